// Least privilege, with real clients: a proxy started as root with proxy.user switches to that user once its
// listeners are bound (every thread, no capabilities, no way back), still serves sandboxes and api.<domain>
// through a node socket of node.socket_group, re-reads what a reload needs as that user, and says clearly
// when it cannot. The account is Debian's nobody / nogroup, so no user is created and tests can run side by
// side; every file the proxy needs is given to it inside the cluster's own temp dir.
#include <dirent.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <sstream>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

const char* kOperatorToken = "op-e2e-priv-6d1f0a93c2";
const char* kRotatedToken = "op-e2e-priv-rotated-84be57";

struct Account {
  std::string user;
  std::string group;
  uid_t uid = 0;
  gid_t gid = 0;
};

Account account(const char* user) {
  Account a;
  passwd* pw = ::getpwnam(user);
  if (!pw) return a;
  group* gr = ::getgrgid(pw->pw_gid);
  if (!gr) return a;
  return {pw->pw_name, gr->gr_name, pw->pw_uid, pw->pw_gid};
}

// What the install does for the real proxy user, here for `a` inside the cluster's temp dir: the config and
// certificate readable, the key readable by the group only, the operator token owned by the user and
// owner-only (the node, as root, reads it all the same; both refuse a token file others can read).
void give_files_to(Cluster& c, const Account& a) {
  const std::string tls = c.dir() + "/tls";
  ASSERT_EQ(::chmod(c.config_path().c_str(), 0644), 0);
  ASSERT_EQ(::chmod(tls.c_str(), 0755), 0);
  ASSERT_EQ(::chmod((tls + "/server.pem").c_str(), 0644), 0);
  ASSERT_EQ(::chown((tls + "/server.key").c_str(), 0, a.gid), 0);
  ASSERT_EQ(::chmod((tls + "/server.key").c_str(), 0640), 0);
  const std::string token = c.dir() + "/operator.token";
  if (::access(token.c_str(), F_OK) == 0) {
    ASSERT_EQ(::chown(token.c_str(), a.uid, a.gid), 0);
  }
}

// The fields of a "Key:\t..." line of /proc/<pid>/status (or of one of its threads, `task` = "task/<tid>/").
std::vector<std::string> status_fields(pid_t pid, const std::string& key, const std::string& task = "") {
  std::istringstream in(read_file("/proc/" + std::to_string(pid) + "/" + task + "status"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) != 0) continue;
    std::istringstream fields(line.substr(key.size() + 1));
    std::vector<std::string> out;
    for (std::string f; fields >> f;) out.push_back(f);
    return out;
  }
  return {"<no " + key + " line>"};
}

std::vector<std::string> threads_of(pid_t pid) {
  std::vector<std::string> tids;
  DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str());
  if (!d) return tids;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') tids.push_back(e->d_name);
  ::closedir(d);
  return tids;
}

// SIGHUP, then the proxy's line that says how the reload went.
std::string reload_proxy(Cluster& c) {
  size_t from = c.proxy().log().size();
  ::kill(c.proxy().pid(), SIGHUP);
  return c.proxy().wait_for("reload", 10000, from);
}

// Replaces the operator token file as an operator would: a new file renamed over the old one.
void write_token(Cluster& c, const std::string& token, uid_t owner, gid_t group) {
  const std::string path = c.dir() + "/operator.token";
  write_file(path + ".new", token + "\n");
  ASSERT_EQ(::chmod((path + ".new").c_str(), 0600), 0);
  ASSERT_EQ(::chown((path + ".new").c_str(), owner, group), 0);
  ASSERT_EQ(::rename((path + ".new").c_str(), path.c_str()), 0);
}

int api_code(Cluster& c, const std::string& token) {
  return Cluster::http_code(c.curl("api.sandbox.localhost", "/v1/sandboxes", bearer(token)));
}

class Privilege : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: the proxy must start as root to drop it";
    nobody_ = account("nobody");
    ASSERT_FALSE(nobody_.user.empty()) << "no user nobody with a primary group (Debian has nobody / nogroup)";
    ASSERT_NE(nobody_.uid, 0u);
    ASSERT_NE(nobody_.gid, 0u);
  }
  ClusterOptions options() const {
    ClusterOptions o = ClusterOptions::with_operator_token(kOperatorToken);
    o.proxy_extra = "user = \"" + nobody_.user + "\"\n";
    o.node_extra = "socket_group = \"" + nobody_.group + "\"\n";
    o.start_proxy = false;
    return o;
  }
  Account nobody_;
};

