// Waking at the ClientHello (issue 12; proxy.wake_at_client_hello, off by default, node.prewake_window_secs): the SNI names a
// suspended sandbox, and the node starts resuming it while the TLS handshake and the request head are still
// on their way. A ClientHello has no credential, so that happens only for an address that opened the sandbox
// with its token before (or for a public port); anyone else's connection wakes it once its token verified.
#include <gtest/gtest.h>

#include <regex>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

// One sample of the node's /metrics (-1 when absent).
long node_sample(Cluster& c, const std::string& name) {
  const std::string socket = c.api().substr(std::string("unix:").size());
  auto r = run("curl -sS --max-time 10 --unix-socket " + shell_quote(socket) + " http://node/metrics");
  std::smatch m;
  const std::regex re("(^|\n)" + std::regex_replace(name, std::regex(R"([{}"])"), R"(\$&)") + R"( (\d+))");
  return std::regex_search(r.out, m, re) ? std::stol(m[2].str()) : -1;
}

// openssl s_client from `source` that completes the handshake for `host` and then holds the connection
// without sending a byte of HTTP (-ign_eof: its empty stdin does not end it), until stopped.
void hold_handshake(Daemon& d, Cluster& c, const std::string& host, const std::string& source, const std::string& log) {
  ASSERT_TRUE(d.start({"/usr/bin/openssl", "s_client", "-quiet", "-ign_eof", "-connect", "127.0.0.1:" + std::to_string(c.port()),
                       "-bind", source + ":0", "-servername", host, "-CAfile", c.ca(), "-verify_return_error"},
                      log));
}

TEST(Prewake, AClientHelloWakesASuspendedSandboxOnlyForAnAddressThatOpenedItWithItsToken) {
  Cluster c(ClusterOptions::proxy("wake_at_client_hello = true\n"));
  const std::string token = c.create_private_serving("early");  // its token verified from 127.0.0.1
  ASSERT_FALSE(token.empty());
  const std::string id = c.get("early").value("id", "");
  const std::string host = "8080-early.sandbox.localhost";
  ASSERT_EQ(c.cli("suspend early").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("early")["state"] == "suspended"; }, std::chrono::seconds(10)));

  // Another address: its handshake reaches the node (refused there) and the sandbox sleeps on.
  {
    Daemon stranger;
    hold_handshake(stranger, c, host, "127.0.0.2", c.dir() + "/s_client-stranger.log");
    EXPECT_TRUE(eventually([&] { return node_sample(c, R"(sandgate_node_prewakes_total{result="refused"})") == 1; },
                           std::chrono::seconds(10)))
        << c.node().log();
    EXPECT_EQ(c.get("early")["state"], "suspended");
    EXPECT_TRUE(c.cgroup_frozen(id));
    stranger.stop();
  }

  // The address that used the token: the handshake alone wakes it, no request and no token sent.
  Daemon known;
  hold_handshake(known, c, host, "127.0.0.1", c.dir() + "/s_client-known.log");
  EXPECT_TRUE(eventually([&] { return c.get("early")["state"] == "running"; }, std::chrono::seconds(10)))
      << c.get("early").dump() << read_file(c.dir() + "/s_client-known.log");
  EXPECT_EQ(node_sample(c, R"(sandgate_node_prewakes_total{result="woke"})"), 1);
  EXPECT_EQ(c.get("early").value("state_reason", ""), "woken at a ClientHello for port 8080");
  known.stop();
  // Its access log entry: no request (no host), the early wake asked for.
  auto held = c.wait_access_entry([](const nlohmann::json& e) {
    return e["host"].is_null() && e.value("client", "").starts_with("127.0.0.1:");
  });
  ASSERT_TRUE(held.is_object()) << "no entry for the held connection";
  EXPECT_TRUE(held.value("prewake", false)) << held.dump();

  // Asleep again: the request whose ClientHello woke it is answered and logged as the one that woke it.
  ASSERT_EQ(c.cli("suspend early").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("early")["state"] == "suspended"; }, std::chrono::seconds(10)));
  auto r = c.curl(host, "/", bearer(token));
  EXPECT_EQ(Cluster::http_code(r), 200) << r.out << r.err;
  EXPECT_EQ(Cluster::body(r), "hello from early");
  auto served = c.wait_access_entry([](const nlohmann::json& e) { return e.value("woke", false); });
  ASSERT_TRUE(served.is_object()) << "no connection says it woke the sandbox";
  EXPECT_EQ(served.value("cause", ""), "client_closed") << served.dump();  // forwarded, not refused
  EXPECT_TRUE(served.value("prewake", false)) << served.dump();
  EXPECT_EQ(node_sample(c, R"(sandgate_node_prewakes_total{result="woke"})"), 2);
  EXPECT_EQ(node_sample(c, R"(sandgate_node_wakes_total{tier="memory"})"), 2) << "one wake each time, shared with the open";
}

}  // namespace
}  // namespace sg::e2e
