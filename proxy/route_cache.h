// What a proxy worker knows about a sandbox port between connections, so most connections never wait for
// the node:
// - the port policy (protocol, public or not), which the ClientHello needs (the ALPN offer, raw TCP mode)
//   before any request head; kept `policy_ttl_ms`, and replaced by every open's answer;
// - for a running sandbox, the route itself: the digests a credential is checked against (the sandbox's
//   token and the node's operator token, the node's own check), where to connect, and spare sockets the
//   node made in the sandbox's network namespace. A new connection then takes a spare and connects: no node
//   round trip. Kept for the `cache_ms` the node gave (short enough that the connections it lets through
//   are reported before the idle timeout could suspend the sandbox), and dropped at once when the node's
//   event stream says the sandbox stopped running or got a new token (invalidate), or the operator token
//   changed (flush). While that stream is down nothing is routed from the cache, with one exception: while
//   the node is gone (its socket refuses connections, checked again before each such use), the routes still
//   within their `cache_ms` when it went keep serving for up to `hold_without_node_ms` (a node that is down
//   changes nothing: no suspend, no new token), and a route out of spares has the SocketSource make more in
//   the namespace the node sent with them; the first sign of the node back stops that until the stream is
//   back (which drops them all: events may have been missed).
// - past its `cache_ms`, a route with such a namespace is kept dormant (its spares closed, its namespace and
//   digests kept) instead of dropped: it routes nothing while the node is up, but the events still drop it
//   when its sandbox stops running, so when the node goes down it is known to run and serves like the rest.
//   At most half the descriptor budget is dormant; the rest is dropped at expiry as before.
//
// Ordering: an open answered before an invalidation may arrive after it (two sockets). Every answer
// carries the node's stamp of the open, every event the stamp it happened at; an answer older than the
// latest invalidation of its sandbox (or than the stream's start) is not cached.
//
// One per worker (no locking). Only positive verdicts are cached: a credential that matches no digest goes
// to the node, which answers the 401 (and never wakes the sandbox for it). During an outage the workers'
// caches share what they serve through an OutageRoutes (proxy/outage_routes.h): a connection landing on a
// worker that never routed its sandbox is served from another worker's route.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "common/net.h"
#include "common/token_digest.h"

namespace sg {

class OutageRoutes;

// Makes unconnected TCP sockets (non-blocking, close-on-exec) in a network namespace: the node's job,
// done for a route cache while the node is down (proxy/socket_maker.h).
class SocketSource {
 public:
  virtual ~SocketSource() = default;
  virtual Result<std::vector<UniqueFd>> make(int netns, size_t count) = 0;
};

struct PortPolicy {
  std::string sandbox_id;
  std::string protocol;  // "http1", "h2c", "tcp"
  bool is_public = false;
};

// A route the node authorized, as an open or an internal/sockets answer describes it.
struct RouteGrant {
  std::string sandbox_id;
  uint16_t port = 0;
  PortPolicy policy;
  uint16_t connect_port = 0;          // spares connect to 127.0.0.1:connect_port
  uint64_t opened_at = 0;             // the node's stamp when the spares were made
  std::string token_sha256;           // the sandbox's token
  std::string operator_token_sha256;  // the node's operator token ("" = none)
  uint32_t cache_ms = 0;
  std::vector<UniqueFd> spares;
  UniqueFd netns;  // the namespace the spares live in, if the node sent it (SocketSource)
};

// A route as one worker serves it during a node outage, for the other workers (proxy/outage_routes.h): what
// a copy needs, without spares.
struct SharedRoute {
  std::string key;  // "<sandbox ref>:<port>", as the publisher's cache keys it
  PortPolicy policy;
  std::string token_sha256;
  std::string operator_token_sha256;
  uint16_t connect_port = 0;
  uint64_t opened_at = 0;
  UniqueFd netns;
};

// What opening a sandbox port gave a connection: the node's internal/open answer, or the route cache in its
// place (then `woke` is false and there are no spares).
struct OpenedSocket {
  std::string id;
  uint16_t port = 0;
  PortPolicy policy;
  bool woke = false;
  double wake_ms = 0;
  uint16_t connect_port = 0;  // where to connect the socket (127.0.0.1), unless `connected`
  bool connected = false;     // the socket is already connected to the port (a vsock stream)
  uint64_t opened_at = 0;     // the node's stamp of this open (suspends and rotations cut older connections)
  std::string token_sha256;   // the sandbox's token, recognised and removed in every request
  std::optional<size_t> credential;  // which candidate verified; none on a public port
  std::optional<TokenDigest> credential_sha256;  // its digest, when the route cache hashed it already
  UniqueFd socket;
  // For the worker's route cache (route_cache.h): more unconnected sockets like `socket`, how long they may
  // be used without asking, and the operator token's digest the node checked against. None: do not cache.
  std::vector<UniqueFd> spares;
  uint32_t cache_ms = 0;
  std::string operator_token_sha256;
  UniqueFd netns;  // the spares' network namespace, if the node sent it
};

// A connection routed from the cache.
struct CachedOpen {
  OpenedSocket opened;
  size_t refill = 0;  // few spares left and no refill asked for yet: the caller asks the node for this many
  size_t made_without_node = 0;  // sockets the SocketSource made for this open (the node is down)
};

class RouteCache {
 public:
  // policy_ttl_ms 0 disables the cache. At most `max_entries` are kept: a full cache is cleared rather than
  // tracked for recency (refilling costs one node call per port). At most `max_spares` descriptors are held
  // (they count against RLIMIT_NOFILE like connections); a grant beyond that is not cached.
  RouteCache(uint64_t policy_ttl_ms, size_t max_entries, size_t max_spares = kDefaultMaxSpares)
      : policy_ttl_ms_(policy_ttl_ms), max_entries_(max_entries), max_spares_(max_spares) {}
  static constexpr size_t kDefaultMaxSpares = 512;
  ~RouteCache();
  RouteCache(const RouteCache&) = delete;
  RouteCache& operator=(const RouteCache&) = delete;

