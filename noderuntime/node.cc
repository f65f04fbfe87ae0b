#include "noderuntime/node.h"

#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <set>

#include "common/failpoint.h"
#include "common/operator_token.h"
#include "common/token_digest.h"
#include "noderuntime/egress.h"
#include "noderuntime/names.h"
#include "noderuntime/snapshot_defaults.h"
#include "noderuntime/state_machine.h"
#include "noderuntime/uv_handles.h"

namespace sg {
namespace {

using Clock = IdleTracker::Clock;
using S = SandboxState;

constexpr int64_t kMinMemoryMb = 16;
constexpr int64_t kMaxMemoryMb = 1024 * 1024;
// An ext4 file smaller than this has no room for its own metadata and a few files.
constexpr double kMaxCpus = 1024;
// A terminate that hangs must not keep the daemon from exiting; whatever is left is adopted next start.
constexpr uint64_t kShutdownTerminateTimeoutMs = 15'000;
// Ports one sandbox may expose: enough for any real service, small enough that answers and lookups stay tiny.
constexpr size_t kMaxExposedPorts = 64;
// A worker's connection count lives this many report intervals past its last report (a few missed reports
// are a slow proxy, not a dead one).
constexpr int kReportTtlIntervals = 10;

int64_t wall_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool valid_env_key(std::string_view key) {
  auto alpha = [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; };
  if (key.empty() || !alpha(key[0])) return false;
  return std::all_of(key.begin(), key.end(), [&](char c) { return alpha(c) || (c >= '0' && c <= '9'); });
}

bool has_nul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

std::string describe_ports(const SandboxSpec& spec) {
  std::string out;
  for (uint16_t p : spec.exposed_ports) out += (out.empty() ? "" : ", ") + std::to_string(p);
  if (spec.agent_port != 0) out += (out.empty() ? "" : ", ") + std::to_string(spec.agent_port) + " (agent)";
  if (sandbox_port(spec, kSshPort) != kSshPort) out += (out.empty() ? "" : ", ") + std::string("22 (ssh, the agent's)");
  return out.empty() ? "none" : out;
}

}  // namespace

// An open() waiting for its sandbox to be running again. Self-owned: freed in its timer's close callback.
struct Node::Waiter {
  uv_timer_t timer;
  Node* node = nullptr;
  std::string sandbox_id;
  uint16_t port = 0;
  uint32_t timeout_ms = 0;
  Clock::time_point started;
  OpenCallback done;
};

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

struct Node::Sandbox {
  struct Reported {
    uint64_t connections = 0;
    Clock::time_point expires;
  };
  StoredSandbox rec;  // the persisted part
  std::map<std::string, Reported> connections_by_reporter;  // only non-zero counts
  std::string new_token;  // the token in clear between create() and its answer, then wiped
  uint64_t connections = 0;
  uint64_t resumes = 0;  // resumes started since this node process adopted or created the sandbox
  std::chrono::steady_clock::time_point wake_started{};  // the resume or restore in flight began (metrics)
  uint64_t suspended_at = 0;  // stamp() of the latest suspend that began
  uint64_t token_rotated_at = 0;  // stamp() of the latest token rotation (0: none since this node started)
  IdleTracker::TimePoint token_rotated_clock{};  // when, to stop announcing it after the report TTL
  struct Closed {
    uint16_t port = 0;
    uint64_t stamp = 0;  // stamp() of the close
    IdleTracker::TimePoint clock{};  // when, to stop announcing it after the report TTL
  };
  std::vector<Closed> closed_ports;  // closed since this node started, pruned once announced long enough
  std::vector<Waiter*> waiters;
  // Set while suspending when something asked for the sandbox (an open, traffic, the API): unless the
  // driver cancels the suspension, it finishes and is then followed by exactly one resume, for this reason.
  std::optional<std::string> pending_wake;
  bool cancel_requested = false;  // the driver agreed to cancel the suspension in flight
  bool starting = false;          // the driver's start() has not answered yet
  SandboxCallback created;        // create()'s caller, answered when the start settles
  bool watched = false;
  bool terminating = false;
  bool checkpointing = false;            // a checkpoint of it is on the thread pool (it may be frozen)
  bool suspend_after_checkpoint = false; // the idle policy wanted to suspend it meanwhile
  std::string terminate_reason;
  std::vector<SandboxCallback> terminated_callbacks;

