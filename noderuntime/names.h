// Sandbox names, ids and access tokens. Both appear in host names (<port>-<name|id>.<domain>) and in API paths
// (/v1/sandboxes/{ref}), so a name must be a DNS label that can never be mistaken for an id, a port
// prefix, or a reserved host.
#pragma once

#include <string>
#include <string_view>

#include "common/error.h"

namespace sg {

// kInvalidArgument with a message saying which rule the name breaks.
Status validate_name(std::string_view name);

// "sb-" + 12 random characters of [a-z0-9] (~62 bits), from getrandom().
std::string generate_id();

// A sandbox access token: "sgt_" + 32 random bytes (getrandom) in unpadded base64url (43 characters).
std::string generate_token();

// True for strings shaped like an id ("sb-" + 12 of [a-z0-9]), whether or not such a sandbox exists.
bool looks_like_id(std::string_view s);

}  // namespace sg
