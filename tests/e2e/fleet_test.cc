// The node side of a fleet on etcd (docs/fleet.md): real etcd members started here, real sandgate-node
// daemons with [fleet], the node API through curl. Name claims, the node key's lease, a dead node's sandbox
// keys, fencing while etcd is unreachable, reconcile on restart.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <thread>

#include "common/etcd_client.h"
#include "tests/e2e/harness.h"
#include "tests/etcd_process.h"
#include "tests/netns.h"

namespace sg::e2e {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;

constexpr int kLeaseTtlSecs = 2;

class Fleet : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(sg::testing::have_etcd()) << "/usr/bin/etcd is missing: deploy/install-deps.sh installs etcd-server";
    char tmpl[] = "/tmp/sg-e2e-etcd-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    etcd_ = std::make_unique<sg::testing::EtcdCluster>(dir_, 1);
    ASSERT_TRUE(etcd_->start_all()) << read_file(dir_ + "/etcd-0.log");
    client_ = std::make_unique<etcd::Client>(etcd_->options());
  }
  void TearDown() override {
    nodes_.clear();
    etcd_.reset();
    if (!dir_.empty() && !HasFailure()) std::filesystem::remove_all(dir_);
  }

  // A node named `name` in the fleet; returns once it has registered with etcd. `node_extra` goes into its
  // [node] table (an images_dir of its own: a node without the shared test image).
  Cluster& add_node(const std::string& name, const std::string& node_extra = "") {
    ClusterOptions o = ClusterOptions::node_only();
    o.node_extra = node_extra;
    std::string endpoints;
    for (const auto& url : etcd_->urls()) endpoints += (endpoints.empty() ? "\"" : ", \"") + url + "\"";
    o.node_extra += "\n[fleet]\netcd_endpoints = [" + endpoints + "]\nnode_name = \"" + name +
                   "\"\nadvertise_api = \"unix:$CLUSTER_DIR/node.sock\"\nadvertise_ingress = \"127.0.0.1:1\"\n" +
                   "lease_ttl_secs = " + std::to_string(kLeaseTtlSecs) + "\netcd_timeout_ms = 300\n";
    nodes_.push_back(std::make_unique<Cluster>(o));
    Cluster& c = *nodes_.back();
    EXPECT_FALSE(c.node().wait_for("fleet: node " + name + " registered", 10000).empty()) << c.node().log();
    return c;
  }

  // POST /v1/sandboxes on `c`: {status, body}. In a fleet the node places it (on itself or another node).
  static std::pair<int, std::string> create(Cluster& c, const std::string& name) {
    json req = {{"name", name}, {"command", {"/bin/sleep", "600"}}};
    auto r = c.api_raw("POST", "/v1/sandboxes", req.dump());
    return {Cluster::http_code(r), Cluster::body(r)};
  }
  static std::pair<int, std::string> create_from_image(Cluster& c, const std::string& name, const std::string& image) {
    json req = {{"name", name}, {"image", image}, {"command", {"/bin/sleep", "600"}}};
    auto r = c.api_raw("POST", "/v1/sandboxes", req.dump());
    return {Cluster::http_code(r), Cluster::body(r)};
  }
  // The same as another node's placement sends it: admitted or refused here, never sent on.
  static std::pair<int, std::string> create_placed(Cluster& c, const std::string& name, const std::string& image = "") {
    json req = {{"name", name}, {"command", {"/bin/sleep", "600"}}};
    if (!image.empty()) req["image"] = image;
    auto r = run("curl -sS --unix-socket " + shell_quote(c.api().substr(5)) +
                 " -X POST -H 'Content-Type: application/json' -H 'X-Sandgate-Placed-By: test' --data-binary " +
                 shell_quote(req.dump()) + " -w '\\n%{http_code}' http://node/v1/sandboxes");
    return {Cluster::http_code(r), Cluster::body(r)};
  }
  // Until `c`'s view of the fleet lists `count` nodes, `draining` of them draining.
  static bool view_has(Cluster& c, size_t count, size_t draining) {
    return eventually([&] {
      auto r = c.api_raw("GET", "/v1/fleet/nodes", "");
      json j = json::parse(Cluster::body(r), nullptr, false);
      if (!j.is_object() || !j["nodes"].is_array() || j["nodes"].size() != count) return false;
      size_t d = 0;
      for (const json& n : j["nodes"]) d += n.value("state", "") == "draining";
      return d == draining;
    }, 10s);
  }

  std::optional<json> key(const std::string& k) {
    auto r = client_->range(k);
    if (!r || r->kvs.empty()) return std::nullopt;
    return json::parse(r->kvs[0].value, nullptr, false);
  }

  std::string dir_;
  std::unique_ptr<sg::testing::EtcdCluster> etcd_;
  std::unique_ptr<etcd::Client> client_;
  std::vector<std::unique_ptr<Cluster>> nodes_;
};