  const std::string& id() const { return rec.spec.id; }
};

Node::Node(uv_loop_t* loop, const ConfigHolder* config, std::vector<std::unique_ptr<Driver>> drivers,
           std::unique_ptr<Store> store)
    : loop_(loop),
      config_(config),
      drivers_(std::move(drivers)),
      store_(std::move(store)),
      idle_timer_(new uv_timer_t),
      shutdown_timer_(new uv_timer_t),
      reports_timer_(new uv_timer_t) {
  uv_timer_init(loop_, idle_timer_);
  idle_timer_->data = this;
  uv_timer_init(loop_, shutdown_timer_);
  shutdown_timer_->data = this;
  uv_timer_init(loop_, reports_timer_);
  reports_timer_->data = this;
}

Node::~Node() {
  for (auto& [id, sb] : sandboxes_) {
    for (Waiter* w : sb->waiters) {
      uv_timer_stop(&w->timer);
      uv_close(reinterpret_cast<uv_handle_t*>(&w->timer),
               [](uv_handle_t* h) { delete static_cast<Waiter*>(h->data); });
    }
  }
  close_and_free(idle_timer_);
  close_and_free(shutdown_timer_);
  close_and_free(reports_timer_);
}

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

Node::Sandbox* Node::find(std::string_view ref) const {
  std::string key(ref);
  if (!looks_like_id(ref)) {
    auto named = ids_by_name_.find(key);
    if (named == ids_by_name_.end()) return nullptr;
    key = named->second;
  }
  auto it = sandboxes_.find(key);
  return it == sandboxes_.end() ? nullptr : it->second.get();
}

Result<Node::Sandbox*> Node::find_usable(std::string_view ref) const {
  Sandbox* sb = find(ref);
  if (sb == nullptr) return fail(Error::kNotFound, "no sandbox '" + std::string(ref) + "'");
  if (sb->terminating) return fail(Error::kNotFound, "sandbox " + sb->id() + " is being terminated");
  return sb;
}

SandboxInfo Node::snapshot(const Sandbox& sb) const {
  SandboxInfo info;
  info.spec = sb.rec.spec;
  info.state = sb.rec.state;
  info.state_reason = sb.rec.state_reason;
  info.runtime = sb.rec.runtime;
  info.created_at_ms = sb.rec.created_at_ms;
  info.last_activity_at_ms = sb.rec.last_activity_at_ms;
  info.connections = sb.connections;
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
  out.reserve(sandboxes_.size());
  for (const auto& [id, sb] : sandboxes_) out.push_back(snapshot(*sb));
  std::sort(out.begin(), out.end(), [](const SandboxInfo& a, const SandboxInfo& b) {
    return a.created_at_ms != b.created_at_ms ? a.created_at_ms < b.created_at_ms : a.spec.id < b.spec.id;
  });
  return out;
}

Result<SandboxInfo> Node::get(std::string_view ref) const {
  Sandbox* sb = find(ref);
  if (sb == nullptr) return fail(Error::kNotFound, "no sandbox '" + std::string(ref) + "'");
  return snapshot(*sb);
}

// ---- create ----

Result<std::optional<snapshot::Snapshot>> Node::apply_snapshot(CreateRequest& req) const {
  if (!req.snapshot_id) return std::optional<snapshot::Snapshot>();
  if (snapshots_ == nullptr) return fail(Error::kUnavailable, "this node has no snapshot store");
  auto snap = snapshots_->get(*req.snapshot_id);
  if (!snap) return fail(snap.error(), "snapshot_id: " + snap.message());
  if (auto s = apply_snapshot_defaults(*snap, req); !s) return s.failure();
  return std::optional<snapshot::Snapshot>(std::move(*snap));
}

Result<SandboxSpec> Node::validate(CreateRequest req) const {
  auto snap = apply_snapshot(req);
  if (!snap) return snap.failure();
  auto cfg = config_->get();
  auto invalid = [](std::string msg) { return fail(Error::kInvalidArgument, std::move(msg)); };
  SandboxSpec spec;
  if (req.name) {
    if (auto s = validate_name(*req.name); !s) return s.failure();
    spec.name = *req.name;
  }
  spec.ephemeral = req.ephemeral;
  if (req.command.empty()) return invalid("command: needs at least one element (the program to run)");
  for (size_t i = 0; i < req.command.size(); ++i) {
    if (req.command[i].empty()) return invalid("command[" + std::to_string(i) + "]: must not be empty");
    if (has_nul(req.command[i])) return invalid("command[" + std::to_string(i) + "]: must not contain NUL bytes");
  }
  spec.command = req.command;
  for (const auto& [key, value] : req.env) {
    if (!valid_env_key(key))
      return invalid("env: key '" + key + "' is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)");
    // An empty value is a legitimate setting (FOO=), but a NUL would silently truncate it.
    if (has_nul(value)) return invalid("env." + key + ": must not contain NUL bytes");
  }
  spec.env = req.env;
  if (req.cwd) {
    if (req.cwd->empty() || req.cwd->front() != '/') return invalid("cwd: must be an absolute path");
    if (has_nul(*req.cwd)) return invalid("cwd: must not contain NUL bytes");
    spec.cwd = *req.cwd;
  }
  if (req.exposed_ports.size() + req.ports.size() > kMaxExposedPorts)
    return invalid("exposed_ports + ports: at most " + std::to_string(kMaxExposedPorts) + " ports, got " +
                   std::to_string(req.exposed_ports.size() + req.ports.size()));
  spec.agent_port = cfg->agent_port;
  std::set<int64_t> seen_ports;
  auto add_port = [&](std::string_view field, int64_t port, bool is_public,
                      PortProtocol protocol) -> std::optional<std::string> {
    std::string where = std::string(field) + ": " + std::to_string(port);
    if (port < 1 || port > 65535) return where + " is not a TCP port (1-65535)";
    if (port == spec.agent_port)
      return where + " is the agent's port (agent_port), which is always reachable with the sandbox's token";
    if (!seen_ports.insert(port).second) return where + " is listed twice";
    spec.exposed_ports.push_back(static_cast<uint16_t>(port));
    spec.ports.push_back(PortPolicy{static_cast<uint16_t>(port), is_public, protocol});
    return std::nullopt;
  };
  for (int64_t port : req.exposed_ports)
    if (auto bad = add_port("exposed_ports", port, false, PortProtocol::kHttp1)) return invalid(*bad);
  for (const CreateRequest::Port& p : req.ports) {
    PortProtocol protocol = PortProtocol::kHttp1;
    if (p.protocol) {
      auto parsed = parse_protocol(*p.protocol);
      if (!parsed) return invalid("ports[].protocol: '" + *p.protocol + "' is not one of http1, h2c, tcp");
      protocol = *parsed;
    }
    if (auto bad = add_port("ports", p.port, p.is_public.value_or(false), protocol)) return invalid(*bad);
  }
  spec.allow_unauthenticated_access = req.allow_unauthenticated_access;
  int64_t timeout = req.timeout_secs.value_or(cfg->node.default_timeout_secs);
  if (timeout < 1 || timeout > static_cast<int64_t>(cfg->node.max_timeout_secs))
    return invalid("timeout_secs: must be between 1 and " + std::to_string(cfg->node.max_timeout_secs) +
                   " (node.max_timeout_secs)");
  spec.timeout_secs = static_cast<uint32_t>(timeout);
  int64_t hibernate_after = req.hibernate_after_secs.value_or(cfg->node.default_hibernate_after_secs);
  if (hibernate_after < 0 || hibernate_after > static_cast<int64_t>(cfg->node.max_timeout_secs))
    return invalid("hibernate_after_secs: must be between 0 (never) and " +
                   std::to_string(cfg->node.max_timeout_secs) + " (node.max_timeout_secs)");
  spec.hibernate_after_secs = static_cast<uint32_t>(hibernate_after);
  spec.driver = req.driver.value_or(std::string(default_driver_name()));
  if (find_driver(spec.driver) == nullptr) {
    std::string enabled;
    for (const std::string& n : driver_names()) enabled += (enabled.empty() ? "" : ", ") + n;
    return invalid("driver: '" + spec.driver + "' is not enabled on this node (enabled: " + enabled + ")");
  }
  double cpus = req.cpus.value_or(spec.cpus);
  if (!std::isfinite(cpus) || cpus <= 0 || cpus > kMaxCpus) return invalid("cpus: must be > 0 and <= 1024");
  spec.cpus = cpus;
  int64_t memory = req.memory_mb.value_or(spec.memory_mb);
  if (memory < kMinMemoryMb || memory > kMaxMemoryMb) return invalid("memory_mb: must be between 16 and 1048576");
  spec.memory_mb = static_cast<uint32_t>(memory);
  int64_t pids = req.pids_max.value_or(cfg->node.default_pids_max);
  if (pids < kMinPidsMax || pids > kMaxPidsMax)
    return invalid("pids_max: must be between " + std::to_string(kMinPidsMax) + " and " + std::to_string(kMaxPidsMax));
  spec.pids_max = static_cast<uint32_t>(pids);
  // Only a driver that enforces it gets the default (a VM's disk is its qcow2 overlay, sized by the image).
  const bool limits_disk = find_driver(spec.driver)->capabilities().disk_limit;
  int64_t disk = req.disk_mb.value_or(limits_disk ? cfg->node.default_disk_mb : 0);
  if (disk != 0 && (disk < kMinDiskMb || disk > kMaxDiskMb))
    return invalid("disk_mb: must be 0 (no limit) or between " + std::to_string(kMinDiskMb) + " and " +
                   std::to_string(kMaxDiskMb));
  spec.disk_mb = static_cast<uint32_t>(disk);
  spec.allow_internet_access = req.allow_internet_access.value_or(cfg->node.default_allow_internet_access);
  if (auto policy = make_egress_policy(spec.allow_internet_access, req.allow_out, req.deny_out); !policy)
    return invalid(policy.message());
  // Process and QEMU sandboxes go out through the node's egress (noderuntime/sandbox_egress.h); the other
  // microVM drivers have no way out of their VM.
  if (spec.allow_internet_access && spec.driver != "process" && spec.driver != "qemu")
    return invalid("allow_internet_access: only process and qemu sandboxes can have it on this node (driver '" +
                   spec.driver + "' has no egress)");
  spec.allow_out = req.allow_out;
  spec.deny_out = req.deny_out;
  // A QEMU sandbox's default is node.qemu_image, whose empty default boots the initramfs alone: a disk boot
  // (an ext4 base made from the image) only where the operator or the request asks for one.
  const bool qemu = spec.driver == "qemu";
  const char* default_key = qemu ? "node.qemu_image" : "node.default_image";
  // A memory snapshot's guest already runs on its root: the image it booted (none for an initramfs guest).
  const bool from_memory = *snap && (*snap)->type == "memory";
  spec.image = from_memory ? (*snap)->image : req.image.value_or(qemu ? cfg->node.qemu_image : cfg->node.default_image);
  if ((spec.image.empty() && !from_memory && (req.image || !qemu)) || has_nul(spec.image))
    return invalid("image: must be a non-empty image name");
  if (images_ != nullptr && !spec.image.empty()) {
    auto image = images_->get(spec.image);
    if (!image) {
      if (image.error() != Error::kNotFound) return image.failure();
      std::string msg = std::string(kNoImageHere) + spec.image + "' on this node";
      if (!req.image)
        msg += std::string(" (") + default_key + "); build it with `sandgate image build " + spec.image +
               " --packages python3` or import one with `sandgate image import FILE.tar " + spec.image + "`";
      return fail(Error::kNotFound, msg);
    }
    // The image's config is the default; what the request sets wins.
    for (const std::string& kv : image->config.env) {
      size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) continue;
      spec.env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
    }
    if (!req.cwd && !image->config.working_dir.empty() && image->config.working_dir.front() == '/')
      spec.cwd = image->config.working_dir;
  }
  if (*snap) {
    spec.snapshot = (*snap)->id;
    spec.layers = (*snap)->layers;
    if ((*snap)->type == "memory") spec.memory_snapshot_dir = snapshots_->files_dir((*snap)->id);
  }
  return spec;
}

