#include "noderuntime/node.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <utility>

#include "common/failpoint.h"
#include "common/operator_token.h"
#include "common/token_digest.h"
#include "common/vouched_netns.h"
#include "noderuntime/names.h"
#include "noderuntime/port_exposure.h"
#include "noderuntime/state_machine.h"
#include "noderuntime/uv_handles.h"

namespace sg {
namespace {

using Clock = IdleTracker::Clock;
using S = SandboxState;

// A terminate that hangs must not keep the daemon from exiting; whatever is left is adopted next start.
constexpr uint64_t kShutdownTerminateTimeoutMs = 15'000;
// A worker's connection count lives this many report intervals past its last report (a few missed reports
// are a slow proxy, not a dead one).
constexpr int kReportTtlIntervals = 10;

// A sandbox's key in the fleet: its name, or its id when it has none.
std::string fleet_key(const LiveSandbox& sb) { return sb.rec.spec.name.empty() ? sb.id() : sb.rec.spec.name; }

int64_t wall_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string describe_ports(const SandboxSpec& spec) {
  std::string out;
  for (uint16_t p : spec.exposed_ports) out += (out.empty() ? "" : ", ") + std::to_string(p);
  if (spec.agent_port != 0) out += (out.empty() ? "" : ", ") + std::to_string(spec.agent_port) + " (agent)";
  if (sandbox_port(spec, kSshPort) != kSshPort) out += (out.empty() ? "" : ", ") + std::string("22 (ssh, the agent's)");
  return out.empty() ? "none" : out;
}

}  // namespace

Node::Node(uv_loop_t* loop, const ConfigHolder* config, std::vector<std::unique_ptr<Driver>> drivers,
           std::unique_ptr<Store> store)
    : loop_(loop),
      config_(config),
      drivers_(std::move(drivers)),
      store_(std::move(store)),
      vouchers_(vouched_netns_dir(config->get()->node_socket)),
      idle_(loop, [this](const std::string& id) { on_idle(id); }),
      reports_(loop, [this] { return report_ttl(); },
               [this](const std::string& id, uint64_t before, uint64_t total) {
                 on_connections_changed(id, before, total);
               }),
      waiters_(loop),
      shutdown_timer_(new uv_timer_t) {
  uv_timer_init(loop_, shutdown_timer_);
  shutdown_timer_->data = this;
}

Node::~Node() { close_and_free(shutdown_timer_); }

// ---- lookup and snapshots ----

Driver* Node::find_driver(std::string_view name) const {
  for (const auto& d : drivers_)
    if (d->name() == name) return d.get();
  return nullptr;
}

// Every live sandbox's driver exists: create checks the name and reconcile fails rows whose driver is gone.
Driver& Node::driver(const Sandbox& sb) const { return *find_driver(sb.rec.spec.driver); }

std::vector<std::string> Node::driver_names() const {
  std::vector<std::string> names;
  for (const auto& d : drivers_) names.emplace_back(d->name());
  return names;
}

SandboxInfo Node::snapshot(const Sandbox& sb) const {
  SandboxInfo info;
  info.spec = sb.rec.spec;
  info.state = sb.rec.state;
  info.state_reason = sb.rec.state_reason;
  info.runtime = sb.rec.runtime;
  info.created_at_ms = sb.rec.created_at_ms;
  info.last_activity_at_ms = sb.rec.last_activity_at_ms;
  info.connections = reports_.total(sb.id());
  info.resumes = sb.resumes;
  bool suspended_state = sb.rec.state == S::kSuspending || sb.rec.state == S::kSuspended || sb.rec.state == S::kResuming;
  info.tier = suspended_state ? sb.rec.tier : SuspendTier::kNone;
  if (sb.terminating) return info;
  if (auto deadline = idle_.deadline(sb.id())) {
    auto remaining = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now());
    int64_t at_ms = wall_now_ms() + remaining.count();
    if (sb.rec.state == S::kRunning) {
      info.idle_deadline_at_ms = at_ms;
      info.next_transition = sb.rec.spec.ephemeral ? "terminate" : "suspend";
    } else {
      info.next_transition = "hibernate";
    }
    info.next_transition_at_ms = at_ms;
  }
  return info;
}

std::vector<SandboxInfo> Node::list() const {
  std::vector<SandboxInfo> out;
  out.reserve(registry_.size());
  for (const Sandbox* sb : registry_.all()) out.push_back(snapshot(*sb));
  std::sort(out.begin(), out.end(), [](const SandboxInfo& a, const SandboxInfo& b) {
    return a.created_at_ms != b.created_at_ms ? a.created_at_ms < b.created_at_ms : a.spec.id < b.spec.id;
  });
  return out;
}

Result<SandboxInfo> Node::get(std::string_view ref) const {
  Sandbox* sb = registry_.find(ref);
  if (sb == nullptr) return fail(Error::kNotFound, "no sandbox '" + std::string(ref) + "'");
  return snapshot(*sb);
}

// ---- create ----

void Node::create(const CreateRequest& request, SandboxCallback done) {
  if (shutting_down_) return done(fail(Error::kUnavailable, "node is shutting down"));
  if (!request.snapshot_id || snapshots_ == nullptr) return create_now(request, std::move(done));
  if (auto id = snapshot::check_snapshot_id(*request.snapshot_id); !id) return done(fail(id.error(), "snapshot_id: " + id.message()));
  // A damaged checkpoint layer is refused before a sandbox stacks on it (hashing runs on the thread pool).
  snapshots_->verify(*request.snapshot_id, [this, alive = std::weak_ptr<bool>(alive_), request,
                                            done = std::move(done)](Status verified) mutable {
    if (alive.expired()) return;
    if (!verified) return done(verified.failure());
    create_now(request, std::move(done));
  });
}