TEST_F(Fleet, TwentyConcurrentCreatesOfOneNameThroughThreeNodesHaveOneWinner) {
  Cluster* n[3] = {&add_node("n0"), &add_node("n1"), &add_node("n2")};
  auto node_key = key("/sandgate/nodes/n1");
  ASSERT_TRUE(node_key);
  EXPECT_EQ((*node_key)["state"], "ready");
  std::vector<std::pair<int, std::string>> results(20);
  std::vector<std::thread> threads;
  for (int i = 0; i < 20; i++) threads.emplace_back([&, i] { results[i] = create(*n[i % 3], "dup"); });
  for (auto& t : threads) t.join();
  int created = 0, conflicts = 0;
  std::string winner_body;
  for (auto& [status, body] : results) {
    if (status / 100 == 2) {
      created++;
      winner_body = body;
    } else if (status == 409) {
      conflicts++;
    } else {
      ADD_FAILURE() << status << " " << body;
    }
  }
  EXPECT_EQ(created, 1);
  EXPECT_EQ(conflicts, 19);
  auto owner = key("/sandgate/sandboxes/dup");
  ASSERT_TRUE(owner);
  const std::string winner = (*owner)["node"];
  EXPECT_EQ((*owner)["state"], "running");
  // Every loser was told which node holds the name (the ones on the winner's own node too).
  for (auto& [status, body] : results)
    if (status == 409) {
      EXPECT_NE(body.find("node '" + winner + "'"), std::string::npos) << body;
    }
  // Exactly one sandbox named dup exists, on the winner.
  int found = 0;
  for (int i = 0; i < 3; i++) {
    auto j = n[i]->get("dup");
    if (!j.empty()) {
      found++;
      EXPECT_EQ("n" + std::to_string(i), winner);
    }
  }
  EXPECT_EQ(found, 1);
  // The CLI: ls has the NODE column, nodes lists the fleet, drain shows at the drained node's next renewal.
  Cluster& w = *n[winner.back() - '0'];
  auto ls = w.cli("ls");
  EXPECT_NE(ls.out.find("NODE"), std::string::npos) << ls.out;
  EXPECT_NE(ls.out.find("  " + winner + "  "), std::string::npos) << ls.out;
  auto nodes = n[0]->cli("nodes");
  ASSERT_EQ(nodes.exit_code, 0) << nodes.err;
  for (const char* name : {"n0 *", "n1 ", "n2 "}) EXPECT_NE(nodes.out.find(name), std::string::npos) << nodes.out;
  // Drain the winner with its sandbox suspended: the drain says what stays there (none is moved).
  ASSERT_EQ(w.cli("suspend dup").exit_code, 0);
  ASSERT_TRUE(eventually([&] { auto k = key("/sandgate/sandboxes/dup"); return k && (*k)["state"] == "suspended"; }, 5s));
  const std::string other = "n" + std::to_string((winner.back() - '0' + 1) % 3);
  auto drain = n[other.back() - '0']->cli("node drain " + winner);
  ASSERT_EQ(drain.exit_code, 0) << drain.err;
  EXPECT_EQ(drain.out, "node " + winner + " is draining: no new sandbox is placed there\n"
                       "1 sandbox stays on it (they keep answering and waking there; none is moved):\n"
                       "NAME  STATE\n"
                       "dup   suspended\n");
  EXPECT_TRUE(eventually([&] { return n[1]->cli("nodes").out.find("draining") != std::string::npos; }, 5s))
      << n[1]->cli("nodes").out;
  auto drained = key("/sandgate/nodes/" + winner);
  ASSERT_TRUE(drained);
  EXPECT_EQ((*drained)["state"], "draining");
  ASSERT_EQ(n[0]->cli("node undrain " + winner).exit_code, 0);
  EXPECT_TRUE(eventually([&] { auto k = key("/sandgate/nodes/" + winner); return k && (*k)["state"] == "ready"; }, 5s));
  auto json_drain = n[0]->cli("node drain --json n0");
  ASSERT_EQ(json_drain.exit_code, 0) << json_drain.err;
  EXPECT_EQ(json::parse(json_drain.out, nullptr, false).value("draining", false), true) << json_drain.out;
  ASSERT_EQ(n[0]->cli("node undrain n0").exit_code, 0);
  EXPECT_NE(n[0]->cli("node drain ../x").exit_code, 0);
  // rm gives the name back to the fleet.
  ASSERT_EQ(w.cli("rm dup").exit_code, 0);
  EXPECT_TRUE(eventually([&] { return !key("/sandgate/sandboxes/dup"); }, 5s));
  auto again = create(*n[(winner.back() - '0' + 1) % 3], "dup");
  EXPECT_EQ(again.first / 100, 2) << again.second;
}