Result<uint32_t> Node::allocate_uid_base() const {
  auto cfg = config_->get();
  std::set<uint32_t> used;
  for (const auto& [id, sb] : sandboxes_) used.insert(sb->rec.spec.uid_base);
  const uint64_t slots = ((uint64_t{1} << 32) - 1 - cfg->node.uid_range_base) / kUidRangeSize;
  for (uint64_t slot = 0; slot < slots; ++slot) {
    const auto base = static_cast<uint32_t>(cfg->node.uid_range_base + slot * kUidRangeSize);
    if (used.count(base) == 0) return base;
  }
  return fail(Error::kLimitExceeded, "every uid range above node.uid_range_base is in use (" + std::to_string(slots) +
                                         " sandboxes)");
}

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
  auto spec = validate(request);
  if (!spec) return done(spec.failure());
  auto cfg = config_->get();
  if (sandboxes_.size() >= cfg->node.max_sandboxes)
    return done(fail(Error::kLimitExceeded, "this node already has " + std::to_string(sandboxes_.size()) +
                                                " sandboxes (node.max_sandboxes)"));
  if (!spec->name.empty()) {
    auto taken = ids_by_name_.find(spec->name);
    if (taken != ids_by_name_.end())
      return done(fail(Error::kAlreadyExists, "name '" + spec->name + "' is already used by " + taken->second +
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
              if (!r && fleet_ != nullptr && ids_by_name_.count(name) == 0) fleet_->publish(name, "terminated");
              done(std::move(r));
            },
            true);
      });
      return;
    }
  }
  do {
    spec->id = generate_id();
  } while (sandboxes_.count(spec->id) != 0);
  std::string token = generate_token();
  spec->token_sha256 = token_digest(token);
  auto uid_base = allocate_uid_base();
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
  Sandbox& sb = *owned;
  sb.rec.spec = std::move(*spec);
  sb.rec.state = S::kCreating;
  sb.rec.state_reason = "created";
  sb.rec.runtime.sandbox_dir = dir;
  sb.rec.created_at_ms = sb.rec.last_activity_at_ms = wall_now_ms();
  // Persisted before anything runs: a crash between start and the next write leaves a record to reconcile.
  if (auto s = store_->upsert(sb.rec); !s) {
    std::filesystem::remove_all(dir, ec);
    image_users_->remove(sb.rec.spec.image, image_user);
    return done(s.failure());
  }
  failpoint("after:creating");
  std::string id = sb.id();
  if (!sb.rec.spec.name.empty()) ids_by_name_[sb.rec.spec.name] = id;
  sandboxes_.emplace(id, std::move(owned));
  if (!sb.rec.spec.snapshot.empty()) {
    std::string snap = sb.rec.spec.snapshot;
    if (auto s = snapshots_->add_user(snap, image_user); !s) {
      forget(id);  // `sb` is gone from here on (its image user with it)
      return done(fail(s.error(), "snapshot " + snap + " was removed while the sandbox was created: " + s.message()));
    }
  }
  sb.starting = true;
  sb.new_token = std::move(token);
  sb.created = std::move(done);
  driver(sb).start(sb.rec.spec, dir, [this, id](Result<RuntimeInfo> r) { on_started(id, std::move(r)); });
}

void Node::on_started(const std::string& id, Result<RuntimeInfo> runtime) {
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return;
  Sandbox& sb = *it->second;
  sb.starting = false;
  SandboxCallback created = std::move(sb.created);
  sb.created = nullptr;
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
    (void)transition(sb, S::kTerminated, "start failed: " + runtime.message());
    forget(id);
    if (created) created(fail(runtime.error(), "cannot start sandbox: " + runtime.message()));
    return;
  }
  sb.rec.runtime = std::move(*runtime);
  metrics_.created(true);
  (void)transition(sb, S::kRunning, "started");
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
  if (to == S::kSuspending) sb.suspended_at = stamp();  // also for a sandbox adopted paused
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
    fleet_->publish(sb.rec.spec.name.empty() ? sb.id() : sb.rec.spec.name, state_name(to));
  return {};
}

void Node::persist(const Sandbox& sb) {
  // The in-memory record stays authoritative; the next transition writes it again, and reconcile
  // re-derives states from the live instances anyway.
  if (auto s = store_->upsert(sb.rec); !s) spdlog::error("sandbox {}: cannot persist state: {}", sb.id(), s.message());
}

void Node::start_idle_clock(Sandbox& sb) {
  idle_.remove(sb.id());  // a fresh entry, so the hold below is its only one
  idle_.set(sb.id(), std::chrono::seconds(sb.rec.spec.timeout_secs), Clock::now());
  if (sb.connections > 0) idle_.hold(sb.id());
  arm_idle_timer();
}

void Node::start_hibernate_clock(Sandbox& sb) {
  if (sb.rec.spec.hibernate_after_secs == 0 || !driver(sb).capabilities().hibernate) return;
  idle_.set(sb.id(), std::chrono::seconds(sb.rec.spec.hibernate_after_secs), Clock::now());
  arm_idle_timer();
}

