#include "noderuntime/names.h"

#include <openssl/crypto.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <random>

namespace sg {
namespace {

constexpr std::string_view kIdPrefix = "sb-";
constexpr size_t kIdRandomChars = 12;
constexpr std::string_view kIdAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
constexpr size_t kMaxLabel = 63;
constexpr std::string_view kTokenPrefix = "sgt_";
constexpr size_t kTokenRandomBytes = 32;  // 256 bits: unguessable, and beyond any offline search of the digest

bool is_lower_alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Fills `buf` from the kernel CSPRNG. getrandom() only fails before the pool is initialised (blocks
// instead) or on signals (retried); a kernel without it predates our minimum, but std::random_device is
// still a sound fallback rather than a crash.
void fill_random(uint8_t* buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t n = ::getrandom(buf + got, len - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR && errno != EAGAIN) {
      std::random_device rd;
      for (; got < len; ++got) buf[got] = static_cast<uint8_t>(rd());
    }
  }
}

}  // namespace

Status validate_name(std::string_view name) {
  if (name.empty()) return fail(Error::kInvalidArgument, "name must not be empty");
  if (name.size() > kMaxLabel)
    return fail(Error::kInvalidArgument, "name is " + std::to_string(name.size()) +
                                             " characters long; a DNS label allows at most 63");
  for (char c : name) {
    if (c >= 'A' && c <= 'Z')
      return fail(Error::kInvalidArgument,
                  "name must be lowercase (host names are case-insensitive, so 'A' and 'a' would collide)");
    if (!is_lower_alnum(c) && c != '-') {
      char shown[16];
      if (c >= 0x21 && c <= 0x7e) {
        std::snprintf(shown, sizeof shown, "'%c'", c);
      } else {
        std::snprintf(shown, sizeof shown, "byte 0x%02x", static_cast<unsigned char>(c));
      }
      return fail(Error::kInvalidArgument,
                  std::string("name contains ") + shown + "; only a-z, 0-9 and '-' are allowed");
    }
  }
  if (name.front() == '-' || name.back() == '-')
    return fail(Error::kInvalidArgument, "name must not start or end with '-' (DNS label rules)");
  // "xn--" style labels are punycode A-labels: browsers decode them, so the name would not round-trip.
  if (name.size() >= 4 && name[2] == '-' && name[3] == '-')
    return fail(Error::kInvalidArgument,
                "name must not have '--' in the third and fourth characters (reserved for internationalized "
                "domain names such as xn--)");
  if (looks_like_id(name))
    return fail(Error::kInvalidArgument,
                "name looks like a sandbox id (sb- followed by 12 characters); ids and names share one namespace");
  if (name == "api") return fail(Error::kInvalidArgument, "name 'api' is reserved for the node API host");
  size_t digits = 0;
  while (digits < name.size() && is_digit(name[digits])) ++digits;
  if (digits > 0 && digits < name.size() && name[digits] == '-')
    return fail(Error::kInvalidArgument, "name must not start with digits followed by '-': '<port>-<name>' is the "
                                         "port-route syntax, so '" + std::string(name) + "' would be ambiguous");
  return {};
}

std::string generate_id() {
  // Rejection sampling keeps every character equally likely: 252 = 7 * 36 is the largest multiple below 256.
  constexpr uint8_t kUnbiasedLimit = 252;
  std::string id(kIdPrefix);
  uint8_t buf[32];
  while (id.size() < kIdPrefix.size() + kIdRandomChars) {
    fill_random(buf, sizeof buf);
    for (uint8_t b : buf) {
      if (b >= kUnbiasedLimit) continue;
      id += kIdAlphabet[b % kIdAlphabet.size()];
      if (id.size() == kIdPrefix.size() + kIdRandomChars) break;
    }
  }
  return id;
}

std::string generate_token() {
  static constexpr char kBase64Url[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  uint8_t raw[kTokenRandomBytes];
  fill_random(raw, sizeof raw);
  std::string token(kTokenPrefix);
  uint32_t bits = 0;
  int nbits = 0;
  for (uint8_t b : raw) {
    bits = (bits << 8) | b;
    nbits += 8;
    while (nbits >= 6) {
      nbits -= 6;
      token += kBase64Url[(bits >> nbits) & 63];
    }
  }
  if (nbits > 0) token += kBase64Url[(bits << (6 - nbits)) & 63];
  OPENSSL_cleanse(raw, sizeof raw);
  return token;
}

bool looks_like_id(std::string_view s) {
  if (s.size() != kIdPrefix.size() + kIdRandomChars || !s.starts_with(kIdPrefix)) return false;
  for (char c : s.substr(kIdPrefix.size()))
    if (!is_lower_alnum(c)) return false;
  return true;
}

}  // namespace sg
