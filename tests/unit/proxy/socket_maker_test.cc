// The socket maker as the proxy starts it (its own binary run with --socket-maker), against network namespaces
// this test makes: where its sockets live, what it refuses, what it keeps of root, and that it ends with the
// proxy's ends.
#include "proxy/socket_maker.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/net.h"
#include "tests/netns.h"

namespace sg {
namespace {

const std::string kProxyBinary = std::string(SANDGATE_BIN_DIR) + "/proxy/sandgate-proxy";

ino_t inode_of(int fd) {
  struct stat st{};
  return ::fstat(fd, &st) == 0 ? st.st_ino : 0;
}

// The network namespace a socket lives in (SIOCGSKNS: a descriptor for it).
ino_t namespace_of_socket(int sock) {
  UniqueFd ns(::ioctl(sock, SIOCGSKNS));
  return ns.valid() ? inode_of(ns.get()) : 0;
}

// "CapEff:\t0000000000200000" and the like from /proc/PID/status.
std::string status_field(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return line.substr(field.size() + 1);
  return "";
}

bool exits_within(pid_t pid, std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    if (::waitpid(pid, nullptr, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

class SocketMakerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "the socket maker needs root to start";
  }
};

TEST_F(SocketMakerTest, MakesSocketsInsideTheNamespaceItIsGivenAndTheyReachWhatListensThere) {
  testing::Netns sandbox;
  ASSERT_TRUE(sandbox.valid());
  ASSERT_TRUE(sandbox.ip("link set lo up\n"));
  // A listener on loopback inside the sandbox's namespace only.
  UniqueFd listener = testing::in_netns(sandbox.path(), [] { return testing::listen_on("127.0.0.1", 0); });
  ASSERT_TRUE(listener.valid());
  auto port = local_port(listener.get());
  ASSERT_TRUE(port);
  UniqueFd netns(::open(sandbox.path().c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(netns.valid());

  auto maker = start_socket_maker(2, 65534, 65534, kProxyBinary);
  ASSERT_TRUE(maker) << maker.message();
  ASSERT_EQ(maker->clients.size(), 2u);
  for (auto& client : maker->clients) {
    auto made = client->make(netns.get(), 3);
    ASSERT_TRUE(made) << made.message();
    ASSERT_EQ(made->size(), 3u);
    for (const UniqueFd& s : *made) {
      EXPECT_EQ(namespace_of_socket(s.get()), inode_of(netns.get()));
      EXPECT_TRUE(::fcntl(s.get(), F_GETFD) & FD_CLOEXEC);
      EXPECT_TRUE(::fcntl(s.get(), F_GETFL) & O_NONBLOCK);
    }
    // Connected, one reaches the sandbox's listener: the host has none on that port.
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(*port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int rc = ::connect(made->front().get(), reinterpret_cast<sockaddr*>(&to), sizeof to);
    ASSERT_TRUE(rc == 0 || errno == EINPROGRESS) << strerror(errno);
    pollfd p{made->front().get(), POLLOUT, 0};
    ASSERT_EQ(::poll(&p, 1, 2000), 1);
    int err = -1;
    socklen_t len = sizeof err;
    ::getsockopt(made->front().get(), SOL_SOCKET, SO_ERROR, &err, &len);
    EXPECT_EQ(err, 0) << strerror(err);
  }
  auto most = maker->clients[0]->make(netns.get(), kMaxSpareSockets);
  ASSERT_TRUE(most) << most.message();
  EXPECT_EQ(most->size(), kMaxSpareSockets);
}

TEST_F(SocketMakerTest, KeepsCapSysAdminAloneAsTheUserItIsGiven) {
  auto maker = start_socket_maker(1, 65534, 65533, kProxyBinary);
  ASSERT_TRUE(maker) << maker.message();
  const std::string sys_admin = "\t0000000000200000";  // 1 << CAP_SYS_ADMIN (21)
  EXPECT_EQ(status_field(maker->pid, "CapEff"), sys_admin);
  EXPECT_EQ(status_field(maker->pid, "CapPrm"), sys_admin);
  EXPECT_EQ(status_field(maker->pid, "CapBnd"), sys_admin);
  EXPECT_EQ(status_field(maker->pid, "CapInh"), "\t0000000000000000");
  EXPECT_EQ(status_field(maker->pid, "CapAmb"), "\t0000000000000000");
  EXPECT_EQ(status_field(maker->pid, "Uid"), "\t65534\t65534\t65534\t65534");
  EXPECT_EQ(status_field(maker->pid, "Gid"), "\t65533\t65533\t65533\t65533");
  EXPECT_EQ(status_field(maker->pid, "Groups"), "\t ") << "none";
  EXPECT_EQ(status_field(maker->pid, "NoNewPrivs"), "\t1");
  // Its descriptors from 3 up: its worker's end and its own namespace, none of the test's (a file opened
  // without O_CLOEXEC before it started).
  const std::string inherited = ::testing::TempDir() + "/socket-maker-inherited";
  UniqueFd marker(::open(inherited.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600));
  ASSERT_TRUE(marker.valid());
  auto second = start_socket_maker(1, 65534, 65534, kProxyBinary);
  ASSERT_TRUE(second) << second.message();
  std::vector<std::string> targets;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/" + std::to_string(second->pid) + "/fd")) {
    if (std::stoi(entry.path().filename().string()) < 3) continue;
    std::error_code ec;
    targets.push_back(std::filesystem::read_symlink(entry.path(), ec).string());
  }
  std::sort(targets.begin(), targets.end());
  ASSERT_EQ(targets.size(), 2u);
  EXPECT_EQ(targets[0].rfind("net:[", 0), 0u) << targets[0];
  EXPECT_EQ(targets[1].rfind("socket:[", 0), 0u) << targets[1];
  ::unlink(inherited.c_str());
}

TEST_F(SocketMakerTest, RefusesWhatIsNotANetworkNamespaceAndGoesOnAnswering) {
  auto maker = start_socket_maker(1, 65534, 65534, kProxyBinary);
  ASSERT_TRUE(maker) << maker.message();
  SocketMakerClient& client = *maker->clients[0];
  UniqueFd mount_ns(::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC));
  UniqueFd file(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  for (int not_netns : {mount_ns.get(), file.get()}) {
    auto made = client.make(not_netns, 1);
    ASSERT_FALSE(made);
    EXPECT_NE(made.message().find("Invalid argument"), std::string::npos) << made.message();
  }
  EXPECT_FALSE(client.make(mount_ns.get(), 0)) << "none asked";
  EXPECT_FALSE(client.make(mount_ns.get(), kMaxSpareSockets + 1)) << "more than a refill";
  UniqueFd own(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  auto made = client.make(own.get(), 2);
  ASSERT_TRUE(made) << "a refusal is an answer: the end stays usable. " << made.message();
  EXPECT_EQ(made->size(), 2u);
}

TEST_F(SocketMakerTest, EndsWhenTheProxysEndsClose) {
  auto maker = start_socket_maker(2, 65534, 65534, kProxyBinary);
  ASSERT_TRUE(maker) << maker.message();
  maker->clients[0].reset();
  UniqueFd own(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  EXPECT_TRUE(maker->clients[1]->make(own.get(), 1)) << "one worker's end left: it serves on";
  maker->clients[1].reset();
  EXPECT_TRUE(exits_within(maker->pid, std::chrono::seconds(5)));
}

}  // namespace
}  // namespace sg
