// Every request on a connection is checked, not only the first, and no credential of the edge reaches sandbox
// code (issue 9, items 1 and 2), through real clients: pipelined HTTP/1.1 over one TLS connection, an HTTP/2
// client that coalesces hosts on one connection as browsers do (tools/h2_client), curl. The backends record
// what they were given (testserver.py GET /seen, tools/h2_recorder) and the test reads it back.
#include <gtest/gtest.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

struct Created {
  std::string id;
  std::string token;
};

Created create(Cluster& c, const std::string& args) {
  auto r = c.cli("create --json " + args);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object() && j.contains("token")) << r.out;
  if (!j.is_object() || !j.contains("token")) return {};
  return {j["id"].get<std::string>(), j["token"].get<std::string>()};
}

std::string testserver(uint16_t port, const std::string& marker) {
  return "/usr/bin/python3 " + tool("testserver.py") + " http " + std::to_string(port) + " " + marker;
}

void wait_serving(Cluster& c, const std::string& host, const std::string& extra = "") {
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(c.curl(host, "/", extra)) == 200; }, std::chrono::seconds(20)))
      << host;
}

// Sends `requests` at once on one TLS connection to the ingress (SNI `sni`); everything until it closes.
CommandResult pipeline(Cluster& c, const std::string& sni, const std::string& requests) {
  const std::string file = c.dir() + "/pipelined-requests";
  write_file(file, requests);
  return run("/usr/bin/python3 " + source("tests/e2e/tools/tls_pipeline.py") + " 127.0.0.1 " +
                 std::to_string(c.port()) + " " + sni + " " + c.ca() + " " + file,
             60);
}

CommandResult h2_requests(Cluster& c, const std::string& sni, const std::vector<std::string>& requests) {
  std::string cmd = bin("tests/h2_client") + " 127.0.0.1 " + std::to_string(c.port()) + " " + sni + " " + c.ca();
  for (const std::string& r : requests) cmd += " " + shell_quote(r);
  return run(cmd, 60);
}

int status_of(const nlohmann::json& e) { return e.contains("status") && e["status"].is_number() ? e["status"].get<int>() : 0; }

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

TEST(EdgeRequests, Http1KeepAliveRequestForAnotherSandboxIs421AndNeverReachesTheFirst) {
  Cluster c;
  create(c, "--name alpha --public 8080 -- " + testserver(8080, "alpha"));
  Created victim = create(c, "--name victim --expose 8080 -- " + testserver(8080, "victim"));
  wait_serving(c, "8080-alpha.sandbox.localhost");
  wait_serving(c, "8080-victim.sandbox.localhost", bearer(victim.token));

  // Pipelined: one for alpha, one for the victim with the victim's cookie, one more for alpha.
  auto r = pipeline(c, "8080-alpha.sandbox.localhost",
                    "GET /?first=1 HTTP/1.1\r\nHost: 8080-alpha.sandbox.localhost\r\n\r\n"
                    "GET /victim-path HTTP/1.1\r\nHost: 8080-victim.sandbox.localhost\r\n"
                    "Cookie: __Host-sandgate_token=" + victim.token + "\r\n\r\n"
                    "GET /after HTTP/1.1\r\nHost: 8080-alpha.sandbox.localhost\r\n\r\n");
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  // The first is answered by alpha, the second by the edge, and the connection ends there.
  const size_t ok = r.out.find("HTTP/1.1 200");
  const size_t misdirected = r.out.find("HTTP/1.1 421 Misdirected Request");
  ASSERT_NE(ok, std::string::npos) << r.out;
  ASSERT_NE(misdirected, std::string::npos) << r.out;
  EXPECT_LT(ok, misdirected) << r.out;
  EXPECT_EQ(count(r.out, "HTTP/1.1 "), 2u) << r.out;

  auto seen = c.curl("8080-alpha.sandbox.localhost", "/seen");
  EXPECT_NE(seen.out.find("GET /?first=1"), std::string::npos) << seen.out;
  EXPECT_EQ(seen.out.find("victim"), std::string::npos) << seen.out;
  EXPECT_EQ(seen.out.find(victim.token), std::string::npos) << seen.out;
  EXPECT_EQ(seen.out.find("/after"), std::string::npos) << seen.out;
  auto entry = c.wait_access_entry([](const nlohmann::json& e) { return status_of(e) == 421; });
  EXPECT_EQ(entry.value("cause", ""), "misdirected") << entry.dump();
  EXPECT_NE(entry.value("detail", "").find("8080-victim.sandbox.localhost"), std::string::npos) << entry.dump();
}