  // Spares asked for with each open; the level at which more are asked for in the background, and how many
  // then. Only a route used again within its cache_ms gets a refill, so refills go to busy routes only: each
  // is a node round trip (and the node's setns into the sandbox's namespace), and a route that runs dry
  // before its refill is back sends its next connection through a full open. Asking while 2 are left instead
  // of 1 makes that rarer with a few connections starting at once (bench/RESULTS.md, "Small requests side by
  // side"). A refill is 16 spares; a route that used the last ones up within kBusyRefillMs asks for twice as
  // many next time, up to the node's most (kMaxSpareSockets), and one that took over 4 x kBusyRefillMs
  // for half as many: hundreds of new connections a second cost a node call per 64, and a route that sees a
  // few holds few descriptors.
  static constexpr size_t kSparesPerGrant = 4;
  static constexpr size_t kRefillBelow = 3;
  static constexpr size_t kSparesPerRefill = 16;
  static constexpr size_t kMaxSparesPerRefill = kMaxSpareSockets;
  static constexpr uint64_t kBusyRefillMs = 250;
  static constexpr uint32_t kMaxRouteMs = 30'000;

  // ---- port policies (the ClientHello) ----
  std::optional<PortPolicy> find(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms);
  void store(std::string_view sandbox_ref, uint16_t port, PortPolicy policy, uint64_t now_ms);
  // The port is gone or the name names another sandbox now: policy and route.
  void erase(std::string_view sandbox_ref, uint16_t port);
  // Every entry of a sandbox, whatever ref it was stored under.
  void erase_sandbox(std::string_view sandbox_id);

  // ---- routes ----
  // A socket for a new connection to `sandbox_ref`:`port`, if a live route is cached and the port is
  // public or one of `credentials` matches a digest. nullopt: ask the node.
  std::optional<CachedOpen> open(std::string_view sandbox_ref, uint16_t port, std::span<const std::string> credentials,
                                 uint64_t now_ms);
  // Whether a live route is cached for `sandbox_ref`:`port`: the sandbox ran when the node last answered and
  // nothing since said it stopped.
  bool has_route(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) const;
  // The node just said the sandbox is running or waking (an open, a lookup's prewake answer): a ClientHello
  // for the port needs no early wake while its policy is kept, unless an invalidation says it stopped
  // running. Without the event stream (route_cache off) the mark may outlive a suspend by up to the policy's
  // ttl, which costs only that early wake: the request then wakes the sandbox as it would anyway.
  void mark_awake(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms);
  // has_route, or marked awake: a ClientHello for it needs no early wake.
  bool known_awake(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) const;
  // Caches what an open answered (under the ref the client used). Ignored while the event stream is down,
  // when the grant predates an invalidation of its sandbox, or without spares.
  void grant(std::string_view sandbox_ref, RouteGrant grant, uint64_t now_ms);
  // Spares from a background refill (internal/sockets) for the route open() said wants one.
  void refill(std::string_view sandbox_ref, RouteGrant grant, uint64_t now_ms);
  // That refill failed or was cancelled: a later open may ask again.
  void refill_failed(std::string_view sandbox_ref, std::string_view sandbox_id, uint16_t port);