void Node::touch(Sandbox& sb) {
  sb.rec.last_activity_at_ms = wall_now_ms();
  idle_.touch(sb.id(), Clock::now());
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
  if (!transition(sb, S::kSuspending, std::move(reason))) return;
  sb.pending_wake.reset();
  sb.cancel_requested = false;
  driver(sb).pause(sb.rec.spec, sb.rec.runtime, [this, id = sb.id()](Status s) { on_pause_done(id, std::move(s)); });
}

void Node::on_pause_done(const std::string& id, Status status) {
  auto it = sandboxes_.find(id);
  // Overtaken while the freeze ran: deleted, or the process exited. Nothing left to settle.
  if (it == sandboxes_.end() || it->second->terminating || it->second->rec.state != S::kSuspending) return;
  Sandbox& sb = *it->second;
  if (!status) {
    std::string reason = sb.cancel_requested && sb.pending_wake ? "suspend cancelled: " + *sb.pending_wake
                                                                : "suspend failed, still running: " + status.message();
    if (!sb.cancel_requested) spdlog::warn("sandbox {}: suspend failed: {}", id, status.message());
    sb.pending_wake.reset();
    (void)transition(sb, S::kRunning, std::move(reason));
    touch(sb);
    serve_waiters(sb);
    return;
  }
  metrics_.suspended(SuspendTier::kMemory);
  (void)transition(sb, S::kSuspended, sb.rec.state_reason);
  if (sb.pending_wake) begin_resume(sb, *sb.pending_wake);
}

void Node::begin_hibernate(Sandbox& sb, std::string reason) {
  sb.rec.tier = SuspendTier::kDisk;
  if (!transition(sb, S::kSuspending, std::move(reason))) return;
  sb.pending_wake.reset();
  sb.cancel_requested = false;
  driver(sb).hibernate(sb.rec.spec, sb.rec.runtime,
                       [this, id = sb.id()](Result<RuntimeInfo> r) { on_hibernate_done(id, std::move(r)); });
}

void Node::on_hibernate_done(const std::string& id, Result<RuntimeInfo> runtime) {
  auto it = sandboxes_.find(id);
  // Overtaken: deleted, or the instance died during the hibernation (on_exit failed it).
  if (it == sandboxes_.end() || it->second->terminating || it->second->rec.state != S::kSuspending) return;
  Sandbox& sb = *it->second;
  if (runtime) {
    sb.rec.runtime = std::move(*runtime);
    sb.watched = false;  // a hibernated instance is gone; its watch ended with it
    metrics_.suspended(SuspendTier::kDisk);
    (void)transition(sb, S::kSuspended, sb.rec.state_reason);
  } else {
    // The instance is still paused in memory, so the sandbox is simply suspended in the memory tier; the
    // hibernate clock starts over, which paces retries.
    std::string reason = sb.cancel_requested && sb.pending_wake
                             ? "hibernation cancelled: " + *sb.pending_wake
                             : "hibernate failed, still suspended in memory: " + runtime.message();
    if (!sb.cancel_requested) spdlog::warn("sandbox {}: hibernate failed: {}", id, runtime.message());
    sb.rec.tier = SuspendTier::kMemory;
    (void)transition(sb, S::kSuspended, std::move(reason));
  }
  if (sb.pending_wake) begin_resume(sb, *sb.pending_wake);
}

void Node::wake(Sandbox& sb, std::string reason) {
  if (sb.rec.state == S::kSuspended) return begin_resume(sb, std::move(reason));
  if (sb.rec.state != S::kSuspending) return;
  if (!sb.pending_wake) sb.pending_wake = std::move(reason);
  if (!sb.cancel_requested) sb.cancel_requested = driver(sb).cancel(sb.rec.spec);
}

void Node::begin_resume(Sandbox& sb, std::string reason) {
  if (!transition(sb, S::kResuming, std::move(reason))) return;
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
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end() || it->second->terminating || it->second->rec.state != S::kResuming) return;
  Sandbox& sb = *it->second;
  if (!status) {
    metrics_.wake_failed(SuspendTier::kMemory);
    (void)transition(sb, S::kFailed, "resume failed: " + status.message());
    fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + " failed to wake: " + status.message()));
    return;
  }
  metrics_.woke(SuspendTier::kMemory, seconds_since(sb.wake_started));
  (void)transition(sb, S::kRunning, sb.rec.state_reason);
  touch(sb);
  serve_waiters(sb);
}

void Node::on_restore_done(const std::string& id, Result<RuntimeInfo> runtime) {
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end() || it->second->terminating || it->second->rec.state != S::kResuming) return;
  Sandbox& sb = *it->second;
  if (!runtime) {
    // The saved state stays on disk (the driver never deletes it on failure) for inspection or deletion.
    metrics_.wake_failed(SuspendTier::kDisk);
    (void)transition(sb, S::kFailed, "restore from disk failed: " + runtime.message());
    fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + " failed to wake: " + runtime.message()));
    return;
  }
  sb.rec.runtime = std::move(*runtime);
  // The restored instance is a new process: recorded before the transition, so a node that dies in between
  // finds it running (and adopts it) instead of the old, gone one (NodeKill's QEMU case, before:resuming->running).
  persist(sb);
  metrics_.woke(SuspendTier::kDisk, seconds_since(sb.wake_started));
  (void)transition(sb, S::kRunning, sb.rec.state_reason);
  watch(sb);
  touch(sb);
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
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return;
  Sandbox& sb = *it->second;
  std::vector<SandboxCallback> callbacks = std::move(sb.terminated_callbacks);
  sb.terminated_callbacks.clear();
  sb.terminating = false;
  --terminating_count_;
  if (status) {
    (void)transition(sb, S::kTerminated, sb.terminate_reason);
    SandboxInfo final_state = snapshot(sb);
    forget(id);
    for (auto& cb : callbacks) cb(final_state);
  } else {
    std::string reason = "terminate failed: " + status.message();
    spdlog::error("sandbox {}: {}", id, reason);
    if (sb.rec.state == S::kFailed) {
      sb.rec.state_reason = reason;
      persist(sb);
    } else {
      (void)transition(sb, S::kFailed, reason);
    }
    for (auto& cb : callbacks) cb(status.failure());
  }
  maybe_finish_shutdown();
}

void Node::forget(const std::string& id) {
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return;
  const StoredSandbox& rec = it->second->rec;
  if (auto s = store_->erase(id); !s) spdlog::error("sandbox {}: cannot delete its record: {}", id, s.message());
  // Only the directory this node created: the stored path is data, not something to trust blindly.
  std::string expected_dir = config_->get()->node.state_dir + "/sandboxes/" + id;
  if (rec.runtime.sandbox_dir == expected_dir) {
    std::error_code ec;
    std::filesystem::remove_all(expected_dir, ec);
    if (ec) spdlog::warn("sandbox {}: cannot remove {}: {}", id, expected_dir, ec.message());
  }
  auto named = ids_by_name_.find(rec.spec.name);
  if (named != ids_by_name_.end() && named->second == id) ids_by_name_.erase(named);
  reported_.erase(id);
  image_users_->remove(rec.spec.image, image_user_label(rec.spec));
  if (snapshots_ != nullptr && !rec.spec.snapshot.empty()) snapshots_->remove_user(rec.spec.snapshot, image_user_label(rec.spec));
  sandboxes_.erase(it);
}

