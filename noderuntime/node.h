// The node's brain: owns every sandbox, drives its Driver through the lifecycle (state_machine.h), persists
// each transition (store.h) and applies the idle policy. Everything runs on one libuv loop thread; no locks.
// Its parts, one job each:
//   create_spec.h        admission: a create request checked and completed into a spec
//   sandbox_registry.h   the live sandboxes by id and name
//   idle_clocks.h        one idle (or hibernation) clock per sandbox on one timer
//   connection_reports.h the proxies' open-connection counts, which hold a sandbox awake
//   wake_waiters.h       opens waiting for a sleeping sandbox (one wake serves them all)
//   route_events.h       what the proxies' route caches must forget, and the stamps that order it
// node.cc keeps the lifecycle itself (the transitions and the driver callbacks), node_reconcile.cc what a
// restarted node settles, node_checkpoint.cc the checkpoints.
//
// Idle policy, two tiers: a running sandbox with no activity for timeout_secs is paused (memory tier; named,
// non-ephemeral sandboxes) or terminated (ephemeral). A paused sandbox with hibernate_after_secs > 0 whose
// driver can hibernate is, after that many more seconds, hibernated (disk tier: state saved, memory freed).
// Activity = every open() and every activity report with bytes > 0. A running sandbox with open proxied
// connections (per the latest report of each proxy worker) never goes idle, bytes or not (an SSH session at
// a prompt, an exec stream waiting); its idle clock starts when the last one closes. A worker's count expires
// 10 report intervals (proxy.activity_report_interval_ms) after its last report, so a proxy that died cannot
// pin a sandbox awake: workers re-report every non-zero count at least that often.
// Access: every exposed port is private (sandbox token or operator token) unless public; the agent port is
// always reachable and always private (allow_unauthenticated_access publishes exposed ports only). Refused
// credentials never wake a sandbox and never count as activity.
// Wake: opens of a suspended sandbox share one resume or restore (single flight); each waits with its own
// timeout. An open that arrives while a pause or hibernation is in flight asks the driver to cancel it and
// waits for the shorter way back (thaw / cont), not for the suspension to finish and be undone.
#pragma once

#include <uv.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "common/net.h"
#include "config/config.h"
#include "noderuntime/connection_reports.h"
#include "noderuntime/create_spec.h"
#include "noderuntime/driver.h"
#include "noderuntime/fleet_hooks.h"
#include "noderuntime/idle_clocks.h"
#include "noderuntime/image_users.h"
#include "noderuntime/node_metrics.h"
#include "noderuntime/netns_vouchers.h"
#include "noderuntime/port_exposure.h"
#include "noderuntime/route_events.h"
#include "noderuntime/sandbox.h"
#include "noderuntime/sandbox_registry.h"
#include "noderuntime/snapshot_service.h"
#include "noderuntime/store.h"
#include "noderuntime/prewake_gate.h"
#include "noderuntime/wake_waiters.h"
#include "snapshot/image_store.h"

