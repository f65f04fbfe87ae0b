// Slowloris (issue 12): connections that trickle a ClientHello or a request head one byte at a time, from
// several client addresses, are closed at their phase's deadline, however often they send, while ordinary
// requests alongside all succeed. tests/e2e/tools/slowloris.py does the talking; bench/RESULTS.md has the
// 1,000-connection run.
#include <gtest/gtest.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

TEST(Slowloris, SlowHandshakesAndHeadsCloseAtTheirDeadlinesWhileLegitimateRequestsSucceed) {
  Cluster c(ClusterOptions::proxy("handshake_timeout_ms = 3000\nrequest_head_timeout_ms = 3000\n"));
  c.create_http_sandbox("web", 8080);
  c.wait_until_serving("web", 8080);
  constexpr int kSlow = 400, kLegit = 100;
  auto r = run("python3 " + shell_quote(source("tests/e2e/tools/slowloris.py")) + " " + std::to_string(c.port()) +
                   " " + shell_quote(c.ca()) + " 8080-web.sandbox.localhost " + std::to_string(kSlow) + " " +
                   std::to_string(kLegit),
               180);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["legit_ok"], kLegit) << r.out;
  EXPECT_EQ(j["legit_failed"], 0) << r.out;
  EXPECT_EQ(j["slow_opened"], kSlow) << r.out;
  EXPECT_EQ(j["slow_still_open"], 0) << "the proxy left slow connections open: " << r.out;
  // The deadline is per phase, not reset by each byte: 3 s, plus the client's 0.5 s trickle and scheduling.
  EXPECT_LE(j["slow_closed_after_max_s"].get<double>(), 5.0) << r.out;
  size_t handshake_timeouts = 0, head_timeouts = 0;
  ASSERT_TRUE(eventually([&] {
    handshake_timeouts = head_timeouts = 0;
    for (const auto& e : c.access_log()) {
      handshake_timeouts += e["cause"] == "handshake_timeout";
      head_timeouts += e["cause"] == "head_timeout";
    }
    return handshake_timeouts >= kSlow / 2 && head_timeouts >= kSlow / 2;
  }, std::chrono::seconds(10))) << handshake_timeouts << " handshake_timeout, " << head_timeouts << " head_timeout";
}

}  // namespace
}  // namespace sg::e2e
