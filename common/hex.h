// Hex: digests, keys and random ids as text. Written lowercase; read in either case.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace sg {

std::string hex_encode(std::span<const unsigned char> bytes);
void hex_append(std::span<const unsigned char> bytes, std::string& out);
// Exactly out.size() bytes from 2 * out.size() hex digits; false for anything else. On false `out` may
// hold part of the bytes: a caller decoding a secret wipes it.
bool hex_decode(std::string_view hex, std::span<unsigned char> out);

}  // namespace sg
