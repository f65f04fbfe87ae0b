// The proxy's route cache through the real daemons with curl: new connections to a running sandbox cost no
// node round trip (the node's own request log is the witness), and whatever changes what the node would
// answer (suspend, token rotation, delete, operator token) reaches the cache before the call that made the
// change returns.
#include <gtest/gtest.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

// One worker, so every connection meets the same cache.
ClusterOptions one_worker(std::string extra = {}) { return ClusterOptions::proxy("workers = 1\n" + extra); }

size_t opens(Cluster& c) { return c.node_calls("/v1/internal/open"); }

size_t cached_entries(Cluster& c, const std::string& ref) {
  size_t n = 0;
  for (const auto& e : c.access_log()) n += e.value("sandbox_ref", "") == ref && e.value("route_cached", false) ? 1 : 0;
  return n;
}

TEST(RouteCache, ConnectionsToARunningSandboxDoNotAskTheNode) {
  ClusterOptions options = one_worker();
  options.operator_token = "sgop_route-cache-operator";
  Cluster c(options);
  const std::string token = c.create_private_serving("warm");
  ASSERT_FALSE(token.empty());
  const std::string host = "8080-warm.sandbox.localhost";
  // The serving check above made the open that filled the cache.
  size_t before = opens(c);
  for (int i = 0; i < 12; ++i) ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200) << i;
  EXPECT_EQ(opens(c), before) << "12 new TLS connections, no open: every one was routed from the cache\n"
                              << c.node().log();
  EXPECT_TRUE(eventually([&] { return cached_entries(c, "warm") >= 12; }, std::chrono::seconds(5)));
  EXPECT_GE(c.node_calls("/v1/internal/sockets"), 1u) << "spares were refilled in the background";
  // The sandbox's code never sees the token, cached route or not (/seen: every head the testserver got).
  auto echo = c.curl(host, "/seen", bearer(token));
  EXPECT_EQ(Cluster::http_code(echo), 200);
  EXPECT_EQ(Cluster::body(echo).find(token), std::string::npos) << Cluster::body(echo);
  // Nor the operator token, whether it opened the connection or came beside the sandbox's.
  before = opens(c);
  for (const std::string& credentials : {bearer(options.operator_token), bearer(token) + " " + bearer(options.operator_token)}) {
    echo = c.curl(host, "/seen", credentials);
    EXPECT_EQ(Cluster::http_code(echo), 200);
    EXPECT_EQ(Cluster::body(echo).find(options.operator_token), std::string::npos) << Cluster::body(echo);
    EXPECT_EQ(Cluster::body(echo).find(token), std::string::npos) << Cluster::body(echo);
  }
  EXPECT_EQ(opens(c), before) << "routed from the cache";
  // Only positive verdicts are cached: a wrong token is the node's 401.
  before = opens(c);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer("sgt_wrong"))), 401);
  EXPECT_EQ(opens(c), before + 1);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/")), 401) << "no token at all";
}

TEST(RouteCache, SuspendRotationAndDeleteReachTheCacheBeforeTheyAnswer) {
  Cluster c(one_worker());
  const std::string token = c.create_private_serving("moving");
  ASSERT_FALSE(token.empty());
  const std::string host = "8080-moving.sandbox.localhost";
  ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);

  // Suspended: the next connection must go through the node, which wakes it (not to the frozen one).
  auto s = c.cli("suspend moving");
  ASSERT_EQ(s.exit_code, 0) << s.err;
  ASSERT_TRUE(eventually([&] { return c.get("moving")["state"] == "suspended"; }, std::chrono::seconds(10)));
  size_t before = opens(c);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token), 20)), 200);
  EXPECT_EQ(opens(c), before + 1);
  auto woke = c.wait_access_entry([](const nlohmann::json& e) { return e.value("woke", false); });
  EXPECT_TRUE(woke.is_object()) << "the request after the suspend did not wake it";

  // Rotated: the old token is refused by the very next connection.
  ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);
  auto r = c.cli("token rotate moving");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string fresh = r.out.substr(0, r.out.find('\n'));
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 401) << "the cache still had the old token";
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(fresh))), 200) << r.out;

  // Deleted: gone for the next connection too.
  ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(fresh))), 200);
  ASSERT_EQ(c.cli("rm moving").exit_code, 0);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(fresh))), 404);
}

