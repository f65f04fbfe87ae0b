#include "proxy/fleet_hop.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace sg::fleet {
namespace {

// A directory the test fills in: what the etcd view would hold.
class FakeDirectory final : public Directory {
 public:
  std::map<std::string, std::string, std::less<>> owners;
  std::map<std::string, NodeInfo, std::less<>> infos;
  std::map<std::string, std::vector<PortRoute>, std::less<>> ports;
  void add_node(const std::string& name, const std::string& ingress) {
    NodeInfo info;
    info.name = name;
    info.ingress = ingress;
    infos[name] = info;
  }

  std::optional<SandboxOwner> owner_of(std::string_view sandbox) const override {
    auto it = owners.find(sandbox);
    if (it == owners.end()) return std::nullopt;
    auto p = ports.find(sandbox);
    return SandboxOwner{it->second, node(it->second),
                        p == ports.end() ? nullptr : std::make_shared<const std::vector<PortRoute>>(p->second)};
  }
  std::optional<NodeInfo> node(std::string_view name) const override {
    auto it = infos.find(name);
    if (it == infos.end()) return std::nullopt;
    return it->second;
  }
  std::vector<NodeInfo> nodes() const override { return {}; }
  bool current() const override { return true; }
};

TEST(FleetDecide, FleetOffRoutesLocally) {
  EXPECT_EQ(decide(nullptr, "a", "web").kind, Decision::Kind::kLocal);
}

TEST(FleetDecide, OwnedHereOrUnknownRoutesLocally) {
  FakeDirectory d;
  d.add_node("a", "127.0.0.1:1");
  d.owners["mine"] = "a";
  EXPECT_EQ(decide(&d, "a", "mine").kind, Decision::Kind::kLocal);
  // Unknown to the fleet: the local node answers (404 when it has none either), as without a fleet.
  EXPECT_EQ(decide(&d, "a", "nobody").kind, Decision::Kind::kLocal);
}

TEST(FleetDecide, AnotherNodesSandboxHopsThere) {
  FakeDirectory d;
  d.add_node("b", "127.0.0.1:7443");
  d.owners["web"] = "b";
  Decision r = decide(&d, "a", "web");
  ASSERT_EQ(r.kind, Decision::Kind::kRemote);
  EXPECT_EQ(r.owner, "b");
  ASSERT_TRUE(r.node);
  EXPECT_EQ(r.node->ingress, "127.0.0.1:7443");
  EXPECT_FALSE(r.ports);
  // The owner's published ports come along: the first proxy picks ALPN and the raw-TCP mode by them.
  d.ports["web"] = {PortRoute{22, "tcp", true}, PortRoute{7000, "h2c", false}};
  auto with_ports = decide(&d, "a", "web");
  ASSERT_TRUE(with_ports.ports);
  EXPECT_EQ(*with_ports.ports, d.ports["web"]);
}

TEST(FleetDecide, OwnerWithoutRegistrationIsGoneNotUnknown) {
  FakeDirectory d;
  d.owners["web"] = "b";  // b's lease expired: no node key
  Decision r = decide(&d, "a", "web");
  EXPECT_EQ(r.kind, Decision::Kind::kOwnerGone);
  EXPECT_EQ(r.owner, "b");
  // Registered without a fleet ingress: it cannot be hopped to either.
  d.add_node("b", "");
  EXPECT_EQ(decide(&d, "a", "web").kind, Decision::Kind::kOwnerGone);
}

TEST(FleetPreamble, RoundTrips) {
  Preamble p{"8080-web.sandbox.localhost", HopProtocol::kHttp2, "[::1]:50123"};
  std::string wire = encode_preamble(p) + "PRI * HTTP/2.0\r\n";
  size_t consumed = 0;
  auto r = parse_preamble(wire, &consumed);
  ASSERT_TRUE(r) << r.message();
  ASSERT_TRUE(*r);
  EXPECT_EQ((*r)->host, p.host);
  EXPECT_EQ((*r)->protocol, HopProtocol::kHttp2);
  EXPECT_EQ((*r)->client, p.client);
  EXPECT_EQ(wire.substr(consumed), "PRI * HTTP/2.0\r\n");
  for (HopProtocol protocol : {HopProtocol::kHttp1, HopProtocol::kTcp}) {
    auto again = parse_preamble(encode_preamble({"22-box.sandbox.localhost", protocol, "1.2.3.4:5"}), &consumed);
    ASSERT_TRUE(again && *again);
    EXPECT_EQ((*again)->protocol, protocol);
  }
  EXPECT_EQ(encode_preamble({"22-box.sandbox.localhost", HopProtocol::kTcp, "1.2.3.4:5"}),
            "SANDGATE-HOP/1 22-box.sandbox.localhost tcp 1.2.3.4:5\r\n");
}

TEST(FleetPreamble, IncompleteNeedsMore) {
  std::string wire = encode_preamble({"web.sandbox.localhost", HopProtocol::kHttp1, "127.0.0.1:1"});
  size_t consumed = 0;
  for (size_t n = 0; n < wire.size(); ++n) {
    auto r = parse_preamble(std::string_view(wire).substr(0, n), &consumed);
    ASSERT_TRUE(r) << n;
    EXPECT_FALSE(*r) << n;
  }
}

TEST(FleetPreamble, LongerThanTheLimitIsRefused) {
  // No line end within kMaxPreambleBytes: refused without waiting for more.
  std::string wire = "SANDGATE-HOP/1 " + std::string(kMaxPreambleBytes, 'a');
  size_t consumed = 0;
  auto r = parse_preamble(wire, &consumed);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kLimitExceeded);
  // A line exactly at the limit passes the length check (and is then judged on its fields).
  std::string at_limit = "SANDGATE-HOP/1 h h1 1.2.3.4:5 ";
  at_limit += std::string(kMaxPreambleBytes - at_limit.size() - 2, 'x') + "\r\n";
  ASSERT_EQ(at_limit.size(), kMaxPreambleBytes);
  auto r2 = parse_preamble(at_limit, &consumed);
  ASSERT_FALSE(r2);
  EXPECT_EQ(r2.error(), Error::kInvalidArgument);  // five fields
  std::string over = at_limit.substr(0, at_limit.size() - 2) + "y\r\n";
  EXPECT_EQ(parse_preamble(over, &consumed).error(), Error::kLimitExceeded);
}

