// common/etcd_client against a real etcd (Debian's 3.4) the suite starts on loopback in its temp dir.
#include "common/etcd_client.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <thread>

#include "tests/etcd_process.h"

namespace sg::etcd {
namespace {

using namespace std::chrono_literals;
using testing::EtcdCluster;

class EtcdClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::have_etcd()) return;
    char tmpl[] = "/tmp/sg-etcd-client-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    cluster_ = new EtcdCluster(dir_, 1);
    ASSERT_TRUE(cluster_->start_all()) << "etcd did not come up; see " << dir_ << "/etcd-0.log";
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  void SetUp() override {
    if (!testing::have_etcd()) GTEST_SKIP() << "/usr/bin/etcd is missing (apt-get install etcd-server)";
    // Each test works under its own prefix, so they do not see each other's keys.
    prefix_ = std::string("/t/") + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "/";
  }
  Client client(ClientOptions extra = {}) {
    ClientOptions o = cluster_->options();
    if (extra.max_answer_bytes != ClientOptions{}.max_answer_bytes) o.max_answer_bytes = extra.max_answer_bytes;
    if (extra.max_value_bytes != ClientOptions{}.max_value_bytes) o.max_value_bytes = extra.max_value_bytes;
    return Client(o);
  }

  static inline std::string dir_;
  static inline EtcdCluster* cluster_ = nullptr;
  std::string prefix_;
};

TEST_F(EtcdClientTest, PutRangeDeleteRoundTrip) {
  Client c = client();
  std::string binary("v\0\xff\n\"x", 6);  // base64 carries any bytes
  auto rev = c.put(prefix_ + "a", binary);
  ASSERT_TRUE(rev) << rev.message();
  EXPECT_GT(*rev, 0);
  ASSERT_TRUE(c.put(prefix_ + "b", "2"));
  auto one = c.range(prefix_ + "a");
  ASSERT_TRUE(one) << one.message();
  ASSERT_EQ(one->kvs.size(), 1u);
  EXPECT_EQ(one->kvs[0].value, binary);
  EXPECT_EQ(one->kvs[0].create_revision, *rev);
  auto all = c.range_prefix(prefix_);
  ASSERT_TRUE(all);
  ASSERT_EQ(all->kvs.size(), 2u);
  EXPECT_EQ(all->kvs[1].key, prefix_ + "b");
  auto limited = c.range(prefix_, prefix_end(prefix_), 1);
  ASSERT_TRUE(limited);
  EXPECT_EQ(limited->kvs.size(), 1u);
  EXPECT_TRUE(limited->more);
  auto deleted = c.delete_range(prefix_, prefix_end(prefix_));
  ASSERT_TRUE(deleted);
  EXPECT_EQ(*deleted, 2);
  auto none = c.range_prefix(prefix_);
  ASSERT_TRUE(none);
  EXPECT_TRUE(none->kvs.empty());
}

TEST_F(EtcdClientTest, TxnClaimSucceedsOnlyWhileTheKeyIsAbsent) {
  Client c = client();
  std::string key = prefix_ + "name";
  auto claim = [&](const std::string& who) {
    return c.txn({{.key = key, .target = Compare::Target::kCreateRevision, .op = Compare::Op::kEqual, .number = 0}},
                 {{.kind = Op::Kind::kPut, .key = key, .value = who}}, {{.kind = Op::Kind::kRange, .key = key}});
  };
  auto first = claim("node-1");
  ASSERT_TRUE(first) << first.message();
  EXPECT_TRUE(first->succeeded);
  EXPECT_TRUE(first->ranges.empty());
  auto second = claim("node-2");
  ASSERT_TRUE(second) << second.message();
  EXPECT_FALSE(second->succeeded);
  ASSERT_EQ(second->ranges.size(), 1u);
  ASSERT_EQ(second->ranges[0].kvs.size(), 1u);
  EXPECT_EQ(second->ranges[0].kvs[0].value, "node-1");  // the loser learns the winner
}

