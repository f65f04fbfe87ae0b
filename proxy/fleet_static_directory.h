// TEST ONLY: a fleet::Directory read from a JSON file (proxy.fleet_static_directory_file), standing in for
// the etcd-backed directory so the cross-node hop runs in tests without etcd. Re-read when the proxy
// reloads (SIGHUP), which is how a test makes a node "gone". Not for production: nothing keeps it current.
//   {"nodes": [{"name": "b", "ingress": "127.0.0.1:7443", "state": "ready"}],
//    "sandboxes": {"web": "b"}}
#pragma once

#include <map>
#include <memory>
#include <string>

#include "common/error.h"
#include "common/fleet_directory.h"

namespace sg::fleet {

class StaticDirectory final : public Directory {
 public:
  static constexpr size_t kMaxFileBytes = 1 << 20;
  static Result<std::shared_ptr<const StaticDirectory>> load_file(const std::string& path);
  static Result<std::shared_ptr<const StaticDirectory>> parse(std::string_view json);

  std::optional<SandboxOwner> owner_of(std::string_view sandbox) const override;
  std::optional<NodeInfo> node(std::string_view name) const override;
  std::vector<NodeInfo> nodes() const override;
  bool current() const override { return true; }

 private:
  std::map<std::string, NodeInfo, std::less<>> nodes_;
  std::map<std::string, std::string, std::less<>> owners_;  // sandbox name -> node name
};

}  // namespace sg::fleet