namespace sg {

// A consistent snapshot of one sandbox for answers (the record may change right after).
struct SandboxInfo {
  SandboxSpec spec;
  SandboxState state = SandboxState::kCreating;
  std::string state_reason;
  RuntimeInfo runtime;
  int64_t created_at_ms = 0;                   // Unix epoch milliseconds
  int64_t last_activity_at_ms = 0;             // Unix epoch milliseconds
  std::optional<int64_t> idle_deadline_at_ms;  // only while running (and not held awake)
  SuspendTier tier = SuspendTier::kNone;       // suspending: target tier; suspended, resuming: current tier
  // The next transition the idle policy has scheduled ("suspend", "terminate" or "hibernate") and when.
  std::string next_transition;
  std::optional<int64_t> next_transition_at_ms;
  uint64_t connections = 0;                    // open proxied connections, per the latest reports
  uint64_t resumes = 0;                        // resumes started since this node process started
  // Only in create()'s answer: the sandbox's access token in clear. The node keeps its digest only, so it
  // can never be shown again.
  std::string token;
};

// suspend()/resume(): `started` is true when this call started (or queued) the transition (HTTP 202) and
// false when the sandbox already is or is heading where asked (HTTP 200).
struct TransitionOutcome {
  bool started = false;
  SandboxInfo sandbox;
};

// What the proxy needs to know about a port before it connects: how to carry it and whether it needs a token.
struct PortAccess {
  std::string id;
  std::string name;  // empty for unnamed sandboxes
  uint16_t port = 0;
  PortProtocol protocol = PortProtocol::kHttp1;
  bool is_public = false;
};

enum class CredentialCheck { kAccepted, kMissing, kInvalid };

struct OpenedPort {
  std::string id;
  std::string name;  // empty for unnamed sandboxes
  uint16_t port = 0;
  PortProtocol protocol = PortProtocol::kHttp1;
  bool is_public = false;
  bool woke = false;     // the sandbox was not running when the open arrived
  double wake_ms = 0;    // time from the open's arrival to the sandbox running again
  GuestSocket socket;    // how the proxy reaches the port (driver.h)
  uint64_t opened_at = 0;  // Node::stamp() of this open: connections older than a suspend are cut
  // The digest of the sandbox's token, so the proxy recognises that token in any later request of the
  // connection (public ports included, where nothing was verified) and removes it before it is forwarded.
  std::string token_sha256;
};

struct ActivityReport {
  std::string id;        // sandbox id (a name is accepted too)
  std::string reporter;  // proxy worker; its connection count replaces its previous one
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t connections = 0;
};

// In the answer to an activity report: a reported sandbox that is suspending or suspended. The proxy closes
// its connections opened before `suspended_at` (Node::stamp() values): their traffic can no longer reach
// the frozen sandbox, and it never wakes it either (only a new connection's open does).
struct AsleepSandbox {
  std::string id;
  uint64_t suspended_at = 0;
};

// Also in that answer: a reported sandbox whose token was rotated at `rotated_at` (a Node::stamp()). The
// proxy closes its connections to it opened before then: they were authorized by a token that is gone.
struct RevokedToken {
  std::string id;
  uint64_t rotated_at = 0;
};

// And a reported sandbox whose `port` was closed (close_port) at `closed_at`: the proxy closes its connections
// to that port opened before then.
struct ClosedPort {
  std::string id;
  uint16_t port = 0;
  uint64_t closed_at = 0;
};

// More unconnected sockets to a port of a running sandbox (Node::spare_sockets), for a proxy's route cache:
// each lets one later connection start without asking the node.
struct SpareSockets {
  std::vector<UniqueFd> fds;
  uint16_t connect_port = 0;
  uint64_t opened_at = 0;   // Node::stamp() when they were made
  uint32_t cache_ms = 0;    // how long the proxy may use them (route_cache_ms)
  std::string token_sha256; // the sandbox's token now (a proxy drops a route whose digest changed)
  // The network namespace they live in, when the driver has one (Driver::socket_namespace): the proxy's
  // socket maker makes more in it while the node is down.
  UniqueFd netns;
};

struct ActivityAnswer {
  std::vector<AsleepSandbox> asleep;
  std::vector<RevokedToken> revoked;
  std::vector<ClosedPort> closed;
};

class Node {
 public:
  using OpenCallback = std::function<void(Result<OpenedPort>)>;
  using SandboxCallback = std::function<void(Result<SandboxInfo>)>;

  // `config` must outlive the Node; it is read per operation so a reload's limits apply at once. `drivers`:
  // one per name, the first is the default for creates that name none.
  Node(uv_loop_t* loop, const ConfigHolder* config, std::vector<std::unique_ptr<Driver>> drivers,
       std::unique_ptr<Store> store);
  // Closes the node's handles (the loop must run once more to free them). Pending callbacks are dropped.
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Adopts what the store remembers: asks the driver about each instance and settles its state, then
  // watches the live ones and restarts their idle clocks from now. Call once, before serving.
  Status reconcile();
  // Makes the token in `config`'s operator_token_file the operator token (none when no file is configured).
  // A configured file that is missing, unreadable, empty, oversized, not a regular file, or accessible by
  // group or others is an error, and the current token stays. Called at start (before serving) and by a
  // config reload before it swaps in the new config, so a rotated token file takes effect on SIGHUP.
  Status load_operator_token(const Config& config);
  // Where create looks up the image a sandbox runs on (it must exist; its env and working_dir are the
  // defaults the request overrides). Without a store (unit tests of the state machine) the name is recorded
  // as given. `images` must outlive the Node.
  void set_images(const snapshot::ImageStore* images) { images_ = images; }
  // The sandboxes using each image (for ImageStore::set_users); shared so the store's hooks outlive no one.
  std::shared_ptr<ImageUsers> image_users() const { return image_users_; }
  // Where checkpoints go and creates from a snapshot look (without it both answer kUnavailable). It must
  // outlive the Node.
  void set_snapshots(SnapshotService* snapshots) { snapshots_ = snapshots; }
  // The fleet this node belongs to ([fleet] in the config; none: the single-node default). Creates claim
  // their name through it first, creates and wakes are refused while it is fenced, and every state change
  // that proxies must see is published to it. Set before reconcile(); it must outlive the Node.
  void set_fleet(FleetHooks* fleet) { fleet_ = fleet; }

