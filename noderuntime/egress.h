// Outbound network access of sandboxes (`allow_internet_access`, `allow_out`, `deny_out`): a process
// sandbox's namespace, or the one a QEMU runs in (its slirp's sockets are the guest's traffic); the drivers
// reach it through noderuntime/sandbox_egress.h.
//
// A sandbox without internet access has only its loopback (its own network namespace, nothing else). One
// with it gets a veth pair: `eth0` inside with the address of its slot in the node's egress subnet and a
// default route to the node's bridge, the host end a port of that bridge. Bridge ports are isolated from
// each other (no sandbox reaches another), and the node's nftables table `inet <table>`:
//   - drops what a sandbox sends to the host itself (the node API, the proxy, anything on the host) except
//     replies on connections the host opened;
//   - sends what a sandbox forwards through its own chain: the node's always-denied nets (link-local: cloud
//     metadata endpoints) and the sandbox's `deny_out` are dropped; then, with an `allow_out` list, only its
//     entries are accepted, without one everything else is;
//   - masquerades the subnet on the way out of any other interface.
// The host must forward IPv4 (the node sets net.ipv4.ip_forward=1 when the first sandbox attaches, as Docker
// does). IPv4 only: a sandbox gets no IPv6 route.
//
// The rules and links stay in the kernel while the sandbox runs, so a restarted node finds them as they were;
// detach() removes one sandbox's, teardown() everything (tests).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/egress_rule.h"
#include "common/error.h"

namespace sg {

inline constexpr size_t kMaxEgressRules = 64;  // per list, per sandbox

struct EgressPolicy {
  bool internet = false;
  std::vector<EgressRule> allow_out;  // empty: everything not denied
  std::vector<EgressRule> deny_out;
};
// The lists as given by a user (API / CLI): parsed, bounded, and refused when given without internet access.
Result<EgressPolicy> make_egress_policy(bool internet, const std::vector<std::string>& allow_out,
                                        const std::vector<std::string>& deny_out);

struct EgressOptions {
  std::string bridge = "sgbr0";
  std::string table = "sandgate";  // nftables table (family inet)
  // The subnet sandboxes get addresses from; the bridge takes .1, slot N takes .N+2.
  EgressRule subnet{0x0AC80000, 16, 0};  // 10.200.0.0/16
  // Dropped for every sandbox, whatever its lists say.
  std::vector<EgressRule> always_deny{{0xA9FE0000, 16, 0}};  // 169.254.0.0/16: link-local, metadata endpoints
};

class Egress {
 public:
  // Creates the bridge (with the gateway address) and the table if they are missing; idempotent.
  static Result<std::unique_ptr<Egress>> create(EgressOptions options);

  // The sandbox's address ("10.200.0.7") once its namespace (`netns_path`, e.g. /proc/PID/ns/net) has eth0 and
  // its route, and its chain is in place. `slot` is the sandbox's stable index on this node (its uid slot):
  // it names the host interface and the chain, so a restarted node finds them again. Attaching a slot that
  // is attached replaces its links and rules.
  Result<std::string> attach(uint32_t slot, const std::string& netns_path, const EgressPolicy& policy);
  // Removes the slot's host interface and chain; nothing attached is not an error.
  Status detach(uint32_t slot);
  // Removes the bridge and the table (tests, uninstall).
  Status teardown();

  std::string address_of(uint32_t slot) const;
  std::string gateway() const;
  size_t max_slots() const;

 private:
  explicit Egress(EgressOptions options) : options_(std::move(options)) {}
  std::string host_interface(uint32_t slot) const;
  std::string chain_rules(uint32_t slot, const EgressPolicy& policy) const;

  EgressOptions options_;
  bool forwarding_enabled_ = false;
};

}  // namespace sg
