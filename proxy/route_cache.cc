#include "proxy/route_cache.h"

#include <fcntl.h>

#include <algorithm>
#include <iterator>

#include "common/hex.h"
#include "common/token_digest.h"
#include "proxy/outage_routes.h"

namespace sg {

namespace {

struct Verified {
  std::optional<size_t> credential;  // none: a public port
  std::optional<TokenDigest> credential_sha256;
};

// The node's check (Node::check_credential): the sandbox's token or the operator token, both digests
// compared for each candidate so the time taken does not tell which one a guess matched. nullopt: none did.
std::optional<Verified> verify(const PortPolicy& policy, const std::string& sandbox_digest,
                               const std::string& operator_digest, std::span<const std::string> credentials) {
  Verified out;
  if (policy.is_public) return out;
  for (size_t i = 0; i < credentials.size() && !out.credential; ++i) {
    if (credentials[i].empty()) continue;
    auto presented = token_sha256(credentials[i]);
    if (!presented) continue;
    const std::string presented_hex = hex_encode(*presented);
    bool own = hex_digest_matches(presented_hex, sandbox_digest);
    bool op = hex_digest_matches(presented_hex, operator_digest);
    if (own || op) {
      out.credential = i;
      out.credential_sha256 = *presented;
    }
  }
  if (!out.credential) return std::nullopt;
  return out;
}

}  // namespace

RouteCache::~RouteCache() { withdraw_outage_routes(); }

std::string RouteCache::key(std::string_view sandbox_ref, uint16_t port) {
  std::string k(sandbox_ref);
  k += ':';
  k += std::to_string(port);
  return k;
}

void RouteCache::drop_route(Entry& e) {
  if (e.route) {
    spares_held_ -= e.route->spares.size();
    namespaces_held_ -= e.route->netns.valid() ? 1 : 0;
    dormant_routes_ -= e.route->state == RouteState::kDormant ? 1 : 0;
  }
  e.route.reset();
}

bool RouteCache::serves(const Route& r, uint64_t now_ms) const {
  if (stream_ == Stream::kNodeGone) {
    // The node answered since the stream was last up: it may have changed what any route says, unseen.
    if (node_answered_without_stream_) return false;
    if (outage_since_ms_) return now_ms < std::max(r.expires_ms, *outage_since_ms_ + hold_without_node_ms_);
  }
  return r.state == RouteState::kLive && now_ms < r.expires_ms;
}

void RouteCache::expire(Entry& e) {
  Route& r = *e.route;
  // Dormant only where an outage could use it: a maker to make its sockets and a hold (a reload may have
  // taken either away since it went dormant).
  const bool may_sleep = r.netns.valid() && socket_source_ != nullptr && hold_without_node_ms_ > 0;
  if (!may_sleep || (r.state == RouteState::kLive && dormant_routes_ >= max_spares_ / 2)) return drop_route(e);
  spares_held_ -= r.spares.size();  // a dormant route holds no sockets (those an outage made included)
  r.spares.clear();
  r.refill_asked = false;
  if (r.state == RouteState::kLive) {
    r.state = RouteState::kDormant;
    ++dormant_routes_;
  }
}

void RouteCache::keep_namespace(Route& r, UniqueFd& netns) {
  if (r.netns.valid() || !netns.valid() || held() >= max_spares_) return;
  r.netns = std::move(netns);
  ++namespaces_held_;
}

size_t RouteCache::make_spares_without_node(Route& r) {
  if (socket_source_ == nullptr || !r.netns.valid() || held() >= max_spares_) return 0;
  auto made = socket_source_->make(r.netns.get(), std::min(kSparesPerRefill, max_spares_ - held()));
  if (!made) return 0;  // the connection asks the node, which answers 503 while it is down
  spares_held_ += made->size();
  std::move(made->begin(), made->end(), std::back_inserter(r.spares));
  return made->size();
}

void RouteCache::publish_outage_routes() {
  if (outage_routes_ == nullptr || published_ || !shares_outage_routes()) return;
  // The copies count against this cache's descriptor budget while they are published.
  const size_t room = max_spares_ - std::min(held(), max_spares_);
  std::vector<SharedRoute> mine;
  for (const auto& [k, e] : entries_) {
    if (mine.size() >= std::min(room, OutageRoutes::kMaxPerPublisher)) break;
    if (!e.route || !e.route->netns.valid()) continue;
    UniqueFd netns(::fcntl(e.route->netns.get(), F_DUPFD_CLOEXEC, 0));
    if (!netns.valid()) break;  // out of descriptors: the rest is this worker's alone
    const Route& r = *e.route;
    mine.push_back({k, e.policy, r.token_sha256, r.operator_token_sha256, r.connect_port, r.opened_at,
                    std::move(netns)});
  }
  published_held_ = outage_routes_->publish(this, std::move(mine));
  published_ = true;
}

void RouteCache::withdraw_outage_routes() {
  if (!published_) return;
  outage_routes_->withdraw(this);
  published_ = false;
  published_held_ = 0;
}

std::optional<SharedRoute> RouteCache::outage_route(const std::string& k, bool with_namespace) const {
  if (outage_routes_ == nullptr || !shares_outage_routes() || unadoptable_.contains(k)) return std::nullopt;
  auto shared = outage_routes_->find(k, with_namespace);
  if (!shared) return std::nullopt;
  // What this worker's own stream said before the node went wins over another worker's route: the other may
  // not have got that event yet (a suspend, a new token, a flush), and the routes of both came from it.
  if (shared->opened_at < flushed_at_) return std::nullopt;
  auto it = invalidated_at_.find(shared->policy.sandbox_id);
  if (it != invalidated_at_.end() && shared->opened_at < it->second) return std::nullopt;
  return shared;
}

void RouteCache::adopt_outage_route(std::string_view sandbox_ref, uint16_t port,
                                    std::span<const std::string> credentials, uint64_t now_ms) {
  if (held() >= max_spares_ || dormant_routes_ >= max_spares_ / 2) return;
  std::string k = key(sandbox_ref, port);
  if (auto it = entries_.find(k); it != entries_.end() && it->second.route) return;
  auto shared = outage_route(k, true);
  // Only for a connection it lets through: a client naming sandboxes takes no descriptor and no slot.
  if (!shared || !verify(shared->policy, shared->token_sha256, shared->operator_token_sha256, credentials)) return;
  Entry* e = slot(sandbox_ref, port, now_ms);
  if (e == nullptr) return;
  e->policy = std::move(shared->policy);
  e->awake_until_ms = 0;
  // Dormant: it serves within this outage's hold only (serves()), like a route of this worker's own past
  // its cache_ms, and makes its sockets in the namespace.
  Route r;
  r.state = RouteState::kDormant;
  r.token_sha256 = std::move(shared->token_sha256);
  r.operator_token_sha256 = std::move(shared->operator_token_sha256);
  r.connect_port = shared->connect_port;
  r.opened_at = shared->opened_at;
  keep_namespace(r, shared->netns);
  ++dormant_routes_;
  e->route = std::move(r);
}

std::optional<PortPolicy> RouteCache::find(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) {
  const std::string k = key(sandbox_ref, port);
  auto it = entries_.find(k);
  if (stream_ == Stream::kNodeGone && (it == entries_.end() || !it->second.route)) {
    // Another worker's route tells the policy (the ClientHello needs it); it is taken only by an open whose
    // credential it verifies.
    if (auto shared = outage_route(k, false)) return shared->policy;
  }
  if (it == entries_.end()) return std::nullopt;
  Entry& e = it->second;
  if (e.route && !serves(*e.route, now_ms)) expire(e);
  // A route that serves vouches for the policy (the events keep both); a dormant one does not.
  if (now_ms >= e.policy_expires_ms && !(e.route && serves(*e.route, now_ms))) {
    if (!e.route) entries_.erase(it);
    return std::nullopt;
  }
  return e.policy;
}

RouteCache::Entry* RouteCache::slot(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) {
  if (policy_ttl_ms_ == 0 || max_entries_ == 0) return nullptr;
  std::string k = key(sandbox_ref, port);
  if (entries_.size() >= max_entries_ && !entries_.contains(k)) {
    entries_.clear();
    spares_held_ = 0;
    namespaces_held_ = 0;
    dormant_routes_ = 0;
  }
  Entry& e = entries_[std::move(k)];
  e.policy_expires_ms = now_ms + policy_ttl_ms_;
  return &e;
}

void RouteCache::store(std::string_view sandbox_ref, uint16_t port, PortPolicy policy, uint64_t now_ms) {
  Entry* e = slot(sandbox_ref, port, now_ms);
  if (e == nullptr) return;
  // The ref names another sandbox now: what was routed to the old one must not serve the new one.
  if (e->policy.sandbox_id != policy.sandbox_id) {
    if (e->route) drop_route(*e);
    e->awake_until_ms = 0;
  }
  e->policy = std::move(policy);
}

void RouteCache::erase(std::string_view sandbox_ref, uint16_t port) {
  // In an outage a route is erased when its socket did not connect (the sandbox is gone): no copy of it
  // from another worker either, until the stream is back.
  std::string k = key(sandbox_ref, port);
  auto it = entries_.find(k);
  if (stream_ == Stream::kNodeGone && unadoptable_.size() < kMaxUnadoptable) unadoptable_.insert(std::move(k));
  if (it == entries_.end()) return;
  drop_route(it->second);
  entries_.erase(it);
}

void RouteCache::erase_sandbox(std::string_view sandbox_id) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.policy.sandbox_id != sandbox_id) {
      ++it;
      continue;
    }
    drop_route(it->second);
    it = entries_.erase(it);
  }
}