// issue 12: "the proxy keeps serving running sandboxes while the node is down (route cache) and answers 503 +
// Retry-After for the rest". A node that is down changes nothing, so the routes the cache holds serve with
// their spare sockets; whatever they cannot answer gets 503. Once the node is back its events come first.
TEST(RouteCache, WhileTheNodeIsDownCachedRoutesServeAndEverythingElseGets503) {
  Cluster c(one_worker());
  const std::string token = c.create_private_serving("steady");
  ASSERT_FALSE(token.empty());
  const std::string other = c.create_private_serving("other");
  const std::string host = "8080-steady.sandbox.localhost";
  ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);  // its route is cached now
  c.stop_node(SIGKILL);  // a crash: the sandboxes keep running and the next node adopts them
  EXPECT_TRUE(eventually([&] { return c.proxy().log().find("the node is down: routes cached") != std::string::npos; },
                         std::chrono::seconds(5)))
      << c.proxy().log();
  const size_t cached_before = cached_entries(c, "steady");
  auto served = c.curl(host, "/", bearer(token));
  EXPECT_EQ(Cluster::http_code(served), 200) << served.out << c.proxy().log();
  EXPECT_EQ(Cluster::body(served), "hello from steady");
  EXPECT_TRUE(eventually([&] { return cached_entries(c, "steady") == cached_before + 1; }, std::chrono::seconds(5)));
  // What the cache cannot answer: a credential it cannot verify, a sandbox it holds no route for.
  for (const auto& [h, t] : {std::pair{host, std::string("sgt_not-the-token")},
                             std::pair{std::string("8080-nobody.sandbox.localhost"), token}}) {
    auto r = c.curl(h, "/", "-i " + bearer(t));
    EXPECT_EQ(Cluster::http_code(r), 503) << h << "\n" << r.out;
    EXPECT_NE(r.out.find("Retry-After:"), std::string::npos) << r.out;
  }
  c.start_node();
  EXPECT_TRUE(eventually([&] { return c.proxy().log().find("route events from sandgate-node again") != std::string::npos; },
                         std::chrono::seconds(10)))
      << c.proxy().log();
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);
  size_t before = opens(c);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);
  EXPECT_EQ(opens(c), before) << "cached again";
  EXPECT_EQ(Cluster::http_code(c.curl("8080-other.sandbox.localhost", "/", bearer(other))), 200);
}

// Past the spares its route holds and past its cache_ms: while the node is down, the proxy's socket maker
// makes the route's sockets in the sandbox's network namespace (routes_without_node_secs, an hour by default).
TEST(RouteCache, WhileTheNodeIsDownARunningSandboxTakesNewConnectionsPastItsSparesAndItsCacheMs) {
  Cluster c(one_worker("metrics_listen = [\"127.0.0.1:0\"]\n"));
  // A 5 s idle timeout: the node lets a proxy cache the route for less than that (route_cache_ms).
  const std::string token = c.create_private_serving("busy", "--timeout 5");
  ASSERT_FALSE(token.empty());
  EXPECT_NE(c.proxy().log().find("socket maker pid"), std::string::npos) << c.proxy().log();
  const std::string host = "8080-busy.sandbox.localhost";
  ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);
  c.stop_node(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(eventually([&] { return c.proxy().log().find("the node is down: routes cached") != std::string::npos; },
                         std::chrono::seconds(5)))
      << c.proxy().log();
  // Each curl is a new TLS connection, so a new socket into the sandbox. A route holds at most 4 + 16 + 32
  // spares here (an open's, then refills doubling from 16 while used up fast).
  size_t served = 0;
  while (served < 150 || std::chrono::steady_clock::now() - killed < std::chrono::seconds(7)) {
    auto r = c.curl(host, "/", bearer(token));
    ASSERT_EQ(Cluster::http_code(r), 200) << "connection " << served << "\n" << r.out << c.proxy().log();
    ASSERT_EQ(Cluster::body(r), "hello from busy");
    ++served;
    ASSERT_LT(served, 1000u);
  }
  const std::string metrics =
      run("curl -s http://127.0.0.1:" + std::to_string(c.metrics_port()) + "/metrics").out;
  const std::string name = "\nsandgate_proxy_sockets_made_without_node_total ";
  const size_t at = metrics.find(name);
  ASSERT_NE(at, std::string::npos) << metrics;
  const size_t made = std::stoul(metrics.substr(at + name.size()));
  EXPECT_GE(made, served - 4 - 16 - 32) << "the connections the spares held could not carry had sockets made";
  // The node back: its events first, then the cache as before.
  c.start_node();
  EXPECT_TRUE(eventually([&] { return c.proxy().log().find("route events from sandgate-node again") != std::string::npos; },
                         std::chrono::seconds(10)))
      << c.proxy().log();
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token), 20)), 200);
}

