// The etcd key layout of a fleet (common/fleet_directory.h describes it) and the JSON of its values, both
// ways, shared by the node's writer (noderuntime/fleet_member) and every reader (EtcdDirectory, the API).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/fleet_directory.h"

namespace sg {

inline constexpr std::string_view kFleetNodesPrefix = "/sandgate/nodes/";
inline constexpr std::string_view kFleetSandboxesPrefix = "/sandgate/sandboxes/";
inline constexpr std::string_view kFleetDrainPrefix = "/sandgate/drain/";

std::string node_info_json(const fleet::NodeInfo& info);
Result<fleet::NodeInfo> parse_node_info(std::string_view json);
// `ports` go in only when there are some, so a sandbox without exposed ports keeps its short value.
std::string sandbox_owner_json(std::string_view node, std::string_view state,
                               const std::vector<fleet::PortRoute>& ports = {});
struct SandboxRecord {
  std::string node;
  std::string state;
  // Entries that are not a port 1-65535 with a protocol of http1, h2c or tcp are left out, and so is
  // everything past kMaxPublishedPorts: a proxy treats a port it does not find as HTTP/1.1 behind a token.
  std::vector<fleet::PortRoute> ports;
};
Result<SandboxRecord> parse_sandbox_owner(std::string_view json);

}  // namespace sg
