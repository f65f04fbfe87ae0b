// The node's egress (noderuntime/egress.h) as the drivers use it: one per node, made in main.cc and handed
// to every driver that gives sandboxes internet access (the process driver, the QEMU driver), so they share
// one bridge, one nftables table and one slot space. A sandbox's slot is its uid slot (SandboxSpec::uid_base,
// allocated by the node for every sandbox whatever its driver), which is stable across restarts and unique
// on the node, so a restarted node finds the slot's interface and chain again.
//
// The bridge and table are made when the first sandbox with internet access attaches: a node whose
// sandboxes have none never touches the host's networking.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "config/config.h"
#include "noderuntime/egress.h"
#include "noderuntime/sandbox.h"

namespace sg {

class SandboxEgress {
 public:
  explicit SandboxEgress(const NodeConfig& cfg);

  // Gives the network namespace at `netns_path` (e.g. /proc/PID/ns/net) its eth0 and route and the
  // sandbox's chain: node.deny_out, spec.deny_out and spec.allow_out. Attaching again (a new namespace
  // after a restore) replaces the slot's links and rules.
  Status attach(const SandboxSpec& spec, const std::string& netns_path);
  // Removes the slot's interface and chain. Failures are logged: a terminate goes on regardless. Nothing
  // to do for a sandbox without internet access.
  void detach(const SandboxSpec& spec);

 private:
  Result<Egress*> egress();
  uint32_t slot(const SandboxSpec& spec) const { return (spec.uid_base - uid_range_base_) / kUidRangeSize; }

  EgressOptions options_;
  uint32_t uid_range_base_;
  std::vector<std::string> node_deny_out_;
  std::unique_ptr<Egress> egress_;
};

}  // namespace sg
