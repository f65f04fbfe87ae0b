// The node's own edge, with real clients: allow_unauthenticated_access never publishes the agent (the SDK
// route through the real proxy), the TCP API (node.api_listen) wants the operator token, its own Host and no
// Origin, SIGHUP rotates the operator token, and an operator token file others can read stops the node.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

const char* kOperatorToken = "op-e2e-node-5b2c8e1f07";

ClusterOptions with_tcp_api() {
  ClusterOptions o = ClusterOptions::with_operator_token(kOperatorToken);
  o.node_extra = "api_listen = \"127.0.0.1:0\"\n";
  o.start_proxy = false;
  return o;
}

// "host:port" of the node's TCP API, from its "node API listening on 127.0.0.1:PORT" line.
std::string tcp_api_address(Cluster& c) {
  std::string line = c.node().wait_for("node API listening on 127.0.0.1:", 5000);
  auto at = line.find("127.0.0.1:");
  if (at == std::string::npos) return "";
  std::string addr = line.substr(at);
  while (!addr.empty() && (addr.back() == '\n' || addr.back() == '\r' || addr.back() == ' ')) addr.pop_back();
  return addr;
}

// curl against the TCP API; the output ends in "\n<http_code>" like Cluster::curl's.
CommandResult tcp_curl(const std::string& addr, const std::string& path, const std::string& extra = "") {
  return run("curl -sS -w '\\n%{http_code}' " + extra + " " + shell_quote("http://" + addr + path), 30);
}

std::string token_path(Cluster& c) { return c.dir() + "/operator.token"; }

// Replaces the token file the way an operator should: a new owner-only file renamed over the old one.
void rotate_token(Cluster& c, const std::string& token, mode_t mode = 0600) {
  std::string tmp = token_path(c) + ".new";
  write_file(tmp, token + "\n");
  ASSERT_EQ(::chmod(tmp.c_str(), mode), 0);
  ASSERT_EQ(::rename(tmp.c_str(), token_path(c).c_str()), 0);
}

// SIGHUP, then waits for the node to report how the reload went; returns that line.
std::string reload_node(Cluster& c) {
  size_t from = c.node().log().size();
  ::kill(c.node().pid(), SIGHUP);
  return c.node().wait_for("reload", 10000, from);
}

TEST(NodeSecurity, UnauthenticatedAccessPublishesExposedPortsButNeverTheAgent) {
  Cluster c;
  // Inside the sandbox; what it writes lands in its overlay's upper dir, where the test looks for it.
  const std::string marker = "/tmp/exec-ran";
  nlohmann::json create = {
      {"name", "open"},
      {"command", {"/usr/bin/python3", tool("testserver.py"), "http", "8080", "open"}},
      {"exposed_ports", {8080}},
      {"allow_unauthenticated_access", true}};
  std::string socket = c.api().substr(5);  // "unix:/path"
  auto r = run("curl -sS --unix-socket " + shell_quote(socket) +
               " -X POST -H 'Content-Type: application/json' --data " + shell_quote(create.dump()) +
               " http://localhost/v1/sandboxes");
  auto created = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(created.is_object() && created.contains("token")) << r.out << r.err;
  EXPECT_EQ(created["ports"][0]["public"], true) << r.out;
  const std::string token = created["token"];
  const std::string written = c.dir() + "/node/sandboxes/" + created["id"].get<std::string>() + "/upper" + marker;

  // The exposed port is public: no token needed.
  c.wait_until_serving("open", 8080);
  EXPECT_EQ(Cluster::body(c.curl("8080-open.sandbox.localhost")), "hello from open");
  // The agent is up (so a 401 below is the edge's answer, not a missing agent) ...
  ASSERT_TRUE(eventually(
      [&] { return Cluster::http_code(c.curl("open.sandbox.localhost", "/health", bearer(token))) == 200; },
      std::chrono::seconds(20)));
  // ... and still needs the token on every route, over HTTP/1.1 and HTTP/2.
  std::string exec_body = nlohmann::json{{"command", {"touch", marker}}}.dump();
  std::string exec_args = "-X POST -H 'Content-Type: application/json' --data " + shell_quote(exec_body);
  auto none = c.curl("open.sandbox.localhost", "/exec", "--http1.1 " + exec_args + " -D -");
  EXPECT_EQ(Cluster::http_code(none), 401) << none.out << none.err;
  EXPECT_NE(none.out.find("WWW-Authenticate: Bearer"), std::string::npos) << none.out;
  auto none_h2 =
      c.curl("open.sandbox.localhost", "/exec", "--http2 " + exec_args + " -w '\\n%{http_code} %{http_version}'");
  EXPECT_NE(none_h2.out.find("\n401 2"), std::string::npos) << none_h2.out;
  EXPECT_EQ(Cluster::http_code(c.curl("open.sandbox.localhost", "/files?path=/etc/hostname")), 401);
  EXPECT_EQ(Cluster::http_code(c.curl("open.sandbox.localhost", "/health")), 401);
  EXPECT_EQ(Cluster::http_code(c.curl("open.sandbox.localhost", "/exec", exec_args + " " + bearer("sgt_wrong"))), 401);
  EXPECT_FALSE(std::filesystem::exists(written)) << "a refused exec ran";
  // The sandbox's token opens the agent: the same exec runs.
  auto ok = c.curl("open.sandbox.localhost", "/exec", exec_args + " " + bearer(token));
  EXPECT_EQ(Cluster::http_code(ok), 200) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("\"type\":\"exit\""), std::string::npos) << ok.out;
  EXPECT_TRUE(std::filesystem::exists(written)) << ok.out;
  // The node logs at debug level here; the sandbox's token is in create's answer and nowhere else.
  EXPECT_EQ(c.node().log().find(token), std::string::npos) << "the sandbox token reached the node log";
}

