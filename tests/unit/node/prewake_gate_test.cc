#include "noderuntime/prewake_gate.h"

#include <gtest/gtest.h>

#include <string>

namespace sg {
namespace {

using namespace std::chrono_literals;
using Clock = PrewakeGate::Clock;

TEST(PrewakeGate, AdmitsOnlyAnAddressThatVerifiedForThatSandboxWithinTheWindow) {
  PrewakeGate gate;
  const Clock::time_point t0{};
  EXPECT_FALSE(gate.admits("sb-a", "127.0.0.2", t0, 1h)) << "nobody verified yet";
  gate.verified("sb-a", "127.0.0.2", t0);
  EXPECT_TRUE(gate.admits("sb-a", "127.0.0.2", t0 + 59min, 1h));
  EXPECT_TRUE(gate.admits("sb-a", "127.0.0.2", t0 + 1h, 1h));
  EXPECT_FALSE(gate.admits("sb-a", "127.0.0.2", t0 + 1h + 1s, 1h)) << "past the window";
  EXPECT_FALSE(gate.admits("sb-a", "127.0.0.3", t0, 1h)) << "another address";
  EXPECT_FALSE(gate.admits("sb-b", "127.0.0.2", t0, 1h)) << "another sandbox";
  // A later verification renews the address.
  gate.verified("sb-a", "127.0.0.2", t0 + 50min);
  EXPECT_TRUE(gate.admits("sb-a", "127.0.0.2", t0 + 1h + 30min, 1h));
}

TEST(PrewakeGate, NoAddressAndAZeroWindowAdmitNothing) {
  PrewakeGate gate;
  const Clock::time_point t0{};
  gate.verified("sb-a", "", t0);
  EXPECT_FALSE(gate.admits("sb-a", "", t0, 1h));
  EXPECT_EQ(gate.sandboxes(), 0u) << "nothing stored without an address";
  gate.verified("sb-a", "10.0.0.1", t0);
  EXPECT_TRUE(gate.admits("sb-a", "10.0.0.1", t0, 1h));
  EXPECT_FALSE(gate.admits("sb-a", "10.0.0.1", t0, 0s)) << "a zero window admits nobody";
}

TEST(PrewakeGate, KeepsAtMostSixteenAddressesPerSandboxReplacingTheOldest) {
  PrewakeGate gate;
  const Clock::time_point t0{};
  for (size_t i = 0; i < PrewakeGate::kMaxClientsPerSandbox; ++i)
    gate.verified("sb-a", "10.0.0." + std::to_string(i), t0 + std::chrono::seconds(i));
  gate.verified("sb-a", "10.0.0.0", t0 + 100s);  // renewed: now the newest
  gate.verified("sb-a", "10.0.1.1", t0 + 200s);  // replaces the oldest, 10.0.0.1
  const auto now = t0 + 300s;
  EXPECT_TRUE(gate.admits("sb-a", "10.0.1.1", now, 24h));
  EXPECT_TRUE(gate.admits("sb-a", "10.0.0.0", now, 24h));
  EXPECT_FALSE(gate.admits("sb-a", "10.0.0.1", now, 24h));
  for (size_t i = 2; i < PrewakeGate::kMaxClientsPerSandbox; ++i)
    EXPECT_TRUE(gate.admits("sb-a", "10.0.0." + std::to_string(i), now, 24h)) << i;
}

TEST(PrewakeGate, ForgetDropsASandboxsAddresses) {
  PrewakeGate gate;
  const Clock::time_point t0{};
  gate.verified("sb-a", "127.0.0.2", t0);
  gate.verified("sb-b", "127.0.0.2", t0);
  gate.forget("sb-a");
  EXPECT_FALSE(gate.admits("sb-a", "127.0.0.2", t0, 1h));
  EXPECT_TRUE(gate.admits("sb-b", "127.0.0.2", t0, 1h));
  EXPECT_EQ(gate.sandboxes(), 1u);
}

}  // namespace
}  // namespace sg
