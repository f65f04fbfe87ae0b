// A file that holds a secret the operator configured (the operator token, the session ticket keys), read the
// same way by every daemon: owner-only, a regular file, bounded. The proxy, running as proxy.user, reads them
// with the same rules the root node does.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "common/error.h"

namespace sg {

// The whole of `path`, at most `max_bytes`. Errors, each naming `setting` and the path: cannot open or stat
// it, not a regular file, group or others can access it (kPermissionDenied, with the chmod 600 that fixes
// it), larger than max_bytes.
Result<std::string> read_secret_file(const std::string& path, std::string_view setting, size_t max_bytes);

}  // namespace sg
