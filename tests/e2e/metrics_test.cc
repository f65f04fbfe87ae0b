// /metrics on both daemons (docs/observability.md), scraped with curl as Prometheus would and checked with
// promtool (Debian's prometheus package), after traffic that must move the counters.
#include <gtest/gtest.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

// The value of one sample line `series value`, -1 when the series is missing.
double sample(const std::string& text, const std::string& series) {
  size_t at = 0;
  while ((at = text.find(series + " ", at)) != std::string::npos) {
    if (at == 0 || text[at - 1] == '\n') return std::stod(text.substr(at + series.size() + 1));
    at += series.size();
  }
  return -1;
}

// `promtool check metrics` reads the exposition on stdin; it exits non-zero on a format error (and prints
// lint problems, which are errors too for us).
void expect_promtool_accepts(const std::string& text, const std::string& dir, const std::string& what) {
  write_file(dir + "/" + what + ".prom", text);
  auto checked = run("promtool check metrics < " + shell_quote(dir + "/" + what + ".prom") + " 2>&1");
  EXPECT_EQ(checked.exit_code, 0) << what << ": " << checked.out << checked.err;
  EXPECT_EQ(checked.out, "") << what << ": promtool lint: " << checked.out;
}

TEST(Metrics, BothDaemonsServeCountersThatMoveWithTraffic) {
  Cluster c(ClusterOptions::proxy("metrics_listen = [\"127.0.0.1:0\"]\n"));
  const uint16_t port = c.metrics_port();
  ASSERT_NE(port, 0);
  const std::string proxy_url = "http://127.0.0.1:" + std::to_string(port) + "/metrics";
  const std::string node_socket = c.api().substr(std::string("unix:").size());
  auto scrape_proxy = [&] { return run("curl -sS --max-time 10 " + shell_quote(proxy_url)); };
  auto scrape_node = [&] {
    return run("curl -sS --max-time 10 --unix-socket " + shell_quote(node_socket) + " http://node/metrics");
  };

  auto before = scrape_proxy();
  ASSERT_EQ(before.exit_code, 0) << before.err;
  EXPECT_EQ(sample(before.out, R"(sandgate_proxy_connections_total{cause="misdirected"})"), 0) << before.out;

  c.create_http_sandbox("web", 8080);
  c.wait_until_serving("web", 8080);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Cluster::http_code(c.curl("8080-web.sandbox.localhost", "/blob?size=100000")), 200);
  ASSERT_EQ(Cluster::http_code(c.curl("8080-nosuch.sandbox.localhost")), 404);
  ASSERT_EQ(c.cli("suspend web").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("web")["state"] == "suspended"; }, std::chrono::seconds(10)));
  EXPECT_EQ(Cluster::http_code(c.curl("8080-web.sandbox.localhost", "/blob?size=10")), 200);  // wakes it

  std::string proxy_text;
  // Bytes reach the counters with the workers' activity reports (about once a second).
  ASSERT_TRUE(eventually([&] {
    proxy_text = scrape_proxy().out;
    return sample(proxy_text, R"(sandgate_proxy_bytes_total{direction="sandbox_to_client"})") >= 300000;
  }, std::chrono::seconds(10))) << proxy_text;
  EXPECT_GE(sample(proxy_text, R"(sandgate_proxy_connections_total{cause="unknown_sandbox"})"), 1) << proxy_text;
  EXPECT_GE(sample(proxy_text, "sandgate_proxy_tls_handshake_duration_seconds_count"), 5) << proxy_text;
  EXPECT_EQ(sample(proxy_text, R"(sandgate_proxy_tls_handshakes_total{resumed="false"})") +
                sample(proxy_text, R"(sandgate_proxy_tls_handshakes_total{resumed="true"})"),
            sample(proxy_text, "sandgate_proxy_tls_handshake_duration_seconds_count"))
      << "every finished handshake is counted once, full or resumed:\n" << proxy_text;
  EXPECT_GE(sample(proxy_text, "sandgate_proxy_wakes_total"), 1) << proxy_text;
  EXPECT_GE(sample(proxy_text, "sandgate_proxy_wake_duration_seconds_count"), 1) << proxy_text;
  EXPECT_GE(sample(proxy_text, R"(sandgate_proxy_node_requests_total{call="open"})"), 1) << proxy_text;
  EXPECT_GE(sample(proxy_text, R"(sandgate_proxy_route_cache_total{result="hit"})"), 1)
      << "later requests to a running sandbox come from the route cache:\n" << proxy_text;
  EXPECT_GE(sample(proxy_text, R"(sandgate_proxy_bytes_total{direction="client_to_sandbox"})"), 100) << proxy_text;
  expect_promtool_accepts(proxy_text, c.dir(), "proxy");

  auto node = scrape_node();
  ASSERT_EQ(node.exit_code, 0) << node.err;
  EXPECT_EQ(sample(node.out, R"(sandgate_node_sandboxes{state="running"})"), 1) << node.out;
  EXPECT_EQ(sample(node.out, R"(sandgate_node_creates_total{result="ok"})"), 1) << node.out;
  EXPECT_EQ(sample(node.out, R"(sandgate_node_suspends_total{tier="memory"})"), 1) << node.out;
  EXPECT_EQ(sample(node.out, R"(sandgate_node_wakes_total{tier="memory"})"), 1) << node.out;
  EXPECT_EQ(sample(node.out, "sandgate_node_wake_duration_seconds_count"), 1) << node.out;
  expect_promtool_accepts(node.out, c.dir(), "node");

  // Only GET /metrics is served on the proxy's metrics listener.
  auto other = run("curl -s -o /dev/null -w '%{http_code}' " + shell_quote("http://127.0.0.1:" + std::to_string(port) + "/"));
  EXPECT_EQ(other.out, "404");
  auto post = run("curl -s -o /dev/null -w '%{http_code}' -X POST " + shell_quote(proxy_url));
  EXPECT_EQ(post.out, "405");
}

TEST(Metrics, AMetricsListenerBeyondLoopbackIsRefusedAtLoad) {
  Cluster c(ClusterOptions::node_only());
  write_file(c.dir() + "/remote.toml", "[proxy]\nmetrics_listen = [\"0.0.0.0:9464\"]\n");
  auto checked = run(shell_quote(bin("proxy/sandgate-proxy")) + " --config " + shell_quote(c.dir() + "/remote.toml") +
                     " --check 2>&1");
  EXPECT_NE(checked.exit_code, 0) << checked.out;
  EXPECT_NE(checked.out.find("proxy.metrics_listen"), std::string::npos) << checked.out;
  EXPECT_NE(checked.out.find("metrics_listen_allow_remote"), std::string::npos) << checked.out;
}

}  // namespace
}  // namespace sg::e2e