  // Validates, persists (state creating) and starts. `done` gets the running sandbox once its driver has
  // started it, or the error; it runs before create() returns when validation fails.
  void create(const CreateRequest& request, SandboxCallback done);
  std::vector<SandboxInfo> list() const;  // terminated sandboxes are gone, so never listed
  Result<SandboxInfo> get(std::string_view ref) const;
  Result<TransitionOutcome> suspend(std::string_view ref);
  Result<TransitionOutcome> resume(std::string_view ref);
  // Terminates; `done` gets the final snapshot (state terminated) once the instance is gone. May run
  // before remove() returns (unknown ref).
  void remove(std::string_view ref, SandboxCallback done);
  // Resolves `ref`, wakes it if needed, and hands back a socket in its network namespace. `done` may run
  // before open() returns (sandbox running, or an error).
  void open(std::string_view ref, uint16_t port, uint32_t wake_timeout_ms, OpenCallback done);
  // A credential of `client` (an address, no port) verified for sandbox `id`: that client's later ClientHellos
  // may wake it (prewake).
  void credential_verified(std::string_view id, std::string_view client);
  // A ClientHello from `client` names `port` of `ref` (internal/lookup with prewake): a sleeping sandbox
  // starts waking when the port is public or the client verified within node.prewake_window_secs
  // (noderuntime/prewake_gate.h), so the resume overlaps the TLS handshake. Not activity: the open that
  // follows is, and joins the wake. Whatever the outcome the lookup answers as before.
  // kNotAsleep: running or waking already; kUnavailable: unknown, not exposed, failed, or the node is fenced
  // or shutting down (the proxy then assumes nothing about it).
  enum class PrewakeOutcome { kWoke, kNotAsleep, kRefused, kUnavailable };
  // How long a sandbox woken by a ClientHello waits for the request it announced: its idle clock runs out
  // then unless an open came, and only an open within it reports that it woke the sandbox.
  static constexpr std::chrono::seconds kEarlyWakeGrace{30};
  PrewakeOutcome prewake(std::string_view ref, uint16_t port, std::string_view client);
  // Applies the proxies' counts: bytes keep a running sandbox's idle clock fresh, but never wake one. The
  // answer lists the reported sandboxes that are asleep.
  ActivityAnswer activity(const std::vector<ActivityReport>& reports);
  // A checkpoint of a running sandbox: `type` "filesystem" (the disk state; the sandbox is frozen only while
  // its upper dir is read and keeps its id, token and idle clock) or "memory" (kUnsupported: no driver here
  // can save processes). kConflict while it is not running or another checkpoint of it runs. `done` runs on
  // the loop, possibly before checkpoint() returns (a refusal).
  using CheckpointCallback = std::function<void(Result<snapshot::CheckpointResult>)>;
  void checkpoint(std::string_view ref, std::string_view type, CheckpointCallback done);
  // A new token for the sandbox (in the answer's `token`, shown this once): the old one is refused from now
  // on, and connections it opened are closed once their proxy next reports (activity()).
  Result<SandboxInfo> rotate_token(std::string_view ref);
  // Opens `port` after create (PUT /v1/sandboxes/{ref}/ports/{port}) with `request`'s policy, or replaces the
  // policy of an exposed one: once the driver forwards it into the live instance, the spec is stored and the
  // proxies drop what they cached of the sandbox (a "ports" route event). kConflict while the sandbox is
  // starting, changing state or being checkpointed. `done` may run before this returns.
  void expose_port(std::string_view ref, int64_t port, const ExposeRequest& request, SandboxCallback done);
  // Closes an exposed port (DELETE): refused from the answer on; connections already open to it go on.
  Result<SandboxInfo> close_port(std::string_view ref, int64_t port);
  // The node's registered SSH keys changed: every running sandbox's driver is told (docs/ssh.md; a VM's
  // guest keeps its own copy). Suspended ones are told when they wake, by the driver's resume or restore.
  void ssh_keys_changed();

