#include "noderuntime/egress.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <thread>

#include "common/fd.h"
#include "common/subprocess.h"

namespace sg {
namespace {

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

// A network namespace held open by a child process (so it has a /proc/PID/ns/net path tools can enter).
class Netns {
 public:
  Netns() {
    int ready[2];
    if (::pipe(ready) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      char ok = ::unshare(CLONE_NEWNET) == 0 ? 'y' : 'n';
      (void)!::write(ready[1], &ok, 1);
      for (;;) ::pause();
    }
    char ok = 'n';
    (void)!::read(ready[0], &ok, 1);
    ::close(ready[0]);
    ::close(ready[1]);
    if (ok != 'y') stop();
  }
  ~Netns() { stop(); }
  bool valid() const { return pid_ > 0; }
  std::string path() const { return "/proc/" + std::to_string(pid_) + "/ns/net"; }
  Status ip(std::string commands) const {
    auto r = run_tool({"nsenter", "--net=" + path(), "ip", "-batch", "-"}, commands);
    if (!r) return r.failure();
    return {};
  }

 private:
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }
  pid_t pid_ = -1;
};

// Runs `fn` on a thread that has entered `netns` (setns switches one thread only).
template <typename Fn>
auto in_netns(const std::string& netns, Fn fn) {
  decltype(fn()) result{};
  std::thread t([&] {
    UniqueFd fd(::open(netns.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.valid() && ::setns(fd.get(), CLONE_NEWNET) == 0) result = fn();
  });
  t.join();
  return result;
}

UniqueFd listen_on(const std::string& address, uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  ::inet_pton(AF_INET, address.c_str(), &sa.sin_addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(fd.get(), 16) != 0) return {};
  return fd;
}

// Does a TCP handshake to address:port complete within the deadline? (A listening socket completes it without
// accept(); a dropped SYN runs into the deadline.)
bool connects(const std::string& address, uint16_t port, int deadline_ms = 1500) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  ::inet_pton(AF_INET, address.c_str(), &sa.sin_addr);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) return true;
  if (errno != EINPROGRESS) return false;
  pollfd p{fd.get(), POLLOUT, 0};
  if (::poll(&p, 1, deadline_ms) != 1) return false;
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  return err == 0;
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
    forward_before_ = read_file("/proc/sys/net/ipv4/ip_forward");
    tag_ = "sgt" + std::to_string(::getpid() % 100000);
    options_.bridge = tag_;
    options_.table = tag_;
    options_.subnet = *parse_egress_rule("10.251.0.0/16");
    auto egress = Egress::create(options_);
    ASSERT_TRUE(egress) << egress.message();
    egress_ = std::move(*egress);

    ASSERT_TRUE(internet_.valid());
    inet_if_ = tag_ + "i";
    ASSERT_TRUE(run_tool({"ip", "link", "add", inet_if_, "type", "veth", "peer", "name", "eth0", "netns",
                                   pid_of(internet_)}));
    ASSERT_TRUE(run_tool({"ip", "-batch", "-"},
                          "addr add 198.51.100.254/24 dev " + inet_if_ + "\nlink set " + inet_if_ + " up\n"));
    Status st = internet_.ip(
        "link set lo up\nlink set eth0 up\naddr add 198.51.100.1/24 dev eth0\naddr add 198.51.100.2/24 dev eth0\n");
    ASSERT_TRUE(st) << st.message();
    for (const char* addr : {"198.51.100.1", "198.51.100.2"})
      for (uint16_t port : {8080, 9090}) {
        UniqueFd fd = in_netns(internet_.path(), [&] { return listen_on(addr, port); });
        ASSERT_TRUE(fd.valid()) << addr << ":" << port;
        servers_.push_back(std::move(fd));
      }
  }

  void TearDown() override {
    if (egress_) {
      Status st = egress_->teardown();
      EXPECT_TRUE(st) << st.message();
    }
    if (!inet_if_.empty()) (void)run_tool({"ip", "link", "del", inet_if_});
    if (!forward_before_.empty()) {
      std::ofstream("/proc/sys/net/ipv4/ip_forward") << forward_before_;
    }
  }

  static std::string pid_of(const Netns& ns) {
    std::string p = ns.path();
    return p.substr(6, p.find("/ns/") - 6);
  }

  bool sandbox_connects(const Netns& sandbox, const std::string& address, uint16_t port) {
    return in_netns(sandbox.path(), [&] { return connects(address, port); });
  }

  EgressOptions options_;
  std::string tag_, inet_if_, forward_before_;
  std::unique_ptr<Egress> egress_;
  Netns internet_;
  std::vector<UniqueFd> servers_;
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
  ASSERT_TRUE(internet_.ip("addr add 169.254.169.254/32 dev lo\n"));
  ASSERT_TRUE(run_tool({"ip", "route", "add", "169.254.169.254/32", "via", "198.51.100.1"}));
  UniqueFd metadata = in_netns(internet_.path(), [&] { return listen_on("169.254.169.254", 80); });
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
