#include "noderuntime/wake_waiters.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace sg {
namespace {

class WakeWaitersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    waiters_ = std::make_unique<WakeWaiters>(&loop_);
  }
  void TearDown() override {
    waiters_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);  // every timer closed and freed
  }
  // Records each answer as "ok" or the failure's message, in order.
  WakeWaiters::Done record(const std::string& who) {
    return [this, who](Status s) { answers_.push_back(who + ":" + (s ? std::string("ok") : s.message())); };
  }

  uv_loop_t loop_{};
  std::unique_ptr<WakeWaiters> waiters_;
  std::vector<std::string> answers_;
};

TEST_F(WakeWaitersTest, OneSettleAnswersEveryWaiterOfTheSandboxInOrder) {
  waiters_->add("sb-a", 60'000, record("1"));
  waiters_->add("sb-b", 60'000, record("other"));
  waiters_->add("sb-a", 60'000, record("2"));
  EXPECT_EQ(waiters_->count("sb-a"), 2u);
  waiters_->settle("sb-a", {});
  EXPECT_EQ(answers_, (std::vector<std::string>{"1:ok", "2:ok"}));
  EXPECT_FALSE(waiters_->any("sb-a"));
  EXPECT_TRUE(waiters_->any("sb-b"));
  waiters_->settle("sb-b", fail(Error::kUnavailable, "failed to wake"));
  EXPECT_EQ(answers_.back(), "other:failed to wake");
  waiters_->settle("sb-b", {});  // nobody left: nothing answered twice
  EXPECT_EQ(answers_.size(), 3u);
}

TEST_F(WakeWaitersTest, EachWaiterTimesOutAtItsOwnDeadlineAndTheOthersWaitOn) {
  waiters_->add("sb-a", 10, record("short"));
  waiters_->add("sb-a", 60'000, record("long"));
  uv_run(&loop_, UV_RUN_ONCE);  // blocks until the 10 ms timer fires
  ASSERT_EQ(answers_.size(), 1u);
  EXPECT_EQ(answers_[0], "short:sandbox sb-a did not wake within 10 ms");
  EXPECT_EQ(waiters_->count("sb-a"), 1u);
  waiters_->settle("sb-a", {});
  EXPECT_EQ(answers_.back(), "long:ok");
}

TEST_F(WakeWaitersTest, AWaiterAddedWhileSettlingWaitsForTheNextSettle) {
  waiters_->add("sb-a", 60'000, [this](Status) {
    answers_.push_back("first");
    waiters_->add("sb-a", 60'000, record("again"));
  });
  waiters_->settle("sb-a", {});
  EXPECT_EQ(answers_, (std::vector<std::string>{"first"}));
  EXPECT_EQ(waiters_->count("sb-a"), 1u);
  waiters_->settle_all(fail(Error::kUnavailable, "node is shutting down"));
  EXPECT_EQ(answers_.back(), "again:node is shutting down");
}

TEST_F(WakeWaitersTest, DestroyingItDropsTheWaitersWithoutAnsweringThem) {
  waiters_->add("sb-a", 60'000, record("dropped"));
  waiters_.reset();
  uv_run(&loop_, UV_RUN_DEFAULT);
  EXPECT_TRUE(answers_.empty());
}

}  // namespace
}  // namespace sg