void Node::create_now(const CreateRequest& request, SandboxCallback done, bool claimed) {
  if (shutting_down_) return done(fail(Error::kUnavailable, "node is shutting down"));
  auto cfg = config_->get();
  auto spec = make_sandbox_spec(request, CreateContext{*cfg, drivers_, images_, snapshots_});
  if (!spec) return done(spec.failure());
  if (registry_.size() >= cfg->node.max_sandboxes)
    return done(fail(Error::kLimitExceeded, "this node already has " + std::to_string(registry_.size()) +
                                                " sandboxes (node.max_sandboxes)"));
  if (Status room = reservation_fits(*registry_.reservations(), cfg->node, *spec); !room) return done(room.failure());
  if (!spec->name.empty()) {
    if (const std::string* taken = registry_.id_of(spec->name))
      return done(fail(Error::kAlreadyExists, "name '" + spec->name + "' is already used by " + *taken +
                                                  (fleet_ != nullptr ? " on node '" + fleet_->node_name() + "'" : "")));
  }
  if (fleet_ != nullptr && !claimed) {
    if (Status s = fleet_->admit(FleetAdmission::kCreate); !s) return done(s.failure());
    if (!spec->name.empty()) {
      // The name is claimed fleet-wide first (in etcd, off the loop); the create then runs again from the
      // top, so whatever changed meanwhile (config, this node's own names) is checked once more.
      std::string name = spec->name;
      fleet_->claim(name, [this, alive = std::weak_ptr<bool>(alive_), request, name,
                           done = std::move(done)](Status got) mutable {
        if (alive.expired()) return;
        if (!got) return done(got.failure());
        create_now(
            request,
            [this, name, done = std::move(done)](Result<SandboxInfo> r) {
              // A create that failed before its sandbox existed gives the name back.
              if (!r && fleet_ != nullptr && registry_.id_of(name) == nullptr) fleet_->publish(name, "terminated", {});
              done(std::move(r));
            },
            true);
      });
      return;
    }
  }
  spec->id = registry_.new_id();
  std::string token = generate_token();
  spec->token_sha256 = token_digest(token);
  auto uid_base = registry_.free_uid_base(cfg->node.uid_range_base);
  if (!uid_base) return done(uid_base.failure());
  spec->uid_base = *uid_base;
  // A user of its image from here on, then the image confirmed: an `image rm` running meanwhile either sees
  // this sandbox and refuses, or has claimed or removed the image, and then this create is refused.
  const std::string image_user = image_user_label(*spec);
  if (Status s = image_users_->add(spec->image, image_user); !s) return done(s.failure());
  if (images_ != nullptr && !spec->image.empty()) {
    if (auto image = images_->get(spec->image); !image) {
      image_users_->remove(spec->image, image_user);
      if (image.error() != Error::kNotFound) return done(image.failure());
      return done(fail(Error::kNotFound, "image: no image '" + spec->image + "' on this node (removed just now)"));
    }
  }

  std::error_code ec;
  std::string parent = cfg->node.state_dir + "/sandboxes";
  std::filesystem::create_directories(parent, ec);
  std::string dir = parent + "/" + spec->id;
  if (ec || (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)) {
    image_users_->remove(spec->image, image_user);
    return done(fail(Error::kIo, "cannot create " + dir + ": " + (ec ? ec.message() : std::strerror(errno))));
  }

  auto owned = std::make_unique<Sandbox>();
  owned->rec.spec = std::move(*spec);
  owned->rec.state = S::kCreating;
  owned->rec.state_reason = "created";
  owned->rec.runtime.sandbox_dir = dir;
  owned->rec.created_at_ms = owned->rec.last_activity_at_ms = wall_now_ms();
  // Persisted before anything runs: a crash between start and the next write leaves a record to reconcile.
  if (auto s = store_->upsert(owned->rec); !s) {
    std::filesystem::remove_all(dir, ec);
    image_users_->remove(owned->rec.spec.image, image_user);
    return done(s.failure());
  }
  failpoint("after:creating");
  Sandbox& sb = registry_.add(std::move(owned));
  const std::string id = sb.id();
  if (!sb.rec.spec.snapshot.empty()) {
    std::string snap = sb.rec.spec.snapshot;
    if (auto s = snapshots_->add_user(snap, image_user); !s) {
      forget(id);  // `sb` is gone from here on (its image user with it)
      return done(fail(s.error(), "snapshot " + snap + " was removed while the sandbox was created: " + s.message()));
    }
  }
  sb.starting = true;
  sb.new_token = std::move(token);
  creates_[id] = std::move(done);
  driver(sb).start(sb.rec.spec, dir, [this, id](Result<RuntimeInfo> r) { on_started(id, std::move(r)); });
}

void Node::on_started(const std::string& id, Result<RuntimeInfo> runtime) {
  Sandbox* found = registry_.by_id(id);
  if (found == nullptr) return;
  Sandbox& sb = *found;
  sb.starting = false;
  SandboxCallback created;
  if (auto it = creates_.find(id); it != creates_.end()) {
    created = std::move(it->second);
    creates_.erase(it);
  }
  std::string token = std::move(sb.new_token);  // moved, not copied: no second copy lingers in the record
  if (sb.terminating) {
    // Deleted (or the node shut down) while starting: the terminate was held back until now.
    if (created) created(fail(Error::kConflict, "sandbox " + id + " was deleted while it was starting"));
    if (!runtime) return on_terminated(id, {});
    sb.rec.runtime = std::move(*runtime);
    driver(sb).terminate(sb.rec.spec, sb.rec.runtime, [this, id](Status s) { on_terminated(id, std::move(s)); });
    return;
  }
  if (!runtime) {
    // Nothing lingers after a failed start: the caller gets the error and can retry with the same name.
    metrics_.created(false);
    fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + " failed to start: " + runtime.message()));
    if (Status s = transition(sb, S::kTerminated, "start failed: " + runtime.message()); !s)
      spdlog::error("sandbox {}: forgotten anyway: nothing runs", id);
    forget(id);
    if (created) created(fail(runtime.error(), "cannot start sandbox: " + runtime.message()));
    return;
  }
  sb.rec.runtime = std::move(*runtime);
  metrics_.created(true);
  if (!transition_or_fail(sb, S::kRunning, "started")) {
    fail_waiters(sb, fail(Error::kInternal, "sandbox " + id + ": " + sb.rec.state_reason));
    if (created) created(fail(Error::kInternal, "sandbox " + id + ": " + sb.rec.state_reason));
    return;
  }
  watch(sb);
  serve_waiters(sb);
  if (!created) return;
  SandboxInfo info = snapshot(sb);
  info.token = std::move(token);
  created(std::move(info));
}

// ---- transitions ----

