// noderuntime/netns.h against the real kernel (the node's unit tests run as root).
#include "noderuntime/netns.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <set>
#include <string>

namespace sg {
namespace {

ino_t inode_of(int fd) {
  struct stat st{};
  return ::fstat(fd, &st) == 0 ? st.st_ino : 0;
}

ino_t thread_netns() {
  struct stat st{};
  return ::stat("/proc/thread-self/ns/net", &st) == 0 ? st.st_ino : 0;
}

// Listens on 127.0.0.1:<ephemeral>; returns the port, 0 on failure.
uint16_t listen_loopback(UniqueFd& fd) {
  fd = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd.get(), 4) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return 0;
  return ntohs(a.sin_port);
}

int connect_loopback(uint16_t port) {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  return ::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
}

class NetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
    auto h = current_netns();
    ASSERT_TRUE(h.ok()) << h.message();
    home_ = std::move(*h);
  }
  UniqueFd home_;
};

TEST_F(NetnsTest, NewNamespaceHasOnlyItsLoopbackUpAndTheThreadIsBackHome) {
  const ino_t before = thread_netns();
  auto ns = create_netns(home_.get());
  ASSERT_TRUE(ns.ok()) << ns.message();
  EXPECT_EQ(thread_netns(), before);
  EXPECT_NE(inode_of(ns->get()), before);

  std::set<std::string> interfaces;
  unsigned lo_flags = 0;
  Status s = in_netns(ns->get(), home_.get(), [&] {
    EXPECT_NE(thread_netns(), before);
    if (struct if_nameindex* all = ::if_nameindex()) {
      for (struct if_nameindex* i = all; i->if_index != 0; ++i) interfaces.insert(i->if_name);
      ::if_freenameindex(all);
    }
    UniqueFd probe(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    ifreq ifr{};
    std::snprintf(ifr.ifr_name, IFNAMSIZ, "lo");
    if (::ioctl(probe.get(), SIOCGIFFLAGS, &ifr) == 0) lo_flags = static_cast<unsigned short>(ifr.ifr_flags);
  });
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(thread_netns(), before);
  EXPECT_EQ(interfaces, std::set<std::string>{"lo"});
  EXPECT_TRUE(lo_flags & IFF_UP);
}

TEST_F(NetnsTest, ListenerInsideIsReachableOnlyFromInside) {
  auto ns = create_netns(home_.get());
  ASSERT_TRUE(ns.ok()) << ns.message();
  UniqueFd listener;
  uint16_t port = 0;
  int inside = -1;
  ASSERT_TRUE(in_netns(ns->get(), home_.get(), [&] {
    port = listen_loopback(listener);
    inside = connect_loopback(port);
  }).ok());
  ASSERT_NE(port, 0);
  EXPECT_EQ(inside, 0);
  // The same port on the host's loopback: nobody (or someone else) listens there, never this listener.
  UniqueFd accept_probe;
  if (connect_loopback(port) == 0) {
    sockaddr_in peer{};
    socklen_t len = sizeof peer;
    ::fcntl(listener.get(), F_SETFL, O_NONBLOCK);
    // One connection is queued from inside; a second would mean the host's connect reached it too.
    int first = ::accept(listener.get(), reinterpret_cast<sockaddr*>(&peer), &len);
    int second = ::accept(listener.get(), reinterpret_cast<sockaddr*>(&peer), &len);
    EXPECT_GE(first, 0);
    EXPECT_LT(second, 0);
    if (first >= 0) ::close(first);
    if (second >= 0) ::close(second);
  }
}

TEST_F(NetnsTest, SwitchingIntoAnInvalidFdFailsAndStaysHome) {
  const ino_t before = thread_netns();
  bool ran = false;
  Status s = in_netns(-1, home_.get(), [&] { ran = true; });
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(ran);
  EXPECT_EQ(thread_netns(), before);
}

}  // namespace
}  // namespace sg
