#include "common/egress_rule.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

TEST(EgressRule, ParsesNetworksAndPorts) {
  auto r = parse_egress_rule("10.1.0.0/16:443");
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->network, 0x0A010000u);
  EXPECT_EQ(r->prefix, 16);
  EXPECT_EQ(r->port, 443);
  EXPECT_EQ(r->to_string(), "10.1.0.0/16:443");
  auto host = parse_egress_rule("192.0.2.7");
  ASSERT_TRUE(host);
  EXPECT_EQ(host->prefix, 32);
  EXPECT_EQ(host->to_string(), "192.0.2.7");
}

TEST(EgressRule, RefusesAnythingElse) {
  for (const char* bad : {"", "example.com", "10.1.0.1/16", "10.0.0.0/33", "10.0.0.0/8:0", "10.0.0.0/8:70000",
                          "::1", "10.0.0.0/8:", "1.2.3.4.5", "10.0.0.0/8:22x"}) {
    auto r = parse_egress_rule(bad);
    EXPECT_FALSE(r) << bad;
    if (!r) {
      EXPECT_EQ(r.error(), Error::kInvalidArgument) << bad;
    }
  }
}

}  // namespace
}  // namespace sg