  // Route-cache invalidations (RouteEvent), delivered synchronously on the loop, before the call that caused
  // them returns: a rotation's answer leaves after every subscriber was told. Returns the id unsubscribe()
  // takes. A listener may unsubscribe (itself or others) while it runs.
  uint64_t subscribe(RouteEvents::Listener listener) { return route_events_.subscribe(std::move(listener)); }
  void unsubscribe(uint64_t subscription) { route_events_.unsubscribe(subscription); }
  // The current stamp (for a subscriber's first line: events before it were not seen).
  uint64_t current_stamp() { return route_events_.stamp(); }
  // `count` (at most kMaxSpareSockets) more sockets to `port` of sandbox `id` while it is running; never
  // wakes it and is not activity (the connections that use them are reported). kUnavailable when it is not
  // running, kUnsupported for a driver whose sockets come connected (a vsock stream per connection).
  Result<SpareSockets> spare_sockets(std::string_view id, uint16_t port, size_t count);
  static constexpr size_t kMaxSpareSockets = sg::kMaxSpareSockets;
  // How long a proxy may route new connections to sandbox `id` from its cache without asking: short enough
  // that the connections it lets through are reported (activity) well before the idle timeout could
  // suspend it, and at most kMaxRouteCacheMs. 0: do not cache.
  uint32_t route_cache_ms(std::string_view id) const;
  static constexpr uint32_t kMaxRouteCacheMs = 30'000;
  // The operator token's digest ("" when none), which a proxy's cache checks a credential against.
  const std::string& operator_token_sha256() const { return operator_token_sha256_; }

  // Resolves `ref` and the policy of `port` without touching the sandbox (no wake, no activity): kNotFound,
  // or kPermissionDenied ("port not exposed") for a port that is neither exposed nor the agent port.
  Result<PortAccess> lookup(std::string_view ref, uint16_t port) const;
  // Whether `credential` opens sandbox `id`'s private ports: its own token or the operator token. An empty
  // credential counts as missing.
  CredentialCheck check_credential(std::string_view id, const std::optional<std::string>& credential) const;
  // Whether `credential` is the operator token: the only credential the TCP API (node.api_listen) accepts.
  CredentialCheck check_operator_token(const std::optional<std::string>& credential) const;

  // Stops serving: opens in flight fail with kUnavailable; with on_shutdown=terminate every sandbox is
  // terminated (bounded wait), otherwise they keep running to be adopted by the next node. `done` runs
  // on the loop once that is finished.
  void shutdown(std::function<void()> done);

  size_t sandbox_count() const { return registry_.size(); }
  // What its sandboxes reserve (node.max_memory_mb, node.max_cpus), for the fleet's node key.
  std::shared_ptr<const Reservations> reservations() const { return registry_.reservations(); }
  // GET /metrics: the node's counters and its sandboxes by state and tier (Prometheus text format).
  std::string metrics_text() const;
  std::string_view default_driver_name() const { return drivers_.front()->name(); }
  std::vector<std::string> driver_names() const;

 private:
  using Sandbox = LiveSandbox;

  SandboxInfo snapshot(const Sandbox& sb) const;
  // create() once a snapshot's layers are verified (or when none is named).
  // `claimed`: the fleet has given this create its name (or there is no fleet).
  void create_now(const CreateRequest& request, SandboxCallback done, bool claimed = false);
  void checkpoint_filesystem(Sandbox& sb, CheckpointCallback done);
  // A memory checkpoint, or a filesystem one of a VM booted on a disk: files the driver writes.
  void checkpoint_vm(Sandbox& sb, std::string_view type, CheckpointCallback done);
  void on_checkpoint_done(const std::string& id);
  Driver& driver(const Sandbox& sb) const;
  Driver* find_driver(std::string_view name) const;

