#include "common/hex.h"

namespace sg {
namespace {

int nibble(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

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
