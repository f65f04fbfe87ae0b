// A proxy worker: one thread, one libuv loop, its own SO_REUSEPORT listener per address (the kernel spreads
// connections across workers), its own connections and traffic counters. Workers share only ProxyShared.
#pragma once

#include <uv.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/fd.h"
#include "common/token_digest.h"
#include "config/config.h"
#include "proxy/access_log.h"
#include "proxy/fleet_context.h"
#include "proxy/listener_handover.h"
#include "proxy/metrics.h"
#include "proxy/node_api.h"
#include "proxy/outage_routes.h"
#include "proxy/route_cache.h"
#include "proxy/socket_watch.h"
#include "proxy/tls.h"
#include "proxy/traffic.h"

namespace sg {

class Connection;

// Everything a reload replaces, as one immutable value: the config, the TLS contexts made from it and the
// operator token it names. A connection takes the current one at accept and keeps it, so its limits, its
// certificate and the token it checks always come from the same reload.
struct ProxySnapshot {
  std::shared_ptr<const Config> config;
  std::shared_ptr<TlsContexts> tls;
  std::string operator_token;  // "" when operator_token_file is not set (read_operator_token)
  std::shared_ptr<const FleetContext> fleet;  // null: proxy.fleet_cert unset, no cross-node routing
  std::optional<TokenDigest> operator_token_sha256 = {};  // set by make_snapshot: hashed once per reload
};

// `s` with the operator token's digest, shared: every proxy snapshot is made here.
std::shared_ptr<const ProxySnapshot> make_snapshot(ProxySnapshot s);

// State every worker reads.
struct ProxyShared {
  explicit ProxyShared(std::shared_ptr<const ProxySnapshot> initial) : snapshot_(std::move(initial)) {}
  std::shared_ptr<const ProxySnapshot> snapshot() const { return snapshot_.load(std::memory_order_acquire); }
  // SIGHUP: connections accepted from now on see `next`; open ones keep theirs.
  void replace(std::shared_ptr<const ProxySnapshot> next) { snapshot_.store(std::move(next), std::memory_order_release); }

  std::unique_ptr<AccessLog> access_log;
  ProxyMetrics metrics;
  ConnectionLimits sandbox_limits;  // by sandbox id, against proxy.max_connections_per_sandbox
  ConnectionLimits client_limits;   // by client address (no port), against proxy.max_connections_per_client
  std::atomic<uint32_t> open_connections{0};
  // What RLIMIT_NOFILE carries (max_connections_for_fd_limit); the effective limit is the smaller of this
  // and proxy.max_connections. Set once before the workers start (the rlimit does not change on reload).
  uint32_t fd_max_connections = UINT32_MAX;
  // Each worker's route cache holds at most this many spare sockets (spare_sockets_for_fd_limit); set with
  // fd_max_connections, out of the same descriptor budget.
  uint32_t spare_sockets_per_worker = RouteCache::kDefaultMaxSpares;
  // What each worker's route cache serves during a node outage, for the others (outlives the workers).
  OutageRoutes outage_routes;

 private:
  std::atomic<std::shared_ptr<const ProxySnapshot>> snapshot_;
};

class Worker {
 public:
  // A port's policy is fixed for its sandbox's life; the bound only limits how long a name given to a new
  // sandbox can be offered the old one's ALPN. Entries are ~100 bytes.
  static constexpr uint64_t kPortPolicyTtlMs = 10'000;
  static constexpr size_t kMaxPortPolicies = 100'000;

  // `node`: how this worker reaches its node; null = the node's unix socket (UnixNodeClient). Tests pass a
  // fake.
  Worker(int index, ProxyShared* shared, std::unique_ptr<NodeClient> node = nullptr);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Binds this worker's listeners (synchronously, so bind errors surface at startup) and sets up its loop.
  // `listen` is the list to bind (port 0 already resolved by the first worker: all workers share ports).
  // `fleet_listen`: proxy.fleet_listen, the mutual-TLS listener other nodes' proxies hop to.
  // Sockets a previous proxy listened with (a takeover, proxy/listener_handover.h): client[i] on listen[i],
  // fleet[i] on fleet_listen[i]. This worker polls them instead of binding one of its own; an address
  // without any is bound anew (SO_REUSEPORT joins the previous process's socket, if it still has one).
  struct Inherited {
    std::vector<std::vector<UniqueFd>> client;
    std::vector<std::vector<UniqueFd>> fleet;
  };
  Status bind(const std::vector<Endpoint>& listen, const std::vector<Endpoint>& fleet_listen = {},
              Inherited inherited = {});
  // Starts the thread that runs the loop: after bind(), and after the proxy dropped root (proxy.user), so
  // that no connection is ever handled with root's privileges.
  void start();
  // The addresses this worker actually bound (port 0 resolved), in config order.
  const std::vector<Endpoint>& bound() const { return bound_; }
  const std::vector<Endpoint>& fleet_bound() const { return fleet_bound_; }
  // Asks the loop to close listeners and connections and return; join() waits for that.
  void stop();
  // Another process took over the listeners: stop accepting, and let the open connections finish. An
  // HTTP/1.1 request forwarded from now on asks the sandbox to close after answering it (Connection: close),
  // an HTTP/1.1 connection idle between requests for a drain tick is closed, an h2 client is told GOAWAY
  // (no new streams; those in flight finish). What is left at the drain deadline goes with stop().
  void drain();
  bool draining() const { return draining_; }
  // Each listening socket (endpoint, descriptor, still this worker's), for a takeover; set at bind.
  struct ListeningSocket {
    Endpoint endpoint;
    int fd;
    ListenerRole role;
  };
  std::vector<ListeningSocket> listeners() const { return listener_fds_; }
  void join();