Status Node::transition(Sandbox& sb, SandboxState to, std::string reason) {
  SandboxState from = sb.rec.state;
  if (auto s = check_transition(from, to); !s) {
    spdlog::error("sandbox {}: {} ({})", sb.id(), s.message(), reason);
    return s;
  }
  // Tests kill the node on either side of each transition's write (docs/tests.md#failpoints).
  const std::string edge = failpoints_armed() ? std::string(state_name(from)) + "->" + std::string(state_name(to)) : "";
  if (!edge.empty()) failpoint("before:" + edge);
  sb.rec.state = to;
  sb.rec.state_reason = std::move(reason);
  if (to == S::kFailed) registry_.release_reservation(sb);  // it cannot run again
  if (to == S::kSuspending) sb.suspended_at = route_events_.stamp();  // also for a sandbox adopted paused
  // Proxies route to running sandboxes from their caches; anything else must go through open() again.
  if (from == S::kRunning && to != S::kRunning) publish(&sb, std::string(state_name(to)));
  spdlog::info("sandbox {}: {} -> {} ({})", sb.id(), state_name(from), state_name(to), sb.rec.state_reason);
  // One idle clock per sandbox: running -> idle timeout, suspended in memory -> hibernation.
  idle_.remove(sb.id());
  if (to == S::kRunning) {
    sb.rec.tier = SuspendTier::kNone;
    start_idle_clock(sb);
  }
  if (to == S::kSuspended && sb.rec.tier == SuspendTier::kMemory) start_hibernate_clock(sb);
  if (to != S::kTerminated) persist(sb);  // a terminated sandbox's row is erased by forget()
  if (!edge.empty()) failpoint("after:" + edge);
  // What the fleet's proxies route by: the settled states (the transient ones would only add writes).
  if (fleet_ != nullptr && (to == S::kRunning || to == S::kSuspended || to == S::kFailed || to == S::kTerminated))
    fleet_->publish(fleet_key(sb), state_name(to), fleet_port_routes(sb.rec.spec));
  return {};
}

bool Node::transition_or_fail(Sandbox& sb, SandboxState to, std::string reason) {
  Status s = transition(sb, to, std::move(reason));
  if (s) return true;
  if (sb.rec.state != S::kFailed && sb.rec.state != S::kTerminated) {
    // Legal from every live state: the sandbox is marked broken rather than left in a state nobody settles.
    if (!transition(sb, S::kFailed, "internal error: " + s.message()))
      spdlog::error("sandbox {}: cannot even be marked failed", sb.id());
  }
  return false;
}

void Node::persist(const Sandbox& sb) {
  // The in-memory record stays authoritative; the next transition writes it again, and reconcile
  // re-derives states from the live instances anyway.
  if (auto s = store_->upsert(sb.rec); !s) spdlog::error("sandbox {}: cannot persist state: {}", sb.id(), s.message());
}

void Node::start_idle_clock(Sandbox& sb) {
  idle_.start(sb.id(), std::chrono::seconds(sb.rec.spec.timeout_secs), reports_.total(sb.id()) > 0);
}

void Node::start_hibernate_clock(Sandbox& sb) {
  if (sb.rec.spec.hibernate_after_secs == 0 || !driver(sb).capabilities().hibernate) return;
  idle_.start(sb.id(), std::chrono::seconds(sb.rec.spec.hibernate_after_secs));
}

void Node::touch(Sandbox& sb) { touch(sb, Clock::now(), wall_now_ms()); }

void Node::touch(Sandbox& sb, Clock::time_point now, int64_t wall_ms) {
  sb.rec.last_activity_at_ms = wall_ms;
  idle_.touch(sb.id(), now);
}

void Node::touch_after_wake(Sandbox& sb) {
  const auto now = Clock::now();
  const auto timeout = std::chrono::seconds(sb.rec.spec.timeout_secs);
  // Woken by a ClientHello alone (no open waits): that is not activity, so the idle clock gives the request
  // it announced kEarlyWakeGrace to come, not a whole timeout; the open that comes touches it as usual.
  if (sb.woken_early_at && !waiters_.any(sb.id()) && timeout > kEarlyWakeGrace) {
    idle_.start(sb.id(), timeout, reports_.total(sb.id()) > 0, now - (timeout - kEarlyWakeGrace));
    return;
  }
  touch(sb, now, wall_now_ms());
}

bool Node::took_early_wake(Sandbox& sb, Clock::time_point now) {
  auto at = std::exchange(sb.woken_early_at, std::nullopt);
  return at && now - *at <= kEarlyWakeGrace;
}

void Node::watch(Sandbox& sb) {
  auto s = driver(sb).watch_exit(sb.rec.spec, sb.rec.runtime, [this, id = sb.id()] { on_exit(id); });
  if (!s) {
    spdlog::warn("sandbox {}: cannot watch for exit: {}", sb.id(), s.message());
    return;
  }
  sb.watched = true;
}

void Node::begin_suspend(Sandbox& sb, std::string reason) {
  sb.rec.tier = SuspendTier::kMemory;
  if (!transition(sb, S::kSuspending, std::move(reason))) return;  // still where it was, and logged
  sb.pending_wake.reset();
  sb.cancel_requested = false;
  sb.woken_early_at.reset();
  driver(sb).pause(sb.rec.spec, sb.rec.runtime, [this, id = sb.id()](Status s) { on_pause_done(id, std::move(s)); });
}

void Node::on_pause_done(const std::string& id, Status status) {
  Sandbox* found = registry_.by_id(id);
  // Overtaken while the freeze ran: deleted, or the process exited. Nothing left to settle.
  if (found == nullptr || found->terminating || found->rec.state != S::kSuspending) return;
  Sandbox& sb = *found;
  if (!status) {
    std::string reason = sb.cancel_requested && sb.pending_wake ? "suspend cancelled: " + *sb.pending_wake
                                                                : "suspend failed, still running: " + status.message();
    if (!sb.cancel_requested) spdlog::warn("sandbox {}: suspend failed: {}", id, status.message());
    sb.pending_wake.reset();
    if (!transition_or_fail(sb, S::kRunning, std::move(reason)))
      return fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + ": " + sb.rec.state_reason));
    touch(sb);
    serve_waiters(sb);
    return;
  }
  metrics_.suspended(SuspendTier::kMemory);
  if (!transition_or_fail(sb, S::kSuspended, sb.rec.state_reason))
    return fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + ": " + sb.rec.state_reason));
  if (sb.pending_wake) begin_resume(sb, *sb.pending_wake);
}

void Node::begin_hibernate(Sandbox& sb, std::string reason) {
  sb.rec.tier = SuspendTier::kDisk;
  if (!transition(sb, S::kSuspending, std::move(reason))) {
    sb.rec.tier = SuspendTier::kMemory;  // still suspended in memory, as it was
    return;
  }
  sb.pending_wake.reset();
  sb.cancel_requested = false;
  driver(sb).hibernate(sb.rec.spec, sb.rec.runtime,
                       [this, id = sb.id()](Result<RuntimeInfo> r) { on_hibernate_done(id, std::move(r)); });
}

