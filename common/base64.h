// Standard base64 (RFC 4648, with padding, no line breaks) through OpenSSL: what etcd's JSON gateway
// expects for keys and values, and what a QEMU guest's identity line carries (one field, no spaces).
#pragma once

#include <string>
#include <string_view>

#include "common/error.h"

namespace sg {

std::string base64_encode(std::string_view bytes);
// The bytes of standard base64 with padding; kInvalidArgument for anything else (a bad length or character).
Result<std::string> base64_decode(std::string_view text);

}  // namespace sg