TEST(NodeSecurity, KeepsTheModeOfADirectoryItDidNotCreate) {
  Cluster c(ClusterOptions::node_only());
  const std::string state_dir = c.dir() + "/node";
  c.stop_node();
  // An operator-prepared state dir (group-readable for a monitoring agent, say) stays as it was made.
  ASSERT_EQ(::chmod(state_dir.c_str(), 0750), 0);
  c.start_node();
  struct stat st{};
  ASSERT_EQ(::stat(state_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0750u);
  // One the node makes itself is owner-only.
  c.stop_node();
  std::filesystem::remove_all(state_dir);
  c.start_node();
  ASSERT_EQ(::stat(state_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
}

TEST(NodeSecurity, TcpApiNeedsTheOperatorTokenItsOwnHostAndNoOrigin) {
  Cluster c(with_tcp_api());
  std::string addr = tcp_api_address(c);
  ASSERT_FALSE(addr.empty()) << c.node().log();
  const std::string port = addr.substr(addr.find(':') + 1);

  auto none = tcp_curl(addr, "/v1/health", "-D -");
  EXPECT_EQ(Cluster::http_code(none), 401) << none.out << none.err;
  EXPECT_NE(none.out.find("WWW-Authenticate: Bearer"), std::string::npos) << none.out;
  EXPECT_EQ(Cluster::http_code(tcp_curl(addr, "/v1/health", bearer("op-wrong"))), 401);
  auto refused = tcp_curl(addr, "/v1/sandboxes",
                          "-X POST -H 'Content-Type: application/json' --data " +
                              shell_quote(R"({"name":"nope","command":["true"]})"));
  EXPECT_EQ(Cluster::http_code(refused), 401) << refused.out;
  EXPECT_NE(c.cli("get nope").exit_code, 0) << "a refused create made a sandbox";

  auto ok = tcp_curl(addr, "/v1/health", bearer(kOperatorToken));
  EXPECT_EQ(Cluster::http_code(ok), 200) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("\"status\":\"ok\""), std::string::npos) << ok.out;
  auto localhost = tcp_curl(addr, "/v1/health", bearer(kOperatorToken) + " -H 'Host: localhost:" + port + "'");
  EXPECT_EQ(Cluster::http_code(localhost), 200) << localhost.out;

  // DNS rebinding: a page's own name resolved to 127.0.0.1 arrives with that name as Host.
  auto foreign = tcp_curl(addr, "/v1/health", bearer(kOperatorToken) + " -H 'Host: rebind.example:" + port + "'");
  EXPECT_EQ(Cluster::http_code(foreign), 421) << foreign.out;
  EXPECT_NE(foreign.out.find("misdirected_request"), std::string::npos) << foreign.out;
  // Anything a web page sends carries Origin.
  auto page = tcp_curl(addr, "/v1/health", bearer(kOperatorToken) + " -H 'Origin: http://rebind.example'");
  EXPECT_EQ(Cluster::http_code(page), 403) << page.out;

  // The CLI sends the operator token to an http --api as it does to the ingress.
  auto cli = run(c.sandgate() + " --api http://" + addr + " --token " + kOperatorToken + " ls");
  EXPECT_EQ(cli.exit_code, 0) << cli.out << cli.err;
  auto cli_without = run(c.sandgate() + " --api http://" + addr + " ls");
  EXPECT_NE(cli_without.exit_code, 0) << cli_without.out;

  // The unix socket is unchanged: no token, any Host.
  auto unix_ok = run("curl -sS -w '\\n%{http_code}' --unix-socket " + shell_quote(c.api().substr(5)) +
                     " http://whatever.example/v1/health");
  EXPECT_EQ(Cluster::http_code(unix_ok), 200) << unix_ok.out << unix_ok.err;
  // No credential reaches the log, even at debug level.
  EXPECT_EQ(c.node().log().find(kOperatorToken), std::string::npos);
  EXPECT_EQ(c.node().log().find("op-wrong"), std::string::npos);
}

TEST(NodeSecurity, SighupRotatesTheOperatorToken) {
  Cluster c(with_tcp_api());
  std::string addr = tcp_api_address(c);
  ASSERT_FALSE(addr.empty()) << c.node().log();
  ASSERT_EQ(Cluster::http_code(tcp_curl(addr, "/v1/health", bearer(kOperatorToken))), 200);

  const std::string rotated = "op-e2e-rotated-93d0a4c6e1";
  rotate_token(c, rotated);
  std::string line = reload_node(c);
  EXPECT_NE(line.find("reloaded"), std::string::npos) << line;
  EXPECT_EQ(Cluster::http_code(tcp_curl(addr, "/v1/health", bearer(kOperatorToken))), 401);
  EXPECT_EQ(Cluster::http_code(tcp_curl(addr, "/v1/health", bearer(rotated))), 200);

  // A rotation to a file others can read is refused, and the node keeps the token it has.
  rotate_token(c, "op-e2e-leaky-0000000000", 0644);
  line = reload_node(c);
  EXPECT_NE(line.find("reload failed"), std::string::npos) << line;
  std::string log = c.node().log();
  EXPECT_NE(log.find("chmod 600 " + token_path(c)), std::string::npos) << log;
  EXPECT_EQ(Cluster::http_code(tcp_curl(addr, "/v1/health", bearer(rotated))), 200);
  EXPECT_EQ(Cluster::http_code(tcp_curl(addr, "/v1/health", bearer("op-e2e-leaky-0000000000"))), 401);
  EXPECT_EQ(log.find(rotated), std::string::npos) << "a token reached the log";
}

TEST(NodeSecurity, RefusesAnOperatorTokenFileOthersCanRead) {
  ClusterOptions o;
  o.operator_token = kOperatorToken;
  o.start_proxy = false;
  Cluster c(o);
  c.stop_node();
  const std::string node_cmd =
      shell_quote(bin("noderuntime/sandgate-node")) + " --config " + shell_quote(c.config_path());
  for (mode_t mode : {0640, 0604}) {
    ASSERT_EQ(::chmod(token_path(c).c_str(), mode), 0);
    // The node exits on its own; one that served anyway would print its ready line and be killed by run().
    auto r = run(node_cmd, 20);
    std::string output = r.out + r.err;
    EXPECT_EQ(r.exit_code, 1) << output;
    EXPECT_NE(output.find("chmod 600 " + token_path(c)), std::string::npos) << output;
    EXPECT_EQ(output.find("sandgate-node ready"), std::string::npos) << output;
  }
  // Owner-only again: the node starts.
  ASSERT_EQ(::chmod(token_path(c).c_str(), 0600), 0);
  c.start_node();
  EXPECT_TRUE(c.node().running());
}

}  // namespace
}  // namespace sg::e2e
