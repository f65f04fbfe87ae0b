#include "proxy/route_cache.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "common/token_digest.h"
#include "proxy/outage_routes.h"
#include "tests/netns.h"

namespace sg {
namespace {

PortPolicy policy(std::string id, std::string protocol, bool is_public) {
  return PortPolicy{std::move(id), std::move(protocol), is_public};
}

TEST(RouteCache, RemembersUntilTheTtl) {
  RouteCache cache(1000, 100);
  EXPECT_FALSE(cache.find("demo", 8080, 0));
  cache.store("demo", 8080, policy("sb-1", "h2c", true), 10);
  auto hit = cache.find("demo", 8080, 500);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->sandbox_id, "sb-1");
  EXPECT_EQ(hit->protocol, "h2c");
  EXPECT_TRUE(hit->is_public);
  EXPECT_FALSE(cache.find("demo", 8081, 500)) << "per port";
  EXPECT_FALSE(cache.find("other", 8080, 500)) << "per sandbox";
  EXPECT_FALSE(cache.find("demo", 8080, 1010)) << "expired";
  EXPECT_EQ(cache.size(), 0u) << "an expired entry is dropped when found";
}

TEST(RouteCache, ErasesByPortAndBySandbox) {
  RouteCache cache(1000, 100);
  cache.store("demo", 8080, policy("sb-1", "http1", false), 0);
  cache.store("sb-1", 22, policy("sb-1", "tcp", true), 0);
  cache.store("other", 8080, policy("sb-2", "http1", false), 0);
  cache.erase("demo", 8080);
  EXPECT_FALSE(cache.find("demo", 8080, 1));
  EXPECT_TRUE(cache.find("sb-1", 22, 1));
  cache.erase_sandbox("sb-1");
  EXPECT_FALSE(cache.find("sb-1", 22, 1));
  EXPECT_TRUE(cache.find("other", 8080, 1));
}

TEST(RouteCache, BoundedAndDisabledByAZeroTtl) {
  RouteCache cache(1000, 3);
  for (int i = 0; i < 3; ++i) cache.store("s" + std::to_string(i), 80, policy("id", "http1", false), 0);
  EXPECT_EQ(cache.size(), 3u);
  cache.store("s0", 80, policy("id", "h2c", false), 0);  // replacing keeps the size
  EXPECT_EQ(cache.size(), 3u);
  cache.store("s9", 80, policy("id", "http1", false), 0);
  EXPECT_EQ(cache.size(), 1u) << "full: cleared, then the new entry";
  RouteCache off(0, 100);
  off.store("demo", 8080, policy("sb-1", "http1", false), 0);
  EXPECT_FALSE(off.find("demo", 8080, 0));
}

std::vector<UniqueFd> sockets(size_t n) {
  std::vector<UniqueFd> out;
  for (size_t i = 0; i < n; ++i) out.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  return out;
}

RouteGrant grant(std::string id, bool is_public, uint64_t opened_at, size_t spares, uint32_t cache_ms = 5000) {
  RouteGrant g;
  g.sandbox_id = id;
  g.port = 8080;
  g.policy = PortPolicy{std::move(id), "http1", is_public};
  g.connect_port = 8080;
  g.opened_at = opened_at;
  g.token_sha256 = token_digest("sandbox-token");
  g.operator_token_sha256 = token_digest("operator-token");
  g.cache_ms = cache_ms;
  g.spares = sockets(spares);
  return g;
}

const std::vector<std::string> kOwnToken{"sandbox-token"};

TEST(RouteCache, RoutesFromSparesWithTheNodesCredentialCheck) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 4), 0);
  EXPECT_EQ(cache.spare_count(), 4u);
  EXPECT_FALSE(cache.open("demo", 8080, {}, 1)) << "no credential: the node answers the 401";
  std::vector<std::string> wrong{"guess"};
  EXPECT_FALSE(cache.open("demo", 8080, wrong, 1)) << "a wrong one too";
  EXPECT_EQ(cache.spare_count(), 4u) << "a refusal takes no spare";
  std::vector<std::string> two{"app-bearer", "operator-token"};
  auto hit = cache.open("demo", 8080, two, 1);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->opened.credential, std::optional<size_t>(1)) << "which candidate matched, as the node says";
  EXPECT_EQ(hit->opened.credential_sha256, token_sha256("operator-token"))
      << "and its digest, so the connection strips it from requests without hashing it again";
  EXPECT_EQ(hit->opened.id, "sb-1");
  EXPECT_EQ(hit->opened.opened_at, 20u);
  EXPECT_TRUE(hit->opened.socket.valid());
  EXPECT_EQ(hit->refill, 0u) << "three left";
  auto second = cache.open("demo", 8080, kOwnToken, 1);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->opened.credential, std::optional<size_t>(0));
  EXPECT_EQ(second->refill, RouteCache::kSparesPerRefill) << "two left: ask for more, once";
  auto third = cache.open("demo", 8080, kOwnToken, 1);
  ASSERT_TRUE(third);
  EXPECT_EQ(third->refill, 0u) << "already asked";
  ASSERT_TRUE(cache.open("demo", 8080, kOwnToken, 1));
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1)) << "out of spares: the node";
  EXPECT_FALSE(cache.open("other", 8080, kOwnToken, 1)) << "per ref";
  EXPECT_TRUE(cache.find("demo", 8080, 1)) << "the policy stays";
}

TEST(RouteCache, PublicPortsNeedNoCredential) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", true, 20, 1), 0);
  auto hit = cache.open("demo", 8080, {}, 1);
  ASSERT_TRUE(hit);
  EXPECT_FALSE(hit->opened.credential);
}