TEST_F(EtcdClientTest, ConcurrentClaimsHaveExactlyOneWinner) {
  std::string key = prefix_ + "name";
  std::atomic<int> wins{0}, losses{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 20; i++) {
    threads.emplace_back([&, i] {
      Client c = client();
      auto r = c.txn({{.key = key, .target = Compare::Target::kCreateRevision, .number = 0}},
                     {{.kind = Op::Kind::kPut, .key = key, .value = std::to_string(i)}}, {});
      if (r && r->succeeded) wins++;
      else if (r) losses++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wins.load(), 1);
  EXPECT_EQ(losses.load(), 19);
}

TEST_F(EtcdClientTest, LeaseKeepaliveRevokeAndDetach) {
  Client c = client();
  auto lease = c.grant(30);
  ASSERT_TRUE(lease) << lease.message();
  EXPECT_EQ(lease->ttl_secs, 30);
  ASSERT_TRUE(c.put(prefix_ + "bound", "x", lease->id));
  ASSERT_TRUE(c.put(prefix_ + "detached", "x", lease->id));
  ASSERT_TRUE(c.put(prefix_ + "detached", "y"));  // a put without a lease takes the key off it
  auto bound = c.range(prefix_ + "bound");
  ASSERT_TRUE(bound);
  ASSERT_EQ(bound->kvs.size(), 1u);
  EXPECT_EQ(bound->kvs[0].lease, lease->id);
  auto ttl = c.keepalive(lease->id);
  ASSERT_TRUE(ttl) << ttl.message();
  EXPECT_EQ(*ttl, 30);
  ASSERT_TRUE(c.revoke(lease->id));
  auto left = c.range_prefix(prefix_);
  ASSERT_TRUE(left);
  ASSERT_EQ(left->kvs.size(), 1u);
  EXPECT_EQ(left->kvs[0].key, prefix_ + "detached");
  auto gone = c.keepalive(lease->id);
  ASSERT_FALSE(gone);
  EXPECT_EQ(gone.error(), Error::kNotFound);
  EXPECT_TRUE(c.revoke(lease->id));  // revoking a gone lease is not an error
  EXPECT_EQ(c.grant(0).error(), Error::kInvalidArgument);
}

TEST_F(EtcdClientTest, LeaseExpiresWithoutKeepalive) {
  Client c = client();
  auto lease = c.grant(1);
  ASSERT_TRUE(lease);
  ASSERT_TRUE(c.put(prefix_ + "k", "x", lease->id));
  // etcd expires a 1 s lease within about two seconds (its minimum TTL handling and the leader's checks).
  EXPECT_TRUE(testing::wait_until([&] {
    auto r = c.range(prefix_ + "k");
    return r && r->kvs.empty();
  }, 5s));
}

TEST_F(EtcdClientTest, WatchReportsPutsAndDeletes) {
  Client c = client();
  auto w = c.watch(prefix_, prefix_end(prefix_), 0);
  ASSERT_TRUE(w) << w.message();
  ASSERT_TRUE(c.put(prefix_ + "a", "1"));
  ASSERT_TRUE(c.delete_range(prefix_ + "a"));
  std::vector<WatchEvent> seen;
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (seen.size() < 2 && std::chrono::steady_clock::now() < deadline) {
    auto b = (*w)->next(500ms);
    ASSERT_TRUE(b) << b.message();
    for (auto& e : b->events) seen.push_back(e);
  }
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].type, WatchEvent::Type::kPut);
  EXPECT_EQ(seen[0].kv.value, "1");
  EXPECT_EQ(seen[1].type, WatchEvent::Type::kDelete);
  EXPECT_EQ(seen[1].kv.key, prefix_ + "a");
  // Nothing more: an idle read comes back at its deadline, the stream still up.
  auto idle = (*w)->next(100ms);
  ASSERT_TRUE(idle);
  EXPECT_EQ(idle->kind, WatchBatch::Kind::kIdle);
}