  // ---- the node's event stream ----
  // Connected: events from `stamp` on will be seen, so grants stamped from then on may be cached. Routes
  // kept from before the stream broke are dropped: what happened meanwhile is not known.
  void stream_up(uint64_t stamp);
  // Broken: nothing is routed from the cache or cached. Routes are kept, for node_gone().
  void stream_down(uint64_t now_ms);
  // With the stream down, the node is not accepting connections: the live routes serve out their cache_ms
  // until node_back(). If the stream ended with the node (within kNodeGoneAfterStreamMs), this is an outage
  // the stream saw everything before: every route, dormant ones too, serves until hold_without_node_ms after
  // the first such call (at least its cache_ms). Nothing serves if the node answered since the stream was
  // last up (node_answered). Ignored while the stream is up.
  void node_gone(uint64_t now_ms);
  static constexpr uint64_t kNodeGoneAfterStreamMs = 5'000;
  // How a node outage is served: routes kept live up to `hold_ms` after it began (0: only their cache_ms),
  // and `source` (none: nothing made) makes sockets for a route whose spares ran out.
  void serve_without_node(SocketSource* source, uint64_t hold_ms) {
    socket_source_ = source;
    hold_without_node_ms_ = hold_ms;
  }
  // Where this cache publishes the routes it serves during an outage, and finds those of the other workers'
  // caches for a sandbox port it holds no route for (null: none; set before any outage).
  void share_outage_routes(OutageRoutes* routes) { outage_routes_ = routes; }
  // The node accepts connections again (the stream is not back yet): no more routing from the cache, and
  // as node_answered().
  void node_back();
  // The node accepted a connection while the stream was down (alive without its events: it may change what
  // the routes say, unseen): until the stream is back, a node that goes down is served from no route. Not
  // within kDyingNodeMs of the stream's end: a node being killed may close its listener a moment after the
  // stream.
  void node_answered(uint64_t now_ms);
  static constexpr uint64_t kDyingNodeMs = 500;
  bool stream_is_up() const { return stream_ == Stream::kUp; }
  // An outage whose routes serve: the stream ended with the node, which has not answered since.
  bool outage_serves() const {
    return stream_ == Stream::kNodeGone && outage_since_ms_ && !node_answered_without_stream_;
  }
  bool serving_without_node() const { return stream_ == Stream::kNodeGone; }
  void invalidate(std::string_view sandbox_id, uint64_t stamp);
  // As invalidate, and the sandbox's port policies go too: its ports changed (exposed, closed, public or not).
  void forget(std::string_view sandbox_id, uint64_t stamp);
  void flush(uint64_t stamp);

  // Closes the spares of expired routes (each holds a sandbox's network namespace alive); those with a
  // namespace go dormant (expire), within the limit.
  void sweep(uint64_t now_ms);

  size_t size() const { return entries_.size(); }
  size_t spare_count() const { return spares_held_; }
  size_t namespace_count() const { return namespaces_held_; }
  size_t dormant_count() const { return dormant_routes_; }
  void set_ttl_ms(uint64_t ttl_ms) { policy_ttl_ms_ = ttl_ms; }