  uv_loop_t* loop() { return &loop_; }
  // Where the connections' client and sandbox sockets are watched (open from bind() to stop()).
  SocketWatchSet& sockets() { return sockets_; }
  ProxyShared* shared() { return shared_; }
  WorkerTraffic& traffic() { return traffic_; }
  RouteCache& routes() { return routes_; }
  // Before a connection is routed from the cache without the node (routes_.serving_without_node()): if the
  // node accepts connections again, the cache stops serving and the event stream is asked for at once.
  void recheck_node();
  // A node call failed while the event stream is down and no outage is known: if the node's socket now
  // refuses, the outage starts here rather than at the stream's next retry (up to a second later: its end
  // may have found a dying node still listening). True when the cache then serves routes in an outage.
  bool outage_found();
  // A connection took one of the last spares of a cached route: ask the node for more in the background.
  void refill_route(const std::string& sandbox_ref, const std::string& sandbox_id, uint16_t port, size_t count);
  // Before start(): this worker's end of the socket maker (proxy/socket_maker.h), which makes sockets for
  // routes out of spares while the node is down. Without one, such a route serves no more connections.
  void use_socket_maker(std::unique_ptr<SocketSource> maker);
  NodeClient& node() { return *node_; }
  int index() const { return index_; }
  void forget(Connection* c) { connections_.erase(c); }
  // A forwarding pump has work poll() never reports (whole records read ahead inside OpenSSL after the
  // socket ran dry, or what a pump that spent its rounds left unsettled): `c` is pumped again on the next
  // loop turn (Connection::pump_again), from one idle handle for the worker, not one per connection.
  void pump_again(Connection* c);
  void cancel_pump_again(Connection* c);  // `c` closed while queued

 private:
  void run();
  void on_accept(int listen_fd);
  bool is_fleet_listener(int fd) const;
  // Out of descriptors (or kernel memory) at accept: the level-triggered listener polls would fire again at
  // once and spin, so they are stopped for kAcceptPauseMs and then resumed. An episode (first failure to
  // next successful accept) logs once when it starts and once when it ends, not per attempt.
  void pause_accepting(int err);
  void resume_accepting();
  void end_fd_shortage();
  void start_listen_polls();
  void report_activity();
  // The node's answer to a report names the reported sandboxes that are asleep or have a new token: their
  // connections opened before that go.
  void cut_connections(const ActivityCuts& cuts);
  // The node's route events keep routes_ honest; while the stream is down routes_ serves no route (but
  // those it kept, while the node is gone), and it is reconnected after kRouteStreamRetryMs.
  void watch_routes();
  // The node is down (its socket refuses): the cache's outage starts or goes on (`known`: not logged again).
  void node_is_down(bool known);
  // What routes_ does for a node outage: the socket maker, proxy.routes_without_node_secs.
  void serve_outages();
  void on_route_event(const RouteStreamEvent& e);
  void on_route_stream_end(const Failure& why);

  int index_;
  ProxyShared* shared_;
  uv_loop_t loop_{};
  SocketWatchSet sockets_;
  uv_async_t stop_async_{};
  uv_timer_t report_timer_{};
  std::vector<UniqueFd> listen_fds_;
  std::vector<ListeningSocket> listener_fds_;  // what listen_fds_ held at bind
  uv_async_t drain_async_{};
  uv_timer_t drain_timer_{};
  bool draining_ = false;  // loop thread only
  static constexpr uint64_t kDrainTickMs = 500;
  void start_draining();
  void close_listeners();
  std::vector<Endpoint> bound_;
  std::vector<Endpoint> fleet_bound_;
  size_t fleet_listeners_from_ = SIZE_MAX;  // listen_fds_ from this index on are fleet_listen's
  std::vector<std::unique_ptr<uv_poll_t>> listen_polls_;
  uv_timer_t accept_pause_timer_{};
  uint64_t fd_shortage_since_ms_ = 0;  // loop time the current episode began; 0 = none
  uint32_t fd_shortage_pauses_ = 0;
  std::unordered_set<Connection*> connections_;
  void run_pumps_again();
  uv_idle_t pump_again_idle_{};
  std::vector<Connection*> pump_again_;  // queued for the next turn
  std::vector<Connection*> pumping_;     // this turn's (kept to keep its capacity)
  WorkerTraffic traffic_;
  std::unique_ptr<SocketSource> socket_maker_;  // before routes_, which points to it: outlives it
  RouteCache routes_;
  int64_t dormant_reported_ = 0;  // routes_.dormant_count() as last added to the metrics' gauge
  std::unique_ptr<NodeClient> node_;
  std::unique_ptr<NodeCall> route_stream_;
  uv_timer_t route_stream_retry_{};
  bool route_stream_warned_ = false;  // one warning per outage, not one per retry
  bool route_stream_seen_ = false;    // its first start is logged (tests wait for it), not every one
  static constexpr uint64_t kRouteStreamRetryMs = 1000;
  // Background refills by "ref:port": one in flight per route.
  std::unordered_map<std::string, std::unique_ptr<NodeCall>> refills_;
  std::unique_ptr<NodeCall> report_in_flight_;
  std::string reporter_id_;
  std::thread thread_;
  bool loop_ready_ = false;  // bind() set up every handle: the destructor can close them without the thread
};

}  // namespace sg
