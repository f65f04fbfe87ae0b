#include "common/hex.h"

#include <gtest/gtest.h>

#include <array>

namespace sg {
namespace {

TEST(Hex, EncodesLowercaseAndDecodesEitherCase) {
  const std::array<unsigned char, 4> bytes{0x00, 0x9f, 0xa0, 0xff};
  EXPECT_EQ(hex_encode(bytes), "009fa0ff");
  std::string out = "prefix:";
  hex_append(bytes, out);
  EXPECT_EQ(out, "prefix:009fa0ff");
  EXPECT_EQ(hex_encode({}), "");

  std::array<unsigned char, 4> back{};
  ASSERT_TRUE(hex_decode("009FA0ff", back));
  EXPECT_EQ(back, bytes);
}

TEST(Hex, DecodeRefusesAWrongLengthOrANonHexDigit) {
  std::array<unsigned char, 2> out{};
  EXPECT_FALSE(hex_decode("abc", out)) << "odd";
  EXPECT_FALSE(hex_decode("abcdef", out)) << "longer than asked";
  EXPECT_FALSE(hex_decode("ab", out)) << "shorter than asked";
  EXPECT_FALSE(hex_decode("abcg", out));
  EXPECT_FALSE(hex_decode("ab c", out));
  EXPECT_FALSE(hex_decode("0x12", out));
  EXPECT_TRUE(hex_decode("", std::span<unsigned char>{}));
}

TEST(Hex, EveryCharacterIsADigitExactlyWhenItIsOne) {
  for (int c = 0; c < 256; ++c) {
    const bool digit = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
    for (int at = 0; at < 2; ++at) {
      std::string text = "00";
      text[static_cast<size_t>(at)] = static_cast<char>(c);
      std::array<unsigned char, 1> out{};
      ASSERT_EQ(hex_decode(text, out), digit) << c;
      if (!digit) continue;
      const int value = c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
      EXPECT_EQ(out[0], at == 0 ? value << 4 : value) << c;
    }
  }
}

}  // namespace
}  // namespace sg