 private:
  enum class RouteState : uint8_t {
    kLive,     // routes connections until expires_ms
    kDormant,  // past expires_ms, no spares: kept only for a node outage (node_gone)
  };
  struct Route {
    RouteState state = RouteState::kLive;
    std::string token_sha256;
    std::string operator_token_sha256;
    uint16_t connect_port = 0;
    uint64_t opened_at = 0;
    uint64_t expires_ms = 0;
    std::vector<UniqueFd> spares;
    bool refill_asked = false;
    size_t refill_size = kSparesPerRefill;  // what the next refill asks for
    uint64_t refilled_ms = 0;               // when the latest refill came (0: none yet)
    UniqueFd netns;                         // where the spares live, for socket_source_ (may be none)
  };
  struct Entry {
    PortPolicy policy;
    uint64_t policy_expires_ms = 0;
    uint64_t awake_until_ms = 0;  // mark_awake
    std::optional<Route> route;
  };
  static std::string key(std::string_view sandbox_ref, uint16_t port);
  bool stale(const std::string& sandbox_id, uint64_t opened_at) const;
  Entry* slot(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms);
  void drop_route(Entry& e);
  // `e`'s live route reached expires_ms: dormant if it may be, else dropped.
  void expire(Entry& e);
  // Whether `r` routes connections now: live within its cache_ms, or anything within an outage's hold.
  bool serves(const Route& r, uint64_t now_ms) const;
  // Descriptors held: spares, namespaces and the copies published for an outage (the budget is max_spares_).
  size_t held() const { return spares_held_ + namespaces_held_ + published_held_; }
  // Takes `netns` for `r` unless it has one or the budget is spent (then it is closed with the caller's).
  void keep_namespace(Route& r, UniqueFd& netns);
  // Node gone and `r` out of spares: the socket source makes some. How many.
  size_t make_spares_without_node(Route& r);
  // An outage whose routes the workers share: it serves, and a maker can make sockets for a copy within a
  // hold.
  bool shares_outage_routes() const {
    return outage_serves() && socket_source_ != nullptr && hold_without_node_ms_ > 0;
  }
  // In an outage: what this cache serves goes to outage_routes_ (once per outage), and when it ends comes
  // back out.
  void publish_outage_routes();
  void withdraw_outage_routes();
  // In an outage: another worker's route for key `k`, unless this cache knows it stale (an invalidation or
  // a flush its stream got after the route was opened) or erased it in this outage.
  std::optional<SharedRoute> outage_route(const std::string& k, bool with_namespace) const;
  // In an outage, `sandbox_ref`:`port` has no route here: a copy of another worker's, if one of
  // `credentials` verifies against it (or the port is public).
  void adopt_outage_route(std::string_view sandbox_ref, uint16_t port, std::span<const std::string> credentials,
                          uint64_t now_ms);
  // The live route of `sandbox_ref`:`port` if it still belongs to `sandbox_id`.
  Route* asked_route(std::string_view sandbox_ref, std::string_view sandbox_id, uint16_t port);

  uint64_t policy_ttl_ms_;
  size_t max_entries_;
  size_t max_spares_;
  size_t spares_held_ = 0;
  size_t namespaces_held_ = 0;
  size_t dormant_routes_ = 0;
  uint64_t stream_down_ms_ = 0;  // when the stream last went from up to down
  // The outage node_gone() describes: since when (nullopt: none), and whether the node answered since the
  // stream was last up (node_answered: then no route serves until the stream is back).
  std::optional<uint64_t> outage_since_ms_;
  bool node_answered_without_stream_ = false;
  SocketSource* socket_source_ = nullptr;
  uint64_t hold_without_node_ms_ = 0;
  OutageRoutes* outage_routes_ = nullptr;
  bool published_ = false;     // in outage_routes_
  size_t published_held_ = 0;  // the namespace copies outage_routes_ holds for this cache
  uint64_t flushed_at_ = 0;    // the latest flush since the stream was last up
  // Erased in this outage (their sockets did not connect): not adopted again. Bounded; cleared at stream_up.
  std::unordered_set<std::string> unadoptable_;
  static constexpr size_t kMaxUnadoptable = 4096;
  std::unordered_map<std::string, Entry> entries_;
  enum class Stream {
    kDown,      // no event stream: nothing routed or cached (the start, or a break not yet explained)
    kUp,        // events flow: cached routes serve, grants are cached
    kNodeGone,  // no stream and no node: the routes kept serve until they expire; nothing new is cached
  };
  Stream stream_ = Stream::kDown;
  // Grants stamped before this are never cached: the stream's start, or the latest invalidation forgotten
  // when the map below was full.
  uint64_t floor_stamp_ = UINT64_MAX;
  std::unordered_map<std::string, uint64_t> invalidated_at_;  // by sandbox id
  static constexpr size_t kMaxInvalidations = 10'000;
};

}  // namespace sg
