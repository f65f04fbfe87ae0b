// Operating the ingress: TLS versions, SNI picking among certificates, config reload, wake timeout, and
// the quickstart (the README's first command) running twice side by side and cleaning up after itself.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <csignal>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

TEST(Operations, Tls12AndTls13BothServe) {
  Cluster c;
  c.create_http_sandbox("app", 8080);
  c.wait_until_serving("app", 8080);
  auto v12 = c.curl("8080-app.sandbox.localhost", "/", "--tlsv1.2 --tls-max 1.2");
  EXPECT_EQ(Cluster::http_code(v12), 200) << v12.err;
  auto v13 = c.curl("8080-app.sandbox.localhost", "/", "--tlsv1.3");
  EXPECT_EQ(Cluster::http_code(v13), 200) << v13.err;
  EXPECT_TRUE(c.wait_access_entry([](const nlohmann::json& e) { return e["tls"] == "TLSv1.2"; }).is_object());
  EXPECT_TRUE(c.wait_access_entry([](const nlohmann::json& e) { return e["tls"] == "TLSv1.3"; }).is_object());
  // TLS 1.1 and older are refused.
  auto old = run("openssl s_client -tls1_1 -connect 127.0.0.1:" + std::to_string(c.port()) +
                 " -servername 8080-app.sandbox.localhost </dev/null 2>&1");
  EXPECT_EQ(old.out.find("BEGIN CERTIFICATE"), std::string::npos);
}

TEST(Operations, SniSelectsTheCertificate) {
  std::string other_dir = "/tmp/sg-e2e-other-cert-" + std::to_string(::getpid());
  ASSERT_EQ(run("bash " + source("deploy/gen-cert.sh") + " " + other_dir + " other.test").exit_code, 0);
  Cluster c(ClusterOptions::proxy("[[proxy.certificates]]\ncert = \"" + other_dir + "/server.pem\"\nkey = \"" +
                                  other_dir + "/server.key\"\n"));
  auto subject = [&](const std::string& sni) {
    return run("openssl s_client -connect 127.0.0.1:" + std::to_string(c.port()) + " -servername " + sni +
               " </dev/null 2>/dev/null | openssl x509 -noout -subject")
        .out;
  };
  EXPECT_NE(subject("8080-a.sandbox.localhost").find("*.sandbox.localhost"), std::string::npos);
  EXPECT_NE(subject("www.other.test").find("*.other.test"), std::string::npos);
  // The second certificate verifies against its own CA; the name is not ours to route, so 421.
  auto r = run("curl -sS --cacert " + other_dir + "/ca.pem --resolve www.other.test:" + std::to_string(c.port()) +
               ":127.0.0.1 -w '\\n%{http_code}' https://www.other.test:" + std::to_string(c.port()) + "/");
  EXPECT_EQ(Cluster::http_code(r), 421) << r.err;
  run("rm -rf " + other_dir);
}

TEST(Operations, ReloadSwapsTheConfigWhole) {
  Cluster c;
  c.create_http_sandbox("app", 8080);
  c.wait_until_serving("app", 8080);
  std::string header = "-H 'X-Pad: " + std::string(3000, 'p') + "'";
  EXPECT_EQ(Cluster::http_code(c.curl("8080-app.sandbox.localhost", "/", header)), 200);

  std::string cfg = read_file(c.config_path());
  write_file(c.config_path(), cfg.substr(0, cfg.find("[proxy]\n") + 8) + "max_request_head_bytes = 2048\n" +
                                  cfg.substr(cfg.find("[proxy]\n") + 8));
  size_t mark = c.proxy().log().size();
  ::kill(c.proxy().pid(), SIGHUP);
  ASSERT_FALSE(c.proxy().wait_for("config reloaded", 5000, mark).empty()) << c.proxy().log();
  EXPECT_EQ(Cluster::http_code(c.curl("8080-app.sandbox.localhost", "/", header)), 431);

  // A broken file is refused and the running snapshot stays.
  write_file(c.config_path(), "[proxy]\nworkers = \"many\"\n");
  mark = c.proxy().log().size();
  ::kill(c.proxy().pid(), SIGHUP);
  ASSERT_FALSE(c.proxy().wait_for("reload failed", 5000, mark).empty());
  EXPECT_EQ(Cluster::http_code(c.curl("8080-app.sandbox.localhost", "/", header)), 431);
  EXPECT_EQ(Cluster::http_code(c.curl("8080-app.sandbox.localhost")), 200);
}

TEST(Operations, WakeTimeoutAnswers503WithRetryAfter) {
  Cluster c(ClusterOptions::proxy("wake_timeout_ms = 1000\n"));
  c.create_http_sandbox("app", 8080);
  c.wait_until_serving("app", 8080);
  ASSERT_EQ(c.cli("suspend app").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("app")["state"] == "suspended"; }, std::chrono::seconds(5)));
  // A node that cannot answer (stopped) must not leave the client hanging.
  ::kill(c.node().pid(), SIGSTOP);
  auto start = std::chrono::steady_clock::now();
  auto r = c.curl("8080-app.sandbox.localhost", "/", "-D -");
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::kill(c.node().pid(), SIGCONT);
  EXPECT_EQ(Cluster::http_code(r), 503);
  EXPECT_NE(r.out.find("Retry-After:"), std::string::npos);
  EXPECT_LT(secs, 5.0);
  EXPECT_TRUE(c.wait_access_entry([](const nlohmann::json& e) { return e["cause"] == "wake_timeout"; }).is_object());
  // Once the node is back the same request wakes the sandbox.
  EXPECT_EQ(Cluster::http_code(c.curl("8080-app.sandbox.localhost")), 200);
}

