#include "noderuntime/egress.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <fstream>

#include "common/fd.h"
#include "common/subprocess.h"
#include "tests/netns.h"

namespace sg {
namespace {

using testing::connects;
using testing::in_netns;
using testing::listen_on;
using testing::Netns;

TEST(EgressPolicy, ListsNeedInternetAndAreBounded) {
  EXPECT_FALSE(make_egress_policy(false, {"10.0.0.0/8"}, {}));
  std::vector<std::string> many(kMaxEgressRules + 1, "10.0.0.0/8");
  auto r = make_egress_policy(true, {}, many);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kLimitExceeded);
  auto ok = make_egress_policy(true, {"192.0.2.0/24:80"}, {"192.0.2.9"});
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->allow_out.size(), 1u);
  EXPECT_EQ(ok->deny_out.size(), 1u);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// The real kernel path: a sandbox namespace attached to a bridge of the test's own, and an "internet" that is a
// namespace the test made (198.51.100.0/24, TEST-NET-2), reached through the host's routing and NAT. Nothing
// leaves the machine: the only routes added lead into the test's namespaces.
class EgressKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (network namespaces, nftables)";
    for (const char* tool : {"ip", "nft", "nsenter"})
      if (!run_tool({"sh", "-c", std::string("command -v ") + tool}))
        GTEST_SKIP() << tool << " is not installed";
    // ctest runs unit tests in parallel, and these share the fake internet's addresses and routes: one at a
    // time, across processes (the lock file lives in the build dir).
    lock_ = UniqueFd(::open(SANDGATE_BIN_DIR "/egress-kernel-test.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(lock_.valid());
    ASSERT_EQ(::flock(lock_.get(), LOCK_EX), 0);
    forward_before_ = read_file("/proc/sys/net/ipv4/ip_forward");
    options_.bridge = tag_;
    options_.table = tag_;
    options_.subnet = *parse_egress_rule("10.251.0.0/16");
    auto egress = Egress::create(options_);
    ASSERT_TRUE(egress) << egress.message();
    egress_ = std::move(*egress);

    Status st = internet_.start();
    ASSERT_TRUE(st) << st.message();
  }

  void TearDown() override {
    if (egress_) {
      Status st = egress_->teardown();
      EXPECT_TRUE(st) << st.message();
    }
    if (!forward_before_.empty()) {
      std::ofstream("/proc/sys/net/ipv4/ip_forward") << forward_before_;
    }
  }

  bool sandbox_connects(const Netns& sandbox, const std::string& address, uint16_t port) {
    return in_netns(sandbox.path(), [&] { return connects(address, port); });
  }

  EgressOptions options_;
  std::string tag_ = "sgt" + std::to_string(::getpid() % 100000);
  std::string forward_before_;
  UniqueFd lock_;  // held from SetUp to the fixture's end, after TearDown has removed everything
  std::unique_ptr<Egress> egress_;
  testing::FakeInternet internet_{tag_};
};

TEST_F(EgressKernel, WithoutAttachNothingIsReachable) {
  Netns sandbox;
  ASSERT_TRUE(sandbox.valid());
  EXPECT_FALSE(sandbox_connects(sandbox, "198.51.100.1", 8080));
}

TEST_F(EgressKernel, InternetReachesOutButNotTheHostNorAnotherSandbox) {
  Netns a, b;
  ASSERT_TRUE(a.valid() && b.valid());
  auto policy = make_egress_policy(true, {}, {});
  ASSERT_TRUE(policy);
  auto addr_a = egress_->attach(0, a.path(), *policy);
  ASSERT_TRUE(addr_a) << addr_a.message();
  EXPECT_EQ(*addr_a, "10.251.0.2");
  auto addr_b = egress_->attach(1, b.path(), *policy);
  ASSERT_TRUE(addr_b) << addr_b.message();

  EXPECT_TRUE(sandbox_connects(a, "198.51.100.1", 8080));
  EXPECT_TRUE(sandbox_connects(a, "198.51.100.2", 9090));

  // A server on the host, on every address (the bridge's gateway address included): not for sandboxes.
  UniqueFd host_server = listen_on("0.0.0.0", 18431);
  ASSERT_TRUE(host_server.valid());
  EXPECT_TRUE(connects(egress_->gateway(), 18431)) << "the host itself reaches it";
  EXPECT_FALSE(sandbox_connects(a, egress_->gateway(), 18431));

  // b listens on its own address; a cannot reach it (isolated bridge ports).
  UniqueFd b_server = in_netns(b.path(), [&] { return listen_on(*addr_b, 8080); });
  ASSERT_TRUE(b_server.valid());
  EXPECT_FALSE(sandbox_connects(a, *addr_b, 8080));

  // The metadata range is always denied (the internet namespace gets that address too, for this check).
  ASSERT_TRUE(internet_.ns().ip("addr add 169.254.169.254/32 dev lo\n"));
  ASSERT_TRUE(run_tool({"ip", "route", "add", "169.254.169.254/32", "via", "198.51.100.1"}));
  UniqueFd metadata = in_netns(internet_.ns().path(), [&] { return listen_on("169.254.169.254", 80); });
  ASSERT_TRUE(metadata.valid());
  EXPECT_FALSE(sandbox_connects(a, "169.254.169.254", 80));
  (void)run_tool({"ip", "route", "del", "169.254.169.254/32"});

  // Detached: nothing again.
  ASSERT_TRUE(egress_->detach(0));
  EXPECT_FALSE(sandbox_connects(a, "198.51.100.1", 8080));
  EXPECT_TRUE(sandbox_connects(b, "198.51.100.1", 8080));
}

TEST_F(EgressKernel, DenyOutBlocksOnlyItsEntries) {
  Netns sandbox;
  auto policy = make_egress_policy(true, {}, {"198.51.100.2"});
  ASSERT_TRUE(policy);
  ASSERT_TRUE(egress_->attach(3, sandbox.path(), *policy));
  EXPECT_TRUE(sandbox_connects(sandbox, "198.51.100.1", 8080));
  EXPECT_FALSE(sandbox_connects(sandbox, "198.51.100.2", 8080));
}

TEST_F(EgressKernel, AllowOutAllowsOnlyItsList) {
  Netns sandbox;
  auto policy = make_egress_policy(true, {"198.51.100.1/32:8080"}, {});
  ASSERT_TRUE(policy);
  ASSERT_TRUE(egress_->attach(4, sandbox.path(), *policy));
  EXPECT_TRUE(sandbox_connects(sandbox, "198.51.100.1", 8080));
  EXPECT_FALSE(sandbox_connects(sandbox, "198.51.100.1", 9090));
  EXPECT_FALSE(sandbox_connects(sandbox, "198.51.100.2", 8080));
  // Attaching again replaces the rules.
  auto open = make_egress_policy(true, {}, {});
  ASSERT_TRUE(egress_->attach(4, sandbox.path(), *open));
  EXPECT_TRUE(sandbox_connects(sandbox, "198.51.100.2", 8080));
}

}  // namespace
}  // namespace sg
