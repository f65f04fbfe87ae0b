// A suspend sticks: the proxy's activity reports trail the traffic by up to an interval, so bytes they carry
// for a sandbox that is asleep never wake it; only a connection that asks for the sandbox after the suspend
// began does (the open/wake path). A connection still open when the sandbox is suspended is cut, with the
// cause `sandbox_suspended` in the access log.
#include <gtest/gtest.h>

#include <thread>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

// True when `id` stays suspended, with its cgroup frozen, for the whole window (polled every 20 ms).
::testing::AssertionResult stays_suspended(Cluster& c, const std::string& name, const std::string& id,
                                           std::chrono::milliseconds window) {
  auto end = std::chrono::steady_clock::now() + window;
  while (std::chrono::steady_clock::now() < end) {
    auto j = c.get(name);
    if (j["state"] != "suspended") return ::testing::AssertionFailure() << "woke up: " << j.dump();
    if (!c.cgroup_frozen(id)) return ::testing::AssertionFailure() << "suspended but its cgroup is not frozen";
    ::usleep(20'000);
  }
  return ::testing::AssertionSuccess();
}

constexpr int kReportIntervalMs = 200;

TEST(Suspend, RequestThenImmediateSuspendStaysSuspendedTwentyTimes) {
  Cluster c(ClusterOptions::proxy("activity_report_interval_ms = " + std::to_string(kReportIntervalMs) + "\n"));
  const std::string id = c.create_http_sandbox("r1", 8080, "--timeout 600").value("id", "");
  ASSERT_FALSE(id.empty());
  c.wait_until_serving("r1", 8080);
  for (int i = 0; i < 20; ++i) {
    SCOPED_TRACE("round " + std::to_string(i));
    auto r = c.curl("8080-r1.sandbox.localhost");
    ASSERT_EQ(Cluster::http_code(r), 200) << r.err;
    auto s = c.cli("suspend r1");
    ASSERT_EQ(s.exit_code, 0) << s.out << s.err;
    ASSERT_TRUE(eventually([&] { return c.get("r1")["state"] == "suspended"; }, std::chrono::seconds(10)));
    // Three report intervals and a margin: every report that carried the request's bytes has arrived.
    ASSERT_TRUE(stays_suspended(c, "r1", id, std::chrono::milliseconds(3 * kReportIntervalMs + 200)))
        << c.node().log();
  }
  EXPECT_EQ(c.node().log().find("raced"), std::string::npos);
  // A request after the suspend still wakes it.
  auto r = c.curl("8080-r1.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 200);
  EXPECT_EQ(Cluster::body(r), "hello from r1");
}

TEST(Suspend, IdleTimeoutAsShortAsTheReportIntervalSticks) {
  Cluster c(ClusterOptions::proxy("activity_report_interval_ms = 1000\n"));
  const std::string id = c.create_http_sandbox("idle", 8080, "--timeout 1").value("id", "");
  ASSERT_FALSE(id.empty());
  c.wait_until_serving("idle", 8080);
  ASSERT_EQ(Cluster::http_code(c.curl("8080-idle.sandbox.localhost")), 200);
  ASSERT_TRUE(eventually([&] { return c.get("idle")["state"] == "suspended"; }, std::chrono::seconds(10)))
      << c.get("idle").dump();
  EXPECT_TRUE(stays_suspended(c, "idle", id, std::chrono::milliseconds(3200))) << c.node().log();
  auto r = c.curl("8080-idle.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 200);
  auto woke = c.wait_access_entry([](const nlohmann::json& e) { return e.value("woke", false); });
  ASSERT_TRUE(woke.is_object()) << "the request did not wake it";
  EXPECT_EQ(woke.value("sandbox_ref", ""), "idle");
}

TEST(Suspend, AnOpenTransferIsCutWithARecordedCauseAndDoesNotUndoTheSuspend) {
  Cluster c(ClusterOptions::proxy("activity_report_interval_ms = " + std::to_string(kReportIntervalMs) + "\n"));
  const std::string id = c.create_http_sandbox("busy", 8080, "--timeout 600").value("id", "");
  ASSERT_FALSE(id.empty());
  c.wait_until_serving("busy", 8080);
  // A response that streams a piece every 100 ms for 20 s: bytes keep moving when the suspend comes.
  // curl writes the body to a file as it arrives, so the suspend comes only once the first piece got through
  // (a connection is reported as soon as it is open, before the sandbox has answered anything).
  const std::string received = c.dir() + "/transfer.out";
  CommandResult transfer;
  std::thread client([&] {
    transfer = c.curl("8080-busy.sandbox.localhost", "/slow?secs=20&steps=200", "-N -o " + received, 40);
  });
  auto body_so_far = [&] { return read_file(received); };
  bool streaming = eventually([&] { return body_so_far().find("tick 0") != std::string::npos; },
                              std::chrono::seconds(10)) &&
                   eventually([&] { return c.get("busy").value("connections", 0) >= 1; }, std::chrono::seconds(10));
  if (!streaming) {
    client.join();
    FAIL() << "the streaming response never started or its connection was never reported: " << transfer.err;
  }
  auto s = c.cli("suspend busy");
  EXPECT_EQ(s.exit_code, 0) << s.err;
  auto cut = c.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "sandbox_suspended"; },
                                 5000);
  client.join();
  ASSERT_TRUE(cut.is_object()) << "no access log line with cause sandbox_suspended\n" << c.proxy().log();
  EXPECT_EQ(cut.value("sandbox_ref", ""), "busy");
  EXPECT_GT(cut.value("bytes_out", 0), 0) << "it was moving bytes";
  EXPECT_EQ(body_so_far().find("tick 199"), std::string::npos) << "the transfer was not cut";
  EXPECT_TRUE(stays_suspended(c, "busy", id, std::chrono::milliseconds(3 * kReportIntervalMs + 200)));
  EXPECT_EQ(c.get("busy").value("connections", -1), 0);
  EXPECT_EQ(Cluster::http_code(c.curl("8080-busy.sandbox.localhost")), 200) << "a new request wakes it";
}

}  // namespace
}  // namespace sg::e2e
