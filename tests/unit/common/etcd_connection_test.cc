// common/etcd_connection (through common/etcd_client) against a real etcd that serves clients over TLS and
// requires a client certificate (--client-cert-auth), as a production etcd does.
#include "common/etcd_connection.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/etcd_client.h"
#include "tests/etcd_process.h"

namespace sg::etcd {
namespace {

using namespace std::chrono_literals;
using testing::EtcdCluster;

class EtcdTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::have_etcd()) return;
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/sg-etcd-tls-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    pki_ = dir_ + "/pki";
    std::filesystem::create_directories(pki_);
    ASSERT_TRUE(testing::make_etcd_pki(pki_)) << "openssl failed; see " << pki_ << "/make-pki.log";
    cluster_ = new EtcdCluster(dir_, 1, "", "127.0.0.1", pki_);
    ASSERT_TRUE(cluster_->start_all()) << "etcd did not come up over TLS; see " << dir_ << "/etcd-0.log";
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  void SetUp() override {
    if (!testing::have_etcd()) GTEST_SKIP() << "/usr/bin/etcd is missing (apt-get install etcd-server)";
    prefix_ = std::string("/tls/") + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "/";
  }
  static ClientOptions with(TlsFiles tls) {
    ClientOptions o = cluster_->options(1000ms);
    o.tls = std::move(tls);
    return o;
  }

  static inline std::string dir_, pki_;
  static inline EtcdCluster* cluster_ = nullptr;
  std::string prefix_;
};

TEST_F(EtcdTlsTest, CallsAndAWatchWorkOverTlsAndLaterConnectionsResumeTheSession) {
  Client c(cluster_->options());
  ASSERT_TRUE(c.ready());
  auto w = c.watch(prefix_, prefix_end(prefix_), 0);
  ASSERT_TRUE(w) << w.message();
  for (int i = 0; i < 5; i++) ASSERT_TRUE(c.put(prefix_ + std::to_string(i), "v" + std::to_string(i)));
  auto r = c.range_prefix(prefix_);
  ASSERT_TRUE(r) << r.message();
  ASSERT_EQ(r->kvs.size(), 5u);
  EXPECT_EQ(r->kvs[4].value, "v4");
  // The watch stream, a TLS connection of its own, delivers the five puts.
  size_t seen = 0;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (seen < 5 && std::chrono::steady_clock::now() < deadline) {
    auto b = (*w)->next(2s);
    ASSERT_TRUE(b) << b.message();
    if (b->kind == WatchBatch::Kind::kEvents) seen += b->events.size();
  }
  EXPECT_EQ(seen, 5u);
  // Seven connections (the watch, five puts, the range): all but the first resumed the session.
  EXPECT_GE(c.resumed_handshakes(), 6u);
  // cancel() still interrupts a watch blocked on a TLS stream: next() returns when it comes, not before
  // (it was blocked) and not at its own deadline.
  std::atomic<bool> waiting{false};
  std::thread t([&] {
    while (!waiting.load()) std::this_thread::yield();
    std::this_thread::sleep_for(300ms);
    (*w)->cancel();
  });
  auto start = std::chrono::steady_clock::now();
  waiting = true;
  auto b = (*w)->next(10s);
  const auto took = std::chrono::steady_clock::now() - start;
  t.join();
  ASSERT_FALSE(b);
  EXPECT_NE(b.message().find("cancelled"), std::string::npos) << b.message();
  EXPECT_GE(took, 250ms) << "next() returned before the cancel";
  EXPECT_LT(took, 5s);
}

TEST_F(EtcdTlsTest, AMemberSignedByAnotherCaIsRefusedWithTheSettingToChange) {
  Client c(with({pki_ + "/other-ca.pem", pki_ + "/client.pem", pki_ + "/client.key", ""}));
  auto r = c.range("/x");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("certificate is not trusted"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("fleet.etcd_cacert"), std::string::npos) << r.message();
  // The system's trust store does not know the test CA either.
  Client system_store(with({"", pki_ + "/client.pem", pki_ + "/client.key", ""}));
  EXPECT_FALSE(system_store.range("/x"));
}