void Node::on_hibernate_done(const std::string& id, Result<RuntimeInfo> runtime) {
  Sandbox* found = registry_.by_id(id);
  // Overtaken: deleted, or the instance died during the hibernation (on_exit failed it).
  if (found == nullptr || found->terminating || found->rec.state != S::kSuspending) return;
  Sandbox& sb = *found;
  bool settled = false;
  if (runtime) {
    sb.rec.runtime = std::move(*runtime);
    sb.watched = false;  // a hibernated instance is gone; its watch ended with it
    metrics_.suspended(SuspendTier::kDisk);
    settled = transition_or_fail(sb, S::kSuspended, sb.rec.state_reason);
  } else {
    // The instance is still paused in memory, so the sandbox is simply suspended in the memory tier; the
    // hibernate clock starts over, which paces retries.
    std::string reason = sb.cancel_requested && sb.pending_wake
                             ? "hibernation cancelled: " + *sb.pending_wake
                             : "hibernate failed, still suspended in memory: " + runtime.message();
    if (!sb.cancel_requested) spdlog::warn("sandbox {}: hibernate failed: {}", id, runtime.message());
    sb.rec.tier = SuspendTier::kMemory;
    settled = transition_or_fail(sb, S::kSuspended, std::move(reason));
  }
  if (!settled) return fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + ": " + sb.rec.state_reason));
  if (sb.pending_wake) begin_resume(sb, *sb.pending_wake);
}

void Node::wake(Sandbox& sb, std::string reason) {
  if (sb.rec.state == S::kSuspended) return begin_resume(sb, std::move(reason));
  if (sb.rec.state != S::kSuspending) return;
  if (!sb.pending_wake) sb.pending_wake = std::move(reason);
  if (!sb.cancel_requested) sb.cancel_requested = driver(sb).cancel(sb.rec.spec);
}

void Node::begin_resume(Sandbox& sb, std::string reason) {
  // Its checkpoint reads the frozen filesystem: the wake follows it (on_checkpoint_done), waiters wait.
  if (sb.checkpointing) {
    if (!sb.pending_wake) sb.pending_wake = std::move(reason);
    return;
  }
  if (Status s = transition(sb, S::kResuming, std::move(reason)); !s) {
    // Nobody would ever serve the opens waiting for this wake.
    sb.pending_wake.reset();
    return fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + sb.id() + " cannot wake: " + s.message()));
  }
  ++sb.resumes;
  sb.wake_started = std::chrono::steady_clock::now();
  sb.pending_wake.reset();
  if (sb.rec.tier == SuspendTier::kDisk) {
    driver(sb).restore(sb.rec.spec, sb.rec.runtime,
                       [this, id = sb.id()](Result<RuntimeInfo> r) { on_restore_done(id, std::move(r)); });
    return;
  }
  driver(sb).resume(sb.rec.spec, sb.rec.runtime, [this, id = sb.id()](Status s) { on_resume_done(id, std::move(s)); });
}

void Node::on_resume_done(const std::string& id, Status status) {
  Sandbox* found = registry_.by_id(id);
  if (found == nullptr || found->terminating || found->rec.state != S::kResuming) return;
  Sandbox& sb = *found;
  if (!status) {
    metrics_.wake_failed(SuspendTier::kMemory);
    if (!transition(sb, S::kFailed, "resume failed: " + status.message()))
      spdlog::error("sandbox {}: resume failed and it cannot be marked failed", id);
    fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + " failed to wake: " + status.message()));
    return;
  }
  metrics_.woke(SuspendTier::kMemory, seconds_since(sb.wake_started));
  if (!transition_or_fail(sb, S::kRunning, sb.rec.state_reason))
    return fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + ": " + sb.rec.state_reason));
  touch_after_wake(sb);
  serve_waiters(sb);
}

void Node::on_restore_done(const std::string& id, Result<RuntimeInfo> runtime) {
  Sandbox* found = registry_.by_id(id);
  if (found == nullptr || found->terminating || found->rec.state != S::kResuming) return;
  Sandbox& sb = *found;
  if (!runtime) {
    // The saved state stays on disk (the driver never deletes it on failure) for inspection or deletion.
    metrics_.wake_failed(SuspendTier::kDisk);
    if (!transition(sb, S::kFailed, "restore from disk failed: " + runtime.message()))
      spdlog::error("sandbox {}: restore failed and it cannot be marked failed", id);
    fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + " failed to wake: " + runtime.message()));
    return;
  }
  sb.rec.runtime = std::move(*runtime);
  // The restored instance is a new process: recorded before the transition, so a node that dies in between
  // finds it running (and adopts it) instead of the old, gone one (NodeKill's QEMU case, before:resuming->running).
  persist(sb);
  metrics_.woke(SuspendTier::kDisk, seconds_since(sb.wake_started));
  if (!transition_or_fail(sb, S::kRunning, sb.rec.state_reason))
    return fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + ": " + sb.rec.state_reason));
  watch(sb);
  touch_after_wake(sb);
  serve_waiters(sb);
}

void Node::begin_terminate(Sandbox& sb, std::string reason) {
  sb.terminating = true;
  // Recorded before the driver acts: a node killed from here on finishes the removal when it restarts.
  if (!sb.rec.terminating) {
    sb.rec.terminating = true;
    persist(sb);
  }
  ++terminating_count_;
  sb.terminate_reason = std::move(reason);
  sb.pending_wake.reset();
  idle_.remove(sb.id());
  if (sb.watched) {
    driver(sb).unwatch(sb.rec.spec);
    sb.watched = false;
  }
  fail_waiters(sb, fail(Error::kNotFound, "sandbox " + sb.id() + " is being terminated"));
  publish(&sb, "terminating");
  spdlog::info("sandbox {}: terminating ({})", sb.id(), sb.terminate_reason);
  if (sb.starting) return;  // on_started terminates it once the driver has answered
  driver(sb).terminate(sb.rec.spec, sb.rec.runtime, [this, id = sb.id()](Status s) { on_terminated(id, std::move(s)); });
}

void Node::on_terminated(const std::string& id, Status status) {
  Sandbox* found = registry_.by_id(id);
  if (found == nullptr) return;
  Sandbox& sb = *found;
  std::vector<SandboxCallback> callbacks;
  if (auto it = removals_.find(id); it != removals_.end()) {
    callbacks = std::move(it->second);
    removals_.erase(it);
  }
  sb.terminating = false;
  --terminating_count_;
  if (status) {
    // Failed -> terminated is legal from every state; a refusal here would leave nothing to keep anyway.
    if (!transition(sb, S::kTerminated, sb.terminate_reason))
      spdlog::error("sandbox {}: its instance is gone; forgotten", id);
    SandboxInfo final_state = snapshot(sb);
    final_state.state = S::kTerminated;
    forget(id);
    for (auto& cb : callbacks) cb(final_state);
  } else {
    std::string reason = "terminate failed: " + status.message();
    spdlog::error("sandbox {}: {}", id, reason);
    if (sb.rec.state == S::kFailed) {
      sb.rec.state_reason = reason;
      persist(sb);
    } else if (!transition(sb, S::kFailed, reason)) {
      spdlog::error("sandbox {}: terminate failed and it cannot be marked failed", id);
    }
    for (auto& cb : callbacks) cb(status.failure());
  }
  maybe_finish_shutdown();
}

