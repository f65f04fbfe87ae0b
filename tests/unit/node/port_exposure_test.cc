#include "noderuntime/port_exposure.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

SandboxSpec spec_with_8080() {
  SandboxSpec s;
  s.id = "sb-1";
  s.agent_port = 49983;
  s.exposed_ports = {8080};
  s.ports = {PortPolicy{8080, false, PortProtocol::kHttp1}};
  return s;
}

TEST(PortExposureTest, AnExposedPortIsRoutedWithItsPolicy) {
  auto out = with_port_exposed(spec_with_8080(), 3000, ExposeRequest{true, "h2c"}, 64);
  ASSERT_TRUE(out) << out.message();
  auto policy = port_policy(*out, 3000);
  ASSERT_TRUE(policy);
  EXPECT_TRUE(policy->is_public);
  EXPECT_EQ(policy->protocol, PortProtocol::kH2c);
  EXPECT_EQ(out->exposed_ports, (std::vector<uint16_t>{8080, 3000}));
  // The create's defaults when the body says nothing.
  auto plain = with_port_exposed(spec_with_8080(), 3000, ExposeRequest{}, 64);
  ASSERT_TRUE(plain);
  EXPECT_FALSE(port_policy(*plain, 3000)->is_public);
  EXPECT_EQ(port_policy(*plain, 3000)->protocol, PortProtocol::kHttp1);
}

TEST(PortExposureTest, ExposingAnExposedPortAgainReplacesItsPolicyOnly) {
  auto out = with_port_exposed(spec_with_8080(), 8080, ExposeRequest{true, "tcp"}, 1);
  ASSERT_TRUE(out) << out.message();  // not counted against the limit a second time
  EXPECT_EQ(out->exposed_ports, (std::vector<uint16_t>{8080}));
  ASSERT_EQ(out->ports.size(), 1u);
  EXPECT_TRUE(out->ports[0].is_public);
  EXPECT_EQ(out->ports[0].protocol, PortProtocol::kTcp);
}

TEST(PortExposureTest, BadPortsProtocolsAndTheLimitAreRefusedWithTheReason) {
  const SandboxSpec s = spec_with_8080();
  for (int64_t bad : {0, -1, 65536}) {
    auto r = with_port_exposed(s, bad, {}, 64);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error(), Error::kInvalidArgument);
    EXPECT_NE(r.message().find("1-65535"), std::string::npos) << r.message();
  }
  auto agent = with_port_exposed(s, 49983, {}, 64);
  ASSERT_FALSE(agent);
  EXPECT_NE(agent.message().find("agent"), std::string::npos);
  auto proto = with_port_exposed(s, 3000, ExposeRequest{std::nullopt, "quic"}, 64);
  ASSERT_FALSE(proto);
  EXPECT_NE(proto.message().find("'quic' is not one of http1, h2c, tcp"), std::string::npos) << proto.message();
  auto full = with_port_exposed(s, 3000, {}, 1);
  ASSERT_FALSE(full);
  EXPECT_EQ(full.error(), Error::kLimitExceeded);
}

// Ports the node reaches its own way: the agent's, its SSH server's (port 22 goes there with the token),
// and a QEMU guest's identity listener (which carries the sandbox's SSH keys). Exposing one, publicly above
// all, would open it without the edge's token.
TEST(PortExposureTest, TheAgentsTheSshServersAndTheIdentityListenersPortsAreRefused) {
  SandboxSpec process = spec_with_8080();
  process.driver = "process";
  SandboxSpec qemu = process;
  qemu.driver = "qemu";
  for (const SandboxSpec& spec : {process, qemu}) {
    EXPECT_NE(with_port_exposed(spec, 49983, ExposeRequest{true, "tcp"}, 64).message().find("agent's port"),
              std::string::npos);
    EXPECT_NE(with_port_exposed(spec, 49984, ExposeRequest{true, "tcp"}, 64).message().find("agent's SSH port"),
              std::string::npos);
  }
  auto identity = with_port_exposed(qemu, kQemuIdentityPort, ExposeRequest{true, "tcp"}, 64);
  ASSERT_FALSE(identity);
  EXPECT_EQ(identity.message(), "port 1021 is the guest's identity listener, the node's only");
  EXPECT_TRUE(with_port_exposed(process, kQemuIdentityPort, ExposeRequest{}, 64)) << "only a VM's is reserved";
}

TEST(PortExposureTest, AClosedPortIsNoLongerRoutedAndClosingItAgainIsNotFound) {
  auto closed = with_port_closed(spec_with_8080(), 8080);
  ASSERT_TRUE(closed) << closed.message();
  EXPECT_TRUE(closed->exposed_ports.empty());
  EXPECT_TRUE(closed->ports.empty());
  EXPECT_FALSE(port_policy(*closed, 8080));
  for (int64_t port : {8080, 0, 70000}) {
    auto again = with_port_closed(*closed, port);
    ASSERT_FALSE(again);
    EXPECT_EQ(again.error(), Error::kNotFound);
  }
}

}  // namespace
}  // namespace sg
