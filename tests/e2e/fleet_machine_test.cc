// deploy/fleet-machine.sh, the three-machine deployment, tried on one machine: three "machines" are the
// loopback addresses 127.0.0.1-3, each with the files the script writes under a root of its own. etcd runs
// from the /etc/default/etcd the script wrote (as Debian's etcd.service would run it), node and proxy from
// its sandgate.toml, etcd speaking TLS to clients and peers (the script's default); then the fleet has to work: a sandbox placed on one machine answers through every
// machine's proxy, and its name is taken fleet-wide.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/e2e/harness.h"
#include "tests/etcd_process.h"

namespace sg::e2e {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr int kMachines = 3;

// KEY=VALUE lines of an environment file, comments and blank lines left out.
std::vector<std::string> environment_file(const std::string& path) {
  std::vector<std::string> out;
  std::istringstream in(read_file(path));
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#' && line.find('=') != std::string::npos) out.push_back(line);
  return out;
}

class FleetMachine : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!sg::testing::have_etcd()) GTEST_SKIP() << "no /usr/bin/etcd (apt-get install etcd-server)";
    char tmpl[] = "/tmp/sg-e2e-fleet-machine-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ::chmod(dir_.c_str(), 0755);
    // Each machine's certificate names its address: its etcd member serves TLS with it. An etcd member also
    // checks a peer's certificate against the address the peer connects from, and the three "machines" of
    // one host connect from 127.0.0.1 (the kernel's pick), which m2 and m3 therefore list too.
    auto ca = run("bash " + source("deploy/gen-fleet-ca.sh") + " " + dir_ +
                  "/fleet-ca m1=127.0.0.1 m2=127.0.0.2,127.0.0.1 m3=127.0.0.3,127.0.0.1");
    ASSERT_EQ(ca.exit_code, 0) << ca.err;
    auto cert = run("bash " + source("deploy/gen-cert.sh") + " " + dir_ + "/tls sandbox.localhost");
    ASSERT_EQ(cert.exit_code, 0) << cert.err;
    write_file(dir_ + "/operator.token", "fleet-machine-test-token\n");
    ::chmod((dir_ + "/operator.token").c_str(), 0600);
    for (uint16_t* p : {&etcd_client_, &etcd_peer_, &fleet_, &api_, &ingress_}) *p = sg::testing::free_port();
  }
  void TearDown() override {
    for (auto& p : proxies_) p.stop();
    for (auto& n : nodes_) n.stop();
    for (auto& e : etcd_) e.stop();
    for (int i = 1; i <= kMachines; ++i)
      run("d=/sys/fs/cgroup/unified/" + cgroup(i) + "; for c in /sys/fs/cgroup/*/" + cgroup(i) + " $d; do " +
          "[ -d $c ] || continue; for p in $(cat $c/*/cgroup.procs 2>/dev/null); do kill -9 $p; done; " +
          "sleep 0.2; rmdir $c/* $c 2>/dev/null; done; true");
    if (!dir_.empty() && !HasFailure()) std::filesystem::remove_all(dir_);
  }

  static std::string ip(int i) { return "127.0.0." + std::to_string(i); }
  static std::string members() { return "m1=127.0.0.1,m2=127.0.0.2,m3=127.0.0.3"; }
  std::string root(int i) const { return dir_ + "/m" + std::to_string(i); }
  std::string cgroup(int i) const { return "sgtest-fm-" + std::to_string(::getpid()) + "-" + std::to_string(i); }
  std::string socket(int i) const { return root(i) + "/run/sandgate/node.sock"; }

  // deploy/fleet-machine.sh for machine i (NAME IP MEMBERS as given), the environment a test run needs.
  CommandResult script(int i, const std::string& args, const std::string& env_after = "") const {
    return run(script_command(i, args, env_after));
  }
  // `env_after`: assignments that override the test's own ("FLEET_CA_DIR=...").
  std::string script_command(int i, const std::string& args, const std::string& env_after = "") const {
    const std::string node_extra = "on_shutdown = \"terminate\"\ninit_path = \"" + bin("noderuntime/sandgate-init") +
                                   "\"\nimages_dir = \"" + test_image().store + "\"\ndefault_image = \"" +
                                   test_image().name + "\"\n";
    std::string env = "ROOT=" + shell_quote(root(i)) + " FLEET_CA_DIR=" + shell_quote(dir_ + "/fleet-ca") +
                      " OPERATOR_TOKEN_FILE=" + shell_quote(dir_ + "/operator.token") +
                      " TLS_CERT=" + shell_quote(dir_ + "/tls/server.pem") + " TLS_KEY=" + shell_quote(dir_ + "/tls/server.key") +
                      " INGRESS_LISTEN=" + ip(i) + ":" + std::to_string(ingress_) +
                      " ETCD_CLIENT_PORT=" + std::to_string(etcd_client_) + " ETCD_PEER_PORT=" + std::to_string(etcd_peer_) +
                      " FLEET_PORT=" + std::to_string(fleet_) + " API_PORT=" + std::to_string(api_) +
                      " CGROUP_NAME=" + cgroup(i) + " NODE_EXTRA=" + shell_quote(node_extra) +
                      " SANDGATE_PROXY=" + shell_quote(bin("proxy/sandgate-proxy")) + " " + env_after;
    return env + " bash " + source("deploy/fleet-machine.sh") + " " + args;
  }

  // curl through machine i's proxy, the name resolved to that machine's address.
  CommandResult curl_through(int i, const std::string& host) const {
    const std::string port = std::to_string(ingress_);
    return run("curl -sS --max-time 20 --cacert " + shell_quote(dir_ + "/tls/ca.pem") + " --resolve " + host + ":" +
               port + ":" + ip(i) + " -w '\\n%{http_code}' https://" + host + ":" + port + "/");
  }

  std::string dir_;
  uint16_t etcd_client_ = 0, etcd_peer_ = 0, fleet_ = 0, api_ = 0, ingress_ = 0;
  std::array<Daemon, kMachines> etcd_, nodes_, proxies_;
};