std::string Node::metrics_text() const {
  std::vector<std::pair<SandboxState, SuspendTier>> states;
  states.reserve(sandboxes_.size());
  for (const auto& [id, sb] : sandboxes_) states.emplace_back(sb->rec.state, sb->rec.tier);
  return metrics_.render(states);
}

std::string Node::image_user_label(const SandboxSpec& spec) {
  return "sandbox " + (spec.name.empty() ? spec.id : spec.name + " (" + spec.id + ")");
}

void Node::on_exit(const std::string& id) {
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end() || it->second->terminating) return;
  Sandbox& sb = *it->second;
  sb.watched = false;  // the driver reports an exit once
  spdlog::warn("sandbox {}: process exited on its own", id);
  if (sb.rec.spec.ephemeral) {
    begin_terminate(sb, "exited on its own");  // releases what the instance left behind
    return;
  }
  sb.pending_wake.reset();
  if (sb.rec.state != S::kFailed) (void)transition(sb, S::kFailed, "the sandbox's process exited on its own");
  fail_waiters(sb, fail(Error::kUnavailable, "sandbox " + id + " exited"));
}

// ---- API operations ----

Result<TransitionOutcome> Node::suspend(std::string_view ref) {
  auto found = find_usable(ref);
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
      return TransitionOutcome{true, snapshot(sb)};
    case S::kSuspending:
    case S::kSuspended:
      // The latest explicit wish wins over an earlier resume request; waiting opens still get their wake.
      if (sb.waiters.empty()) sb.pending_wake.reset();
      return TransitionOutcome{false, snapshot(sb)};
    default:
      return fail(Error::kConflict, "sandbox " + sb.id() + " is " + std::string(state_name(sb.rec.state)) +
                                        "; only a running sandbox can be suspended");
  }
}

