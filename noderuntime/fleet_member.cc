#include "noderuntime/fleet_member.h"

#include <spdlog/spdlog.h>

#include <set>

namespace sg {
namespace {

using Clock = std::chrono::steady_clock;
using etcd::Compare;
using etcd::Op;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

etcd::ClientOptions client_options(const FleetConfig& config) {
  return etcd::client_options(config.etcd_endpoints, config.etcd_timeout_ms,
                              {config.etcd_cacert, config.etcd_cert, config.etcd_key, config.etcd_server_name});
}

}  // namespace

FleetMember::FleetMember(uv_loop_t* loop, const FleetConfig& config, size_t capacity)
    : loop_(loop),
      config_(config),
      capacity_(capacity),
      client_(client_options(config)),
      directory_(client_options(config)),
      period_(std::max<int64_t>(500, config.lease_ttl_secs * 1000 / 3)) {}

FleetMember::~FleetMember() { stop(); }

Status FleetMember::start() {
  if (Status s = client_.ready(); !s) return s;
  async_ = new uv_async_t;
  async_->data = this;
  if (int rc = uv_async_init(loop_, async_, [](uv_async_t* a) { static_cast<FleetMember*>(a->data)->drain_posted(); }); rc < 0) {
    delete async_;
    async_ = nullptr;
    return fail(Error::kInternal, std::string("uv_async_init: ") + uv_strerror(rc));
  }
  directory_.start();
  lease_thread_ = std::thread([this] { lease_loop(); });
  writer_thread_ = std::thread([this] { writer_loop(); });
  return {};
}

void FleetMember::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (writer_thread_.joinable()) writer_thread_.join();
  if (lease_thread_.joinable()) lease_thread_.join();
  directory_.stop();
}

void FleetMember::set_draining(const std::string& node, bool draining, DrainDone done) {
  {
    std::lock_guard lock(mu_);
    claims_.push_back(Claim{node, nullptr, draining, std::move(done)});
  }
  cv_.notify_all();
}

void FleetMember::close() {
  if (async_ == nullptr) return;
  uv_close(reinterpret_cast<uv_handle_t*>(async_), [](uv_handle_t* h) { delete reinterpret_cast<uv_async_t*>(h); });
  async_ = nullptr;
}

void FleetMember::post(std::function<void()> fn) {
  {
    std::lock_guard lock(posted_mu_);
    posted_.push_back(std::move(fn));
  }
  if (async_ != nullptr) uv_async_send(async_);
}

void FleetMember::drain_posted() {
  std::vector<std::function<void()>> batch;
  {
    std::lock_guard lock(posted_mu_);
    batch.swap(posted_);
  }
  for (auto& fn : batch) fn();
}

Status FleetMember::admit(FleetAdmission what) const {
  // Fresh enough that etcd still holds the lease: half the TTL since the last renewal. The lease thread
  // may be stuck in a call to an unreachable member, so the age is checked here, not only by that thread.
  int64_t age = now_ms() - last_renew_ms_.load();
  if (state_.load() == State::kLive && age < static_cast<int64_t>(config_.lease_ttl_secs) * 500) {
    // Placement leaves a draining node out; a create that reached it anyway (a view a moment old) is
    // refused with a 503, which the placing node takes as "try the next one". Wakes go on: its sandboxes
    // stay its own until they move.
    if (what == FleetAdmission::kCreate && draining_.load())
      return fail(Error::kUnavailable, "fleet: node " + config_.node_name + " is draining (sandgate node undrain " +
                                           config_.node_name + " to admit again): it admits no new sandboxes");
    return {};
  }
  return fail(Error::kUnavailable, "fleet: node " + config_.node_name + " cannot reach etcd to renew its lease, so it " +
                                       "refuses to " + std::string(admission_words(what)) + " (its running sandboxes keep running); retry shortly");
}

void FleetMember::claim(const std::string& name, std::function<void(Status)> done) {
  if (Status s = admit(FleetAdmission::kCreate); !s) return done(s);
  {
    std::lock_guard lock(mu_);
    claims_.push_back(Claim{name, std::move(done)});
  }
  cv_.notify_all();
}