bool RouteCache::has_route(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) const {
  if (stream_ == Stream::kDown) return false;
  auto it = entries_.find(key(sandbox_ref, port));
  return it != entries_.end() && it->second.route && serves(*it->second.route, now_ms);
}

void RouteCache::mark_awake(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) {
  auto it = entries_.find(key(sandbox_ref, port));
  if (it != entries_.end() && now_ms < it->second.policy_expires_ms) it->second.awake_until_ms = it->second.policy_expires_ms;
}

bool RouteCache::known_awake(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) const {
  auto it = entries_.find(key(sandbox_ref, port));
  if (it == entries_.end()) return false;
  const Entry& e = it->second;
  return now_ms < e.awake_until_ms || (stream_ != Stream::kDown && e.route && serves(*e.route, now_ms));
}

std::optional<CachedOpen> RouteCache::open(std::string_view sandbox_ref, uint16_t port,
                                           std::span<const std::string> credentials, uint64_t now_ms) {
  if (stream_ == Stream::kDown) return std::nullopt;
  if (stream_ == Stream::kNodeGone) adopt_outage_route(sandbox_ref, port, credentials, now_ms);
  auto it = entries_.find(key(sandbox_ref, port));
  if (it == entries_.end() || !it->second.route) return std::nullopt;
  Entry& e = it->second;
  Route& r = *e.route;
  if (!serves(r, now_ms)) {  // past its cache_ms, or dormant while the node answers
    expire(e);
    return std::nullopt;
  }
  const bool can_make = stream_ == Stream::kNodeGone && socket_source_ != nullptr && r.netns.valid();
  if (r.spares.empty() && !can_make) return std::nullopt;
  auto verified = verify(e.policy, r.token_sha256, r.operator_token_sha256, credentials);
  if (!verified) return std::nullopt;
  // Only for a connection the route lets through: a wrong token makes none.
  const size_t made = r.spares.empty() ? make_spares_without_node(r) : 0;
  if (r.spares.empty()) return std::nullopt;
  CachedOpen out;
  out.made_without_node = made;
  OpenedSocket& o = out.opened;
  o.id = e.policy.sandbox_id;
  o.port = port;
  o.policy = e.policy;
  o.connect_port = r.connect_port;
  o.opened_at = r.opened_at;
  o.token_sha256 = r.token_sha256;
  o.credential = verified->credential;
  o.credential_sha256 = verified->credential_sha256;
  o.socket = std::move(r.spares.back());
  r.spares.pop_back();
  --spares_held_;
  // The node's refills; while it is gone, make_spares_without_node does its job when the last is taken.
  if (stream_ == Stream::kUp && r.spares.size() < kRefillBelow && !r.refill_asked) {
    // How long the last refill lasted sizes the next (the first is kSparesPerRefill: an open's few spares
    // going fast say little).
    if (r.refilled_ms != 0) {
      const uint64_t lasted_ms = now_ms - r.refilled_ms;
      if (lasted_ms < kBusyRefillMs) r.refill_size = std::min(r.refill_size * 2, kMaxSparesPerRefill);
      if (lasted_ms > 4 * kBusyRefillMs) r.refill_size = std::max(r.refill_size / 2, kSparesPerRefill);
    }
    // Beyond the descriptor budget the refill's spares would be closed as they came.
    out.refill = std::min(r.refill_size, max_spares_ - std::min(held(), max_spares_));
    r.refill_asked = out.refill > 0;
  }
  return out;
}

