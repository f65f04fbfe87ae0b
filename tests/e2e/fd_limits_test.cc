// Descriptor exhaustion at the ingress with a real sandgate-proxy and raw TCP sockets: the connection limit
// derived from RLIMIT_NOFILE, accept backing off instead of spinning when the process is out of descriptors,
// and the per-client-address connection limit. A legit request (curl to api.<domain>) must get through as
// soon as a flood is gone.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

const char* kOperatorToken = "op-fd-limits-6d2a91";
constexpr int kFlood = 2000;

ClusterOptions options(bool start_proxy, std::string proxy_extra) {
  ClusterOptions o;
  o.operator_token = kOperatorToken;
  o.start_proxy = start_proxy;
  o.proxy_extra = std::move(proxy_extra);
  return o;
}

// The cluster's proxy started under `ulimit -n <nofile>`: the harness starts it with the test's own limit.
// sh's ulimit sets soft and hard, so the proxy's raise to the hard limit stays at `nofile`.
struct LimitedProxy {
  Daemon daemon;
  uint16_t port = 0;

  void start(Cluster& c, int nofile) {
    std::string cmd = "ulimit -n " + std::to_string(nofile) + " && exec " + shell_quote(bin("proxy/sandgate-proxy")) +
                      " --config " + shell_quote(c.config_path());
    ASSERT_TRUE(daemon.start({"/bin/sh", "-c", cmd}, c.dir() + "/proxy.log"));
    std::string line = daemon.wait_for("sandgate-proxy ready", 15000);
    ASSERT_FALSE(line.empty()) << "proxy did not start:\n" << daemon.log();
    // "... ready on 127.0.0.1:PORT (..."
    auto on = line.find(" on 127.0.0.1:");
    ASSERT_NE(on, std::string::npos) << line;
    port = static_cast<uint16_t>(std::atoi(line.c_str() + on + 14));
    ASSERT_NE(port, 0) << line;
  }

  // curl to api.<domain> with the operator token, giving up after max_secs.
  CommandResult curl_api(const Cluster& c, int max_secs) const {
    std::string host = "api.sandbox.localhost:" + std::to_string(port);
    return run("curl -sS -m " + std::to_string(max_secs) + " --cacert " + shell_quote(c.ca()) + " --resolve " + host +
                   ":127.0.0.1 -H " + shell_quote(std::string("Authorization: Bearer ") + kOperatorToken) +
                   " -w '\\n%{http_code}' https://" + host + "/v1/sandboxes",
               max_secs + 5);
  }
};

// utime + stime of a process, in seconds.
double cpu_seconds(pid_t pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  std::istringstream in(stat.substr(paren + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  // After "(comm) ": state is field 3; utime and stime are fields 14 and 15.
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// The proxy's CPU use over `window`, as a fraction of one core. A fixed window is the measurement itself,
// not a wait for an event.
double cpu_share(pid_t pid, std::chrono::milliseconds window) {
  double before = cpu_seconds(pid);
  auto t0 = std::chrono::steady_clock::now();
  ::usleep(static_cast<useconds_t>(window.count()) * 1000);
  double after = cpu_seconds(pid);
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return (after - before) / elapsed;
}

size_t open_fds(pid_t pid) {
  size_t n = 0;
  DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (!d) return 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

// A plain TCP connection to the proxy (no TLS: it sits in the handshake phase). Non-blocking connect, so a
// full accept queue (the proxy not accepting) cannot stall the test: the SYN is then simply retried by the
// kernel. -1 on failure.
int connect_raw(uint16_t port, bool blocking) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (blocking ? 0 : SOCK_NONBLOCK), 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  return fd;
}

struct Flood {
  std::vector<int> fds;
  ~Flood() { close_all(); }
  void open(uint16_t port, int n) {
    for (int i = 0; i < n; ++i) {
      int fd = connect_raw(port, false);
      ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
      fds.push_back(fd);
    }
  }
  void close_all() {
    for (int fd : fds) ::close(fd);
    fds.clear();
  }
};

// The flood needs ~2,000 descriptors in this process too.
void raise_own_fd_limit() {
  rlimit lim{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &lim), 0);
  if (lim.rlim_cur < 4096) {
    lim.rlim_cur = std::max<rlim_t>(4096, lim.rlim_cur);
    if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < lim.rlim_cur) lim.rlim_max = lim.rlim_cur;  // root may
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0) << std::strerror(errno);
  }
}

