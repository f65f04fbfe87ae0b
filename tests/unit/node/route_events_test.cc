#include "noderuntime/route_events.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace sg {
namespace {

TEST(RouteEvents, StampsIncreaseStrictlyAndFollowTheWallClock) {
  RouteEvents events;
  const auto wall_us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  uint64_t last = events.stamp();
  EXPECT_GE(last, wall_us);  // a restarted node's stamps come after the previous process's
  for (int i = 0; i < 10000; ++i) {
    uint64_t next = events.stamp();
    ASSERT_GT(next, last);
    last = next;
  }
}

TEST(RouteEvents, EveryListenerHearsAnEventStampedAfterTheOpensBeforeIt) {
  RouteEvents events;
  std::vector<RouteEvent> a, b;
  events.subscribe([&](const RouteEvent& e) { a.push_back(e); });
  events.subscribe([&](const RouteEvent& e) { b.push_back(e); });
  const uint64_t opened_at = events.stamp();
  events.publish("sb-1", "web", "token");
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(a[0].id, "sb-1");
  EXPECT_EQ(a[0].name, "web");
  EXPECT_EQ(a[0].reason, "token");
  EXPECT_GT(a[0].stamp, opened_at);
  EXPECT_EQ(a[0].stamp, b[0].stamp);
}

TEST(RouteEvents, AListenerMayUnsubscribeItselfAndOthersWhileItRuns) {
  RouteEvents events;
  int first = 0, second = 0, third = 0;
  uint64_t second_id = 0, first_id = 0;
  first_id = events.subscribe([&](const RouteEvent&) {
    ++first;
    events.unsubscribe(first_id);
    events.unsubscribe(second_id);
  });
  second_id = events.subscribe([&](const RouteEvent&) { ++second; });
  events.subscribe([&](const RouteEvent&) { ++third; });
  events.publish("", "", "operator_token");
  events.publish("", "", "operator_token");
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 0);  // gone before its turn came
  EXPECT_EQ(third, 2);
  EXPECT_EQ(events.subscribers(), 1u);
}

}  // namespace
}  // namespace sg
