#include "common/token_digest.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <memory>

#include "common/hex.h"

namespace sg {

std::optional<TokenDigest> token_sha256(std::string_view token) {
  // Fetched once for the process (EVP_sha256() would be looked up in the provider store at every init).
  static EVP_MD* const sha256 = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  struct CtxFree {
    void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
  };
  thread_local std::unique_ptr<EVP_MD_CTX, CtxFree> ctx(EVP_MD_CTX_new());
  TokenDigest out{};
  unsigned int len = 0;
  if (sha256 == nullptr || !ctx || EVP_DigestInit_ex2(ctx.get(), sha256, nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), token.data(), token.size()) != 1 ||
      EVP_DigestFinal_ex(ctx.get(), out.data(), &len) != 1 || len != out.size())
    return std::nullopt;
  return out;
}

std::optional<TokenDigest> parse_token_digest(std::string_view hex) {
  TokenDigest out{};
  if (!hex_decode(hex, out)) return std::nullopt;
  return out;
}

std::string token_digest(std::string_view token) {
  // Cannot fail short of memory exhaustion; an empty result then never matches.
  auto md = token_sha256(token);
  if (!md) return {};
  return hex_encode(*md);
}

bool token_matches_digest(std::string_view token, std::string_view digest_hex) {
  return hex_digest_matches(token_digest(token), digest_hex);
}

bool hex_digest_matches(std::string_view presented_hex, std::string_view digest_hex) {
  // The lengths are public (always 64 for a stored digest); only the contents are compared in constant time.
  if (digest_hex.empty() || presented_hex.size() != digest_hex.size()) return false;
  return CRYPTO_memcmp(presented_hex.data(), digest_hex.data(), presented_hex.size()) == 0;
}

}  // namespace sg