TEST_F(FleetMachine, TheScriptRefusesMembersThatDoNotAddUp) {
  auto missing = script(1, "m1 127.0.0.1 m2=127.0.0.2,m3=127.0.0.3");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("MEMBERS does not list m1=127.0.0.1"), std::string::npos) << missing.err;
  auto twice = script(1, "m1 127.0.0.1 m1=127.0.0.1,m2=127.0.0.1");
  EXPECT_NE(twice.exit_code, 0);
  EXPECT_NE(twice.err.find("member address '127.0.0.1' is listed twice"), std::string::npos) << twice.err;
  auto other = script(1, "m1 127.0.0.9 " + members());
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.err.find("MEMBERS says m1 is 127.0.0.1, not 127.0.0.9"), std::string::npos) << other.err;
  auto name = script(1, "M_1 127.0.0.1 M_1=127.0.0.1");
  EXPECT_NE(name.exit_code, 0);
  EXPECT_NE(name.err.find("is not a node name"), std::string::npos) << name.err;
  // etcd over TLS (the default) needs the member's certificate to name its address.
  ASSERT_EQ(run("bash " + source("deploy/gen-fleet-ca.sh") + " " + dir_ + "/no-ip-ca m1").exit_code, 0);
  auto no_ip = script(1, "m1 127.0.0.1 " + members(), "FLEET_CA_DIR=" + shell_quote(dir_ + "/no-ip-ca"));
  EXPECT_NE(no_ip.exit_code, 0);
  EXPECT_NE(no_ip.err.find("m1.pem does not name 127.0.0.1, which etcd's clients check"), std::string::npos) << no_ip.err;
  EXPECT_NE(no_ip.err.find("gen-fleet-ca.sh " + dir_ + "/no-ip-ca m1=127.0.0.1"), std::string::npos) << no_ip.err;
  // DNS:NAME entries (an etcd member on Kubernetes, dialled by name) become DNS names of the certificate.
  ASSERT_EQ(run("bash " + source("deploy/gen-fleet-ca.sh") + " " + dir_ + "/no-ip-ca e0=10.1.2.3,DNS:e0.etcd.ns.svc").exit_code, 0);
  auto sans = run("openssl x509 -in " + dir_ + "/no-ip-ca/e0.pem -noout -ext subjectAltName");
  EXPECT_NE(sans.out.find("DNS:e0, IP Address:10.1.2.3, DNS:e0.etcd.ns.svc"), std::string::npos) << sans.out;
  auto bad_dns = run("bash " + source("deploy/gen-fleet-ca.sh") + " " + dir_ + "/no-ip-ca e1=DNS:Not_A_Name");
  EXPECT_NE(bad_dns.err.find("'Not_A_Name' is not a DNS name"), std::string::npos) << bad_dns.err;
  auto tls_flag = script(1, "m1 127.0.0.1 " + members(), "ETCD_TLS=yes");
  EXPECT_NE(tls_flag.err.find("ETCD_TLS must be 0 or 1"), std::string::npos) << tls_flag.err;
  EXPECT_FALSE(std::filesystem::exists(root(1) + "/etc/sandgate/sandgate.toml"));
  // ETCD_TLS=0: clear text, asked for, and then the certificate need not name the address.
  auto clear = script(1, "m1 127.0.0.1 " + members(), "ETCD_TLS=0 FLEET_CA_DIR=" + shell_quote(dir_ + "/no-ip-ca"));
  ASSERT_EQ(clear.exit_code, 0) << clear.err;
  const std::string env = read_file(root(1) + "/etc/default/etcd");
  EXPECT_NE(env.find("ETCD_LISTEN_CLIENT_URLS=http://127.0.0.1:"), std::string::npos) << env;
  EXPECT_EQ(env.find("ETCD_CERT_FILE"), std::string::npos) << env;
  EXPECT_EQ(read_file(root(1) + "/etc/sandgate/sandgate.toml").find("etcd_cacert"), std::string::npos);
}

