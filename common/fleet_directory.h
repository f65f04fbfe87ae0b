// Who owns which sandbox in a fleet of nodes, as this process last saw it. The node side (registration,
// name claims) writes the fleet's state to etcd; a Directory is the read side every proxy and node keeps
// from a list + watch of it, and the proxy's routing reads only this interface, so it runs against a fake.
//
// etcd keys (values are JSON):
//   /sandgate/nodes/<node>        NodeInfo, bound to the node's lease: gone when the node stops renewing it
//   /sandgate/sandboxes/<name>    {"node": "<node>", "state": "<sandbox state>", "ports": [PortRoute]}: the
//                                 fleet-wide name claim
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sg::fleet {

enum class NodeState { kReady, kDraining };

struct NodeInfo {
  std::string name;     // unique in the fleet
  std::string api;      // the node API other nodes and the CLI reach it at (https://host:port)
  std::string ingress;  // host:port of the node's fleet ingress listener (mutual TLS with the fleet CA)
  NodeState state = NodeState::kReady;
  int64_t capacity_sandboxes = 0;  // how many sandboxes it admits in all
  int64_t sandboxes = 0;           // how many it holds now
  // What its sandboxes may reserve in all (node.max_memory_mb, node.max_cpus; 0: no limit) and what they
  // reserve now (each sandbox its memory_mb and cpus, whatever its state). CPUs in thousandths of a core.
  int64_t capacity_memory_mb = 0;
  int64_t reserved_memory_mb = 0;
  int64_t capacity_millicpus = 0;
  int64_t reserved_millicpus = 0;
  // The names of the images it has, sorted, for placement to prefer a node that has the one asked for.
  // nullopt: not known (a node from before images were published, or one with more than
  // kMaxPublishedImages), so no node is passed over for it.
  std::optional<std::vector<std::string>> images;
};

// A node key lives in etcd, whose requests are at most 1.5 MiB by default: past this many names (~60 KiB
// at 64 bytes each) a node publishes none.
inline constexpr size_t kMaxPublishedImages = 1000;

// False only when `node` published its images and `image` is not among them.
bool may_have_image(const NodeInfo& node, std::string_view image);

// How the owning node carries one of a sandbox's exposed ports: what a proxy must know of another node's
// sandbox at the ClientHello, before any request byte (it offers h2 only for an h2c port, and forwards a
// public tcp port at once, since the server there may speak first). The owner's node still decides each
// connection.
struct PortRoute {
  uint16_t port = 0;
  std::string protocol;  // "http1", "h2c" or "tcp"
  bool is_public = false;
  bool operator==(const PortRoute&) const = default;
};

// A sandbox key carries at most this many ports (node/create_spec.h kMaxExposedPorts: a node exposes no more).
inline constexpr size_t kMaxPublishedPorts = 64;

struct SandboxOwner {
  std::string node;
  // Empty when the owner's node key is gone (lease expired): the sandbox exists but cannot be reached now,
  // which a proxy answers with 503 + Retry-After, not 404.
  std::optional<NodeInfo> node_info;
  // As the owner last published them (none from a node before ports were). Shared with the directory: a
  // lookup per connection copies a pointer, not the list.
  std::shared_ptr<const std::vector<PortRoute>> ports;
};

// Every method is safe to call from any thread (proxy workers share one directory).
class Directory {
 public:
  virtual ~Directory() = default;
  // nullopt: the fleet has no sandbox of that name (as far as this view knows).
  virtual std::optional<SandboxOwner> owner_of(std::string_view sandbox) const = 0;
  virtual std::optional<NodeInfo> node(std::string_view name) const = 0;
  virtual std::vector<NodeInfo> nodes() const = 0;
  // False while the view cannot follow etcd (watch broken, re-listing): entries may be stale. Routing goes
  // on from the last view; a stale entry is corrected by the node it reaches (a redirect to the real owner).
  virtual bool current() const = 0;
};

}  // namespace sg::fleet