void Node::forget(const std::string& id) {
  Sandbox* found = registry_.by_id(id);
  if (found == nullptr) return;
  const StoredSandbox& rec = found->rec;
  if (auto s = store_->erase(id); !s) spdlog::error("sandbox {}: cannot delete its record: {}", id, s.message());
  // Only the directory this node created: the stored path is data, not something to trust blindly.
  std::string expected_dir = config_->get()->node.state_dir + "/sandboxes/" + id;
  if (rec.runtime.sandbox_dir == expected_dir) {
    std::error_code ec;
    std::filesystem::remove_all(expected_dir, ec);
    if (ec) spdlog::warn("sandbox {}: cannot remove {}: {}", id, expected_dir, ec.message());
  }
  reports_.forget(id);
  idle_.remove(id);
  prewake_gate_.forget(id);
  image_users_->remove(rec.spec.image, image_user_label(rec.spec));
  if (snapshots_ != nullptr && !rec.spec.snapshot.empty()) snapshots_->remove_user(rec.spec.snapshot, image_user_label(rec.spec));
  registry_.erase(id);
}

std::string Node::metrics_text() const {
  std::vector<std::pair<SandboxState, SuspendTier>> states;
  states.reserve(registry_.size());
  for (const Sandbox* sb : registry_.all()) states.emplace_back(sb->rec.state, sb->rec.tier);
  return metrics_.render(states);
}

std::string Node::image_user_label(const SandboxSpec& spec) {
  return "sandbox " + (spec.name.empty() ? spec.id : spec.name + " (" + spec.id + ")");
}

void Node::on_exit(const std::string& id) {
  Sandbox* found = registry_.by_id(id);
  if (found == nullptr || found->terminating) return;
  Sandbox& sb = *found;
  sb.watched = false;  // the driver reports an exit once
  spdlog::warn("sandbox {}: process exited on its own", id);
  if (sb.rec.spec.ephemeral) {
    begin_terminate(sb, "exited on its own");  // releases what the instance left behind
    return;
  }
  sb.pending_wake.reset();
  if (sb.rec.state != S::kFailed && !transition(sb, S::kFailed, "the sandbox's process exited on its own"))
    spdlog::error("sandbox {}: exited, and cannot be marked failed", id);
  fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + " exited"));
}

// ---- API operations ----

Result<TransitionOutcome> Node::suspend(std::string_view ref) {
  auto found = registry_.find_usable(ref);
  if (!found) return found.failure();
  Sandbox& sb = **found;
  if (sb.rec.spec.ephemeral)
    return fail(Error::kInvalidArgument,
                "sandbox " + sb.id() + " is ephemeral: it is terminated when idle, never suspended");
  if (!driver(sb).capabilities().pause)
    return fail(Error::kUnsupported, "the " + sb.rec.spec.driver + " driver cannot suspend sandboxes");
  switch (sb.rec.state) {
    case S::kRunning:
      if (sb.checkpointing)
        return fail(Error::kConflict, "sandbox " + sb.id() + " is being checkpointed; suspend it once that is done");
      begin_suspend(sb, "suspended on request");
      if (sb.rec.state != S::kSuspending)
        return fail(Error::kInternal, "sandbox " + sb.id() + " could not begin its suspend (see the node's log)");
      return TransitionOutcome{true, snapshot(sb)};
    case S::kSuspending:
    case S::kSuspended:
      // The latest explicit wish wins over an earlier resume request; waiting opens still get their wake.
      if (!waiters_.any(sb.id())) sb.pending_wake.reset();
      return TransitionOutcome{false, snapshot(sb)};
    default:
      return fail(Error::kConflict, "sandbox " + sb.id() + " is " + std::string(state_name(sb.rec.state)) +
                                        "; only a running sandbox can be suspended");
  }
}

Result<TransitionOutcome> Node::resume(std::string_view ref) {
  auto found = registry_.find_usable(ref);
  if (!found) return found.failure();
  Sandbox& sb = **found;
  if (sb.rec.spec.ephemeral)
    return fail(Error::kInvalidArgument, "sandbox " + sb.id() + " is ephemeral: it never suspends");
  switch (sb.rec.state) {
    case S::kSuspended:
      if (fleet_ != nullptr)
        if (Status s = fleet_->admit(FleetAdmission::kWake); !s) return s.failure();
      begin_resume(sb, "resumed on request");
      if (sb.rec.state != S::kResuming && !sb.checkpointing)
        return fail(Error::kInternal, "sandbox " + sb.id() + " could not begin its resume (see the node's log)");
      return TransitionOutcome{true, snapshot(sb)};
    case S::kSuspending:
      if (fleet_ != nullptr)
        if (Status s = fleet_->admit(FleetAdmission::kWake); !s) return s.failure();
      wake(sb, "resumed on request");
      return TransitionOutcome{true, snapshot(sb)};
    case S::kRunning:
    case S::kResuming:
      return TransitionOutcome{false, snapshot(sb)};
    default:
      return fail(Error::kConflict, "sandbox " + sb.id() + " is " + std::string(state_name(sb.rec.state)) +
                                        "; it cannot be resumed");
  }
}

void Node::remove(std::string_view ref, SandboxCallback done) {
  Sandbox* sb = registry_.find(ref);
  if (sb == nullptr) return done(fail(Error::kNotFound, "no sandbox '" + std::string(ref) + "'"));
  removals_[sb->id()].push_back(std::move(done));
  if (!sb->terminating) begin_terminate(*sb, "deleted on request");
}

