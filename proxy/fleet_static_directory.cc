#include "proxy/fleet_static_directory.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "proxy/fleet_hop.h"

namespace sg::fleet {

Result<std::shared_ptr<const StaticDirectory>> StaticDirectory::load_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(Error::kNotFound, "fleet static directory " + path + ": cannot be read");
  std::string text(kMaxFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxFileBytes)
    return fail(Error::kLimitExceeded, "fleet static directory " + path + ": larger than 1 MiB");
  auto d = parse(text);
  if (!d) return fail(d.error(), "fleet static directory " + path + ": " + d.message());
  return d;
}

Result<std::shared_ptr<const StaticDirectory>> StaticDirectory::parse(std::string_view text) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return fail(Error::kInvalidArgument, "not a JSON object");
  auto dir = std::make_shared<StaticDirectory>();
  if (j.contains("nodes")) {
    if (!j["nodes"].is_array()) return fail(Error::kInvalidArgument, "\"nodes\" must be an array");
    for (const auto& n : j["nodes"]) {
      if (!n.is_object() || !n.contains("name") || !n["name"].is_string() || !n.contains("ingress") ||
          !n["ingress"].is_string())
        return fail(Error::kInvalidArgument, "each node needs string \"name\" and \"ingress\"");
      NodeInfo info;
      info.name = n["name"].get<std::string>();
      if (!valid_node_name(info.name)) return fail(Error::kInvalidArgument, "bad node name \"" + info.name + "\"");
      info.ingress = n["ingress"].get<std::string>();
      if (n.contains("api") && n["api"].is_string()) info.api = n["api"].get<std::string>();
      if (n.contains("state") && n["state"] == "draining") info.state = NodeState::kDraining;
      dir->nodes_[info.name] = std::move(info);
    }
  }
  if (j.contains("sandboxes")) {
    if (!j["sandboxes"].is_object()) return fail(Error::kInvalidArgument, "\"sandboxes\" must be an object");
    for (const auto& [name, node] : j["sandboxes"].items()) {
      if (!node.is_string() || !valid_node_name(node.get<std::string>()))
        return fail(Error::kInvalidArgument, "sandbox \"" + name + "\": the owner must be a node name");
      dir->owners_[name] = node.get<std::string>();
    }
  }
  return std::shared_ptr<const StaticDirectory>(std::move(dir));
}

std::optional<SandboxOwner> StaticDirectory::owner_of(std::string_view sandbox) const {
  auto it = owners_.find(sandbox);
  if (it == owners_.end()) return std::nullopt;
  return SandboxOwner{it->second, node(it->second), nullptr};
}

std::optional<NodeInfo> StaticDirectory::node(std::string_view name) const {
  auto it = nodes_.find(name);
  if (it == nodes_.end()) return std::nullopt;
  return it->second;
}

std::vector<NodeInfo> StaticDirectory::nodes() const {
  std::vector<NodeInfo> out;
  for (const auto& [_, n] : nodes_) out.push_back(n);
  return out;
}

}  // namespace sg::fleet
