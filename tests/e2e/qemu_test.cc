// The QEMU driver end to end: a real microvm guest (deploy/build-guest-image.sh) behind the real proxy and
// node. The guest runs busybox httpd with a CGI counter kept in the guest's RAM (/tmp), so a counter that
// keeps counting proves the memory survived a pause and a hibernation. Skips, loudly, only when the guest
// image cannot be built (no kernel package reachable).
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <thread>
#include <vector>

#include "noderuntime/sandbox.h"
#include "tests/e2e/harness.h"
#include "tests/netns.h"

namespace sg::e2e {
namespace {

// The sandbox's command (run by the guest's /bin/sh). The CGI answers "<count> <guest epoch seconds>".
constexpr const char* kGuestServer = R"SH(mkdir -p /tmp/www/cgi-bin
cat >/tmp/www/cgi-bin/c <<'EOF'
#!/bin/sh
n=$(cat /tmp/n 2>/dev/null || echo 0)
n=$((n+1))
echo $n >/tmp/n
echo "Content-Type: text/plain"
echo ""
echo "$n $(date +%s)"
EOF
chmod +x /tmp/www/cgi-bin/c
echo ok >/tmp/www/index.html
exec httpd -f -p 8080 -h /tmp/www
)SH";

// Builds (or reuses) a guest image under the build dir, with the agent or without it; "" when the kernel
// package is unavailable.
std::string guest_image_dir(std::string* why, bool with_agent = true) {
  const std::string dir = bin(with_agent ? "qemu-guest" : "qemu-guest-no-agent");
  auto r = run("bash " + source("deploy/build-guest-image.sh") + " " + dir + " " +
                   (with_agent ? bin("agent/sandgate-agent") : std::string()) + " 2>&1",
               600);
  if (r.exit_code != 0) {
    *why = r.out;
    return "";
  }
  return dir;
}

struct Answer {
  int code = 0;
  long count = -1;
  long guest_time = 0;
};

Answer counter(Cluster& c, const std::string& name = "q") {
  auto r = c.curl("8080-" + name + ".sandbox.localhost", "/cgi-bin/c", "", 90);
  Answer a;
  a.code = Cluster::http_code(r);
  std::istringstream in(Cluster::body(r));
  in >> a.count >> a.guest_time;
  return a;
}

// Each start and wake waited for the guest's answer that it applied its identity line (the clock first), not
// for the deadline, and the guest took every line whole.
void expect_every_identity_line_taken(Cluster& c) {
  for (const char* warning : {"did not answer its identity line", "closed its identity connection",
                              "applied its identity line only in part"})
    EXPECT_EQ(c.node().log().find(warning), std::string::npos) << c.node().log();
}

// The scheduling classes (ps's CLS: TS for SCHED_OTHER, B for SCHED_BATCH) of every thread of the sandbox's
// QEMU, one line each without repeats; "" when no QEMU runs for it.
std::string qemu_thread_classes(const std::string& id) {
  auto pid = run("pgrep -f '[s]andgate-" + id + "' || true").out;
  while (!pid.empty() && pid.back() == '\n') pid.pop_back();
  if (pid.empty()) return "";
  return run("ps -L -o cls= -p " + pid + " | tr -d ' ' | sort -u").out;
}

// A 16 MiB tmpfs mounted on `path` (made first) for as long as it lives: a disk that fills up.
struct SmallTmpfs {
  explicit SmallTmpfs(std::string p) : path(std::move(p)) {
    mounted = run("mkdir -p " + path + " && mount -t tmpfs -o size=16m sgtest-full " + path).exit_code == 0;
  }
  ~SmallTmpfs() {
    if (mounted) run("umount -l " + path);
  }
  std::string path;
  bool mounted = false;
};

class Qemu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    image_ = guest_image_dir(&why);
    if (image_.empty()) {
      std::fprintf(stderr, "\n################################################################\n"
                           "QEMU e2e SKIPPED: the guest image cannot be built:\n%s\n"
                           "################################################################\n",
                   why.c_str());
      GTEST_SKIP() << "guest image cannot be built: " << why;
    }
  }
  std::string node_config() const { return node_config(image_); }
  static std::string node_config(const std::string& image) {
    // Boots under TCG on a shared 2-core machine: a generous per-attempt deadline.
    return "guest_kernel = \"" + image + "/vmlinuz\"\nguest_initrd = \"" + image +
           "/initrd.img\"\nqemu_boot_timeout_ms = 90000\nqemu_boot_attempts = 2\n";
  }
  std::string image_;
};

TEST_F(Qemu, WakesFromBothTiersKeepsMemoryFixesClockAndSurvivesNodeKill) {
  // A snapshot store of its own (images_dir ""): the hibernated guest's checkpoint goes where the test dir is
  // removed.
  Cluster c(ClusterOptions::node(node_config() + "images_dir = \"\"\n"));
  // 256 MiB: the initramfs is unpacked into guest RAM, and a sanitizer build's agent (~40 MiB) does not fit
  // in 128 MiB (the node's create then names that cause).
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 3 --hibernate-after 4 "
                       "--memory-mb 256 -- /bin/sh -c " + shell_quote(kGuestServer),
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const std::string id = nlohmann::json::parse(created.out, nullptr, false).value("id", "");
  ASSERT_FALSE(id.empty()) << created.out;
  // The guest reports ready once httpd is started; it listens a moment later.
  c.wait_until_serving("q", 8080);
  Answer a = counter(c);
  ASSERT_EQ(a.code, 200) << c.node().log();
  EXPECT_EQ(a.count, 1);
  // node.batch_scheduling (on by default): every vCPU and I/O thread, so none preempts the proxy.
  EXPECT_EQ(qemu_thread_classes(id), "B\n");

  // Memory tier after the idle timeout; a request wakes it and the guest's RAM is intact.
  ASSERT_TRUE(eventually([&] { return c.get("q")["tier"] == "memory"; }, std::chrono::seconds(30)))
      << c.get("q").dump();
  EXPECT_EQ(c.get("q")["state"], "suspended");
  a = counter(c);
  EXPECT_EQ(a.code, 200);
  EXPECT_EQ(a.count, 2);

  // Disk tier: suspended in memory after 3 s idle, hibernated 4 s later. QEMU is gone meanwhile.
  ASSERT_TRUE(eventually([&] {
    auto j = c.get("q");
    return j["tier"] == "disk" && j["state"] == "suspended";
  }, std::chrono::seconds(60))) << c.get("q").dump() << c.node().log();
  EXPECT_EQ(run("pgrep -f '[s]andgate-" + id + "' || true").out, "");
  // A memory checkpoint of the hibernated guest copies its saved state: it stays hibernated, no QEMU runs.
  auto checkpoint = c.cli("checkpoint q --type memory --json", 180);
  ASSERT_EQ(checkpoint.exit_code, 0) << checkpoint.out << checkpoint.err << c.node().log();
  const std::string snap = nlohmann::json::parse(checkpoint.out, nullptr, false).value("snapshot_id", "");
  EXPECT_EQ(c.get("q")["tier"], "disk");
  EXPECT_EQ(run("pgrep -f '[s]andgate-" + id + "' || true").out, "");
  // Stay hibernated a while, so a guest clock that was not fixed would be visibly behind.
  ::sleep(6);
  a = counter(c);
  const long host_now = static_cast<long>(std::time(nullptr));
  EXPECT_EQ(a.code, 200);
  EXPECT_EQ(a.count, 3) << "the counter in guest RAM did not survive the hibernation";
  EXPECT_LE(std::labs(a.guest_time - host_now), 3) << "guest clock " << a.guest_time << " vs host " << host_now
                                                   << c.node().log();
  EXPECT_EQ(qemu_thread_classes(id), "B\n") << "the restored QEMU";
  // A sandbox from the hibernated guest's checkpoint continues it (2 -> 3), with its clock set.
  ASSERT_EQ(c.cli("create --name h --from " + snap, 180).exit_code, 0) << c.node().log();
  Answer from_disk = counter(c, "h");
  EXPECT_EQ(from_disk.count, 3) << c.node().log();
  EXPECT_LE(std::labs(from_disk.guest_time - static_cast<long>(std::time(nullptr))), 3) << "clock not set";
  ASSERT_EQ(c.cli("rm h").exit_code, 0);
  EXPECT_EQ(c.cli("snapshot rm " + snap).exit_code, 0);
  expect_every_identity_line_taken(c);

  // kill -9 of the node while the next hibernation is under way (or as close to it as polling gets).
  ASSERT_TRUE(eventually([&] { return c.get("q")["tier"] == "memory"; }, std::chrono::seconds(30)));
  eventually([&] { return c.get("q")["state"] == "suspending"; }, std::chrono::seconds(15));
  c.node().stop(SIGKILL);
  c.start_node();
  // Whatever the moment of the kill, the restarted node finds a consistent sandbox that still wakes.
  ASSERT_TRUE(eventually([&] {
    auto s = c.get("q")["state"];
    return s == "suspended" || s == "running";
  }, std::chrono::seconds(60))) << c.get("q").dump() << c.node().log();
  a = counter(c);
  EXPECT_EQ(a.code, 200) << c.node().log();
  EXPECT_EQ(a.count, 4);

  ASSERT_EQ(c.cli("rm q").exit_code, 0);
  EXPECT_TRUE(eventually([&] { return run("pgrep -f '[s]andgate-" + id + "' || true").out.empty(); },
                         std::chrono::seconds(10)));
}

