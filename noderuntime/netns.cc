#include "noderuntime/netns.h"

#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"

namespace sg {
namespace {

Status back_home(int home) {
  if (::setns(home, CLONE_NEWNET) == 0) return {};
  const int err = errno;
  spdlog::critical("cannot return to the node's network namespace: {}", std::strerror(err));
  return fail_errno("setns back into the node's network namespace", err);
}

// A new namespace's loopback is down: QEMU's hostfwd listeners and the node's connects to them need it up.
Status loopback_up() {
  UniqueFd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return fail_errno("socket", errno);
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  if (::ioctl(s.get(), SIOCGIFFLAGS, &ifr) != 0) return fail_errno("SIOCGIFFLAGS lo", errno);
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
  if (::ioctl(s.get(), SIOCSIFFLAGS, &ifr) != 0) return fail_errno("SIOCSIFFLAGS lo up", errno);
  return {};
}

}  // namespace

Result<UniqueFd> current_netns() {
  // thread-self, not self: the namespace is per thread, and this is the thread that switches.
  UniqueFd fd(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return fail_errno("open /proc/thread-self/ns/net", errno);
  return fd;
}

Result<UniqueFd> create_netns(int home) {
  if (::unshare(CLONE_NEWNET) != 0) {
    const int err = errno;
    return fail(err == EPERM ? Error::kPermissionDenied : Error::kIo,
                std::string("cannot create a network namespace (unshare CLONE_NEWNET: ") + std::strerror(err) +
                    "); the node needs CAP_SYS_ADMIN for it");
  }
  auto fd = current_netns();
  Status up = fd ? loopback_up() : Status{};
  if (Status s = back_home(home); !s) return s.failure();
  if (!fd) return fd.failure();
  if (!up) return up.failure();
  return fd;
}

Status in_netns(int target, int home, const std::function<void()>& fn) {
  if (::setns(target, CLONE_NEWNET) != 0) return fail_errno("setns into the sandbox's network namespace", errno);
  fn();
  return back_home(home);
}

}  // namespace sg
