// The QEMU driver end to end: a real microvm guest (deploy/build-guest-image.sh) behind the real proxy and
// node. The guest runs busybox httpd with a CGI counter kept in the guest's RAM (/tmp), so a counter that
// keeps counting proves the memory survived a pause and a hibernation. Skips, loudly, only when the guest
// image cannot be built (no kernel package reachable).
#include <gtest/gtest.h>

#include <csignal>
#include <ctime>
#include <sstream>

#include "tests/e2e/harness.h"

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

// Builds (or reuses) the guest image under the build dir; "" when the kernel package is unavailable.
std::string guest_image_dir(std::string* why) {
  const std::string dir = bin("qemu-guest");
  auto r = run("bash " + source("deploy/build-guest-image.sh") + " " + dir + " 2>&1", 600);
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

Answer counter(Cluster& c) {
  auto r = c.curl("8080-q.sandbox.localhost", "/cgi-bin/c", "", 90);
  Answer a;
  a.code = Cluster::http_code(r);
  std::istringstream in(Cluster::body(r));
  in >> a.count >> a.guest_time;
  return a;
}

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
  std::string node_config() const {
    // Boots under TCG on a shared 2-core machine: a generous per-attempt deadline.
    return "guest_kernel = \"" + image_ + "/vmlinuz\"\nguest_initrd = \"" + image_ +
           "/initrd.img\"\nqemu_boot_timeout_ms = 90000\nqemu_boot_attempts = 2\n";
  }
  std::string image_;
};

TEST_F(Qemu, WakesFromBothTiersKeepsMemoryFixesClockAndSurvivesNodeKill) {
  Cluster c(ClusterOptions::node(node_config()));
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 3 --hibernate-after 4 "
                       "--memory-mb 128 -- /bin/sh -c " + shell_quote(kGuestServer),
                       180);
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err << c.node().log();
  const std::string id = nlohmann::json::parse(created.out, nullptr, false).value("id", "");
  ASSERT_FALSE(id.empty()) << created.out;
  // The guest reports ready once httpd is started; it listens a moment later.
  c.wait_until_serving("q", 8080);
  Answer a = counter(c);
  ASSERT_EQ(a.code, 200) << c.node().log();
  EXPECT_EQ(a.count, 1);

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
  // Stay hibernated a while, so a guest clock that was not fixed would be visibly behind.
  ::sleep(6);
  a = counter(c);
  const long host_now = static_cast<long>(std::time(nullptr));
  EXPECT_EQ(a.code, 200);
  EXPECT_EQ(a.count, 3) << "the counter in guest RAM did not survive the hibernation";
  EXPECT_LE(std::labs(a.guest_time - host_now), 3) << "guest clock " << a.guest_time << " vs host " << host_now;

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

// The disk fills up during a hibernation: the migration fails, the VM stays paused in memory with the
// reason in its state, nothing of the guest is lost, and a request wakes it as usual.
TEST_F(Qemu, DiskFullDuringHibernateKeepsTheSandboxInMemory) {
  Cluster c(ClusterOptions::node(node_config()));
  // Sandbox directories (where the state file goes) on a tmpfs far smaller than the guest's RAM.
  const std::string sandboxes = c.dir() + "/node/sandboxes";
  ASSERT_EQ(run("mkdir -p " + sandboxes + " && mount -t tmpfs -o size=16m sgtest-full " + sandboxes).exit_code, 0);
  struct LazyUnmount {
    std::string path;
    ~LazyUnmount() { run("umount -l " + path); }
  } unmount{sandboxes};
  auto created = c.cli("create --json --name q --driver qemu --public 8080 --timeout 2 --hibernate-after 2 "
                       "--memory-mb 128 -- /bin/sh -c " + shell_quote(kGuestServer),
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

}  // namespace
}  // namespace sg::e2e
