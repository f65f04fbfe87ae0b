// The three kinds of traffic the ingress exists for, through real clients: SSH (OpenSSH with openssl
// s_client or `sandgate ssh-proxy` as the ProxyCommand, scp both ways), SDK calls to the in-sandbox agent
// over HTTP/1.1 and HTTP/2 (streaming exec), HTTP/2 to an h2c port (curl, h2load), and WebSocket.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

nlohmann::json create_json(Cluster& c, const std::string& args) {
  auto r = c.cli("create --json " + args);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  return nlohmann::json::parse(r.out, nullptr, false);
}

// An sshd inside a process sandbox (its own network namespace, so port 22 is its own), running on the test
// image's host keys and tests/e2e/tools/sshd_config; the test's public key reaches root's authorized_keys
// through the sandbox's command (the sandbox sees nothing of the host's files).
struct SshFixture {
  std::string dir;
  std::string key;
  std::string sshd_cmd;

  explicit SshFixture(const std::string& base) : dir(base + "/ssh"), key(base + "/ssh/id_ed25519") {
    ::mkdir(dir.c_str(), 0700);
    EXPECT_EQ(run("ssh-keygen -q -t ed25519 -N '' -f " + shell_quote(key)).exit_code, 0);
    std::string pub = read_file(key + ".pub");
    while (!pub.empty() && pub.back() == '\n') pub.pop_back();
    sshd_cmd = "/bin/sh -c " + shell_quote("mkdir -p /root/.ssh && echo '" + pub +
                                           "' > /root/.ssh/authorized_keys && exec /usr/sbin/sshd -D -e -f " +
                                           tool("sshd_config"));
  }

  std::string ssh_base(const std::string& proxy_command) const {
    return "ssh -F /dev/null -i " + shell_quote(key) +
           " -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o BatchMode=yes -o LogLevel=ERROR"
           " -o ConnectTimeout=30 -o ProxyCommand=" +
           shell_quote(proxy_command);
  }
  std::string scp_base(const std::string& proxy_command) const {
    return "scp -q -F /dev/null -i " + shell_quote(key) +
           " -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o BatchMode=yes -o ProxyCommand=" +
           shell_quote(proxy_command);
  }
};

std::string ssh_proxy_command(Cluster& c, const std::string& token) {
  return c.sandgate() + " ssh-proxy --ingress 127.0.0.1:" + std::to_string(c.port()) + " --cacert " + c.ca() +
         " --domain sandbox.localhost --token " + token + " %h";
}

void ssh_eventually_answers(const SshFixture& f, const std::string& proxy_command, const std::string& host) {
  ASSERT_TRUE(eventually(
      [&] {
        auto r = run(f.ssh_base(proxy_command) + " root@" + host + " 'echo ssh-ok $((6*7))'", 60);
        return r.exit_code == 0 && r.out == "ssh-ok 42\n";
      },
      std::chrono::seconds(30)));
}

TEST(Ssh, OpenSshThroughSandgateSshProxyRunsCommandsAndScpBothWays) {
  Cluster c;
  SshFixture f(c.dir());
  auto j = create_json(c, "--name box --expose 22/tcp -- " + f.sshd_cmd);
  ASSERT_TRUE(j.contains("token")) << j.dump();
  std::string token = j["token"];
  std::string pc = ssh_proxy_command(c, token);
  ssh_eventually_answers(f, pc, "box");

  // 10 MiB each way, compared by hash.
  std::string up = c.dir() + "/up.bin";
  ASSERT_EQ(run("head -c 10485760 /dev/urandom > " + shell_quote(up)).exit_code, 0);
  auto put = run(f.scp_base(pc) + " " + shell_quote(up) + " root@box:/root/in-sandbox.bin", 120);
  ASSERT_EQ(put.exit_code, 0) << put.err;
  // What the sandbox writes lands in its overlay's upper dir on the host.
  const std::string upper = c.dir() + "/node/sandboxes/" + j["id"].get<std::string>() + "/upper";
  EXPECT_EQ(sha256_file(upper + "/root/in-sandbox.bin"), sha256_file(up));
  auto get = run(f.scp_base(pc) + " root@box:/root/in-sandbox.bin " + shell_quote(c.dir() + "/down.bin"), 120);
  ASSERT_EQ(get.exit_code, 0) << get.err;
  EXPECT_EQ(sha256_file(c.dir() + "/down.bin"), sha256_file(up));

  // A CONNECT to a port the sandbox does not expose is refused (403) before anything is opened.
  auto unexposed = run("true | " + c.sandgate() + " ssh-proxy --ingress 127.0.0.1:" + std::to_string(c.port()) +
                           " --cacert " + c.ca() + " --domain sandbox.localhost --token " + token + " --port 2222 box",
                       30);
  EXPECT_EQ(unexposed.exit_code, 1);
  EXPECT_NE(unexposed.err.find("403"), std::string::npos) << unexposed.err;
  EXPECT_NE(unexposed.err.find("or create it with --expose 2222/tcp"), std::string::npos) << unexposed.err;
  auto refused_entry =
      c.wait_access_entry([](const nlohmann::json& e) { return e.value("cause", "") == "port_not_exposed"; });
  ASSERT_TRUE(refused_entry.is_object()) << read_file(c.dir() + "/access.log");
  EXPECT_EQ(refused_entry.value("port", 0), 2222);
  EXPECT_EQ(refused_entry.value("status", 0), 403);

  // A wrong token is refused before sshd sees anything.
  auto refused = run(f.ssh_base(ssh_proxy_command(c, "sgt_wrong")) + " root@box true", 60);
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("401"), std::string::npos) << refused.err;

  // Suspended first: the ssh connection wakes it, with no error.
  ASSERT_EQ(c.cli("suspend box").exit_code, 0);
  ASSERT_EQ(c.get("box")["state"], "suspended");
  auto woke = run(f.ssh_base(pc) + " root@box 'echo awake'", 60);
  EXPECT_EQ(woke.exit_code, 0) << woke.err;
  EXPECT_EQ(woke.out, "awake\n");
  put = run(f.scp_base(pc) + " " + shell_quote(up) + " root@box:/root/again.bin", 120);
  EXPECT_EQ(put.exit_code, 0) << put.err;
  EXPECT_EQ(sha256_file(upper + "/root/again.bin"), sha256_file(up));
}

