#include "common/fleet_keys.h"

#include <algorithm>
#include <limits>

#include <nlohmann/json.hpp>

namespace sg {
namespace {

using json = nlohmann::json;

std::string str_field(const json& j, const char* name) {
  auto it = j.find(name);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A count or capacity from a node key, which any etcd client may have written: 0 unless a non-negative
// integer, and at most INT64_MAX (so room arithmetic cannot overflow).
int64_t count_field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_number_integer()) return 0;
  if (it->is_number_unsigned())
    return static_cast<int64_t>(std::min<uint64_t>(it->get<uint64_t>(), std::numeric_limits<int64_t>::max()));
  return std::max<int64_t>(it->get<int64_t>(), 0);
}

}  // namespace

namespace fleet {
bool may_have_image(const NodeInfo& node, std::string_view image) {
  return !node.images || std::binary_search(node.images->begin(), node.images->end(), image);
}
}  // namespace fleet

std::string node_info_json(const fleet::NodeInfo& info) {
  json j = {{"name", info.name},
            {"api", info.api},
            {"ingress", info.ingress},
            {"state", info.state == fleet::NodeState::kDraining ? "draining" : "ready"},
            {"capacity_sandboxes", info.capacity_sandboxes},
            {"sandboxes", info.sandboxes},
            {"capacity_memory_mb", info.capacity_memory_mb},
            {"reserved_memory_mb", info.reserved_memory_mb},
            {"capacity_millicpus", info.capacity_millicpus},
            {"reserved_millicpus", info.reserved_millicpus}};
  if (info.images) j["images"] = *info.images;
  return j.dump();
}

Result<fleet::NodeInfo> parse_node_info(std::string_view text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return fail(Error::kInvalidArgument, "node key: not a JSON object");
  fleet::NodeInfo info;
  info.name = str_field(j, "name");
  if (info.name.empty()) return fail(Error::kInvalidArgument, "node key: no name");
  info.api = str_field(j, "api");
  info.ingress = str_field(j, "ingress");
  std::string state = str_field(j, "state");
  if (state == "ready") info.state = fleet::NodeState::kReady;
  else if (state == "draining") info.state = fleet::NodeState::kDraining;
  else return fail(Error::kInvalidArgument, "node key: state must be ready or draining");
  info.capacity_sandboxes = count_field(j, "capacity_sandboxes");
  info.sandboxes = count_field(j, "sandboxes");
  // Absent (a node from before they were published): 0, no limit known.
  info.capacity_memory_mb = count_field(j, "capacity_memory_mb");
  info.reserved_memory_mb = count_field(j, "reserved_memory_mb");
  info.capacity_millicpus = count_field(j, "capacity_millicpus");
  info.reserved_millicpus = count_field(j, "reserved_millicpus");
  if (auto it = j.find("images"); it != j.end()) {
    if (!it->is_array() || it->size() > fleet::kMaxPublishedImages)
      return fail(Error::kInvalidArgument, "node key: images must be an array of at most " +
                                               std::to_string(fleet::kMaxPublishedImages) + " names");
    std::vector<std::string> names;
    for (const json& name : *it) {
      if (!name.is_string()) return fail(Error::kInvalidArgument, "node key: images must hold names");
      names.push_back(name.get<std::string>());
    }
    std::sort(names.begin(), names.end());
    info.images = std::move(names);
  }
  return info;
}

std::string sandbox_owner_json(std::string_view node, std::string_view state,
                               const std::vector<fleet::PortRoute>& ports) {
  json j{{"node", node}, {"state", state}};
  if (!ports.empty()) {
    json list = json::array();
    for (const fleet::PortRoute& p : ports)
      list.push_back({{"port", p.port}, {"protocol", p.protocol}, {"public", p.is_public}});
    j["ports"] = std::move(list);
  }
  return j.dump();
}

Result<SandboxRecord> parse_sandbox_owner(std::string_view text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return fail(Error::kInvalidArgument, "sandbox key: not a JSON object");
  SandboxRecord r{str_field(j, "node"), str_field(j, "state"), {}};
  if (r.node.empty()) return fail(Error::kInvalidArgument, "sandbox key: no node");
  auto ports = j.find("ports");
  if (ports != j.end() && ports->is_array()) {
    for (const json& p : *ports) {
      if (r.ports.size() == fleet::kMaxPublishedPorts) break;
      if (!p.is_object()) continue;
      auto port = p.find("port");
      auto is_public = p.find("public");
      std::string protocol = str_field(p, "protocol");
      if (port == p.end() || !port->is_number_unsigned() || port->get<uint64_t>() == 0 || port->get<uint64_t>() > 65535)
        continue;
      if (protocol != "http1" && protocol != "h2c" && protocol != "tcp") continue;
      r.ports.push_back(fleet::PortRoute{static_cast<uint16_t>(port->get<uint64_t>()), std::move(protocol),
                                         is_public != p.end() && is_public->is_boolean() && is_public->get<bool>()});
    }
  }
  return r;
}

}  // namespace sg
