// The operator token file (Config::operator_token_file), read the same way by sandgate-node and
// sandgate-proxy: one token, owner-only. Kept in one place so the two daemons can never disagree about which
// file is acceptable (the proxy, running as proxy.user, reads it with the same rules the root node does).
#pragma once

#include <cstddef>
#include <string>

#include "common/error.h"

namespace sg {

// The file holds one token; anything larger is not what the operator meant to configure.
inline constexpr size_t kMaxOperatorTokenBytes = 4096;

// The token in `path`, surrounding whitespace trimmed; "" when `path` is empty (no operator token
// configured). Errors, each naming operator_token_file and the path: cannot open or stat it, not a regular
// file, group or others can access it (kPermissionDenied, with the chmod 600 that fixes it), larger than
// kMaxOperatorTokenBytes, or no token in it.
Result<std::string> read_operator_token(const std::string& path);

}  // namespace sg
