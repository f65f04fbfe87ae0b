// Fleet placement without etcd: the order nodes are asked in, and the placer's retries against a fake remote
// node API (the e2e Fleet.* tests place creates between real nodes).
#include "noderuntime/placement.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "tests/unit/node/fake_hypervisor.h"

namespace sg {
namespace {

using testing::TestLoop;

fleet::NodeInfo node(std::string name, int64_t capacity, int64_t sandboxes,
                     fleet::NodeState state = fleet::NodeState::kReady) {
  fleet::NodeInfo n;
  n.name = std::move(name);
  n.api = "unix:/nonexistent/" + n.name + ".sock";
  n.state = state;
  n.capacity_sandboxes = capacity;
  n.sandboxes = sandboxes;
  return n;
}

std::vector<std::string> names(const std::vector<fleet::NodeInfo>& nodes) {
  std::vector<std::string> out;
  for (const auto& n : nodes) out.push_back(n.name);
  return out;
}

std::set<std::string> name_set(const std::vector<fleet::NodeInfo>& nodes) {
  std::set<std::string> out;
  for (const auto& n : nodes) out.insert(n.name);
  return out;
}

TEST(PlacementOrder, LeavesOutDrainingAndFullNodes) {
  std::mt19937_64 rng(1);
  auto order = placement_order({node("full", 2, 2), node("draining", 10, 0, fleet::NodeState::kDraining),
                                node("ok", 10, 3), node("unlimited", 0, 50)},
                               rng);
  EXPECT_EQ(name_set(order),
            (std::set<std::string>{"ok", "unlimited"}));
  EXPECT_EQ(free_capacity(node("unlimited", 0, 50)), std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(placement_order({node("full", 1, 1)}, rng).empty());
}

TEST(PlacementOrder, OfTwoNodesTheOneWithMoreRoomComesFirst) {
  for (uint64_t seed = 0; seed < 50; ++seed) {
    std::mt19937_64 rng(seed);
    EXPECT_EQ(names(placement_order({node("busy", 10, 9), node("idle", 10, 1)}, rng)),
              (std::vector<std::string>{"idle", "busy"}));
  }
}

// The power of two choices: the emptiest node is not always first (two placers with the same view would
// both pick it), but the fullest of three never is, and every node is still in the order for retries.
TEST(PlacementOrder, TheFirstIsTheBetterOfTwoRandomNodesAndTheRestFollowByRoom) {
  std::map<std::string, int> first;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    std::mt19937_64 rng(seed);
    auto order = placement_order({node("a", 10, 1), node("b", 10, 5), node("c", 10, 9)}, rng);
    ASSERT_EQ(order.size(), 3u);
    ++first[order[0].name];
    EXPECT_GE(free_capacity(order[0]), free_capacity(order[1]));
    EXPECT_EQ(name_set(order), (std::set<std::string>{"a", "b", "c"}));
  }
  EXPECT_EQ(first["c"], 0);
  EXPECT_GT(first["a"], first["b"]);  // a wins both of its pairs, b one of its two
  EXPECT_GT(first["b"], 0);
}

fleet::NodeInfo with_images(fleet::NodeInfo n, std::vector<std::string> images) {
  n.images = std::move(images);
  return n;
}

// A node whose published list lacks the image is asked only after every node that may have it (its list may
// be a renewal old, so it is still asked); a node that published none may have any.
TEST(PlacementOrder, NodesThatPublishedImagesWithoutTheOneAskedForComeLast) {
  for (uint64_t seed = 0; seed < 50; ++seed) {
    std::mt19937_64 rng(seed);
    auto order = placement_order({with_images(node("roomy-without", 100, 0), {"base", "node"}),
                                  with_images(node("has", 10, 9), {"base", "python"}), node("unknown", 10, 5),
                                  with_images(node("empty", 100, 0), {})},
                                 rng, PlacementDemand{.image = "python", .memory_mb = 0, .millicpus = 0});
    ASSERT_EQ(order.size(), 4u);
    EXPECT_EQ(name_set({order[0], order[1]}), (std::set<std::string>{"has", "unknown"}));
    EXPECT_EQ(name_set({order[2], order[3]}), (std::set<std::string>{"roomy-without", "empty"}));
    // Without an image asked for, room alone decides.
    auto any = placement_order({with_images(node("roomy-without", 100, 0), {"node"}), node("full-ish", 100, 99)}, rng);
    EXPECT_EQ(names(any), (std::vector<std::string>{"roomy-without", "full-ish"}));
  }
}

fleet::NodeInfo with_resources(fleet::NodeInfo n, int64_t capacity_mb, int64_t reserved_mb,
                               int64_t capacity_millicpus = 0, int64_t reserved_millicpus = 0) {
  n.capacity_memory_mb = capacity_mb;
  n.reserved_memory_mb = reserved_mb;
  n.capacity_millicpus = capacity_millicpus;
  n.reserved_millicpus = reserved_millicpus;
  return n;
}

PlacementDemand sized(int64_t memory_mb, int64_t millicpus) {
  PlacementDemand d;
  d.memory_mb = memory_mb;
  d.millicpus = millicpus;
  return d;
}

// Room is counted in creates of the asked size: the fewest of free slots, unreserved memory and CPUs allow.
TEST(PlacementOrder, RoomIsTheFewestCreatesOfThisSizeThatSlotsMemoryAndCpusAllow) {
  const PlacementDemand small = sized(512, 1000);
  EXPECT_EQ(room_for(with_resources(node("n", 100, 0), 4096, 1024), small), 6);       // memory: 3072 / 512
  EXPECT_EQ(room_for(with_resources(node("n", 100, 0), 0, 0, 8000, 6500), small), 1); // cpus: 1.5 / 1
  EXPECT_EQ(room_for(with_resources(node("n", 4, 2), 4096, 0, 8000, 0), small), 2);  // slots
  EXPECT_EQ(room_for(with_resources(node("n", 0, 0), 4096, 4000), small), 0);
  // Nothing published (an older node), or a create asking nothing: no limit from that side.
  EXPECT_EQ(room_for(node("n", 0, 0), small), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(room_for(with_resources(node("n", 0, 0), 4096, 4000), PlacementDemand{}), std::numeric_limits<int64_t>::max());
  // A key that says more is reserved than there is, or a negative reservation, is no room / all room.
  EXPECT_EQ(room_for(with_resources(node("n", 0, 0), 1024, 2048), small), 0);
  EXPECT_EQ(room_for(with_resources(node("n", 0, 0), 1024, -5000), small), 2);
}

TEST(PlacementOrder, NodesWithoutMemoryOrCpusForTheCreateAreLeftOutAndTheRestGoByThem) {
  for (uint64_t seed = 0; seed < 50; ++seed) {
    std::mt19937_64 rng(seed);
    // The emptiest by sandbox count has the least memory left for a 2 GiB create.
    auto order = placement_order({with_resources(node("few-but-full", 100, 1), 4096, 3072),
                                  with_resources(node("busy-roomy", 100, 60), 65536, 8192),
                                  with_resources(node("half", 100, 10), 8192, 4096),
                                  with_resources(node("no-cpus", 100, 0), 0, 0, 4000, 3500)},
                                 rng, sized(2048, 1000));
    EXPECT_EQ(names(order), (std::vector<std::string>{"busy-roomy", "half"}));
  }
}

TEST(PlacementRefusal, ForWantOfRoomOrAvailabilityOrOfTheImage) {
  EXPECT_EQ(placement_refusal(503, "{}"), PlacementRefusal::kUnavailable);
  EXPECT_EQ(placement_refusal(429, ""), PlacementRefusal::kUnavailable);
  EXPECT_EQ(placement_refusal(404, R"({"error":"not_found","message":"image: no image 'py' on this node","missing":"image"})"),
            PlacementRefusal::kMissingImage);
  // Any other 404 (a snapshot, a path) is the request's own fault: passed on, not retried.
  EXPECT_EQ(placement_refusal(404, R"({"error":"not_found","message":"no such snapshot"})"), PlacementRefusal::kNone);
  EXPECT_EQ(placement_refusal(404, R"({"missing":7})"), PlacementRefusal::kNone);
  EXPECT_EQ(placement_refusal(404, "not json"), PlacementRefusal::kNone);
  for (int status : {201, 400, 401, 409, 500, 502, 504})
    EXPECT_EQ(placement_refusal(status, R"({"missing":"image"})"), PlacementRefusal::kNone) << status;
}

class CreatePlacerTest : public ::testing::Test {
 protected:
  using Remote = CreatePlacer::RemoteAnswer;
  // Each remote node's answer, by name; a node not listed is one that cannot be reached.
  void answer(const std::string& name, Remote a) {
    std::lock_guard lock(mu_);
    remote_[name] = std::move(a);
  }
  static Remote status(int code, const std::string& message = "") {
    Remote r;
    r.reached = r.ok = true;
    r.status = code;
    r.body = nlohmann::json{{"error", "x"}, {"message", message}}.dump();
    return r;
  }
  static std::string missing_image_body(const std::string& node) {
    return nlohmann::json{{"error", "not_found"},
                          {"message", "image: no image 'python' on " + node},
                          {"missing", "image"}}
        .dump();
  }
  static Remote missing_image(const std::string& node) {
    Remote r = status(404);
    r.body = missing_image_body(node);
    return r;
  }
  CreatePlacer placer() {
    return CreatePlacer(loop_.get(), PlacementOptions{"self", "", "", 1000},
                        [this](const fleet::NodeInfo& n, const std::string& body) {
                          std::lock_guard lock(mu_);
                          asked_.push_back(n.name);
                          bodies_.push_back(body);
                          auto it = remote_.find(n.name);
                          if (it != remote_.end()) return it->second;
                          Remote unreachable;
                          unreachable.error = "cannot reach sandgate-node at " + n.api;
                          return unreachable;
                        });
  }
  // Places with a local create that answers `local_status`, and waits for the answer.
  // `local_body` replaces the local answer's default body for its status.
  CreatePlacer::Answer place(CreatePlacer& p, std::vector<fleet::NodeInfo> order, int local_status = 201,
                             std::string local_body = "") {
    std::optional<CreatePlacer::Answer> out;
    if (local_body.empty())
      local_body = local_status == 201 ? R"({"id":"sb-1","node":"self"})"
                                       : R"({"error":"unavailable","message":"self is draining"})";
    p.place(R"({"name":"web","command":["sleep","1"]})", std::move(order),
            [this, local_status, local_body](CreatePlacer::Done done) {
              {
                std::lock_guard lock(mu_);
                asked_.push_back("self");
              }
              done({local_status, local_body, ""});
            },
            [&](CreatePlacer::Answer a) { out = std::move(a); });
    EXPECT_TRUE(loop_.run_until([&] { return out.has_value(); }));
    return out.value_or(CreatePlacer::Answer{});
  }

  TestLoop loop_;
  std::mutex mu_;
  std::map<std::string, Remote> remote_;
  std::vector<std::string> asked_;
  std::vector<std::string> bodies_;
};

TEST_F(CreatePlacerTest, ARefusalIsRetriedOnTheNextNode) {
  answer("n2", status(503, "fleet: node n2 is draining"));
  answer("n3", status(201));
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("n3", 0, 0), node("self", 0, 0)});
  EXPECT_EQ(a.status, 201);
  EXPECT_EQ(asked_, (std::vector<std::string>{"n2", "n3"}));
  EXPECT_EQ(bodies_[0], R"({"name":"web","command":["sleep","1"]})");  // the client's body as it came
}

TEST_F(CreatePlacerTest, ThisNodeIsAskedInItsTurnAndAnUnreachableNodeIsSkipped) {
  answer("n2", status(429, "at most 10 sandboxes"));
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("down", 0, 0), node("self", 0, 0)});
  EXPECT_EQ(a.status, 201);
  EXPECT_EQ(asked_, (std::vector<std::string>{"n2", "down", "self"}));
}

