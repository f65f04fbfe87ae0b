// The process-tree driver, the node's embedded default: each sandbox is a process tree under sandgate-init
// in its own PID, mount, network, UTS, IPC, cgroup and user namespaces, on a root filesystem made from its
// image (an overlay of the image's layers), confined and frozen through per-sandbox cgroups
// (noderuntime/cgroup.h). docs/security.md ("Process sandbox boundary") has the whole picture. Sandboxes survive the node process; a restarted node adopts them by pid + start
// time (RuntimeInfo).
#pragma once

#include <uv.h>

#include <memory>

#include "common/error.h"
#include "config/config.h"
#include "noderuntime/driver.h"

namespace sg {

namespace snapshot {
class ImageStore;
}
class SandboxEgress;

// Detects the host's cgroup layout and captures the host network namespace. The driver keeps `loop`,
// `images` (where each sandbox's SandboxSpec::image is looked up at start) and `egress` (the node's, which
// attaches sandboxes with internet access; null refuses them); both must outlive the driver. It copies what
// it needs from `cfg`.
Result<std::unique_ptr<Driver>> make_process_driver(uv_loop_t* loop, const NodeConfig& cfg,
                                                    snapshot::ImageStore* images, SandboxEgress* egress = nullptr);

}  // namespace sg
