// Ports opened or closed on a sandbox after its create (PUT / DELETE /v1/sandboxes/{ref}/ports/{port}): the
// change to its spec, checked the way a create checks its ports. The node applies it (node.cc) once the driver
// forwards the port; the proxy learns of it from the node's route events.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fleet_directory.h"
#include "noderuntime/sandbox.h"

namespace sg {

// The port's whole policy, as a PUT gives it: what is absent takes the create's defaults (private, http1).
struct ExposeRequest {
  std::optional<bool> is_public;
  std::optional<std::string> protocol;  // http1, h2c or tcp
};

// `spec` with `port` exposed under `request`'s policy; a port already exposed takes the new policy.
// kInvalidArgument for a port outside 1-65535, the agent's port or an unknown protocol; kLimitExceeded past
// `max_ports` exposed ports.
Result<SandboxSpec> with_port_exposed(const SandboxSpec& spec, int64_t port, const ExposeRequest& request,
                                      size_t max_ports);
// `spec` without `port`; kNotFound when it is not exposed.
Result<SandboxSpec> with_port_closed(const SandboxSpec& spec, int64_t port);

// The ports as the fleet's other proxies must know them (the sandbox's etcd key, docs/fleet.md).
std::vector<fleet::PortRoute> fleet_port_routes(const SandboxSpec& spec);

}  // namespace sg