bool RouteCache::stale(const std::string& sandbox_id, uint64_t opened_at) const {
  if (stream_ != Stream::kUp || opened_at < floor_stamp_) return true;
  auto it = invalidated_at_.find(sandbox_id);
  return it != invalidated_at_.end() && opened_at < it->second;
}

void RouteCache::grant(std::string_view sandbox_ref, RouteGrant grant, uint64_t now_ms) {
  if (grant.spares.empty() || grant.cache_ms == 0 || stale(grant.sandbox_id, grant.opened_at)) return;
  auto existing = entries_.find(key(sandbox_ref, grant.port));
  size_t replaced = 0;
  if (existing != entries_.end() && existing->second.route)
    replaced = existing->second.route->spares.size() + (existing->second.route->netns.valid() ? 1 : 0);
  if (held() - replaced + grant.spares.size() > max_spares_) return;  // the descriptor budget is spent
  Entry* e = slot(sandbox_ref, grant.port, now_ms);
  if (e == nullptr) return;
  Route r;
  // An open that found the route dry replaces it: the pace of its refills stays with the sandbox's route.
  if (e->route && e->policy.sandbox_id == grant.sandbox_id) {
    r.refill_size = e->route->refill_size;
    r.refilled_ms = e->route->refilled_ms;
  }
  drop_route(*e);
  e->policy = std::move(grant.policy);
  r.token_sha256 = std::move(grant.token_sha256);
  r.operator_token_sha256 = std::move(grant.operator_token_sha256);
  r.connect_port = grant.connect_port;
  r.opened_at = grant.opened_at;
  r.expires_ms = now_ms + std::min(grant.cache_ms, kMaxRouteMs);
  r.spares = std::move(grant.spares);
  spares_held_ += r.spares.size();
  keep_namespace(r, grant.netns);
  e->route = std::move(r);
}

