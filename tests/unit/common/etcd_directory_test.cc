// EtcdDirectory against real etcd members on loopback: the first list, the watch's puts and deletes, and a
// member dying under the watch (the view lists again from another member and keeps routing).
#include "common/etcd_directory.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>

#include "common/fleet_keys.h"
#include "tests/etcd_process.h"

namespace sg::fleet {
namespace {

using namespace std::chrono_literals;
using sg::testing::EtcdCluster;
using sg::testing::wait_until;

class EtcdDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!sg::testing::have_etcd()) GTEST_SKIP() << "/usr/bin/etcd is missing (apt-get install etcd-server)";
    char tmpl[] = "/tmp/sg-etcd-dir-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    cluster_.reset();
    if (!dir_.empty() && !HasFailure()) std::filesystem::remove_all(dir_);
  }
  void start(int members) {
    cluster_ = std::make_unique<EtcdCluster>(dir_, members);
    ASSERT_TRUE(cluster_->start_all());
    client_ = std::make_unique<etcd::Client>(cluster_->options());
  }
  void put_node(const std::string& name) {
    NodeInfo info{.name = name,
                  .api = "https://" + name,
                  .ingress = name + ":1",
                  .capacity_sandboxes = 10,
                  .sandboxes = 0,
                  .images = std::vector<std::string>{"base", "python"}};
    ASSERT_TRUE(client_->put(std::string(kFleetNodesPrefix) + name, node_info_json(info)));
  }
  void put_sandbox(const std::string& name, const std::string& node) {
    ASSERT_TRUE(client_->put(std::string(kFleetSandboxesPrefix) + name, sandbox_owner_json(node, "running")));
  }

  std::string dir_;
  std::unique_ptr<EtcdCluster> cluster_;
  std::unique_ptr<etcd::Client> client_;
};

TEST_F(EtcdDirectoryTest, ListsThenFollowsPutsAndDeletes) {
  start(1);
  put_node("n1");
  put_sandbox("a", "n1");
  ASSERT_TRUE(client_->put(std::string(kFleetSandboxesPrefix) + "junk", "not json"));  // ignored, not fatal
  EtcdDirectory d(cluster_->options());
  EXPECT_FALSE(d.current());
  d.start();
  ASSERT_TRUE(wait_until([&] { return d.current(); }, 5s));
  auto a = d.owner_of("a");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->node, "n1");
  ASSERT_TRUE(a->node_info);
  EXPECT_EQ(a->node_info->ingress, "n1:1");
  EXPECT_EQ(a->node_info->images, (std::vector<std::string>{"base", "python"}));
  EXPECT_FALSE(d.owner_of("junk"));
  EXPECT_FALSE(a->ports);
  // A ports change of a's (a new value of its key) reaches the view.
  std::vector<PortRoute> ports = {{22, "tcp", true}};
  ASSERT_TRUE(client_->put(std::string(kFleetSandboxesPrefix) + "a", sandbox_owner_json("n1", "running", ports)));
  ASSERT_TRUE(wait_until([&] { auto o = d.owner_of("a"); return o && o->ports && *o->ports == ports; }, 5s));
  EXPECT_FALSE(d.owner_of("b"));
  put_sandbox("b", "n2");
  put_node("n2");
  ASSERT_TRUE(wait_until([&] { auto b = d.owner_of("b"); return b && b->node_info; }, 5s));
  EXPECT_EQ(d.nodes().size(), 2u);
  // The node key expires: its sandboxes stay known, without a node to reach (503 + Retry-After, not 404).
  ASSERT_TRUE(client_->delete_range(std::string(kFleetNodesPrefix) + "n1"));
  ASSERT_TRUE(wait_until([&] { return !d.node("n1"); }, 5s));
  auto stale = d.owner_of("a");
  ASSERT_TRUE(stale);
  EXPECT_EQ(stale->node, "n1");
  EXPECT_FALSE(stale->node_info);
  ASSERT_TRUE(client_->delete_range(std::string(kFleetSandboxesPrefix) + "a"));
  ASSERT_TRUE(wait_until([&] { return !d.owner_of("a"); }, 5s));
  EXPECT_EQ(d.lists(), 1u);  // followed by the watch alone
  d.stop();
  EXPECT_FALSE(d.current());
}

// Between a list and its watch, keys change and etcd compacts past the list's revision: the watch starts
// compacted, and the view lists again instead of missing what changed in the window.
TEST_F(EtcdDirectoryTest, ACompactionBetweenTheListAndItsWatchMeansAnotherList) {
  start(1);
  put_node("n1");
  put_sandbox("before", "n1");
  EtcdDirectory d(cluster_->options());
  std::atomic<int> windows{0};
  d.set_between_list_and_watch([&] {
    if (windows++ != 0) return;
    put_sandbox("in-window", "n1");
    ASSERT_TRUE(client_->delete_range(std::string(kFleetSandboxesPrefix) + "before"));
    put_sandbox("last", "n1");
    auto revision = client_->range(std::string(kFleetSandboxesPrefix) + "last");
    ASSERT_TRUE(revision) << revision.message();
    const std::string compact = "curl -sS -X POST -d '{\"revision\": \"" + std::to_string(revision->revision) +
                                "\", \"physical\": true}' " + cluster_->url(0) + "/v3/kv/compaction";
    FILE* out = ::popen(compact.c_str(), "r");
    ASSERT_NE(out, nullptr);
    char buf[512] = {};
    const size_t n = std::fread(buf, 1, sizeof buf - 1, out);
    ASSERT_EQ(::pclose(out), 0);
    EXPECT_EQ(std::string(buf, n).find("error"), std::string::npos) << buf;
  });
  d.start();
  ASSERT_TRUE(wait_until([&] { return d.lists() >= 2 && d.current(); }, 10s)) << d.lists();
  EXPECT_EQ(windows.load(), 2);
  EXPECT_TRUE(d.owner_of("in-window"));
  EXPECT_TRUE(d.owner_of("last"));
  EXPECT_FALSE(d.owner_of("before"));
  put_sandbox("after", "n1");  // and the second watch follows
  EXPECT_TRUE(wait_until([&] { return d.owner_of("after").has_value(); }, 5s));
  EXPECT_EQ(d.lists(), 2u);
  d.stop();
}

TEST_F(EtcdDirectoryTest, AMemberDyingUnderTheWatchMeansAListFromAnother) {
  start(3);
  put_node("n1");
  put_sandbox("a", "n1");
  EtcdDirectory d(cluster_->options(300ms));
  d.start();
  ASSERT_TRUE(wait_until([&] { return d.current(); }, 5s));
  // The first member in the list took the watch; kill it.
  cluster_->stop(0, SIGKILL);
  ASSERT_TRUE(wait_until([&] { return d.lists() >= 2 && d.current(); }, 10s)) << "lists " << d.lists();
  etcd::ClientOptions rest = cluster_->options();
  rest.members.erase(rest.members.begin());
  etcd::Client survivor(rest);
  ASSERT_TRUE(survivor.put(std::string(kFleetSandboxesPrefix) + "b", sandbox_owner_json("n1", "running")));
  EXPECT_TRUE(wait_until([&] { return d.owner_of("b").has_value(); }, 5s));
  EXPECT_TRUE(d.owner_of("a"));
}

}  // namespace
}  // namespace sg::fleet