// A request held behind an Upgrade is checked once the sandbox's answer says the protocol did not switch,
// however the answers arrive: here a download, a refused Upgrade and a request for another sandbox, at 30
// download sizes so that the refusal's bytes land at different points of the proxy's work on the connection.
// The 421 must come as soon as the sandbox's answers are through, never when a side gives up (the sandbox
// keeps its side open).
TEST(EdgeRequests, Http1RequestAfterARefusedUpgradeIsCheckedWhateverTheTimingOfTheRefusal) {
  Cluster c;
  create(c, "--name alpha --public 8080 -- " + testserver(8080, "alpha"));
  wait_serving(c, "8080-alpha.sandbox.localhost");
  for (int i = 0; i < 30; ++i) {
    const std::string size = std::to_string(200'000 + i * 37'301);
    auto r = pipeline(c, "8080-alpha.sandbox.localhost",
                      "GET /blob?size=" + size + " HTTP/1.1\r\nHost: 8080-alpha.sandbox.localhost\r\n\r\n"
                      "GET /refuse HTTP/1.1\r\nHost: 8080-alpha.sandbox.localhost\r\nConnection: Upgrade\r\n"
                      "Upgrade: websocket\r\n\r\n"
                      "GET / HTTP/1.1\r\nHost: 8080-other.sandbox.localhost\r\n\r\n");
    ASSERT_EQ(r.exit_code, 0) << "size " << size << ": " << r.out.substr(r.out.size() > 300 ? r.out.size() - 300 : 0) << r.err;
    const size_t ok = r.out.find("HTTP/1.1 200");
    const size_t refused = r.out.find("HTTP/1.1 404");
    const size_t misdirected = r.out.find("HTTP/1.1 421 Misdirected Request");
    ASSERT_NE(misdirected, std::string::npos) << "size " << size;
    EXPECT_LT(ok, refused);
    EXPECT_LT(refused, misdirected);
    EXPECT_NE(r.out.find("Content-Length: " + size + "\r\n"), std::string::npos);
  }
}

TEST(EdgeRequests, Http1LaterCrossOriginCookiePostIs403) {
  Cluster c;
  Created a = create(c, "--name alpha --expose 8080 -- " + testserver(8080, "alpha"));
  wait_serving(c, "8080-alpha.sandbox.localhost", bearer(a.token));
  const std::string cookie = "Cookie: __Host-sandgate_token=" + a.token + "\r\n";
  auto r = pipeline(c, "8080-alpha.sandbox.localhost",
                    "GET / HTTP/1.1\r\nHost: 8080-alpha.sandbox.localhost\r\n" + cookie + "\r\n"
                    "POST /hash HTTP/1.1\r\nHost: 8080-alpha.sandbox.localhost\r\n" + cookie +
                        "Origin: https://8080-evil.sandbox.localhost\r\nContent-Length: 0\r\n\r\n");
  EXPECT_NE(r.out.find("HTTP/1.1 200"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("HTTP/1.1 403"), std::string::npos) << r.out;
  auto seen = c.curl("8080-alpha.sandbox.localhost", "/seen", bearer(a.token));
  EXPECT_EQ(seen.out.find("POST /hash"), std::string::npos) << seen.out;
  c.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "cross_origin"; });
}