RouteCache::Route* RouteCache::asked_route(std::string_view sandbox_ref, std::string_view sandbox_id, uint16_t port) {
  auto it = entries_.find(key(sandbox_ref, port));
  if (it == entries_.end() || !it->second.route || it->second.policy.sandbox_id != sandbox_id) return nullptr;
  return &*it->second.route;
}

void RouteCache::refill(std::string_view sandbox_ref, RouteGrant grant, uint64_t now_ms) {
  if (stale(grant.sandbox_id, grant.opened_at)) return;
  Route* r = asked_route(sandbox_ref, grant.sandbox_id, grant.port);
  if (r == nullptr) return;  // dropped meanwhile: the spares are closed with `grant`
  r->refill_asked = false;
  if (r->state == RouteState::kDormant) {  // asked before it expired: the node's answer makes it live again
    r->state = RouteState::kLive;
    --dormant_routes_;
  }
  // A new digest means the route changed under us (the token was rotated): the stream's invalidation is on
  // its way; keep nothing until a full open.
  if (r->token_sha256 != grant.token_sha256 || grant.cache_ms == 0) {
    drop_route(entries_.find(key(sandbox_ref, grant.port))->second);
    return;
  }
  r->operator_token_sha256 = grant.operator_token_sha256;
  r->connect_port = grant.connect_port;
  r->opened_at = grant.opened_at;
  r->expires_ms = now_ms + std::min(grant.cache_ms, kMaxRouteMs);
  keep_namespace(*r, grant.netns);  // an open from a node without it, refilled by one with it
  if (held() + grant.spares.size() > max_spares_) return;  // over budget: they are closed
  r->refilled_ms = now_ms;
  spares_held_ += grant.spares.size();
  std::move(grant.spares.begin(), grant.spares.end(), std::back_inserter(r->spares));
}

