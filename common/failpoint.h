// Failpoints: named places in the daemons where a test has the process killed with SIGKILL, as a crash or a
// `kill -9` would, to show that what was persisted before that point is enough to recover from. Armed only by
// the environment variable SANDGATE_FAILPOINTS (comma-separated names), read once at the first check; when
// it is unset, each check costs one branch on a bool. The names in use: docs/tests.md#failpoints.
#pragma once

#include <string_view>

namespace sg {

// Whether any failpoint is armed: callers that build a name check this first.
bool failpoints_armed();
// If `name` is armed: one line on stderr ("failpoint NAME: SIGKILL"), then SIGKILL to this process.
void failpoint(std::string_view name);

}  // namespace sg