void FleetMember::publish(const std::string& key, std::string_view state, std::vector<fleet::PortRoute> ports) {
  {
    std::lock_guard lock(mu_);
    claimed_.erase(key);  // its create is over, one way or the other
    Published value{std::string(state), std::move(ports)};
    if (state == "terminated") local_.erase(key);
    else local_[key] = value;
    queue_write(key, std::move(value));
  }
  cv_.notify_all();
}

void FleetMember::publish_ports(const std::string& key, std::vector<fleet::PortRoute> ports) {
  {
    std::lock_guard lock(mu_);
    auto it = local_.find(key);
    if (it == local_.end()) return;  // still creating: its first state carries the ports
    it->second.ports = std::move(ports);
    queue_write(key, it->second);
  }
  cv_.notify_all();
}

void FleetMember::queue_write(const std::string& key, Published value) {
  if (!pending_.count(key)) publish_order_.push_back(key);
  pending_[key] = std::move(value);  // a later value replaces one not yet written
}

std::vector<std::string> FleetMember::conflicts() const {
  std::lock_guard lock(mu_);
  return conflicts_;
}

// ---- the writer ----

void FleetMember::writer_loop() {
  Clock::time_point stop_deadline{};
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !claims_.empty() || !publish_order_.empty(); });
    if (stopping_) {
      // Pending writes (e.g. the terminations of on_shutdown = terminate) get a bounded chance to land.
      if (stop_deadline == Clock::time_point{}) stop_deadline = Clock::now() + std::chrono::seconds(5);
      if ((claims_.empty() && publish_order_.empty()) || Clock::now() > stop_deadline) break;
    }
    if (!claims_.empty()) {
      Claim c = std::move(claims_.front());
      claims_.pop_front();
      lock.unlock();
      Status s;
      if (c.drain) {
        auto staying = write_drain(c.name, *c.drain);
        post([done = std::move(c.drained), staying = std::move(staying)]() mutable { done(std::move(staying)); });
        lock.lock();
        continue;
      } else {
        bool held = false;
        {
          std::lock_guard claim_lock(mu_);
          held = !claimed_.insert(c.name).second;  // before the txn: see claimed_
        }
        s = claim_now(c.name, /*stale_claim_is_ours=*/!held);
        if (!s && !held) {
          std::lock_guard claim_lock(mu_);
          claimed_.erase(c.name);
          // A timeout leaves the outcome unknown: the claim may land when etcd answers again.
          if (s.error() == Error::kUnavailable) needs_reconcile_ = true;
        }
      }
      post([done = std::move(c.done), s]() { done(s); });
      lock.lock();
    } else {
      std::string key = publish_order_.front();
      publish_order_.pop_front();
      Published value = std::move(pending_[key]);
      pending_.erase(key);
      lock.unlock();
      if (Status s = write_state(key, value); !s) {
        // Not retried here: the reconcile after the next successful renewal writes every state again.
        spdlog::warn("fleet: cannot publish sandbox {} as {}: {}", key, value.state, s.message());
        needs_reconcile_ = true;
      }
      lock.lock();
    }
  }
}