TEST(FleetPreamble, BadFieldsAreRefused) {
  size_t consumed = 0;
  for (std::string bad : std::vector<std::string>{"GET / HTTP/1.1\r\n", "SANDGATE-HOP/2 web.x h1 1.2.3.4:5\r\n",
                          "SANDGATE-HOP/1 web.x h3 1.2.3.4:5\r\n", "SANDGATE-HOP/1 Web.X h1 1.2.3.4:5\r\n",
                          "SANDGATE-HOP/1 web/x h1 1.2.3.4:5\r\n", "SANDGATE-HOP/1 web.x h1 1.2.3.4:5 extra\r\n",
                          "SANDGATE-HOP/1 web.x h1\r\n", "SANDGATE-HOP/1  web.x h1 1.2.3.4:5\r\n",
                          "SANDGATE-HOP/1 web.x h1 evil\"addr\r\n", "SANDGATE-HOP/1 web.x h1 " + std::string(65, '1') + "\r\n",
                          "SANDGATE-HOP/1 " + std::string(254, 'a') + " h1 1.2.3.4:5\r\n"}) {
    auto r = parse_preamble(bad, &consumed);
    EXPECT_FALSE(r) << bad;
  }
}

TEST(FleetAnswer, RoundTripsAndRefusesJunk) {
  size_t consumed = 0;
  for (Answer a : {Answer{Answer::Kind::kOk, ""}, Answer{Answer::Kind::kRedirect, "node-2"},
                   Answer{Answer::Kind::kGone, "n3"}}) {
    auto r = parse_answer(encode_answer(a), &consumed);
    ASSERT_TRUE(r && *r) << encode_answer(a);
    EXPECT_EQ((*r)->kind, a.kind);
    EXPECT_EQ((*r)->node, a.node);
  }
  EXPECT_FALSE(*parse_answer("SANDGATE-HOP/1 o", &consumed));
  for (std::string bad : std::vector<std::string>{"HTTP/1.1 200 OK\r\n", "SANDGATE-HOP/1 redirect\r\n", "SANDGATE-HOP/1 redirect Bad_Node\r\n",
                          "SANDGATE-HOP/1 ok extra\r\n", "SANDGATE-HOP/1 maybe n\r\n"})
    EXPECT_FALSE(parse_answer(bad, &consumed)) << bad;
  EXPECT_EQ(parse_answer(std::string(kMaxAnswerBytes, 'x'), &consumed).error(), Error::kLimitExceeded);
}

TEST(FleetNodeName, IsADnsLabel) {
  EXPECT_TRUE(valid_node_name("node-1"));
  EXPECT_FALSE(valid_node_name(""));
  EXPECT_FALSE(valid_node_name("-a"));
  EXPECT_FALSE(valid_node_name("a-"));
  EXPECT_FALSE(valid_node_name("A"));
  EXPECT_FALSE(valid_node_name("a.b"));
  EXPECT_FALSE(valid_node_name(std::string(64, 'a')));
  EXPECT_TRUE(valid_node_name(std::string(63, 'a')));
}

TEST(FleetRedirect, FollowedOnceAndOnlyBeforeAnyByteWentUpstream) {
  EXPECT_EQ(on_redirect(0, false, "c", "a"), RedirectAction::kRetryRemote);
  EXPECT_EQ(on_redirect(0, false, "a", "a"), RedirectAction::kRetryLocal);
  // Once bytes went to a hop, the request may have been acted on: it is not repeated elsewhere.
  EXPECT_EQ(on_redirect(0, true, "c", "a"), RedirectAction::kRefuse);
  EXPECT_EQ(on_redirect(0, true, "a", "a"), RedirectAction::kRefuse);
  // A second redirect means the views disagree: no ping-pong between nodes.
  EXPECT_EQ(on_redirect(kMaxRedirects, false, "c", "a"), RedirectAction::kRefuse);
  EXPECT_EQ(on_redirect(kMaxRedirects, false, "a", "a"), RedirectAction::kRefuse);
}

}  // namespace
}  // namespace sg::fleet