size_t count_cause(const Cluster& c, const std::string& cause) {
  size_t n = 0;
  for (const auto& e : c.access_log()) n += e.value("cause", "") == cause ? 1 : 0;
  return n;
}

size_t count_in(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// The legit request right after a flood ends: within 1 s, curl's own start and TLS handshake included.
void expect_served_within_a_second(const Cluster& c, const LimitedProxy& p) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = p.curl_api(c, 1);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(Cluster::http_code(r), 200) << r.out << r.err;
  EXPECT_LT(ms, 1000.0);
  std::printf("legit request after the flood: HTTP %d in %.0f ms\n", Cluster::http_code(r), ms);
}

TEST(FdLimits, RlimitCapsConnectionsAndAFloodDoesNotSpin) {
  raise_own_fd_limit();
  // Handshakes must outlast the test: the flood is held, not timed out. The flood comes from one address,
  // whose own limit (256 by default) must not be what refuses it.
  Cluster c(options(false, "handshake_timeout_ms = 60000\nmax_connections_per_client = 10000\n"));
  LimitedProxy p;
  p.start(c, 1024);
  // The route caches' spares first: 1024 / 16 / 2 workers = 32 each. Then (1024 - 64 spares - 64 reserved)
  // / 3 fds per connection = 298, below the configured 10000; / 6 where kTLS is possible (splice pipes):
  // 149.
  std::string line = p.daemon.wait_for("effective max_connections", 1000);
  const bool pipes = line.find(" at 6 fds each") != std::string::npos;
  const size_t held = pipes ? 149 : 298;
  const std::string expected = "RLIMIT_NOFILE 1024 (hard 1024) carries " + std::to_string(held) + " connections at " +
                               (pipes ? "6" : "3") + " fds each and 32 spare sockets per worker's route cache; " +
                               "effective max_connections " + std::to_string(held);
  EXPECT_NE(line.find(expected), std::string::npos) << line;

  Flood flood;
  flood.open(p.port, kFlood);
  // Every connection past the 149th is closed at accept with its cause; none is left waiting for a
  // descriptor, so the proxy never reaches EMFILE.
  ASSERT_TRUE(eventually([&] { return count_cause(c, "too_many_connections") >= kFlood - held; },
                         std::chrono::seconds(30)))
      << count_cause(c, "too_many_connections") << " refused";
  double share = cpu_share(p.daemon.pid(), std::chrono::milliseconds(2000));
  std::printf("proxy CPU while %d connections are held under ulimit -n 1024: %.1f%% of one core; %zu fds open\n",
              kFlood, share * 100, open_fds(p.daemon.pid()));
  EXPECT_LT(share, 0.30);
  EXPECT_EQ(count_cause(c, "too_many_connections"), kFlood - held);
  EXPECT_LT(open_fds(p.daemon.pid()), 1024u);
  EXPECT_EQ(p.daemon.log().find("pausing accepts"), std::string::npos) << "the derived limit should prevent EMFILE";

  flood.close_all();
  // The held ones see EOF and end as client_closed, giving their slots back.
  ASSERT_TRUE(eventually([&] { return count_cause(c, "client_closed") >= held; }, std::chrono::seconds(10)));
  expect_served_within_a_second(c, p);
}