TEST_F(CreatePlacerTest, WhenEveryNodeRefusesTheAnswerNamesEachReason) {
  answer("n2", status(503, "fleet: node n2 is draining"));
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("self", 0, 0), node("down", 0, 0)}, 503);
  EXPECT_EQ(a.status, 503);
  EXPECT_EQ(a.extra_headers, "Retry-After: 2\r\n");
  const std::string message = nlohmann::json::parse(a.body).value("message", "");
  EXPECT_NE(message.find("no node admitted the create"), std::string::npos) << message;
  EXPECT_NE(message.find("n2: fleet: node n2 is draining"), std::string::npos) << message;
  EXPECT_NE(message.find("self: self is draining"), std::string::npos) << message;
  EXPECT_NE(message.find("down: cannot reach"), std::string::npos) << message;
}

TEST_F(CreatePlacerTest, ANodeWithoutTheImageIsPassedOverForTheNext) {
  answer("n2", missing_image("n2"));
  answer("n3", status(201));
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("n3", 0, 0), node("self", 0, 0)});
  EXPECT_EQ(a.status, 201);
  EXPECT_EQ(asked_, (std::vector<std::string>{"n2", "n3"}));
}

// No node has it: retrying later would not help, so the answer is a 404 naming each node, without Retry-After.
TEST_F(CreatePlacerTest, WhenNoNodeHasTheImageTheAnswerIsA404NamingEachNode) {
  answer("n2", missing_image("n2"));
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("self", 0, 0)}, 404, missing_image_body("self"));
  EXPECT_EQ(a.status, 404) << a.body;
  EXPECT_EQ(a.extra_headers, "");
  const std::string message = nlohmann::json::parse(a.body).value("message", "");
  EXPECT_NE(message.find("no node has the image"), std::string::npos) << message;
  EXPECT_NE(message.find("n2: image: no image 'python' on n2"), std::string::npos) << message;
  EXPECT_NE(message.find("self: image: no image 'python' on self"), std::string::npos) << message;
}

