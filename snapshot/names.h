// The names and paths the store accepts from untrusted input (image names, paths inside an image). Pure
// string checks in a library of their own, so the parsers of requests that carry them (the node API's
// bodies, noderuntime/api_request.h) use them without linking the store.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "common/error.h"

namespace sg::snapshot {

inline constexpr size_t kMaxNameLength = 128;

// [A-Za-z0-9][A-Za-z0-9._:-]* up to kMaxNameLength: a file name and a URL path segment as it is.
Status check_image_name(std::string_view name);

// `path` without "." and empty components: "./a//b/" -> "a/b", "" for the root. nullopt for an absolute path,
// and for a ".." unless `resolve_dotdot`, which then resolves it but never above the root ("a/../b" -> "b",
// "../b" -> nullopt).
std::optional<std::string> normalize_relative(std::string_view path, bool resolve_dotdot);

}  // namespace sg::snapshot
