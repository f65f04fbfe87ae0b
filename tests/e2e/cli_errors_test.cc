// The errors a new user meets, from the real CLI against a real node: each names the cause and the next step.
// (The certificate and operator-token ones are in cli_ingress_test.cc; the ones that need a server to
// misbehave are unit tests with fakes, tests/unit/cli.)
#include <gtest/gtest.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

TEST(CliErrors, NodeNotRunningSaysStartItOrSetTheApi) {
  Cluster c(ClusterOptions::node_only());
  c.stop_node();
  auto r = c.cli("ls");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("cannot reach sandgate-node at " + c.api() + ": "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Is sandgate-node running? Start it (deploy/quickstart.sh, or systemctl start "
                       "sandgate-node), or point SANDGATE_API (or --api) at the address it serves"),
            std::string::npos)
      << r.err;
}

TEST(CliErrors, NameTakenSaysChooseAnotherOrRemoveIt) {
  Cluster c(ClusterOptions::node_only());
  ASSERT_EQ(c.cli("create --name taken -- /bin/sleep 600").exit_code, 0);
  const std::string token = read_file(c.home() + "/.config/sandgate/tokens/taken");
  auto r = c.cli("create --name taken -- /bin/sleep 600");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("name 'taken' is already used by sb-"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(": choose another --name, or remove the existing sandbox first with `sandgate rm taken`"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(read_file(c.home() + "/.config/sandgate/tokens/taken"), token) << "the first sandbox's token is kept";
}

TEST(CliErrors, UnknownSandboxPointsAtLs) {
  Cluster c(ClusterOptions::node_only());
  auto r = c.cli("get nothere");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "sandgate: no sandbox 'nothere': `sandgate ls` lists the sandboxes on " + c.api() +
                       " (is that the node you meant?)\n");
}

TEST(CliErrors, FailedSandboxSaysWhyAndToRecreateIt) {
  Cluster c(ClusterOptions::node_only());
  // Its command ends on its own a moment after it started: the sandbox fails.
  auto created = c.cli("create --name brief -- /bin/sh -c 'sleep 0.5; exit 3'");
  ASSERT_EQ(created.exit_code, 0) << created.err;
  ASSERT_TRUE(eventually([&] { return c.get("brief").value("state", "") == "failed"; }, std::chrono::seconds(15)));
  for (auto [command, attempted] : {std::pair{"resume", "resumed"}, std::pair{"suspend", "suspended"}}) {
    auto r = c.cli(std::string(command) + " brief");
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find(std::string("sandgate: sandbox brief has failed (")), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(std::string("), so it cannot be ") + attempted +
                         ". A failed sandbox does not run again: remove it with `sandgate rm brief` and create it "
                         "anew"),
              std::string::npos)
        << r.err;
  }
  // Which is what works.
  EXPECT_EQ(c.cli("rm brief").exit_code, 0);
  EXPECT_EQ(c.cli("create --name brief -- /bin/sleep 600").exit_code, 0);
}

// Through the ingress, ssh-proxy with a ProxyCommand whose ingress is not there: start it or point elsewhere.
TEST(CliErrors, SshProxyToAnIngressThatIsNotRunning) {
  Cluster c;
  ASSERT_EQ(c.cli("create --name box --expose 22/tcp -- /bin/sleep 600").exit_code, 0);
  const uint16_t port = c.port();
  c.stop_proxy();
  auto r = run("true | " + c.sandgate() + " ssh-proxy --ingress 127.0.0.1:" + std::to_string(port) + " --cacert " +
               shell_quote(c.ca()) + " box");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("Connection refused). Is it running and listening there? If it listens elsewhere, pass "
                       "--ingress HOST:PORT or set SANDGATE_INGRESS (this address came from --ingress)"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace sg::e2e
