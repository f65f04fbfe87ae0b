#include "proxy/fleet_static_directory.h"

#include <gtest/gtest.h>

namespace sg::fleet {
namespace {

TEST(FleetStaticDirectory, ReadsNodesAndOwners) {
  auto d = StaticDirectory::parse(R"({"nodes": [{"name": "b", "ingress": "127.0.0.1:7443", "state": "draining"}],
                                      "sandboxes": {"web": "b", "ghost": "c"}})");
  ASSERT_TRUE(d) << d.message();
  auto web = (*d)->owner_of("web");
  ASSERT_TRUE(web);
  EXPECT_EQ(web->node, "b");
  ASSERT_TRUE(web->node_info);
  EXPECT_EQ(web->node_info->ingress, "127.0.0.1:7443");
  EXPECT_EQ(web->node_info->state, NodeState::kDraining);
  auto ghost = (*d)->owner_of("ghost");  // owned by a node that is not registered: gone
  ASSERT_TRUE(ghost);
  EXPECT_FALSE(ghost->node_info);
  EXPECT_FALSE((*d)->owner_of("nobody"));
  EXPECT_EQ((*d)->nodes().size(), 1u);
}

TEST(FleetStaticDirectory, RefusesMalformedFiles) {
  for (const char* bad : {"", "[]", "{", R"({"nodes": {}})", R"({"nodes": [{"name": "b"}]})",
                          R"({"nodes": [{"name": "B!", "ingress": "x"}]})", R"({"sandboxes": []})",
                          R"({"sandboxes": {"web": 3}})", R"({"sandboxes": {"web": "Not A Node"}})"})
    EXPECT_FALSE(StaticDirectory::parse(bad)) << bad;
}

TEST(FleetStaticDirectory, MissingFileIsAnError) {
  auto d = StaticDirectory::load_file("/nonexistent/sandgate-fleet.json");
  ASSERT_FALSE(d);
  EXPECT_NE(d.message().find("/nonexistent/sandgate-fleet.json"), std::string::npos);
}

}  // namespace
}  // namespace sg::fleet
