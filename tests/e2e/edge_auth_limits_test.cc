// Limits of edge authentication through the real ingress with curl: a request carrying more credential
// candidates than kMaxCredentialCandidates is refused before the node is asked, and the operator token is
// never turned into a cookie by ?sandgate_token=.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

const char* kOperatorToken = "op-e2e-limits-93b7e0";

size_t node_open_calls(Cluster& c) { return c.node_calls("/v1/internal/open"); }

// "status" is null for forwarded connections.
bool answered_400(const nlohmann::json& e) { return e.contains("status") && e["status"] == 400; }

std::string cookies(int n, const std::string& last = "") {
  std::string value;
  for (int i = 0; i < n; ++i) value += (i ? "; " : "") + std::string("__Host-sandgate_token=sgt_wrong") + std::to_string(i);
  if (!last.empty()) value += "; __Host-sandgate_token=" + last;
  return "-H " + shell_quote("Cookie: " + value);
}

TEST(EdgeAuthLimits, TooManyCredentialCandidatesIsABadRequest) {
  // Counts opens: without the route cache every connection makes one.
  Cluster c(ClusterOptions::proxy("route_cache = false\n"));
  const std::string token = c.create_private_serving("many");
  ASSERT_FALSE(token.empty());
  const std::string host = "8080-many.sandbox.localhost";

  // 100 token cookies: refused at once, without a node call per candidate (nor any).
  size_t before = node_open_calls(c);
  auto r = c.curl(host, "/", cookies(100));
  EXPECT_EQ(Cluster::http_code(r), 400) << r.out;
  EXPECT_NE(Cluster::body(r).find("too many sandgate credentials (100): send at most 4"), std::string::npos) << r.out;
  EXPECT_LE(node_open_calls(c) - before, 1u);
  auto entry = c.wait_access_entry(answered_400);
  EXPECT_EQ(entry.value("cause", ""), "bad_request") << entry.dump();

  // The boundary: 4 candidates (3 wrong cookies, then the right one) all go in one open; 5 are refused.
  before = node_open_calls(c);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", cookies(3, token))), 200);
  // One open settles all four: the count this test relies on does see node calls.
  EXPECT_TRUE(eventually([&] { return node_open_calls(c) - before == 1; }, std::chrono::seconds(5)))
      << node_open_calls(c) - before;
  before = node_open_calls(c);
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", cookies(4, token))), 400);
  EXPECT_EQ(node_open_calls(c), before);
}

TEST(EdgeAuthLimits, OperatorTokenNeverBecomesACookie) {
  ClusterOptions o;
  o.operator_token = kOperatorToken;
  Cluster c(o);
  const std::string token = c.create_private_serving("opq");
  ASSERT_FALSE(token.empty());
  const std::string host = "8080-opq.sandbox.localhost";

  size_t before = node_open_calls(c);
  auto r = c.curl(host, std::string("/page?sandgate_token=") + kOperatorToken, "-D -");
  EXPECT_EQ(Cluster::http_code(r), 400) << r.out;
  EXPECT_EQ(r.out.find("Set-Cookie"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("Location"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("use this sandbox's own token"), std::string::npos) << r.out;
  // Refused before the node is asked: nothing is woken for it.
  EXPECT_EQ(node_open_calls(c), before);
  auto entry = c.wait_access_entry(answered_400);
  EXPECT_EQ(entry.value("cause", ""), "bad_request") << entry.dump();

  // The sandbox's own token still becomes its cookie, and the operator token still works as a header.
  auto own = c.curl(host, "/page?sandgate_token=" + token, "-D -");
  EXPECT_EQ(Cluster::http_code(own), 302) << own.out;
  EXPECT_NE(own.out.find("Set-Cookie: __Host-sandgate_token=" + token + ";"), std::string::npos) << own.out;
  EXPECT_EQ(Cluster::http_code(c.curl(host, "/", bearer(kOperatorToken))), 200);
}

}  // namespace
}  // namespace sg::e2e