void Node::open(std::string_view ref, uint16_t port, uint32_t wake_timeout_ms, OpenCallback done) {
  Clock::time_point started = Clock::now();
  if (shutting_down_) return done(fail(Error::kUnavailable, "node is shutting down"));
  auto found = registry_.find_usable(ref);
  if (!found) return done(found.failure());
  Sandbox& sb = **found;
  if (!port_policy(sb.rec.spec, port))
    return done(fail(Error::kPermissionDenied, "port not exposed: sandbox " + sb.id() + " exposes " +
                                                   describe_ports(sb.rec.spec) + ", not " + std::to_string(port)));
  touch(sb);
  switch (sb.rec.state) {
    case S::kRunning:
      return done(open_port(sb, port, took_early_wake(sb, started), started));
    case S::kFailed:
      return done(fail(Error::kUnavailable, "sandbox " + sb.id() + " failed: " + sb.rec.state_reason));
    case S::kTerminated:
      return done(fail(Error::kUnavailable, "sandbox " + sb.id() + " is " + std::string(state_name(sb.rec.state))));
    case S::kSuspending:
    case S::kSuspended:
      // A fenced node wakes nothing: etcd may already be handing this node's names to others.
      if (fleet_ != nullptr)
        if (Status s = fleet_->admit(FleetAdmission::kWake); !s) return done(s.failure());
      break;
    case S::kCreating:
    case S::kResuming:
      break;
  }
  // Served once the sandbox runs: the socket is opened then, for the sandbox as it is then.
  waiters_.add(sb.id(), wake_timeout_ms, [this, id = sb.id(), port, started, done = std::move(done)](Status woke) {
    if (!woke) return done(woke.failure());
    Sandbox* now = registry_.by_id(id);
    if (now == nullptr || now->rec.state != S::kRunning)
      return done(fail(Error::kUnavailable, "sandbox " + id + " is not running"));
    now->woken_early_at.reset();
    done(open_port(*now, port, true, started));
  });
  wake(sb, "woken by a connection to port " + std::to_string(port));
}

void Node::credential_verified(std::string_view id, std::string_view client) {
  if (registry_.contains(std::string(id))) prewake_gate_.verified(id, client, Clock::now());
}

Node::PrewakeOutcome Node::prewake(std::string_view ref, uint16_t port, std::string_view client) {
  if (shutting_down_) return PrewakeOutcome::kUnavailable;
  auto found = registry_.find_usable(ref);
  if (!found) return PrewakeOutcome::kUnavailable;
  Sandbox& sb = **found;
  auto policy = port_policy(sb.rec.spec, port);
  if (!policy) return PrewakeOutcome::kUnavailable;
  if (sb.rec.state == S::kRunning || sb.rec.state == S::kResuming || sb.rec.state == S::kCreating)
    return PrewakeOutcome::kNotAsleep;
  if (sb.rec.state != S::kSuspended && sb.rec.state != S::kSuspending) return PrewakeOutcome::kUnavailable;
  const std::chrono::seconds window(config_->get()->node.prewake_window_secs);
  if (!policy->is_public && !prewake_gate_.admits(sb.id(), client, Clock::now(), window)) {
    metrics_.prewake(false);
    return PrewakeOutcome::kRefused;
  }
  if (fleet_ != nullptr)
    if (Status s = fleet_->admit(FleetAdmission::kWake); !s) return PrewakeOutcome::kUnavailable;
  metrics_.prewake(true);
  sb.woken_early_at = Clock::now();
  wake(sb, "woken at a ClientHello for port " + std::to_string(port));
  return PrewakeOutcome::kWoke;
}

Result<PortAccess> Node::lookup(std::string_view ref, uint16_t port) const {
  auto found = registry_.find_usable(ref);
  if (!found) return found.failure();
  const Sandbox& sb = **found;
  auto policy = port_policy(sb.rec.spec, port);
  if (!policy)
    return fail(Error::kPermissionDenied, "port not exposed: sandbox " + sb.id() + " exposes " +
                                              describe_ports(sb.rec.spec) + ", not " + std::to_string(port));
  return PortAccess{sb.id(), sb.rec.spec.name, port, policy->protocol, policy->is_public};
}

CredentialCheck Node::check_credential(std::string_view id, const std::optional<std::string>& credential) const {
  if (!credential || credential->empty()) return CredentialCheck::kMissing;
  Sandbox* sb = registry_.find(id);
  // Both digests are always compared, so the answer's timing does not tell which of the two a guess matched.
  bool sandbox_token = sb != nullptr && token_matches_digest(*credential, sb->rec.spec.token_sha256);
  bool operator_token = token_matches_digest(*credential, operator_token_sha256_);
  return sandbox_token || operator_token ? CredentialCheck::kAccepted : CredentialCheck::kInvalid;
}

CredentialCheck Node::check_operator_token(const std::optional<std::string>& credential) const {
  if (!credential || credential->empty()) return CredentialCheck::kMissing;
  return token_matches_digest(*credential, operator_token_sha256_) ? CredentialCheck::kAccepted : CredentialCheck::kInvalid;
}

ActivityAnswer Node::activity(const std::vector<ActivityReport>& reports) {
  const Clock::time_point now = Clock::now();
  const int64_t wall_ms = wall_now_ms();
  ActivityAnswer answer;
  for (const ActivityReport& r : reports) {
    Sandbox* sb = registry_.find(r.id);
    if (sb == nullptr || sb->terminating) continue;  // reports may trail a delete; nothing to account
    reports_.report(sb->id(), r.reporter, r.connections, now);
    // A report carries bytes moved up to an interval ago, so it cannot tell traffic after a suspend from
    // traffic before it: it never wakes. Whatever asks for a sleeping sandbox comes through open().
    if (sb->rec.state == S::kRunning && (r.bytes_in != 0 || r.bytes_out != 0)) touch(*sb, now, wall_ms);
    if (sb->rec.state == S::kSuspending || sb->rec.state == S::kSuspended)
      answer.asleep.push_back(AsleepSandbox{sb->id(), sb->suspended_at});
    // Announced for as long as a live proxy must have reported once (the report TTL); cutting is idempotent.
    if (sb->token_rotated_at != 0 && now - sb->token_rotated_clock < report_ttl())
      answer.revoked.push_back(RevokedToken{sb->id(), sb->token_rotated_at});
    std::erase_if(sb->closed_ports, [&](const Sandbox::Closed& c) { return now - c.clock >= report_ttl(); });
    for (const Sandbox::Closed& c : sb->closed_ports) answer.closed.push_back(ClosedPort{sb->id(), c.port, c.stamp});
  }
  return answer;
}

Result<SandboxInfo> Node::rotate_token(std::string_view ref) {
  auto found = registry_.find_usable(ref);
  if (!found) return found.failure();
  Sandbox& sb = **found;
  std::string token = generate_token();
  const std::string before = sb.rec.spec.token_sha256;
  sb.rec.spec.token_sha256 = token_digest(token);
  // Persisted before anyone sees the new token: a node restart must not bring the old one back.
  if (auto s = store_->upsert(sb.rec); !s) {
    sb.rec.spec.token_sha256 = before;
    return fail(Error::kIo, "sandbox " + sb.id() + ": cannot store the new token: " + s.message());
  }
  sb.token_rotated_at = route_events_.stamp();
  sb.token_rotated_clock = Clock::now();
  prewake_gate_.forget(sb.id());  // those addresses showed the old token
  publish(&sb, "token");
  spdlog::info("sandbox {}: token rotated", sb.id());
  SandboxInfo info = snapshot(sb);
  info.token = std::move(token);
  return info;
}

