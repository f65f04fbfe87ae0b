// The fleet end to end, with nothing stood in: a real etcd member, two node + proxy pairs whose nodes
// register and claim names in it, and whose proxies route from their etcd view (EtcdDirectory) over the
// mutual-TLS hop. A sandbox created on node b answers through proxy a, and a's requests wake it on b.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <memory>

#include "common/etcd_client.h"
#include "common/net.h"
#include "tests/e2e/harness.h"
#include "tests/etcd_process.h"

namespace sg::e2e {
namespace {

// A port free now, for a fleet listener a node must advertise before its proxy binds it.
uint16_t free_port() {
  auto fd = listen_on(*parse_endpoint("127.0.0.1:0"), false);
  return fd ? *local_port(fd->get()) : 0;
}

class FleetRouting : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(sg::testing::have_etcd()) << "/usr/bin/etcd is missing: deploy/install-deps.sh installs etcd-server";
    char tmpl[] = "/tmp/sg-e2e-fleet-route-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::string pki;
    if (etcd_over_tls()) {
      pki = dir_ + "/etcd-pki";
      std::filesystem::create_directories(pki);
      ASSERT_TRUE(sg::testing::make_etcd_pki(pki)) << read_file(pki + "/make-pki.log");
    }
    etcd_ = std::make_unique<sg::testing::EtcdCluster>(dir_, etcd_members(), "", "127.0.0.1", pki);
    ASSERT_TRUE(etcd_->start_all()) << read_file(dir_ + "/etcd-0.log");
    auto gen = run("bash " + source("deploy/gen-fleet-ca.sh") + " " + dir_ + "/certs a b");
    ASSERT_EQ(gen.exit_code, 0) << gen.err;
  }
  void TearDown() override {
    nodes_.clear();
    etcd_.reset();
    if (!dir_.empty() && !HasFailure()) std::filesystem::remove_all(dir_);
  }

  virtual size_t etcd_members() const { return 1; }
  // https:// members that require a client certificate (as a production etcd does).
  virtual bool etcd_over_tls() const { return false; }

  Cluster& add(const std::string& name) {
    const uint16_t fleet = free_port();
    const std::string certs = dir_ + "/certs/";
    ClusterOptions o;
    o.proxy_extra = "activity_report_interval_ms = 200\nfleet_listen = \"127.0.0.1:" + std::to_string(fleet) +
                    "\"\nfleet_cert = \"" + certs + name + ".pem\"\nfleet_key = \"" + certs + name +
                    ".key\"\nfleet_ca = \"" + certs + "fleet-ca.pem\"\n";
    std::string endpoints;
    for (const auto& url : etcd_->urls()) endpoints += (endpoints.empty() ? "\"" : ", \"") + url + "\"";
    // advertise_api is not reachable, so placement falls back to the node asked: each create stays where
    // the test sent it (placement itself: Fleet.CreatesArePlaced...).
    o.node_extra = "\n[fleet]\netcd_endpoints = [" + endpoints + "]\nnode_name = \"" + name +
                   "\"\nadvertise_api = \"https://127.0.0.1:1\"\nadvertise_ingress = \"127.0.0.1:" +
                   std::to_string(fleet) + "\"\nlease_ttl_secs = 3\netcd_timeout_ms = 500\n" + etcd_->tls_config();
    nodes_.push_back(std::make_unique<Cluster>(o));
    Cluster& c = *nodes_.back();
    EXPECT_FALSE(c.node().wait_for("fleet: node " + name + " registered", 10000).empty()) << c.node().log();
    return c;
  }

  // Pairs a and b, with sandbox `name` (idle timeout 600 s) serving on b and answering through a once a's
  // view has seen its claim.
  std::pair<Cluster&, Cluster&> a_and_b_serving(const std::string& name) {
    Cluster& a = add("a");
    Cluster& b = add("b");
    b.create_http_sandbox(name, 8080, "--timeout 600");
    b.wait_until_serving(name, 8080);
    EXPECT_TRUE(eventually([&] { return Cluster::http_code(a.curl("8080-" + name + ".sandbox.localhost")) == 200; },
                           std::chrono::seconds(10)))
        << a.proxy().log();
    return {a, b};
  }