// A sandbox reached a while before the node went down (its route past cache_ms, dormant): served too, since
// the node's events dropped nothing of it meanwhile.
TEST(RouteCache, WhileTheNodeIsDownASandboxReachedBeforeItsLastCacheMsServesToo) {
  Cluster c(one_worker("metrics_listen = [\"127.0.0.1:0\"]\n"));
  // A 10 s idle timeout: the node lets a proxy cache the route for 7 s (route_cache_ms: the timeout less two
  // report intervals and a second).
  const std::string token = c.create_private_serving("quiet", "--timeout 10");
  ASSERT_FALSE(token.empty());
  const std::string host = "8080-quiet.sandbox.localhost";
  ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);
  // One keep-alive connection with a request every half second keeps the sandbox busy (never idle for the
  // node) while no new connection renews the route: it goes dormant at its cache_ms.
  const std::string pidfile = c.dir() + "/keepalive.pid";
  run("(curl -sS --cacert " + shell_quote(c.ca()) + " --resolve " + host + ":" + std::to_string(c.port()) +
      ":127.0.0.1 -H " + shell_quote("Authorization: Bearer " + token) + " --rate 2/s -o /dev/null " +
      shell_quote("https://" + host + ":" + std::to_string(c.port()) + "/?[1-120]") +
      " >/dev/null 2>&1 & echo $! > " + shell_quote(pidfile) + ")");
  const std::string metrics = "http://127.0.0.1:" + std::to_string(c.metrics_port()) + "/metrics";
  ASSERT_TRUE(eventually([&] {
    return run("curl -s " + shell_quote(metrics)).out.find("\nsandgate_proxy_route_cache_dormant_routes 1\n") !=
           std::string::npos;
  }, std::chrono::seconds(15)));
  c.stop_node(SIGKILL);
  ASSERT_TRUE(eventually([&] { return c.proxy().log().find("the node is down: routes cached") != std::string::npos; },
                         std::chrono::seconds(5)))
      << c.proxy().log();
  for (int i = 0; i < 20; ++i) {
    auto r = c.curl(host, "/", bearer(token));
    ASSERT_EQ(Cluster::http_code(r), 200) << "connection " << i << "\n" << r.out << c.proxy().log();
    ASSERT_EQ(Cluster::body(r), "hello from quiet");
  }
  auto wrong = c.curl(host, "/", "-i " + bearer("sgt_not-the-token"));
  EXPECT_EQ(Cluster::http_code(wrong), 503) << "a credential the route cannot verify: the node's to answer";
  run("kill " + read_file(pidfile));
  c.start_node();
  EXPECT_TRUE(eventually([&] { return c.proxy().log().find("route events from sandgate-node again") != std::string::npos; },
                         std::chrono::seconds(10)))
      << c.proxy().log();
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token), 20)), 200);
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// Route caches are per worker, and a new connection lands on either of the two (one SO_REUSEPORT listener
// each, as in production): a sandbox one connection reached before the node went down has its route on one
// worker only. In the outage the other serves it from that route (proxy/outage_routes.h).
TEST(RouteCache, WhileTheNodeIsDownEitherWorkerServesASandboxOnlyOneOfThemRouted) {
  Cluster c;  // two workers
  const std::string token = c.create_private_serving("once");
  ASSERT_FALSE(token.empty());
  const std::string host = "8080-once.sandbox.localhost";
  // A new proxy: its caches are empty (the serving check's connections reached both workers of the last one).
  c.stop_proxy();
  const size_t from = c.proxy().log().size();
  c.start_proxy();
  ASSERT_TRUE(eventually([&] { return count(c.proxy().log().substr(from), "following sandgate-node's route events") >= 2; },
                         std::chrono::seconds(10)))
      << c.proxy().log().substr(from);
  ASSERT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token))), 200);  // one worker's route now
  const size_t before_kill = c.proxy().log().size();
  c.stop_node(SIGKILL);
  ASSERT_TRUE(eventually([&] { return count(c.proxy().log().substr(before_kill), "the node is down: routes cached") >= 2; },
                         std::chrono::seconds(5)))
      << c.proxy().log().substr(before_kill);
  // 24 new connections: all on one worker has a chance of 2^-23.
  for (int i = 0; i < 24; ++i) {
    auto r = c.curl(host, "/", bearer(token));
    ASSERT_EQ(Cluster::http_code(r), 200) << "connection " << i << "\n" << r.out << c.proxy().log().substr(before_kill);
    ASSERT_EQ(Cluster::body(r), "hello from once");
  }
  auto wrong = c.curl(host, "/", "-i " + bearer("sgt_not-the-token"));
  EXPECT_EQ(Cluster::http_code(wrong), 503) << "a credential the route cannot verify: the node's to answer";
  c.start_node();
  EXPECT_TRUE(eventually([&] { return count(c.proxy().log().substr(before_kill), "route events from sandgate-node again") >= 2; },
                         std::chrono::seconds(10)))
      << c.proxy().log();
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(token), 20)), 200);
}

}  // namespace
}  // namespace sg::e2e
