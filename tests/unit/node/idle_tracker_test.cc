#include "noderuntime/idle_tracker.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace sg {
namespace {

using namespace std::chrono_literals;
using TimePoint = IdleTracker::TimePoint;

const TimePoint kT0 = TimePoint() + 1000h;

TEST(IdleTracker, ExpiresInDeadlineOrder) {
  IdleTracker t;
  t.set("c", 30s, kT0);
  t.set("a", 10s, kT0);
  t.set("b", 20s, kT0);
  EXPECT_EQ(t.next_deadline(), kT0 + 10s);
  EXPECT_TRUE(t.pop_expired(kT0 + 9s).empty());
  EXPECT_EQ(t.pop_expired(kT0 + 10s), std::vector<std::string>{"a"});
  EXPECT_EQ(t.pop_expired(kT0 + 60s), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(t.size(), 0u);
  EXPECT_FALSE(t.next_deadline().has_value());
}

TEST(IdleTracker, TouchPostponesWithoutHeapWork) {
  IdleTracker t;
  t.set("a", 10s, kT0);
  size_t heap_before = t.heap_size();
  for (int i = 1; i <= 100; ++i) ASSERT_TRUE(t.touch("a", kT0 + std::chrono::seconds(i) / 10));
  EXPECT_EQ(t.heap_size(), heap_before);
  EXPECT_EQ(t.deadline("a"), kT0 + 20s);
  // The stale heap entry surfaces at the old deadline and is pushed back, not expired.
  EXPECT_TRUE(t.pop_expired(kT0 + 10s).empty());
  EXPECT_EQ(t.next_deadline(), kT0 + 20s);
  EXPECT_EQ(t.pop_expired(kT0 + 20s), std::vector<std::string>{"a"});
}

TEST(IdleTracker, TouchNeverMovesBackwards) {
  IdleTracker t;
  t.set("a", 10s, kT0 + 5s);
  t.touch("a", kT0);  // an older timestamp (a late report) must not shorten the deadline
  EXPECT_EQ(t.deadline("a"), kT0 + 15s);
  EXPECT_FALSE(t.touch("unknown", kT0));
}

TEST(IdleTracker, SetRestartsWithTheNewTimeout) {
  IdleTracker t;
  t.set("a", 10s, kT0);
  t.set("a", 100s, kT0 + 5s);
  EXPECT_TRUE(t.pop_expired(kT0 + 50s).empty());  // the first entry is stale
  EXPECT_EQ(t.pop_expired(kT0 + 105s), std::vector<std::string>{"a"});
  t.set("b", 100s, kT0);
  t.set("b", 1s, kT0);  // shorter: must expire early, not at the old deadline
  EXPECT_EQ(t.pop_expired(kT0 + 1s), std::vector<std::string>{"b"});
}

TEST(IdleTracker, RemoveIsFinal) {
  IdleTracker t;
  t.set("a", 10s, kT0);
  t.set("b", 10s, kT0);
  t.remove("a");
  t.remove("never-added");
  EXPECT_FALSE(t.contains("a"));
  EXPECT_EQ(t.pop_expired(kT0 + 1h), std::vector<std::string>{"b"});
  // Removed then added again: only the new entry counts.
  t.set("a", 10s, kT0);
  t.remove("a");
  t.set("a", 50s, kT0);
  EXPECT_TRUE(t.pop_expired(kT0 + 10s).empty());
  EXPECT_EQ(t.pop_expired(kT0 + 50s), std::vector<std::string>{"a"});
}

TEST(IdleTracker, HoldKeepsAwakeAndReleaseStartsTheClock) {
  IdleTracker t;
  t.set("a", 10s, kT0);
  ASSERT_TRUE(t.hold("a"));
  ASSERT_TRUE(t.hold("a"));
  EXPECT_FALSE(t.deadline("a").has_value());
  EXPECT_TRUE(t.pop_expired(kT0 + 1h).empty());
  t.release("a", kT0 + 2h);
  EXPECT_TRUE(t.pop_expired(kT0 + 3h).empty()) << "still one hold";
  t.release("a", kT0 + 3h);
  EXPECT_EQ(t.deadline("a"), kT0 + 3h + 10s);
  EXPECT_TRUE(t.pop_expired(kT0 + 3h + 9s).empty());
  EXPECT_EQ(t.pop_expired(kT0 + 3h + 10s), std::vector<std::string>{"a"});
  t.release("a", kT0);  // untracked now: a no-op
  EXPECT_FALSE(t.hold("a"));
}

TEST(IdleTracker, HoldAndReleaseBeforeTheEntrySurfaces) {
  IdleTracker t;
  t.set("a", 10s, kT0);
  t.hold("a");
  t.release("a", kT0 + 1s);
  EXPECT_EQ(t.heap_size(), 1u) << "the original entry still speaks for the key";
  EXPECT_TRUE(t.pop_expired(kT0 + 10s).empty());
  EXPECT_EQ(t.pop_expired(kT0 + 11s), std::vector<std::string>{"a"});
}

TEST(IdleTracker, SetKeepsHolds) {
  IdleTracker t;
  t.set("a", 10s, kT0);
  t.hold("a");
  t.set("a", 5s, kT0);
  EXPECT_TRUE(t.pop_expired(kT0 + 1h).empty());
  t.release("a", kT0 + 1h);
  EXPECT_EQ(t.pop_expired(kT0 + 1h + 5s), std::vector<std::string>{"a"});
}

TEST(IdleTracker, OrderingAtScaleWithRandomTouches) {
  constexpr int kKeys = 100'000;
  IdleTracker t;
  std::mt19937 rng(7);
  std::vector<TimePoint> last_activity(kKeys, kT0);
  std::vector<IdleTracker::Duration> timeouts(kKeys);
  for (int i = 0; i < kKeys; ++i) {
    timeouts[i] = std::chrono::seconds(1 + rng() % 600);
    t.set("sb-" + std::to_string(i), timeouts[i], kT0);
  }
  for (int n = 0; n < 200'000; ++n) {
    int i = static_cast<int>(rng() % kKeys);
    auto at = kT0 + std::chrono::milliseconds(rng() % 300'000);
    t.touch("sb-" + std::to_string(i), at);
    last_activity[i] = std::max(last_activity[i], at);
  }
  std::vector<TimePoint> expected(kKeys);
  for (int i = 0; i < kKeys; ++i) expected[i] = last_activity[i] + timeouts[i];
  EXPECT_EQ(t.heap_size(), static_cast<size_t>(kKeys)) << "touches must not grow the heap";
  // Walk time forward; every key expires exactly when its own deadline passes.
  size_t total = 0;
  for (auto now = kT0; total < static_cast<size_t>(kKeys); now += 7s) {
    for (const std::string& key : t.pop_expired(now)) {
      int i = std::stoi(key.substr(3));
      ASSERT_LE(expected[i], now) << key << " expired early";
      ASSERT_GT(expected[i], now - 7s) << key << " expired late";
      ++total;
    }
    ASSERT_LT(now, kT0 + 24h);
  }
  EXPECT_EQ(t.size(), 0u);
}

TEST(IdleTracker, ChurnDoesNotBloatTheHeap) {
  IdleTracker t;
  for (int round = 0; round < 50; ++round)
    for (int i = 0; i < 1000; ++i) {
      std::string key = "k" + std::to_string(i);
      t.set(key, 1h, kT0);
      if (i % 2 == 0) t.remove(key);
    }
  EXPECT_EQ(t.size(), 500u);
  EXPECT_LE(t.heap_size(), 2 * t.size() + 64 + 1);
  EXPECT_EQ(t.pop_expired(kT0 + 1h).size(), 500u);
}

}  // namespace
}  // namespace sg
