// Edge authentication through the real ingress with curl: per-sandbox tokens (Bearer, cookie, one-time
// query parameter), public ports, the operator token on api.<domain>, and that a refused request neither
// reaches nor wakes the sandbox.
#include <gtest/gtest.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

const char* kOperatorToken = "op-e2e-4f1c9a7d2b";

struct Created {
  std::string id;
  std::string token;
};

Created create_private(Cluster& c, const std::string& name, uint16_t port) {
  auto r = c.cli("create --json --name " + name + " --expose " + std::to_string(port) + " -- /usr/bin/python3 " +
                 tool("testserver.py") + " http " + std::to_string(port) + " " + name);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object() && j.contains("token")) << r.out;
  if (!j.is_object() || !j.contains("token")) return {};
  return {j["id"].get<std::string>(), j["token"].get<std::string>()};
}

void wait_serving_with(Cluster& c, const std::string& host, const std::string& token) {
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(c.curl(host, "/", bearer(token))) == 200; },
                         std::chrono::seconds(20)));
}

TEST(Auth, PrivatePortNeedsTheSandboxToken) {
  Cluster c;
  Created a = create_private(c, "alpha", 8080);
  Created b = create_private(c, "beta", 8080);
  ASSERT_FALSE(a.token.empty());
  ASSERT_NE(a.token, b.token);
  wait_serving_with(c, "8080-alpha.sandbox.localhost", a.token);

  auto none = c.curl("8080-alpha.sandbox.localhost", "/", "-D -");
  EXPECT_EQ(Cluster::http_code(none), 401) << none.out;
  EXPECT_NE(none.out.find("WWW-Authenticate: Bearer realm=\"sandgate\""), std::string::npos) << none.out;
  EXPECT_EQ(Cluster::http_code(c.curl("8080-alpha.sandbox.localhost", "/", bearer("sgt_wrong"))), 401);
  // Another sandbox's token opens only that sandbox.
  EXPECT_EQ(Cluster::http_code(c.curl("8080-alpha.sandbox.localhost", "/", bearer(b.token))), 401);
  auto ok = c.curl("8080-alpha.sandbox.localhost", "/", bearer(a.token));
  EXPECT_EQ(Cluster::http_code(ok), 200);
  EXPECT_EQ(Cluster::body(ok), "hello from alpha");
  auto entry = c.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "unauthorized"; });
  EXPECT_EQ(entry.value("status", 0), 401);
}

// From an address that never opened the sandbox with its token: such a client's ClientHello does not start a
// wake either (node.prewake_window_secs; Prewake.* has the address that did).
TEST(Auth, RefusedRequestDoesNotWakeTheSandbox) {
  Cluster c;
  Created a = create_private(c, "sleepy", 8080);
  wait_serving_with(c, "8080-sleepy.sandbox.localhost", a.token);
  ASSERT_EQ(c.cli("suspend sleepy").exit_code, 0);
  ASSERT_EQ(c.get("sleepy")["state"], "suspended");
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(Cluster::http_code(c.curl("8080-sleepy.sandbox.localhost", "/", bearer("sgt_nope") + " --interface 127.0.0.2")),
              401);
  EXPECT_EQ(c.get("sleepy")["state"], "suspended");
  EXPECT_TRUE(c.cgroup_frozen(a.id));
  // The right token wakes it, with no error seen by the client.
  auto ok = c.curl("8080-sleepy.sandbox.localhost", "/", bearer(a.token));
  EXPECT_EQ(Cluster::http_code(ok), 200) << ok.out << ok.err;
  EXPECT_EQ(c.get("sleepy")["state"], "running");
}

TEST(Auth, QueryTokenBecomesAHostScopedCookieAndLeavesTheUrl) {
  Cluster c;
  Created a = create_private(c, "web", 8080);
  wait_serving_with(c, "8080-web.sandbox.localhost", a.token);
  auto r = c.curl("8080-web.sandbox.localhost", "/blob?size=3&sandgate_token=" + a.token + "&x=1", "-D -");
  ASSERT_EQ(Cluster::http_code(r), 302) << r.out;
  std::string expected_location = "Location: " + c.url("8080-web.sandbox.localhost", "/blob?size=3&x=1");
  EXPECT_NE(r.out.find(expected_location), std::string::npos) << r.out;
  auto cookie_at = r.out.find("Set-Cookie: __Host-sandgate_token=" + a.token + ";");
  ASSERT_NE(cookie_at, std::string::npos) << r.out;
  std::string cookie_line = r.out.substr(cookie_at, r.out.find('\n', cookie_at) - cookie_at);
  EXPECT_NE(cookie_line.find("HttpOnly"), std::string::npos);
  EXPECT_NE(cookie_line.find("Secure"), std::string::npos);
  EXPECT_EQ(cookie_line.find("Domain"), std::string::npos) << "the cookie must stay on this host";

  // A browser following the redirect with the cookie jar gets the page.
  std::string jar = c.dir() + "/cookies.txt";
  auto followed = c.curl("8080-web.sandbox.localhost", "/?sandgate_token=" + a.token,
                         "-L -c " + shell_quote(jar) + " -b " + shell_quote(jar));
  EXPECT_EQ(Cluster::http_code(followed), 200) << followed.out;
  EXPECT_EQ(Cluster::body(followed), "hello from web");
  // An invalid query token gets no cookie.
  auto bad = c.curl("8080-web.sandbox.localhost", "/?sandgate_token=sgt_bad", "-D -");
  EXPECT_EQ(Cluster::http_code(bad), 401);
  EXPECT_EQ(bad.out.find("Set-Cookie"), std::string::npos);
  // An expired (or otherwise stale) cookie is refused like no token.
  auto stale = c.curl("8080-web.sandbox.localhost", "/", "-H 'Cookie: __Host-sandgate_token=sgt_expired'");
  EXPECT_EQ(Cluster::http_code(stale), 401);
}