TEST(Ssh, OpenSslClientAsProxyCommandReachesAPublicSshPort) {
  Cluster c;
  SshFixture f(c.dir());
  create_json(c, "--name pubssh --public 22/tcp -- " + f.sshd_cmd);
  std::string pc = "openssl s_client -quiet -verify_return_error -verify_hostname 22-pubssh.sandbox.localhost"
                   " -CAfile " + c.ca() + " -servername 22-pubssh.sandbox.localhost -connect 127.0.0.1:" +
                   std::to_string(c.port());
  ssh_eventually_answers(f, pc, "pubssh");
  ASSERT_EQ(c.cli("suspend pubssh").exit_code, 0);
  auto woke = run(f.ssh_base(pc) + " root@pubssh 'echo awake'", 60);
  EXPECT_EQ(woke.exit_code, 0) << woke.err;
  EXPECT_EQ(woke.out, "awake\n");
}

TEST(Ssh, AnOpenSessionHoldsTheSandboxAwake) {
  Cluster c;
  SshFixture f(c.dir());
  auto j = create_json(c, "--name held --timeout 2 --expose 22/tcp -- " + f.sshd_cmd);
  std::string pc = ssh_proxy_command(c, j["token"]);
  ssh_eventually_answers(f, pc, "held");
  // A session that moves no bytes for three idle timeouts.
  auto r = run(f.ssh_base(pc) + " root@held 'sleep 7; echo still-here'", 60);
  EXPECT_EQ(r.out, "still-here\n") << r.err;
  // Closed: the idle clock starts and the sandbox suspends.
  EXPECT_TRUE(eventually([&] { return c.get("held")["state"] == "suspended"; }, std::chrono::seconds(15)));
}

TEST(Ssh, SshConfigPrintsAUsableHostBlockAndRefusesInjection) {
  Cluster c;
  auto r = c.cli("ssh-config box --ingress 127.0.0.1:" + std::to_string(c.port()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* line : {"Host box", "HostName box.sandbox.localhost", "User root", "ProxyCommand ",
                           "ssh-proxy", "ServerAliveInterval 30", "ServerAliveCountMax 3"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  EXPECT_EQ(c.cli(shell_quote("ssh-config") + " " + shell_quote("box\n  ProxyCommand evil")).exit_code, 2);
  EXPECT_EQ(c.cli("ssh-config 'a b'").exit_code, 2);
}

TEST(Sdk, AgentAnswersOverHttp1AndHttp2AndStreamsExec) {
  Cluster c;
  auto j = create_json(c, "--name sdk -- /bin/sleep 3600");
  std::string token = j["token"];
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(c.curl("sdk.sandbox.localhost", "/health", bearer(token))) == 200; },
                         std::chrono::seconds(20)));
  EXPECT_EQ(Cluster::http_code(c.curl("sdk.sandbox.localhost", "/health")), 401);
  auto h2 = c.curl("sdk.sandbox.localhost", "/health", "--http2 -w ' %{http_version}' " + bearer(token));
  EXPECT_NE(h2.out.find("\"status\":\"ok\""), std::string::npos) << h2.out;
  EXPECT_NE(h2.out.find(" 2"), std::string::npos) << "negotiated HTTP/2: " << h2.out;

  // The first event arrives while the command still runs: nothing buffers it on the way.
  std::string body = R"({"command":["sh","-c","echo first; sleep 2; echo second"]})";
  auto exec = c.curl("sdk.sandbox.localhost", "/exec",
                     "-N -X POST -H 'Content-Type: application/json' --data " + shell_quote(body) + " " + bearer(token) +
                         " -w ' ttfb=%{time_starttransfer} total=%{time_total}'");
  EXPECT_NE(exec.out.find("\"data\":\"first\\n\""), std::string::npos) << exec.out;
  EXPECT_NE(exec.out.find("\"type\":\"exit\""), std::string::npos) << exec.out;
  double ttfb = std::atof(exec.out.substr(exec.out.find("ttfb=") + 5).c_str());
  double total = std::atof(exec.out.substr(exec.out.find("total=") + 6).c_str());
  EXPECT_GE(total, 2.0);
  EXPECT_LT(ttfb, total - 1.0) << exec.out;
  // The same over HTTP/2.
  auto exec2 = c.curl("sdk.sandbox.localhost", "/exec",
                      "--http2 -N -X POST -H 'Content-Type: application/json' --data " + shell_quote(body) + " " +
                          bearer(token));
  EXPECT_NE(exec2.out.find("\"data\":\"second\\n\""), std::string::npos) << exec2.out;
}

