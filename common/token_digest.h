// How sandbox and operator tokens are stored and compared: as SHA-256 digests, so neither the node's database
// nor a proxy's route knowledge ever holds a token itself. Shared by the node (which stores digests) and the
// proxy (which strips the tokens it recognises before a request reaches sandbox code).
#pragma once

#include <string>
#include <string_view>

namespace sg {

// SHA-256 of `token` as 64 lowercase hex digits.
std::string token_digest(std::string_view token);

// Whether `token` hashes to `digest_hex`, compared in constant time (CRYPTO_memcmp) so the time taken says
// nothing about how much of a guess was right. False for an empty digest (no token was ever set).
bool token_matches_digest(std::string_view token, std::string_view digest_hex);

}  // namespace sg
