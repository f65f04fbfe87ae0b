// Network namespaces for tests: one held open by a child process (so tools can enter it by path), code run on
// a thread inside one, and plain TCP probes. Shared by the unit tests (egress) and the e2e tests.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/subprocess.h"

namespace sg::testing {

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
  Status ip(const std::string& commands) const {
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

// The inode of the namespace `fd` refers to (0 if none), and of the network namespace a socket lives in
// (SIOCGSKNS): equal when the socket was made inside it.
inline ino_t namespace_inode(int fd) {
  struct stat st{};
  return ::fstat(fd, &st) == 0 ? st.st_ino : 0;
}
inline ino_t socket_namespace_inode(int sock) {
  UniqueFd ns(::ioctl(sock, SIOCGSKNS));
  return ns.valid() ? namespace_inode(ns.get()) : 0;
}
inline ino_t own_netns_inode() {
  UniqueFd own(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  return namespace_inode(own.get());
}

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

inline UniqueFd listen_on(const std::string& address, uint16_t port) {
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
inline bool connects(const std::string& address, uint16_t port, int deadline_ms = 1500) {
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

// A stand-in for the internet: a namespace the test owns with 198.51.100.1 and .2 (TEST-NET-2), each listening on
// 8080 and 9090, joined to the host by a veth (`<tag>i` on the host, 198.51.100.254) so the host routes to it.
// Nothing leaves the machine: the only route added leads into this namespace.
class FakeInternet {
 public:
  explicit FakeInternet(std::string tag) : host_if_(std::move(tag) + "i") {}
  ~FakeInternet() {
    if (made_) (void)run_tool({"ip", "link", "del", host_if_});
  }
  Status start() {
    if (!ns_.valid()) return fail(Error::kIo, "cannot make the fake internet's namespace");
    std::string p = ns_.path();
    const std::string pid = p.substr(6, p.find("/ns/") - 6);
    if (auto r = run_tool({"ip", "link", "add", host_if_, "type", "veth", "peer", "name", "eth0", "netns", pid}); !r)
      return r.failure();
    made_ = true;
    if (auto r = run_tool({"ip", "-batch", "-"}, "addr add 198.51.100.254/24 dev " + host_if_ + "\nlink set " + host_if_ + " up\n");
        !r)
      return r.failure();
    if (Status st = ns_.ip("link set lo up\nlink set eth0 up\naddr add 198.51.100.1/24 dev eth0\n"
                           "addr add 198.51.100.2/24 dev eth0\n");
        !st)
      return st;
    for (const char* addr : {"198.51.100.1", "198.51.100.2"})
      for (uint16_t port : {8080, 9090}) {
        UniqueFd fd = in_netns(ns_.path(), [&] { return listen_on(addr, port); });
        if (!fd.valid()) return fail(Error::kIo, std::string("cannot listen on ") + addr + ":" + std::to_string(port));
        servers_.push_back(std::move(fd));
      }
    return {};
  }
  const Netns& ns() const { return ns_; }

 private:
  std::string host_if_;
  Netns ns_;
  bool made_ = false;
  std::vector<UniqueFd> servers_;
};

}  // namespace sg::testing