// Placement: a create through any node lands on a ready node (the answer names it, and that node has the
// sandbox); never on a draining one, whose own admission refuses a create placed on it by a stale view; a
// node killed with -9 takes none, whether the placing node's view still lists it (its socket refuses, so the
// next node is asked) or not; with every node draining the create is refused with the reason.
TEST_F(Fleet, CreatesArePlacedOnReadyNodesNeverOnADrainingOrDeadOne) {
  Cluster* n[3] = {&add_node("p0"), &add_node("p1"), &add_node("p2")};
  auto index = [](const std::string& node) { return node.size() == 2 ? node[1] - '0' : -1; };
  ASSERT_TRUE(view_has(*n[1], 3, 0));
  ASSERT_EQ(n[0]->cli("node drain p1").exit_code, 0);
  ASSERT_TRUE(view_has(*n[1], 3, 1));
  std::map<std::string, int> placed;
  for (int i = 0; i < 6; i++) {
    const std::string name = "pl" + std::to_string(i);
    auto [status, body] = create(*n[1], name);
    ASSERT_EQ(status, 201) << body;
    const std::string node = json::parse(body, nullptr, false).value("node", "");
    ASSERT_TRUE(node == "p0" || node == "p2") << body;
    placed[node]++;
    EXPECT_FALSE(n[index(node)]->get(name).empty()) << name << " is not on " << node;
    EXPECT_TRUE(n[1]->get(name).empty()) << name << " is on the draining node";
  }
  EXPECT_NE(n[1]->node().log().find("fleet: placed a create on node"), std::string::npos) << n[1]->node().log();

  auto refused = create_placed(*n[1], "pl-direct");
  EXPECT_EQ(refused.first, 503) << refused.second;
  EXPECT_NE(refused.second.find("node p1 is draining"), std::string::npos) << refused.second;

  n[2]->stop_node(SIGKILL);
  for (int i = 0; i < 4; i++) {
    const std::string name = "pk" + std::to_string(i);
    auto [status, body] = create(*n[0], name);
    ASSERT_EQ(status, 201) << body;
    EXPECT_EQ(json::parse(body, nullptr, false).value("node", ""), "p0") << body;
  }
  ASSERT_TRUE(eventually([&] { return !key("/sandgate/nodes/p2"); }, std::chrono::seconds(kLeaseTtlSecs + 3)));

  ASSERT_EQ(n[0]->cli("node drain p0").exit_code, 0);
  ASSERT_TRUE(view_has(*n[0], 2, 2));
  auto none = create(*n[0], "pl-none");
  EXPECT_EQ(none.first, 503) << none.second;
  EXPECT_NE(none.second.find("is draining"), std::string::npos) << none.second;
  EXPECT_FALSE(key("/sandgate/sandboxes/pl-none"));
}