Result<TransitionOutcome> Node::resume(std::string_view ref) {
  auto found = find_usable(ref);
  if (!found) return found.failure();
  Sandbox& sb = **found;
  if (sb.rec.spec.ephemeral)
    return fail(Error::kInvalidArgument, "sandbox " + sb.id() + " is ephemeral: it never suspends");
  switch (sb.rec.state) {
    case S::kSuspended:
      if (fleet_ != nullptr)
        if (Status s = fleet_->admit(FleetAdmission::kWake); !s) return s.failure();
      begin_resume(sb, "resumed on request");
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
  Sandbox* sb = find(ref);
  if (sb == nullptr) return done(fail(Error::kNotFound, "no sandbox '" + std::string(ref) + "'"));
  sb->terminated_callbacks.push_back(std::move(done));
  if (!sb->terminating) begin_terminate(*sb, "deleted on request");
}

void Node::open(std::string_view ref, uint16_t port, uint32_t wake_timeout_ms, OpenCallback done) {
  Clock::time_point started = Clock::now();
  if (shutting_down_) return done(fail(Error::kUnavailable, "node is shutting down"));
  auto found = find_usable(ref);
  if (!found) return done(found.failure());
  Sandbox& sb = **found;
  if (!port_policy(sb.rec.spec, port))
    return done(fail(Error::kPermissionDenied, "port not exposed: sandbox " + sb.id() + " exposes " +
                                                   describe_ports(sb.rec.spec) + ", not " + std::to_string(port)));
  touch(sb);
  switch (sb.rec.state) {
    case S::kRunning:
      return done(open_port(sb, port, false, started));
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
  auto* w = new Waiter;
  w->node = this;
  w->sandbox_id = sb.id();
  w->port = port;
  w->timeout_ms = wake_timeout_ms;
  w->started = started;
  w->done = std::move(done);
  uv_timer_init(loop_, &w->timer);
  w->timer.data = w;
  auto on_timeout = [](uv_timer_t* t) {
    auto* waiter = static_cast<Waiter*>(t->data);
    waiter->node->on_waiter_timeout(waiter);
  };
  uv_timer_start(&w->timer, on_timeout, wake_timeout_ms, 0);
  sb.waiters.push_back(w);
  wake(sb, "woken by a connection to port " + std::to_string(port));
}

Result<PortAccess> Node::lookup(std::string_view ref, uint16_t port) const {
  auto found = find_usable(ref);
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
  Sandbox* sb = find(id);
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
  Clock::time_point now = Clock::now();
  ActivityAnswer answer;
  for (const ActivityReport& r : reports) {
    Sandbox* sb = find(r.id);
    if (sb == nullptr || sb->terminating) continue;  // reports may trail a delete; nothing to account
    set_connections(*sb, r.reporter, r.connections, now);
    // A report carries bytes moved up to an interval ago, so it cannot tell traffic after a suspend from
    // traffic before it: it never wakes. Whatever asks for a sleeping sandbox comes through open().
    if (sb->rec.state == S::kRunning && (r.bytes_in != 0 || r.bytes_out != 0)) touch(*sb);
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

void Node::checkpoint(std::string_view ref, std::string_view type, CheckpointCallback done) {
  auto found = find_usable(ref);
  if (!found) return done(found.failure());
  Sandbox& sb = **found;
  const SandboxSpec& spec = sb.rec.spec;
  if (type == "memory" && !driver(sb).capabilities().memory_checkpoint)
    return done(fail(Error::kUnsupported, "memory checkpoints are not supported by the " + spec.driver +
                                              " driver (it cannot save running processes); use --type filesystem"));
  if (type != "filesystem" && type != "memory")
    return done(fail(Error::kInvalidArgument, "type: '" + std::string(type) + "' is not one of filesystem, memory"));
  if (snapshots_ == nullptr) return done(fail(Error::kUnavailable, "this node has no snapshot store"));
  if (sb.rec.state != S::kRunning)
    return done(fail(Error::kConflict,
                     "sandbox " + sb.id() + " is " + std::string(state_name(sb.rec.state)) +
                         "; only a running sandbox can be checkpointed" +
                         (sb.rec.state == S::kSuspended ? " (resume it first: sandgate resume " + std::string(ref) + ")"
                                                        : std::string())));
  if (sb.checkpointing) return done(fail(Error::kConflict, "a checkpoint of sandbox " + sb.id() + " is in progress"));
  if (type == "memory") return checkpoint_memory(sb, std::move(done));
  auto source = driver(sb).checkpoint_source(spec, sb.rec.runtime);
  if (!source) return done(source.failure());

  snapshot::CheckpointJob job;
  job.upper_dir = source->upper_dir;
  job.shift = source->shift;
  job.index_path = sb.rec.runtime.sandbox_dir + "/checkpoint.index";
  job.base_layers = std::move(source->base_layers);
  job.record = snapshot_record(spec);
  sb.checkpointing = true;
  spdlog::info("sandbox {}: checkpoint (filesystem) started", sb.id());
  snapshots_->checkpoint(std::move(job), std::move(source->freezer),
                         [this, alive = std::weak_ptr<bool>(alive_), id = sb.id(),
                          done = std::move(done)](Result<snapshot::CheckpointResult> r) {
                           if (alive.expired()) return;
                           if (r) {
                             spdlog::info("sandbox {}: checkpoint {}: {} entries, {} bytes, frozen {:.1f} ms", id,
                                          r->snapshot.id, r->entries, r->snapshot.layer_bytes, r->pause_ms);
                           } else {
                             spdlog::warn("sandbox {}: checkpoint failed: {}", id, r.message());
                           }
                           on_checkpoint_done(id);
                           done(std::move(r));
                         });
}

void Node::checkpoint_memory(Sandbox& sb, CheckpointCallback done) {
  snapshot::Snapshot record = snapshot_record(sb.rec.spec);
  record.type = "memory";
  record.id = snapshot::generate_snapshot_id();
  record.memory_mb = sb.rec.spec.memory_mb;
  record.cpus = sb.rec.spec.cpus;  // no layers: the guest's root is its disk (copied into the snapshot) or initramfs
  auto dir = snapshots_->begin_memory(record.id);
  if (!dir) return done(dir.failure());
  sb.checkpointing = true;
  spdlog::info("sandbox {}: checkpoint (memory) {} started", sb.id(), record.id);
  driver(sb).checkpoint_memory(
      sb.rec.spec, sb.rec.runtime, *dir,
      [this, alive = std::weak_ptr<bool>(alive_), id = sb.id(), record = std::move(record),
       done = std::move(done)](Result<MemoryCheckpoint> saved) mutable {
        if (alive.expired()) return;
        auto finish = [this, id, done = std::move(done)](Result<snapshot::CheckpointResult> r) {
          if (r)
            spdlog::info("sandbox {}: checkpoint {}: state {} bytes, RAM {} bytes, disk {} bytes, paused {:.1f} ms",
                         id, r->snapshot.id, r->snapshot.state_bytes, r->snapshot.ram_bytes, r->snapshot.disk_bytes,
                         r->pause_ms);
          else
            spdlog::warn("sandbox {}: memory checkpoint failed: {}", id, r.message());
          on_checkpoint_done(id);
          done(std::move(r));
        };
        if (!saved) {
          snapshots_->discard_memory(record.id);
          return finish(saved.failure());
        }
        record.state_bytes = saved->state_bytes;
        record.ram_bytes = saved->ram_bytes;
        record.disk_bytes = saved->disk_bytes;
        record.created_at_ms = wall_now_ms();
        failpoint("memory-checkpoint:saved");  // the files in their .d.tmp, no record yet
        snapshots_->commit_memory(std::move(record), [alive, pause_ms = saved->pause_ms,
                                                      finish = std::move(finish)](Result<snapshot::Snapshot> r) {
          if (alive.expired()) return;
          if (!r) return finish(r.failure());
          finish(snapshot::CheckpointResult{.snapshot = std::move(*r), .pause_ms = pause_ms, .entries = 0});
        });
      });
}

void Node::on_checkpoint_done(const std::string& id) {
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return;
  Sandbox& sb = *it->second;
  sb.checkpointing = false;
  if (!sb.suspend_after_checkpoint) return;
  sb.suspend_after_checkpoint = false;
  if (sb.rec.state == S::kRunning && !sb.terminating) begin_suspend(sb, "idle (held back while a checkpoint ran)");
}

Result<SandboxInfo> Node::rotate_token(std::string_view ref) {
  auto found = find_usable(ref);
  if (!found) return found.failure();
  Sandbox& sb = **found;
  std::string token = generate_token();
  sb.rec.spec.token_sha256 = token_digest(token);
  // Persisted before anyone sees the new token: a node restart must not bring the old one back.
  if (auto s = store_->upsert(sb.rec); !s)
    return fail(Error::kIo, "sandbox " + sb.id() + ": cannot store the new token: " + s.message());
  sb.token_rotated_at = stamp();
  sb.token_rotated_clock = Clock::now();
  publish(&sb, "token");
  spdlog::info("sandbox {}: token rotated", sb.id());
  SandboxInfo info = snapshot(sb);
  info.token = std::move(token);
  return info;
}

void Node::expose_port(std::string_view ref, int64_t port, const ExposeRequest& request, SandboxCallback done) {
  auto found = find_usable(ref);
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
    Sandbox* now = find(id);
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
    spdlog::info("sandbox {}: port {} exposed ({})", id, p, describe_ports(now->rec.spec));
    done(snapshot(*now));
  });
}

Result<SandboxInfo> Node::close_port(std::string_view ref, int64_t port) {
  auto found = find_usable(ref);
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
  sb.closed_ports.push_back(Sandbox::Closed{static_cast<uint16_t>(port), stamp(), Clock::now()});
  publish(&sb, "ports");
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

void Node::set_connections(Sandbox& sb, const std::string& reporter, uint64_t count, Clock::time_point now) {
  if (count == 0) {
    sb.connections_by_reporter.erase(reporter);
  } else {
    Clock::time_point expires = now + report_ttl();
    sb.connections_by_reporter[reporter] = Sandbox::Reported{count, expires};
    reported_.insert(sb.id());
    arm_reports_timer(expires);
  }
  recount(sb, now);
}

// The idle entry holds at most once, and only while running: holding is about not going idle, and every
// transition drops the entry (start_idle_clock holds it again if connections are still open).
void Node::recount(Sandbox& sb, Clock::time_point now) {
  uint64_t before = sb.connections;
  sb.connections = 0;
  for (const auto& [reporter, reported] : sb.connections_by_reporter) sb.connections += reported.connections;
  if (sb.connections_by_reporter.empty()) reported_.erase(sb.id());
  if (sb.rec.state != S::kRunning) return;
  if (before == 0 && sb.connections > 0) {
    idle_.hold(sb.id());
  } else if (before > 0 && sb.connections == 0) {
    // The last connection closed: the idle clock starts now, not at the last byte it carried.
    sb.rec.last_activity_at_ms = wall_now_ms();
    idle_.release(sb.id(), now);
    arm_idle_timer();
  }
}

void Node::arm_reports_timer(Clock::time_point due) {
  if (shutting_down_ || (reports_timer_due_ && *reports_timer_due_ <= due)) return;
  auto now = Clock::now();
  uint64_t delay_ms =
      due > now ? static_cast<uint64_t>(std::chrono::ceil<std::chrono::milliseconds>(due - now).count()) : 0;
  uv_update_time(loop_);
  uv_timer_start(reports_timer_, [](uv_timer_t* t) { static_cast<Node*>(t->data)->expire_reports(); }, delay_ms, 0);
  reports_timer_due_ = due;
}

// Scans only the sandboxes that have counts, and re-arms for the earliest count still alive.
void Node::expire_reports() {
  reports_timer_due_.reset();
  Clock::time_point now = Clock::now();
  std::optional<Clock::time_point> next;
  std::vector<std::string> ids(reported_.begin(), reported_.end());
  for (const std::string& id : ids) {
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) {
      reported_.erase(id);
      continue;
    }
    Sandbox& sb = *it->second;
    bool expired = false;
    for (auto r = sb.connections_by_reporter.begin(); r != sb.connections_by_reporter.end();) {
      if (r->second.expires <= now) {
        spdlog::warn("sandbox {}: {} connection(s) reported by '{}' expired: no report for {} ms", id,
                     r->second.connections, r->first,
                     std::chrono::duration_cast<std::chrono::milliseconds>(report_ttl()).count());
        r = sb.connections_by_reporter.erase(r);
        expired = true;
        continue;
      }
      if (!next || r->second.expires < *next) next = r->second.expires;
      ++r;
    }
    if (expired) recount(sb, now);
  }
  if (next) arm_reports_timer(*next);
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
  // open() checked the port; the policy cannot have changed since (specs are immutable).
  if (auto policy = port_policy(sb.rec.spec, port)) {
    opened.protocol = policy->protocol;
    opened.is_public = policy->is_public;
  }
  opened.woke = woke;
  opened.opened_at = stamp();
  opened.token_sha256 = sb.rec.spec.token_sha256;
  if (woke) opened.wake_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
  opened.socket = std::move(*socket);
  return opened;
}

void Node::serve_waiters(Sandbox& sb) {
  std::vector<Waiter*> waiters = std::move(sb.waiters);
  sb.waiters.clear();
  for (Waiter* w : waiters) finish_waiter(w, open_port(sb, w->port, true, w->started));
}

void Node::fail_waiters(Sandbox& sb, const Failure& failure) {
  std::vector<Waiter*> waiters = std::move(sb.waiters);
  sb.waiters.clear();
  for (Waiter* w : waiters) finish_waiter(w, failure);
}

void Node::finish_waiter(Waiter* w, Result<OpenedPort> result) {
  uv_timer_stop(&w->timer);
  OpenCallback done = std::move(w->done);
  uv_close(reinterpret_cast<uv_handle_t*>(&w->timer), [](uv_handle_t* h) { delete static_cast<Waiter*>(h->data); });
  done(std::move(result));
}

void Node::on_waiter_timeout(Waiter* w) {
  auto it = sandboxes_.find(w->sandbox_id);
  if (it != sandboxes_.end()) {
    auto& waiters = it->second->waiters;
    waiters.erase(std::remove(waiters.begin(), waiters.end(), w), waiters.end());
  }
  // The wake itself goes on: the next open will find the sandbox running.
  finish_waiter(w, fail(Error::kTimeout, "sandbox " + w->sandbox_id + " did not wake within " +
                                             std::to_string(w->timeout_ms) + " ms"));
}

// ---- idle expiry ----

void Node::arm_idle_timer() {
  if (shutting_down_) return;
  auto next = idle_.next_deadline();
  if (!next) {
    uv_timer_stop(idle_timer_);
    idle_timer_due_.reset();
    return;
  }
  if (idle_timer_due_ && *idle_timer_due_ <= *next) return;  // already fires early enough
  auto now = Clock::now();
  uint64_t delay_ms = 0;
  if (*next > now)
    delay_ms = static_cast<uint64_t>(std::chrono::ceil<std::chrono::milliseconds>(*next - now).count());
  uv_update_time(loop_);  // libuv schedules from its cached loop time, which lags behind `now`
  uv_timer_start(idle_timer_, [](uv_timer_t* t) { static_cast<Node*>(t->data)->on_idle_timer(); }, delay_ms, 0);
  idle_timer_due_ = *next;
}

void Node::on_idle_timer() {
  idle_timer_due_.reset();
  for (const std::string& id : idle_.pop_expired(Clock::now())) {
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end() || it->second->terminating) continue;
    Sandbox& sb = *it->second;
    if (sb.rec.state == S::kSuspended && sb.rec.tier == SuspendTier::kMemory) {
      begin_hibernate(sb, "suspended in memory for " + std::to_string(sb.rec.spec.hibernate_after_secs) + " s");
      continue;
    }
    if (sb.rec.state != S::kRunning) continue;
    std::string reason = "idle for " + std::to_string(sb.rec.spec.timeout_secs) + " s";
    if (sb.checkpointing && !sb.rec.spec.ephemeral) {
      // The checkpoint freezes and thaws the cgroup itself; a pause now would be undone by its thaw.
      sb.suspend_after_checkpoint = true;
      continue;
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
  arm_idle_timer();
}

uint64_t Node::stamp() {
  auto wall_us = std::chrono::duration_cast<std::chrono::microseconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  last_stamp_ = std::max(last_stamp_ + 1, static_cast<uint64_t>(std::max<int64_t>(wall_us, 0)));
  return last_stamp_;
}

// ---- route caches of the proxies ----

uint64_t Node::subscribe(std::function<void(const RouteEvent&)> listener) {
  uint64_t id = next_subscription_++;
  route_listeners_.emplace(id, std::move(listener));
  return id;
}

void Node::unsubscribe(uint64_t subscription) { route_listeners_.erase(subscription); }

void Node::publish(const Sandbox* sb, std::string reason) {
  if (route_listeners_.empty()) return;
  RouteEvent event{sb ? sb->id() : std::string(), sb ? sb->rec.spec.name : std::string(), std::move(reason), stamp()};
  // A listener may unsubscribe others (a stream that failed to write closes), so ids are taken first.
  std::vector<uint64_t> ids;
  for (const auto& [id, listener] : route_listeners_) ids.push_back(id);
  for (uint64_t id : ids)
    if (auto it = route_listeners_.find(id); it != route_listeners_.end()) it->second(event);
}

Result<SpareSockets> Node::spare_sockets(std::string_view id, uint16_t port, size_t count) {
  Sandbox* sb = find(id);
  if (sb == nullptr || sb->terminating) return fail(Error::kNotFound, "no sandbox " + std::string(id));
  if (sb->rec.state != S::kRunning || shutting_down_)
    return fail(Error::kUnavailable, "sandbox " + sb->id() + " is " + std::string(state_name(sb->rec.state)));
  if (!port_policy(sb->rec.spec, port)) return fail(Error::kPermissionDenied, "port not exposed");
  SpareSockets spares;
  for (size_t i = 0; i < std::min(count, kMaxSpareSockets); ++i) {
    auto socket = driver(*sb).open_socket(sb->rec.spec, sb->rec.runtime, sandbox_port(sb->rec.spec, port));
    if (!socket) return fail(socket.error(), "cannot open a socket in sandbox " + sb->id() + ": " + socket.message());
    if (socket->connected) return fail(Error::kUnsupported, "the driver's sockets are one connected stream each");
    spares.connect_port = socket->connect_port;
    spares.fds.push_back(std::move(socket->fd));
  }
  spares.opened_at = stamp();
  spares.cache_ms = route_cache_ms(sb->id());
  spares.token_sha256 = sb->rec.spec.token_sha256;
  return spares;
}

uint32_t Node::route_cache_ms(std::string_view id) const {
  Sandbox* sb = find(id);
  if (sb == nullptr) return 0;
  // A connection routed from a cache reaches the node in the next activity report, one interval later
  // (plus one in flight); a second's slack covers a slow proxy loop.
  int64_t margin_ms = 2 * static_cast<int64_t>(config_->get()->proxy.activity_report_interval_ms) + 1000;
  int64_t ms = static_cast<int64_t>(sb->rec.spec.timeout_secs) * 1000 - margin_ms;
  return static_cast<uint32_t>(std::clamp<int64_t>(ms, 0, kMaxRouteCacheMs));
}

// ---- restart and shutdown ----

Status Node::load_operator_token(const Config& config) {
  // The same reader (and so the same owner-only rule) as the proxy's: common/operator_token.h.
  auto token = read_operator_token(config.operator_token_file);
  if (!token) return token.failure();
  std::string digest = token->empty() ? std::string() : token_digest(*token);
  if (digest != operator_token_sha256_) {
    operator_token_sha256_ = std::move(digest);
    publish(nullptr, "operator_token");  // every cached verdict may rest on the old one
  }
  if (!token->empty()) spdlog::info("operator token loaded from {}", config.operator_token_file);
  return {};
}

Status Node::reconcile() {
  auto rows = store_->load_live();
  if (!rows) return rows.failure();
  size_t adopted = 0, failed = 0;
  for (StoredSandbox& row : *rows) {
    auto owned = std::make_unique<Sandbox>();
    Sandbox& sb = *owned;
    sb.rec = std::move(row);
    std::string id = sb.id();
    if (!sb.rec.spec.name.empty()) ids_by_name_[sb.rec.spec.name] = id;
    sandboxes_.emplace(id, std::move(owned));
    // Before the API listens, so no remove can have claimed the image; a refusal would be a bug worth a line.
    if (Status s = image_users_->add(sb.rec.spec.image, image_user_label(sb.rec.spec)); !s)
      spdlog::error("sandbox {}: {}", id, s.message());
    if (snapshots_ != nullptr && !sb.rec.spec.snapshot.empty())
      if (auto s = snapshots_->add_user(sb.rec.spec.snapshot, image_user_label(sb.rec.spec)); !s)
        spdlog::warn("sandbox {}: its snapshot {}: {}", id, sb.rec.spec.snapshot, s.message());
    // A removal the node died in (before or after the driver stopped the sandbox): finished now, whatever is
    // left of the sandbox (the driver's terminate finds its processes by their cgroup, or none).
    if (sb.rec.terminating) {
      ++failed;
      begin_terminate(sb, "its removal did not finish before the node restarted");
      continue;
    }
    if (sb.rec.state == S::kFailed) {
      ++failed;
      continue;
    }
    if (find_driver(sb.rec.spec.driver) == nullptr) {
      ++failed;
      (void)transition(sb, S::kFailed, "its driver '" + sb.rec.spec.driver + "' is not enabled on this node");
      continue;
    }
    // Creating with pid 0: the node stopped between persisting `creating` and the start answering. The
    // driver may have started the sandbox, but no process was recorded to adopt, and its caller never got an
    // answer. What it started is killed (the driver's terminate reaches it through the sandbox's cgroup) and
    // the record and the name go, as after a failed start.
    if (sb.rec.state == S::kCreating && sb.rec.runtime.pid == 0) {
      ++failed;
      begin_terminate(sb, "its create did not finish before the node restarted");
      continue;
    }
    ObservedInstance seen;
    if (sb.rec.state != S::kCreating) seen = driver(sb).observe(sb.rec.spec, sb.rec.runtime);
    if (!seen.alive && seen.hibernated && sb.rec.state != S::kCreating) {
      adopt_hibernated(sb);
      ++adopted;
      continue;
    }
    if (!seen.alive) {
      ++failed;
      if (sb.rec.spec.ephemeral) {
        begin_terminate(sb, "not running after node restart");
      } else {
        (void)transition(sb, S::kFailed, "not running after node restart");
      }
      continue;
    }
    adopt(sb, seen.paused);
    watch(sb);
    ++adopted;
  }
  spdlog::info("reconciled {} sandboxes from the store: {} adopted, {} failed or gone", rows->size(), adopted, failed);
  return {};
}

// Settles a live instance's recorded state with what the driver sees, finishing half-done transitions
// through the legal intermediate states so the state machine stays the single source of rules.
void Node::adopt(Sandbox& sb, bool paused) {
  // A live instance's memory is resident whatever the record said (e.g. a hibernation that never finished).
  sb.rec.tier = paused ? SuspendTier::kMemory : SuspendTier::kNone;
  switch (sb.rec.state) {
    case S::kCreating:
      (void)transition(sb, S::kRunning, "started (adopted after node restart)");
      if (paused) {
        (void)transition(sb, S::kSuspending, "found paused after node restart");
        (void)transition(sb, S::kSuspended, "found paused after node restart");
      }
      break;
    case S::kRunning:
      if (paused) {
        (void)transition(sb, S::kSuspending, "found paused after node restart");
        (void)transition(sb, S::kSuspended, "found paused after node restart");
      } else {
        start_idle_clock(sb);
      }
      break;
    case S::kSuspending:
      if (paused) {
        (void)transition(sb, S::kSuspended, "suspend completed before node restart");
      } else {
        (void)transition(sb, S::kRunning, "suspend did not complete before node restart");
      }
      break;
    case S::kSuspended:
      if (!paused) {
        (void)transition(sb, S::kResuming, "found running after node restart");
        (void)transition(sb, S::kRunning, "found running after node restart");
      } else {
        persist(sb);
        start_hibernate_clock(sb);
      }
      break;
    case S::kResuming:
      if (paused) {
        // The resume was asked for before the restart; finish it.
        driver(sb).resume(sb.rec.spec, sb.rec.runtime,
                        [this, id = sb.id()](Status s) { on_resume_done(id, std::move(s)); });
      } else {
        (void)transition(sb, S::kRunning, "resume completed before node restart");
      }
      break;
    case S::kFailed:
    case S::kTerminated:
      break;
  }
}

// The instance is gone but its saved state is complete: whatever was in flight, the sandbox is hibernated.
void Node::adopt_hibernated(Sandbox& sb) {
  sb.rec.tier = SuspendTier::kDisk;
  const char* reason = "found hibernated after node restart";
  switch (sb.rec.state) {
    case S::kRunning:
      (void)transition(sb, S::kSuspending, reason);
      (void)transition(sb, S::kSuspended, reason);
      break;
    case S::kSuspending:
      (void)transition(sb, S::kSuspended, reason);
      break;
    case S::kSuspended:
      persist(sb);
      break;
    case S::kResuming:
      // The restore was asked for before the restart; start it again from the saved state.
      driver(sb).restore(sb.rec.spec, sb.rec.runtime,
                         [this, id = sb.id()](Result<RuntimeInfo> r) { on_restore_done(id, std::move(r)); });
      break;
    case S::kCreating:
    case S::kFailed:
    case S::kTerminated:
      break;
  }
}

void Node::shutdown(std::function<void()> done) {
  shutting_down_ = true;
  shutdown_done_ = std::move(done);
  uv_timer_stop(idle_timer_);
  idle_timer_due_.reset();
  uv_timer_stop(reports_timer_);
  reports_timer_due_.reset();
  for (auto& [id, sb] : sandboxes_) {
    sb->pending_wake.reset();
    fail_waiters(*sb, fail(Error::kUnavailable, "node is shutting down"));
  }
  if (config_->get()->node.on_shutdown == ShutdownPolicy::kKeep) {
    for (auto& [id, sb] : sandboxes_) {
      if (!sb->watched) continue;
      driver(*sb).unwatch(sb->rec.spec);
      sb->watched = false;
    }
    spdlog::info("leaving {} sandboxes running for the next sandgate-node to adopt (on_shutdown = keep)",
                 sandboxes_.size());
    maybe_finish_shutdown();
    return;
  }
  spdlog::info("terminating {} sandboxes (on_shutdown = terminate)", sandboxes_.size());
  for (auto& [id, sb] : sandboxes_)
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