TEST(Operations, QuickstartTwiceSideBySideThenCleanExit) {
  // Everything in one temp dir: both state dirs, their logs, and a HOME for each (the quickstart's CLI saves
  // the demo's token there, and the real home must not see it).
  char tmpl[] = "/tmp/sg-e2e-qs-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string base = tmpl;
  Daemon a, b;
  {
    Cluster importer(ClusterOptions::node_only());  // puts the test image into the shared store
  }
  std::string script = source("deploy/quickstart.sh");
  auto start = [&](Daemon& d, const std::string& name, int port) {
    const std::string home = base + "/" + name + "-home";
    ::mkdir(home.c_str(), 0700);
    // The test image's store instead of a Debian image built by each copy (the build has tests of its own).
    return d.start({"/usr/bin/env", "HOME=" + home, "XDG_CONFIG_HOME=" + home + "/.config", "SANDGATE_NO_BUILD=1",
                    "SANDGATE_IMAGES_DIR=" + test_image().store, "SANDGATE_DEFAULT_IMAGE=" + test_image().name,
                    "BUILD_DIR=" + std::string(SANDGATE_BIN_DIR), "SANDGATE_STATE_DIR=" + base + "/" + name,
                    "SANDGATE_LISTEN=127.0.0.1:" + std::to_string(port), "bash", script},
                   base + "/" + name + ".log");
  };
  ASSERT_TRUE(start(a, "a", 18543));
  ASSERT_TRUE(start(b, "b", 18544));
  ASSERT_FALSE(a.wait_for("Press Ctrl-C", 60000).empty()) << a.log();
  ASSERT_FALSE(b.wait_for("Press Ctrl-C", 60000).empty()) << b.log();
  for (auto [name, port] : {std::pair{"a", 18543}, std::pair{"b", 18544}}) {
    const std::string dir = base + "/" + name, home = dir + "-home";
    auto r = run("curl -sS --cacert " + dir + "/tls/ca.pem https://8080-demo.sandbox.localhost:" +
                 std::to_string(port) + "/");
    EXPECT_NE(r.out.find("hello from the demo sandbox"), std::string::npos) << r.err;
    EXPECT_FALSE(read_file(home + "/.config/sandgate/tokens/demo").empty()) << "the demo's token is saved in HOME";

    // The ssh-config line the quickstart prints, with only the SANDGATE_API it says to export: the block
    // names this copy's ingress and CA (from <state>/ingress), not the default 127.0.0.1:8443.
    const std::string log = name == std::string("a") ? a.log() : b.log();
    EXPECT_NE(log.find("/cli/sandgate ssh-config NAME >> ~/.ssh/config"), std::string::npos) << log;
    const std::string cli = "env HOME=" + home + " XDG_CONFIG_HOME=" + home + "/.config SANDGATE_API=unix:" + dir +
                            "/node.sock " + bin("cli/sandgate");
    auto cfg = run(cli + " ssh-config demo");
    ASSERT_EQ(cfg.exit_code, 0) << cfg.err;
    const std::string proxy_command_end =
        " ssh-proxy --ingress 127.0.0.1:" + std::to_string(port) + " --cacert " + dir + "/tls/ca.pem %h\n";
    auto pc_end = cfg.out.find(proxy_command_end);
    ASSERT_NE(pc_end, std::string::npos) << cfg.out;
    // And it works: that ProxyCommand, as ssh would run it (but to the demo's port 8080, where an HTTP server
    // answers instead of sshd), tunnels through this copy's ingress with the token create saved.
    auto pc_start = cfg.out.find("ProxyCommand ") + 13;
    std::string proxy_command = cfg.out.substr(pc_start, pc_end + proxy_command_end.size() - 4 - pc_start);
    auto tunnel = run("printf 'GET / HTTP/1.0\\r\\nHost: demo\\r\\n\\r\\n' | env HOME=" + home + " " +
                      proxy_command + " --port 8080 demo.sandbox.localhost");
    EXPECT_EQ(tunnel.exit_code, 0) << proxy_command << "\n" << tunnel.err;
    EXPECT_NE(tunnel.out.find("hello from the demo sandbox"), std::string::npos) << tunnel.out << tunnel.err;
  }
  EXPECT_EQ(WEXITSTATUS(a.stop(SIGINT, 60000)), 0);
  EXPECT_EQ(WEXITSTATUS(b.stop(SIGINT, 60000)), 0);
  // Nothing left behind: no sandbox processes, no cgroups of either copy.
  // "[/]" keeps pgrep from matching the shell that runs it.
  auto procs = run("pgrep -f '[/]" + base.substr(1) + "' || true");
  EXPECT_EQ(procs.out, "");
  // Only these two copies' cgroups (named as the quickstart names them): other quickstarts may be running.
  for (const char* name : {"a", "b"}) {
    auto cgroups = run("g=sandgate-qs-$(printf '%s' " + shell_quote(base + "/" + name) +
                       " | sha256sum | cut -c1-10); ls -d /sys/fs/cgroup/*/$g /sys/fs/cgroup/$g 2>/dev/null || true");
    EXPECT_EQ(cgroups.out, "") << name;
  }
  if (!::testing::Test::HasFailure()) run("rm -rf " + shell_quote(base));
}

}  // namespace
}  // namespace sg::e2e