Status FleetMember::claim_now(const std::string& name, bool stale_claim_is_ours) {
  if (Status s = admit(FleetAdmission::kCreate); !s) return s;
  std::string key = std::string(kFleetSandboxesPrefix) + name;
  int64_t lease = lease_.load();
  const std::string value = sandbox_owner_json(config_.node_name, "creating");
  // Bound to the lease while creating: if this node dies before the sandbox runs, the name comes free
  // when the lease expires.
  auto r = client_.txn({{.key = key, .target = Compare::Target::kCreateRevision, .op = Compare::Op::kEqual, .number = 0}},
                       {{.kind = Op::Kind::kPut, .key = key, .value = value, .lease = lease}},
                       {{.kind = Op::Kind::kRange, .key = key}});
  if (!r) return fail(Error::kUnavailable, "fleet: cannot claim the name '" + name + "' in etcd: " + r.message());
  if (r->succeeded) return {};
  std::string owner = "another node";
  if (!r->ranges.empty() && !r->ranges[0].kvs.empty()) {
    const etcd::KeyValue& kv = r->ranges[0].kvs[0];
    auto rec = parse_sandbox_owner(kv.value);
    // This node's own claim that no create holds: an earlier create whose claim timed out while etcd was
    // unreachable, and that etcd carried out once it answered again. It is taken over (unless it changed
    // since it was read), not reported as a conflict with ourselves.
    if (rec && rec->node == config_.node_name && rec->state == "creating" && stale_claim_is_ours) {
      auto t = client_.txn({{.key = key, .target = Compare::Target::kModRevision, .op = Compare::Op::kEqual, .number = kv.mod_revision}},
                           {{.kind = Op::Kind::kPut, .key = key, .value = value, .lease = lease}}, {});
      if (!t) return fail(Error::kUnavailable, "fleet: cannot claim the name '" + name + "' in etcd: " + t.message());
      if (t->succeeded) return {};
    }
    if (rec) owner = "node '" + rec->node + "'";
  }
  return fail(Error::kAlreadyExists, "name '" + name + "' is already used in the fleet by a sandbox on " + owner);
}

Result<std::vector<FleetAdmin::NodeSandbox>> FleetMember::write_drain(const std::string& node, bool draining) {
  // A key of its own rather than a field of the node key: the node key belongs to its node's lease and is
  // rewritten by it, while a drain must outlive that node's restarts.
  std::string key = std::string(kFleetDrainPrefix) + node;
  auto written = draining ? client_.put(key, "{}") : client_.delete_range(key);
  if (!written) return fail(Error::kUnavailable, "fleet: cannot write " + key + ": " + written.message());
  std::vector<NodeSandbox> staying;
  if (!draining) return staying;
  // Read after the write, so nothing placed before the drain took effect is missed.
  auto claims = client_.range_prefix(kFleetSandboxesPrefix);
  if (!claims)
    return fail(Error::kUnavailable, "fleet: " + node + " is draining, but its sandboxes cannot be listed: " +
                                         claims.message());
  for (const auto& kv : claims->kvs) {
    auto rec = parse_sandbox_owner(kv.value);
    if (rec && rec->node == node)
      staying.push_back(NodeSandbox{kv.key.substr(kFleetSandboxesPrefix.size()), rec->state});
  }
  return staying;  // etcd ranges are sorted by key, so by name
}

Status FleetMember::write_state(const std::string& name, const Published& published) {
  const std::string& state = published.state;
  std::string key = std::string(kFleetSandboxesPrefix) + name;
  std::string value = sandbox_owner_json(config_.node_name, state, published.ports);
  // Read, then write guarded by what was read, so a key that another node holds is never overwritten.
  // Two round trips per state change; a lost race is retried a few times.
  for (int attempt = 0; attempt < 3; attempt++) {
    auto cur = client_.range(key);
    if (!cur) return cur.failure();
    if (cur->kvs.empty()) {
      if (state == "terminated") return {};
      auto t = client_.txn({{.key = key, .target = Compare::Target::kCreateRevision, .number = 0}},
                           {{.kind = Op::Kind::kPut, .key = key, .value = value}}, {});
      if (!t) return t.failure();
      if (t->succeeded) return {};
      continue;
    }
    const etcd::KeyValue& kv = cur->kvs[0];
    auto rec = parse_sandbox_owner(kv.value);
    if (rec && rec->node != config_.node_name) {
      spdlog::error("fleet: sandbox name {} is held by node {} in etcd; this node's sandbox of that name is not "
                    "published (a conflict the operator must settle)", name, rec->node);
      std::lock_guard lock(mu_);
      if (std::find(conflicts_.begin(), conflicts_.end(), name) == conflicts_.end()) conflicts_.push_back(name);
      return {};
    }
    if (state != "terminated" && kv.value == value && kv.lease == 0) return {};
    Op op = state == "terminated" ? Op{.kind = Op::Kind::kDelete, .key = key}
                                  : Op{.kind = Op::Kind::kPut, .key = key, .value = value};  // no lease: it stays
    auto t = client_.txn({{.key = key, .target = Compare::Target::kModRevision, .number = kv.mod_revision}}, {op}, {});
    if (!t) return t.failure();
    if (t->succeeded) return {};
  }
  return fail(Error::kConflict, "sandbox key " + key + " kept changing under the write");
}