TEST_F(Privilege, ProxyDropsRootAfterBindingAndStillServesAndReloads) {
  Cluster c(options());
  // The node serves its socket to the proxy's group.
  struct stat st{};
  ASSERT_EQ(::stat(c.api().substr(5).c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, nobody_.gid);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  give_files_to(c, nobody_);
  c.start_proxy();
  const pid_t pid = c.proxy().pid();
  EXPECT_NE(c.proxy().log().find("dropped root: running as uid " + std::to_string(nobody_.uid) + " (" +
                                 nobody_.user + ")"),
            std::string::npos)
      << c.proxy().log();
  // Everything a reload reads is readable by the user, so the start-time check has nothing to say.
  EXPECT_EQ(c.proxy().log().find("a reload will fail"), std::string::npos) << c.proxy().log();
  EXPECT_EQ(c.proxy().log().find("cannot connect to the node socket"), std::string::npos) << c.proxy().log();

  // Real, effective, saved and file-system ids of every thread (main and both workers) are the user's, and no
  // capability is left anywhere.
  const std::string uid = std::to_string(nobody_.uid), gid = std::to_string(nobody_.gid);
  std::vector<std::string> tids = threads_of(pid);
  EXPECT_GE(tids.size(), 3u) << "main thread and two workers";
  for (const std::string& tid : tids) {
    const std::string task = "task/" + tid + "/";
    EXPECT_EQ(status_fields(pid, "Uid", task), std::vector<std::string>(4, uid)) << "thread " << tid;
    EXPECT_EQ(status_fields(pid, "Gid", task), std::vector<std::string>(4, gid)) << "thread " << tid;
    for (const char* key : {"CapEff", "CapPrm", "CapInh", "CapAmb"})
      EXPECT_EQ(status_fields(pid, key, task), std::vector<std::string>{"0000000000000000"}) << key << " " << tid;
  }
  for (const std::string& g : status_fields(pid, "Groups")) EXPECT_NE(g, "0") << "root's group kept";
  EXPECT_EQ(status_fields(pid, "NoNewPrivs"), std::vector<std::string>{"1"});
  // Its socket maker, started before the switch: the same user, CAP_SYS_ADMIN alone, the proxy's child.
  const std::string log = c.proxy().log();
  const size_t at = log.find("socket maker pid ");
  ASSERT_NE(at, std::string::npos) << log;
  const pid_t maker = static_cast<pid_t>(std::stol(log.substr(at + 17)));
  EXPECT_EQ(status_fields(maker, "Uid"), std::vector<std::string>(4, uid));
  EXPECT_EQ(status_fields(maker, "Gid"), std::vector<std::string>(4, gid));
  for (const char* key : {"CapEff", "CapPrm", "CapBnd"})
    EXPECT_EQ(status_fields(maker, key), std::vector<std::string>{"0000000000200000"}) << key;
  EXPECT_EQ(status_fields(maker, "PPid"), std::vector<std::string>{std::to_string(pid)});

  // A sandbox and the node API answer through it: the node socket is reachable as that user.
  c.create_http_sandbox("web", 8080);
  c.wait_until_serving("web", 8080);
  EXPECT_EQ(Cluster::body(c.curl("8080-web.sandbox.localhost")), "hello from web");
  EXPECT_EQ(api_code(c, kOperatorToken), 200);

  // SIGHUP re-reads the config, the certificates and the token file as that user: a rotated token is the
  // one api.<domain> takes from then on.
  write_token(c, kRotatedToken, nobody_.uid, nobody_.gid);
  std::string line = reload_proxy(c);
  EXPECT_NE(line.find("config reloaded"), std::string::npos) << line << "\n" << c.proxy().log();
  EXPECT_EQ(api_code(c, kRotatedToken), 200);
  EXPECT_EQ(api_code(c, kOperatorToken), 401);

  // A token file the user cannot read (root's, owner-only) fails the reload with the reason and the user
  // named; the proxy keeps its running config and token, and keeps serving.
  write_token(c, kOperatorToken, 0, 0);
  line = reload_proxy(c);
  EXPECT_NE(line.find("reload failed, keeping the running config"), std::string::npos) << line;
  EXPECT_NE(line.find("operator_token_file: cannot open"), std::string::npos) << line;
  EXPECT_NE(line.find("Permission denied"), std::string::npos) << line;
  EXPECT_NE(line.find("runs as user " + nobody_.user), std::string::npos) << line;
  EXPECT_EQ(::kill(pid, 0), 0) << "the proxy died on a failed reload";
  EXPECT_EQ(api_code(c, kRotatedToken), 200);
  EXPECT_EQ(Cluster::body(c.curl("8080-web.sandbox.localhost")), "hello from web");

  // The same for a private key only root can read.
  write_token(c, kRotatedToken, nobody_.uid, nobody_.gid);
  ASSERT_EQ(::chmod((c.dir() + "/tls/server.key").c_str(), 0600), 0);
  line = reload_proxy(c);
  EXPECT_NE(line.find("reload failed, keeping the running config: private key " + c.dir() + "/tls/server.key"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("runs as user " + nobody_.user), std::string::npos) << line;
  EXPECT_EQ(Cluster::body(c.curl("8080-web.sandbox.localhost")), "hello from web");
}

// The socket maker as proxy.user: it reads the node's marks and makes a route's sockets while the node is
// down. One worker, so every connection meets the route the first one cached.
TEST_F(Privilege, TheSocketMakerServesANodeOutageAsTheProxysUser) {
  ClusterOptions o = options();
  o.proxy_extra += "workers = 1\n";
  Cluster c(o);
  give_files_to(c, nobody_);
  c.start_proxy();
  c.create_http_sandbox("web", 8080);
  c.wait_until_serving("web", 8080);
  ASSERT_EQ(Cluster::body(c.curl("8080-web.sandbox.localhost")), "hello from web");
  c.stop_node(SIGKILL);
  ASSERT_TRUE(eventually([&] { return c.proxy().log().find("the node is down: routes cached") != std::string::npos; },
                         std::chrono::seconds(5)))
      << c.proxy().log();
  // Past the route's spares (at most 20 here: an open's 4 and one refill of 16).
  for (int i = 0; i < 40; ++i)
    ASSERT_EQ(Cluster::body(c.curl("8080-web.sandbox.localhost")), "hello from web") << i << c.proxy().log();
  EXPECT_EQ(c.proxy().log().find("the socket maker refused"), std::string::npos) << c.proxy().log();
}

TEST_F(Privilege, StartWarnsAboutFilesAndASocketTheUserCannotUse) {
  ClusterOptions o = options();
  o.node_extra = "";  // the socket keeps root's group: the proxy's user cannot connect
  Cluster c(o);
  give_files_to(c, nobody_);
  ASSERT_EQ(::chmod((c.dir() + "/tls/server.key").c_str(), 0600), 0);  // root's only
  c.start_proxy();
  // It starts (everything was read as root), but says what will go wrong, and why.
  std::string log = c.proxy().log();
  EXPECT_NE(log.find("a reload will fail: private key " + c.dir() + "/tls/server.key"), std::string::npos) << log;
  EXPECT_NE(log.find("user " + nobody_.user + " cannot connect to the node socket " + c.api().substr(5) +
                     ": Permission denied"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("node.socket_group"), std::string::npos) << log;
  // And so it is: a request fails with the edge's own answer, and the proxy stays up.
  c.create_http_sandbox("web", 8080);
  auto r = c.curl("8080-web.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 503) << r.out << r.err;
  EXPECT_EQ(::kill(c.proxy().pid(), 0), 0);
}

TEST_F(Privilege, ProxyUserNamingAMissingUserIsAConfigError) {
  const std::string missing = "sg-no-such-user-e2e-71c4";
  ASSERT_EQ(::getpwnam(missing.c_str()), nullptr);
  ClusterOptions o = ClusterOptions::node_only();
  Cluster c(o);
  std::string cfg = read_file(c.config_path());
  const std::string bad = c.dir() + "/bad.toml";
  write_file(bad, cfg.substr(0, cfg.find("[proxy]\n") + 8) + "user = \"" + missing + "\"\n" +
                      cfg.substr(cfg.find("[proxy]\n") + 8));
  auto check = run(shell_quote(bin("proxy/sandgate-proxy")) + " --config " + shell_quote(bad) + " --check");
  EXPECT_EQ(check.exit_code, 2) << check.out << check.err;
  EXPECT_NE(check.err.find(bad + ":"), std::string::npos) << check.err;
  EXPECT_NE(check.err.find("proxy.user: no user named \"" + missing + "\""), std::string::npos) << check.err;
  EXPECT_NE(check.err.find("useradd --system"), std::string::npos) << check.err;
  // The daemon refuses it the same way at start, and so does the node (one file for both).
  auto start = run(shell_quote(bin("proxy/sandgate-proxy")) + " --config " + shell_quote(bad), 30);
  EXPECT_EQ(start.exit_code, 2) << start.out << start.err;
  EXPECT_NE(start.err.find("proxy.user: no user named"), std::string::npos) << start.err;
  auto node = run(shell_quote(bin("noderuntime/sandgate-node")) + " --config " + shell_quote(bad) +
                      " --socket unix:" + c.dir() + "/other.sock",
                  30);
  EXPECT_EQ(node.exit_code, 2) << node.out << node.err;
  EXPECT_NE(node.err.find("proxy.user: no user named"), std::string::npos) << node.err;

  // A reload into such a file is refused too, and the running proxy keeps its config.
  c.start_proxy();
  write_file(c.config_path(), read_file(bad));
  std::string line = reload_proxy(c);
  EXPECT_NE(line.find("reload failed, keeping the running config"), std::string::npos) << line;
  EXPECT_NE(c.proxy().log().find("proxy.user: no user named"), std::string::npos) << c.proxy().log();
}

// Started unprivileged (a unit with User=, say): already being proxy.user is fine; being anyone else is an
// error at start that names the key, since only root can switch.
TEST_F(Privilege, WithoutRootTheProxyMustAlreadyBeThatUser) {
  Account daemon = account("daemon");
  ASSERT_FALSE(daemon.user.empty()) << "no user daemon (Debian has one)";
  ClusterOptions o = options();
  o.operator_token.clear();
  Cluster c(o);
  give_files_to(c, nobody_);
  ASSERT_EQ(::chmod((c.dir() + "/tls/server.key").c_str(), 0644), 0);  // readable by daemon too
  // Opened before the switch, by whoever the proxy starts as.
  write_file(c.dir() + "/access.log", "");
  ASSERT_EQ(::chmod((c.dir() + "/access.log").c_str(), 0666), 0);

  auto as = [&](const Account& a) {
    return "setpriv --reuid=" + a.user + " --regid=" + a.group + " --clear-groups ";
  };
  auto wrong = run(as(daemon) + shell_quote(bin("proxy/sandgate-proxy")) + " --config " +
                       shell_quote(c.config_path()),
                   30);
  EXPECT_EQ(wrong.exit_code, 1) << wrong.out << wrong.err;
  EXPECT_NE(wrong.err.find("cannot switch to proxy.user " + nobody_.user), std::string::npos) << wrong.err;
  EXPECT_NE(wrong.err.find("runs as uid " + std::to_string(daemon.uid)), std::string::npos) << wrong.err;
  EXPECT_NE(wrong.err.find("not as root"), std::string::npos) << wrong.err;
  EXPECT_EQ(wrong.err.find("sandgate-proxy ready"), std::string::npos) << "it served as the wrong user";

  ASSERT_TRUE(c.proxy().start({"/usr/bin/setpriv", "--reuid=" + nobody_.user, "--regid=" + nobody_.group,
                               "--clear-groups", bin("proxy/sandgate-proxy"), "--config", c.config_path()},
                              c.dir() + "/proxy.log"));
  std::string ready = c.proxy().wait_for("sandgate-proxy ready", 15000);
  ASSERT_FALSE(ready.empty()) << c.proxy().log();
  EXPECT_NE(c.proxy().log().find("already running as proxy.user: uid " + std::to_string(nobody_.uid)),
            std::string::npos)
      << c.proxy().log();
}

}  // namespace
}  // namespace sg::e2e
