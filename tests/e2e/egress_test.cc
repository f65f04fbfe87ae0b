// Egress (docs/egress.md): what a sandbox's code can reach, asked from inside through /exec as a user's code
// would, against a fake internet: a network namespace this test makes (198.51.100.0/24), reached only through
// the host's routing and NAT. Nothing is sent anywhere else.
#include <gtest/gtest.h>
#include <unistd.h>

#include "tests/e2e/harness.h"
#include "tests/netns.h"

namespace sg::e2e {
namespace {

// Removes the node's bridge and table when the test ends, whatever happened.
struct EgressCleanup {
  std::string bridge;
  ~EgressCleanup() {
    (void)run_tool({"ip", "link", "del", bridge});
    (void)run_tool({"nft", "delete", "table", "inet", bridge});
  }
};

// "ok" when a TCP handshake to host:port completes within 2 s from inside the sandbox, "refused" otherwise.
std::string reach(Cluster& c, const std::string& name, const std::string& token, const std::string& host, int port) {
  Exec e = exec_in(c, name, token,
                   {"python3", "-c",
                    "import socket; s = socket.socket(); s.settimeout(2); "
                    "print('ok' if s.connect_ex(('" + host + "', " + std::to_string(port) + ")) == 0 else 'refused')"});
  if (e.code != 0) return "[exec failed] " + e.out;
  return e.out.substr(0, e.out.find('\n'));
}

TEST(Egress, NoInternetByDefaultAndTheListsHoldFromInside) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (network namespaces, nftables)";
  const std::string tag = "sge" + std::to_string(::getpid() % 100000);
  EgressCleanup cleanup{tag};
  testing::FakeInternet internet(tag);
  Status st = internet.start();
  ASSERT_TRUE(st) << st.message();
  Cluster c(ClusterOptions::node("egress_bridge = \"" + tag + "\"\negress_subnet = \"10.252.0.0/16\""));

  auto off = create_with_agent(c, "off", "-- /bin/sleep 3600");
  auto on = create_with_agent(c, "on", "--internet -- /bin/sleep 3600");
  auto deny = create_with_agent(c, "deny", "--internet --deny-out 198.51.100.2 -- /bin/sleep 3600");
  auto allow = create_with_agent(c, "allow", "--internet --allow-out 198.51.100.1/32:8080 -- /bin/sleep 3600");
  for (auto* box : {&off, &on, &deny, &allow}) ASSERT_TRUE(box->contains("token")) << box->dump();

  EXPECT_EQ(reach(c, "off", off["token"], "198.51.100.1", 8080), "refused");
  EXPECT_EQ(reach(c, "on", on["token"], "198.51.100.1", 8080), "ok");
  EXPECT_EQ(reach(c, "on", on["token"], "198.51.100.2", 9090), "ok");
  EXPECT_EQ(reach(c, "deny", deny["token"], "198.51.100.1", 8080), "ok");
  EXPECT_EQ(reach(c, "deny", deny["token"], "198.51.100.2", 8080), "refused");
  EXPECT_EQ(reach(c, "allow", allow["token"], "198.51.100.1", 8080), "ok");
  EXPECT_EQ(reach(c, "allow", allow["token"], "198.51.100.1", 9090), "refused");
  EXPECT_EQ(reach(c, "allow", allow["token"], "198.51.100.2", 8080), "refused");
  // The node's own gateway address is the host: not for sandboxes (the node API, the proxy, sshd ...).
  EXPECT_EQ(reach(c, "on", on["token"], "10.252.0.1", 22), "refused");

  auto shown = c.get("on");
  EXPECT_EQ(shown.value("allow_internet_access", false), true) << shown.dump();
  EXPECT_EQ(c.get("allow")["allow_out"], nlohmann::json::array({"198.51.100.1/32:8080"}));

  // Terminated: its chain is gone with it (three sandboxes with internet access before, two after).
  auto count_chains = [&] {
    auto table = run_tool({"nft", "list", "table", "inet", tag});
    if (!table) return -1;
    int n = 0;
    for (size_t at = 0; (at = table->find("chain sb", at)) != std::string::npos; ++at) ++n;
    return n;
  };
  EXPECT_EQ(count_chains(), 3);
  ASSERT_EQ(c.cli("rm on").exit_code, 0);
  EXPECT_EQ(count_chains(), 2);
}

TEST(Egress, BadListsAreRefusedWithTheEntry) {
  Cluster c(ClusterOptions::node_only());
  auto cli = c.cli("create --internet --deny-out example.com -- /bin/true");
  EXPECT_NE(cli.exit_code, 0);
  EXPECT_NE((cli.out + cli.err).find("--deny-out example.com"), std::string::npos) << cli.out << cli.err;
  auto api = c.cli("create --allow-out 192.0.2.0/24 -- /bin/true");
  EXPECT_NE(api.exit_code, 0);
  EXPECT_NE((api.out + api.err).find("allow_internet_access"), std::string::npos) << api.out << api.err;
}

}  // namespace
}  // namespace sg::e2e
