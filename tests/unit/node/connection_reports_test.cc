#include "noderuntime/connection_reports.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace sg {
namespace {

using Clock = ConnectionReports::Clock;
using namespace std::chrono_literals;

class ConnectionReportsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    reports_ = std::make_unique<ConnectionReports>(
        &loop_, [this] { return ttl_; },
        [this](const std::string& id, uint64_t before, uint64_t total) {
          changes_.push_back(id + ":" + std::to_string(before) + "->" + std::to_string(total));
        });
  }
  void TearDown() override {
    reports_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }

  uv_loop_t loop_{};
  Clock::duration ttl_ = std::chrono::duration_cast<Clock::duration>(60s);
  std::unique_ptr<ConnectionReports> reports_;
  std::vector<std::string> changes_;
};

TEST_F(ConnectionReportsTest, EachWorkersLatestCountReplacesItsLastAndTheTotalSumsThem) {
  const auto now = Clock::now();
  reports_->report("sb", "w1", 3, now);
  reports_->report("sb", "w2", 2, now);
  EXPECT_EQ(reports_->total("sb"), 5u);
  reports_->report("sb", "w1", 1, now);  // replaces w1's 3
  EXPECT_EQ(reports_->total("sb"), 3u);
  reports_->report("sb", "w2", 0, now);
  reports_->report("sb", "w1", 0, now);
  EXPECT_EQ(reports_->total("sb"), 0u);
  // Only the crossings of zero are news: the idle clock is held at the first and starts at the last.
  EXPECT_EQ(changes_, (std::vector<std::string>{"sb:0->3", "sb:1->0"}));
  reports_->report("sb", "w3", 0, now);  // a zero from a worker that never counted: nothing
  EXPECT_EQ(changes_.size(), 2u);
}

TEST_F(ConnectionReportsTest, ACountNotReportedAgainWithinTheTtlExpires) {
  ttl_ = std::chrono::duration_cast<Clock::duration>(20ms);
  reports_->report("dead-proxy", "w1", 4, Clock::now());
  ttl_ = std::chrono::duration_cast<Clock::duration>(60s);
  reports_->report("live", "w2", 1, Clock::now());
  // The expiry timer fires once the first count is 20 ms old; nothing else is due.
  while (reports_->total("dead-proxy") != 0) {
    const int active = uv_run(&loop_, UV_RUN_ONCE);
    ASSERT_TRUE(active != 0 || reports_->total("dead-proxy") == 0) << "no timer armed";
  }
  EXPECT_EQ(reports_->total("live"), 1u);
  EXPECT_EQ(changes_, (std::vector<std::string>{"dead-proxy:0->4", "live:0->1", "dead-proxy:4->0"}));
}

TEST_F(ConnectionReportsTest, AForgottenSandboxIsNeverReportedAsChanged) {
  ttl_ = std::chrono::duration_cast<Clock::duration>(10ms);
  reports_->report("gone", "w1", 2, Clock::now());
  reports_->forget("gone");
  EXPECT_EQ(reports_->total("gone"), 0u);
  uv_run(&loop_, UV_RUN_ONCE);  // the timer armed for its count fires on nothing
  EXPECT_EQ(changes_, (std::vector<std::string>{"gone:0->2"}));
}

}  // namespace
}  // namespace sg
