// The cross-node hop (docs/fleet.md#cross-node-routing) with two node + proxy pairs on loopback, each with
// its own state dir and cgroup. The fleet's etcd view is stood in for by proxy.fleet_static_directory_file
// (tests only), rewritten and reloaded (SIGHUP) as the test goes. Clients are real: curl verifying the
// ingress certificate, openssl s_client against the fleet listener.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <set>
#include <sstream>
#include <thread>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

// The fleet CA and node certificates, made by deploy/gen-fleet-ca.sh in a temp dir of the test's own.
struct FleetCerts {
  std::string dir;
  FleetCerts() {
    char tmpl[] = "/tmp/sg-e2e-fleet-XXXXXX";
    dir = ::mkdtemp(tmpl);
    auto gen = run("bash " + source("deploy/gen-fleet-ca.sh") + " " + dir + " a b");
    EXPECT_EQ(gen.exit_code, 0) << gen.err;
  }
  ~FleetCerts() {
    if (!::testing::Test::HasFailure()) run("rm -rf " + shell_quote(dir));
  }
  std::string proxy_keys(const std::string& node) const {
    write_file(directory(node), "{}");
    return "activity_report_interval_ms = 200\nfleet_listen = \"127.0.0.1:0\"\nfleet_cert = \"" + dir + "/" + node +
           ".pem\"\nfleet_key = \"" + dir + "/" + node + ".key\"\nfleet_ca = \"" + dir +
           "/fleet-ca.pem\"\nfleet_static_directory_file = \"" + directory(node) + "\"\n";
  }
  std::string directory(const std::string& node) const { return dir + "/directory-" + node + ".json"; }
};

uint16_t fleet_port(Cluster& c) {
  std::string line = c.proxy().wait_for("fleet ingress on 127.0.0.1:", 5000);
  auto at = line.find("fleet ingress on 127.0.0.1:");
  return at == std::string::npos ? 0 : static_cast<uint16_t>(std::atoi(line.c_str() + at + 27));
}

// Writes a proxy's directory view and waits until the proxy has reloaded it.
void set_directory(Cluster& c, const std::string& path, const nlohmann::json& view) {
  size_t from = c.proxy().log().size();
  write_file(path, view.dump());
  ::kill(c.proxy().pid(), SIGHUP);
  ASSERT_FALSE(c.proxy().wait_for("config reloaded", 5000, from).empty()) << c.proxy().log();
}

