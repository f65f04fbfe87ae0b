// read_secret_file: the reader of every secret file the operator configures (operator token, session ticket
// keys): owner-only, regular, bounded, and each refusal names the setting and the path.
#include "common/secret_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

void write_file(const std::string& path, const std::string& content, mode_t mode) {
  std::ofstream(path, std::ios::trunc) << content;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0);
}

TEST(SecretFile, AnOwnerOnlyFileIsReadWhole) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/secret";
  write_file(path, "line one\nline two\n", 0600);
  auto text = read_secret_file(path, "some.setting", 64);
  ASSERT_TRUE(text) << text.message();
  EXPECT_EQ(*text, "line one\nline two\n");
}

TEST(SecretFile, EachRefusalNamesTheSettingAndThePath) {
  testing::TempDir temp;
  const std::string root = temp.path(), path = root + "/secret";
  write_file(path, "secret", 0640);
  auto shared = read_secret_file(path, "some.setting", 64);
  ASSERT_FALSE(shared);
  EXPECT_EQ(shared.error(), Error::kPermissionDenied);
  EXPECT_NE(shared.message().find("some.setting: " + path + " has mode 0640"), std::string::npos) << shared.message();
  EXPECT_NE(shared.message().find("chmod 600 " + path), std::string::npos) << shared.message();

  write_file(path, std::string(65, 'x'), 0600);
  auto big = read_secret_file(path, "some.setting", 64);
  ASSERT_FALSE(big);
  EXPECT_NE(big.message().find("some.setting: " + path + " is larger than 64 bytes"), std::string::npos)
      << big.message();
  write_file(path, std::string(64, 'x'), 0600);
  EXPECT_TRUE(read_secret_file(path, "some.setting", 64)) << "exactly the limit is fine";

  auto dir = read_secret_file(root, "some.setting", 64);
  ASSERT_FALSE(dir);
  EXPECT_NE(dir.message().find("is not a regular file"), std::string::npos) << dir.message();
  auto missing = read_secret_file(root + "/none", "some.setting", 64);
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("some.setting: cannot open " + root + "/none"), std::string::npos)
      << missing.message();
}

}  // namespace
}  // namespace sg