// ---- the lease ----

void FleetMember::lease_loop() {
  bool fenced_logged = false;
  std::unique_lock lock(mu_);
  while (!stopping_) {
    lock.unlock();
    Status s = lease_.load() == 0 ? register_node() : renew();
    if (s) {
      if (fenced_logged) spdlog::info("fleet: node {} is live again (lease {})", config_.node_name, lease_.load());
      fenced_logged = false;
      if (needs_reconcile_.exchange(false)) {
        if (Status r = reconcile(); !r) {
          spdlog::warn("fleet: reconcile failed: {}", r.message());
          needs_reconcile_ = true;
        }
      }
    } else {
      bool stale = now_ms() - last_renew_ms_.load() >= static_cast<int64_t>(config_.lease_ttl_secs) * 500;
      if (stale && state_.exchange(State::kFenced) == State::kLive) {
        spdlog::error("fleet: node {} fenced: {} (no creates or wakes until it renews)", config_.node_name, s.message());
        fenced_logged = true;
      } else if (!fenced_logged) {
        spdlog::warn("fleet: {}", s.message());
        fenced_logged = stale;
      }
    }
    lock.lock();
    // Right away after an expiry (re-register), otherwise every third of the TTL.
    if (s || lease_.load() != 0) cv_.wait_for(lock, period_, [&] { return stopping_; });
    else cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return stopping_; });
  }
  lock.unlock();
  if (int64_t lease = lease_.exchange(0); lease != 0) {
    // The node key goes now rather than at the TTL; sandbox keys without a lease stay.
    if (Status s = client_.revoke(lease); !s) spdlog::warn("fleet: cannot revoke lease {}: {}", lease, s.message());
  }
  state_ = State::kFenced;
}

Status FleetMember::register_node() {
  auto lease = client_.grant(config_.lease_ttl_secs);
  if (!lease) return fail(lease.error(), "cannot register with etcd: " + lease.message());
  int64_t granted_at = now_ms();
  lease_ = lease->id;
  if (Status s = put_node_key(true); !s) {
    (void)client_.revoke(lease->id);
    lease_ = 0;
    return s;
  }
  last_renew_ms_ = granted_at;
  state_ = State::kLive;
  needs_reconcile_ = true;  // a new lease: claims of the old one are gone, states may be missing
  spdlog::info("fleet: node {} registered (lease {}, TTL {} s)", config_.node_name, lease->id, lease->ttl_secs);
  return {};
}

Status FleetMember::renew() {
  int64_t lease = lease_.load();
  int64_t sent_at = now_ms();  // etcd renews on receipt: the lease runs at most TTL from here
  auto ttl = client_.keepalive(lease);
  if (!ttl) {
    if (ttl.error() == Error::kNotFound) {
      lease_ = 0;
      state_ = State::kFenced;
      last_renew_ms_ = 0;
      return fail(Error::kUnavailable, "lease " + std::to_string(lease) + " expired; registering again");
    }
    return fail(ttl.error(), "cannot renew lease: " + ttl.message());
  }
  last_renew_ms_ = sent_at;
  state_ = State::kLive;
  auto drain = client_.range(std::string(kFleetDrainPrefix) + config_.node_name);
  if (drain) draining_ = !drain->kvs.empty();
  return put_node_key(false);
}