// A node of a fleet whose etcd runs elsewhere (more nodes than members; the Kubernetes packaging).
TEST_F(FleetMachine, AMachineWithoutAnEtcdMemberUsesTheGivenEndpoints) {
  auto both = run("ETCD_ENDPOINTS=http://10.0.0.9:2379 " + script_command(1, "m1 127.0.0.1 " + members()));
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.err.find("ETCD_ENDPOINTS is for MEMBERS \"-\""), std::string::npos) << both.err;
  auto none = script(1, "m1 127.0.0.1 -");
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.err.find("ETCD_ENDPOINTS must say where etcd is"), std::string::npos) << none.err;
  auto named = run("ETCD_ENDPOINTS=http://etcd:2379 " + script_command(1, "m1 127.0.0.1 -"));
  EXPECT_NE(named.exit_code, 0);
  EXPECT_NE(named.err.find("'http://etcd:2379' is not http(s)://IP:PORT"), std::string::npos) << named.err;

  auto mixed = script(1, "m1 127.0.0.1 -", "ETCD_ENDPOINTS=http://10.96.0.10:2379,https://10.96.0.11:2379");
  EXPECT_NE(mixed.err.find("all http:// or all https://"), std::string::npos) << mixed.err;
  auto ok = run("ETCD_ENDPOINTS=http://10.96.0.10:2379,http://10.96.0.11:2379 " + script_command(1, "m1 127.0.0.1 -"));
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.err.find("sandgate.toml loads"), std::string::npos) << ok.err;
  EXPECT_NE(ok.err.find("enable --now sandgate-node sandgate-proxy\n"), std::string::npos) << ok.err;
  const std::string conf = read_file(root(1) + "/etc/sandgate/sandgate.toml");
  EXPECT_NE(conf.find("etcd_endpoints = [\"http://10.96.0.10:2379\", \"http://10.96.0.11:2379\"]"), std::string::npos) << conf;
  EXPECT_FALSE(std::filesystem::exists(root(1) + "/etc/default/etcd"));
  EXPECT_FALSE(std::filesystem::exists(root(1) + "/etc/systemd/system/sandgate-node.service.d/fleet.conf"));
  EXPECT_EQ(conf.find("etcd_cacert"), std::string::npos) << conf;
  // An etcd elsewhere that speaks TLS: its members are checked against the fleet CA, and the node's fleet
  // certificate is presented (the config check loads them).
  auto over_tls = script(2, "m2 127.0.0.2 -", "ETCD_ENDPOINTS=https://10.96.0.10:2379");
  ASSERT_EQ(over_tls.exit_code, 0) << over_tls.err;
  const std::string tls_conf = read_file(root(2) + "/etc/sandgate/sandgate.toml");
  EXPECT_NE(tls_conf.find("etcd_cert = \"" + root(2) + "/etc/sandgate/fleet/m2.pem\""), std::string::npos) << tls_conf;
  EXPECT_EQ(tls_conf.find("etcd_server_name"), std::string::npos) << tls_conf;
  // Behind a Service's address (the Kubernetes packaging), the members' certificates are checked against its
  // name; a name over clear text, or not a DNS name, is refused.
  auto named_tls = script(3, "m3 127.0.0.3 -",
                          "ETCD_ENDPOINTS=https://10.96.0.10:2379 ETCD_SERVER_NAME=sandgate-etcd-client.sandgate.svc");
  ASSERT_EQ(named_tls.exit_code, 0) << named_tls.err;
  EXPECT_NE(named_tls.err.find("sandgate.toml loads"), std::string::npos) << named_tls.err;
  EXPECT_NE(read_file(root(3) + "/etc/sandgate/sandgate.toml").find("etcd_server_name = \"sandgate-etcd-client.sandgate.svc\""),
            std::string::npos);
  auto name_clear = script(3, "m3 127.0.0.3 -", "ETCD_ENDPOINTS=http://10.96.0.10:2379 ETCD_SERVER_NAME=etcd.svc");
  EXPECT_NE(name_clear.err.find("ETCD_SERVER_NAME is for https ETCD_ENDPOINTS"), std::string::npos) << name_clear.err;
  auto name_bad = script(3, "m3 127.0.0.3 -", "ETCD_ENDPOINTS=https://10.96.0.10:2379 ETCD_SERVER_NAME='a b'");
  EXPECT_NE(name_bad.err.find("is not a DNS name"), std::string::npos) << name_bad.err;
}