  // The one way a state changes: checked against the state machine, persisted, published. A refusal (an
  // illegal change: a bug or a race between operations) is logged and returned; every caller handles it.
  [[nodiscard]] Status transition(Sandbox& sb, SandboxState to, std::string reason);
  // A transition whose refusal leaves the sandbox where nothing else can make it sane: failed, with the
  // refusal as its reason (failed is reachable from every state but terminated). False if it was refused.
  bool transition_or_fail(Sandbox& sb, SandboxState to, std::string reason);
  void persist(const Sandbox& sb);
  void touch(Sandbox& sb);
  // The same at given times (steady for the idle clock, wall for the record): an activity report reads the
  // clocks once for all its sandboxes.
  void touch(Sandbox& sb, std::chrono::steady_clock::time_point now, int64_t wall_ms);
  void start_idle_clock(Sandbox& sb);
  void start_hibernate_clock(Sandbox& sb);
  void watch(Sandbox& sb);

  void on_started(const std::string& id, Result<RuntimeInfo> runtime);
  void begin_suspend(Sandbox& sb, std::string reason);
  void on_pause_done(const std::string& id, Status status);
  void begin_hibernate(Sandbox& sb, std::string reason);
  void on_hibernate_done(const std::string& id, Result<RuntimeInfo> runtime);
  // Something wants the sandbox running: resume it, or cancel / follow up a suspension in flight.
  void wake(Sandbox& sb, std::string reason);
  // After a resume or restore: the idle clock from now, or from the early-wake grace (Node::prewake).
  void touch_after_wake(Sandbox& sb);
  // An open of a running sandbox: whether a ClientHello's wake was for it (and it is used up).
  bool took_early_wake(Sandbox& sb, std::chrono::steady_clock::time_point now);
  void begin_resume(Sandbox& sb, std::string reason);
  void on_resume_done(const std::string& id, Status status);
  void on_restore_done(const std::string& id, Result<RuntimeInfo> runtime);
  void begin_terminate(Sandbox& sb, std::string reason);
  void on_terminated(const std::string& id, Status status);
  void on_exit(const std::string& id);
  // The idle policy: a running sandbox's clock ran out (suspend or terminate), or a suspended one's
  // hibernation delay did.
  void on_idle(const std::string& id);
  void on_connections_changed(const std::string& id, uint64_t before, uint64_t total);
  // node_reconcile.cc: settles a live instance's recorded state with what the driver sees.
  void adopt(Sandbox& sb, bool paused);
  void adopt_hibernated(Sandbox& sb);
  void forget(const std::string& id);

  Result<OpenedPort> open_port(Sandbox& sb, uint16_t port, bool woke, IdleTracker::TimePoint started);
  void serve_waiters(Sandbox& sb);
  void fail_waiters(Sandbox& sb, const Failure& failure);

  void publish(const Sandbox* sb, std::string reason);
  IdleTracker::Duration report_ttl() const;
  void maybe_finish_shutdown();
  void finish_shutdown();
  static std::string image_user_label(const SandboxSpec& spec);

  uv_loop_t* loop_;
  const ConfigHolder* config_;
  std::vector<std::unique_ptr<Driver>> drivers_;
  std::unique_ptr<Store> store_;
  const snapshot::ImageStore* images_ = nullptr;
  SnapshotService* snapshots_ = nullptr;
  FleetHooks* fleet_ = nullptr;
  // Callbacks from the thread pool (checkpoints) check it: a Node destroyed meanwhile has nothing to settle.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::shared_ptr<ImageUsers> image_users_ = std::make_shared<ImageUsers>();
  NodeMetrics metrics_;
  SandboxRegistry registry_;
  RouteEvents route_events_;
  NetnsVouchers vouchers_;  // the namespaces sent with spares, for the proxy's socket maker
  bool vouch_failure_said_ = false;
  IdleClocks idle_;
  ConnectionReports reports_;
  WakeWaiters waiters_;
  PrewakeGate prewake_gate_;
  // Who waits for a lifecycle operation: create()'s caller until the start settles, remove()'s callers.
  std::unordered_map<std::string, SandboxCallback> creates_;
  std::unordered_map<std::string, std::vector<SandboxCallback>> removals_;
  uv_timer_t* shutdown_timer_;
  std::string operator_token_sha256_;  // empty: no operator token configured
  size_t terminating_count_ = 0;  // sandboxes with a terminate in flight
  bool shutting_down_ = false;
  std::function<void()> shutdown_done_;
};

}  // namespace sg