  std::string dir_;
  std::unique_ptr<sg::testing::EtcdCluster> etcd_;
  std::vector<std::unique_ptr<Cluster>> nodes_;
};

TEST_F(FleetRouting, ASandboxOnAnotherNodeAnswersThroughThisProxyFromTheEtcdView) {
  Cluster& a = add("a");
  Cluster& b = add("b");
  b.create_http_sandbox("web", 8080, "--timeout 2");
  b.wait_until_serving("web", 8080);

  // Once a's view has seen the claim (a watch event), a routes to b; before that it answers 404.
  CommandResult r;
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(r = a.curl("8080-web.sandbox.localhost")) == 200; },
                         std::chrono::seconds(10)))
      << r.out << r.err << a.proxy().log();
  EXPECT_EQ(Cluster::body(r), "hello from web");
  auto at_a = a.wait_access_entry([](const nlohmann::json& e) { return e.value("hop_to", "") == "b"; });
  EXPECT_GT(at_a.value("bytes_out", 0), 0) << at_a.dump();

  // It sleeps on b (2 s idle); a request through a wakes it there and gets its answer.
  ASSERT_TRUE(eventually([&] { return b.get("web").value("state", "") == "suspended"; }, std::chrono::seconds(15)));
  r = a.curl("8080-web.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 200) << r.out << r.err;
  EXPECT_EQ(b.get("web").value("state", ""), "running");

  // The name is the fleet's: a create of it through a is refused, naming b.
  auto dup = a.cli("create --name web -- /bin/sleep 60");
  EXPECT_NE(dup.exit_code, 0);
  EXPECT_NE((dup.out + dup.err).find("'b'"), std::string::npos) << dup.out << dup.err;
}

// The ports a connection must know at its ClientHello come with the owner's etcd key: through a, a public
// raw-TCP port of a sandbox on b is forwarded at once (the server there speaks first), an h2c port gets
// HTTP/2 while an HTTP/1.1 port stays HTTP/1.1.
TEST_F(FleetRouting, AnotherNodesPublicTcpAndH2cPortsAnswerThroughThisProxyAsOnTheirOwn) {
  Cluster& a = add("a");
  Cluster& b = add("b");
  auto banner = b.cli("create --json --name ban --public 7100/tcp -- /usr/bin/python3 " + tool("testserver.py") +
                      " banner 7100 from-b");
  ASSERT_EQ(banner.exit_code, 0) << banner.out << banner.err;
  auto h2 = b.cli("create --json --name hh --public 7000/h2c -- " + tool("h2_recorder") + " 7000");
  ASSERT_EQ(h2.exit_code, 0) << h2.out << h2.err;
  b.create_http_sandbox("web", 8080, "--timeout 600");
  b.wait_until_serving("web", 8080);
  // a's view has web's claim, and so the two made before it (one watch, in order).
  CommandResult v;
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(v = a.curl("8080-web.sandbox.localhost", "/", "--http2")) == 200; },
                         std::chrono::seconds(10))) << v.out << v.err;
  // An HTTP/1.1 port stays HTTP/1.1 (offering h2 there would hand the backend a connection it cannot read).
  EXPECT_EQ(a.curl("8080-web.sandbox.localhost", "/", "--http2 -o /dev/null -w '%{http_version}'").out, "1.1");

  // The client sends its line only after the banner came: a proxy waiting for a request head first would
  // never pass the banner on, and would answer the line with an error.
  const std::string host = "7100-ban.sandbox.localhost";
  auto talk = run("(sleep 1; printf 'ping\\n') | timeout 20 openssl s_client -quiet -ign_eof -verify_return_error"
                  " -servername " + host + " -CAfile " + shell_quote(a.ca()) + " -connect 127.0.0.1:" +
                      std::to_string(a.port()) + " 2>/dev/null",
                  30);
  EXPECT_EQ(talk.out, "banner from-b\necho: ping\n") << talk.err << a.proxy().log();
  auto entry = a.wait_access_entry([](const nlohmann::json& e) {
    return e.value("hop_to", "") == "b" && e.value("sni", "").starts_with("7100-");
  });
  EXPECT_GT(entry.value("bytes_out", 0), 0) << entry.dump();

  // HTTP/2 end to end through the hop, to an h2c port (h2_recorder speaks only HTTP/2).
  v = a.curl("7000-hh.sandbox.localhost", "/", "--http2 -o /dev/null -w '%{http_version}'");
  EXPECT_EQ(v.out, "2") << v.err << a.proxy().log();
}

