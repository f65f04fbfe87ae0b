#include "agent/files.h"

#include <gtest/gtest.h>

namespace sg::agent {
namespace {

TEST(PercentDecode, DecodesEscapesAndPlus) {
  EXPECT_EQ(*percent_decode("a%20b%2Bc+d%2f%C3%A9"), "a b+c d/\xc3\xa9");
  EXPECT_EQ(*percent_decode(""), "");
  for (std::string_view bad : {"%", "%2", "%zz", "a%2"}) EXPECT_FALSE(percent_decode(bad).ok()) << bad;
}

TEST(FilePathParam, TakesTheDecodedAbsolutePath) {
  EXPECT_EQ(*file_path_param("/files?path=%2Ftmp%2Fa%20b"), "/tmp/a b");
  EXPECT_EQ(*file_path_param("/files?x=1&path=/etc/hosts&y"), "/etc/hosts");
}

TEST(FilePathParam, RejectsMissingRelativeRepeatedAndNul) {
  for (std::string_view target : {"/files", "/files?", "/files?path=", "/files?path=etc/hosts", "/files?path=/a&path=/b",
                                  "/files?path=/a%00b", "/files?path=%zz"}) {
    auto r = file_path_param(target);
    EXPECT_FALSE(r.ok()) << target;
    if (!r.ok()) {
      EXPECT_EQ(r.error(), Error::kInvalidArgument);
    }
  }
}

}  // namespace
}  // namespace sg::agent
