#include "noderuntime/egress.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "common/fd.h"
#include "common/subprocess.h"

namespace sg {
namespace {

Status run(std::vector<std::string> argv, std::string_view input = {}) {
  auto out = run_tool(std::move(argv), input);
  if (!out) return out.failure();
  return {};
}

bool interface_exists(const std::string& name) { return bool(run_tool({"ip", "link", "show", "dev", name})); }

// nft's match for one rule: the network, and for a port rule both transport protocols.
std::vector<std::string> matches(const EgressRule& r) {
  const std::string net = "ip daddr " + r.to_string().substr(0, r.to_string().find(':'));
  if (r.port == 0) return {net};
  const std::string port = std::to_string(r.port);
  return {net + " tcp dport " + port, net + " udp dport " + port};
}

}  // namespace

Result<EgressPolicy> make_egress_policy(bool internet, const std::vector<std::string>& allow_out,
                                        const std::vector<std::string>& deny_out) {
  EgressPolicy policy;
  policy.internet = internet;
  if (!internet && (!allow_out.empty() || !deny_out.empty()))
    return fail(Error::kInvalidArgument, "allow_out and deny_out need allow_internet_access");
  for (auto [list, into] : {std::pair{&allow_out, &policy.allow_out}, std::pair{&deny_out, &policy.deny_out}}) {
    if (list->size() > kMaxEgressRules)
      return fail(Error::kLimitExceeded, "at most " + std::to_string(kMaxEgressRules) + " egress rules per list");
    for (const std::string& text : *list) {
      auto rule = parse_egress_rule(text);
      if (!rule) return rule.failure();
      into->push_back(*rule);
    }
  }
  return policy;
}

Result<std::unique_ptr<Egress>> Egress::create(EgressOptions options) {
  if (options.bridge.empty() || options.bridge.size() > 8)
    return fail(Error::kInvalidArgument, "egress bridge name must be 1-8 characters (its ports add a suffix)");
  if (options.subnet.prefix < 8 || options.subnet.prefix > 28)
    return fail(Error::kInvalidArgument, "egress subnet prefix must be 8-28");
  std::unique_ptr<Egress> egress(new Egress(std::move(options)));
  const EgressOptions& o = egress->options_;
  if (!interface_exists(o.bridge)) {
    if (auto st = run({"ip", "link", "add", o.bridge, "type", "bridge"}); !st) return st.failure();
  }
  if (auto st = run({"ip", "addr", "replace", egress->gateway() + "/" + std::to_string(o.subnet.prefix), "dev", o.bridge});
      !st)
    return st.failure();
  if (auto st = run({"ip", "link", "set", o.bridge, "up"}); !st) return st.failure();

  const std::string br = "\"" + o.bridge + "\"";
  const std::string subnet = o.subnet.to_string();
  // `add` is idempotent in nft; the base chains are flushed and refilled so an older node's rules never stay.
  std::string ruleset =
      "add table inet " + o.table + "\n" +
      "add map inet " + o.table + " sandboxes { type ipv4_addr : verdict; }\n" +
      "add chain inet " + o.table + " forward { type filter hook forward priority filter; policy accept; }\n" +
      "add chain inet " + o.table + " input { type filter hook input priority filter; policy accept; }\n" +
      "add chain inet " + o.table + " postrouting { type nat hook postrouting priority srcnat; policy accept; }\n" +
      "flush chain inet " + o.table + " forward\n" + "flush chain inet " + o.table + " input\n" +
      "flush chain inet " + o.table + " postrouting\n" +
      // From a sandbox: only from its own address, through its own chain; a spoofed source matches nothing.
      "add rule inet " + o.table + " forward iifname " + br + " ip saddr vmap @sandboxes\n" +
      "add rule inet " + o.table + " forward iifname " + br + " drop\n" +
      "add rule inet " + o.table + " forward oifname " + br + " ct state established,related accept\n" +
      "add rule inet " + o.table + " forward oifname " + br + " drop\n" +
      "add rule inet " + o.table + " input iifname " + br + " ct state established,related accept\n" +
      "add rule inet " + o.table + " input iifname " + br + " drop\n" +
      "add rule inet " + o.table + " postrouting ip saddr " + subnet + " oifname != " + br + " masquerade\n";
  if (auto st = run({"nft", "-f", "-"}, ruleset); !st) return st.failure();
  return egress;
}

std::string Egress::address_of(uint32_t slot) const { return ipv4_text(options_.subnet.network + slot + 2); }
std::string Egress::gateway() const { return ipv4_text(options_.subnet.network + 1); }
size_t Egress::max_slots() const { return (size_t{1} << (32 - options_.subnet.prefix)) - 3; }
std::string Egress::host_interface(uint32_t slot) const { return options_.bridge + "v" + std::to_string(slot); }

std::string Egress::chain_rules(uint32_t slot, const EgressPolicy& policy) const {
  const std::string chain = "inet " + options_.table + " sb" + std::to_string(slot);
  std::string out = "add chain " + chain + "\nflush chain " + chain + "\n";
  for (const auto* list : {&options_.always_deny, &policy.deny_out})
    for (const EgressRule& r : *list)
      for (const std::string& m : matches(r)) out += "add rule " + chain + " " + m + " drop\n";
  if (policy.allow_out.empty()) {
    out += "add rule " + chain + " accept\n";
  } else {
    for (const EgressRule& r : policy.allow_out)
      for (const std::string& m : matches(r)) out += "add rule " + chain + " " + m + " accept\n";
    out += "add rule " + chain + " drop\n";
  }
  out += "add element inet " + options_.table + " sandboxes { " + address_of(slot) + " : jump sb" +
         std::to_string(slot) + " }\n";
  return out;
}

Result<std::string> Egress::attach(uint32_t slot, const std::string& netns_path, const EgressPolicy& policy) {
  if (!policy.internet) return fail(Error::kInvalidArgument, "attach: the sandbox has no internet access");
  if (slot >= max_slots())
    return fail(Error::kLimitExceeded, "egress slot " + std::to_string(slot) + " is outside the subnet");
  if (!forwarding_enabled_) {
    UniqueFd fd(::open("/proc/sys/net/ipv4/ip_forward", O_WRONLY | O_CLOEXEC));
    if (!fd.valid() || ::write(fd.get(), "1", 1) != 1) return fail_errno("enable net.ipv4.ip_forward", errno);
    forwarding_enabled_ = true;
  }
  const std::string host_if = host_interface(slot);
  if (interface_exists(host_if)) {
    // The kernel tears down a dead namespace's veth asynchronously (a QEMU killed just before its retry or
    // restore): an end that went by itself in between is what the delete wanted.
    if (auto st = run({"ip", "link", "del", host_if}); !st && interface_exists(host_if)) return st.failure();
  }
  // Made inside the sandbox's namespace, the peer sent out to ours: eth0 never exists on the host.
  if (auto st = run({"nsenter", "--net=" + netns_path, "ip", "link", "add", "eth0", "type", "veth", "peer", "name",
                     host_if, "netns", std::to_string(::getpid())});
      !st)
    return st.failure();
  const std::string address = address_of(slot);
  // Rules first: the sandbox's traffic has a chain before it has a route.
  if (auto st = run({"nft", "-f", "-"}, chain_rules(slot, policy)); !st) return st.failure();
  if (auto st = run({"ip", "link", "set", host_if, "master", options_.bridge}); !st) return st.failure();
  // An isolated port talks only to the bridge itself, never to another sandbox's port.
  if (auto st = run({"ip", "link", "set", host_if, "type", "bridge_slave", "isolated", "on"}); !st) return st.failure();
  if (auto st = run({"ip", "link", "set", host_if, "up"}); !st) return st.failure();
  const std::string inside = "addr add " + address + "/" + std::to_string(options_.subnet.prefix) +
                             " dev eth0\nlink set eth0 up\nroute add default via " + gateway() + "\n";
  if (auto st = run({"nsenter", "--net=" + netns_path, "ip", "-batch", "-"}, inside); !st) return st.failure();
  return address;
}

Status Egress::detach(uint32_t slot) {
  const std::string host_if = host_interface(slot);
  // Deleting the host end deletes the pair.
  if (interface_exists(host_if)) {
    if (auto st = run({"ip", "link", "del", host_if}); !st) return st;
  }
  // Each step alone: one that finds nothing to delete must not keep the next from running.
  (void)run({"nft", "delete", "element", "inet", options_.table, "sandboxes", "{", address_of(slot), "}"});
  (void)run({"nft", "delete", "chain", "inet", options_.table, "sb" + std::to_string(slot)});
  return {};
}

Status Egress::teardown() {
  // Its ports first: a port whose sandbox namespace is still alive would outlive the bridge.
  if (auto ports = run_tool({"ip", "-o", "link", "show", "master", options_.bridge}); ports) {
    size_t at = 0;
    while ((at = ports->find(": ", at)) != std::string::npos) {
      const size_t end = ports->find_first_of("@:", at + 2);
      const std::string name = ports->substr(at + 2, end - at - 2);
      at = ports->find('\n', at);
      if (name.rfind(options_.bridge + "v", 0) == 0) (void)run({"ip", "link", "del", name});
      if (at == std::string::npos) break;
    }
  }
  if (interface_exists(options_.bridge)) {
    if (auto st = run({"ip", "link", "del", options_.bridge}); !st) return st;
  }
  (void)run({"nft", "delete", "table", "inet", options_.table});
  return {};
}

}  // namespace sg
