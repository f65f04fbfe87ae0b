// The JSON of a fleet node key, both ways: what a node publishes is what every reader gets back, and a key
// written by something else is an error, not a crash or a silently wrong view.
#include "common/fleet_keys.h"

#include <gtest/gtest.h>

#include <limits>

#include <nlohmann/json.hpp>

namespace sg {
namespace {

TEST(FleetKeys, ANodeKeysImagesComeBackSortedAndAbsentMeansUnknown) {
  fleet::NodeInfo info;
  info.name = "n1";
  info.api = "https://n1:7443";
  info.images = std::vector<std::string>{"python", "base"};
  auto back = parse_node_info(node_info_json(info));
  ASSERT_TRUE(back) << back.message();
  EXPECT_EQ(back->images, (std::vector<std::string>{"base", "python"}));
  EXPECT_TRUE(fleet::may_have_image(*back, "python"));
  EXPECT_FALSE(fleet::may_have_image(*back, "node"));

  info.images.reset();
  const std::string unpublished = node_info_json(info);
  EXPECT_EQ(unpublished.find("images"), std::string::npos) << unpublished;
  back = parse_node_info(unpublished);
  ASSERT_TRUE(back) << back.message();
  EXPECT_FALSE(back->images);
  EXPECT_TRUE(fleet::may_have_image(*back, "anything"));

  info.images = std::vector<std::string>{};
  back = parse_node_info(node_info_json(info));
  ASSERT_TRUE(back && back->images);
  EXPECT_FALSE(fleet::may_have_image(*back, "base"));
}

TEST(FleetKeys, ANodeKeysMemoryAndCpusComeBackAndAbsentMeansNoLimitKnown) {
  fleet::NodeInfo info;
  info.name = "n1";
  info.capacity_memory_mb = 65536;
  info.reserved_memory_mb = 1536;
  info.capacity_millicpus = 16000;
  info.reserved_millicpus = 2500;
  auto back = parse_node_info(node_info_json(info));
  ASSERT_TRUE(back) << back.message();
  EXPECT_EQ(back->capacity_memory_mb, 65536);
  EXPECT_EQ(back->reserved_memory_mb, 1536);
  EXPECT_EQ(back->capacity_millicpus, 16000);
  EXPECT_EQ(back->reserved_millicpus, 2500);
  // Written by anything with access to etcd: negative counts are none, and huge ones stop at INT64_MAX.
  auto odd = parse_node_info(R"({"name": "n9", "state": "ready", "sandboxes": -9223372036854775807,
                                 "capacity_memory_mb": 18446744073709551615, "reserved_millicpus": -5})");
  ASSERT_TRUE(odd) << odd.message();
  EXPECT_EQ(odd->sandboxes, 0);
  EXPECT_EQ(odd->capacity_memory_mb, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(odd->reserved_millicpus, 0);
  auto older = parse_node_info(R"({"name": "n0", "state": "ready", "capacity_sandboxes": 5, "sandboxes": 1})");
  ASSERT_TRUE(older) << older.message();
  EXPECT_EQ(older->capacity_memory_mb, 0);
  EXPECT_EQ(older->capacity_millicpus, 0);
}

TEST(FleetKeys, ANodeKeysImagesMustBeAtMostTheLimitOfNames) {
  nlohmann::json j = {{"name", "n1"}, {"state", "ready"}, {"images", {"base", 7}}};
  auto bad = parse_node_info(j.dump());
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.message(), "node key: images must hold names");
  j["images"] = "base";
  EXPECT_FALSE(parse_node_info(j.dump()));
  j["images"] = std::vector<std::string>(fleet::kMaxPublishedImages, "x");
  EXPECT_TRUE(parse_node_info(j.dump()));
  j["images"].push_back("one-too-many");
  bad = parse_node_info(j.dump());
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("at most 1000 names"), std::string::npos) << bad.message();
}

TEST(FleetKeys, ASandboxKeysPortsComeBackAndBadEntriesAreLeftOut) {
  std::vector<fleet::PortRoute> ports = {{22, "tcp", true}, {7000, "h2c", false}, {8080, "http1", false}};
  auto rec = parse_sandbox_owner(sandbox_owner_json("n1", "running", ports));
  ASSERT_TRUE(rec) << rec.message();
  EXPECT_EQ(rec->node, "n1");
  EXPECT_EQ(rec->state, "running");
  EXPECT_EQ(rec->ports, ports);
  // Without ports the value is what it was before ports existed, and reads back with none.
  EXPECT_EQ(sandbox_owner_json("n1", "running"), R"({"node":"n1","state":"running"})");
  EXPECT_TRUE(parse_sandbox_owner(R"({"node":"n1","state":"running"})")->ports.empty());
  // Any etcd client may write a key: what is not a port 1-65535 with a known protocol is dropped.
  auto odd = parse_sandbox_owner(R"({"node":"n1","state":"running","ports":[
      {"port":0,"protocol":"tcp"},{"port":70000,"protocol":"tcp"},{"port":-1,"protocol":"tcp"},
      {"port":"22","protocol":"tcp"},{"port":22,"protocol":"udp"},{"port":22},"junk",7,
      {"port":443,"protocol":"h2c","public":"yes"}]})");
  ASSERT_TRUE(odd) << odd.message();
  ASSERT_EQ(odd->ports.size(), 1u);
  EXPECT_EQ(odd->ports[0], (fleet::PortRoute{443, "h2c", false}));
  EXPECT_TRUE(parse_sandbox_owner(R"({"node":"n1","ports":"nope"})")->ports.empty());
  // At most kMaxPublishedPorts.
  std::string many = R"({"node":"n1","ports":[)";
  for (int p = 1; p <= 100; ++p) many += std::string(p > 1 ? "," : "") + R"({"port":)" + std::to_string(p) + R"(,"protocol":"tcp"})";
  EXPECT_EQ(parse_sandbox_owner(many + "]}")->ports.size(), fleet::kMaxPublishedPorts);
}

}  // namespace
}  // namespace sg