// Images are per node: p0 and p1 have stores of their own with no image, p2 the test image. Nodes publish
// their images' names in their node keys, so a create naming an image goes to a node that has it; a node
// without it refuses with a marked 404 that placement passes over; an image no node has is a 404 naming each.
TEST_F(Fleet, ACreateGoesToANodeThatHasItsImage) {
  Cluster* n[3] = {&add_node("i0", "images_dir = \"\"\n"), &add_node("i1", "images_dir = \"\"\n"), &add_node("i2")};
  const std::string image = test_image().name;
  ASSERT_TRUE(eventually([&] {
    auto r = n[0]->api_raw("GET", "/v1/fleet/nodes", "");
    json j = json::parse(Cluster::body(r), nullptr, false);
    if (!j.is_object() || !j["nodes"].is_array() || j["nodes"].size() != 3) return false;
    for (const json& node : j["nodes"]) {
      const json& images = node["images"];
      const bool has = images.is_array() && std::find(images.begin(), images.end(), image) != images.end();
      if (!images.is_array() || has != (node.value("name", "") == "i2")) return false;
    }
    return true;
  }, 10s)) << Cluster::body(n[0]->api_raw("GET", "/v1/fleet/nodes", ""));
  auto nodes = n[1]->cli("nodes");
  EXPECT_NE(nodes.out.find("IMAGES"), std::string::npos) << nodes.out;

  for (int i = 0; i < 4; i++) {
    const std::string name = "img" + std::to_string(i);
    auto [status, body] = create_from_image(*n[i % 2], name, image);
    ASSERT_EQ(status, 201) << body;
    EXPECT_EQ(json::parse(body, nullptr, false).value("node", ""), "i2") << body;
    EXPECT_FALSE(n[2]->get(name).empty()) << name << " is not on i2";
  }

  // Asked directly (as placement asks), a node without the image refuses, marked, and holds no claim.
  auto direct = create_placed(*n[0], "img-direct", image);
  EXPECT_EQ(direct.first, 404) << direct.second;
  json refusal = json::parse(direct.second, nullptr, false);
  EXPECT_EQ(refusal.value("missing", ""), "image") << direct.second;
  EXPECT_NE(refusal.value("message", "").find("no image '" + image + "' on this node"), std::string::npos) << direct.second;
  EXPECT_FALSE(key("/sandgate/sandboxes/img-direct"));
  auto placed = create_from_image(*n[1], "img-direct", image);
  ASSERT_EQ(placed.first, 201) << placed.second;
  EXPECT_EQ(json::parse(placed.second, nullptr, false).value("node", ""), "i2") << placed.second;

  auto none = create_from_image(*n[0], "img-none", "no-such-image");
  EXPECT_EQ(none.first, 404) << none.second;
  const std::string message = json::parse(none.second, nullptr, false).value("message", "");
  EXPECT_NE(message.find("fleet: no node has the image"), std::string::npos) << none.second;
  for (const char* node : {"i0: ", "i1: ", "i2: "}) EXPECT_NE(message.find(node), std::string::npos) << message;
  EXPECT_FALSE(key("/sandgate/sandboxes/img-none"));
}

