#include "common/hex.h"

#include <array>

namespace sg {
namespace {

// A table, not comparisons: random digits and letters make those branches mispredict about every other
// character, and the proxy decodes two TLS secrets per handshake (proxy/ktls.cc).
constexpr auto kNibbles = [] {
  std::array<signed char, 256> t{};
  t.fill(-1);
  for (int c = '0'; c <= '9'; ++c) t[c] = static_cast<signed char>(c - '0');
  for (int c = 'a'; c <= 'f'; ++c) t[c] = static_cast<signed char>(c - 'a' + 10);
  for (int c = 'A'; c <= 'F'; ++c) t[c] = static_cast<signed char>(c - 'A' + 10);
  return t;
}();

int nibble(char c) { return kNibbles[static_cast<unsigned char>(c)]; }

}  // namespace

void hex_append(std::span<const unsigned char> bytes, std::string& out) {
  static constexpr char kDigits[] = "0123456789abcdef";
  out.reserve(out.size() + 2 * bytes.size());
  for (unsigned char b : bytes) {
    out += kDigits[b >> 4];
    out += kDigits[b & 0xf];
  }
}

std::string hex_encode(std::span<const unsigned char> bytes) {
  std::string out;
  hex_append(bytes, out);
  return out;
}

bool hex_decode(std::string_view hex, std::span<unsigned char> out) {
  if (hex.size() != 2 * out.size()) return false;
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

}  // namespace sg
