// The agent's SSH server on loopback, outside any sandbox, against OpenSSH's own ssh: what the e2e test
// checks through the ingress, here at the unit's own boundary (the key file re-read per connection, the
// refusal, the exit status, a host key file that cannot be read).
#include "agent/ssh_server.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>

#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "common/fd.h"
#include "common/net.h"
#include "tests/unit/temp_dir.h"

namespace sg::agent {
namespace {

struct Run {
  int code = -1;
  std::string out;
};

Run run(const std::string& cmd) {
  Run r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A raw TCP connection to the listener (no SSH client behind it).
UniqueFd connect_raw(uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

// Everything the server sends until it closes the connection, or nullopt if it is still open at the deadline.
std::optional<std::string> read_to_eof(int fd, int timeout_ms) {
  std::string got;
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now()).count());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, left) != 1) return std::nullopt;
    char buf[1024];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) return got;
    got.append(buf, static_cast<size_t>(n));
  }
}

// A new connection gets the server's banner within a deadline (polled: the listener reaps the closed
// connection's process before it accepts the next one).
bool eventually_served(uint16_t port) {
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < end) {
    UniqueFd fd = connect_raw(port);
    pollfd p{fd.get(), POLLIN, 0};
    char buf[8];
    if (::poll(&p, 1, 2000) == 1 && ::read(fd.get(), buf, sizeof buf) == static_cast<ssize_t>(sizeof buf)) return true;
  }
  return false;
}

class SshServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tmp_.path();
    ASSERT_EQ(run("ssh-keygen -q -t ed25519 -N '' -f " + dir_ + "/host").code, 0);
    ASSERT_EQ(run("ssh-keygen -q -t ed25519 -N '' -C one -f " + dir_ + "/one").code, 0);
    ASSERT_EQ(run("ssh-keygen -q -t ed25519 -N '' -C two -f " + dir_ + "/two").code, 0);
    std::ofstream(dir_ + "/authorized_keys") << "# registered\n" << slurp(dir_ + "/one.pub");
    std::ofstream(dir_ + "/known_hosts") << "[127.0.0.1]:PORT " << slurp(dir_ + "/host.pub");
    auto ep = parse_endpoint("127.0.0.1:0");
    ASSERT_TRUE(ep);
    auto fd = listen_on(*ep, false, 16);
    ASSERT_TRUE(fd) << fd.message();
    listen_fd_ = std::move(*fd);
    auto port = local_port(listen_fd_.get());
    ASSERT_TRUE(port) << port.message();
    port_ = *port;
    // known_hosts names the port the listener got.
    std::string kh = slurp(dir_ + "/known_hosts");
    kh.replace(kh.find("PORT"), 4, std::to_string(port_));
    std::ofstream(dir_ + "/known_hosts") << kh;
  }
  void start(const std::string& host_key, SshServerOptions opts = {}) {
    opts.host_key_file = host_key;
    opts.authorized_keys_file = dir_ + "/authorized_keys";
    auto pid = start_ssh_listener(listen_fd_.get(), opts);
    ASSERT_TRUE(pid) << pid.message();
    listener_ = *pid;
    listen_fd_.reset();  // the listener has its own copy
  }
  void TearDown() override {
    if (listener_ > 0) {
      ::kill(listener_, SIGTERM);
      ::waitpid(listener_, nullptr, 0);
    }
  }
  std::string ssh(const std::string& key) const {
    return "HOME=" + dir_ + " ssh -F /dev/null -p " + std::to_string(port_) + " -i " + dir_ + "/" + key +
           " -o IdentitiesOnly=yes -o IdentityAgent=none -o BatchMode=yes -o ConnectTimeout=10"
           " -o StrictHostKeyChecking=yes -o UserKnownHostsFile=" + dir_ + "/known_hosts root@127.0.0.1 ";
  }

  testing::TempDir tmp_;
  std::string dir_;
  uint16_t port_ = 0;
  UniqueFd listen_fd_;
  pid_t listener_ = 0;
};

TEST_F(SshServerTest, RunsCommandsForRegisteredKeysOnlyAndRereadsTheKeys) {
  start(dir_ + "/host");
  auto ok = run(ssh("one") + "'echo hi $((6*7)); exit 5'");
  EXPECT_EQ(ok.code, 5) << ok.out;
  EXPECT_NE(ok.out.find("hi 42"), std::string::npos) << ok.out;
  auto refused = run(ssh("two") + "true");
  EXPECT_EQ(refused.code, 255);
  EXPECT_NE(refused.out.find("Permission denied (publickey)"), std::string::npos) << refused.out;
  // The file is read by every connection: a key added now works at once, without a restart.
  std::ofstream(dir_ + "/authorized_keys", std::ios::app) << slurp(dir_ + "/two.pub");
  auto added = run(ssh("two") + "'echo added'");
  EXPECT_EQ(added.code, 0) << added.out;
  EXPECT_NE(added.out.find("added"), std::string::npos);
  // stdin reaches the command and its EOF ends it.
  auto piped = run("printf 'a\\nb\\n' | " + ssh("one") + "'wc -l'");
  EXPECT_EQ(piped.code, 0) << piped.out;
  EXPECT_NE(piped.out.find("2"), std::string::npos) << piped.out;
}

