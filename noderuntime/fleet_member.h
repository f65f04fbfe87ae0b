// This node's membership in a fleet on etcd (docs/fleet.md): it registers /sandgate/nodes/<node> under a
// lease it renews, claims sandbox names, publishes sandbox states, fences itself when it cannot renew, and
// reconciles its sandboxes against etcd whenever it (re-)registers.
//
// Two threads, so a slow write never delays a renewal: the lease thread (register, renew every third of the
// TTL, re-register after an expiry, reconcile, the node key's load and drain state) and the writer (claims
// first, then state writes, coalesced per sandbox). Neither runs on the node's loop; a claim's answer is
// posted back to it through a uv_async_t.
//
// Keys (the layout common/fleet_directory.h fixes):
//   /sandgate/nodes/<node>       NodeInfo JSON, bound to the lease
//   /sandgate/sandboxes/<name>   {"node": ..., "state": ...}: bound to the lease while "creating" (a node that
//                                dies mid-create frees the name when its lease expires), then written without
//                                a lease so a dead node's sandboxes stay known (503, not 404)
//   /sandgate/drain/<node>       present: the node is draining (sandgate node drain); survives its restarts
#pragma once

#include <uv.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/etcd_client.h"
#include "common/etcd_directory.h"
#include "common/fleet_directory.h"
#include "common/fleet_keys.h"
#include "config/config.h"
#include "noderuntime/fleet_hooks.h"

namespace sg {

class FleetMember : public FleetHooks, public FleetAdmin {
 public:
  // kLive: the lease was renewed recently enough that etcd still holds it. kFenced: not (or never
  // registered): creates and wakes are refused until it registers again.
  enum class State { kFenced, kLive };

  FleetMember(uv_loop_t* loop, const FleetConfig& config, size_t capacity);
  ~FleetMember() override;
  FleetMember(const FleetMember&) = delete;
  FleetMember& operator=(const FleetMember&) = delete;

  // The names of this node's images, published in its node key for placement (docs/fleet.md#placement).
  // Called on the lease thread at every renewal; set before start(). Unset, or failing: none published.
  using ImageNames = std::function<Result<std::vector<std::string>>()>;
  void set_image_names(ImageNames names) { image_names_ = std::move(names); }
  // This node's memory and CPU capacity and what its sandboxes reserve of them (fleet::NodeInfo's fields of
  // those names), published in its node key for placement. Called on the lease thread at every renewal; set
  // before start(). Unset: nothing published (placement then takes the node to have no such limits).
  struct Resources {
    int64_t capacity_memory_mb = 0;
    int64_t reserved_memory_mb = 0;
    int64_t capacity_millicpus = 0;
    int64_t reserved_millicpus = 0;
  };
  using ResourcesOf = std::function<Resources()>;
  void set_resources(ResourcesOf resources) { resources_ = std::move(resources); }

  // Starts both threads; registration happens on the lease thread (the node serves meanwhile, fenced).
  Status start();
  // Flushes pending writes (bounded), revokes the lease (the node key goes at once) and joins the threads.
  void stop();
  // Closes the loop handle (after stop(); the loop must run once more).
  void close();

  Status admit(FleetAdmission what) const override;
  void claim(const std::string& name, std::function<void(Status)> done) override;
  void publish(const std::string& key, std::string_view state, std::vector<fleet::PortRoute> ports) override;
  void publish_ports(const std::string& key, std::vector<fleet::PortRoute> ports) override;

  State state() const { return state_.load(); }
  bool draining() const { return draining_.load(); }
  const std::string& node_name() const override { return config_.node_name; }
  std::vector<fleet::NodeInfo> fleet_nodes() const override { return directory_.nodes(); }
  void set_draining(const std::string& node, bool draining, DrainDone done) override;
  // The list + watch view of the fleet this node keeps (for the API and, later, placement).
  const fleet::Directory& directory() const { return directory_; }
  const etcd::Client& client() const { return client_; }
  std::vector<std::string> conflicts() const override;

 private:
  // What a sandbox key says of this node's sandbox.
  struct Published {
    std::string state;
    std::vector<fleet::PortRoute> ports;
  };
  struct Claim {
    std::string name;
    std::function<void(Status)> done;
    // Not a claim but a drain flag write for node `name` (the same queue keeps etcd off the loop), answered
    // through `drained`.
    std::optional<bool> drain = std::nullopt;
    DrainDone drained = nullptr;
  };

  void lease_loop();
  void writer_loop();
  Status register_node();
  Status renew();
  Status put_node_key(bool force);
  Status reconcile();
  // `stale_claim_is_ours`: no other create of this name is in flight here, so a "creating" claim of this
  // node's in etcd is a leftover (a timed-out claim etcd carried out later) and may be taken over.
  Status claim_now(const std::string& name, bool stale_claim_is_ours);
  Status write_state(const std::string& key, const Published& value);
  void queue_write(const std::string& key, Published value);  // mu_ held
  Result<std::vector<NodeSandbox>> write_drain(const std::string& node, bool draining);
  void post(std::function<void()> fn);
  void drain_posted();

  uv_loop_t* loop_;
  FleetConfig config_;
  size_t capacity_;
  etcd::Client client_;
  fleet::EtcdDirectory directory_;
  std::chrono::milliseconds period_;
  ImageNames image_names_;
  ResourcesOf resources_;

  std::atomic<State> state_{State::kFenced};
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> lease_{0};
  std::atomic<bool> needs_reconcile_{true};
  std::atomic<int64_t> last_renew_ms_{0};  // steady clock, when the last renewal that etcd took was sent
  std::string last_node_json_;                             // lease thread only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<Claim> claims_;
  std::deque<std::string> publish_order_;
  std::map<std::string, Published> pending_;  // key -> latest value not yet written
  std::map<std::string, Published> local_;    // key -> value of every sandbox this node has
  // Names whose claim is being sent or was won, until their create publishes a state: reconcile keeps their
  // "creating" keys and deletes every other "creating" key of this node (a claim whose answer timed out
  // may still have landed once etcd came back).
  std::set<std::string> claimed_;
  std::vector<std::string> conflicts_;

  std::mutex posted_mu_;
  std::vector<std::function<void()>> posted_;
  uv_async_t* async_ = nullptr;  // freed by close()

  std::thread lease_thread_;
  std::thread writer_thread_;
};

}  // namespace sg