TEST(Auth, PublicPortsAndOpenSandboxesNeedNoToken) {
  Cluster c;
  auto r = c.cli("create --json --name pub --public 8080 -- /usr/bin/python3 " +
                 tool("testserver.py") + " http 8080 pub");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  c.wait_until_serving("pub", 8080);
  EXPECT_EQ(Cluster::body(c.curl("8080-pub.sandbox.localhost")), "hello from pub");
}

TEST(Auth, ApiNeedsTheOperatorToken) {
  Cluster c(ClusterOptions::with_operator_token(kOperatorToken));
  ASSERT_EQ(c.cli("create --name listed -- /bin/sleep 600").exit_code, 0);
  auto none = c.curl("api.sandbox.localhost", "/v1/sandboxes");
  EXPECT_EQ(Cluster::http_code(none), 401) << none.out;
  EXPECT_EQ(Cluster::http_code(c.curl("api.sandbox.localhost", "/v1/sandboxes", bearer("not-the-operator"))), 401);
  auto ok = c.curl("api.sandbox.localhost", "/v1/sandboxes", bearer(kOperatorToken));
  ASSERT_EQ(Cluster::http_code(ok), 200) << ok.out;
  EXPECT_NE(Cluster::body(ok).find("\"listed\""), std::string::npos) << ok.out;
  // The operator token opens every sandbox's private ports too.
  Created a = create_private(c, "opened", 8080);
  wait_serving_with(c, "8080-opened.sandbox.localhost", kOperatorToken);
}

TEST(Auth, HeaderFloodIsRefusedAndTheProxyKeepsServing) {
  Cluster c;
  Created a = create_private(c, "flood", 8080);
  wait_serving_with(c, "8080-flood.sandbox.localhost", a.token);
  std::string headers;
  for (int i = 0; i < 400; ++i) headers += " -H " + shell_quote("X-Flood-" + std::to_string(i) + ": " + std::string(100, 'x'));
  auto r = c.curl("8080-flood.sandbox.localhost", "/", bearer(a.token) + headers);
  EXPECT_EQ(Cluster::http_code(r), 431) << r.err;
  EXPECT_EQ(Cluster::http_code(c.curl("8080-flood.sandbox.localhost", "/", bearer(a.token))), 200);
}

// All sandboxes are one site to a browser: a page on 8080-evil.<domain> must not drive another sandbox's
// agent or change state with that sandbox's cookie. The agent wants application/json on /exec, which a
// cross-origin form or text/plain POST cannot send without a preflight.
TEST(Auth, CrossOriginRequestsAreRefusedAndExecWantsJson) {
  Cluster c;
  Created a = create_private(c, "victim", 8080);
  wait_serving_with(c, "8080-victim.sandbox.localhost", a.token);
  const std::string cookie = "-H " + shell_quote("Cookie: __Host-sandgate_token=" + a.token) + " ";
  const std::string body = "--data " + shell_quote(R"({"command":["sh","-c","echo ran"]})") + " ";
  const std::string json = "-H 'Content-Type: application/json' ";
  const std::string evil = "-H 'Origin: https://8080-evil.sandbox.localhost:" + std::to_string(c.port()) + "' ";

  // Cookie-authenticated exec from another sandbox's page: 403 at the edge, over HTTP/1.1 and h2.
  for (const std::string proto : {"--http1.1 ", "--http2 "}) {
    auto r = c.curl("victim.sandbox.localhost", "/exec", proto + cookie + json + evil + body);
    EXPECT_EQ(Cluster::http_code(r), 403) << r.out << r.err;
    EXPECT_EQ(r.out.find("ran"), std::string::npos) << r.out;
  }
  auto fetch_meta = c.curl("victim.sandbox.localhost", "/exec", cookie + json + "-H 'Sec-Fetch-Site: same-site' " + body);
  EXPECT_EQ(Cluster::http_code(fetch_meta), 403) << fetch_meta.out;
  // Even with the Bearer token the SDK route takes nothing from another origin.
  EXPECT_EQ(Cluster::http_code(c.curl("victim.sandbox.localhost", "/health", bearer(a.token) + " " + evil)), 403);
  // A state-changing request to an exposed port with the cookie, from elsewhere: 403; a GET stays allowed,
  // so links between sandboxes keep working.
  EXPECT_EQ(Cluster::http_code(c.curl("8080-victim.sandbox.localhost", "/hash", cookie + evil + "--data x")), 403);
  EXPECT_EQ(Cluster::http_code(c.curl("8080-victim.sandbox.localhost", "/", cookie + evil)), 200);
  auto entry = c.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "cross_origin"; });
  ASSERT_TRUE(entry.is_object());
  EXPECT_EQ(entry["status"], 403);

  // Same origin (or no Origin, as from curl or an SDK): exec runs, but only as JSON.
  auto ok = c.curl("victim.sandbox.localhost", "/exec", cookie + json + body);
  EXPECT_EQ(Cluster::http_code(ok), 200) << ok.out;
  EXPECT_NE(ok.out.find("ran"), std::string::npos) << ok.out;
  auto plain = c.curl("victim.sandbox.localhost", "/exec", bearer(a.token) + " -H 'Content-Type: text/plain' " + body);
  EXPECT_EQ(Cluster::http_code(plain), 415) << plain.out << plain.err;
}

}  // namespace
}  // namespace sg::e2e