class FleetRoutingOverTls : public FleetRouting {
 protected:
  bool etcd_over_tls() const override { return true; }
};

// The same fleet with etcd serving only TLS and requiring client certificates: the nodes register, claim and
// keep their lease over https://, and the proxies' watch follows them, so a sandbox on b answers through a.
TEST_F(FleetRoutingOverTls, NodesAndProxiesShareTheFleetThroughAnEtcdThatRequiresClientCertificates) {
  ASSERT_NE(etcd_->url(0).rfind("https://", 0), std::string::npos);
  auto [a, b] = a_and_b_serving("web");
  auto r = a.curl("8080-web.sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 200) << r.out << r.err << a.proxy().log();
  EXPECT_EQ(Cluster::body(r), "hello from web");
  // b's claim is in etcd, read back over TLS.
  etcd::Client client(etcd_->options());
  auto claim = client.range("/sandgate/sandboxes/web");
  ASSERT_TRUE(claim) << claim.message();
  EXPECT_EQ(claim->kvs.size(), 1u);
}

// Compaction: a proxy whose watch broke while etcd compacted past what it had seen must not route from a view
// that lost the events in between. Proxy a is stopped (SIGSTOP) while on b one sandbox goes and another
// comes, etcd compacts to its latest revision (physically) and restarts, so a's watch stream breaks; once a
// runs again it lists again and routes to what exists now. A proxy restarted after the compaction lists from
// scratch and routes the same. (A watch that starts from an already compacted revision, between a list and
// its watch, is reported by the client (EtcdClientTest); that window is not hit here.)
TEST_F(FleetRouting, AProxyWhoseWatchBrokeAcrossACompactionListsAgainAndARestartedOneRoutesRight) {
  using namespace std::chrono_literals;
  // References, not a structured binding: clang 14 (the sanitizer tree) cannot capture one in a lambda.
  auto clusters = a_and_b_serving("old");
  Cluster& a = clusters.first;
  Cluster& b = clusters.second;
  ASSERT_FALSE(HasFailure());

  ASSERT_EQ(::kill(a.proxy().pid(), SIGSTOP), 0);
  struct Resume {
    pid_t pid;
    ~Resume() { ::kill(pid, SIGCONT); }
  } resume{a.proxy().pid()};
  ASSERT_EQ(b.cli("rm old").exit_code, 0);
  b.create_http_sandbox("new", 8080, "--timeout 600");
  b.wait_until_serving("new", 8080);
  auto status = run("curl -s -X POST -d '{\"key\": \"eA==\"}' " + etcd_->url(0) + "/v3/kv/range");
  const auto revision = nlohmann::json::parse(status.out, nullptr, false)["header"].value("revision", "0");
  ASSERT_NE(revision, "0") << status.out;
  auto compacted = run("curl -s -X POST -d '{\"revision\": \"" + revision + "\", \"physical\": true}' " +
                       etcd_->url(0) + "/v3/kv/compaction");
  ASSERT_EQ(compacted.exit_code, 0) << compacted.err;
  ASSERT_EQ(compacted.out.find("error"), std::string::npos) << compacted.out;
  etcd_->stop(0);
  ASSERT_TRUE(etcd_->start_all()) << read_file(dir_ + "/etcd-0.log");
  const size_t from = a.proxy().log().size();
  ::kill(a.proxy().pid(), SIGCONT);

  EXPECT_FALSE(a.proxy().wait_for("listing again", 15000, from).empty()) << a.proxy().log().substr(from);
  CommandResult r;
  ASSERT_TRUE(eventually([&] { return Cluster::http_code(r = a.curl("8080-new.sandbox.localhost")) == 200; }, 10s))
      << r.out << a.proxy().log().substr(from);
  EXPECT_EQ(Cluster::body(r), "hello from new");
  EXPECT_EQ(Cluster::http_code(a.curl("8080-old.sandbox.localhost")), 404);

  a.stop_proxy();
  a.start_proxy();
  EXPECT_TRUE(eventually([&] { return Cluster::http_code(r = a.curl("8080-new.sandbox.localhost")) == 200; }, 10s))
      << r.out << a.proxy().log();
  EXPECT_EQ(Cluster::http_code(a.curl("8080-old.sandbox.localhost")), 404);
}

// etcd with three members: with the leader killed everything goes on (a new leader within the election
// timeout); with a second member killed there is no quorum: running sandboxes keep answering through both
// proxies from their last view, creates are refused with a 503 that says why, and all recovers once the
// members are back.
class FleetQuorum : public FleetRouting {
 protected:
  size_t etcd_members() const override { return 3; }
};

TEST_F(FleetQuorum, OneMemberDownChangesNothingTwoDownKeepRunningSandboxesAndRefuseCreatesThenAllRecovers) {
  using namespace std::chrono_literals;
  // References, not a structured binding: clang 14 (the sanitizer tree) cannot capture one in a lambda.
  auto clusters = a_and_b_serving("web");
  Cluster& a = clusters.first;
  Cluster& b = clusters.second;
  ASSERT_FALSE(HasFailure());

  int leader = -1;
  ASSERT_TRUE(eventually([&] { return (leader = etcd_->leader()) >= 0; }, 10s));
  etcd_->stop(static_cast<size_t>(leader), SIGKILL);
  // A create through a: the claim waits out the election at most.
  CommandResult created;
  ASSERT_TRUE(eventually([&] { return (created = a.cli("create --name after-leader -- /bin/sleep 600")).exit_code == 0; },
                         15s))
      << created.out << created.err << a.node().log();
  EXPECT_EQ(Cluster::http_code(a.curl("8080-web.sandbox.localhost")), 200);

  const size_t second = (static_cast<size_t>(leader) + 1) % 3;
  etcd_->stop(second, SIGKILL);
  // No quorum: the nodes cannot renew, so within half the lease TTL (3 s) they fence themselves.
  CommandResult refused;
  const std::string body = R"({"name": "no-quorum", "command": ["/bin/sleep", "600"]})";
  ASSERT_TRUE(eventually([&] {
    refused = a.api_raw("POST", "/v1/sandboxes", body);
    return Cluster::http_code(refused) == 503 && Cluster::body(refused).find("etcd") != std::string::npos;
  }, 20s)) << refused.out << refused.err;
  for (int i = 0; i < 5; i++) {
    EXPECT_EQ(Cluster::body(a.curl("8080-web.sandbox.localhost")), "hello from web") << a.proxy().log();
    EXPECT_EQ(Cluster::body(b.curl("8080-web.sandbox.localhost")), "hello from web") << b.proxy().log();
  }

  ASSERT_TRUE(etcd_->start(static_cast<size_t>(leader)));
  ASSERT_TRUE(etcd_->start(second));
  ASSERT_TRUE(eventually([&] { return (created = a.cli("create --name recovered -- /bin/sleep 600")).exit_code == 0; },
                         30s))
      << created.out << created.err << a.node().log();
  EXPECT_EQ(Cluster::http_code(a.curl("8080-web.sandbox.localhost")), 200);
  // A refused create's claim may still land once etcd has quorum again (its answer timed out, not its
  // txn); the node that sent it releases it at its next reconcile (after the next renewal), so the name is
  // free again within a renewal or two, not at once.
  CommandResult again;
  EXPECT_TRUE(eventually([&] { return (again = b.cli("create --name no-quorum -- /bin/sleep 600")).exit_code == 0; },
                         10s))
      << "the refused create kept the name: " << again.out << again.err;
}

}  // namespace
}  // namespace sg::e2e
