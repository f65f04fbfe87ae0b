// The etcd key layout of a fleet (common/fleet_directory.h describes it) and the JSON of its values, both
// ways, shared by the node's writer (noderuntime/fleet_member) and every reader (EtcdDirectory, the API).
#pragma once

#include <string>
#include <string_view>

#include "common/error.h"
#include "common/fleet_directory.h"

namespace sg {

inline constexpr std::string_view kFleetNodesPrefix = "/sandgate/nodes/";
inline constexpr std::string_view kFleetSandboxesPrefix = "/sandgate/sandboxes/";
inline constexpr std::string_view kFleetDrainPrefix = "/sandgate/drain/";

std::string node_info_json(const fleet::NodeInfo& info);
Result<fleet::NodeInfo> parse_node_info(std::string_view json);
std::string sandbox_owner_json(std::string_view node, std::string_view state);
struct SandboxRecord {
  std::string node;
  std::string state;
};
Result<SandboxRecord> parse_sandbox_owner(std::string_view json);

}  // namespace sg