// The SDK route (<name>.<domain> -> the agent in the guest) over HTTP/1.1 and HTTP/2: health, a streaming
// exec whose first event arrives before the command ends, and a 1 MiB file round trip, hash-checked.
void expect_sdk_works(Cluster& c, const std::string& token, const std::string& when, const std::string& scratch) {
  SCOPED_TRACE("SDK route, " + when);
  const std::string host = "vq.sandbox.localhost";
  for (const std::string proto : {"--http1.1", "--http2"}) {
    SCOPED_TRACE(proto);
    auto health = c.curl(host, "/health", proto + " -w '\\n%{http_code} %{http_version}' " + bearer(token), 120);
    EXPECT_EQ(Cluster::http_code(health), 200) << health.out << health.err << c.proxy().log();
    EXPECT_NE(health.out.find("\"status\":\"ok\""), std::string::npos) << health.out;
    EXPECT_NE(health.out.rfind(proto == "--http2" ? " 2" : " 1.1"), std::string::npos) << health.out;

    const std::string body = R"({"command":["sh","-c","echo first; sleep 2; echo second"]})";
    auto exec = c.curl(host, "/exec",
                       proto + " -N -X POST -H 'Content-Type: application/json' --data " + shell_quote(body) + " " +
                           bearer(token) + " -w '\\n%{http_code} ttfb=%{time_starttransfer} total=%{time_total}'",
                       120);
    EXPECT_NE(exec.out.find("\"data\":\"first\\n\""), std::string::npos) << exec.out << exec.err;
    EXPECT_NE(exec.out.find("\"data\":\"second\\n\""), std::string::npos) << exec.out;
    EXPECT_NE(exec.out.find("\"type\":\"exit\""), std::string::npos) << exec.out;
    auto ttfb_at = exec.out.find("ttfb="), total_at = exec.out.find("total=");
    ASSERT_NE(ttfb_at, std::string::npos) << exec.out;
    double ttfb = std::atof(exec.out.c_str() + ttfb_at + 5), total = std::atof(exec.out.c_str() + total_at + 6);
    EXPECT_LT(ttfb, total - 1.0) << "the first event waited for the end: " << exec.out;

    const std::string local = scratch + "/upload.bin", back = scratch + "/download.bin";
    ASSERT_EQ(run("head -c 1048576 /dev/urandom > " + shell_quote(local)).exit_code, 0);
    const std::string remote = "/files?path=/tmp/roundtrip-" + std::string(proto == "--http2" ? "h2" : "h1");
    auto put = c.curl(host, remote, proto + " -X PUT --data-binary @" + shell_quote(local) + " " + bearer(token), 120);
    const int put_code = Cluster::http_code(put);
    EXPECT_TRUE(put_code == 201 || put_code == 204) << put.out << put.err;  // created, or replaced
    auto get = c.curl(host, remote, proto + " -o " + shell_quote(back) + " " + bearer(token), 120);
    EXPECT_EQ(Cluster::http_code(get), 200) << get.out << get.err;
    EXPECT_EQ(sha256_file(back), sha256_file(local));
  }
}

// `ssh vq` through `sandgate ssh-proxy` and the ingress to the agent's SSH server in the guest (docs/ssh.md):
// a command's output and exit status, and a shell on a pty; the host key must be the one the node keeps for
// the sandbox (known_hosts pinned, StrictHostKeyChecking=yes).
void expect_ssh_works(Cluster& c, const std::string& ssh, const std::string& when) {
  SCOPED_TRACE("SSH, " + when);
  auto cmd = run(ssh + " vq 'echo out $((6*7)) $(hostname); echo err >&2; exit 7'", 120);
  EXPECT_EQ(cmd.exit_code, 7) << cmd.out << cmd.err << c.proxy().log();
  EXPECT_EQ(cmd.out, "out 42 vq\n") << cmd.err;
  EXPECT_NE(cmd.err.find("err"), std::string::npos) << cmd.err;
  auto shell = run("printf 'tty; echo pty-$((6*7))\\nexit 3\\n' | " + ssh + " -tt vq", 120);
  EXPECT_EQ(shell.exit_code, 3) << shell.out << shell.err;
  EXPECT_NE(shell.out.find("/dev/pts/"), std::string::npos) << shell.out;
  EXPECT_NE(shell.out.find("pty-42"), std::string::npos) << shell.out;
}

// Issue: every SDK request to a QEMU sandbox was reset ("bad file descriptor") when the guest had no agent.
// With the agent in the image, the SDK works as for a process sandbox, and so does SSH without an sshd, also
// right after each kind of wake. A key registered after the create reaches the running guest; a removed
// one is refused at once.
TEST_F(Qemu, TheAgentServesTheSdkAndSshAlsoAfterWakingFromBothTiers) {
  Cluster c(ClusterOptions::node(node_config()));
  // 256 MiB: the initramfs, the files written to /tmp (tmpfs) and a sanitizer build's agent all live in guest
  // RAM; at 128 MiB the guest's OOM killer ends an ASan agent (seen on its console).
  auto created = c.cli("create --json --name vq --driver qemu --timeout 3 --hibernate-after 3 --memory-mb 256 "
                       "-- /bin/sh -c 'exec sleep 100000'",
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const auto sandbox = nlohmann::json::parse(created.out, nullptr, false);
  const std::string token = sandbox.value("token", ""), id = sandbox.value("id", "");
  ASSERT_FALSE(token.empty()) << created.out;
  expect_sdk_works(c, token, "running", c.dir());

  SshKeys keys = make_ssh_keys(c);
  const std::string config = c.dir() + "/ssh_config", known_hosts = keys.dir + "/known_hosts";
  auto block = c.cli("ssh-config vq --ingress 127.0.0.1:" + std::to_string(c.port()) + " --cacert " + c.ca());
  ASSERT_EQ(block.exit_code, 0) << block.err;
  write_file(config, block.out);
  write_file(known_hosts, known_hosts_line(c, "vq", id));
  const std::string ssh = ssh_client(c, "ssh", config, keys.good, known_hosts);
  // Registered after the guest booted: the node tells the running guest.
  for (const std::string& key : {keys.good, keys.bad}) {
    auto added = c.cli("ssh-keys add --name " + std::string(key == keys.good ? "good" : "bad") + " " +
                       shell_quote(key + ".pub"));
    ASSERT_EQ(added.exit_code, 0) << added.out << added.err;
  }
  expect_ssh_works(c, ssh, "running");
  const std::string bad_ssh = ssh_client(c, "ssh", config, keys.bad, known_hosts);
  EXPECT_EQ(run(bad_ssh + " vq true", 120).exit_code, 0) << "the second key did not reach the guest";
  // Removed while it runs: the node tells the guest without waiting for it, so refused within moments.
  ASSERT_EQ(c.cli("ssh-keys rm bad").exit_code, 0);
  CommandResult refused;
  EXPECT_TRUE(eventually([&] { return (refused = run(bad_ssh + " vq true", 120)).exit_code == 255; },
                         std::chrono::seconds(30)));
  EXPECT_NE(refused.err.find("Permission denied (publickey)"), std::string::npos) << refused.err;
  // Anything in the guest can reach the identity listener (the agent's); a well-formed line without the
  // boot's secret (here: the removed key as the only one, a sequence beyond every later one, another hostname
  // and time) changes nothing and gets no answer. nc returns once the listener closed the connection.
  const std::string forged = "1700000000 sb-forged forged - - " +
                             run("base64 -w0 " + shell_quote(keys.bad + ".pub")).out + " 9000000000000000000 " +
                             std::string(64, '0');
  auto sent = run(ssh + " vq " +
                      shell_quote("echo '" + forged + "' | nc -w 5 127.0.0.1 " + std::to_string(kQemuIdentityPort) +
                                  "; echo \"answer:$?\"; hostname; cat /run/sandgate-id; date +%Y"),
                  120);
  EXPECT_NE(sent.out.find("vq\n" + id + "\n"), std::string::npos) << sent.out << sent.err;
  EXPECT_EQ(sent.out.find("answer:0\nok"), std::string::npos) << "the forged line was answered: " << sent.out;
  EXPECT_EQ(sent.out.find("2023"), std::string::npos) << "the forged line set the clock: " << sent.out;
  EXPECT_EQ(run(bad_ssh + " vq true", 120).exit_code, 255) << "a forged identity line was applied";
  expect_ssh_works(c, ssh, "after a forged identity line");

  ASSERT_TRUE(eventually([&] { return c.get("vq")["tier"] == "memory"; }, std::chrono::seconds(30)));
  expect_sdk_works(c, token, "woken from the memory tier", c.dir());
  ASSERT_TRUE(eventually([&] { return c.get("vq")["tier"] == "memory"; }, std::chrono::seconds(30)));
  expect_ssh_works(c, ssh, "woken from the memory tier");

  ASSERT_TRUE(eventually([&] {
    auto j = c.get("vq");
    return j["tier"] == "disk" && j["state"] == "suspended";
  }, std::chrono::seconds(60))) << c.get("vq").dump() << c.node().log();
  expect_sdk_works(c, token, "woken from the disk tier", c.dir());
  ASSERT_TRUE(eventually([&] {
    auto j = c.get("vq");
    return j["tier"] == "disk" && j["state"] == "suspended";
  }, std::chrono::seconds(60))) << c.get("vq").dump() << c.node().log();
  expect_ssh_works(c, ssh, "woken from the disk tier");
  EXPECT_EQ(run(bad_ssh + " vq true", 120).exit_code, 255) << "a removed key came back with the restore";

  // Registered while the guest is hibernated: the connection that wakes it finds the key (the restore waits
  // for the guest to acknowledge keys it did not have).
  ASSERT_TRUE(eventually([&] {
    auto j = c.get("vq");
    return j["tier"] == "disk" && j["state"] == "suspended";
  }, std::chrono::seconds(60))) << c.get("vq").dump() << c.node().log();
  ASSERT_EQ(c.cli("ssh-keys add --name back " + shell_quote(keys.bad + ".pub")).exit_code, 0);
  auto woken = run(bad_ssh + " vq true", 120);
  EXPECT_EQ(woken.exit_code, 0) << "the waking connection did not find the key added while asleep: " << woken.err;
  for (const auto& e : c.access_log()) {
    if (e.value("sandbox_ref", "") != "vq") continue;
    EXPECT_NE(e.value("cause", ""), "upstream_reset") << e.dump();
  }
  ASSERT_EQ(c.cli("rm vq").exit_code, 0);
}

// A guest image without the agent: the SDK route is refused up front with a 502 that says why, and the
// access log names the cause; nothing is reset after the request was read.
TEST_F(Qemu, SdkRouteToAGuestWithoutTheAgentIsRefusedWithTheReason) {
  std::string why;
  const std::string image = guest_image_dir(&why, false);
  if (image.empty()) GTEST_SKIP() << why;
  // The node would rebuild a stamped image that lacks the agent; this one is meant to lack it.
  Cluster c(ClusterOptions::node(node_config(image) + "guest_image_autobuild = false\n"));
  auto created = c.cli("create --json --name vq --driver qemu --timeout 600 --memory-mb 128 -- /bin/sh -c 'exec sleep 100000'",
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const std::string token = nlohmann::json::parse(created.out, nullptr, false).value("token", "");
  for (const std::string proto : {"--http1.1", "--http2"}) {
    auto r = c.curl("vq.sandbox.localhost", "/health", proto + " " + bearer(token), 60);
    EXPECT_EQ(Cluster::http_code(r), 502) << r.out << r.err;
    EXPECT_NE(r.out.find("no sandgate-agent"), std::string::npos) << r.out;
  }
  auto entry = c.wait_access_entry([](const nlohmann::json& e) { return e.contains("status") && e["status"] == 502; });
  ASSERT_TRUE(entry.is_object()) << c.proxy().log();
  EXPECT_EQ(entry.value("cause", ""), "upstream_connect_failed");
  EXPECT_NE(entry.value("detail", "").find("no sandgate-agent"), std::string::npos) << entry.dump();
  ASSERT_EQ(c.cli("rm vq").exit_code, 0);
}

// The disk fills up during a hibernation: the migration fails, the VM stays paused in memory with the
// reason in its state, nothing of the guest is lost, and a request wakes it as usual.
TEST_F(Qemu, DiskFullDuringHibernateKeepsTheSandboxInMemory) {
  Cluster c(ClusterOptions::node(node_config()));
  // Sandbox directories (where the state file goes) on a tmpfs far smaller than the guest's RAM.
  SmallTmpfs full(c.dir() + "/node/sandboxes");
  ASSERT_TRUE(full.mounted);
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 2 --hibernate-after 2 "
                       "--memory-mb 256 -- /bin/sh -c " + shell_quote(kGuestServer),
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  c.wait_until_serving("q", 8080);
  EXPECT_EQ(counter(c).count, 1);
  ASSERT_TRUE(eventually([&] {
    auto j = c.get("q");
    return j["state"] == "suspended" && j["tier"] == "memory" &&
           j.value("state_reason", "").find("hibernate failed") != std::string::npos;
  }, std::chrono::seconds(90))) << c.get("q").dump() << c.node().log();
  Answer a = counter(c);
  EXPECT_EQ(a.code, 200) << c.node().log();
  EXPECT_EQ(a.count, 2) << "the guest's memory did not survive the failed hibernation";
  ASSERT_EQ(c.cli("rm q").exit_code, 0);
}

// A server that greets every connection with its banner and closes it: on the host's loopback (127.0.0.1,
// an ephemeral port) by default, or on a listening socket it is given (one made in another namespace).
class BannerServer {
 public:
  static constexpr const char* kHostLoopback = "HOST-LOOPBACK-REACHED\n";
  BannerServer() : BannerServer(loopback_listener(), kHostLoopback) {}
  BannerServer(UniqueFd listener, std::string banner) : fd_(std::move(listener)), banner_(std::move(banner)) {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    if (fd_.valid() && ::getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0) port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      while (!stop_) {
        pollfd p{fd_.get(), POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) continue;
        int c = ::accept(fd_.get(), nullptr, nullptr);
        if (c < 0) continue;
        (void)!::send(c, banner_.data(), banner_.size(), MSG_NOSIGNAL);
        ::close(c);
      }
    });
  }
  ~BannerServer() {
    stop_ = true;
    thread_.join();
  }
  uint16_t port() const { return port_; }

 private:
  static UniqueFd loopback_listener() {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd.get(), 16) != 0) return {};
    return fd;
  }
  UniqueFd fd_;
  std::string banner_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The TCP ports a process listens on in the host's network namespace (ss, run here, in it).