std::string header(const CommandResult& r, const std::string& name) {
  std::string lower_out = r.out;
  for (char& ch : lower_out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  auto at = lower_out.find("\n" + name + ":");
  if (at == std::string::npos) return {};
  auto end = r.out.find('\r', at);
  std::string v = r.out.substr(at + name.size() + 2, end - at - name.size() - 2);
  return v.substr(v.find_first_not_of(' '));
}

// The fleet listener with openssl as the peer: what B's access log said about it.
nlohmann::json raw_hop(Cluster& b, const FleetCerts& certs, uint16_t port, const std::string& client_cert,
                       const std::string& bytes, const std::function<bool(const nlohmann::json&)>& which) {
  const std::string cert = client_cert.empty() ? std::string()
                                               : " -cert " + certs.dir + "/" + client_cert + ".pem -key " + certs.dir +
                                                     "/" + client_cert + ".key";
  run("printf %s " + shell_quote(bytes) + " | timeout 10 openssl s_client -quiet -connect 127.0.0.1:" +
      std::to_string(port) + " -CAfile " + certs.dir + "/fleet-ca.pem -verify_hostname b" + cert + " 2>&1");
  return b.wait_access_entry(which, 10000);
}

TEST(FleetHop, AnotherNodesSandboxThroughThisProxy) {
  FleetCerts certs;
  Cluster a(ClusterOptions::proxy(certs.proxy_keys("a")));
  Cluster b(ClusterOptions::proxy(certs.proxy_keys("b")));
  const uint16_t a_port = fleet_port(a), b_port = fleet_port(b);
  ASSERT_NE(a_port, 0) << a.proxy().log();
  ASSERT_NE(b_port, 0) << b.proxy().log();

  // web and priv live on b; stale lives on a, but a's view says b (b's view knows better).
  const std::string web_id = b.create_http_sandbox("web", 8080, "--timeout 2").value("id", "");
  ASSERT_FALSE(web_id.empty());
  b.wait_until_serving("web", 8080);
  const std::string token = b.create_private_serving("priv");
  ASSERT_FALSE(token.empty());
  auto tun = nlohmann::json::parse(b.cli("create --json --name tun --expose 7000/tcp -- /usr/bin/python3 " +
                                         tool("testserver.py") + " tcp 7000").out, nullptr, false);
  ASSERT_TRUE(tun.is_object() && tun.contains("token")) << tun.dump();
  a.create_http_sandbox("stale", 8080, "--timeout 600");
  a.wait_until_serving("stale", 8080);
  const nlohmann::json nodes = nlohmann::json::array(
      {{{"name", "a"}, {"ingress", "127.0.0.1:" + std::to_string(a_port)}},
       {{"name", "b"}, {"ingress", "127.0.0.1:" + std::to_string(b_port)}}});
  set_directory(a, certs.directory("a"),
                {{"nodes", nodes}, {"sandboxes", {{"web", "b"}, {"priv", "b"}, {"tun", "b"}, {"stale", "b"}, {"ghost", "c"}}}});
  set_directory(b, certs.directory("b"), {{"nodes", nodes}, {"sandboxes", {{"web", "b"}, {"priv", "b"}, {"stale", "a"}}}});

  // b's sandbox answers through a's ingress (curl verifies a's certificate), and each proxy logs its end.
  auto r = a.curl("8080-web.sandbox.localhost");
  ASSERT_EQ(Cluster::http_code(r), 200) << r.err << a.proxy().log();
  EXPECT_EQ(Cluster::body(r), "hello from web");
  auto at_a = a.wait_access_entry([](const nlohmann::json& e) { return e.value("hop_to", "") == "b"; });
  EXPECT_EQ(at_a.value("phase", ""), "forward") << at_a.dump();
  EXPECT_GT(at_a.value("bytes_out", 0), 0) << at_a.dump();
  auto at_b = b.wait_access_entry([](const nlohmann::json& e) { return e.value("hop_from", "") == "a"; });
  EXPECT_EQ(at_b.value("sandbox", ""), web_id) << at_b.dump();
  EXPECT_EQ(at_b.value("client", "").rfind("127.0.0.1:", 0), 0u) << at_b.dump();
  EXPECT_GT(at_b.value("bytes_out", 0), 0) << at_b.dump();

  // Edge authentication is the owning proxy's, on the credentials as the client sent them.
  EXPECT_EQ(Cluster::http_code(a.curl("8080-priv.sandbox.localhost")), 401);
  auto p = a.curl("8080-priv.sandbox.localhost", "/", bearer(token));
  EXPECT_EQ(Cluster::http_code(p), 200) << p.out;
  EXPECT_EQ(Cluster::body(p), "hello from priv");

  // sandgate ssh-proxy's CONNECT through a: b answers it and the tunnel carries bytes both ways, with the
  // client's half-close (the server answers after EOF: the sha256 of "hello" and its length).
  const std::string tunnel = "printf hello | " + a.sandgate() + " ssh-proxy --ingress 127.0.0.1:" +
                             std::to_string(a.port()) + " --cacert " + a.ca() + " --domain sandbox.localhost --token " +
                             tun["token"].get<std::string>() + " --port 7000 tun";
  CommandResult tunneled;
  EXPECT_TRUE(eventually(
      [&] {
        tunneled = run(tunnel, 20);
        return tunneled.out == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824 5\n";
      },
      std::chrono::seconds(20)))
      << tunneled.out << tunneled.err;

  // A stale view: b redirects to a, which is this node, so a's own node serves it; b logs the redirect.
  auto s = a.curl("8080-stale.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(s), 200) << s.out << a.proxy().log();
  EXPECT_EQ(Cluster::body(s), "hello from stale");
  auto redirect = b.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "fleet_redirect"; });
  EXPECT_EQ(redirect.value("sandbox_ref", ""), "stale") << redirect.dump();

  // Unknown everywhere: 404 as without a fleet. Owned by a node that is gone: 503 + Retry-After.
  EXPECT_EQ(Cluster::http_code(a.curl("8080-nobody.sandbox.localhost")), 404);
  auto g = a.curl("8080-ghost.sandbox.localhost", "/", "-i");
  EXPECT_EQ(Cluster::http_code(g), 503) << g.out;
  EXPECT_EQ(header(g, "retry-after"), "5") << g.out;

  // Traffic through a keeps web (timeout 2 s) awake on b: a 4 s download through a, watched from b.
  ASSERT_EQ(Cluster::http_code(a.curl("8080-web.sandbox.localhost")), 200);
  ASSERT_TRUE(eventually([&] { return b.get("web").value("state", "") == "running"; }, std::chrono::seconds(5)));
  CommandResult slow;
  std::thread client([&] { slow = a.curl("8080-web.sandbox.localhost", "/slow?secs=4&steps=40", "", 30); });
  bool stayed_running = true;
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(3500);
  while (std::chrono::steady_clock::now() < until && stayed_running) {
    stayed_running = b.get("web").value("state", "") == "running";
    ::usleep(100'000);
  }
  client.join();
  EXPECT_TRUE(stayed_running) << b.get("web").dump();
  EXPECT_EQ(Cluster::http_code(slow), 200) << slow.err;

  // Then idle: it suspends on b, and a request through a wakes it there.
  ASSERT_TRUE(eventually([&] { return b.get("web").value("state", "") == "suspended"; }, std::chrono::seconds(15)))
      << b.get("web").dump();
  auto woken_via_a = [&] {
    size_t n = 0;
    for (const auto& e : b.access_log()) n += e.value("woke", false) && e.value("hop_from", "") == "a" ? 1 : 0;
    return n;
  };
  const size_t woken_before = woken_via_a();
  auto w = a.curl("8080-web.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(w), 200) << w.out;
  EXPECT_EQ(Cluster::body(w), "hello from web");
  EXPECT_TRUE(eventually([&] { return woken_via_a() == woken_before + 1; }, std::chrono::seconds(5)))
      << "b's access log shows no wake for the request through a";

  // The fleet listener takes only fleet members, and bounds what they send before the client's bytes.
  auto no_cert = raw_hop(b, certs, b_port, "", "SANDGATE-HOP/1 8080-web.sandbox.localhost h1 1.2.3.4:5\r\n",
                         [](const nlohmann::json& e) { return e.value("cause", "") == "handshake_failed"; });
  EXPECT_TRUE(no_cert.is_object()) << "a peer without a fleet certificate was not refused";
  auto junk = raw_hop(b, certs, b_port, "a", "GET / HTTP/1.1\r\nHost: 8080-web.sandbox.localhost\r\n\r\n",
                      [](const nlohmann::json& e) { return e.value("cause", "") == "bad_request" && e.value("phase", "") == "preamble"; });
  EXPECT_TRUE(junk.is_object()) << b.proxy().log();
  auto huge = raw_hop(b, certs, b_port, "a", "SANDGATE-HOP/1 " + std::string(600, 'a'),
                      [](const nlohmann::json& e) { return e.value("cause", "") == "head_too_large"; });
  EXPECT_TRUE(huge.is_object()) << b.proxy().log();

  // b's proxy goes away: its sandboxes answer 503 + Retry-After through a, promptly, not a hang or 404.
  b.stop_proxy();
  auto start = std::chrono::steady_clock::now();
  auto gone = a.curl("8080-web.sandbox.localhost", "/", "-i", 20);
  EXPECT_EQ(Cluster::http_code(gone), 503) << gone.out;
  EXPECT_EQ(header(gone, "retry-after"), "5") << gone.out;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  // And once the directory drops b (its lease expired), the same answer comes without trying it.
  set_directory(a, certs.directory("a"),
                {{"nodes", {{{"name", "a"}, {"ingress", "127.0.0.1:" + std::to_string(a_port)}}}},
                 {"sandboxes", {{"web", "b"}}}});
  auto expired = a.curl("8080-web.sandbox.localhost", "/", "-i");
  EXPECT_EQ(Cluster::http_code(expired), 503) << expired.out;
  EXPECT_EQ(header(expired, "retry-after"), "5") << expired.out;
  auto owner_gone = a.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "fleet_owner_gone" && e.value("sandbox_ref", "") == "web"; });
  EXPECT_TRUE(owner_gone.is_object());
}

