#include "proxy/port_policy_cache.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

PortPolicy policy(std::string id, std::string protocol, bool is_public) {
  return PortPolicy{std::move(id), std::move(protocol), is_public};
}

TEST(PortPolicyCache, RemembersUntilTheTtl) {
  PortPolicyCache cache(1000, 100);
  EXPECT_FALSE(cache.find("demo", 8080, 0));
  cache.store("demo", 8080, policy("sb-1", "h2c", true), 10);
  auto hit = cache.find("demo", 8080, 500);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->sandbox_id, "sb-1");
  EXPECT_EQ(hit->protocol, "h2c");
  EXPECT_TRUE(hit->is_public);
  EXPECT_FALSE(cache.find("demo", 8081, 500)) << "per port";
  EXPECT_FALSE(cache.find("other", 8080, 500)) << "per sandbox";
  EXPECT_FALSE(cache.find("demo", 8080, 1010)) << "expired";
  EXPECT_EQ(cache.size(), 0u) << "an expired entry is dropped when found";
}

TEST(PortPolicyCache, ErasesByPortAndBySandbox) {
  PortPolicyCache cache(1000, 100);
  cache.store("demo", 8080, policy("sb-1", "http1", false), 0);
  cache.store("sb-1", 22, policy("sb-1", "tcp", true), 0);
  cache.store("other", 8080, policy("sb-2", "http1", false), 0);
  cache.erase("demo", 8080);
  EXPECT_FALSE(cache.find("demo", 8080, 1));
  EXPECT_TRUE(cache.find("sb-1", 22, 1));
  cache.erase_sandbox("sb-1");
  EXPECT_FALSE(cache.find("sb-1", 22, 1));
  EXPECT_TRUE(cache.find("other", 8080, 1));
}

TEST(PortPolicyCache, BoundedAndDisabledByAZeroTtl) {
  PortPolicyCache cache(1000, 3);
  for (int i = 0; i < 3; ++i) cache.store("s" + std::to_string(i), 80, policy("id", "http1", false), 0);
  EXPECT_EQ(cache.size(), 3u);
  cache.store("s0", 80, policy("id", "h2c", false), 0);  // replacing keeps the size
  EXPECT_EQ(cache.size(), 3u);
  cache.store("s9", 80, policy("id", "http1", false), 0);
  EXPECT_EQ(cache.size(), 1u) << "full: cleared, then the new entry";
  PortPolicyCache off(0, 100);
  off.store("demo", 8080, policy("sb-1", "http1", false), 0);
  EXPECT_FALSE(off.find("demo", 8080, 0));
}

}  // namespace
}  // namespace sg
