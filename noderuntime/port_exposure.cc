#include "noderuntime/port_exposure.h"

#include <algorithm>

namespace sg {

Result<SandboxSpec> with_port_exposed(const SandboxSpec& spec, int64_t port, const ExposeRequest& request,
                                      size_t max_ports) {
  const std::string where = "port " + std::to_string(port);
  if (port < 1 || port > 65535) return fail(Error::kInvalidArgument, where + " is not a TCP port (1-65535)");
  if (auto why = reserved_port(spec, port)) return fail(Error::kInvalidArgument, where + " is " + *why);
  PortPolicy policy{static_cast<uint16_t>(port), request.is_public.value_or(false), PortProtocol::kHttp1};
  if (request.protocol) {
    auto parsed = parse_protocol(*request.protocol);
    if (!parsed)
      return fail(Error::kInvalidArgument, "protocol: '" + *request.protocol + "' is not one of http1, h2c, tcp");
    policy.protocol = *parsed;
  }
  SandboxSpec out = spec;
  auto& exposed = out.exposed_ports;
  if (std::find(exposed.begin(), exposed.end(), policy.port) == exposed.end()) {
    if (exposed.size() >= max_ports)
      return fail(Error::kLimitExceeded, "sandbox " + spec.id + " already exposes " + std::to_string(exposed.size()) +
                                             " ports, the most a sandbox may (close one first)");
    exposed.push_back(policy.port);
  }
  std::erase_if(out.ports, [&](const PortPolicy& p) { return p.port == policy.port; });
  out.ports.push_back(policy);
  return out;
}

Result<SandboxSpec> with_port_closed(const SandboxSpec& spec, int64_t port) {
  SandboxSpec out = spec;
  auto& exposed = out.exposed_ports;
  auto it = port < 1 || port > 65535 ? exposed.end() : std::find(exposed.begin(), exposed.end(), port);
  if (it == exposed.end())
    return fail(Error::kNotFound, "sandbox " + spec.id + " does not expose port " + std::to_string(port));
  exposed.erase(it);
  std::erase_if(out.ports, [&](const PortPolicy& p) { return p.port == port; });
  return out;
}

std::vector<fleet::PortRoute> fleet_port_routes(const SandboxSpec& spec) {
  // The policies the node itself answers with (port_policy): allow_unauthenticated_access included, and
  // the agent's port, which the SDK route reaches.
  // The agent's first: a sandbox with every port exposed still has it within kMaxPublishedPorts.
  std::vector<uint16_t> ports;
  if (spec.agent_port != 0) ports.push_back(spec.agent_port);
  ports.insert(ports.end(), spec.exposed_ports.begin(), spec.exposed_ports.end());
  std::vector<fleet::PortRoute> out;
  for (uint16_t port : ports)
    if (auto p = port_policy(spec, port); p && out.size() < fleet::kMaxPublishedPorts)
      out.push_back(fleet::PortRoute{p->port, std::string(protocol_name(p->protocol)), p->is_public});
  return out;
}

}  // namespace sg