TEST_F(EtcdTlsTest, TheCertificateMustNameTheMembersAddressOrTheConfiguredName) {
  // The member's certificate has IP:127.0.0.1 and DNS:etcd.test.
  Client by_name(with({pki_ + "/ca.pem", pki_ + "/client.pem", pki_ + "/client.key", "etcd.test"}));
  EXPECT_TRUE(by_name.range("/x"));
  Client wrong_name(with({pki_ + "/ca.pem", pki_ + "/client.pem", pki_ + "/client.key", "etcd.example"}));
  auto r = wrong_name.range("/x");
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("does not name etcd.example"), std::string::npos) << r.message();
  // A member at an address its certificate does not carry: a TLS server with the member's certificate on
  // 127.0.0.2 (openssl s_server), which the certificate does not name.
  const uint16_t port = testing::free_port();
  pid_t server = ::fork();
  ASSERT_GE(server, 0);
  if (server == 0) {
    const std::string accept = "127.0.0.2:" + std::to_string(port), cert = pki_ + "/member.pem", key = pki_ + "/member.key";
    int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, 0), ::dup2(null, 1), ::dup2(null, 2);
    ::execlp("openssl", "openssl", "s_server", "-quiet", "-accept", accept.c_str(), "-cert", cert.c_str(), "-key",
             key.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_TRUE(testing::wait_until([&] { return connect_blocking(*parse_endpoint("127.0.0.2:" + std::to_string(port)), 200).ok(); },
                                  10s));
  ClientOptions elsewhere = with({pki_ + "/ca.pem", pki_ + "/client.pem", pki_ + "/client.key", ""});
  elsewhere.members = {*parse_member("https://127.0.0.2:" + std::to_string(port))};
  auto r2 = Client(elsewhere).range("/x");
  ::kill(server, SIGKILL);
  ::waitpid(server, nullptr, 0);
  ASSERT_FALSE(r2);
  EXPECT_EQ(r2.error(), Error::kUnavailable);
  EXPECT_NE(r2.message().find("does not name its address 127.0.0.2"), std::string::npos) << r2.message();
}

TEST_F(EtcdTlsTest, WithoutAClientCertificateEtcdRefusesAndTheMessageSaysWhatToSet) {
  Client c(with({pki_ + "/ca.pem", "", "", ""}));
  ASSERT_TRUE(c.ready());
  auto r = c.put(prefix_ + "k", "v");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("etcd_cert"), std::string::npos) << r.message();
}

TEST_F(EtcdTlsTest, AClearTextClientGetsNoAnswerFromATlsMember) {
  ClientOptions o = cluster_->options(500ms);
  o.members = {*parse_member("http://127.0.0.1:" + std::to_string(cluster_->client_port(0)))};
  auto r = Client(o).range("/x");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnavailable);
}

TEST(EtcdTlsSetup, FilesThatDoNotLoadAreClearErrorsBeforeAnyConnection) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/sg-etcd-tls-setup-XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  ASSERT_TRUE(testing::make_etcd_pki(dir)) << "openssl failed; see " << dir << "/make-pki.log";
  EXPECT_TRUE(TlsSetup::create({dir + "/ca.pem", dir + "/client.pem", dir + "/client.key", ""}, 1));
  auto missing = TlsSetup::create({dir + "/nope.pem", "", "", ""}, 1);
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find(dir + "/nope.pem"), std::string::npos) << missing.message();
  auto half = TlsSetup::create({"", dir + "/client.pem", "", ""}, 1);
  ASSERT_FALSE(half);
  EXPECT_NE(half.message().find("go together"), std::string::npos) << half.message();
  auto mismatched = TlsSetup::create({"", dir + "/client.pem", dir + "/member.key", ""}, 1);
  ASSERT_FALSE(mismatched);
  EXPECT_NE(mismatched.message().find("does not belong to"), std::string::npos) << mismatched.message();
  std::ofstream(dir + "/garbage.pem") << "not a certificate\n";
  EXPECT_FALSE(TlsSetup::create({dir + "/garbage.pem", "", "", ""}, 1));
  // A client whose TLS cannot be set up says so on every call, and ready() says it first.
  ClientOptions o;
  o.members = {*parse_member("https://127.0.0.1:1")};
  o.tls = {dir + "/nope.pem", "", "", ""};
  Client c(o);
  EXPECT_FALSE(c.ready());
  EXPECT_EQ(c.range("/x").message(), c.ready().message());
  std::filesystem::remove_all(dir);
}

TEST(EtcdMember, ParsesSchemesAndRefusesTheRest) {
  auto plain = parse_member("http://127.0.0.1:2379");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->endpoint.port, 2379);
  EXPECT_FALSE(plain->tls);
  auto tls = parse_member("https://[::1]:2379/");
  ASSERT_TRUE(tls);
  EXPECT_TRUE(tls->tls);
  EXPECT_EQ(tls->to_string(), "https://[::1]:2379");
  EXPECT_TRUE(parse_member("127.0.0.1:2379/"));
  EXPECT_FALSE(parse_member("unix://x"));
  EXPECT_FALSE(parse_member("https://etcd.example:2379"));
  EXPECT_FALSE(parse_member("unix:/x"));
}

}  // namespace
}  // namespace sg::etcd