// Nodes publish node.max_memory_mb / node.max_cpus and what their sandboxes reserve; placement passes over a
// node without room for the create's memory_mb and cpus, and a node asked directly refuses with 429.
TEST_F(Fleet, ACreateGoesToANodeWithRoomForItsMemoryAndCpus) {
  Cluster* n[2] = {&add_node("m0", "max_memory_mb = 1024\nmax_cpus = 2\n"), &add_node("m1", "max_memory_mb = 8192\n")};
  auto sized = [](Cluster& c, const std::string& name, int memory_mb, double cpus) {
    json req = {{"name", name}, {"memory_mb", memory_mb}, {"cpus", cpus}, {"command", {"/bin/sleep", "600"}}};
    auto r = c.api_raw("POST", "/v1/sandboxes", req.dump());
    return std::pair<int, std::string>{Cluster::http_code(r), Cluster::body(r)};
  };
  // `node` as `viewer` sees it, once it has published `reserved_mb`.
  auto published = [&](Cluster& viewer, const std::string& node, int64_t reserved_mb) {
    return eventually([&] {
      json j = json::parse(Cluster::body(viewer.api_raw("GET", "/v1/fleet/nodes", "")), nullptr, false);
      if (!j.is_object() || !j["nodes"].is_array()) return false;
      for (const json& x : j["nodes"])
        if (x.value("name", "") == node) return x.value("reserved_memory_mb", int64_t{-1}) == reserved_mb;
      return false;
    }, 10s);
  };
  ASSERT_TRUE(view_has(*n[0], 2, 0));
  ASSERT_TRUE(published(*n[0], "m1", 0));

  // 2 GiB fit only on m1, wherever the create comes in.
  auto big = sized(*n[0], "mem-big", 2048, 1);
  ASSERT_EQ(big.first, 201) << big.second;
  EXPECT_EQ(json::parse(big.second, nullptr, false).value("node", ""), "m1") << big.second;
  // 3 CPUs do not fit on m0 (node.max_cpus = 2), which has the memory.
  auto wide = sized(*n[0], "cpu-wide", 256, 3);
  ASSERT_EQ(wide.first, 201) << wide.second;
  EXPECT_EQ(json::parse(wide.second, nullptr, false).value("node", ""), "m1") << wide.second;

  // Asked directly, m0 admits what fits and refuses the rest with a 429 naming the key.
  json small = {{"name", "mem-small"}, {"memory_mb", 768}, {"cpus", 0.5}, {"command", {"/bin/sleep", "600"}}};
  auto placed = run("curl -sS --unix-socket " + shell_quote(n[0]->api().substr(5)) +
                    " -X POST -H 'X-Sandgate-Placed-By: test' --data-binary " + shell_quote(small.dump()) +
                    " -w '\n%{http_code}' http://node/v1/sandboxes");
  ASSERT_EQ(Cluster::http_code(placed), 201) << placed.out;
  small["name"] = "mem-small-2";
  auto refused = run("curl -sS --unix-socket " + shell_quote(n[0]->api().substr(5)) +
                     " -X POST -H 'X-Sandgate-Placed-By: test' --data-binary " + shell_quote(small.dump()) +
                     " -w '\n%{http_code}' http://node/v1/sandboxes");
  EXPECT_EQ(Cluster::http_code(refused), 429) << refused.out;
  EXPECT_NE(Cluster::body(refused).find("node.max_memory_mb"), std::string::npos) << refused.out;
  EXPECT_FALSE(key("/sandgate/sandboxes/mem-small-2"));

  // Both views learn the reservations at the next renewal; the CLI shows them.
  ASSERT_TRUE(published(*n[1], "m0", 768));
  ASSERT_TRUE(published(*n[0], "m1", 2048 + 256));
  auto nodes = n[1]->cli("nodes");
  EXPECT_NE(nodes.out.find("768/1024"), std::string::npos) << nodes.out;
  EXPECT_NE(nodes.out.find("0.5/2"), std::string::npos) << nodes.out;
  // One that fits nowhere is a 429, and claims no name.
  auto huge = sized(*n[1], "mem-huge", 6144, 1);
  EXPECT_EQ(huge.first, 429) << huge.second;
  EXPECT_FALSE(key("/sandgate/sandboxes/mem-huge"));
  // A removal gives the room back: then the same create is placed.
  ASSERT_EQ(Cluster::http_code(n[1]->api_raw("DELETE", "/v1/sandboxes/mem-big", "")), 200);
  ASSERT_TRUE(published(*n[1], "m1", 256));
  auto after = sized(*n[0], "mem-huge", 6144, 1);
  ASSERT_EQ(after.first, 201) << after.second;
  EXPECT_EQ(json::parse(after.second, nullptr, false).value("node", ""), "m1") << after.second;
}

TEST_F(Fleet, KillNineDropsTheNodeKeyKeepsItsSandboxesAndARestartReconciles) {
  Cluster& c = add_node("k0");
  ASSERT_EQ(create(c, "k9").first / 100, 2);
  ASSERT_EQ(create(c, "k10").first / 100, 2);
  ASSERT_TRUE(eventually([&] { auto k = key("/sandgate/sandboxes/k9"); return k && (*k)["state"] == "running"; }, 5s));
  c.stop_node(SIGKILL);
  auto killed = std::chrono::steady_clock::now();
  // Gone within the lease TTL (plus etcd's expiry check and our polling).
  ASSERT_TRUE(eventually([&] { return !key("/sandgate/nodes/k0"); }, std::chrono::seconds(kLeaseTtlSecs + 2)));
  auto took = std::chrono::steady_clock::now() - killed;
  EXPECT_LT(took, std::chrono::seconds(kLeaseTtlSecs + 2));
  // The dead node's sandboxes are still known (proxies answer 503 + Retry-After, not 404).
  auto k9 = key("/sandgate/sandboxes/k9");
  ASSERT_TRUE(k9);
  EXPECT_EQ((*k9)["node"], "k0");
  // While it is down: one key lost, one stale key of a sandbox it no longer has, one name held by another node.
  ASSERT_TRUE(client_->delete_range("/sandgate/sandboxes/k10"));
  ASSERT_TRUE(client_->put("/sandgate/sandboxes/ghost", R"({"node":"k0","state":"running"})"));
  ASSERT_TRUE(client_->put("/sandgate/sandboxes/k9", R"({"node":"other","state":"running"})"));
  size_t from = c.node().log().size();
  c.start_node();
  ASSERT_FALSE(c.node().wait_for("fleet: reconciled", 10000, from).empty()) << c.node().log();
  EXPECT_TRUE(key("/sandgate/nodes/k0"));
  auto k10 = key("/sandgate/sandboxes/k10");
  ASSERT_TRUE(k10) << "not re-claimed";
  EXPECT_EQ((*k10)["node"], "k0");
  EXPECT_FALSE(key("/sandgate/sandboxes/ghost")) << "stale key left";
  auto k9_after = key("/sandgate/sandboxes/k9");
  ASSERT_TRUE(k9_after);
  EXPECT_EQ((*k9_after)["node"], "other") << "another node's claim overwritten";
  EXPECT_NE(c.node().log().find("sandbox k9 exists on this node but etcd gives its name to another node"),
            std::string::npos);
  // Its sandboxes were adopted and serve requests again: a new create works.
  EXPECT_EQ(create(c, "k11").first / 100, 2);
}

