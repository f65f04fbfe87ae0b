// JSON written straight into a string, for the lines and bodies the daemons write on hot paths (the access
// log, the activity report) where building an nlohmann tree first costs more than the writing.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace sg {

// `s` as a JSON string, quotes included. Escapes what JSON requires; a byte sequence that is not UTF-8
// (a client's SNI or Host may hold anything) becomes U+FFFD, one per invalid byte, so the output is
// always valid JSON in valid UTF-8.
void append_json_string(std::string& out, std::string_view s);
void append_json_number(std::string& out, uint64_t n);
// A finite double in its shortest form that reads back the same; NaN and infinities as null.
void append_json_double(std::string& out, double d);

}  // namespace sg
