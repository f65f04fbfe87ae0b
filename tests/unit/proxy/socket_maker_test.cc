// The socket maker as the proxy starts it (its own binary run with --socket-maker, as root), against network
// namespaces this test makes and vouches for as the node would: where its sockets live, what it refuses,
// what it keeps of root, and that it ends with the proxy's ends.
#include "proxy/socket_maker.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/socket.h>
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
#include "common/vouched_netns.h"
#include "tests/netns.h"
#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

const std::string kProxyBinary = std::string(SANDGATE_BIN_DIR) + "/proxy/sandgate-proxy";

// "CapEff:\t0000000000200000" and the like from /proc/PID/status.
std::string status_field(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return line.substr(field.size() + 1);
  return "";
}

// Waits (with a deadline) for `pid` to exit; its wait status, or -1.
int wait_exit(pid_t pid, std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

bool connects_to(int sock, uint16_t port) {
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(sock, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0 && errno != EINPROGRESS) return false;
  pollfd p{sock, POLLOUT, 0};
  if (::poll(&p, 1, 2000) != 1) return false;
  int err = -1;
  socklen_t len = sizeof err;
  ::getsockopt(sock, SOL_SOCKET, SO_ERROR, &err, &len);
  return err == 0;
}

class SocketMakerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "the socket maker needs root to start";
    dir_ = tmp_.path();
    ASSERT_FALSE(dir_.empty());
    ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);  // the maker runs as another user
    vouched_ = dir_ + "/node.sock.netns";
    ASSERT_EQ(::mkdir(vouched_.c_str(), 0755), 0);
    ASSERT_EQ(::chmod(vouched_.c_str(), 0755), 0);
  }
  void TearDown() override {
    // Every maker started here ends once its ends are closed (they are, with the test's locals), and
    // cleanly: a sanitizer report or a die() would show in the status.
    for (pid_t pid : pids_) {
      const int status = wait_exit(pid, std::chrono::seconds(10));
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "maker " << pid << " status " << status;
    }
  }

  Result<SocketMaker> start(size_t workers, uid_t uid, gid_t gid) {
    auto maker = start_socket_maker(workers, uid, gid, vouched_, kProxyBinary);
    if (maker) pids_.push_back(maker->pid);
    return maker;
  }
  // What sandgate-node does for the namespace of `ns`, which it sends a proxy with spares made inside it
  // (noderuntime/netns_vouchers.h): a mark named after the namespace's cookie.
  std::string mark_of(const testing::Netns& ns) {
    UniqueFd sock = testing::in_netns(ns.path(), [] { return UniqueFd(::socket(AF_INET, SOCK_STREAM, 0)); });
    auto cookie = netns_cookie(sock.get());
    return cookie ? vouched_ + "/" + netns_mark_name(*cookie) : std::string();
  }
  void vouch(const testing::Netns& ns) {
    UniqueFd mark(::open(mark_of(ns).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0444));
    ASSERT_TRUE(mark.valid());
  }
  void revoke(const testing::Netns& ns) { ::unlink(mark_of(ns).c_str()); }

  // The maker started by hand, for requests SocketMakerClient never sends: its end, and its pid in pids_.
  UniqueFd start_raw(pid_t parent) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) return {};
    UniqueFd mine(pair[0]), theirs(pair[1]);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, theirs.get(), theirs.get());
    std::vector<std::string> args = {"sandgate-proxy", kSocketMakerFlag, "65534", "65534", std::to_string(parent),
                                     vouched_, std::to_string(theirs.get())};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    char* env[] = {nullptr};
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, kProxyBinary.c_str(), &actions, nullptr, argv.data(), env);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return {};
    raw_pid_ = pid;
    return mine;
  }

  testing::TempDir tmp_{"socket-maker"};
  std::string dir_;
  std::string vouched_;
  std::vector<pid_t> pids_;
  pid_t raw_pid_ = -1;
};

