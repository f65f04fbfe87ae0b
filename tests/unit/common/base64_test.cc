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

TEST(Base64, DecodesWhatItEncodesAndRefusesTheRest) {
  for (std::string bytes : {std::string(), std::string("f"), std::string("fo"), std::string("foo"),
                            std::string("\0\xff\x10", 3), std::string(1000, 'q')}) {
    auto back = base64_decode(base64_encode(bytes));
    ASSERT_TRUE(back) << back.message();
    EXPECT_EQ(*back, bytes);
  }
  EXPECT_FALSE(base64_decode("Zg="));     // a length that is not a multiple of 4
  EXPECT_FALSE(base64_decode("Zm9v\n"));  // a line break
  EXPECT_FALSE(base64_decode(" Zm9"));    // whitespace, which OpenSSL would skip
  EXPECT_FALSE(base64_decode("Zm9*"));
}

}  // namespace
}  // namespace sg
