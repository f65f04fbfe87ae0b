#include "common/base64.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

// RFC 4648's test vectors: padding for every remainder, and no line break however long the input.
TEST(Base64, EncodesTheRfcVectorsWithPaddingAndNoLineBreaks) {
  EXPECT_EQ(base64_encode(""), "");
  EXPECT_EQ(base64_encode("f"), "Zg==");
  EXPECT_EQ(base64_encode("fo"), "Zm8=");
  EXPECT_EQ(base64_encode("foo"), "Zm9v");
  EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
  EXPECT_EQ(base64_encode(std::string("\0\xff", 2)), "AP8=");
  const std::string long_one = base64_encode(std::string(3000, 'x'));
  EXPECT_EQ(long_one.size(), 4000u);
  EXPECT_EQ(long_one.find('\n'), std::string::npos);
}

}  // namespace
}  // namespace sg
