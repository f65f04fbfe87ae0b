// The sandgate CLI reaching the node API through the real ingress (https://api.<domain>, operator token),
// with the certificate checked against the test CA and *.localhost dialed as loopback by the CLI itself.
#include <gtest/gtest.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

const char* kOperatorToken = "op-cli-e2e-8d3b6e1f";

// "sandgate --api https://api.sandbox.localhost:<port> --cacert <ca> --token <token> <args>".
CommandResult via_ingress(Cluster& c, const std::string& token, const std::string& args) {
  return run(c.sandgate() + " --api https://api.sandbox.localhost:" + std::to_string(c.port()) + " --cacert " +
             shell_quote(c.ca()) + " --token " + shell_quote(token) + " " + args);
}

TEST(CliIngress, EveryCommandWorksThroughTheIngress) {
  Cluster c(ClusterOptions::with_operator_token(kOperatorToken));
  auto created = via_ingress(c, kOperatorToken, "create --name x -- /bin/sleep 600");
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;
  EXPECT_NE(created.out.find("x"), std::string::npos) << created.out;

  auto ls = via_ingress(c, kOperatorToken, "ls");
  ASSERT_EQ(ls.exit_code, 0) << ls.out << ls.err;
  EXPECT_NE(ls.out.find(" x "), std::string::npos) << ls.out;

  auto got = via_ingress(c, kOperatorToken, "get x --json");
  ASSERT_EQ(got.exit_code, 0) << got.out << got.err;
  auto j = nlohmann::json::parse(got.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << got.out;
  EXPECT_EQ(j.value("name", ""), "x");
  EXPECT_EQ(j.value("state", ""), "running");

  auto suspended = via_ingress(c, kOperatorToken, "suspend x");
  EXPECT_EQ(suspended.exit_code, 0) << suspended.out << suspended.err;
  auto resumed = via_ingress(c, kOperatorToken, "resume x");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;

  auto rm = via_ingress(c, kOperatorToken, "rm x");
  ASSERT_EQ(rm.exit_code, 0) << rm.out << rm.err;
  auto gone = via_ingress(c, kOperatorToken, "get x");
  EXPECT_EQ(gone.exit_code, 1) << gone.out << gone.err;
}

TEST(CliIngress, WrongTokenIsRefusedWithAClearMessage) {
  Cluster c(ClusterOptions::with_operator_token(kOperatorToken));
  auto r = via_ingress(c, "op-wrong", "ls");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("401"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--token"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST(CliIngress, ConnectToAndEnvironment) {
  Cluster c(ClusterOptions::with_operator_token(kOperatorToken));
  // The URL names a host that does not resolve; SANDGATE_INGRESS says where to dial, the URL's host is what the
  // certificate must carry.
  auto r = run("SANDGATE_API=https://api.sandbox.localhost:1 SANDGATE_TOKEN=" + shell_quote(kOperatorToken) +
               " SANDGATE_CACERT=" + shell_quote(c.ca()) + " SANDGATE_INGRESS=127.0.0.1:" + std::to_string(c.port()) +
               " " + c.sandgate() + " ls --json");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(nlohmann::json::parse(r.out, nullptr, false).contains("sandboxes")) << r.out;
}

TEST(CliIngress, UntrustedCertificateSaysWhichCaToPass) {
  Cluster c(ClusterOptions::with_operator_token(kOperatorToken));
  auto r = run(c.sandgate() + " --api https://api.sandbox.localhost:" + std::to_string(c.port()) + " --token " +
               shell_quote(kOperatorToken) + " ls");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("not trusted"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("pass the CA that signed it with --cacert or SANDGATE_CACERT"), std::string::npos) << r.err;
}

TEST(CliIngress, MissingOperatorTokenSaysHowToPassIt) {
  Cluster c(ClusterOptions::with_operator_token(kOperatorToken));
  auto r = run(c.sandgate() + " --api https://api.sandbox.localhost:" + std::to_string(c.port()) + " --cacert " +
               shell_quote(c.ca()) + " ls");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("wants the operator token (HTTP 401 Unauthorized) and none was given: pass it with --token "
                       "or SANDGATE_TOKEN"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace sg::e2e