// Some node that may have had it was full or draining: the create may succeed later, so 503 + Retry-After.
TEST_F(CreatePlacerTest, AMissingImageBesideAFullNodeIsStillA503) {
  answer("n2", missing_image("n2"));
  answer("n3", status(429, "at most 10 sandboxes"));
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("n3", 0, 0), node("self", 0, 0)}, 404, missing_image_body("self"));
  EXPECT_EQ(a.status, 503) << a.body;
  EXPECT_EQ(a.extra_headers, "Retry-After: 2\r\n");
  EXPECT_EQ(asked_, (std::vector<std::string>{"n2", "n3", "self"}));
}

TEST_F(CreatePlacerTest, AnAnswerThatIsNotARefusalIsTheAnswer) {
  answer("n2", status(409, "name 'web' is already used in the fleet by a sandbox on node 'n9'"));
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("self", 0, 0)});
  EXPECT_EQ(a.status, 409);
  EXPECT_EQ(asked_, (std::vector<std::string>{"n2"}));
}

// A node that had the request may have created the sandbox: no second one elsewhere.
TEST_F(CreatePlacerTest, ANodeThatTookTheRequestButDidNotAnswerIsNotRetried) {
  Remote lost;
  lost.reached = true;
  lost.error = "sandgate-node at unix:/x did not answer within 1 s";
  answer("n2", lost);
  auto p = placer();
  auto a = place(p, {node("n2", 0, 0), node("self", 0, 0)});
  EXPECT_EQ(a.status, 502);
  EXPECT_NE(a.body.find("took the create but its answer did not come"), std::string::npos) << a.body;
  EXPECT_EQ(asked_, (std::vector<std::string>{"n2"}));
}

// A view that does not list this node yet (its key was just written) must not make a create fail.
TEST_F(CreatePlacerTest, ThisNodeMissingFromTheViewIsAskedLast) {
  auto p = placer();
  auto a = place(p, {node("down", 0, 0)});
  EXPECT_EQ(a.status, 201);
  EXPECT_EQ(asked_, (std::vector<std::string>{"down", "self"}));
}

TEST_F(CreatePlacerTest, NoCandidatesCreatesHere) {
  auto p = placer();
  auto a = place(p, {});
  EXPECT_EQ(a.status, 201);
  EXPECT_EQ(asked_, (std::vector<std::string>{"self"}));
}

}  // namespace
}  // namespace sg
