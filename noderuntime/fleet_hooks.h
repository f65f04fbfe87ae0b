// What a Node asks of the fleet it belongs to (docs/fleet.md). The Node calls these on its loop only when
// [fleet] is configured; FleetMember implements them on etcd, and unit tests use a fake.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/fleet_directory.h"

namespace sg {

// What a node admits only while it is live in the fleet.
enum class FleetAdmission {
  kCreate,  // a new sandbox (refused while draining too)
  kWake,    // a suspended sandbox of this node
};
// The words of the refusals: "refuses to create", "refuses to wake a sandbox".
inline std::string_view admission_words(FleetAdmission what) {
  return what == FleetAdmission::kCreate ? "create" : "wake a sandbox";
}

class FleetHooks {
 public:
  virtual ~FleetHooks() = default;
  // This node's name in the fleet (the answers that name an owner use it).
  virtual const std::string& node_name() const = 0;
  // kUnavailable while this node is fenced (it cannot renew its lease, so etcd may already consider it gone):
  // no creates and no wakes then; and for a create, while the node drains.
  virtual Status admit(FleetAdmission what) const = 0;
  // Claims sandbox name `name` fleet-wide before a create uses it. `done` runs on the loop: ok; kAlreadyExists
  // naming the node that holds it; kUnavailable when etcd cannot be reached or the node is fenced.
  virtual void claim(const std::string& name, std::function<void(Status)> done) = 0;
  // A sandbox's state as every proxy should see it ("running", "suspended", "failed"); "terminated" releases
  // the name. `key` is the name, or the id for an unnamed sandbox. `ports` are its exposed ports as another
  // node's proxy must know them at a ClientHello (fleet::PortRoute). Written asynchronously.
  virtual void publish(const std::string& key, std::string_view state, std::vector<fleet::PortRoute> ports) = 0;
  // Its ports changed, its state did not: written with the state last published (a sandbox whose create is
  // still in flight gets them with its first state).
  virtual void publish_ports(const std::string& key, std::vector<fleet::PortRoute> ports) = 0;
};

// What the node API serves about the fleet (GET /v1/fleet/nodes, drain), on the loop.
class FleetAdmin {
 public:
  virtual ~FleetAdmin() = default;
  virtual const std::string& node_name() const = 0;
  // The fleet's nodes as this node's view of etcd last saw them.
  virtual std::vector<fleet::NodeInfo> fleet_nodes() const = 0;
  // A sandbox etcd gives to a node, with its state there.
  struct NodeSandbox {
    std::string name;
    std::string state;
  };
  using DrainDone = std::function<void(Result<std::vector<NodeSandbox>>)>;
  // Marks `node` draining (placement skips it) or ready again; `done` runs on the loop. A drain answers with
  // the sandboxes that stay on the node (all of them: none is moved), sorted by name, for the operator to see
  // what still lives there.
  virtual void set_draining(const std::string& node, bool draining, DrainDone done) = 0;
  // Sandbox names etcd gives to another node while this node has a sandbox of that name (found by the last
  // reconcile or state write): for the operator to settle.
  virtual std::vector<std::string> conflicts() const = 0;
};

}  // namespace sg
