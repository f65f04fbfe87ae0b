// GET and PUT /files?path=/abs/path: download streamed from the file, upload streamed into a temporary file
// in the same directory and renamed over the target, so readers see the old file or the new one, never a
// partial one.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "agent/handler.h"
#include "common/error.h"

namespace sg::agent {

// RFC 3986 percent-decoding; '+' decodes to a space, as form encoders (Python's urlencode, Go's
// url.Values) write it, so a literal '+' must arrive as %2B.
Result<std::string> percent_decode(std::string_view s);

// The `path` query parameter of a request target: present once, decoded, absolute, without NUL bytes.
Result<std::string> file_path_param(std::string_view target);

// Both answer right away when the request cannot succeed (and return a handler that ignores the body).
std::unique_ptr<Handler> download(const std::string& path, Responder& out);
std::unique_ptr<Handler> upload(const std::string& path, int64_t content_length, uint64_t max_bytes,
                                mode_t new_file_mode, Responder& out);

}  // namespace sg::agent