Status FleetMember::put_node_key(bool force) {
  fleet::NodeInfo info;
  info.name = config_.node_name;
  info.api = config_.advertise_api;
  info.ingress = config_.advertise_ingress;
  info.state = draining_.load() ? fleet::NodeState::kDraining : fleet::NodeState::kReady;
  info.capacity_sandboxes = static_cast<int64_t>(capacity_);
  {
    std::lock_guard lock(mu_);
    info.sandboxes = static_cast<int64_t>(local_.size());
  }
  if (resources_) {
    const Resources r = resources_();
    info.capacity_memory_mb = r.capacity_memory_mb;
    info.reserved_memory_mb = r.reserved_memory_mb;
    info.capacity_millicpus = r.capacity_millicpus;
    info.reserved_millicpus = r.reserved_millicpus;
  }
  if (image_names_) {
    // An image imported or built since the last renewal shows up within a period; placement retries a
    // node that lacks one anyway, so a late list costs a refusal, never a create.
    auto names = image_names_();
    if (names && names->size() <= fleet::kMaxPublishedImages) info.images = std::move(*names);
  }
  std::string text = node_info_json(info);
  // Written when it changes, not on every renewal: the load moves with creates and removals, the images with
  // imports, builds and removals.
  if (!force && text == last_node_json_) return {};
  auto r = client_.put(std::string(kFleetNodesPrefix) + config_.node_name, text, lease_.load());
  if (!r) return fail(r.error(), "cannot write the node key: " + r.message());
  last_node_json_ = text;
  return {};
}

Status FleetMember::reconcile() {
  auto all = client_.range_prefix(kFleetSandboxesPrefix);
  if (!all) return all.failure();
  // Taken after the range: a claim in that answer was added to claimed_ before its txn was sent.
  std::map<std::string, Published> local;
  std::set<std::string> claimed;
  {
    std::lock_guard lock(mu_);
    local = local_;
    claimed = claimed_;
  }
  std::set<std::string> in_etcd;
  std::vector<std::string> conflicts;
  size_t written = 0, removed = 0;
  for (const etcd::KeyValue& kv : all->kvs) {
    std::string name = kv.key.substr(kFleetSandboxesPrefix.size());
    auto rec = parse_sandbox_owner(kv.value);
    if (!rec) {
      spdlog::warn("fleet: ignoring sandbox key {}: {}", kv.key, rec.message());
      continue;
    }
    in_etcd.insert(name);
    if (rec->node != config_.node_name) {
      if (local.count(name)) conflicts.push_back(name);
      continue;
    }
    auto mine = local.find(name);
    Op op;
    if (mine == local.end()) {
      // A claim of a create in flight stays; anything else of ours we no longer have (removed while etcd
      // was unreachable, lost with a crash mid-create, or a claim whose answer timed out) is released.
      if (rec->state == "creating" && claimed.count(name)) continue;
      op = Op{.kind = Op::Kind::kDelete, .key = kv.key};
      removed++;
    } else {
      std::string value = sandbox_owner_json(config_.node_name, mine->second.state, mine->second.ports);
      if (kv.value == value && kv.lease == 0) continue;
      op = Op{.kind = Op::Kind::kPut, .key = kv.key, .value = value};
      written++;
    }
    auto t = client_.txn({{.key = kv.key, .target = Compare::Target::kModRevision, .number = kv.mod_revision}}, {op}, {});
    if (!t) return t.failure();
    if (!t->succeeded) needs_reconcile_ = true;  // changed meanwhile: next round
  }
  for (const auto& [name, published] : local) {
    if (in_etcd.count(name)) continue;
    std::string key = std::string(kFleetSandboxesPrefix) + name;
    // Re-claimed: this node has the sandbox and etcd lost (or never got) its key.
    auto t = client_.txn({{.key = key, .target = Compare::Target::kCreateRevision, .number = 0}},
                         {{.kind = Op::Kind::kPut, .key = key,
                           .value = sandbox_owner_json(config_.node_name, published.state, published.ports)}}, {});
    if (!t) return t.failure();
    if (!t->succeeded) needs_reconcile_ = true;
    written++;
  }
  for (const auto& name : conflicts)
    spdlog::error("fleet: sandbox {} exists on this node but etcd gives its name to another node: a conflict "
                  "the operator must settle (rm one of them)", name);
  {
    std::lock_guard lock(mu_);
    conflicts_ = conflicts;
  }
  spdlog::info("fleet: reconciled {} local sandboxes against etcd ({} written, {} stale keys removed, {} conflicts)",
               local.size(), written, removed, conflicts.size());
  return {};
}

}  // namespace sg
