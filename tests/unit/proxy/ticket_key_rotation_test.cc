// The rotation of the session ticket keys on the main loop's timer (proxy/ticket_key_rotation.*), with a
// period of milliseconds instead of the config's hour.
#include "proxy/ticket_key_rotation.h"

#include <gtest/gtest.h>

#include <chrono>

namespace sg {
namespace {

TEST(TicketKeyRotation, RotatesEveryPeriodAskingForThePeriodEachTime) {
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  auto keys = TicketKeys::generate();
  ASSERT_TRUE(keys) << keys.message();
  const std::string first = (*keys)->serialize();
  int asked = 0;
  {
    TicketKeyRotation rotation(&loop, *keys, [&] {
      ++asked;
      return uint64_t{5};
    });
    rotation.start();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (rotation.rotations() < TicketKeys::kKept && std::chrono::steady_clock::now() < deadline)
      uv_run(&loop, UV_RUN_ONCE);
    EXPECT_EQ(rotation.rotations(), TicketKeys::kKept);
    EXPECT_EQ(asked, static_cast<int>(TicketKeys::kKept) + 1) << "the period is read again before each wait";
  }
  EXPECT_EQ((*keys)->size(), TicketKeys::kKept);
  EXPECT_EQ((*keys)->serialize().find(first), std::string::npos) << "the first key rotated out";
  uv_run(&loop, UV_RUN_DEFAULT);  // the timer's close
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

}  // namespace
}  // namespace sg