TEST(EdgeRequests, Http2StreamForAnotherSandboxIs421AndNeverReachesTheFirst) {
  Cluster c;
  create(c, "--name alpha --public 7000/h2c -- " + tool("h2_recorder") + " 7000");
  Created victim = create(c, "--name victim --expose 8080 -- " + testserver(8080, "victim"));
  wait_serving(c, "7000-alpha.sandbox.localhost", "--http2");
  wait_serving(c, "8080-victim.sandbox.localhost", bearer(victim.token));

  auto r = h2_requests(c, "7000-alpha.sandbox.localhost",
                       {"7000-alpha.sandbox.localhost|/one",
                        "8080-victim.sandbox.localhost|/victim-path|cookie: __Host-sandgate_token=" + victim.token,
                        "7000-alpha.sandbox.localhost|/three"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("--- stream 1 status 200"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--- stream 3 status 421"), std::string::npos) << r.out;
  // The connection goes on: stream 5 is alpha's again, and its answer lists what alpha's server decoded.
  const size_t third = r.out.find("--- stream 5 status 200");
  ASSERT_NE(third, std::string::npos) << r.out;
  const std::string seen = r.out.substr(third);
  EXPECT_NE(seen.find("stream 1 :path: /one"), std::string::npos) << seen;
  EXPECT_NE(seen.find("stream 5 :path: /three"), std::string::npos) << seen;
  EXPECT_EQ(seen.find("victim"), std::string::npos) << seen;
  EXPECT_EQ(seen.find(victim.token), std::string::npos) << seen;
  auto entry = c.wait_access_entry([](const nlohmann::json& e) { return status_of(e) == 421; });
  EXPECT_EQ(entry.value("cause", ""), "misdirected") << entry.dump();
  EXPECT_NE(entry.value("detail", "").find("h2 stream 3"), std::string::npos) << entry.dump();
}

// RFC 9113 §8.1.1: a malformed request is an error of its stream, the first one of a connection included. A
// trailing space in a field value (§8.2.1) gets a 400 curl reads, not a connection error.
TEST(EdgeRequests, Http2MalformedFirstRequestGetsAReadable400) {
  Cluster c;
  create(c, "--name alpha --public 7000/h2c -- " + tool("h2_recorder") + " 7000");
  const std::string host = "7000-alpha.sandbox.localhost";
  wait_serving(c, host, "--http2");

  auto r = c.curl(host, "/malformed-first", "--http2 -H 'Authorization: Bearer '");
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(Cluster::http_code(r), 400) << r.out << r.err;
  EXPECT_NE(Cluster::body(r).find("'authorization' starts or ends with whitespace"), std::string::npos) << r.out;
  auto entry = c.wait_access_entry([](const nlohmann::json& e) { return status_of(e) == 400; });
  ASSERT_TRUE(entry.is_object()) << "no access log line for the 400";
  EXPECT_EQ(entry.value("cause", ""), "bad_request") << entry.dump();
  EXPECT_NE(entry.value("detail", "").find("whitespace"), std::string::npos) << entry.dump();
  // The sandbox never saw it (the recorder answers with everything it decoded so far).
  auto seen = c.curl(host, "/after", "--http2");
  EXPECT_EQ(Cluster::http_code(seen), 200) << seen.out << seen.err;
  EXPECT_NE(seen.out.find(":path: /after"), std::string::npos) << seen.out;
  EXPECT_EQ(seen.out.find("/malformed-first"), std::string::npos) << seen.out;
}

// RFC 8441: WebSockets over HTTP/2 to a sandbox that enables extended CONNECT. The CONNECT reaches it with its
// :protocol and without the sandgate credential, as a later request and as the first one of a connection; to
// one that does not enable it, a later CONNECT gets 400 from the edge.
TEST(EdgeRequests, Http2ExtendedConnectReachesASandboxThatEnablesIt) {
  Cluster c;
  Created ws = create(c, "--name ws --expose 7000/h2c -- " + tool("h2_recorder") + " 7000 --extended-connect");
  const std::string host = "7000-ws.sandbox.localhost";
  wait_serving(c, host, "--http2 " + bearer(ws.token));
  const std::string auth = "|authorization: Bearer " + ws.token;
  const std::string websocket = "|:method: CONNECT|:protocol: websocket|sec-websocket-version: 13";

  // A page first: the client has the sandbox's SETTINGS (ENABLE_CONNECT_PROTOCOL) before it sends the CONNECT.
  auto r = h2_requests(c, host, {host + "|/page" + auth, host + "|/chat?room=1" + websocket + auth});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  const size_t answer = r.out.find("--- stream 3 status 200");
  ASSERT_NE(answer, std::string::npos) << r.out;
  std::string seen = r.out.substr(answer);
  EXPECT_NE(seen.find("stream 3 :method: CONNECT"), std::string::npos) << seen;
  EXPECT_NE(seen.find("stream 3 :protocol: websocket"), std::string::npos) << seen;
  EXPECT_NE(seen.find("stream 3 :path: /chat?room=1"), std::string::npos) << seen;
  EXPECT_NE(seen.find("stream 3 sec-websocket-version: 13"), std::string::npos) << seen;
  EXPECT_EQ(r.out.find(ws.token), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("authorization"), std::string::npos) << r.out;

  // As the first request: the proxy routes and authenticates it before the sandbox is reached, then lets the
  // sandbox judge it.
  auto first = h2_requests(c, host, {host + "|/chat-first" + websocket + auth});
  EXPECT_EQ(first.exit_code, 0) << first.out << first.err;
  ASSERT_NE(first.out.find("--- stream 1 status 200"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("stream 1 :path: /chat-first"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find("stream 1 :protocol: websocket"), std::string::npos) << first.out;
  EXPECT_EQ(first.out.find(ws.token), std::string::npos) << first.out;
  EXPECT_EQ(first.out.find("authorization"), std::string::npos) << first.out;

  // A sandbox whose SETTINGS do not enable it never gets an extended CONNECT: once those SETTINGS passed the
  // edge, the stream is answered 400 as malformed (RFC 8441 §3), and the connection serves the next one.
  Created plain = create(c, "--name wsno --expose 7000/h2c -- " + tool("h2_recorder") + " 7000");
  const std::string plain_host = "7000-wsno.sandbox.localhost";
  const std::string plain_auth = "|authorization: Bearer " + plain.token;
  wait_serving(c, plain_host, "--http2 " + bearer(plain.token));
  auto refused = h2_requests(c, plain_host,
                             {plain_host + "|/page" + plain_auth, plain_host + "|/chat" + websocket + plain_auth,
                              plain_host + "|/after" + plain_auth});
  EXPECT_NE(refused.out.find("--- stream 1 status 200"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("--- stream 3 status 400"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("--- stream 5 status 200"), std::string::npos) << refused.out;
  EXPECT_EQ(refused.out.find("stream 3 :method"), std::string::npos) << "the sandbox saw the CONNECT: " << refused.out;
}

TEST(EdgeRequests, NoCredentialReachesAPortBackend) {
  Cluster c;
  Created p = create(c, "--name priv --expose 8080 -- " + testserver(8080, "priv"));
  Created q = create(c, "--name pub --public 8080 -- " + testserver(8080, "pub"));
  Created h = create(c, "--name hh --expose 7000/h2c -- " + tool("h2_recorder") + " 7000");
  wait_serving(c, "8080-priv.sandbox.localhost", bearer(p.token));
  wait_serving(c, "8080-pub.sandbox.localhost");
  wait_serving(c, "7000-hh.sandbox.localhost", "--http2 " + bearer(h.token));

  // HTTP/1.1, private port: Bearer, then the cookie next to the application's own cookie and Authorization,
  // on one keep-alive connection (curl reuses it for the second URL).
  auto r = c.curl("8080-priv.sandbox.localhost", "/seen",
                  bearer(p.token) + " " + c.url("8080-priv.sandbox.localhost", "/seen") +
                      " -H 'Cookie: app=1; __Host-sandgate_token=" + p.token + "; other=2'");
  std::string seen = c.curl("8080-priv.sandbox.localhost", "/seen",
                            "-H 'Cookie: __Host-sandgate_token=" + p.token +
                                "; app=3' -H 'Authorization: Bearer the-apps-own'").out;
  EXPECT_EQ(seen.find(p.token), std::string::npos) << seen;
  EXPECT_NE(seen.find("Cookie: app=1; other=2"), std::string::npos) << seen;
  EXPECT_NE(seen.find("Cookie: app=3"), std::string::npos) << seen;
  EXPECT_NE(seen.find("Authorization: Bearer the-apps-own"), std::string::npos) << seen;
  EXPECT_EQ(count(seen, "Authorization"), 1u) << seen;

  // Public port: nothing is verified there, yet the sandbox's own token is recognised and removed, in a
  // header and in the query.
  seen = c.curl("8080-pub.sandbox.localhost", "/seen?x=1&sandgate_token=" + q.token, bearer(q.token)).out;
  EXPECT_EQ(seen.find(q.token), std::string::npos) << seen;
  EXPECT_NE(seen.find("GET /seen?x=1 HTTP/1.1"), std::string::npos) << seen;
  EXPECT_EQ(seen.find("Authorization"), std::string::npos) << seen;

  // HTTP/2 to an h2c port: the header block is re-encoded without the credentials.
  auto h2 = h2_requests(c, "7000-hh.sandbox.localhost",
                        {"7000-hh.sandbox.localhost|/a|authorization: Bearer " + h.token,
                         "7000-hh.sandbox.localhost|/b|authorization: Bearer " + h.token +
                             "|cookie: k=v; __Host-sandgate_token=" + h.token});
  EXPECT_EQ(h2.exit_code, 0) << h2.out << h2.err;
  EXPECT_NE(h2.out.find("--- stream 3 status 200"), std::string::npos) << h2.out;
  EXPECT_EQ(h2.out.find(h.token), std::string::npos) << h2.out;
  EXPECT_NE(h2.out.find("stream 3 cookie: k=v"), std::string::npos) << h2.out;
  EXPECT_EQ(h2.out.find("authorization"), std::string::npos) << h2.out;
}

TEST(EdgeRequests, NoCredentialReachesTheSdkRouteBackend) {
  // The agent's port served by the recording test server.
  Cluster c(ClusterOptions::node("agent_path = \"" + source("tests/e2e/tools/record_agent.sh") + "\""));
  Created s = create(c, "--name sdk -- /bin/sleep 600");
  // The SDK route offers h2 (the real agent speaks h2c); this stand-in speaks HTTP/1.1 only.
  wait_serving(c, "sdk.sandbox.localhost", "--http1.1 " + bearer(s.token));
  std::string seen = c.curl("sdk.sandbox.localhost", "/seen", "--http1.1 " + bearer(s.token)).out;
  EXPECT_NE(seen.find("GET /seen"), std::string::npos) << seen;
  EXPECT_EQ(seen.find(s.token), std::string::npos) << seen;
  EXPECT_EQ(seen.find("Authorization"), std::string::npos) << seen;
}

// Node API requests of one kind so far (the node logs each at debug level, which the harness sets).
size_t node_calls(Cluster& c, const std::string& path) { return count(c.node().log(), path); }

TEST(EdgeRequests, ANewConnectionToAKnownPortCostsOneNodeCall) {
  // The port policy cache is per worker; with the route cache the open is skipped too (route_cache_test.cc).
  Cluster c(ClusterOptions::proxy("workers = 1\nroute_cache = false\n"));
  Created a = create(c, "--name alpha --expose 8080 -- " + testserver(8080, "alpha"));
  wait_serving(c, "8080-alpha.sandbox.localhost", bearer(a.token));
  const size_t lookups = node_calls(c, "/v1/internal/lookup");
  const size_t opens = node_calls(c, "/v1/internal/open");
  EXPECT_GE(lookups, 1u) << "the first connection asks for the port's policy at its ClientHello";
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(Cluster::http_code(c.curl("8080-alpha.sandbox.localhost", "/", bearer(a.token))), 200);
  EXPECT_TRUE(eventually([&] { return node_calls(c, "/v1/internal/open") == opens + 3; }, std::chrono::seconds(5)))
      << node_calls(c, "/v1/internal/open") - opens;
  EXPECT_EQ(node_calls(c, "/v1/internal/lookup"), lookups) << "known port: no lookup at the handshake";
}

}  // namespace
}  // namespace sg::e2e