void RouteCache::refill_failed(std::string_view sandbox_ref, std::string_view sandbox_id, uint16_t port) {
  if (Route* r = asked_route(sandbox_ref, sandbox_id, port)) r->refill_asked = false;
}

void RouteCache::stream_up(uint64_t stamp) {
  withdraw_outage_routes();
  flushed_at_ = 0;
  unadoptable_.clear();
  if (stream_ != Stream::kUp)
    for (auto& [k, e] : entries_) drop_route(e);
  stream_ = Stream::kUp;
  floor_stamp_ = stamp;
  invalidated_at_.clear();
  outage_since_ms_.reset();
  node_answered_without_stream_ = false;
}

void RouteCache::stream_down(uint64_t now_ms) {
  if (stream_ == Stream::kUp) stream_down_ms_ = now_ms;
  stream_ = Stream::kDown;
  floor_stamp_ = UINT64_MAX;
}

void RouteCache::node_gone(uint64_t now_ms) {
  if (stream_ != Stream::kDown) return;
  stream_ = Stream::kNodeGone;
  // A node that is down suspends nothing and rotates no token: what the stream said of a route until the
  // node went stays true until it is back. cache_ms only bounds how late the connections it let through are
  // reported. The hold counts from the first call: the stream's retries call again every second.
  if (!outage_since_ms_ && !node_answered_without_stream_ && now_ms - stream_down_ms_ <= kNodeGoneAfterStreamMs)
    outage_since_ms_ = now_ms;
  publish_outage_routes();
}

void RouteCache::node_back() {
  if (stream_ != Stream::kNodeGone) return;
  stream_ = Stream::kDown;
  node_answered_without_stream_ = true;
  withdraw_outage_routes();
}

void RouteCache::node_answered(uint64_t now_ms) {
  if (stream_ != Stream::kUp && now_ms - stream_down_ms_ >= kDyingNodeMs) {
    node_answered_without_stream_ = true;
    withdraw_outage_routes();
  }
}

void RouteCache::invalidate(std::string_view sandbox_id, uint64_t stamp) {
  for (auto& [k, e] : entries_)
    if (e.policy.sandbox_id == sandbox_id) {
      drop_route(e);
      e.awake_until_ms = 0;
    }
  std::string id(sandbox_id);
  if (invalidated_at_.size() >= kMaxInvalidations && !invalidated_at_.contains(id)) {
    // Forgetting them must not let an old grant in: the floor rises to the newest forgotten stamp.
    for (const auto& [i, s] : invalidated_at_) floor_stamp_ = std::max(floor_stamp_, s);
    invalidated_at_.clear();
  }
  uint64_t& at = invalidated_at_[id];
  at = std::max(at, stamp);
}

void RouteCache::forget(std::string_view sandbox_id, uint64_t stamp) {
  invalidate(sandbox_id, stamp);
  erase_sandbox(sandbox_id);
}

void RouteCache::flush(uint64_t stamp) {
  for (auto& [k, e] : entries_) {
    drop_route(e);
    e.awake_until_ms = 0;
  }
  floor_stamp_ = std::max(floor_stamp_, stamp);
  flushed_at_ = std::max(flushed_at_, stamp);  // kept past the stream's end, unlike the floor
  invalidated_at_.clear();
}

void RouteCache::sweep(uint64_t now_ms) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.route && !serves(*e.route, now_ms)) expire(e);
    it = !e.route && now_ms >= e.policy_expires_ms ? entries_.erase(it) : std::next(it);
  }
}


}  // namespace sg