TEST_F(EtcdClientTest, WatchFromACompactedRevisionSaysSo) {
  Client c = client();
  auto r1 = c.put(prefix_ + "a", "1");
  auto r2 = c.put(prefix_ + "a", "2");
  ASSERT_TRUE(r1 && r2);
  // Compaction is not in the client (the fleet never compacts; etcd's own --auto-compaction does): the
  // gateway's endpoint is called here directly.
  std::string cmd = "curl -sf " + cluster_->url(0) + "/v3/kv/compaction -d '{\"revision\":\"" + std::to_string(*r2) + "\"}' >/dev/null";
  ASSERT_EQ(::system(cmd.c_str()), 0);
  // etcd confirms the watch ("created"), then cancels it with the compact revision: re-list and watch anew.
  auto w = c.watch(prefix_, prefix_end(prefix_), *r1);
  ASSERT_TRUE(w) << w.message();
  auto b = (*w)->next(5s);
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(b->kind, WatchBatch::Kind::kCompacted);
  EXPECT_EQ(b->compact_revision, *r2);
}

TEST_F(EtcdClientTest, CancelUnblocksAWatch) {
  Client c = client();
  auto w = c.watch(prefix_, prefix_end(prefix_), 0);
  ASSERT_TRUE(w);
  auto start = std::chrono::steady_clock::now();
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);  // the cancel must find next() already blocked
    (*w)->cancel();
  });
  auto b = (*w)->next(10s);
  t.join();
  EXPECT_FALSE(b);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST_F(EtcdClientTest, FailsOverToTheNextMember) {
  ClientOptions o = cluster_->options();
  // A member that refuses connections (nothing listens) first in the list.
  o.members.insert(o.members.begin(), *parse_member("http://127.0.0.1:" + std::to_string(testing::free_port())));
  Client c(o);
  ASSERT_TRUE(c.put(prefix_ + "k", "v"));
  EXPECT_EQ(c.preferred_member(), 1u);
  auto w = c.watch(prefix_, prefix_end(prefix_), 0);
  ASSERT_TRUE(w) << w.message();
  EXPECT_EQ((*w)->member(), 1u);
}

TEST_F(EtcdClientTest, NoMemberAnsweringIsUnavailable) {
  ClientOptions o;
  o.members = {*parse_member("127.0.0.1:" + std::to_string(testing::free_port()))};
  Client c(o);
  auto r = c.range("/x");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("no etcd member answered"), std::string::npos) << r.message();
}

TEST_F(EtcdClientTest, AMemberThatHangsTimesOut) {
  // A second, paused etcd: it accepts connections (the kernel does) and never answers.
  std::string dir = dir_ + "/paused";
  std::filesystem::create_directories(dir);
  EtcdCluster paused(dir, 1);
  ASSERT_TRUE(paused.start_all());
  ASSERT_TRUE(paused.pause(0));
  Client c(paused.options(300ms));
  auto start = std::chrono::steady_clock::now();
  auto r = c.range("/x");
  auto took = std::chrono::steady_clock::now() - start;
  paused.resume(0);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("timed out"), std::string::npos) << r.message();
  EXPECT_LT(took, 2s);
}

TEST_F(EtcdClientTest, LimitsAreExplicit) {
  ClientOptions small;
  small.max_answer_bytes = 1024;
  small.max_value_bytes = 100;
  Client c = client(small);
  EXPECT_EQ(c.put(prefix_ + "big", std::string(101, 'x')).error(), Error::kLimitExceeded);
  EXPECT_EQ(c.put(std::string(2000, 'k'), "v").error(), Error::kLimitExceeded);
  EXPECT_EQ(c.put("", "v").error(), Error::kInvalidArgument);
  for (int i = 0; i < 20; i++) ASSERT_TRUE(c.put(prefix_ + std::to_string(i), std::string(90, 'v')));
  auto r = c.range_prefix(prefix_);  // 20 values of 90 bytes, base64'd: over 1 KiB
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kLimitExceeded) << r.message();
}

TEST(EtcdMember, PrefixEnd) {
  EXPECT_EQ(prefix_end("/sandgate/"), "/sandgate0");
  EXPECT_EQ(prefix_end(std::string("a\xff", 2)), "b");
}

}  // namespace
}  // namespace sg::etcd