TEST_F(Fleet, ANodeThatCannotRenewFencesItselfAndRecovers) {
  Cluster& c = add_node("f0");
  ASSERT_EQ(create(c, "f1").first / 100, 2);
  ASSERT_EQ(c.cli("suspend f1").exit_code, 0);
  ASSERT_EQ(create(c, "f2").first / 100, 2);
  // etcd stops answering (its connections stay open): the renewals time out. A create meanwhile may fail
  // on its own claim's timeout first; the fence is the refusal that names the lease.
  ASSERT_TRUE(etcd_->pause(0));
  std::pair<int, std::string> refused;
  bool fenced = eventually([&] {
    refused = create(c, "f3");
    return refused.first == 503 && refused.second.find("cannot reach etcd") != std::string::npos;
  }, std::chrono::seconds(kLeaseTtlSecs + 3));
  // Running sandboxes keep running; a wake is refused like a create.
  auto f2 = c.get("f2");
  auto wake = c.cli("resume f1");
  etcd_->resume(0);
  ASSERT_TRUE(fenced) << refused.first << " " << refused.second << "\n" << c.node().log();
  EXPECT_EQ(f2["state"], "running");
  EXPECT_NE(wake.exit_code, 0);
  EXPECT_NE((wake.out + wake.err).find("cannot reach etcd"), std::string::npos) << wake.out << wake.err;
  EXPECT_EQ(c.get("f1")["state"], "suspended");
  // etcd is back: the node renews (or registers again) and serves creates and wakes.
  std::pair<int, std::string> accepted;
  EXPECT_TRUE(eventually([&] {
    accepted = create(c, "f3");
    return accepted.first / 100 == 2;
  }, 10s)) << accepted.first << " " << accepted.second;
  EXPECT_EQ(c.cli("resume f1").exit_code, 0);
  EXPECT_TRUE(eventually([&] { auto k = key("/sandgate/sandboxes/f2"); return k && (*k)["node"] == "f0"; }, 5s));
}

// A claim etcd carried out after the node had given up on it (its answer timed out while etcd was away)
// is this node's own leftover: the next create of that name takes it over instead of a 409 naming itself.
// Another node's claim is never taken.
TEST_F(Fleet, ALeftoverClaimOfThisNodeIsTakenOverByTheNextCreate) {
  Cluster& c = add_node("s0");
  ASSERT_TRUE(client_->put("/sandgate/sandboxes/left", R"({"node":"s0","state":"creating"})"));
  ASSERT_TRUE(client_->put("/sandgate/sandboxes/theirs", R"({"node":"other","state":"creating"})"));
  auto left = create(c, "left");
  EXPECT_EQ(left.first / 100, 2) << left.second;
  EXPECT_TRUE(eventually([&] { auto k = key("/sandgate/sandboxes/left"); return k && (*k)["state"] == "running"; }, 5s));
  auto theirs = create(c, "theirs");
  EXPECT_EQ(theirs.first, 409) << theirs.second;
  EXPECT_NE(theirs.second.find("node 'other'"), std::string::npos) << theirs.second;
}