// A shell on a pty follows the terminal's size: python's pty gives ssh a real terminal, resizes it and sends
// ssh the SIGWINCH a terminal emulator would; `stty size` in the sandbox's shell tells what the server did.
TEST_F(SshServerTest, ThePtyFollowsWindowChanges) {
  start(dir_ + "/host");
  const std::string script = dir_ + "/winch.py";
  std::ofstream(script) << R"py(
import os, pty, fcntl, termios, struct, signal, select, sys, time
pid, fd = pty.fork()
if pid == 0:
    os.execvp("sh", ["sh", "-c", sys.argv[1]])
def size(rows, cols):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
def expect(needle):
    out, end = b"", time.time() + 20
    while time.time() < end and needle not in out:
        if select.select([fd], [], [], 0.2)[0]:
            try: out += os.read(fd, 4096)
            except OSError: break
    if needle not in out: sys.exit("no %r in %r" % (needle, out))
size(30, 100)
os.write(fd, b"echo ready\n"); expect(b"ready\r\n")
os.write(fd, b"stty size\n"); expect(b"30 100")
size(40, 120); os.kill(pid, signal.SIGWINCH)
# The resize reaches the server asynchronously: ask until it shows (bounded by expect's deadline).
out, end = b"", time.time() + 20
while b"40 120" not in out and time.time() < end:
    os.write(fd, b"stty size\n")
    if select.select([fd], [], [], 0.5)[0]: out += os.read(fd, 4096)
if b"40 120" not in out: sys.exit("the resize never arrived: %r" % out)
os.write(fd, b"exit 4\n")
while True:
    try:
        if not os.read(fd, 4096): break
    except OSError: break
print("status", os.waitpid(pid, 0)[1] >> 8)
)py";
  std::string command = ssh("one");
  command.replace(command.find("-o BatchMode"), 0, "-tt ");
  auto r = run("python3 " + script + " '" + command + "'");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("status 4"), std::string::npos) << r.out;
}

TEST_F(SshServerTest, AClientThatNeverAuthenticatesIsDroppedAtTheDeadline) {
  SshServerOptions opts;
  opts.auth_timeout_secs = 1;
  start(dir_ + "/host", opts);
  UniqueFd idle = connect_raw(port_);
  auto start = std::chrono::steady_clock::now();
  auto got = read_to_eof(idle.get(), 10'000);
  ASSERT_TRUE(got) << "still open after 10 s";
  EXPECT_TRUE(got->starts_with("SSH-2.0-")) << *got;
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(900));
}

TEST_F(SshServerTest, ConnectionsBeyondTheLimitAreClosedAtOnce) {
  SshServerOptions opts;
  opts.max_sessions = 1;
  start(dir_ + "/host", opts);
  UniqueFd first = connect_raw(port_);
  char banner[8];
  ASSERT_EQ(::read(first.get(), banner, sizeof banner), static_cast<ssize_t>(sizeof banner));  // it is served
  UniqueFd second = connect_raw(port_);
  auto got = read_to_eof(second.get(), 10'000);
  ASSERT_TRUE(got) << "the connection beyond the limit was not closed";
  EXPECT_EQ(*got, "");  // closed before any banner
  first.reset();
  // Once the first is gone, a new connection is served again.
  EXPECT_TRUE(eventually_served(port_));
}

TEST_F(SshServerTest, AtMostMaxAuthAttemptsKeysAreTried) {
  for (const char* k : {"x1", "x2"})
    ASSERT_EQ(run("ssh-keygen -q -t ed25519 -N '' -f " + dir_ + "/" + k).code, 0);
  SshServerOptions opts;
  opts.max_auth_attempts = 2;
  start(dir_ + "/host", opts);
  // Three unregistered keys go first; the registered one would be the fourth try.
  std::string many = ssh("two");
  many.replace(many.find(" -o IdentitiesOnly"), 0, " -i " + dir_ + "/x1 -i " + dir_ + "/x2 -i " + dir_ + "/one");
  auto refused = run(many + "true");
  EXPECT_EQ(refused.code, 255) << refused.out;
  // Within the limit the same client gets in.
  std::string two_tries = ssh("x1");
  two_tries.replace(two_tries.find(" -o IdentitiesOnly"), 0, " -i " + dir_ + "/one");
  auto ok = run(two_tries + "true");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

TEST_F(SshServerTest, NoKeysFileRefusesEveryKey) {
  ASSERT_EQ(::unlink((dir_ + "/authorized_keys").c_str()), 0);
  start(dir_ + "/host");
  auto refused = run(ssh("one") + "true");
  EXPECT_EQ(refused.code, 255);
  EXPECT_NE(refused.out.find("Permission denied (publickey)"), std::string::npos) << refused.out;
}

TEST_F(SshServerTest, AnUnreadableHostKeyIsRefusedAtStart) {
  SshServerOptions opts;
  opts.host_key_file = dir_ + "/no-such-host-key";
  opts.authorized_keys_file = dir_ + "/authorized_keys";
  auto pid = start_ssh_listener(listen_fd_.get(), opts);
  ASSERT_FALSE(pid);
  EXPECT_NE(pid.message().find("no-such-host-key"), std::string::npos) << pid.message();
}

}  // namespace
}  // namespace sg::agent
