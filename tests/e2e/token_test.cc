// Rotating a sandbox's token with the CLI: the new token is printed and saved, the old one is refused at
// once, and a connection the old one opened (a transfer in progress) is closed with the cause
// `token_revoked`; a connection to a public port of the same sandbox stays.
#include <gtest/gtest.h>

#include <thread>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

TEST(TokenRotation, RefusesTheOldTokenAndClosesItsConnections) {
  Cluster c(ClusterOptions::proxy("activity_report_interval_ms = 200\n"));
  auto created = c.cli("create --json --name rot --expose 8080 --public 8081 -- /bin/sh -c " +
                       shell_quote("/usr/bin/python3 " + tool("testserver.py") +
                                   " http 8081 rot-public & exec /usr/bin/python3 " +
                                   tool("testserver.py") + " http 8080 rot"));
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;
  const std::string old_token = nlohmann::json::parse(created.out, nullptr, false).value("token", "");
  ASSERT_FALSE(old_token.empty());
  const std::string host = "8080-rot.sandbox.localhost", public_host = "8081-rot.sandbox.localhost";
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(c.curl(host, "/", bearer(old_token))) == 200; },
                         std::chrono::seconds(20)));
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(c.curl(public_host, "/")) == 200; },
                         std::chrono::seconds(20)));

  // Two streams that outlive the rotation: one authorized by the old token, one on the public port.
  CommandResult privileged, open_to_all;
  std::thread a([&] { privileged = c.curl(host, "/slow?secs=20&steps=200", bearer(old_token), 40); });
  std::thread b([&] { open_to_all = c.curl(public_host, "/slow?secs=3&steps=30", "", 40); });
  bool reported = eventually([&] { return c.get("rot").value("connections", 0) >= 2; }, std::chrono::seconds(10));

  auto rotated = c.cli("token rotate rot");
  a.join();
  b.join();
  ASSERT_TRUE(reported) << "the streams were never reported";
  ASSERT_EQ(rotated.exit_code, 0) << rotated.out << rotated.err;
  std::string new_token = rotated.out.substr(0, rotated.out.find('\n'));
  ASSERT_TRUE(new_token.starts_with("sgt_")) << rotated.out;
  EXPECT_NE(new_token, old_token);
  EXPECT_EQ(read_file(c.home() + "/.config/sandgate/tokens/rot"), new_token + "\n") << "the CLI saves the new token";

  auto cut = c.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "token_revoked"; });
  ASSERT_TRUE(cut.is_object()) << "no connection closed with cause token_revoked\n" << c.proxy().log();
  EXPECT_EQ(cut.value("port", 0), 8080);
  EXPECT_EQ(Cluster::body(privileged).find("tick 199"), std::string::npos) << "the old token's stream went on";
  EXPECT_NE(Cluster::body(open_to_all).find("tick 29"), std::string::npos) << "the public stream was cut";

  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(old_token))), 401);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(new_token))), 200);
  EXPECT_EQ(c.node().log().find(new_token), std::string::npos) << "a token reached the log";
}

}  // namespace
}  // namespace sg::e2e
