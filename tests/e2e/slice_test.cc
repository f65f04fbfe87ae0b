// The vertical slice, as a user sees it: TLS to an exposed port, idle suspend (checked in the kernel's
// cgroup files), wake on request with no client-visible error, single-flight wake, ephemeral expiry,
// node restart.
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

TEST(Slice, RequestThroughTlsReachesTheSandboxPort) {
  Cluster c;
  auto sb = c.create_http_sandbox("web", 8080);
  ASSERT_EQ(sb["state"], "running");
  c.wait_until_serving("web", 8080);
  auto r = c.curl("8080-web.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 200) << r.err;
  EXPECT_EQ(Cluster::body(r), "hello from web");
  // Reaching it by id works too.
  auto by_id = c.curl("8080-" + sb["id"].get<std::string>() + ".sandbox.localhost");
  EXPECT_EQ(Cluster::body(by_id), "hello from web");

  auto entry = c.wait_access_entry([](const nlohmann::json& e) { return e["cause"] == "upstream_closed" || e["cause"] == "client_closed"; });
  ASSERT_TRUE(entry.is_object());
  EXPECT_EQ(entry["sandbox"], sb["id"]);
  EXPECT_EQ(entry["port"], 8080);
  EXPECT_EQ(entry["sni"], "8080-web.sandbox.localhost");
  EXPECT_GT(entry["bytes_in"].get<int>(), 0);
  EXPECT_GT(entry["bytes_out"].get<int>(), 0);
  // This host has no kTLS, and a connection that carried one request never left OpenSSL for the proxy's own
  // record layer (that switch waits for a second request or a quiet second: TlsRecords.* covers it).
  EXPECT_EQ(entry["path"], "userspace");
  EXPECT_TRUE(entry["tls"].is_string());
}

TEST(Slice, TwoSandboxesBothListenOnTheSamePort) {
  Cluster c;
  c.create_http_sandbox("one", 8080);
  c.create_http_sandbox("two", 8080);
  c.wait_until_serving("one", 8080);
  c.wait_until_serving("two", 8080);
  EXPECT_EQ(Cluster::body(c.curl("8080-one.sandbox.localhost")), "hello from one");
  EXPECT_EQ(Cluster::body(c.curl("8080-two.sandbox.localhost")), "hello from two");
}

TEST(Slice, IdleSandboxIsFrozenAndWakesOnRequest) {
  Cluster c;
  auto sb = c.create_http_sandbox("sleepy", 8080, "--timeout 2");
  std::string id = sb["id"];
  c.wait_until_serving("sleepy", 8080);
  ASSERT_FALSE(c.cgroup_frozen(id));
  // No traffic for timeout_secs: the node freezes the cgroup.
  ASSERT_TRUE(eventually([&] { return c.get("sleepy")["state"] == "suspended"; }, std::chrono::seconds(10)));
  EXPECT_TRUE(c.cgroup_frozen(id)) << "API says suspended but the kernel does not have the cgroup frozen";

  // One plain request, no retry: held while the sandbox resumes, then answered.
  auto r = c.curl("8080-sleepy.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 200) << r.err;
  EXPECT_EQ(Cluster::body(r), "hello from sleepy");
  EXPECT_EQ(r.err, "");
  EXPECT_FALSE(c.cgroup_frozen(id));
  EXPECT_EQ(c.get("sleepy")["state"], "running");
  auto woke = c.wait_access_entry([](const nlohmann::json& e) { return e["woke"] == true; });
  ASSERT_TRUE(woke.is_object()) << "no access log entry with woke=true";
  EXPECT_TRUE(woke["wake_ms"].is_number());
}

TEST(Slice, TrafficKeepsASandboxAwake) {
  Cluster c;
  c.create_http_sandbox("busy", 8080, "--timeout 2");
  c.wait_until_serving("busy", 8080);
  // A download that trickles for 5 s keeps bytes moving past the 2 s idle threshold.
  auto r = c.curl("8080-busy.sandbox.localhost", "/slow?secs=5");
  EXPECT_EQ(Cluster::http_code(r), 200);
  EXPECT_NE(c.node().log().find("sandgate-node ready"), std::string::npos);
  auto log = c.access_log();
  for (auto& e : log) EXPECT_NE(e["woke"], true) << e.dump();  // never suspended under traffic
}

TEST(Slice, FiftyConcurrentRequestsCauseOneResume) {
  Cluster c;
  auto sb = c.create_http_sandbox("crowd", 8080);
  std::string id = sb["id"];
  c.wait_until_serving("crowd", 8080);
  auto s = c.cli("suspend crowd");
  ASSERT_EQ(s.exit_code, 0) << s.err;
  ASSERT_TRUE(eventually([&] { return c.cgroup_frozen(id); }, std::chrono::seconds(5)));
  int resumes_before = c.get("crowd")["resumes"].get<int>();

  std::vector<std::future<CommandResult>> results;
  for (int i = 0; i < 50; ++i)
    results.push_back(std::async(std::launch::async, [&] { return c.curl("8080-crowd.sandbox.localhost"); }));
  int ok = 0;
  for (auto& f : results) {
    auto r = f.get();
    if (Cluster::http_code(r) == 200 && Cluster::body(r) == "hello from crowd") ++ok;
    else ADD_FAILURE() << r.out << r.err;
  }
  EXPECT_EQ(ok, 50);
  EXPECT_EQ(c.get("crowd")["resumes"].get<int>(), resumes_before + 1);
}

TEST(Slice, EphemeralSandboxIsGoneAfterItsTimeout) {
  Cluster c;
  auto sb = c.create_http_sandbox("temp", 8080, "--ephemeral --timeout 1");
  std::string id = sb["id"];
  ASSERT_TRUE(c.cgroup_exists(id));
  ASSERT_TRUE(eventually([&] { return c.cli("get temp").exit_code == 1; }, std::chrono::seconds(10)));
  EXPECT_FALSE(c.cgroup_exists(id));
  auto r = c.curl("8080-temp.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 404);
  // An ephemeral sandbox cannot be suspended.
  auto eph = c.create_http_sandbox("temp2", 8080, "--ephemeral");
  auto s = c.cli("suspend temp2");
  EXPECT_EQ(s.exit_code, 1);
}

TEST(Slice, NodeRestartFindsItsSandboxes) {
  Cluster c;
  auto a = c.create_http_sandbox("keep-a", 8080);
  auto b = c.create_http_sandbox("keep-b", 8080);
  c.wait_until_serving("keep-a", 8080);
  c.wait_until_serving("keep-b", 8080);  // frozen before it listens, it could not answer once woken
  ASSERT_EQ(c.cli("suspend keep-b").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("keep-b")["state"] == "suspended"; }, std::chrono::seconds(5)));
  // A crash (SIGKILL) must not lose the sandboxes: they keep running and the new node adopts them.
  c.stop_node(SIGKILL);
  c.start_node();
  EXPECT_EQ(c.get("keep-a")["state"], "running");
  EXPECT_EQ(c.get("keep-a")["id"], a["id"]);
  EXPECT_EQ(c.get("keep-b")["state"], "suspended");
  EXPECT_TRUE(c.cgroup_frozen(b["id"]));
  EXPECT_EQ(Cluster::body(c.curl("8080-keep-a.sandbox.localhost")), "hello from keep-a");
  EXPECT_EQ(Cluster::body(c.curl("8080-keep-b.sandbox.localhost")), "hello from keep-b");
  auto ls = c.cli("ls");
  EXPECT_NE(ls.out.find("keep-a"), std::string::npos);
  EXPECT_NE(ls.out.find("keep-b"), std::string::npos);
}

TEST(Slice, DeleteKillsTheWholeSandbox) {
  Cluster c;
  auto sb = c.create_http_sandbox("doomed", 8080);
  std::string id = sb["id"];
  int pid = sb["pid"];
  c.wait_until_serving("doomed", 8080);
  auto r = c.cli("rm doomed");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(c.cgroup_exists(id));
  EXPECT_NE(::kill(pid, 0), 0) << "sandbox init still alive";
  EXPECT_EQ(Cluster::http_code(c.curl("8080-doomed.sandbox.localhost")), 404);
}

}  // namespace
}  // namespace sg::e2e
