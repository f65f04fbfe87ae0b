// Runs a short-lived system tool (ip, nft) to completion and captures what it printed: for the node's few
// setup steps that Debian's own tools do better than hand-written netlink. Blocking, so only for calls that
// take milliseconds; each has a deadline, after which the tool is killed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace sg {

// Runs `argv` (argv[0] looked up in PATH) with `input` written to its stdin (then closed) and returns its
// stdout when it exits 0. Otherwise kIo (could not start), kTimeout (killed at the deadline) or
// kUnavailable (exited non-zero / by a signal), the message naming the command and ending with its stderr.
// Output beyond kMaxToolOutputBytes per stream is dropped.
inline constexpr size_t kMaxToolOutputBytes = 1 << 20;
Result<std::string> run_tool(const std::vector<std::string>& argv, std::string_view input = {},
                             int timeout_ms = 10'000);

}  // namespace sg