std::vector<std::string> host_listeners(int pid) {
  std::vector<std::string> ports;
  std::istringstream in(run("ss -Hltnp").out);
  for (std::string line; std::getline(in, line);) {
    if (line.find("pid=" + std::to_string(pid) + ",") == std::string::npos) continue;
    std::istringstream cols(line);
    std::string state, recvq, sendq, local;
    cols >> state >> recvq >> sendq >> local;
    ports.push_back(local.substr(local.rfind(':') + 1));
  }
  return ports;
}

int qemu_pid(const std::string& id) {
  return std::atoi(run("pgrep -f '[s]andgate-" + id + "' | head -1").out.c_str());
}

// The output of `script` run in the sandbox through the agent's /exec (the events' text, JSON-escaped).
std::string exec_in(Cluster& c, const std::string& host, const std::string& token, const std::string& script) {
  const nlohmann::json body = {{"command", {"sh", "-c", script}}};
  auto r = c.curl(host, "/exec", "-N -X POST -H 'Content-Type: application/json' --data " +
                                     shell_quote(body.dump()) + " " + bearer(token), 120);
  return r.out;
}

// Issue 10: a guest reached the host's loopback at 10.0.2.2 (so other VMs' agents, which have no auth, through
// their hostfwd ports), any local user reached every VM's agent on those ports, and the command and env were
// readable in QEMU's command line. Two VMs in one test (each boot costs tens of seconds under TCG).
TEST_F(Qemu, GuestIsSealedFromTheHostAndOtherVmsAndItsCommandIsNotInTheProcessList) {
  BannerServer host_server;
  ASSERT_NE(host_server.port(), 0);
  Cluster c(ClusterOptions::node(node_config()));
  auto other = c.cli("create --json --name vb --driver qemu --timeout 600 --memory-mb 256 -- /bin/sh -c 'exec sleep 100000'",
                     180);
  ASSERT_EQ(other.exit_code, 0) << other.out << other.err << c.node().log();
  const std::string other_id = nlohmann::json::parse(other.out, nullptr, false).value("id", "");
  const std::string secret = "sg-e2e-secret-" + std::to_string(::getpid());
  auto created = c.cli("create --json --name va --driver qemu --timeout 600 --memory-mb 256 --env SG_SECRET=" + secret +
                           " -- /bin/sh -c 'echo \"$SG_SECRET\" >/tmp/secret; exec sleep 100000'",
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const auto j = nlohmann::json::parse(created.out, nullptr, false);
  const std::string id = j.value("id", ""), token = j.value("token", "");
  ASSERT_FALSE(token.empty()) << created.out;

  // From the host's namespace: no port of either VM listens (before, every hostfwd port did).
  const int pid = qemu_pid(id), other_pid = qemu_pid(other_id);
  ASSERT_GT(pid, 0);
  ASSERT_GT(other_pid, 0);
  EXPECT_TRUE(host_listeners(pid).empty()) << run("ss -Hltnp").out;
  const std::vector<std::string> other_ports = host_listeners(other_pid);
  EXPECT_TRUE(other_ports.empty()) << run("ss -Hltnp").out;

  // From inside the VM: the host's loopback server, and the other VM's agent wherever it might be forwarded
  // (its port in the guest, any port its QEMU listens on in the host's namespace), through 10.0.2.2.
  std::string script = "out=$(timeout 5 nc 10.0.2.2 " + std::to_string(host_server.port()) +
                       " </dev/null); case \"$out\" in *HOST-LOOPBACK*) echo REACHED-host;; *) echo BLOCKED-host;; esac\n";
  std::vector<std::string> agent_ports = other_ports;
  agent_ports.push_back("9501");
  for (const std::string& p : agent_ports)
    script += "timeout 5 wget -T 3 -q -O - http://10.0.2.2:" + p + "/health && echo REACHED-" + p + " || echo BLOCKED-" + p + "\n";
  script += "echo secret=$(cat /tmp/secret)\n";
  const std::string out = exec_in(c, "va.sandbox.localhost", token, script);
  EXPECT_NE(out.find("BLOCKED-host"), std::string::npos) << out;
  EXPECT_EQ(out.find("REACHED-"), std::string::npos) << out;
  for (const std::string& p : agent_ports) EXPECT_NE(out.find("BLOCKED-" + p), std::string::npos) << out;
  // The env reached the command (through fw_cfg)...
  EXPECT_NE(out.find("secret=" + secret), std::string::npos) << out;
  // ...but not QEMU's command line, which every local user can read.
  std::ifstream cmdline_file("/proc/" + std::to_string(pid) + "/cmdline");
  const std::string cmdline((std::istreambuf_iterator<char>(cmdline_file)), std::istreambuf_iterator<char>());
  ASSERT_NE(cmdline.find("sandgate-" + id), std::string::npos) << cmdline;
  EXPECT_EQ(cmdline.find(secret), std::string::npos) << cmdline;
  EXPECT_EQ(cmdline.find("sg.cmd"), std::string::npos) << cmdline;
  EXPECT_EQ(cmdline.find("sleep 100000"), std::string::npos) << cmdline;
  const std::string dir = c.dir() + "/node/sandboxes/" + id;
  struct stat st{};
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat((dir + "/guest-command.sh").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(c.cli("rm va").exit_code, 0);
  EXPECT_EQ(c.cli("rm vb").exit_code, 0);
}

// A `docker save` archive of a one-layer image in `dir`: busybox (static) as /bin/sh and friends, and
// /etc/image-marker. Returns the archive's path.
std::string busybox_image(const std::string& dir) {
  const std::string rootfs = dir + "/rootfs", out = dir + "/out";
  EXPECT_EQ(run("mkdir -p " + rootfs + "/bin " + rootfs + "/etc " + out + "/l0 && cp /bin/busybox " + rootfs +
                "/bin/ && for t in sh cat echo grep sync sleep; do ln -s busybox " + rootfs +
                "/bin/$t; done && echo from-the-image >" + rootfs + "/etc/image-marker && tar -cf " + out +
                "/l0/layer.tar -C " + rootfs + " .")
                .exit_code,
            0);
  const nlohmann::json config = {
      {"os", "linux"},
      {"config", {{"Env", {"PATH=/bin"}}, {"Cmd", {"/bin/sh"}}, {"WorkingDir", "/"}}},
      {"rootfs", {{"type", "layers"}, {"diff_ids", {"sha256:" + sha256_file(out + "/l0/layer.tar")}}}}};
  std::ofstream(out + "/config.json") << config.dump();
  const std::string config_name = sha256_file(out + "/config.json") + ".json";  // named by its digest
  EXPECT_EQ(run("mv " + out + "/config.json " + out + "/" + config_name).exit_code, 0);
  const nlohmann::json manifest =
      nlohmann::json::array({{{"Config", config_name}, {"RepoTags", {"qdisk:latest"}}, {"Layers", {"l0/layer.tar"}}}});
  std::ofstream(out + "/manifest.json") << manifest.dump();
  EXPECT_EQ(run("tar -cf " + dir + "/image.tar -C " + out + " .").exit_code, 0);
  return dir + "/image.tar";
}

// The value after "kept-" in an exec's output ("" when absent).
std::string kept_value(const std::string& out) {
  size_t at = out.find("kept-");
  if (at == std::string::npos) return "";
  size_t end = out.find_first_not_of("kept-0123456789", at);
  return out.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

// Issue 10: the guest's root filesystem is a disk made from the create's image (a shared base plus the
// sandbox's qcow2 overlay), and what the guest writes there stays through both tiers and a node restart.
TEST_F(Qemu, ImageDiskKeepsWhatTheGuestWroteAcrossSuspendHibernateAndNodeRestart) {
  // A store of its own: the image it imports must not stay behind in the test image's shared store. No
  // node.qemu_image: the disk comes from --image alone.
  Cluster c(ClusterOptions::node(node_config() + "images_dir = \"\"\n"));
  const std::string archive = busybox_image(c.dir() + "/img");
  auto imported = c.cli("image import " + archive + " qdisk");
  ASSERT_EQ(imported.exit_code, 0) << imported.out << imported.err;
  auto created = c.cli("create --json --name vd --driver qemu --image qdisk --timeout 3 --hibernate-after 3 "
                       "--memory-mb 256 "
                       "-- /bin/sh -c 'exec sleep 100000'",
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const auto j = nlohmann::json::parse(created.out, nullptr, false);
  const std::string id = j.value("id", ""), token = j.value("token", "");
  const std::string host = "vd.sandbox.localhost";

  std::string out = exec_in(c, host, token,
                            "cat /etc/image-marker; grep ' / ' /proc/mounts; echo kept-$$ >/data.txt; sync; cat /data.txt");
  EXPECT_NE(out.find("from-the-image"), std::string::npos) << out;
  EXPECT_NE(out.find("/dev/vda / ext4"), std::string::npos) << out;
  const std::string kept = kept_value(out);
  ASSERT_FALSE(kept.empty()) << out;

  ASSERT_TRUE(eventually([&] { return c.get("vd")["tier"] == "memory"; }, std::chrono::seconds(30)));
  EXPECT_EQ(kept_value(exec_in(c, host, token, "cat /data.txt")), kept) << "after suspend + resume";

  ASSERT_TRUE(eventually([&] {
    auto s = c.get("vd");
    return s["tier"] == "disk" && s["state"] == "suspended";
  }, std::chrono::seconds(60))) << c.get("vd").dump() << c.node().log();
  // Hibernated, QEMU is gone: the file is in the sandbox's overlay on disk, as the host reads it. The guest's
  // sync may have left the file's metadata in ext4's journal only (jbd2 writes it home later), and debugfs
  // does not replay a journal: e2fsck replays it into the copy first (exit 1: "errors corrected").
  const std::string raw = c.dir() + "/disk.raw";
  auto on_disk = run("qemu-img convert -O raw " + c.dir() + "/node/sandboxes/" + id + "/disk.qcow2 " + raw +
                     " && { e2fsck -fy " + raw + " >/dev/null 2>&1; [ $? -le 1 ]; } && debugfs -R 'cat /data.txt' " +
                     raw + " 2>/dev/null");
  EXPECT_EQ(kept_value(on_disk.out), kept) << on_disk.out << on_disk.err;
  EXPECT_EQ(kept_value(exec_in(c, host, token, "cat /data.txt")), kept) << "after hibernate + restore";

  c.node().stop(SIGKILL);
  c.start_node();
  ASSERT_TRUE(eventually([&] {
    auto s = c.get("vd")["state"];
    return s == "suspended" || s == "running";
  }, std::chrono::seconds(60))) << c.get("vd").dump() << c.node().log();
  EXPECT_EQ(kept_value(exec_in(c, host, token, "cat /data.txt")), kept) << "after a node restart";
  expect_every_identity_line_taken(c);  // by the agent chrooted into the image's disk
  EXPECT_EQ(c.cli("rm vd").exit_code, 0);
}

// `sandgate checkpoint` (a filesystem checkpoint, the default) of a QEMU sandbox booted on an image's disk:
// the guest's agent writes out what it just wrote before a backup job copies its disk while it runs on, and a
// sandbox created from the checkpoint in another shape boots on that disk with the file there. The source's
// next checkpoint holds only what it wrote since (1 MiB of a 17 MiB overlay) over the first one's disk, and a
// sandbox from it has everything. A snapshot whose disk a later one reads is removed from the list at once
// and from the disk with the last of those.
TEST_F(Qemu, AFilesystemCheckpointHasWhatTheGuestJustWroteAndBootsInAnotherShape) {
  Cluster c(ClusterOptions::node(node_config() + "images_dir = \"\"\n"));
  const std::string archive = busybox_image(c.dir() + "/img");
  auto imported = c.cli("image import " + archive + " qdisk");
  ASSERT_EQ(imported.exit_code, 0) << imported.out << imported.err;
  auto created = c.cli("create --json --name vd --driver qemu --image qdisk --timeout 600 --memory-mb 256 "
                       "-- /bin/sh -c 'exec sleep 100000'",
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const auto j = nlohmann::json::parse(created.out, nullptr, false);
  const std::string id = j.value("id", ""), token = j.value("token", "");
  // No sync here: the file is in the guest's page cache when the checkpoint is asked for.
  const std::string kept = kept_value(exec_in(
      c, "vd.sandbox.localhost", token,
      "dd if=/dev/urandom of=/big bs=1M count=16 2>/dev/null; echo kept-$$ >/data.txt; cat /data.txt"));
  ASSERT_FALSE(kept.empty());
  const std::string big_hash = exec_in(c, "vd.sandbox.localhost", token, "sha256sum /big");

  auto checkpoint = c.cli("checkpoint vd --json", 180);
  ASSERT_EQ(checkpoint.exit_code, 0) << checkpoint.out << checkpoint.err << c.node().log();
  const auto cp = nlohmann::json::parse(checkpoint.out, nullptr, false);
  const std::string snap = cp.value("snapshot_id", "");
  ASSERT_FALSE(snap.empty()) << checkpoint.out;
  EXPECT_EQ(cp["snapshot"]["type"], "filesystem");
  const uint64_t first_bytes = cp["snapshot"].value("disk_bytes", 0ull);
  EXPECT_GT(first_bytes, 16ull << 20) << checkpoint.out;
  EXPECT_FALSE(cp["snapshot"].contains("memory_mb")) << checkpoint.out;
  EXPECT_FALSE(cp["snapshot"].contains("parent")) << checkpoint.out;
  std::fprintf(stderr, "filesystem checkpoint of a QEMU guest: transaction %.1f ms, disk %llu bytes\n",
               cp.value("pause_ms", 0.0), static_cast<unsigned long long>(first_bytes));
  EXPECT_EQ(c.node().log().find("write out its files"), std::string::npos) << c.node().log();
  EXPECT_EQ(c.node().log().find("did not confirm"), std::string::npos) << c.node().log();
  EXPECT_EQ(c.get("vd")["state"], "running");
  EXPECT_EQ(c.get("vd")["id"], id);

  auto copy = c.cli("create --json --name vd2 --from " + snap + " --memory-mb 384", 180);
  ASSERT_EQ(copy.exit_code, 0) << copy.out << copy.err << c.node().log();
  const auto k = nlohmann::json::parse(copy.out, nullptr, false);
  const std::string copy_token = k.value("token", "");
  EXPECT_NE(k.value("id", ""), id);
  const std::string seen = exec_in(c, "vd2.sandbox.localhost", copy_token,
                                   "cat /data.txt; cat /etc/image-marker; grep MemTotal /proc/meminfo");
  EXPECT_EQ(kept_value(seen), kept) << seen << c.node().log();
  EXPECT_NE(seen.find("from-the-image"), std::string::npos) << seen;
  // A cold boot in the new shape: more than the source's 256 MiB.
  const auto mem = seen.find("MemTotal:");
  ASSERT_NE(mem, std::string::npos) << seen;
  EXPECT_GT(std::stol(seen.substr(mem + 9)), 300L * 1024) << seen;
  // The source's later writes are its own.
  const std::string small_hash = exec_in(
      c, "vd.sandbox.localhost", token, "echo later >/data.txt; dd if=/dev/urandom of=/small bs=1M count=1 2>/dev/null; "
                                        "sha256sum /small");
  ASSERT_NE(small_hash.find("  /small"), std::string::npos) << small_hash;
  EXPECT_EQ(kept_value(exec_in(c, "vd2.sandbox.localhost", copy_token, "cat /data.txt")), kept);

  // The source's second checkpoint: what it wrote since the first, over the first one's disk.
  auto delta = c.cli("checkpoint vd --json", 180);
  ASSERT_EQ(delta.exit_code, 0) << delta.out << delta.err << c.node().log();
  const auto cpd = nlohmann::json::parse(delta.out, nullptr, false);
  const std::string snap_b = cpd.value("snapshot_id", "");
  EXPECT_EQ(cpd["snapshot"].value("parent", ""), snap) << delta.out;
  const uint64_t delta_bytes = cpd["snapshot"].value("disk_bytes", 0ull);
  std::fprintf(stderr, "the next checkpoint, 1 MiB written since: transaction %.1f ms, disk %llu bytes (the first: %llu)\n",
               cpd.value("pause_ms", 0.0), static_cast<unsigned long long>(delta_bytes),
               static_cast<unsigned long long>(first_bytes));
  EXPECT_GT(delta_bytes, 1ull << 20) << delta.out;
  EXPECT_LT(delta_bytes, 4ull << 20) << "the second checkpoint copied more than what changed: " << delta.out;
  auto third = c.cli("create --json --name vd3 --from " + snap_b, 180);
  ASSERT_EQ(third.exit_code, 0) << third.out << third.err << c.node().log();
  const std::string third_token = nlohmann::json::parse(third.out, nullptr, false).value("token", "");
  const std::string in_third =
      exec_in(c, "vd3.sandbox.localhost", third_token, "cat /data.txt; sha256sum /small; sha256sum /big");
  EXPECT_NE(in_third.find("later"), std::string::npos) << in_third;
  // sha256sum's line, "<64 hex>  <path>", in an exec's output.
  auto hash_of = [](const std::string& out, const std::string& path) {
    const size_t at = out.find("  " + path);
    return at == std::string::npos || at < 64 ? std::string() : out.substr(at - 64, 64);
  };
  ASSERT_FALSE(hash_of(big_hash, "/big").empty()) << big_hash;
  EXPECT_EQ(hash_of(in_third, "/small"), hash_of(small_hash, "/small")) << in_third << small_hash;
  EXPECT_EQ(hash_of(in_third, "/big"), hash_of(big_hash, "/big")) << in_third << big_hash;

  // A memory checkpoint copies the disk the same way, while the guest stands: a delta over snap_b. A sandbox
  // from it continues with the disk as it was.
  exec_in(c, "vd.sandbox.localhost", token, "echo kept-in-memory >/data.txt");
  auto memory = c.cli("checkpoint vd --type memory --json", 180);
  ASSERT_EQ(memory.exit_code, 0) << memory.out << memory.err << c.node().log();
  const auto cpm = nlohmann::json::parse(memory.out, nullptr, false);
  const std::string snap_m = cpm.value("snapshot_id", "");
  EXPECT_EQ(cpm["snapshot"].value("parent", ""), snap_b) << memory.out;
  EXPECT_LT(cpm["snapshot"].value("disk_bytes", 0ull), 4ull << 20) << memory.out;
  auto warm = c.cli("create --json --name vd5 --from " + snap_m, 180);
  ASSERT_EQ(warm.exit_code, 0) << warm.out << warm.err << c.node().log();
  const std::string warm_token = nlohmann::json::parse(warm.out, nullptr, false).value("token", "");
  const std::string in_warm = exec_in(c, "vd5.sandbox.localhost", warm_token, "cat /data.txt; sha256sum /small");
  EXPECT_NE(in_warm.find("kept-in-memory"), std::string::npos) << in_warm;
  EXPECT_EQ(hash_of(in_warm, "/small"), hash_of(small_hash, "/small")) << in_warm;
  ASSERT_EQ(c.cli("rm vd5").exit_code, 0);
  ASSERT_EQ(c.cli("snapshot rm " + snap_m).exit_code, 0);

  // vd2's checkpoint reads the first snapshot's disk under its own too.
  auto second = c.cli("checkpoint vd2 --json", 180);
  ASSERT_EQ(second.exit_code, 0) << second.out << second.err << c.node().log();
  const auto cp2 = nlohmann::json::parse(second.out, nullptr, false);
  const std::string child = cp2.value("snapshot_id", "");
  EXPECT_EQ(cp2["snapshot"].value("parent", ""), snap) << second.out;
  ASSERT_EQ(c.cli("rm vd2").exit_code, 0);

  // Removed while two snapshots' disks read it: unlisted at once, its disk kept for them.
  const std::string files = run("find " + c.dir() + " -maxdepth 4 -type d -name " + snap + ".d").out;
  ASSERT_FALSE(files.empty()) << "no files dir for " << snap;
  const std::string snap_dir = files.substr(0, files.find('\n'));
  auto removed = c.cli("snapshot rm " + snap);
  EXPECT_EQ(removed.exit_code, 0) << removed.out << removed.err;
  EXPECT_NE(removed.out.find("stays"), std::string::npos) << removed.out;
  const auto listed = nlohmann::json::parse(c.cli("snapshots --json").out, nullptr, false).value(
      "snapshots", nlohmann::json());
  ASSERT_TRUE(listed.is_array()) << listed.dump();
  EXPECT_EQ(listed.size(), 2u) << listed.dump();
  for (const auto& s : listed) EXPECT_NE(s.value("id", ""), snap) << "a removed snapshot is still listed";
  EXPECT_NE(c.cli("create --name vd4 --from " + snap).exit_code, 0) << "a removed snapshot started a sandbox";
  EXPECT_EQ(c.cli("snapshot rm " + child).exit_code, 0);
  EXPECT_TRUE(std::filesystem::exists(snap_dir)) << "the disk went while " << snap_b << " reads it";
  EXPECT_NE(c.cli("snapshot rm " + snap_b).exit_code, 0) << "removed while vd3 runs on it";
  ASSERT_EQ(c.cli("rm vd3").exit_code, 0);
  EXPECT_EQ(c.cli("snapshot rm " + snap_b).exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(snap_dir)) << "the removed snapshot's disk stayed after its last child went";
  EXPECT_EQ(c.cli("rm vd").exit_code, 0);
}

// A line of sandboxes, each made from the last one's checkpoint: each checkpoint is a whole copy of its
// sandbox's overlay on the snapshot under it, so the chain of disks would grow by one per generation. Once
// the disks under a sandbox's overlay reach node.checkpoint_flatten_layers (2 here), its checkpoint first
// streams them into the overlay: the new snapshot's disk backs on the image's base alone, and has every
// generation's file.
TEST_F(Qemu, ALineOfSandboxesFromCheckpointsKeepsItsDiskChainShort) {
  Cluster c(ClusterOptions::node(node_config() + "images_dir = \"\"\ncheckpoint_flatten_layers = 2\n"));
  const std::string archive = busybox_image(c.dir() + "/img");
  ASSERT_EQ(c.cli("image import " + archive + " qdisk").exit_code, 0);
  // The number of images in the backing chain of snapshot `snap`'s disk, itself included.
  auto chain_of = [&](const std::string& snap) {
    const std::string dir = run("find " + c.dir() + " -maxdepth 4 -type d -name " + snap + ".d").out;
    const std::string disk = dir.substr(0, dir.find('\n')) + "/disk.qcow2";
    return std::stoi(run("qemu-img info -U --backing-chain " + disk + " | grep -c '^image:'").out);
  };
  std::string from = "--driver qemu --image qdisk -- /bin/sh -c 'exec sleep 100000'";
  std::vector<std::string> snaps;
  for (int g = 0; g < 3; ++g) {
    const std::string name = "g" + std::to_string(g);
    auto created = c.cli("create --json --name " + name + " --timeout 600 --memory-mb 256 " + from, 180);
    ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
    const std::string token = nlohmann::json::parse(created.out, nullptr, false).value("token", "");
    const std::string seen = exec_in(c, name + ".sandbox.localhost", token,
                                     "echo kept-" + std::to_string(g) + " >/" + name + "; cat /g0 /g1 /g2 2>/dev/null");
    for (int before = 0; before < g; ++before)
      EXPECT_NE(seen.find("kept-" + std::to_string(before)), std::string::npos) << name << ": " << seen;
    auto checkpoint = c.cli("checkpoint " + name + " --json", 180);
    ASSERT_EQ(checkpoint.exit_code, 0) << checkpoint.out << checkpoint.err << c.node().log();
    snaps.push_back(nlohmann::json::parse(checkpoint.out, nullptr, false).value("snapshot_id", ""));
    from = "--from " + snaps.back();
  }
  EXPECT_EQ(chain_of(snaps[0]), 2);  // g0's disk, the image's base
  EXPECT_EQ(chain_of(snaps[1]), 3);  // g1's, g0's, the base
  EXPECT_EQ(chain_of(snaps[2]), 2) << "g2's checkpoint did not flatten the disks it inherited";
  auto last = c.cli("create --json --name g3 --timeout 600 " + from, 180);
  ASSERT_EQ(last.exit_code, 0) << last.out << last.err << c.node().log();
  const std::string token = nlohmann::json::parse(last.out, nullptr, false).value("token", "");
  const std::string seen = exec_in(c, "g3.sandbox.localhost", token, "cat /g0 /g1 /g2");
  for (int g = 0; g < 3; ++g) EXPECT_NE(seen.find("kept-" + std::to_string(g)), std::string::npos) << seen;
}

// node.qemu_image is the default image of QEMU sandboxes (the create names none): the guest boots its disk,
// the sandbox records the image, `image rm` is refused while the sandbox uses it and succeeds once it is gone.
TEST_F(Qemu, ImageDiskFromTheNodeDefaultIsInUseUntilTheSandboxGoes) {
  Cluster c(ClusterOptions::node(node_config() + "qemu_image = \"qdisk\"\nimages_dir = \"\"\n"));
  const std::string archive = busybox_image(c.dir() + "/img");
  auto imported = c.cli("image import " + archive + " qdisk");
  ASSERT_EQ(imported.exit_code, 0) << imported.out << imported.err;
  auto created = c.cli("create --json --name vn --driver qemu --timeout 600 --memory-mb 256 -- /bin/sh -c 'exec sleep 100000'",
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const auto j = nlohmann::json::parse(created.out, nullptr, false);
  const std::string id = j.value("id", ""), token = j.value("token", "");
  EXPECT_EQ(c.get("vn").value("image", ""), "qdisk");
  const std::string out = exec_in(c, "vn.sandbox.localhost", token, "cat /etc/image-marker; grep ' / ' /proc/mounts");
  EXPECT_NE(out.find("from-the-image"), std::string::npos) << out;
  EXPECT_NE(out.find("/dev/vda / ext4"), std::string::npos) << out;

  auto refused = c.cli("image rm qdisk");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE((refused.out + refused.err).find(id), std::string::npos) << refused.out << refused.err;
  ASSERT_EQ(c.cli("rm vn").exit_code, 0);
  const std::string bases = "ls " + c.dir() + "/node/qemu-disks | grep -c '[.]raw$'";
  EXPECT_EQ(run(bases).out, "1\n");
  auto removed = c.cli("image rm qdisk");
  EXPECT_EQ(removed.exit_code, 0) << removed.out << removed.err;
  EXPECT_EQ(run(bases).out, "0\n") << "the image's base disk stayed after `image rm`";
}

// Removes a node's egress bridge and table when the test ends, whatever happened.
struct EgressCleanup {
  std::string bridge;
  ~EgressCleanup() {
    (void)run_tool({"ip", "link", "del", bridge});
    (void)run_tool({"nft", "delete", "table", "inet", bridge});
  }
};

// A script for the guest that tries each target ("NAME HOST PORT") at once and prints REACHED-NAME when the
// target's banner came back within 5 s, BLOCKED-NAME otherwise.
std::string probe_script(const std::vector<std::string>& targets) {
  std::string script;
  for (const std::string& t : targets) {
    std::istringstream in(t);
    std::string name, host, port;
    in >> name >> host >> port;
    script += "(out=$(timeout 5 nc " + host + " " + port + " </dev/null 2>&1); case \"$out\" in *-REACHED*) echo REACHED-" +
              name + ";; *) echo BLOCKED-" + name + ";; esac) &\n";
  }
  return script + "wait\n";
}

// Issue 10: QEMU sandboxes had no internet access (refused at create). Now the VM's namespace is attached to
// the node's egress like a process sandbox (a veth, the sandbox's nftables chain) and slirp runs without
// restrict=on, so the guest reaches the (fake) internet except what deny_out names, never the host, and keeps
// it across a hibernation (a new namespace) and a node restart; a VM without it reaches nothing. The fake
// internet is a namespace this test makes (198.51.100.0/24): nothing is routed anywhere else.
TEST_F(Qemu, InternetAccessGoesThroughTheNodesEgressAndItsListsAndWithoutItNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (network namespaces, nftables)";
  const std::string tag = "sgqe" + std::to_string(::getpid() % 10000);
  EgressCleanup cleanup{tag};
  testing::FakeInternet internet(tag);
  Status st = internet.start();
  ASSERT_TRUE(st) << st.message();
  std::vector<std::unique_ptr<BannerServer>> servers;
  for (const char* addr : {"198.51.100.1", "198.51.100.2"}) {
    UniqueFd fd = testing::in_netns(internet.ns().path(), [&] { return testing::listen_on(addr, 7070); });
    ASSERT_TRUE(fd.valid()) << addr;
    servers.push_back(std::make_unique<BannerServer>(std::move(fd), "FAKE-INTERNET-REACHED\n"));
  }
  Cluster c(ClusterOptions::node(node_config() + "egress_bridge = \"" + tag + "\"\negress_subnet = \"10.248.0.0/16\"\n"));
  auto on = c.cli("create --json --name qon --driver qemu --internet --deny-out 198.51.100.2 --timeout 600 "
                  "--hibernate-after 2 --memory-mb 256 -- /bin/sh -c 'exec sleep 100000'",
                  180);
  ASSERT_EQ(on.exit_code, 0) << on.out << on.err << c.node().log();
  auto off = c.cli("create --json --name qoff --driver qemu --timeout 600 --memory-mb 256 -- /bin/sh -c 'exec sleep 100000'",
                   180);
  ASSERT_EQ(off.exit_code, 0) << off.out << off.err << c.node().log();
  const std::string on_token = nlohmann::json::parse(on.out, nullptr, false).value("token", "");
  const std::string off_id = nlohmann::json::parse(off.out, nullptr, false).value("id", "");
  const std::string off_token = nlohmann::json::parse(off.out, nullptr, false).value("token", "");
  EXPECT_EQ(c.get("qon").value("allow_internet_access", false), true);

  // The host itself, at the bridge's gateway address (there since qon attached), is not for sandboxes.
  UniqueFd gateway_fd = testing::listen_on("10.248.0.1", 0);
  ASSERT_TRUE(gateway_fd.valid());
  BannerServer host_server(std::move(gateway_fd), "HOST-GATEWAY-REACHED\n");
  const std::string gw = "gw 10.248.0.1 " + std::to_string(host_server.port());

  std::string out = exec_in(c, "qon.sandbox.localhost", on_token,
                            probe_script({"one 198.51.100.1 7070", "two 198.51.100.2 7070", gw}));
  EXPECT_NE(out.find("REACHED-one"), std::string::npos) << out << c.node().log();
  EXPECT_NE(out.find("BLOCKED-two"), std::string::npos) << out;  // --deny-out
  EXPECT_NE(out.find("BLOCKED-gw"), std::string::npos) << out;
  out = exec_in(c, "qoff.sandbox.localhost", off_token, probe_script({"one 198.51.100.1 7070", gw}));
  EXPECT_NE(out.find("BLOCKED-one"), std::string::npos) << out;
  EXPECT_NE(out.find("BLOCKED-gw"), std::string::npos) << out;
  // Without internet access the VM's namespace has no link out at all.
  auto links = run("nsenter --net=/proc/" + std::to_string(qemu_pid(off_id)) + "/ns/net ip -o link show");
  EXPECT_NE(links.out.find("lo:"), std::string::npos) << links.out << links.err;
  EXPECT_EQ(links.out.find("eth0"), std::string::npos) << links.out;

  // Hibernated: the restored QEMU's new namespace is attached again, with the same chain.
  ASSERT_EQ(c.cli("suspend qon").exit_code, 0);
  ASSERT_TRUE(eventually([&] {
    auto j = c.get("qon");
    return j["tier"] == "disk" && j["state"] == "suspended";
  }, std::chrono::seconds(60))) << c.get("qon").dump() << c.node().log();
  out = exec_in(c, "qon.sandbox.localhost", on_token, probe_script({"one 198.51.100.1 7070", "two 198.51.100.2 7070"}));
  EXPECT_NE(out.find("REACHED-one"), std::string::npos) << "after hibernate + restore: " << out << c.node().log();
  EXPECT_NE(out.find("BLOCKED-two"), std::string::npos) << "after hibernate + restore: " << out;

  // A restarted node adopts the running VM with its links and rules as they were.
  c.node().stop(SIGKILL);
  c.start_node();
  ASSERT_TRUE(eventually([&] { return c.get("qon")["state"] == "running"; }, std::chrono::seconds(60)))
      << c.get("qon").dump() << c.node().log();
  out = exec_in(c, "qon.sandbox.localhost", on_token, probe_script({"one 198.51.100.1 7070"}));
  EXPECT_NE(out.find("REACHED-one"), std::string::npos) << "after a node restart: " << out << c.node().log();

  // Removed: its chain goes with it.
  auto chains = [&] {
    auto table = run_tool({"nft", "list", "table", "inet", tag});
    if (!table) return -1;
    int n = 0;
    for (size_t at = 0; (at = table->find("chain sb", at)) != std::string::npos; ++at) ++n;
    return n;
  };
  EXPECT_EQ(chains(), 1);
  ASSERT_EQ(c.cli("rm qon").exit_code, 0);
  EXPECT_EQ(chains(), 0);
  EXPECT_EQ(c.cli("rm qoff").exit_code, 0);
}

// Issue 11: a memory checkpoint saves the running guest (RAM, devices, disk) while the source keeps running;
// a sandbox created from it continues its processes, and so does each fork, each with its own identity.
TEST_F(Qemu, MemoryCheckpointContinuesTheGuestAndForksDivergeWithTheirOwnIdentity) {
  // A store of its own: the snapshots go where the test dir is removed, whatever the outcome.
  Cluster c(ClusterOptions::node(node_config() + "images_dir = \"\"\n"));
  const auto boot_started = std::chrono::steady_clock::now();
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 600 --memory-mb 256 -- "
                       "/bin/sh -c " + shell_quote(kGuestServer),
                       180);
  std::fprintf(stderr, "cold create (a boot under TCG): %.0f ms (CLI round trip)\n",
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - boot_started).count());
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const auto source = nlohmann::json::parse(created.out, nullptr, false);
  const std::string source_id = source.value("id", ""), source_token = source.value("token", "");
  c.wait_until_serving("q", 8080);
  ASSERT_EQ(counter(c).count, 1);
  ASSERT_EQ(counter(c).count, 2);

  auto checkpoint = c.cli("checkpoint q --type memory --json", 180);
  ASSERT_EQ(checkpoint.exit_code, 0) << checkpoint.out << checkpoint.err << c.node().log();
  const auto cp = nlohmann::json::parse(checkpoint.out, nullptr, false);
  const std::string snap = cp.value("snapshot_id", "");
  ASSERT_FALSE(snap.empty()) << checkpoint.out;
  EXPECT_EQ(cp["snapshot"]["type"], "memory");
  EXPECT_EQ(cp["snapshot"]["memory_mb"], 256);
  // The RAM is saved apart from the device state, which is KiB whatever the guest's memory.
  EXPECT_GT(cp["snapshot"].value("state_bytes", 0), 0) << checkpoint.out;
  EXPECT_LT(cp["snapshot"].value("state_bytes", 0), 1 << 20) << checkpoint.out;
  EXPECT_GT(cp["snapshot"].value("ram_bytes", 0), 0) << checkpoint.out;
  std::fprintf(stderr, "memory checkpoint of a 256 MiB guest: paused %.1f ms, state %llu bytes, RAM %llu bytes\n",
               cp.value("pause_ms", 0.0), static_cast<unsigned long long>(cp["snapshot"].value("state_bytes", 0ull)),
               static_cast<unsigned long long>(cp["snapshot"].value("ram_bytes", 0ull)));
  // The source kept running, under its own id, and counts on from where it was.
  EXPECT_EQ(c.get("q")["state"], "running");
  EXPECT_EQ(c.get("q")["id"], source_id);
  EXPECT_EQ(counter(c).count, 3);

  // A shape the saved guest cannot continue in is refused, naming why.
  auto resized = c.cli("create --from " + snap + " --memory-mb 512");
  EXPECT_NE(resized.exit_code, 0);
  EXPECT_NE(resized.err.find("memory snapshot of a 256 MiB guest"), std::string::npos) << resized.err;

  // Created from the snapshot: the guest's processes continue from the checkpointed value (2), not from 0.
  const auto create_started = std::chrono::steady_clock::now();
  auto restored = c.cli("create --json --name r --from " + snap, 180);
  std::fprintf(stderr, "create from the memory snapshot: %.0f ms (CLI round trip)\n",
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - create_started).count());
  ASSERT_EQ(restored.exit_code, 0) << restored.out << restored.err << c.node().log();
  const auto r = nlohmann::json::parse(restored.out, nullptr, false);
  EXPECT_NE(r.value("id", ""), source_id);
  EXPECT_NE(r.value("token", ""), source_token);
  Answer from_snapshot = counter(c, "r");
  EXPECT_EQ(from_snapshot.code, 200) << c.node().log();
  EXPECT_EQ(from_snapshot.count, 3) << "the restored guest did not continue from the checkpoint";
  EXPECT_LE(std::labs(from_snapshot.guest_time - static_cast<long>(std::time(nullptr))), 3) << "clock not set";

  // fork: a memory checkpoint of the source (now at 3), then two sandboxes from it.
  auto forked = c.cli("fork q --count 2 --name-prefix f --json", 300);
  ASSERT_EQ(forked.exit_code, 0) << forked.out << forked.err << c.node().log();
  const auto f = nlohmann::json::parse(forked.out, nullptr, false);
  ASSERT_EQ(f["sandboxes"].size(), 2u) << forked.out;
  const std::string fork_snap = f.value("snapshot_id", "");
  std::vector<std::string> ids, tokens;
  for (const auto& sb : f["sandboxes"]) {
    ids.push_back(sb.value("id", ""));
    tokens.push_back(sb.value("token", ""));
  }
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_EQ(counter(c, "f-1").count, 4);
  EXPECT_EQ(counter(c, "f-2").count, 4);
  EXPECT_EQ(counter(c, "f-1").count, 5) << "the forks diverge: each counts on its own";
  EXPECT_EQ(counter(c, "q").count, 4);

  // Each fork knows who it is (the agent's /health, the hostname) and draws its own random numbers.
  std::vector<std::string> random;
  for (int i = 0; i < 2; ++i) {
    const std::string name = "f-" + std::to_string(i + 1);
    const std::string host = name + ".sandbox.localhost";
    EXPECT_TRUE(eventually([&] {
      auto h = c.curl(host, "/health", bearer(tokens[i]), 30);
      return Cluster::body(h).find(ids[i]) != std::string::npos;
    }, std::chrono::seconds(30))) << Cluster::body(c.curl(host, "/health", bearer(tokens[i]), 30));
    std::string out = exec_in(c, host, tokens[i], "hostname; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'");
    EXPECT_NE(out.find(name), std::string::npos) << out;
    random.push_back(out.substr(out.find(name) + name.size()));
    // Logged before the id is recorded; the serial console reaches its file a moment later.
    const std::string console = c.dir() + "/node/sandboxes/" + ids[i] + "/console.log";
    EXPECT_TRUE(eventually([&] {
      std::ifstream in(console);
      std::stringstream text;
      text << in.rdbuf();
      return text.str().find("kernel RNG reseeded") != std::string::npos;
    }, std::chrono::seconds(10))) << "the guest logs its reseed";
  }
  EXPECT_NE(random[0], random[1]) << "two forks read the same /dev/urandom bytes";
  // Both forks map the fork snapshot's RAM file (privately): the pages neither wrote are one copy in memory.
  const std::string fork_ram = "/" + fork_snap + ".d/ram";
  for (const std::string& id : ids) {
    const std::string maps = read_file("/proc/" + std::to_string(qemu_pid(id)) + "/maps");
    EXPECT_NE(maps.find(fork_ram), std::string::npos) << id << " does not map " << fork_ram;
  }

  // A sandbox suspended in memory is checkpointed as it stands (its stopped VM) and stays suspended; a
  // create from that checkpoint continues it, and the source wakes as usual.
  ASSERT_EQ(c.cli("suspend q").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("q")["state"] == "suspended"; }, std::chrono::seconds(30)));
  auto asleep = c.cli("checkpoint q --type memory --json", 180);
  ASSERT_EQ(asleep.exit_code, 0) << asleep.out << asleep.err << c.node().log();
  const std::string asleep_snap = nlohmann::json::parse(asleep.out, nullptr, false).value("snapshot_id", "");
  EXPECT_EQ(nlohmann::json::parse(asleep.out, nullptr, false).value("pause_ms", -1.0), 0.0) << asleep.out;
  EXPECT_EQ(c.get("q")["state"], "suspended") << "the checkpoint woke the sandbox";
  ASSERT_EQ(c.cli("create --name s --from " + asleep_snap, 180).exit_code, 0) << c.node().log();
  Answer from_asleep = counter(c, "s");
  EXPECT_EQ(from_asleep.count, 5) << "the sandbox from the suspended guest's checkpoint did not continue it";
  EXPECT_LE(std::labs(from_asleep.guest_time - static_cast<long>(std::time(nullptr))), 3) << "clock not set";
  EXPECT_EQ(counter(c, "q").count, 5) << "the source did not wake with its memory";

  // A snapshot in use stays; the records outlive a node restart, and so do the sandboxes made from them.
  auto in_use = c.cli("snapshot rm " + snap);
  EXPECT_NE(in_use.exit_code, 0);
  EXPECT_NE(in_use.err.find("in use by"), std::string::npos) << in_use.err;
  c.node().stop(SIGKILL);
  c.start_node();
  auto listed = c.cli("snapshots --json");
  EXPECT_NE(listed.out.find(snap), std::string::npos) << listed.out;
  EXPECT_NE(listed.out.find(fork_snap), std::string::npos) << listed.out;
  EXPECT_EQ(counter(c, "r").count, 4) << c.node().log();

  for (const char* name : {"r", "f-1", "f-2", "s", "q"}) EXPECT_EQ(c.cli(std::string("rm ") + name).exit_code, 0) << name;
  for (const std::string& id : {snap, fork_snap, asleep_snap}) {
    auto removed = c.cli("snapshot rm " + id);
    EXPECT_EQ(removed.exit_code, 0) << removed.out << removed.err;
  }
  EXPECT_EQ(run("ls -A " + c.dir() + "/node/snapshots").out, "")
      << "the snapshots' files are gone with their records";
}

// The disk filling up during a memory checkpoint (the snapshots' directory on a tmpfs that holds the device
// state but not the RAM): the checkpoint fails naming the cause, the guest runs on with its memory, and no
// snapshot nor any of its files stays.
TEST_F(Qemu, DiskFullDuringAMemoryCheckpointLeavesNoSnapshotAndTheGuestRunning) {
  Cluster c(ClusterOptions::node(node_config() + "images_dir = \"\"\n"));
  const std::string snapshots = c.dir() + "/node/snapshots";
  SmallTmpfs small(snapshots);
  ASSERT_TRUE(small.mounted);
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 600 --memory-mb 256 -- "
                       "/bin/sh -c " + shell_quote(kGuestServer),
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  c.wait_until_serving("q", 8080);
  EXPECT_EQ(counter(c).count, 1);
  auto full = c.cli("checkpoint q --type memory", 180);
  EXPECT_NE(full.exit_code, 0) << full.out;
  EXPECT_NE(full.err.find("No space left on device"), std::string::npos) << full.err << c.node().log();
  EXPECT_EQ(c.get("q").value("state", ""), "running");
  EXPECT_EQ(counter(c).count, 2) << "the guest's memory did not survive the failed checkpoint";
  EXPECT_EQ(c.cli("snapshots").out, "ID  SOURCE  TYPE  LAYERS  LAYER-SIZE  AGE\n");
  EXPECT_EQ(run("ls -A " + snapshots).out, "") << "a failed checkpoint's files stayed";
  ASSERT_EQ(c.cli("rm q").exit_code, 0);
}

// Kills the node at failpoint `point` during `checkpoint` (a CLI command line), starts it again unarmed and
// checks what a checkpoint that never finished must leave: no snapshot listed, no file, sandbox `name` running.
void kill_node_during_checkpoint(Cluster& c, const std::string& point, const std::string& checkpoint,
                                 const std::string& name) {
  c.stop_node(SIGKILL);
  c.start_node({"SANDGATE_FAILPOINTS=" + point});
  const size_t from = c.node().log().size();
  (void)c.cli(checkpoint, 120);
  const int status = c.node().wait_exit(120000);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << point << ": status " << status;
  ASSERT_NE(c.node().log().find("failpoint " + point + ": SIGKILL", from), std::string::npos) << c.node().log();
  c.start_node();
  EXPECT_EQ(c.cli("snapshots").out, "ID  SOURCE  TYPE  LAYERS  LAYER-SIZE  AGE\n") << point;
  EXPECT_EQ(run("ls -A " + c.dir() + "/node/snapshots").out, "") << point << ": files of no snapshot stayed";
  EXPECT_TRUE(eventually([&] { return c.get(name).value("state", "") == "running"; }, std::chrono::seconds(30)))
      << point << ": " << c.get(name).dump();
}

// The node killed during a memory checkpoint (failpoints, docs/tests.md#failpoints): with the guest stopped
// for the save, and with the files saved but not recorded. The restarted node lists no snapshot and keeps
// none of its files, and the guest goes on with its memory: the restarted node lets the guest it finds
// stopped (running on record) run again, and the counter continues. Then a checkpoint succeeds.
TEST_F(Qemu, ANodeKilledDuringAMemoryCheckpointLeavesNoSnapshotAndTheGuestGoesOn) {
  ClusterOptions options = ClusterOptions::node(node_config() + "images_dir = \"\"\n");
  options.proxy_extra = "workers = 1\n";  // the end's outage: every connection meets the one route cache
  Cluster c(options);
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 600 --memory-mb 256 -- "
                       "/bin/sh -c " + shell_quote(kGuestServer),
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  c.wait_until_serving("q", 8080);
  long expected = counter(c).count;
  ASSERT_EQ(expected, 1);
  for (const std::string point : {"memory-checkpoint:stopped", "memory-checkpoint:saved"}) {
    kill_node_during_checkpoint(c, point, "checkpoint q --type memory", "q");
    if (HasFatalFailure()) return;
    EXPECT_EQ(counter(c).count, ++expected) << point << "\n" << c.get("q").dump() << c.node().log();
  }
  auto checkpoint = c.cli("checkpoint q --type memory --json", 180);
  ASSERT_EQ(checkpoint.exit_code, 0) << checkpoint.out << checkpoint.err << c.node().log();
  EXPECT_EQ(counter(c).count, ++expected);

  // The node killed once more, for good this time: the guest keeps taking new connections through the
  // proxy past the route's spares, on sockets the proxy's socket maker makes in QEMU's network namespace
  // (the one the node vouched for).
  // The proxy says so at each outage it notices (the kills above were outages too): this one's line.
  auto outages = [&] {
    const std::string log = c.proxy().log();
    size_t n = 0;
    for (size_t at = log.find("the node is down: routes cached"); at != std::string::npos;
         at = log.find("the node is down: routes cached", at + 1))
      ++n;
    return n;
  };
  // Served from the route cache: its event stream, broken by each kill above, reconnects within a second,
  // and until then no open is cached. Reach the guest until a connection is routed from the cache (a
  // checkpoint quicker than that second left none cached: seen in a CI run).
  ASSERT_TRUE(eventually([&] {
    EXPECT_EQ(counter(c).count, ++expected);
    const auto log = c.access_log();
    return !log.empty() && log.back().value("route_cached", false);
  }, std::chrono::seconds(20))) << c.proxy().log();
  const size_t outages_before = outages();
  c.stop_node(SIGKILL);
  ASSERT_TRUE(eventually([&] { return outages() > outages_before; }, std::chrono::seconds(10))) << c.proxy().log();
  for (int i = 0; i < 40; ++i) ASSERT_EQ(counter(c).count, ++expected) << i << "\n" << c.proxy().log();
  EXPECT_EQ(c.proxy().log().find("the socket maker refused"), std::string::npos) << c.proxy().log();
}

// The node killed during a disk checkpoint, while QEMU's backup job runs and once it has finished but before
// the snapshot is recorded: after each restart no snapshot is listed and no file stays, the guest runs on
// with its files, and the next checkpoint works (whole again: the last one was never recorded) and boots.
TEST_F(Qemu, ANodeKilledDuringADiskCheckpointLeavesNoSnapshotAndTheGuestGoesOn) {
  Cluster c(ClusterOptions::node(node_config() + "images_dir = \"\"\n"));
  const std::string archive = busybox_image(c.dir() + "/img");
  ASSERT_EQ(c.cli("image import " + archive + " qdisk").exit_code, 0);
  auto created = c.cli("create --json --name vk --driver qemu --image qdisk --timeout 600 --memory-mb 256 "
                       "-- /bin/sh -c 'exec sleep 100000'",
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const std::string token = nlohmann::json::parse(created.out, nullptr, false).value("token", "");
  const std::string kept = kept_value(exec_in(c, "vk.sandbox.localhost", token,
                                              "dd if=/dev/urandom of=/big bs=1M count=8 2>/dev/null; "
                                              "echo kept-$$ >/data.txt; cat /data.txt"));
  ASSERT_FALSE(kept.empty());
  for (const std::string point : {"disk-checkpoint:copying", "disk-checkpoint:copied"}) {
    kill_node_during_checkpoint(c, point, "checkpoint vk", "vk");
    if (HasFatalFailure()) return;
    EXPECT_EQ(kept_value(exec_in(c, "vk.sandbox.localhost", token, "cat /data.txt")), kept) << point;
  }
  auto checkpoint = c.cli("checkpoint vk --json", 180);
  ASSERT_EQ(checkpoint.exit_code, 0) << checkpoint.out << checkpoint.err << c.node().log();
  const auto cp = nlohmann::json::parse(checkpoint.out, nullptr, false);
  EXPECT_FALSE(cp["snapshot"].contains("parent")) << "a delta over a checkpoint that was never recorded: "
                                                  << checkpoint.out;
  auto from = c.cli("create --json --name vk2 --from " + cp.value("snapshot_id", ""), 180);
  ASSERT_EQ(from.exit_code, 0) << from.out << from.err << c.node().log();
  const std::string from_token = nlohmann::json::parse(from.out, nullptr, false).value("token", "");
  EXPECT_EQ(kept_value(exec_in(c, "vk2.sandbox.localhost", from_token, "cat /data.txt")), kept);
  // The job the first kill left in QEMU was cleared: a second checkpoint is a delta over the first.
  auto next = c.cli("checkpoint vk --json", 180);
  ASSERT_EQ(next.exit_code, 0) << next.out << next.err << c.node().log();
  EXPECT_EQ(nlohmann::json::parse(next.out, nullptr, false)["snapshot"].value("parent", ""),
            cp.value("snapshot_id", "")) << next.out;
}

// The node killed on either side of the state writes of a hibernation (memory tier -> disk) and of the
// restore that wakes it (failpoints): after each restart the sandbox settles suspended or running with the
// guest's RAM intact (its counter goes on from where it was), whatever the moment of the kill.
// A create killed after its record and before the start answered: before QEMU was spawned, and once the
// guest booted (QEMU running, the record naming no process). The restarted node stops the QEMU it finds for
// the record (by its -pidfile lock), removes the record since its caller got no answer, and the name can be
// used again. NodeKill.ACreateKilledBeforeItsStartWasRecorded... is the same for a process sandbox. Then a
// fork killed at the same points.
TEST_F(Qemu, ACreateOrForkKilledBeforeItsStartWasRecordedLeavesNoQemuAndTheNameFree) {
  Cluster c(ClusterOptions::node(node_config()));
  // This cluster's QEMUs (their command lines name files in its directory); "[q]" keeps the shell out.
  const std::string count_qemus = "pgrep -c -f -- '[q]emu-system.*" + c.dir() + "' || true";
  const std::string create = "create --name qk --driver qemu --public 8080 --timeout 600 --memory-mb 256 -- "
                             "/bin/sh -c " + shell_quote(kGuestServer);
  // Arms `failpoint` in a restarted node and runs `command`, which the kill leaves unanswered; the node stays
  // down. *from: where the node's log of this attempt starts.
  auto kill_during = [&](const std::string& failpoint, const std::string& command, size_t* from) {
    c.stop_node(SIGKILL);
    *from = c.node().log().size();
    c.start_node({"SANDGATE_FAILPOINTS=" + failpoint});
    auto r = c.cli(command, 300);
    EXPECT_NE(r.exit_code, 0) << r.out;
    const int status = c.node().wait_exit(180000);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << c.node().log();
    ASSERT_NE(c.node().log().find("failpoint " + failpoint + ": SIGKILL", *from), std::string::npos)
        << c.node().log();
  };
  for (const std::string failpoint : {"after:creating", "before:creating->running"}) {
    SCOPED_TRACE(failpoint);
    size_t from = 0;
    kill_during(failpoint, create, &from);
    if (HasFatalFailure()) return;
    if (failpoint == "before:creating->running") {
      EXPECT_EQ(run(count_qemus).out, "1\n") << "the booted guest's QEMU, which no record names";
    }
    c.start_node();
    EXPECT_TRUE(eventually([&] { return c.get("qk").empty(); }, std::chrono::seconds(60)))
        << c.get("qk").dump() << c.node().log();
    EXPECT_NE(c.node().log().find("its create did not finish before the node restarted", from), std::string::npos)
        << c.node().log();
    EXPECT_TRUE(eventually([&] { return run(count_qemus).out == "0\n"; }, std::chrono::seconds(30)))
        << run("pgrep -af '[q]emu-system'").out << c.node().log();
  }
  auto created = c.cli(create, 180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  c.wait_until_serving("qk", 8080);
  EXPECT_EQ(counter(c, "qk").code, 200) << c.node().log();

  // A fork killed the same way (its memory checkpoint written, its sandbox being created from it, before
  // and after that guest came up): the source runs on, and no fork's record or QEMU is left.
  for (const std::string failpoint : {"after:creating", "before:creating->running"}) {
    SCOPED_TRACE("fork, " + failpoint);
    size_t from = 0;
    kill_during(failpoint, "fork qk --count 1 --name-prefix qf --json", &from);
    if (HasFatalFailure()) return;
    if (failpoint == "before:creating->running") {
      EXPECT_EQ(run(count_qemus).out, "2\n") << "the source's QEMU and the fork's, which no record names";
    }
    c.start_node();
    EXPECT_TRUE(eventually([&] { return c.get("qf-1").empty(); }, std::chrono::seconds(60)))
        << c.get("qf-1").dump() << c.node().log();
    EXPECT_TRUE(eventually([&] { return run(count_qemus).out == "1\n"; }, std::chrono::seconds(30)))
        << "the source's only\n" << run("pgrep -af '[q]emu-system'").out << c.node().log();
    EXPECT_EQ(counter(c, "qk").code, 200) << c.node().log();
  }
  auto forked = c.cli("fork qk --count 1 --name-prefix qf --json", 300);
  ASSERT_EQ(forked.exit_code, 0) << forked.out << forked.err << c.node().log();
  EXPECT_EQ(counter(c, "qf-1").code, 200) << c.node().log();
  ASSERT_EQ(c.cli("rm qk").exit_code, 0);
  ASSERT_EQ(c.cli("rm qf-1").exit_code, 0);
  EXPECT_TRUE(eventually([&] { return run(count_qemus).out == "0\n"; }, std::chrono::seconds(30)));
}

TEST_F(Qemu, ANodeKilledDuringAHibernationOrARestoreKeepsTheGuestsMemory) {
  Cluster c(ClusterOptions::node(node_config()));
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 600 --hibernate-after 2 "
                       "--memory-mb 256 -- /bin/sh -c " + shell_quote(kGuestServer),
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  c.wait_until_serving("q", 8080);
  long expected = counter(c).count;
  ASSERT_EQ(expected, 1);
  auto settled = [&](const std::string& tier) {
    return eventually([&] {
      auto j = c.get("q");
      return j.value("state", "") == "suspended" && j["tier"] == tier;
    }, std::chrono::seconds(90));
  };
  // Kills the node at `point` (armed in a restarted node) once `arm` has run, then starts it again, unarmed.
  auto kill_at = [&](const std::string& point, const std::function<void()>& after_arming) {
    c.stop_node(SIGKILL);
    const size_t from = c.node().log().size();
    c.start_node({"SANDGATE_FAILPOINTS=" + point});
    after_arming();
    const int status = c.node().wait_exit(120000);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << point << ": status " << status << c.node().log();
    ASSERT_NE(c.node().log().find("failpoint " + point + ": SIGKILL", from), std::string::npos) << c.node().log();
    c.start_node();
  };
  // A request wakes it from wherever the restarted node found it, and the counter in guest RAM goes on.
  auto wakes_intact = [&](const std::string& point) {
    Answer a = counter(c);
    EXPECT_EQ(a.code, 200) << point << "\n" << c.get("q").dump() << c.node().log();
    EXPECT_EQ(a.count, ++expected) << point << "\n" << c.get("q").dump();
  };

  // The hibernation recorded as begun, QEMU not yet told: found paused in memory. Each kill waits for the
  // suspend to settle first: a restarted node that finishes the pause itself would trip the failpoint in its
  // own reconcile, before it serves.
  ASSERT_EQ(c.cli("suspend q").exit_code, 0);
  ASSERT_TRUE(settled("memory")) << c.get("q").dump() << c.node().log();
  kill_at("after:suspended->suspending", [] {});
  ASSERT_TRUE(eventually([&] { return c.get("q").value("state", "") == "suspended"; }, std::chrono::seconds(60)))
      << c.get("q").dump() << c.node().log();
  wakes_intact("after:suspended->suspending");

  // The state saved and QEMU gone, not yet recorded: found hibernated.
  ASSERT_EQ(c.cli("suspend q").exit_code, 0);
  ASSERT_TRUE(settled("memory")) << c.get("q").dump() << c.node().log();
  kill_at("before:suspending->suspended", [] {});
  ASSERT_TRUE(settled("disk")) << c.get("q").dump() << c.node().log();
  wakes_intact("before:suspending->suspended");

  // Restores from the disk tier: killed before QEMU is started from the saved state; inside the driver's
  // restore, once QEMU is spawned (the guest has not run: that QEMU is killed and the state restored again)
  // and once the guest runs on (that QEMU is adopted: the saved state is behind its disk now); and after the
  // restore, before it is recorded. The request that wakes it is the one the kill interrupts. Each time there
  // is one QEMU for the sandbox afterwards.
  const std::string id = nlohmann::json::parse(created.out, nullptr, false).value("id", "");
  ASSERT_FALSE(id.empty()) << created.out;
  for (const std::string point : {"after:suspended->resuming", "qemu:restore:spawned", "qemu:restore:continued",
                                  "before:resuming->running"}) {
    ASSERT_EQ(c.cli("suspend q").exit_code, 0);
    ASSERT_TRUE(settled("disk")) << point << c.get("q").dump() << c.node().log();
    kill_at(point, [&] { (void)c.curl("8080-q.sandbox.localhost", "/cgi-bin/c", "", 60); });
    // A wake whose request went unanswered: the count it made (if QEMU ran it) is one more.
    ASSERT_TRUE(eventually([&] {
      auto s = c.get("q").value("state", "");
      return s == "running" || s == "suspended";
    }, std::chrono::seconds(90))) << c.get("q").dump() << c.node().log();
    Answer a = counter(c);
    EXPECT_EQ(a.code, 200) << point << "\n" << c.get("q").dump() << c.node().log();
    EXPECT_TRUE(a.count == expected + 1 || a.count == expected + 2) << point << ": count " << a.count << " after "
                                                                     << expected;
    expected = a.count;
    EXPECT_EQ(run("pgrep -c -f -- '-name [s]andgate-" + id + "'").out, "1\n") << point << c.node().log();
  }
  ASSERT_EQ(c.cli("rm q").exit_code, 0);
}

}  // namespace
}  // namespace sg::e2e