// A real partition, not a stopped process: etcd runs in a network namespace of its own, reached over a veth
// pair; an nftables rule in that namespace drops the node's packets to it (connections hang, nothing is
// refused). The node fences itself (creates answer 503 naming etcd, a running sandbox keeps running) and,
// once the rule goes, renews or registers again and creates work. Nothing leaves the machine.
TEST(FleetPartition, ANodeCutOffFromEtcdFencesItselfAndServesAgainWhenHealed) {
  ASSERT_TRUE(sg::testing::have_etcd()) << "/usr/bin/etcd is missing: deploy/install-deps.sh installs etcd-server";
  sg::testing::Netns ns;
  ASSERT_TRUE(ns.valid());
  const std::string tag = std::to_string(::getpid() % 100000);
  const std::string host_end = "sgph" + tag, ns_end = "sgpn" + tag;
  const std::string subnet = "10.213." + std::to_string(::getpid() % 250) + ".";
  ASSERT_TRUE(ns.ip("link add " + ns_end + " type veth peer name " + host_end + " netns 1\naddr add " + subnet +
                    "2/30 dev " + ns_end + "\nlink set " + ns_end + " up\nlink set lo up\n"));
  struct DeleteLink {
    std::string name;
    ~DeleteLink() { run("ip link del " + name + " 2>/dev/null"); }
  } link{host_end};
  ASSERT_EQ(run("ip addr add " + subnet + "1/30 dev " + host_end + " && ip link set " + host_end + " up").exit_code, 0);

  char tmpl[] = "/tmp/sg-e2e-partition-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct RemoveIfPassed {  // after etcd has stopped writing into it (destroyed after it)
    std::string dir;
    ~RemoveIfPassed() {
      if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
    }
  } remove_dir{dir};
  sg::testing::EtcdCluster etcd(dir, 1, ns.path(), subnet + "2");
  ASSERT_TRUE(etcd.start_all()) << read_file(dir + "/etcd-0.log");

  ClusterOptions o = ClusterOptions::node_only();
  o.node_extra = "\n[fleet]\netcd_endpoints = [\"" + etcd.url(0) +
                 "\"]\nnode_name = \"cut\"\nadvertise_api = \"unix:$CLUSTER_DIR/node.sock\"\n"
                 "advertise_ingress = \"127.0.0.1:1\"\nlease_ttl_secs = 2\netcd_timeout_ms = 300\n";
  Cluster c(o);
  ASSERT_FALSE(c.node().wait_for("fleet: node cut registered", 10000).empty()) << c.node().log();
  auto create = [&](const std::string& name) {
    auto r = c.api_raw("POST", "/v1/sandboxes", json{{"name", name}, {"command", {"/bin/sleep", "600"}}}.dump());
    return std::pair{Cluster::http_code(r), Cluster::body(r)};
  };
  ASSERT_EQ(create("before").first, 201);

  const std::string nft = "nsenter --net=" + ns.path() + " nft ";
  auto cut = run(nft + "-f - <<'EOF'\ntable inet sgpartition {\n chain input {\n  type filter hook input priority 0;\n"
                "  tcp dport " + std::to_string(etcd.client_port(0)) + " drop\n }\n}\nEOF");
  ASSERT_EQ(cut.exit_code, 0) << cut.err;
  std::pair<int, std::string> refused;
  bool fenced = eventually([&] {
    // A create may first fail on its own claim's timeout; the fence is the refusal that names the lease.
    refused = create("during");
    return refused.first == 503 && refused.second.find("cannot reach etcd to renew its lease") != std::string::npos;
  }, 15s);
  const std::string state_during = c.get("before").value("state", "");
  // The refusal goes by the last renewal's age; the log line comes once the lease thread's call gives up.
  const bool logged = !c.node().wait_for("fleet: node cut fenced", 10000).empty();
  ASSERT_EQ(run(nft + "delete table inet sgpartition").exit_code, 0);
  ASSERT_TRUE(fenced) << refused.first << " " << refused.second << "\n" << c.node().log();
  EXPECT_EQ(state_during, "running");
  EXPECT_TRUE(logged) << c.node().log();

  std::pair<int, std::string> accepted;
  EXPECT_TRUE(eventually([&] { return (accepted = create("after")).first == 201; }, 20s))
      << accepted.first << " " << accepted.second << "\n" << c.node().log();
}

}  // namespace
}  // namespace sg::e2e