TEST(RouteCache, NothingIsRoutedWithoutTheEventStream) {
  RouteCache cache(1000, 100);
  cache.grant("demo", grant("sb-1", false, 20, 2), 0);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1)) << "never up: not cached";
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 5, 2), 0);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1)) << "an open from before the stream started";
  cache.grant("demo", grant("sb-1", false, 20, 2), 0);
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 1));
  cache.stream_down(0);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1)) << "down: nothing is routed";
  EXPECT_EQ(cache.spare_count(), 1u) << "but the route is kept, for a node that turns out to be gone";
  cache.grant("demo", grant("sb-1", false, 30, 2), 0);
  EXPECT_EQ(cache.spare_count(), 1u) << "and none is cached while down";
  cache.stream_up(40);
  EXPECT_EQ(cache.spare_count(), 0u) << "back: what was kept goes (events may have been missed)";
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 41));
}

// The node is down (its socket refuses): routes kept serve their spares until they expire, a credential
// they cannot verify still goes to the node (503 there), and the first sign of the node back ends it.
TEST(RouteCache, RoutesKeptServeWhileTheNodeIsGoneAndStopWhenItIsBack) {
  RouteCache cache(1000, 100);
  cache.node_gone(0);
  cache.stream_up(10);
  cache.node_gone(0);
  cache.grant("demo", grant("sb-1", false, 20, 3, 500), 0);
  ASSERT_TRUE(cache.open("demo", 8080, kOwnToken, 1)) << "node_gone is ignored while the stream is up";
  cache.stream_down(0);
  EXPECT_FALSE(cache.serving_without_node());
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 2)) << "a break alone: not known whether the node is gone";
  cache.node_gone(0);
  EXPECT_TRUE(cache.serving_without_node());
  EXPECT_FALSE(cache.open("demo", 8080, std::vector<std::string>{"sgt_wrong"}, 3)) << "a token the route cannot verify";
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 3)) << "gone: the route serves";
  EXPECT_TRUE(cache.has_route("demo", 8080, 3));
  cache.grant("other", grant("sb-2", false, 30, 2, 500), 3);
  EXPECT_FALSE(cache.open("other", 8080, kOwnToken, 4)) << "nothing new is cached without the stream";
  cache.node_back();
  EXPECT_FALSE(cache.serving_without_node());
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 5)) << "the node is back: it answers, not the cache";
  cache.stream_down(0);
  cache.node_gone(0);  // down again before its stream came back
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 6))
      << "the node answered meanwhile and may have changed the route unseen: nothing until the stream is back";
  cache.stream_up(40);
  cache.grant("demo", grant("sb-1", false, 50, 1, 500), 10);
  cache.stream_down(20);
  cache.node_gone(20);
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 21)) << "the stream back: the next outage is served";
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 22)) << "out of spares: none can be made without a maker";
}

