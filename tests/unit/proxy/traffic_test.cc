#include "proxy/traffic.h"

#include "noderuntime/api_request.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace sg {
namespace {

TEST(WorkerTraffic, ReportsDeltasAndDropsClosedSandboxes) {
  WorkerTraffic t;
  SandboxTraffic* a = t.open_connection("sb-a");
  a->bytes_in += 10;
  a->bytes_out += 20;
  auto j = nlohmann::json::parse(t.take_report("w0"));
  ASSERT_EQ(j["sandboxes"].size(), 1u);
  EXPECT_EQ(j["sandboxes"][0]["id"], "sb-a");
  EXPECT_EQ(j["sandboxes"][0]["bytes_in"], 10);
  EXPECT_EQ(j["sandboxes"][0]["bytes_out"], 20);
  EXPECT_EQ(j["sandboxes"][0]["connections"], 1);
  EXPECT_EQ(j["reporter"], "w0") << "named once for every entry";
  // Nothing moved, but the connection is still open: it is re-asserted (the node expires silent reporters).
  j = nlohmann::json::parse(t.take_report("w0"));
  EXPECT_EQ(j["sandboxes"][0]["bytes_in"], 0);
  EXPECT_EQ(j["sandboxes"][0]["connections"], 1);
  a->bytes_out += 5;
  j = nlohmann::json::parse(t.take_report("w0"));
  EXPECT_EQ(j["sandboxes"][0]["bytes_in"], 0);
  EXPECT_EQ(j["sandboxes"][0]["bytes_out"], 5);
  t.close_connection("sb-a");
  j = nlohmann::json::parse(t.take_report("w0"));
  EXPECT_EQ(j["sandboxes"][0]["connections"], 0);
  // Closed and reported once: nothing more to say.
  EXPECT_EQ(t.take_report("w0"), "");
}

// The report is written by hand (no JSON tree); the node's reader must get back exactly what was counted,
// whatever bytes an id holds.
TEST(WorkerTraffic, TheNodeReadsTheReportAsWritten) {
  WorkerTraffic t;
  const std::string odd = std::string("sb-\"q\\\x01\x1f\xc3\xa9", 10);
  SandboxTraffic* a = t.open_connection("sb-a");
  SandboxTraffic* b = t.open_connection(odd);
  a->bytes_in += 18446744073709551615ull;
  b->bytes_out += 7;
  t.open_connection(odd);
  auto reports = parse_activity(t.take_report("worker \"1\""));
  ASSERT_TRUE(reports) << reports.message();
  ASSERT_EQ(reports->size(), 2u);
  for (const ActivityReport& r : *reports) {
    EXPECT_EQ(r.reporter, "worker \"1\"");
    if (r.id == "sb-a") {
      EXPECT_EQ(r.bytes_in, 18446744073709551615ull);
      EXPECT_EQ(r.bytes_out, 0u);
      EXPECT_EQ(r.connections, 1u);
    } else {
      EXPECT_EQ(r.id, odd);
      EXPECT_EQ(r.bytes_in, 0u);
      EXPECT_EQ(r.bytes_out, 7u);
      EXPECT_EQ(r.connections, 2u);
    }
  }
}

TEST(WorkerTraffic, PointerStaysValidWhileConnectionsOpen) {
  WorkerTraffic t;
  SandboxTraffic* a = t.open_connection("sb-a");
  for (int i = 0; i < 1000; ++i) t.open_connection("sb-" + std::to_string(i));  // rehashes
  a->bytes_in += 1;
  (void)t.take_report("w");
  EXPECT_EQ(a->connections, 1u);
}

TEST(ConnectionLimits, EnforcedAcrossThreads) {
  ConnectionLimits limits;
  std::atomic<int> granted{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&] {
      for (int k = 0; k < 100; ++k)
        if (limits.try_acquire("sb-x", 50)) granted.fetch_add(1);
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(granted.load(), 50);
  EXPECT_EQ(limits.count("sb-x"), 50u);
  limits.release("sb-x");
  EXPECT_TRUE(limits.try_acquire("sb-x", 50));
  EXPECT_FALSE(limits.try_acquire("sb-x", 50));
  EXPECT_TRUE(limits.try_acquire("sb-y", 50));
}

TEST(ConnectionLimits, ReleaseForgetsEmptyKeysAndIgnoresUnknownOnes) {
  // The per-client instance sees one key per address that ever connected: a key must not outlive its
  // last connection, and a stray release must not underflow another key's count.
  ConnectionLimits limits;
  ASSERT_TRUE(limits.try_acquire("127.0.0.1", 1));
  EXPECT_FALSE(limits.try_acquire("127.0.0.1", 1));
  limits.release("10.0.0.1");
  EXPECT_EQ(limits.count("127.0.0.1"), 1u);
  limits.release("127.0.0.1");
  limits.release("127.0.0.1");
  EXPECT_EQ(limits.count("127.0.0.1"), 0u);
  EXPECT_TRUE(limits.try_acquire("127.0.0.1", 1));
}

}  // namespace
}  // namespace sg
