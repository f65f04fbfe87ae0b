// read_operator_token: the one reader of operator_token_file, used by both the node and the proxy.
#include "common/operator_token.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

namespace sg {
namespace {

class OperatorTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sgtest-optoken-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/operator.token";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& content, mode_t mode) {
    std::ofstream(path_, std::ios::trunc) << content;
    ASSERT_EQ(::chmod(path_.c_str(), mode), 0);
  }

  std::string dir_;
  std::string path_;
};

TEST_F(OperatorTokenTest, NoFileConfiguredIsNoToken) {
  auto t = read_operator_token("");
  ASSERT_TRUE(t.ok()) << t.message();
  EXPECT_EQ(*t, "");
}

TEST_F(OperatorTokenTest, OwnerOnlyFileGivesTheTrimmedToken) {
  for (mode_t mode : {0600, 0400}) {
    write("  op-secret-0123456789\n\n", mode);
    auto t = read_operator_token(path_);
    ASSERT_TRUE(t.ok()) << std::oct << mode << ": " << t.message();
    EXPECT_EQ(*t, "op-secret-0123456789");
  }
}

// The proxy and the node share this check, so the proxy (which before had none) refuses exactly what the node
// refuses: a token group or others can read, write or even execute.
TEST_F(OperatorTokenTest, RefusesAFileGroupOrOthersCanAccess) {
  for (mode_t mode : {0644, 0640, 0604, 0620, 0602, 0610, 0601, 0660}) {
    write("op-secret-0123456789\n", mode);
    auto t = read_operator_token(path_);
    ASSERT_FALSE(t.ok()) << std::oct << mode;
    EXPECT_EQ(t.error(), Error::kPermissionDenied);
    EXPECT_NE(t.message().find("operator_token_file"), std::string::npos) << t.message();
    EXPECT_NE(t.message().find(path_), std::string::npos) << t.message();
    EXPECT_NE(t.message().find("chmod 600"), std::string::npos) << t.message();
  }
}

TEST_F(OperatorTokenTest, RefusesMissingEmptyOversizedAndNonRegularFiles) {
  auto missing = read_operator_token(path_);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("cannot open " + path_), std::string::npos) << missing.message();

  write(" \n\t", 0600);
  auto empty = read_operator_token(path_);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.message().find("holds no token"), std::string::npos) << empty.message();

  write(std::string(kMaxOperatorTokenBytes, 'a'), 0600);
  EXPECT_TRUE(read_operator_token(path_).ok()) << "exactly the limit is allowed";
  write(std::string(kMaxOperatorTokenBytes + 1, 'a'), 0600);
  auto big = read_operator_token(path_);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.message().find("larger than 4096 bytes"), std::string::npos) << big.message();

  auto dir = read_operator_token(dir_);
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.message().find("is not a regular file"), std::string::npos) << dir.message();
}

}  // namespace
}  // namespace sg