TEST_F(SocketMakerTest, MakesSocketsOnlyInANamespaceTheNodeVouchesForAndTheyReachWhatListensThere) {
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

  auto maker = start(2, 65534, 65534);
  ASSERT_TRUE(maker) << maker.message();
  ASSERT_EQ(maker->clients.size(), 2u);
  auto unvouched = maker->clients[0]->make(netns.get(), 1);
  ASSERT_FALSE(unvouched) << "a namespace the node did not mark";
  EXPECT_EQ(unvouched.error(), Error::kPermissionDenied) << unvouched.message();
  EXPECT_NE(unvouched.message().find("Permission denied"), std::string::npos) << "EACCES";

  vouch(sandbox);
  for (auto& client : maker->clients) {
    auto made = client->make(netns.get(), 3);
    ASSERT_TRUE(made) << made.message();
    ASSERT_EQ(made->size(), 3u);
    for (const UniqueFd& s : *made) {
      EXPECT_EQ(testing::socket_namespace_inode(s.get()), testing::namespace_inode(netns.get()));
      EXPECT_TRUE(::fcntl(s.get(), F_GETFD) & FD_CLOEXEC);
      EXPECT_TRUE(::fcntl(s.get(), F_GETFL) & O_NONBLOCK);
    }
    EXPECT_TRUE(connects_to(made->front().get(), *port)) << "the sandbox's listener; the host has none there";
  }
  auto most = maker->clients[0]->make(netns.get(), kMaxSpareSockets);
  ASSERT_TRUE(most) << most.message();
  EXPECT_EQ(most->size(), kMaxSpareSockets);

  revoke(sandbox);  // the sandbox stopped running
  auto revoked = maker->clients[1]->make(netns.get(), 1);
  ASSERT_FALSE(revoked);
  EXPECT_EQ(revoked.error(), Error::kPermissionDenied);
}

TEST_F(SocketMakerTest, KeepsCapSysAdminAloneAsTheUserItIsGivenAndNothingOfTheProxys) {
  // Opened without O_CLOEXEC before the maker starts: it must not be the maker's.
  UniqueFd inherited(::open((dir_ + "/inherited").c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600));
  ASSERT_TRUE(inherited.valid());
  ::setenv("SANDGATE_SOCKET_MAKER_TEST_SECRET", "not for the maker", 1);
  auto maker = start(1, 65534, 65533);
  ::unsetenv("SANDGATE_SOCKET_MAKER_TEST_SECRET");
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
  std::ifstream environ("/proc/" + std::to_string(maker->pid) + "/environ", std::ios::binary);
  const std::string environment((std::istreambuf_iterator<char>(environ)), std::istreambuf_iterator<char>());
  EXPECT_EQ(environment, "") << "the proxy's environment stays with the proxy";
  // Its descriptors from 3 up: its worker's end and its own namespace.
  std::vector<std::string> targets;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/" + std::to_string(maker->pid) + "/fd")) {
    if (std::stoi(entry.path().filename().string()) < 3) continue;
    std::error_code ec;
    targets.push_back(std::filesystem::read_symlink(entry.path(), ec).string());
  }
  std::sort(targets.begin(), targets.end());
  ASSERT_EQ(targets.size(), 2u) << ::testing::PrintToString(targets);
  EXPECT_EQ(targets[0].rfind("net:[", 0), 0u) << targets[0];
  EXPECT_EQ(targets[1].rfind("socket:[", 0), 0u) << targets[1];
}

// What SocketMakerClient never sends, straight on a maker's end: each refused with an answer, and the end
// still answers a good request after them.
TEST_F(SocketMakerTest, RefusesEveryMalformedRequestWithAnAnswerAndGoesOn) {
  UniqueFd end = start_raw(::getpid());
  ASSERT_TRUE(end.valid());
  pids_.push_back(raw_pid_);
  testing::Netns sandbox;
  ASSERT_TRUE(sandbox.valid());
  UniqueFd netns(::open(sandbox.path().c_str(), O_RDONLY | O_CLOEXEC));
  vouch(sandbox);
  UniqueFd mount_ns(::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC));
  UniqueFd file(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  struct Request {
    uint32_t version, count;
  };
  struct Answer {
    int32_t error;
    uint32_t count;
  };
  auto ask = [&](const void* data, size_t len, std::vector<int> fds) -> Answer {
    auto sent = send_with_fds(end.get(), data, len, fds);
    EXPECT_TRUE(sent);
    pollfd p{end.get(), POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 5000), 1);
    Answer a{-1, 0};
    std::vector<UniqueFd> got;
    bool would_block = false;
    auto n = recv_with_fds(end.get(), &a, sizeof a, &got, &would_block);
    EXPECT_TRUE(n && *n == sizeof a);
    EXPECT_EQ(got.size(), a.count);
    return a;
  };
  const Request good{1, 2};
  const Request bad_version{2, 2}, none{1, 0}, too_many{1, static_cast<uint32_t>(kMaxSpareSockets + 1)};
  const uint32_t short_request = 1;
  const char long_request[12] = {1, 0, 0, 0, 2};
  EXPECT_EQ(ask(&good, sizeof good, {}).error, EINVAL) << "no namespace";
  EXPECT_EQ(ask(&good, sizeof good, {netns.get(), netns.get()}).error, EINVAL) << "two";
  EXPECT_EQ(ask(&good, sizeof good, {netns.get(), netns.get(), netns.get()}).error, EINVAL) << "three (truncated)";
  EXPECT_EQ(ask(&short_request, sizeof short_request, {netns.get()}).error, EINVAL) << "short";
  EXPECT_EQ(ask(long_request, sizeof long_request, {netns.get()}).error, EINVAL) << "long (truncated)";
  EXPECT_EQ(ask(&bad_version, sizeof bad_version, {netns.get()}).error, EINVAL) << "version";
  EXPECT_EQ(ask(&none, sizeof none, {netns.get()}).error, EINVAL) << "count 0";
  EXPECT_EQ(ask(&too_many, sizeof too_many, {netns.get()}).error, EINVAL) << "count 65";
  EXPECT_EQ(ask(&good, sizeof good, {mount_ns.get()}).error, EINVAL) << "a mount namespace";
  EXPECT_EQ(ask(&good, sizeof good, {file.get()}).error, EINVAL) << "a file";
  UniqueFd own(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  EXPECT_EQ(ask(&good, sizeof good, {own.get()}).error, EACCES) << "a namespace no node vouched for";
  const Answer answer = ask(&good, sizeof good, {netns.get()});
  EXPECT_EQ(answer.error, 0);
  EXPECT_EQ(answer.count, 2u) << "still answering";
}