void Node::expose_port(std::string_view ref, int64_t port, const ExposeRequest& request, SandboxCallback done) {
  auto found = registry_.find_usable(ref);
  if (!found) return done(found.failure());
  Sandbox& sb = **found;
  if ((sb.rec.state != S::kRunning && sb.rec.state != S::kSuspended) || sb.checkpointing)
    return done(fail(Error::kConflict, "sandbox " + sb.id() + " is " +
                                           std::string(sb.checkpointing ? "being checkpointed"
                                                                        : state_name(sb.rec.state)) +
                                           "; expose a port once it is running or suspended"));
  auto checked = with_port_exposed(sb.rec.spec, port, request, kMaxExposedPorts);
  if (!checked) return done(checked.failure());
  const auto p = static_cast<uint16_t>(port);
  driver(sb).forward_port(sb.rec.spec, sb.rec.runtime, p, [this, id = sb.id(), port, request, p,
                                                           done = std::move(done)](Status forwarded) {
    Sandbox* now = registry_.by_id(id);
    if (now == nullptr || now->terminating) return done(fail(Error::kNotFound, "sandbox " + id + " is gone"));
    if (!forwarded)
      return done(fail(forwarded.error(), "sandbox " + id + ": cannot forward port " + std::to_string(p) + ": " +
                                              forwarded.message()));
    // Again, on the spec as it is now: another change may have landed while the driver worked.
    auto next = with_port_exposed(now->rec.spec, port, request, kMaxExposedPorts);
    if (!next) return done(next.failure());
    SandboxSpec before = now->rec.spec;
    now->rec.spec = std::move(*next);
    if (auto s = store_->upsert(now->rec); !s) {
      now->rec.spec = std::move(before);
      return done(fail(Error::kIo, "sandbox " + id + ": cannot store its ports: " + s.message()));
    }
    publish(now, "ports");
    if (fleet_ != nullptr) fleet_->publish_ports(fleet_key(*now), fleet_port_routes(now->rec.spec));
    spdlog::info("sandbox {}: port {} exposed ({})", id, p, describe_ports(now->rec.spec));
    done(snapshot(*now));
  });
}

void Node::ssh_keys_changed() {
  for (Sandbox* sb : registry_.all())
    if (sb->rec.state == S::kRunning && !sb->terminating) driver(*sb).ssh_keys_changed(sb->rec.spec, sb->rec.runtime);
}

Result<SandboxInfo> Node::close_port(std::string_view ref, int64_t port) {
  auto found = registry_.find_usable(ref);
  if (!found) return found.failure();
  Sandbox& sb = **found;
  auto next = with_port_closed(sb.rec.spec, port);
  if (!next) return next.failure();
  SandboxSpec before = sb.rec.spec;
  sb.rec.spec = std::move(*next);
  if (auto s = store_->upsert(sb.rec); !s) {
    sb.rec.spec = std::move(before);
    return fail(Error::kIo, "sandbox " + sb.id() + ": cannot store its ports: " + s.message());
  }
  // Connections to the port opened before now are cut by their proxies (activity()).
  sb.closed_ports.push_back(Sandbox::Closed{static_cast<uint16_t>(port), route_events_.stamp(), Clock::now()});
  publish(&sb, "ports");
  if (fleet_ != nullptr) fleet_->publish_ports(fleet_key(sb), fleet_port_routes(sb.rec.spec));
  spdlog::info("sandbox {}: port {} closed", sb.id(), port);
  // The node refuses the port from now on whatever the driver does; the forward is only tidied away.
  driver(sb).unforward_port(sb.rec.spec, sb.rec.runtime, static_cast<uint16_t>(port), [id = sb.id(), port](Status s) {
    if (!s) spdlog::warn("sandbox {}: port {} closed, its forward stays: {}", id, port, s.message());
  });
  return snapshot(sb);
}

// ---- connections hold sandboxes awake ----

IdleTracker::Duration Node::report_ttl() const {
  return std::chrono::milliseconds(static_cast<int64_t>(kReportTtlIntervals) *
                                   config_->get()->proxy.activity_report_interval_ms);
}

// The idle clock is held only while running: holding is about not going idle, and every transition drops
// the clock (start_idle_clock holds it again if connections are still open).
void Node::on_connections_changed(const std::string& id, uint64_t before, uint64_t total) {
  Sandbox* sb = registry_.by_id(id);
  if (sb == nullptr || sb->rec.state != S::kRunning) return;
  if (before == 0 && total > 0) {
    idle_.hold(id);
  } else if (before > 0 && total == 0) {
    // The last connection closed: the idle clock starts now, not at the last byte it carried.
    sb->rec.last_activity_at_ms = wall_now_ms();
    idle_.release(id);
  }
}

// ---- waiters ----

Result<OpenedPort> Node::open_port(Sandbox& sb, uint16_t port, bool woke, Clock::time_point started) {
  auto socket = driver(sb).open_socket(sb.rec.spec, sb.rec.runtime, sandbox_port(sb.rec.spec, port));
  if (!socket)
    return fail(socket.error(), "cannot open a socket in sandbox " + sb.id() + ": " + socket.message());
  OpenedPort opened;
  opened.id = sb.id();
  opened.name = sb.rec.spec.name;
  opened.port = port;
  auto policy = port_policy(sb.rec.spec, port);
  // A waiter's port may have been closed while the sandbox woke.
  if (!policy) return fail(Error::kPermissionDenied, "port not exposed: sandbox " + sb.id() + " closed port " + std::to_string(port));
  opened.protocol = policy->protocol;
  opened.is_public = policy->is_public;
  opened.woke = woke;
  opened.opened_at = route_events_.stamp();
  opened.token_sha256 = sb.rec.spec.token_sha256;
  if (woke) opened.wake_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
  opened.socket = std::move(*socket);
  return opened;
}

void Node::serve_waiters(Sandbox& sb) { waiters_.settle(sb.id(), {}); }

void Node::fail_waiters(Sandbox& sb, const Failure& failure) { waiters_.settle(sb.id(), failure); }

// ---- idle expiry ----