// The inodes of the sockets listening on 127.0.0.1:`port` (/proc/net/tcp): the same set before and after a
// takeover means the sockets were handed over, not bound anew.
std::set<std::string> listening_inodes(uint16_t port) {
  char local[32];
  std::snprintf(local, sizeof local, "0100007F:%04X", port);
  std::set<std::string> out;
  std::istringstream lines(read_file("/proc/net/tcp"));
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream f(line);
    std::string sl, addr, rem, st, queues, timer, retr, uid, timeout, inode;
    if (f >> sl >> addr >> rem >> st >> queues >> timer >> retr >> uid >> timeout >> inode && addr == local && st == "0A")
      out.insert(inode);
  }
  return out;
}

// `sandgate-proxy --takeover` takes the fleet listener too, as it takes the client listeners: the same
// sockets (nothing waiting in their queues is lost, and the old process never accepts beside the new one),
// and the new process serves hops on them once the old one has drained and exited.
TEST(FleetHop, ATakeoverHandsTheFleetListenerOverWithTheOthers) {
  FleetCerts certs;
  Cluster b(ClusterOptions::proxy(certs.proxy_keys("b") + "handover_socket = \"handover.sock\"\ndrain_timeout_secs = 5\n"));
  const uint16_t port = fleet_port(b);
  ASSERT_NE(port, 0) << b.proxy().log();
  const std::set<std::string> before = listening_inodes(port);
  ASSERT_EQ(before.size(), 2u) << "one socket per worker";

  Daemon next;
  ASSERT_TRUE(next.start({bin("proxy/sandgate-proxy"), "--config", b.config_path(), "--takeover"},
                         b.dir() + "/proxy-next.log"));
  EXPECT_NE(next.wait_for("the previous process stopped accepting", 15000), "") << next.log();
  EXPECT_NE(next.log().find("received 4 listening sockets"), std::string::npos) << next.log();
  const int status = b.proxy().wait_exit(30'000);
  ASSERT_NE(status, -1) << "the old proxy did not exit after draining:\n" << b.proxy().log();
  EXPECT_EQ(listening_inodes(port), before) << "the fleet listener was bound anew instead of handed over";

  auto served = raw_hop(b, certs, port, "a", "GET / HTTP/1.1\r\nHost: 8080-web.sandbox.localhost\r\n\r\n",
                        [](const nlohmann::json& e) { return e.value("cause", "") == "bad_request" && e.value("phase", "") == "preamble"; });
  EXPECT_TRUE(served.is_object()) << next.log();
  next.stop();
}

}  // namespace
}  // namespace sg::e2e