TEST_F(FleetMachine, ThreeMachinesFromTheScriptFormAFleetThatAnswersThroughEveryProxy) {
  { Cluster importer(ClusterOptions::node_only()); }  // the shared test image, imported once if it is not yet
  for (int i = 1; i <= kMachines; ++i) {
    auto r = script(i, "m" + std::to_string(i) + " " + ip(i) + " " + members());
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.err.find("sandgate.toml loads"), std::string::npos) << r.err;
    EXPECT_NE(read_file(root(i) + "/etc/systemd/system/sandgate-node.service.d/fleet.conf").find("After=etcd.service"),
              std::string::npos);
    struct stat st {};
    ASSERT_EQ(::stat((root(i) + "/etc/sandgate/fleet/m" + std::to_string(i) + ".key").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  // A second run on a machine is the same files again (an operator rerunning it after an edit).
  ASSERT_EQ(script(1, "m1 " + ip(1) + " " + members()).exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(root(1) + "/etc/sandgate/sandgate.toml.bak"));

  // etcd as Debian's etcd.service runs it: the binary, with the environment file.
  for (int i = 1; i <= kMachines; ++i) {
    const std::vector<std::string> env = environment_file(root(i) + "/etc/default/etcd");
    ASSERT_GE(env.size(), 16u);  // TLS for clients and peers, by default
    EXPECT_NE(std::find(env.begin(), env.end(), "ETCD_CLIENT_CERT_AUTH=true"), env.end());
    EXPECT_NE(std::find(env.begin(), env.end(), "ETCD_PEER_CLIENT_CERT_AUTH=true"), env.end());
    ASSERT_TRUE(etcd_[i - 1].start({"/usr/bin/etcd"}, root(i) + "/etcd.log", env));
  }
  for (int i = 1; i <= kMachines; ++i) {
    // Over TLS, with a certificate from the fleet CA (etcd refuses a client without one).
    const std::string ca = dir_ + "/fleet-ca/";
    const std::string health = "curl -sS --max-time 2 --cacert " + ca + "fleet-ca.pem --cert " + ca + "m1.pem --key " + ca +
                               "m1.key https://" + ip(i) + ":" + std::to_string(etcd_client_) + "/health";
    ASSERT_TRUE(eventually([&] { return run(health).out.find("\"true\"") != std::string::npos; }, 30s))
        << read_file(root(i) + "/etcd.log");
  }
  for (int i = 1; i <= kMachines; ++i) {
    std::filesystem::create_directories(root(i) + "/run/sandgate");  // the unit's RuntimeDirectory
    const std::string conf = root(i) + "/etc/sandgate/sandgate.toml";
    ASSERT_TRUE(nodes_[i - 1].start({bin("noderuntime/sandgate-node"), "--config", conf}, root(i) + "/node.log"));
    ASSERT_FALSE(nodes_[i - 1].wait_for("fleet: node m" + std::to_string(i) + " registered", 20000).empty())
        << nodes_[i - 1].log();
    ASSERT_TRUE(proxies_[i - 1].start({bin("proxy/sandgate-proxy"), "--config", conf}, root(i) + "/proxy.log"));
    ASSERT_FALSE(proxies_[i - 1].wait_for("sandgate-proxy ready", 15000).empty()) << proxies_[i - 1].log();
  }

  // Every node sees all three; the node API on each machine's address takes the operator token.
  const std::string cli = "HOME=" + shell_quote(dir_) + " XDG_CONFIG_HOME=" + shell_quote(dir_ + "/config") + " " +
                          bin("cli/sandgate");
  ASSERT_TRUE(eventually([&] {
    auto nodes = run(cli + " --api unix:" + socket(2) + " nodes");
    return nodes.out.find("m1") != std::string::npos && nodes.out.find("m3") != std::string::npos;
  }, 15s));
  // Machine 3's own view (over its API) may trail machine 2's by a watch event: asked until it has all three.
  CommandResult remote;
  eventually([&] {
    remote = run("curl -sS -H 'Authorization: Bearer fleet-machine-test-token' -w '\\n%{http_code}' http://" +
                 ip(3) + ":" + std::to_string(api_) + "/v1/fleet/nodes");
    const json j = json::parse(Cluster::body(remote), nullptr, false);
    return Cluster::http_code(remote) == 200 && j.is_object() && j.contains("nodes") && j["nodes"].size() == 3u;
  }, 15s);
  ASSERT_EQ(Cluster::http_code(remote), 200) << remote.out;
  EXPECT_EQ(json::parse(Cluster::body(remote), nullptr, false)["nodes"].size(), 3u) << remote.out;
  auto unauthenticated = run("curl -sS -o /dev/null -w '%{http_code}' http://" + ip(3) + ":" + std::to_string(api_) +
                             "/v1/sandboxes");
  EXPECT_EQ(unauthenticated.out, "401");

  // Created through machine 1, placed wherever placement chose; served through every machine's proxy.
  auto created = run(cli + " --api unix:" + socket(1) + " create --json --name web --public 8080 -- /usr/bin/python3 " +
                     tool("testserver.py") + " http 8080 web");
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;
  const std::string owner = json::parse(created.out, nullptr, false).value("node", "");
  EXPECT_TRUE(owner == "m1" || owner == "m2" || owner == "m3") << created.out;
  for (int i = 1; i <= kMachines; ++i) {
    ASSERT_TRUE(eventually([&] { return Cluster::http_code(curl_through(i, "8080-web.sandbox.localhost")) == 200; }, 30s))
        << "through m" << i << " (owner " << owner << "): " << curl_through(i, "8080-web.sandbox.localhost").out
        << read_file(root(i) + "/proxy.log");
  }
  // The name is the fleet's: taken, whichever machine is asked.
  auto again = run(cli + " --api unix:" + socket(3) + " create --name web -- /bin/sleep 60");
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE((again.out + again.err).find(owner), std::string::npos) << again.out << again.err;
  auto removed = run(cli + " --api unix:" + socket(owner.back() - '0') + " rm web");
  EXPECT_EQ(removed.exit_code, 0) << removed.out << removed.err;
  // Every member took every peer's certificate: one refused for its addresses ("rejected connection ...
  // does not match any of ...") leaves the cluster formed by luck. (A client that left mid-handshake is
  // logged as rejected too, with "EOF": not a refusal.)
  for (int i = 1; i <= kMachines; ++i)
    EXPECT_EQ(read_file(root(i) + "/etcd.log").find("does not match any of"), std::string::npos)
        << read_file(root(i) + "/etcd.log");
}

}  // namespace
}  // namespace sg::e2e
