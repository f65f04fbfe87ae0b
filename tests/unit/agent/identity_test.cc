#include "agent/identity.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/random.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "tests/unit/temp_dir.h"

namespace sg::agent {
namespace {

class IdentityTest : public ::testing::Test {
 protected:
  std::string write(const std::string& text) {
    std::string path = dir_.path() + "/id";
    std::ofstream(path) << text;
    return path;
  }
  sg::testing::TempDir dir_{"identity"};
};

TEST_F(IdentityTest, TheIdIsTheFirstLineWhenItIsAnIdAndNothingOtherwise) {
  EXPECT_EQ(sandbox_identity(write("sb-abc123\n").c_str()), "sb-abc123");
  EXPECT_EQ(sandbox_identity(write("sb-abc123\nmore\n").c_str()), "sb-abc123");
  EXPECT_EQ(sandbox_identity(write("").c_str()), "");
  EXPECT_EQ(sandbox_identity(write("sb abc\n").c_str()), "");  // a space: not an id
  EXPECT_EQ(sandbox_identity(write("<script>\n").c_str()), "");
  EXPECT_EQ(sandbox_identity(write(std::string(65, 'a')).c_str()), "");
  EXPECT_EQ(sandbox_identity((dir_.path() + "/missing").c_str()), "");
}

TEST(SeedTest, ASeedIsAnEvenRunOfHexDigitsWithinItsBounds) {
  auto ok = decode_seed("00ff10Ab0123cdef");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(*ok, std::string("\x00\xff\x10\xab\x01\x23\xcd\xef", 8));
  EXPECT_FALSE(decode_seed("abc"));                   // odd
  EXPECT_FALSE(decode_seed("0011223344556677zz"));    // not hex
  EXPECT_FALSE(decode_seed("00112233"));              // too short to be a seed
  auto long_seed = decode_seed(std::string(2 * kMaxSeedBytes + 2, 'a'));
  ASSERT_FALSE(long_seed);
  EXPECT_EQ(long_seed.error(), Error::kInvalidArgument);
  EXPECT_NE(long_seed.message().find("256 bytes"), std::string::npos) << long_seed.message();
}

TEST(SeedTest, AReseedIsAcceptedByTheKernelWhenRootAndRefusedForAMalformedSeed) {
  EXPECT_EQ(reseed_rng("xyz").error(), Error::kInvalidArgument);
  if (::geteuid() != 0) GTEST_SKIP() << "RNDADDENTROPY and RNDRESEEDCRNG need CAP_SYS_ADMIN";
  // Real random bytes: the host's pool is credited with what it is given, so it gets nothing predictable.
  unsigned char bytes[32];
  ASSERT_EQ(::getrandom(bytes, sizeof bytes, 0), static_cast<ssize_t>(sizeof bytes));
  std::string hex;
  for (unsigned char b : bytes) hex += {"0123456789abcdef"[b >> 4], "0123456789abcdef"[b & 15]};
  Status s = reseed_rng(hex);
  EXPECT_TRUE(s) << s.message();
}

}  // namespace
}  // namespace sg::agent
