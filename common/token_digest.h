// How sandbox and operator tokens are stored and compared: as SHA-256 digests, so neither the node's database
// nor a proxy's route knowledge ever holds a token itself. Shared by the node (which stores digests) and the
// proxy (which strips the tokens it recognises before a request reaches sandbox code).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace sg {

using TokenDigest = std::array<unsigned char, 32>;

// SHA-256 of `token`, nullopt only when OpenSSL fails (out of memory). With the digest fetched once and a
// context per thread: no provider lookup, lock or allocation per call, since the proxy hashes the credential
// of every request it forwards.
std::optional<TokenDigest> token_sha256(std::string_view token);
// 64 hex digits (token_digest's form, either case) as bytes; nullopt for anything else.
std::optional<TokenDigest> parse_token_digest(std::string_view hex);

// SHA-256 of `token` as 64 lowercase hex digits.
std::string token_digest(std::string_view token);

// Whether `token` hashes to `digest_hex`, compared in constant time (CRYPTO_memcmp) so the time taken says
// nothing about how much of a guess was right. False for an empty digest (no token was ever set).
bool token_matches_digest(std::string_view token, std::string_view digest_hex);
// The same for a token already hashed and hex-encoded (token_digest's form): one hash of a presented token
// checks it against several digests.
bool hex_digest_matches(std::string_view presented_hex, std::string_view digest_hex);

}  // namespace sg
