#include "common/token_digest.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

namespace sg {

std::string token_digest(std::string_view token) {
  static constexpr char kHex[] = "0123456789abcdef";
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // EVP_Digest with SHA-256 cannot fail short of memory exhaustion; an empty result then never matches.
  if (EVP_Digest(token.data(), token.size(), md, &len, EVP_sha256(), nullptr) != 1) return {};
  std::string hex;
  hex.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    hex += kHex[md[i] >> 4];
    hex += kHex[md[i] & 15];
  }
  return hex;
}

bool token_matches_digest(std::string_view token, std::string_view digest_hex) {
  std::string presented = token_digest(token);
  // The lengths are public (always 64 for a stored digest); only the contents are compared in constant time.
  if (digest_hex.empty() || presented.size() != digest_hex.size()) return false;
  return CRYPTO_memcmp(presented.data(), digest_hex.data(), presented.size()) == 0;
}

}  // namespace sg
