#include "noderuntime/idle_clocks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace sg {
namespace {

using namespace std::chrono_literals;

class IdleClocksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    clocks_ = std::make_unique<IdleClocks>(&loop_, [this](const std::string& id) { expired_.push_back(id); });
  }
  void TearDown() override {
    clocks_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }
  // Runs the loop until `id` expired; fails when the loop has nothing left to wait for.
  void run_until_expired(const std::string& id) {
    auto expired = [&] { return std::find(expired_.begin(), expired_.end(), id) != expired_.end(); };
    while (!expired()) {
      const int active = uv_run(&loop_, UV_RUN_ONCE);
      ASSERT_TRUE(active != 0 || expired()) << id << " never expired: no timer armed";
    }
  }

  uv_loop_t loop_{};
  std::unique_ptr<IdleClocks> clocks_;
  std::vector<std::string> expired_;
};

TEST_F(IdleClocksTest, TheEarliestClockFiresFirstAndTheLaterOneStillRuns) {
  clocks_->start("late", 60s);
  clocks_->start("soon", 20ms);
  run_until_expired("soon");
  EXPECT_EQ(expired_, (std::vector<std::string>{"soon"}));
  EXPECT_FALSE(clocks_->deadline("soon"));
  EXPECT_TRUE(clocks_->deadline("late"));
}

TEST_F(IdleClocksTest, AHeldClockDoesNotRunUntilReleased) {
  clocks_->start("held", 10ms, /*held=*/true);
  EXPECT_FALSE(clocks_->deadline("held"));
  clocks_->start("marker", 30ms);
  run_until_expired("marker");  // 30 ms later, and the held one is still there
  EXPECT_EQ(expired_, (std::vector<std::string>{"marker"}));
  const auto released = IdleClocks::Clock::now();
  clocks_->release("held");
  ASSERT_TRUE(clocks_->deadline("held"));
  EXPECT_GE(*clocks_->deadline("held"), released + 10ms);  // the clock starts at the release
  run_until_expired("held");
}

TEST_F(IdleClocksTest, AnExpiryMayStartItsClockAgain) {
  int rounds = 0;
  clocks_ = std::make_unique<IdleClocks>(&loop_, [&](const std::string& id) {
    if (++rounds < 3) clocks_->start(id, 5ms);  // a driver that cannot suspend: the sandbox keeps running
  });
  clocks_->start("sb", 5ms);
  while (rounds < 3) {
    const int active = uv_run(&loop_, UV_RUN_ONCE);
    ASSERT_TRUE(active != 0 || rounds == 3) << "stopped after " << rounds << " expiries";
  }
  EXPECT_FALSE(clocks_->deadline("sb"));
}

TEST_F(IdleClocksTest, StoppedClocksNeverFire) {
  clocks_->start("sb", 5ms);
  clocks_->stop();
  EXPECT_EQ(uv_run(&loop_, UV_RUN_NOWAIT), 0);  // no timer left on the loop
  EXPECT_TRUE(expired_.empty());
}

}  // namespace
}  // namespace sg
