// systemd readiness (Type=notify, common/service_notify.h): both daemons, started with $NOTIFY_SOCKET as
// systemd starts them, say READY=1 only once they serve, RELOADING=1 then READY=1 around a SIGHUP, and
// STOPPING=1 when they stop. The test plays systemd's part: a unix datagram socket it reads.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <filesystem>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    bound_ = fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~NotifySocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool bound() const { return bound_; }
  // The next message, or "" when none came within `timeout_ms`.
  std::string next(int timeout_ms = 20000) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return "";
    char buf[4096];
    ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool bound_ = false;
};

bool accepts(uint16_t port) {
  return run("bash -c " + shell_quote("exec 3<>/dev/tcp/127.0.0.1/" + std::to_string(port))).exit_code == 0;
}

TEST(ServiceNotify, BothDaemonsSayReadyOnceTheyServeAndAroundAReload) {
  char tmpl[] = "/tmp/sg-notify-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  NotifySocket notify(dir + "/notify.sock");
  ASSERT_TRUE(notify.bound());
  ::setenv("NOTIFY_SOCKET", (dir + "/notify.sock").c_str(), 1);
  auto cluster = std::make_unique<Cluster>();
  ::unsetenv("NOTIFY_SOCKET");  // only these two daemons were started with it
  Cluster& c = *cluster;

  std::string node_ready, proxy_ready;
  for (int i = 0; i < 2 && (node_ready.empty() || proxy_ready.empty()); ++i) {
    std::string m = notify.next();
    ASSERT_EQ(m.rfind("READY=1\nSTATUS=serving on ", 0), 0u) << "message " << i << ": " << m;
    (m.find("workers") != std::string::npos ? proxy_ready : node_ready) = m;
  }
  EXPECT_NE(node_ready.find(c.api()), std::string::npos) << node_ready;
  EXPECT_NE(proxy_ready.find("127.0.0.1:" + std::to_string(c.port())), std::string::npos) << proxy_ready;
  // Ready means serving: the proxy's port accepts and the node answers.
  EXPECT_TRUE(accepts(c.port()));
  EXPECT_EQ(c.cli("ls").exit_code, 0);

  ASSERT_EQ(::kill(c.proxy().pid(), SIGHUP), 0);
  EXPECT_EQ(notify.next(), "RELOADING=1\nSTATUS=reloading the configuration");
  EXPECT_EQ(notify.next(), proxy_ready) << "READY=1 again once the reload is done";
  ASSERT_EQ(::kill(c.node().pid(), SIGHUP), 0);
  EXPECT_EQ(notify.next(), "RELOADING=1\nSTATUS=reloading the configuration");
  EXPECT_EQ(notify.next(), node_ready);

  c.stop_proxy();
  EXPECT_EQ(notify.next().rfind("STOPPING=1\n", 0), 0u);
  cluster.reset();
  EXPECT_EQ(notify.next().rfind("STOPPING=1\n", 0), 0u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sg::e2e
