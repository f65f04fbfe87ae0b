#include "noderuntime/sandbox_egress.h"

#include "common/log.h"

namespace sg {
namespace {

EgressOptions egress_options(const NodeConfig& cfg) {
  EgressOptions options;
  options.bridge = cfg.egress_bridge;
  options.table = cfg.egress_bridge;  // one table per bridge: two nodes on one host keep apart
  if (auto subnet = parse_egress_rule(cfg.egress_subnet)) options.subnet = *subnet;  // checked at config load
  return options;
}

}  // namespace

SandboxEgress::SandboxEgress(const NodeConfig& cfg)
    : options_(egress_options(cfg)), uid_range_base_(cfg.uid_range_base), node_deny_out_(cfg.deny_out) {}

Result<Egress*> SandboxEgress::egress() {
  if (!egress_) {
    auto made = Egress::create(options_);
    if (!made) return fail(made.error(), "internet access: " + made.message());
    egress_ = std::move(*made);
  }
  return egress_.get();
}

Status SandboxEgress::attach(const SandboxSpec& spec, const std::string& netns_path) {
  std::vector<std::string> deny = node_deny_out_;
  deny.insert(deny.end(), spec.deny_out.begin(), spec.deny_out.end());
  auto policy = make_egress_policy(true, spec.allow_out, deny);
  if (!policy) return policy.failure();
  auto e = egress();
  if (!e) return e.failure();
  if (spec.uid_base < uid_range_base_) return fail(Error::kInvalidArgument, "internet access needs a uid slot");
  auto address = (*e)->attach(slot(spec), netns_path, *policy);
  if (!address) return fail(address.error(), "internet access: " + address.message());
  spdlog::info("sandbox {}: internet access as {}", spec.id, *address);
  return {};
}

void SandboxEgress::detach(const SandboxSpec& spec) {
  if (!spec.allow_internet_access || spec.uid_base < uid_range_base_) return;
  auto e = egress();
  if (!e) return spdlog::warn("sandbox {}: {}", spec.id, e.message());
  if (Status st = (*e)->detach(slot(spec)); !st)
    spdlog::warn("sandbox {}: {}", spec.id, st.message());
}

}  // namespace sg