void Node::on_idle(const std::string& id) {
  Sandbox* found = registry_.by_id(id);
  if (found == nullptr || found->terminating) return;
  Sandbox& sb = *found;
  if (sb.rec.state == S::kSuspended && sb.rec.tier == SuspendTier::kMemory) {
    if (sb.checkpointing) {
      sb.idle_after_checkpoint = true;  // its checkpoint reads the frozen filesystem first
      return;
    }
    begin_hibernate(sb, "suspended in memory for " + std::to_string(sb.rec.spec.hibernate_after_secs) + " s");
    return;
  }
  if (sb.rec.state != S::kRunning) return;
  std::string reason = "idle for " + std::to_string(sb.rec.spec.timeout_secs) + " s";
  if (sb.checkpointing && !sb.rec.spec.ephemeral) {
    // The checkpoint freezes and thaws the cgroup itself; a pause now would be undone by its thaw.
    sb.idle_after_checkpoint = true;
    return;
  }
  if (sb.rec.spec.ephemeral) {
    begin_terminate(sb, std::move(reason));
  } else if (driver(sb).capabilities().pause) {
    begin_suspend(sb, std::move(reason));
  } else {
    spdlog::info("sandbox {}: {}, but the {} driver cannot suspend; it keeps running", id, reason,
                 sb.rec.spec.driver);
    start_idle_clock(sb);
  }
}

// ---- route caches of the proxies ----

void Node::publish(const Sandbox* sb, std::string reason) {
  // Whatever the event says (stopped running, a new token, gone), the proxy's socket maker may no longer
  // enter the sandbox's namespace; the next spares vouch for it again.
  if (sb) vouchers_.revoke(sb->id());
  route_events_.publish(sb ? sb->id() : std::string(), sb ? sb->rec.spec.name : std::string(), std::move(reason));
}

Result<SpareSockets> Node::spare_sockets(std::string_view id, uint16_t port, size_t count) {
  Sandbox* sb = registry_.find(id);
  if (sb == nullptr || sb->terminating) return fail(Error::kNotFound, "no sandbox " + std::string(id));
  if (sb->rec.state != S::kRunning || shutting_down_)
    return fail(Error::kUnavailable, "sandbox " + sb->id() + " is " + std::string(state_name(sb->rec.state)));
  if (!port_policy(sb->rec.spec, port)) return fail(Error::kPermissionDenied, "port not exposed");
  SpareSockets spares;
  auto sockets = driver(*sb).open_sockets(sb->rec.spec, sb->rec.runtime, sandbox_port(sb->rec.spec, port),
                                          std::min(count, kMaxSpareSockets));
  if (!sockets) return fail(sockets.error(), "cannot open a socket in sandbox " + sb->id() + ": " + sockets.message());
  for (GuestSocket& socket : *sockets) {
    if (socket.connected) return fail(Error::kUnsupported, "the driver's sockets are one connected stream each");
    spares.connect_port = socket.connect_port;
    spares.fds.push_back(std::move(socket.fd));
  }
  spares.opened_at = route_events_.stamp();
  spares.cache_ms = route_cache_ms(sb->id());
  spares.token_sha256 = sb->rec.spec.token_sha256;
  // Optional: without it the proxy serves a node outage with the spares it holds only. Vouched for first:
  // its socket maker enters no namespace the node did not mark.
  if (auto netns = driver(*sb).socket_namespace(sb->rec.spec, sb->rec.runtime); netns && !spares.fds.empty()) {
    Status vouched = vouchers_.vouch(sb->id(), spares.fds.front().get());
    if (vouched) {
      spares.netns = std::move(*netns);
    } else if (!vouch_failure_said_) {  // once: every refill would say it again
      spdlog::warn("sandbox {}: no network namespace goes to the proxy, since it cannot be vouched for: {}", sb->id(),
                   vouched.message());
      vouch_failure_said_ = true;
    }
  }
  return spares;
}

uint32_t Node::route_cache_ms(std::string_view id) const {
  Sandbox* sb = registry_.find(id);
  if (sb == nullptr) return 0;
  // A connection routed from a cache reaches the node in the next activity report, one interval later
  // (plus one in flight); a second's slack covers a slow proxy loop.
  int64_t margin_ms = 2 * static_cast<int64_t>(config_->get()->proxy.activity_report_interval_ms) + 1000;
  int64_t ms = static_cast<int64_t>(sb->rec.spec.timeout_secs) * 1000 - margin_ms;
  return static_cast<uint32_t>(std::clamp<int64_t>(ms, 0, kMaxRouteCacheMs));
}

Status Node::load_operator_token(const Config& config) {
  // The same reader (and so the same owner-only rule) as the proxy's: common/operator_token.h.
  auto token = read_operator_token(config.operator_token_file);
  if (!token) return token.failure();
  std::string digest = token->empty() ? std::string() : token_digest(*token);
  if (digest != operator_token_sha256_) {
    operator_token_sha256_ = std::move(digest);
    prewake_gate_.clear();                // an address may have shown the old one
    publish(nullptr, "operator_token");  // every cached verdict may rest on the old one
  }
  if (!token->empty()) spdlog::info("operator token loaded from {}", config.operator_token_file);
  return {};
}

// ---- shutdown ----

void Node::shutdown(std::function<void()> done) {
  shutting_down_ = true;
  shutdown_done_ = std::move(done);
  idle_.stop();
  reports_.stop();
  for (Sandbox* sb : registry_.all()) sb->pending_wake.reset();
  waiters_.settle_all(fail(Error::kUnavailable, "node is shutting down"));
  if (config_->get()->node.on_shutdown == ShutdownPolicy::kKeep) {
    for (Sandbox* sb : registry_.all()) {
      if (!sb->watched) continue;
      driver(*sb).unwatch(sb->rec.spec);
      sb->watched = false;
    }
    spdlog::info("leaving {} sandboxes running for the next sandgate-node to adopt (on_shutdown = keep)",
                 registry_.size());
    maybe_finish_shutdown();
    return;
  }
  spdlog::info("terminating {} sandboxes (on_shutdown = terminate)", registry_.size());
  for (Sandbox* sb : registry_.all())
    if (!sb->terminating) begin_terminate(*sb, "node shutdown (on_shutdown = terminate)");
  uv_timer_start(
      shutdown_timer_,
      [](uv_timer_t* t) {
        auto* self = static_cast<Node*>(t->data);
        spdlog::warn("shutdown: gave up waiting for sandboxes to terminate");
        self->finish_shutdown();
      },
      kShutdownTerminateTimeoutMs, 0);
  maybe_finish_shutdown();
}

void Node::maybe_finish_shutdown() {
  if (!shutdown_done_ || terminating_count_ != 0) return;
  // Always from the loop, never from inside shutdown() itself.
  uv_timer_start(shutdown_timer_, [](uv_timer_t* t) { static_cast<Node*>(t->data)->finish_shutdown(); }, 0, 0);
}

void Node::finish_shutdown() {
  uv_timer_stop(shutdown_timer_);
  std::function<void()> done = std::move(shutdown_done_);
  shutdown_done_ = nullptr;
  if (done) done();
}

}  // namespace sg