TEST(Http2, H2cPortGetsHttp2AndHttp1PortsFallBack) {
  Cluster c;
  // The agent binary doubles as an h2c server on an exposed port.
  create_json(c, "--name h2 --public 7000/h2c -- " + std::string(kAgentInSandbox) + " --listen 0.0.0.0:7000");
  create_json(c, "--name h1 --public 8080 -- /usr/bin/python3 " + tool("testserver.py") +
                     " http 8080 h1");
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(c.curl("7000-h2.sandbox.localhost", "/health")) == 200; },
                         std::chrono::seconds(20)));
  auto h2 = c.curl("7000-h2.sandbox.localhost", "/health", "--http2 -w ' %{http_version}'");
  EXPECT_NE(h2.out.rfind(" 2"), std::string::npos) << h2.out;
  c.wait_until_serving("h1", 8080);
  auto h1 = c.curl("8080-h1.sandbox.localhost", "/", "--http2 -w ' %{http_version}'");
  EXPECT_NE(h1.out.find("hello from h1"), std::string::npos) << h1.out;
  EXPECT_NE(h1.out.rfind(" 1.1"), std::string::npos) << h1.out;

  // h2load: a 10,000-stream connection (100 at a time, the backend's SETTINGS limit), every stream answered.
  auto load = run("h2load -n 10000 -c 1 -m 100 --connect-to 127.0.0.1:" + std::to_string(c.port()) + " " +
                      c.url("7000-h2.sandbox.localhost", "/health"),
                  120);
  EXPECT_NE(load.out.find("10000 succeeded"), std::string::npos) << load.out << load.err;
  EXPECT_NE(load.out.find("h2"), std::string::npos) << load.out;

  // Garbage instead of the HTTP/2 preface: GOAWAY, a logged cause, and the proxy keeps serving.
  auto garbage = run("printf 'GARBAGE GARBAGE GARBAGE GARBAGE\\r\\n\\r\\n' | openssl s_client -quiet -alpn h2 -CAfile " +
                         c.ca() + " -servername 7000-h2.sandbox.localhost -connect 127.0.0.1:" +
                         std::to_string(c.port()) + " | od -An -tx1 | head -5",
                     30);
  auto entry = c.wait_access_entry(
      [](const nlohmann::json& e) { return e.value("cause", "") == "bad_request" && e.value("sni", "") == "7000-h2.sandbox.localhost"; });
  EXPECT_NE(entry.value("detail", "").find("preface"), std::string::npos) << entry.dump();
  EXPECT_EQ(Cluster::http_code(c.curl("7000-h2.sandbox.localhost", "/health", "--http2")), 200);
}

TEST(WebSocket, EchoThroughAnExposedPort) {
  Cluster c;
  create_json(c, "--name ws --public 8765 -- /usr/bin/python3 " + tool("ws_echo.py") +
                     " serve 8765");
  std::string uri = "wss://8765-ws.sandbox.localhost:" + std::to_string(c.port()) + "/";
  ASSERT_TRUE(eventually(
      [&] {
        auto r = run("/usr/bin/python3 " + source("tests/e2e/tools/ws_echo.py") + " client " + uri + " " +
                         std::to_string(c.port()) + " " + c.ca(),
                     30);
        return r.out == "ok 3\n";
      },
      std::chrono::seconds(20)));
}

}  // namespace
}  // namespace sg::e2e