// The stream ended, and the node still accepts connections a while later: alive without its events, it may
// change what the routes say unseen. If it goes down after that, no route serves until the stream is back.
// Within kDyingNodeMs of the stream's end, though, that is a node being killed, whose listener closes a
// moment after its stream.
TEST(RouteCache, ANodeThatAnswersWithoutItsStreamIsNotTrustedWhenItGoesDown) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 3, 5'000), 0);
  cache.stream_down(100);
  cache.node_answered(100 + RouteCache::kDyingNodeMs - 1);  // the dying node's listener, still there
  cache.node_gone(1'100);
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 1'101));
  cache.node_back();
  cache.stream_up(2'000);
  cache.grant("demo", grant("sb-1", false, 2'010, 3, 5'000), 2'000);
  cache.stream_down(2'100);
  cache.node_answered(2'100 + RouteCache::kDyingNodeMs);  // a retry a while later finds it answering
  cache.node_gone(3'100);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 3'101));
}

// Stands for the socket maker: counts what it is asked, makes plain sockets (or fails when told to).
class FakeSocketSource : public SocketSource {
 public:
  Result<std::vector<UniqueFd>> make(int netns, size_t count) override {
    ++calls;
    asked = count;
    struct stat st{};
    netns_inode = ::fstat(netns, &st) == 0 ? st.st_ino : 0;
    if (fail) return sg::fail(Error::kTimeout, "the socket maker did not answer");
    return sockets(count);
  }
  int calls = 0;
  size_t asked = 0;
  ino_t netns_inode = 0;
  bool fail = false;
};

// A cache whose event stream is up, serving a node outage with a fake maker for `hold_ms`.
struct OutageCache {
  OutageCache(size_t max_spares, uint64_t hold_ms) : cache(1000, 100, max_spares) {
    cache.serve_without_node(&maker, hold_ms);
    cache.stream_up(10);
  }
  FakeSocketSource maker;
  RouteCache cache;
};


RouteGrant grant_with_namespace(std::string id, uint64_t opened_at, size_t spares, uint32_t cache_ms) {
  RouteGrant g = grant(std::move(id), false, opened_at, spares, cache_ms);
  g.netns = UniqueFd(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  return g;
}

// issue 12: the proxy keeps serving running sandboxes while the node is down. A node that is down changes
// nothing, so a route live when it went serves for hold_without_node_ms, and one out of spares has the
// socket source make more in the namespace the node sent: for a connection it lets through only.
TEST(RouteCache, WhileTheNodeIsGoneARouteOutOfSparesGetsSocketsMadeInItsNamespaceAndOutlivesItsCacheMs) {
  OutageCache t(RouteCache::kDefaultMaxSpares, 60'000);
  RouteCache& cache = t.cache;
  FakeSocketSource& maker = t.maker;
  cache.grant("demo", grant_with_namespace("sb-1", 20, 1, 500), 0);
  cache.grant("late", grant_with_namespace("sb-2", 20, 1, 500), 0);
  EXPECT_EQ(cache.namespace_count(), 2u);
  ASSERT_TRUE(cache.open("demo", 8080, kOwnToken, 1)) << "its one spare";
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 2)) << "node up: out of spares means an open, not the maker";
  EXPECT_EQ(maker.calls, 0);

  cache.stream_down(0);
  cache.node_gone(100);
  EXPECT_FALSE(cache.open("demo", 8080, std::vector<std::string>{"sgt_wrong"}, 101)) << "a wrong token";
  EXPECT_FALSE(cache.open("demo", 8080, {}, 101)) << "or none";
  EXPECT_EQ(maker.calls, 0) << "makes nothing";
  auto hit = cache.open("demo", 8080, kOwnToken, 5'000);
  ASSERT_TRUE(hit) << "past its cache_ms (500), out of spares: made";
  EXPECT_EQ(maker.calls, 1);
  EXPECT_EQ(maker.asked, RouteCache::kSparesPerRefill);
  EXPECT_EQ(maker.netns_inode, testing::own_netns_inode()) << "in the namespace the node sent";
  EXPECT_EQ(hit->refill, 0u) << "no refill is asked of a node that is gone";
  EXPECT_EQ(hit->made_without_node, RouteCache::kSparesPerRefill) << "counted by the caller";
  EXPECT_EQ(cache.spare_count(), RouteCache::kSparesPerRefill - 1 + 1) << "the rest, and late's one";
  for (size_t i = 1; i < RouteCache::kSparesPerRefill; ++i) ASSERT_TRUE(cache.open("demo", 8080, kOwnToken, 6'000));
  EXPECT_EQ(maker.calls, 1) << "one call per kSparesPerRefill connections";
  ASSERT_TRUE(cache.open("demo", 8080, kOwnToken, 60'099));
  EXPECT_EQ(maker.calls, 2);
  EXPECT_TRUE(cache.open("late", 8080, kOwnToken, 60'099));
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 60'100)) << "held for 60 s from the outage's start, no longer";
  cache.sweep(60'100);
  EXPECT_EQ(cache.spare_count(), 0u) << "past the hold their spares are closed";
}

TEST(RouteCache, WithoutTheNodeNothingIsMadeForARouteWithoutANamespaceOrAfterAFailure) {
  OutageCache t(6, 60'000);
  RouteCache& cache = t.cache;
  FakeSocketSource& maker = t.maker;
  cache.grant("plain", grant("sb-2", false, 20, 1, 5'000), 0);
  cache.grant("failing", grant_with_namespace("sb-3", 20, 1, 5'000), 0);
  EXPECT_EQ(cache.spare_count() + cache.namespace_count(), 3u);
  cache.stream_down(600);
  cache.node_gone(600);
  ASSERT_TRUE(cache.open("plain", 8080, kOwnToken, 601));
  EXPECT_FALSE(cache.open("plain", 8080, kOwnToken, 602)) << "no namespace from its node: its spares only";
  EXPECT_EQ(maker.calls, 0);
  ASSERT_TRUE(cache.open("failing", 8080, kOwnToken, 602));
  maker.fail = true;
  EXPECT_FALSE(cache.open("failing", 8080, kOwnToken, 603)) << "the maker failed: the node's answer (503)";
  EXPECT_EQ(maker.calls, 1);
  maker.fail = false;
  auto hit = cache.open("failing", 8080, kOwnToken, 604);
  ASSERT_TRUE(hit);
  EXPECT_EQ(maker.asked, 5u) << "within the descriptor budget (6), which its namespace shares";
}

// Past its cache_ms a route with a namespace is kept dormant: it routes nothing while the node answers (the
// node's idle clock must see every connection), but the events keep it honest, so an outage revives it.
TEST(RouteCache, PastItsCacheMsARouteWithANamespaceIsKeptDormantForANodeOutage) {
  OutageCache t(8, 60'000);
  RouteCache& cache = t.cache;
  FakeSocketSource& maker = t.maker;
  cache.grant("demo", grant_with_namespace("sb-1", 20, 2, 500), 0);
  cache.grant("plain", grant("sb-2", false, 20, 1, 500), 0);
  cache.sweep(500);
  EXPECT_EQ(cache.dormant_count(), 1u);
  EXPECT_EQ(cache.spare_count(), 0u) << "its spares are closed; the route without a namespace is gone";
  EXPECT_EQ(cache.namespace_count(), 1u);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 600)) << "dormant: the node answers while it is up";
  EXPECT_FALSE(cache.has_route("demo", 8080, 600));
  EXPECT_FALSE(cache.known_awake("demo", 8080, 600));
  EXPECT_FALSE(cache.find("demo", 8080, 5'000)) << "nor does it keep the policy past its ttl";
  EXPECT_EQ(maker.calls, 0);
  cache.stream_down(20'000);
  cache.node_gone(20'100);  // the stream ended with the node
  auto hit = cache.open("demo", 8080, kOwnToken, 20'200);
  ASSERT_TRUE(hit) << "the outage revives it, with sockets made in its namespace";
  EXPECT_EQ(maker.calls, 1);
  EXPECT_EQ(hit->made_without_node, 7u) << "the descriptor budget (8) less its namespace";
  EXPECT_TRUE(cache.find("demo", 8080, 20'200)) << "its policy answers the ClientHello again";
  EXPECT_FALSE(cache.open("plain", 8080, kOwnToken, 20'200));
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 80'099));
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 80'100)) << "for hold_without_node_ms from the outage";
}

TEST(RouteCache, EventsDropDormantRoutesAndAStreamThatEndedBeforeTheNodeRevivesNone) {
  OutageCache t(12, 60'000);
  RouteCache& cache = t.cache;
  cache.grant("suspended", grant_with_namespace("sb-1", 20, 1, 500), 0);
  cache.grant("kept", grant_with_namespace("sb-2", 20, 1, 500), 0);
  cache.grant("fresh", grant_with_namespace("sb-3", 20, 1, 30'000), 0);
  cache.sweep(600);
  EXPECT_EQ(cache.dormant_count(), 2u);
  cache.invalidate("sb-1", 30);
  EXPECT_EQ(cache.dormant_count(), 1u) << "the sandbox stopped running: its dormant route goes";
  EXPECT_EQ(cache.namespace_count(), 2u);
  cache.stream_down(1'000);
  cache.node_gone(1'000 + RouteCache::kNodeGoneAfterStreamMs + 1);  // the stream broke well before the node went
  EXPECT_FALSE(cache.open("kept", 8080, kOwnToken, 7'000)) << "what the node did after the stream broke is unknown";
  ASSERT_TRUE(cache.open("fresh", 8080, kOwnToken, 7'000)) << "a live route serves out its cache_ms";
  EXPECT_TRUE(cache.open("fresh", 8080, kOwnToken, 29'999)) << "with sockets made";
  EXPECT_FALSE(cache.open("fresh", 8080, kOwnToken, 30'000)) << "and no longer";
}

// The stream's retries call node_gone every second: the hold counts from the first. A node that was back
// meanwhile (accepting, the stream not up yet) may have changed what the routes say: no hold after that.
TEST(RouteCache, AnOutagesHoldCountsFromItsStartAndEndsWhenTheNodeWasBack) {
  OutageCache t(RouteCache::kDefaultMaxSpares, 10'000);
  RouteCache& cache = t.cache;
  cache.grant("demo", grant_with_namespace("sb-1", 20, 4, 500), 0);
  cache.stream_down(100);
  cache.node_gone(100);
  for (uint64_t t = 1'100; t < 9'000; t += 1'000) {  // retries, each finding the node still gone
    cache.stream_down(t);
    cache.node_gone(t);
  }
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 10'099));
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 10'100)) << "10 s from the first call, not from the last";

  OutageCache second(RouteCache::kDefaultMaxSpares, 10'000);
  RouteCache& flapping = second.cache;
  flapping.grant("demo", grant_with_namespace("sb-1", 20, 4, 500), 0);
  flapping.stream_down(100);
  flapping.node_gone(100);
  flapping.node_back();  // the node accepts again; its stream is not back yet
  flapping.stream_down(200);
  flapping.node_gone(200);
  EXPECT_FALSE(flapping.open("demo", 8080, kOwnToken, 201)) << "not even within its cache_ms";
  flapping.stream_up(300);
  flapping.grant("demo", grant_with_namespace("sb-1", 320, 4, 500), 1'000);
  flapping.stream_down(1'100);
  flapping.node_gone(1'100);
  EXPECT_TRUE(flapping.open("demo", 8080, kOwnToken, 5'000)) << "the stream up again: the next outage holds";
}

// Two workers' caches publishing to and copying from one board (which the caller keeps past them).
struct SharingCaches {
  explicit SharingCaches(OutageRoutes& board) {
    first.cache.share_outage_routes(&board);
    second.cache.share_outage_routes(&board);
  }
  OutageCache first{RouteCache::kDefaultMaxSpares, 60'000};
  OutageCache second{RouteCache::kDefaultMaxSpares, 60'000};
};

// Route caches are per worker and a new connection lands on any worker: during an outage a worker that never
// routed a sandbox serves it from another worker's route (OutageRoutes), with the same credential check, as
// long as both are in the outage.
TEST(RouteCache, InAnOutageAWorkerWithoutTheRouteServesItFromAnotherWorkers) {
  OutageRoutes board;
  SharingCaches workers(board);
  auto& [first, second] = workers;
  first.cache.grant("demo", grant_with_namespace("sb-1", 20, 2, 500), 0);
  first.cache.grant("plain", grant("sb-2", true, 20, 2), 0);  // no namespace: nothing to share
  EXPECT_FALSE(second.cache.open("demo", 8080, kOwnToken, 1)) << "node up: the other worker asks it";
  EXPECT_EQ(board.size(), 0u) << "nothing shared while the node is up";

  second.cache.stream_down(100);  // its outage begins first, with nothing published yet
  second.cache.node_gone(100);
  EXPECT_FALSE(second.cache.open("demo", 8080, kOwnToken, 101));
  first.cache.stream_down(100);
  first.cache.node_gone(100);
  EXPECT_EQ(board.size(), 1u) << "demo, which has a namespace";

  EXPECT_FALSE(second.cache.open("demo", 8080, std::vector<std::string>{"sgt_wrong"}, 200)) << "a wrong token";
  auto policy = second.cache.find("demo", 8080, 200);
  ASSERT_TRUE(policy) << "the policy comes with it (the ClientHello asks)";
  EXPECT_EQ(policy->sandbox_id, "sb-1");
  EXPECT_EQ(second.cache.namespace_count(), 0u) << "a ClientHello or a wrong token takes no copy";
  EXPECT_EQ(second.cache.dormant_count(), 0u);
  auto hit = second.cache.open("demo", 8080, kOwnToken, 5'000);
  ASSERT_TRUE(hit) << "past the route's cache_ms: within the outage's hold";
  EXPECT_EQ(hit->opened.id, "sb-1");
  EXPECT_EQ(hit->opened.connect_port, 8080);
  EXPECT_EQ(hit->opened.token_sha256, token_digest("sandbox-token"));
  EXPECT_EQ(second.maker.calls, 1) << "its sockets made in the namespace";
  EXPECT_EQ(second.maker.netns_inode, testing::own_netns_inode());
  EXPECT_EQ(second.cache.namespace_count(), 1u) << "a copy of its own";
  EXPECT_FALSE(second.cache.open("plain", 8080, {}, 5'000)) << "a route without a namespace is not shared";
  EXPECT_FALSE(second.cache.open("demo", 8080, kOwnToken, 60'100)) << "no longer than its own hold";

  first.cache.node_back();  // the node answers the first worker: its routes are not served any more
  EXPECT_EQ(board.size(), 0u);
}

TEST(RouteCache, OutageRoutesAreWithdrawnWhenTheNodeAnswersOrTheStreamIsBackAndNotTakenOutsideAnOutage) {
  OutageRoutes board;
  {
    SharingCaches workers(board);
    auto& [first, second] = workers;
    first.cache.grant("demo", grant_with_namespace("sb-1", 20, 2, 500), 0);
    first.cache.stream_down(100);
    first.cache.node_gone(100);
    ASSERT_EQ(board.size(), 1u);
    second.cache.stream_down(100);  // its stream is down but the node accepts: not an outage for it
    second.cache.node_answered(1'000);
    second.cache.node_gone(1'100);
    EXPECT_FALSE(second.cache.open("demo", 8080, kOwnToken, 1'200)) << "a node alive without its events";
    EXPECT_EQ(second.maker.calls, 0);
    first.cache.stream_up(2'000);
    EXPECT_EQ(board.size(), 0u) << "the stream back: withdrawn";
    first.cache.grant("demo", grant_with_namespace("sb-1", 2'020, 2, 500), 2'100);
    first.cache.stream_down(3'000);
    first.cache.node_gone(3'000);
    ASSERT_EQ(board.size(), 1u) << "the next outage publishes again";
    first.cache.stream_down(4'000);
    first.cache.node_answered(4'000);
    EXPECT_EQ(board.size(), 0u) << "the node answered: withdrawn";
    first.cache.stream_up(5'000);
    first.cache.grant("demo", grant_with_namespace("sb-1", 5'020, 2, 500), 5'100);
    first.cache.stream_down(6'000);
    first.cache.node_gone(6'000);
    ASSERT_EQ(board.size(), 1u);
  }
  EXPECT_EQ(board.size(), 0u) << "a cache destroyed in an outage withdraws too";
}

// What a worker's own stream said before the node went wins over another worker's route: that worker may
// not have got the event yet. And a route whose socket did not connect in the outage is not taken again.
TEST(RouteCache, AWorkerTakesNoRouteItsOwnStreamSaidIsStaleOrThatFailedInThisOutage) {
  OutageRoutes board;
  SharingCaches workers(board);
  auto& [first, second] = workers;
  first.cache.grant("demo", grant_with_namespace("sb-1", 20, 2, 500), 0);
  first.cache.grant("other", grant_with_namespace("sb-2", 20, 2, 500), 0);
  first.cache.grant("third", grant_with_namespace("sb-3", 20, 2, 500), 0);
  second.cache.invalidate("sb-1", 30);  // the first worker's stream had not delivered this one yet
  for (RouteCache* c : {&first.cache, &second.cache}) {
    c->stream_down(100);
    c->node_gone(100);
  }
  ASSERT_EQ(board.size(), 3u);
  EXPECT_FALSE(second.cache.find("demo", 8080, 200)) << "invalidated here";
  EXPECT_FALSE(second.cache.open("demo", 8080, kOwnToken, 200));
  ASSERT_TRUE(second.cache.open("other", 8080, kOwnToken, 200));
  second.cache.erase("other", 8080);  // its socket did not connect: the sandbox is gone
  EXPECT_FALSE(second.cache.open("other", 8080, kOwnToken, 300)) << "not taken again in this outage";
  EXPECT_TRUE(second.cache.open("third", 8080, kOwnToken, 300));

  OutageCache flushed(RouteCache::kDefaultMaxSpares, 60'000);
  flushed.cache.share_outage_routes(&board);
  flushed.cache.flush(40);  // the operator token changed
  flushed.cache.stream_down(100);
  flushed.cache.node_gone(100);
  EXPECT_FALSE(flushed.cache.open("third", 8080, kOwnToken, 200)) << "opened before the flush this worker saw";
}

// The copies a cache publishes are descriptors: they count against its budget while published.
TEST(RouteCache, PublishedCopiesCountAgainstTheDescriptorBudget) {
  OutageRoutes board;
  OutageCache small(6, 60'000);
  small.cache.share_outage_routes(&board);
  small.cache.grant("demo", grant_with_namespace("sb-1", 20, 1, 500), 0);
  small.cache.grant("other", grant_with_namespace("sb-2", 20, 1, 500), 0);
  ASSERT_EQ(small.cache.spare_count() + small.cache.namespace_count(), 4u);
  small.cache.stream_down(100);
  small.cache.node_gone(100);
  EXPECT_EQ(board.size(), 2u) << "room for both";
  ASSERT_TRUE(small.cache.open("demo", 8080, kOwnToken, 200));  // its spare
  ASSERT_TRUE(small.cache.open("demo", 8080, kOwnToken, 200)) << "one more made: the budget's last";
  EXPECT_EQ(small.maker.asked, 1u) << "6 held: 1 spare, 2 namespaces, 2 published, and room for 1";

  OutageCache full(4, 60'000);
  full.cache.share_outage_routes(&board);
  full.cache.grant("demo", grant_with_namespace("sb-1", 20, 1, 500), 0);
  full.cache.grant("other", grant_with_namespace("sb-2", 20, 1, 500), 0);
  full.cache.stream_down(100);
  full.cache.node_gone(100);
  EXPECT_EQ(board.size(), 2u) << "the first cache's two; this one's budget is spent: it published none";
}

TEST(RouteCache, NothingIsSharedWithoutAMakerOrAHold) {
  OutageRoutes board;
  RouteCache spares_only(1000, 100);
  spares_only.share_outage_routes(&board);
  spares_only.serve_without_node(nullptr, 60'000);  // not root: no socket maker
  spares_only.stream_up(10);
  spares_only.grant("demo", grant_with_namespace("sb-1", 20, 2, 500), 0);
  spares_only.stream_down(100);
  spares_only.node_gone(100);
  EXPECT_EQ(board.size(), 0u);
  OutageCache no_hold(RouteCache::kDefaultMaxSpares, 0);  // routes_without_node_secs = 0
  no_hold.cache.share_outage_routes(&board);
  no_hold.cache.grant("demo", grant_with_namespace("sb-1", 20, 2, 500), 0);
  no_hold.cache.stream_down(100);
  no_hold.cache.node_gone(100);
  EXPECT_EQ(board.size(), 0u);
}

TEST(RouteCache, AnOpenOrARefillMakesADormantRouteLiveAgainAndTheCountsFollow) {
  OutageCache t(RouteCache::kDefaultMaxSpares, 60'000);
  RouteCache& cache = t.cache;
  cache.grant("demo", grant_with_namespace("sb-1", 20, 4, 500), 0);
  cache.grant("other", grant_with_namespace("sb-2", 20, 4, 500), 0);
  ASSERT_TRUE(cache.open("other", 8080, kOwnToken, 1));
  ASSERT_TRUE(cache.open("other", 8080, kOwnToken, 1));  // two left: a refill is asked
  cache.sweep(500);
  ASSERT_EQ(cache.dormant_count(), 2u);
  ASSERT_EQ(cache.spare_count(), 0u);
  // The node's next open of demo replaces its dormant route.
  cache.grant("demo", grant_with_namespace("sb-1", 30, 2, 500), 600);
  EXPECT_EQ(cache.dormant_count(), 1u);
  EXPECT_EQ(cache.spare_count(), 2u);
  EXPECT_EQ(cache.namespace_count(), 2u) << "the replaced route's namespace closed, the new one's kept";
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 601));
  // The refill other asked for before it went dormant comes back: live again, with its spares.
  RouteGrant refill = grant_with_namespace("sb-2", 40, 16, 500);
  cache.refill("other", std::move(refill), 700);
  EXPECT_EQ(cache.dormant_count(), 0u);
  EXPECT_EQ(cache.spare_count(), 1u + 16u);
  EXPECT_EQ(cache.namespace_count(), 2u) << "the refill's namespace is closed: the route has one";
  EXPECT_TRUE(cache.open("other", 8080, kOwnToken, 701));
  // A reload to routes_without_node_secs = 0: dormant routes go at their next look.
  cache.sweep(1'200);
  ASSERT_EQ(cache.dormant_count(), 2u);
  cache.serve_without_node(&t.maker, 0);
  cache.sweep(1'201);
  EXPECT_EQ(cache.dormant_count(), 0u);
  EXPECT_EQ(cache.namespace_count(), 0u);
}

TEST(RouteCache, AtMostHalfTheDescriptorBudgetIsDormant) {
  OutageCache t(5, 60'000);
  RouteCache& cache = t.cache;
  FakeSocketSource& maker = t.maker;
  for (const std::string ref : {"a", "b", "c"}) {
    cache.grant(ref, grant_with_namespace("sb-" + ref, 20, 1, 500), 0);
    ASSERT_TRUE(cache.open(ref, 8080, kOwnToken, 1)) << ref;  // its one spare: only its namespace is held
  }
  ASSERT_EQ(cache.namespace_count(), 3u);
  cache.sweep(500);
  EXPECT_EQ(cache.dormant_count(), 2u);
  EXPECT_EQ(cache.namespace_count(), 2u) << "the third was dropped at expiry, its namespace closed";
  RouteCache off(1000, 100, 5);
  off.serve_without_node(&maker, 0);  // routes_without_node_secs = 0: nothing past cache_ms
  off.stream_up(10);
  off.grant("a", grant_with_namespace("sb-a", 20, 1, 500), 0);
  off.sweep(500);
  EXPECT_EQ(off.dormant_count(), 0u);
  EXPECT_EQ(off.namespace_count(), 0u);
}

TEST(RouteCache, ChangedPortsDropTheSandboxsPoliciesTooAndStillWinOverOlderOpens) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.store("demo", 3000, policy("sb-1", "http1", false), 0);
  cache.grant("demo", grant("sb-1", false, 20, 2), 0);
  cache.store("keep", 8080, policy("sb-2", "http1", false), 0);
  cache.invalidate("sb-1", 25);
  EXPECT_TRUE(cache.find("demo", 3000, 1)) << "a plain invalidation keeps the policy (the ClientHello needs it)";
  cache.forget("sb-1", 30);
  EXPECT_FALSE(cache.find("demo", 3000, 1)) << "the port may be public now, or closed";
  EXPECT_FALSE(cache.find("demo", 8080, 1));
  EXPECT_EQ(cache.spare_count(), 0u);
  EXPECT_TRUE(cache.find("keep", 8080, 1));
  cache.grant("demo", grant("sb-1", false, 28, 2), 0);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1)) << "answered before the change";
}

TEST(RouteCache, AnInvalidationWinsOverAnOpenAnsweredBeforeIt) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 2), 0);
  cache.grant("sb-1", grant("sb-1", false, 20, 2), 0);
  cache.grant("keep", grant("sb-2", false, 20, 2), 0);
  cache.invalidate("sb-1", 30);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1)) << "every ref of the sandbox";
  EXPECT_FALSE(cache.open("sb-1", 8080, kOwnToken, 1));
  EXPECT_TRUE(cache.open("keep", 8080, kOwnToken, 1)) << "other sandboxes keep theirs";
  // The answer to an open the node handled before the suspend arrives after the event.
  cache.grant("demo", grant("sb-1", false, 25, 2), 0);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1));
  cache.grant("demo", grant("sb-1", false, 35, 2), 0);
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 1)) << "an open after it (resumed) is cached";
  cache.flush(40);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1)) << "operator token changed: everything";
  EXPECT_FALSE(cache.open("keep", 8080, kOwnToken, 1));
  cache.grant("keep", grant("sb-2", false, 39, 2), 0);
  EXPECT_FALSE(cache.open("keep", 8080, kOwnToken, 1)) << "older than the flush";
}

TEST(RouteCache, ForgottenInvalidationsRaiseTheFloor) {
  RouteCache cache(1000, 1'000'000);
  cache.stream_up(1);
  for (uint64_t i = 0; i < 10'001; ++i) cache.invalidate("sb-" + std::to_string(i), 100 + i);
  // sb-0's invalidation (stamp 100) was forgotten when the map was full: an older grant must still lose.
  cache.grant("demo", grant("sb-0", false, 99, 1), 0);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 1));
}

TEST(RouteCache, RoutesExpireAndSweepClosesTheirSpares) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 3, 500), 0);
  cache.grant("zero", grant("sb-2", false, 20, 3, 0), 0);
  EXPECT_EQ(cache.spare_count(), 3u) << "cache_ms 0: the node said not to";
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 499));
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 500)) << "expired";
  cache.grant("demo", grant("sb-1", false, 30, 3, 500), 600);
  cache.sweep(1100);
  EXPECT_EQ(cache.spare_count(), 0u) << "expired spares are closed by the sweep";
  cache.sweep(5000);
  EXPECT_EQ(cache.size(), 0u) << "and the policy after its own ttl";
}

// What a ClientHello asks before it asks the node to wake the sandbox (proxy.wake_at_client_hello).
TEST(RouteCache, HasRouteOnlyForALiveRouteWhileTheStreamIsUp) {
  RouteCache cache(1000, 100);
  cache.store("demo", 8080, PortPolicy{"sb-1", "http1", false}, 0);
  EXPECT_FALSE(cache.has_route("demo", 8080, 1)) << "a policy alone says nothing of the sandbox's state";
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 3, 500), 0);
  EXPECT_TRUE(cache.has_route("demo", 8080, 499));
  EXPECT_FALSE(cache.has_route("demo", 8081, 499)) << "another port";
  EXPECT_FALSE(cache.has_route("demo", 8080, 500)) << "expired";
  cache.grant("demo", grant("sb-1", false, 30, 3, 500), 600);
  cache.invalidate("sb-1", 40);  // it stopped running
  EXPECT_FALSE(cache.has_route("demo", 8080, 601));
  cache.grant("demo", grant("sb-1", false, 50, 3, 500), 700);
  ASSERT_TRUE(cache.has_route("demo", 8080, 701));
  cache.stream_down(0);
  EXPECT_FALSE(cache.has_route("demo", 8080, 701)) << "without the event stream nothing is known to run";
}

// Without a route (route_cache off, or a vsock sandbox), what the node last said: running or waking.
TEST(RouteCache, AnAwakeMarkLastsWhileThePolicyIsKeptUnlessTheSandboxStopsRunning) {
  RouteCache cache(1000, 100);
  cache.mark_awake("demo", 8080, 0);
  EXPECT_FALSE(cache.known_awake("demo", 8080, 1)) << "no policy, no mark";
  cache.store("demo", 8080, PortPolicy{"sb-1", "http1", false}, 0);
  cache.mark_awake("demo", 8080, 10);
  EXPECT_TRUE(cache.known_awake("demo", 8080, 999));
  EXPECT_FALSE(cache.known_awake("demo", 8080, 1000)) << "the policy's ttl";
  cache.store("demo", 8080, PortPolicy{"sb-1", "http1", false}, 1000);
  EXPECT_FALSE(cache.known_awake("demo", 8080, 1001)) << "a refreshed policy is not a fresh mark";
  cache.mark_awake("demo", 8080, 1001);
  cache.invalidate("sb-1", 5);
  EXPECT_FALSE(cache.known_awake("demo", 8080, 1002)) << "it stopped running";
  cache.mark_awake("demo", 8080, 1003);
  cache.store("demo", 8080, PortPolicy{"sb-2", "http1", false}, 1004);
  EXPECT_FALSE(cache.known_awake("demo", 8080, 1005)) << "the name is another sandbox's now";
  cache.mark_awake("demo", 8080, 1006);
  cache.flush(6);
  EXPECT_FALSE(cache.known_awake("demo", 8080, 1007));
}

TEST(RouteCache, RefillsTopUpTheRouteThatAsked) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 1), 0);
  auto hit = cache.open("demo", 8080, kOwnToken, 1);
  ASSERT_TRUE(hit);
  EXPECT_GT(hit->refill, 0u);
  cache.refill("demo", grant("sb-1", false, 30, 4), 2);
  EXPECT_EQ(cache.spare_count(), 4u);
  EXPECT_TRUE(cache.open("demo", 8080, kOwnToken, 3));
  // A refill that shows a new token digest drops the route (the rotation's event is on its way).
  RouteGrant rotated = grant("sb-1", false, 40, 4);
  rotated.token_sha256 = token_digest("new-token");
  cache.refill("demo", std::move(rotated), 4);
  EXPECT_EQ(cache.spare_count(), 0u);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 5));
}

// Takes spares until the route asks for a refill; returns how many it asked for (0: it ran dry first).
size_t use_until_refill(RouteCache& cache, uint64_t now_ms) {
  while (auto hit = cache.open("demo", 8080, kOwnToken, now_ms))
    if (hit->refill > 0) return hit->refill;
  return 0;
}

TEST(RouteCache, ABusyRouteAsksForLargerRefillsAndAQuietOneForSmallerOnes) {
  RouteCache cache(1000, 100, 1000);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 4, 60'000), 0);
  uint64_t now = 1;
  EXPECT_EQ(use_until_refill(cache, now), RouteCache::kSparesPerRefill)
      << "the first refill, however fast the open's spares went";
  size_t asked = RouteCache::kSparesPerRefill;
  for (int i = 0; i < 4; ++i) {
    cache.refill("demo", grant("sb-1", false, 20, asked, 60'000), now);
    now += 10;  // each refill used up within 10 ms
    size_t next = use_until_refill(cache, now);
    EXPECT_EQ(next, std::min(2 * asked, RouteCache::kMaxSparesPerRefill)) << "refill " << i;
    asked = next;
  }
  EXPECT_EQ(asked, RouteCache::kMaxSparesPerRefill) << "no more than the node makes per call";
  cache.refill("demo", grant("sb-1", false, 20, asked, 60'000), now);
  now += 2 * RouteCache::kBusyRefillMs;  // neither busy nor quiet: the same again
  EXPECT_EQ(use_until_refill(cache, now), RouteCache::kMaxSparesPerRefill);
  cache.refill("demo", grant("sb-1", false, 20, asked, 60'000), now);
  now += 5 * RouteCache::kBusyRefillMs;  // quiet: half
  EXPECT_EQ(use_until_refill(cache, now), RouteCache::kMaxSparesPerRefill / 2);
  for (int i = 0; i < 3; ++i) {
    cache.refill("demo", grant("sb-1", false, 20, RouteCache::kSparesPerRefill, 60'000), now);
    now += 5 * RouteCache::kBusyRefillMs;
    EXPECT_EQ(use_until_refill(cache, now), RouteCache::kSparesPerRefill) << "never below the first size";
  }
}

TEST(RouteCache, AnOpenThatFoundTheRouteDryKeepsThePaceOfItsRefills) {
  RouteCache cache(1000, 100, 1000);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 4, 60'000), 0);
  EXPECT_EQ(use_until_refill(cache, 1), RouteCache::kSparesPerRefill);
  cache.refill("demo", grant("sb-1", false, 20, RouteCache::kSparesPerRefill, 60'000), 2);
  EXPECT_EQ(use_until_refill(cache, 3), 2 * RouteCache::kSparesPerRefill);
  while (cache.open("demo", 8080, kOwnToken, 3)) {
  }
  // Dry before the refill came back: the next connection's open brings a grant, which replaces the route.
  cache.grant("demo", grant("sb-1", false, 30, 4, 60'000), 4);
  cache.refill("demo", grant("sb-1", false, 30, 2 * RouteCache::kSparesPerRefill, 60'000), 5);
  EXPECT_EQ(use_until_refill(cache, 6), 4 * RouteCache::kSparesPerRefill) << "still doubling";
  cache.grant("demo", grant("sb-2", false, 40, 4, 60'000), 7);  // the name is another sandbox's now
  EXPECT_EQ(use_until_refill(cache, 8), RouteCache::kSparesPerRefill) << "a new route starts over";
}

TEST(RouteCache, ARefillAsksForNoMoreThanTheDescriptorBudgetLeaves) {
  RouteCache cache(1000, 100, 12);
  cache.stream_up(10);
  cache.grant("other", grant("sb-2", false, 20, 8), 0);
  cache.grant("demo", grant("sb-1", false, 20, 4), 0);
  EXPECT_EQ(use_until_refill(cache, 2000), 12u - 8u - 2u) << "8 held for another route, 2 still for this one";
}

TEST(RouteCache, HoldsNoMoreSparesThanItsBudget) {
  RouteCache cache(1000, 100, 5);
  cache.stream_up(10);
  cache.grant("a", grant("sb-1", false, 20, 3), 0);
  cache.grant("b", grant("sb-2", false, 20, 3), 0);
  EXPECT_EQ(cache.spare_count(), 3u) << "the second grant would pass the budget";
  EXPECT_FALSE(cache.open("b", 8080, kOwnToken, 1));
  cache.grant("a", grant("sb-1", false, 21, 2), 0);
  EXPECT_EQ(cache.spare_count(), 2u) << "a new grant replaces the entry's spares";
  cache.refill("a", grant("sb-1", false, 22, 3), 1);
  EXPECT_EQ(cache.spare_count(), 5u);
  cache.refill("a", grant("sb-1", false, 23, 1), 1);
  EXPECT_EQ(cache.spare_count(), 5u) << "full";
  cache.erase("a", 8080);
  EXPECT_EQ(cache.spare_count(), 0u);
}

TEST(RouteCache, ANameGivenToANewSandboxDropsTheOldRoute) {
  RouteCache cache(1000, 100);
  cache.stream_up(10);
  cache.grant("demo", grant("sb-1", false, 20, 2), 0);
  cache.store("demo", 8080, policy("sb-2", "http1", false), 1);
  EXPECT_FALSE(cache.open("demo", 8080, kOwnToken, 2));
  EXPECT_EQ(cache.find("demo", 8080, 2)->sandbox_id, "sb-2");
}

}  // namespace
}  // namespace sg
