// Standard base64 (RFC 4648, with padding, no line breaks) through OpenSSL: what etcd's JSON gateway
// expects for keys and values, and what a QEMU guest's identity line carries (one field, no spaces).
#pragma once

#include <string>
#include <string_view>

namespace sg {

std::string base64_encode(std::string_view bytes);

}  // namespace sg