TEST(FdLimits, AcceptBacksOffWhenOutOfDescriptors) {
#ifdef SANDGATE_SANITIZED  // the daemons under test are sanitizer builds (CMakeLists.txt)
  // UBSan's vptr check tests memory with a pipe; a process without a spare descriptor then reports false
  // "invalid vptr" errors (seen in fmt), so a sanitizer build of the proxy cannot be run out of descriptors.
  GTEST_SKIP() << "a sanitizer build cannot run at its descriptor limit (UBSan needs a pipe per vptr check)";
#endif
  raise_own_fd_limit();
  Cluster c(options(false, "handshake_timeout_ms = 60000\n"));
  LimitedProxy p;
  p.start(c, 1024);
  // Lower the running proxy's soft limit below what its derived max_connections assumes (as another
  // descriptor-hungry part of the process would), so accept itself fails with EMFILE.
  const pid_t pid = p.daemon.pid();
  const size_t base = open_fds(pid);
  rlimit low{static_cast<rlim_t>(base + 8), 1024};
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &low, nullptr), 0) << std::strerror(errno);

  Flood flood;
  flood.open(p.port, kFlood);
  // Out of descriptors: accept failed (the message names the errno, whatever the proxy does about it).
  ASSERT_FALSE(p.daemon.wait_for("Too many open files", 10000).empty()) << p.daemon.log();
  double share = cpu_share(pid, std::chrono::milliseconds(2000));
  std::printf("proxy CPU while out of descriptors with %d connections queued: %.1f%% of one core\n", kFlood,
              share * 100);
  EXPECT_LT(share, 0.30);
  // One line per worker per episode (2 workers), not one per failed accept.
  std::string log = p.daemon.log();
  EXPECT_LE(count_in(log, "pausing accepts"), 2u) << log.substr(0, 4000);
  EXPECT_EQ(count_in(log, "Too many open files"), count_in(log, "pausing accepts"));

  flood.close_all();
  // The descriptors come back (the part of the process that held them let go). The 2,000 dead connections
  // still queued are drained first; with only 8 descriptors that alone would take many pauses.
  rlimit restored{1024, 1024};
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &restored, nullptr), 0) << std::strerror(errno);
  expect_served_within_a_second(c, p);
  // The episode is over: accepting again is logged once.
  EXPECT_FALSE(p.daemon.wait_for("accepting again after", 5000).empty());
}

TEST(FdLimits, PerClientLimitRefusesTheFourthConnection) {
  Cluster c(options(true, "max_connections_per_client = 3\nhandshake_timeout_ms = 60000\n"));
  const pid_t pid = c.proxy().pid();
  const size_t base = open_fds(pid);
  // One at a time, each accepted (a descriptor more in the proxy) before the next: with two workers the
  // kernel may hand connections to either, so only this makes "the 4th" well defined.
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) {
    int fd = connect_raw(c.port(), true);
    ASSERT_GE(fd, 0);
    held.push_back(fd);
    ASSERT_TRUE(eventually([&] { return open_fds(pid) >= base + held.size(); }, std::chrono::seconds(5)));
  }
  int fourth = connect_raw(c.port(), true);
  ASSERT_GE(fourth, 0);
  // The proxy closes it at accept: EOF (or a reset) on our side.
  pollfd pf{fourth, POLLIN, 0};
  ASSERT_EQ(::poll(&pf, 1, 5000), 1);
  char byte;
  EXPECT_LE(::recv(fourth, &byte, 1, 0), 0);
  ::close(fourth);
  auto entry = c.wait_access_entry(
      [](const nlohmann::json& e) { return e.value("cause", "") == "client_connection_limit"; });
  EXPECT_EQ(entry.value("cause", ""), "client_connection_limit");
  EXPECT_EQ(entry.value("client", "").rfind("127.0.0.1:", 0), 0u) << entry.dump();
  EXPECT_EQ(count_cause(c, "client_connection_limit"), 1u);
  // The three are still open (nothing to read, no EOF).
  for (int fd : held) {
    pollfd h{fd, POLLIN, 0};
    EXPECT_EQ(::poll(&h, 1, 0), 0);
  }
  // Closing one gives its slot back: a request from the same address gets in.
  ::close(held.back());
  held.pop_back();
  std::string op = std::string("-H ") + shell_quote(std::string("Authorization: Bearer ") + kOperatorToken);
  EXPECT_TRUE(eventually(
      [&] { return Cluster::http_code(c.curl("api.sandbox.localhost", "/v1/sandboxes", op, 10)) == 200; },
      std::chrono::seconds(5)));
  for (int fd : held) ::close(fd);
}

}  // namespace
}  // namespace sg::e2e