TEST_F(SocketMakerTest, ExitsAtOnceUnlessItsParentIsTheProxyNamed) {
  UniqueFd end = start_raw(1);  // not its parent
  ASSERT_TRUE(end.valid());
  const int status = wait_exit(raw_pid_, std::chrono::seconds(10));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
}

// The proxy killed (SIGKILL: no end closed in an orderly way, no exit code run): its maker dies with it.
// The "proxy" here is a shell that starts the maker as the proxy does and then waits.
TEST_F(SocketMakerTest, DiesWithTheProxyThatStartedIt) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair), 0);  // inherited by the shell, then the maker
  UniqueFd mine(pair[0]), theirs(pair[1]);
  ::fcntl(mine.get(), F_SETFD, FD_CLOEXEC);
  const std::string script = kProxyBinary + " " + kSocketMakerFlag + " 65534 65534 $$ " + vouched_ + " " +
                             std::to_string(theirs.get()) + " & echo $!; exec sleep 600";
  int out[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  UniqueFd out_read(out[0]), out_write(out[1]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_write.get(), 1);
  std::vector<std::string> args = {"/bin/sh", "-c", script};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t shell = -1;
  char* env[] = {nullptr};
  const int spawned = ::posix_spawn(&shell, "/bin/sh", &actions, nullptr, argv.data(), env);
  posix_spawn_file_actions_destroy(&actions);
  ASSERT_EQ(spawned, 0);
  theirs.reset();
  out_write.reset();
  std::string line;
  for (char ch = 0; ch != '\n';) {
    ASSERT_EQ(::read(out_read.get(), &ch, 1), 1);
    line += ch;
  }
  const pid_t maker = static_cast<pid_t>(std::stol(line));
  // It serves (so it is past its parent check) before its parent goes.
  pollfd p{mine.get(), POLLOUT, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  UniqueFd own(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  const uint32_t request[2] = {1, 1};
  const int fds[] = {own.get()};
  ASSERT_TRUE(send_with_fds(mine.get(), request, sizeof request, fds));
  pollfd answered{mine.get(), POLLIN, 0};
  ASSERT_EQ(::poll(&answered, 1, 5000), 1);
  ::kill(shell, SIGKILL);
  ::waitpid(shell, nullptr, 0);
  // Not our child: gone (or a zombie its new parent has yet to reap) is what can be seen.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() < until) {
    const std::string state = status_field(maker, "State");
    gone = state.empty() || state.find("zombie") != std::string::npos;
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(gone) << "the maker outlived its proxy";
  ::kill(maker, SIGKILL);  // in case it did
}

TEST_F(SocketMakerTest, EndsWhenTheProxysEndsClose) {
  testing::Netns sandbox;  // first: its process, forked from this one, would hold copies of the ends
  ASSERT_TRUE(sandbox.valid());
  auto maker = start(2, 65534, 65534);
  ASSERT_TRUE(maker) << maker.message();
  maker->clients[0].reset();
  UniqueFd netns(::open(sandbox.path().c_str(), O_RDONLY | O_CLOEXEC));
  vouch(sandbox);
  EXPECT_TRUE(maker->clients[1]->make(netns.get(), 1)) << "one worker's end left: it serves on";
  maker->clients[1].reset();
  const int status = wait_exit(maker->pid, std::chrono::seconds(10));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  pids_.clear();  // reaped here
}

}  // namespace
}  // namespace sg
