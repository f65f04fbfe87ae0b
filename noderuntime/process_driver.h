// The process-tree driver, the node's embedded default: each sandbox is a process tree under sandgate-init
// in its own PID, mount, network, UTS and IPC namespaces, confined and frozen through per-sandbox cgroups
// (noderuntime/cgroup.h). Sandboxes survive the node process; a restarted node adopts them by pid + start
// time (RuntimeInfo).
#pragma once

#include <uv.h>

#include <memory>

#include "common/error.h"
#include "config/config.h"
#include "noderuntime/driver.h"

namespace sg {

// Detects the host's cgroup layout and captures the host network namespace. The driver keeps `loop`; it
// copies what it needs from `cfg`.
Result<std::unique_ptr<Driver>> make_process_driver(uv_loop_t* loop, const NodeConfig& cfg);

}  // namespace sg
