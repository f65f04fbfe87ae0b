// cgroup.h against the real kernel (as root): both freezer backends this host offers, limits in the real
// files, kill, and the detection policy on layouts this host does not have (parsed from mountinfo text).
#include "noderuntime/cgroup.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace sg {
namespace {

using namespace std::chrono_literals;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

template <typename Pred>
bool wait_for(Pred pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// /proc/<pid>/stat fields 14+15: CPU time consumed, in clock ticks.
uint64_t cpu_ticks(pid_t pid) {
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return utime + stime;
}

char proc_state(pid_t pid) {
  std::string status = slurp("/proc/" + std::to_string(pid) + "/status");
  size_t at = status.find("State:\t");
  return at == std::string::npos ? '?' : status[at + 7];
}

// This machine's layout (Debian 12 hybrid): v1 controllers plus a controller-less cgroup2 mount.
constexpr const char* kHybridMountinfo =
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer\n"
    "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

TEST(CgroupDetectionTest, HybridLayoutFreezesWithV2AndLimitsWithV1) {
  CgroupMounts mounts = parse_cgroup_mounts(kHybridMountinfo);
  EXPECT_EQ(mounts.v2_mount, "/sys/fs/cgroup/unified");
  EXPECT_EQ(mounts.v1_mounts["cpu"], "/sys/fs/cgroup/cpu,cpuacct");
  EXPECT_EQ(mounts.v1_mounts["cpuacct"], "/sys/fs/cgroup/cpu,cpuacct");
  EXPECT_EQ(mounts.v1_mounts["freezer"], "/sys/fs/cgroup/freezer");
  EXPECT_EQ(mounts.v1_mounts.count("name=systemd"), 0u);
  EXPECT_EQ(mounts.v1_mounts.count("xattr"), 1u);  // unknown flags are harmless: never looked up

  CgroupDetection d = choose_cgroup_features(mounts, {"hugetlb"});
  EXPECT_EQ(d.freeze.version, CgroupVersion::kV2);
  EXPECT_EQ(d.freeze.mount, "/sys/fs/cgroup/unified");
  EXPECT_EQ(d.memory.version, CgroupVersion::kV1);
  EXPECT_EQ(d.memory.mount, "/sys/fs/cgroup/memory");
  EXPECT_EQ(d.cpu.version, CgroupVersion::kV1);
  EXPECT_EQ(d.cpu.mount, "/sys/fs/cgroup/cpu,cpuacct");
  EXPECT_NE(d.describe().find("freeze: v2 /sys/fs/cgroup/unified"), std::string::npos) << d.describe();
}

TEST(CgroupDetectionTest, PureV2LayoutUsesV2ForEverythingItHasControllersFor) {
  const char* mountinfo =
      "25 30 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
      "rw,nsdelegate,memory_recursiveprot\n"
      "26 30 0:23 / /run/with\\040space rw shared:5 - cgroup2 cgroup2 rw\n";
  CgroupMounts mounts = parse_cgroup_mounts(mountinfo);
  EXPECT_EQ(mounts.v2_mount, "/sys/fs/cgroup");  // the first cgroup2 mount wins
  EXPECT_TRUE(mounts.v1_mounts.empty());

  CgroupDetection d = choose_cgroup_features(mounts, {"cpuset", "cpu", "io", "memory", "pids"});
  EXPECT_EQ(d.freeze.version, CgroupVersion::kV2);
  EXPECT_EQ(d.memory.version, CgroupVersion::kV2);
  EXPECT_EQ(d.cpu.version, CgroupVersion::kV2);
  EXPECT_EQ(d.memory.mount, "/sys/fs/cgroup");

  CgroupDetection no_cpu = choose_cgroup_features(mounts, {"memory"});
  EXPECT_EQ(no_cpu.cpu.version, CgroupVersion::kNone);
  EXPECT_NE(no_cpu.describe().find("cpu limit: none"), std::string::npos) << no_cpu.describe();
}

TEST(CgroupDetectionTest, MountPathsAreUnescaped) {
  CgroupMounts mounts = parse_cgroup_mounts("26 30 0:23 / /run/with\\040space rw shared:5 - cgroup2 cgroup2 rw\n");
  EXPECT_EQ(mounts.v2_mount, "/run/with space");
}

TEST(CgroupDetectionTest, PureV1WithoutFreezerCannotFreeze) {
  CgroupMounts mounts = parse_cgroup_mounts("35 31 0:32 / /cg/memory rw - cgroup cgroup rw,memory\n");
  CgroupDetection d = choose_cgroup_features(mounts, {});
  EXPECT_EQ(d.freeze.version, CgroupVersion::kNone);
  EXPECT_EQ(d.memory.version, CgroupVersion::kV1);
  EXPECT_EQ(d.cpu.version, CgroupVersion::kNone);

  SandboxCgroup cg = CgroupManager(d, "parent").sandbox("sb-x");
  EXPECT_FALSE(cg.can_freeze());
  EXPECT_EQ(cg.freeze().error(), Error::kUnsupported);
  EXPECT_EQ(cg.dirs(), std::vector<std::string>{"/cg/memory/parent/sb-x"});
}

TEST(CgroupDetectionTest, ThisHostOffersAFreezer) {
  auto d = detect_cgroups();
  ASSERT_TRUE(d.ok()) << d.message();
  std::cout << d->describe() << "\n";
  EXPECT_NE(d->freeze.version, CgroupVersion::kNone);
  EXPECT_TRUE(exists(d->freeze.mount)) << d->freeze.mount;
}

// Which layout a test runs against: what this host detects, or the same host with its cgroup2 mount
// hidden, which forces the v1 freezer and the signal-based kill.
enum class Layout { kDetected, kV1Only };

class CgroupTest : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    auto detected = detect_cgroups();
    ASSERT_TRUE(detected.ok()) << detected.message();
    CgroupDetection d = *detected;
    if (GetParam() == Layout::kV1Only) {
      CgroupMounts mounts = d.mounts;
      mounts.v2_mount.clear();
      d = choose_cgroup_features(mounts, {});
      if (d.freeze.version != CgroupVersion::kV1) GTEST_SKIP() << "no v1 freezer on this host";
    }
    static int counter = 0;
    parent_ = "sgtest-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
    manager_.emplace(d, parent_);
  }

  void TearDown() override {
    if (!manager_) return;
    // Thaw first: a frozen (v1) child cannot die, and waiting for it would hang the suite.
    for (const auto& id : ids_) (void)manager_->sandbox(id).thaw();
    for (pid_t pid : children_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    for (const auto& id : ids_) EXPECT_TRUE(manager_->sandbox(id).remove().ok());
    for (const auto& dir : manager_->parent_dirs()) {
      if (::rmdir(dir.c_str()) != 0) {
        EXPECT_EQ(errno, ENOENT) << dir;
      }
    }
  }

  SandboxCgroup create(const std::string& id, double cpus = 0, uint32_t memory_mb = 0) {
    ids_.push_back(id);
    auto cg = manager_->create(id, cpus, memory_mb);
    EXPECT_TRUE(cg.ok()) << cg.message();
    return cg.ok() ? *cg : manager_->sandbox(id);
  }

  pid_t spawn(const char* shell_command) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::execl("/bin/sh", "sh", "-c", shell_command, static_cast<char*>(nullptr));
      ::_exit(127);
    }
    children_.push_back(pid);
    return pid;
  }

  // Waits (bounded) for `pid` to die; true if it was killed by SIGKILL.
  bool died_of_sigkill(pid_t pid) {
    int status = 0;
    bool reaped = wait_for([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }, 3000ms);
    if (reaped) std::erase(children_, pid);
    return reaped && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  }

  std::string parent_;
  std::optional<CgroupManager> manager_;
  std::vector<std::string> ids_;
  std::vector<pid_t> children_;
};

TEST_P(CgroupTest, CreateMakesOneDirectoryPerHierarchyAndRemoveDeletesThem) {
  SandboxCgroup cg = create("sb-dirs");
  ASSERT_FALSE(cg.dirs().empty());
  for (const auto& dir : cg.dirs()) {
    EXPECT_TRUE(exists(dir + "/cgroup.procs")) << dir;
    EXPECT_NE(dir.find("/" + parent_ + "/sb-dirs"), std::string::npos) << dir;
  }
  ASSERT_TRUE(cg.remove().ok());
  for (const auto& dir : cg.dirs()) EXPECT_FALSE(exists(dir)) << dir;
  EXPECT_TRUE(cg.remove().ok()) << "removing twice is not an error";
}

TEST_P(CgroupTest, FreezeStopsABusyProcessAndThawResumesIt) {
  SandboxCgroup cg = create("sb-freeze");
  pid_t pid = spawn("while :; do :; done");
  ASSERT_TRUE(cg.add_pid(pid).ok());
  for (const auto& dir : cg.dirs())
    EXPECT_NE(slurp(dir + "/cgroup.procs").find(std::to_string(pid)), std::string::npos) << dir;
  ASSERT_TRUE(wait_for([&] { return proc_state(pid) == 'R'; }, 2000ms)) << "the busy loop never ran";

  ASSERT_TRUE(cg.freeze().ok());
  ASSERT_TRUE(wait_for([&] { return cg.is_frozen().ok() && *cg.is_frozen(); }, 2000ms));
  const std::string state = slurp(cg.freezer_state_file());
  if (manager_->detection().freeze.version == CgroupVersion::kV2)
    EXPECT_NE(state.find("frozen 1"), std::string::npos) << state;
  else
    EXPECT_EQ(state, "FROZEN\n");
  // A busy loop is always runnable unless the freezer holds it: S (v2 freezer trap) or D (v1 freezer).
  EXPECT_NE(proc_state(pid), 'R');
  const uint64_t frozen_ticks = cpu_ticks(pid);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(cpu_ticks(pid), frozen_ticks) << "a frozen process consumed CPU";

  ASSERT_TRUE(cg.thaw().ok());
  ASSERT_TRUE(wait_for([&] { return cg.is_frozen().ok() && !*cg.is_frozen(); }, 2000ms));
  EXPECT_TRUE(wait_for([&] { return cpu_ticks(pid) > frozen_ticks; }, 2000ms)) << "thawed process never ran";
}

TEST_P(CgroupTest, KillAllKillsEveryProcessEvenWhenFrozen) {
  SandboxCgroup cg = create("sb-kill");
  pid_t first = spawn("exec sleep 1000");
  pid_t second = spawn("exec sleep 1000");
  ASSERT_TRUE(cg.add_pid(first).ok());
  ASSERT_TRUE(cg.add_pid(second).ok());
  ASSERT_TRUE(cg.freeze().ok());
  ASSERT_TRUE(wait_for([&] { return cg.is_frozen().ok() && *cg.is_frozen(); }, 2000ms));

  ASSERT_TRUE(cg.kill_all().ok());
  EXPECT_TRUE(died_of_sigkill(first));
  EXPECT_TRUE(died_of_sigkill(second));
  EXPECT_TRUE(cg.remove().ok());
  for (const auto& dir : cg.dirs()) EXPECT_FALSE(exists(dir)) << dir;
}

TEST_P(CgroupTest, LimitsLandInTheRealKernelFiles) {
  const CgroupDetection& d = manager_->detection();
  if (d.memory.version == CgroupVersion::kNone && d.cpu.version == CgroupVersion::kNone)
    GTEST_SKIP() << "no memory or cpu controller on this host";
  SandboxCgroup cg = create("sb-limits", 0.5, 64);

  if (d.memory.version == CgroupVersion::kNone) {
    EXPECT_EQ(cg.memory_limit_file(), "");
  } else {
    EXPECT_EQ(slurp(cg.memory_limit_file()), "67108864\n") << cg.memory_limit_file();
  }
  if (d.cpu.version == CgroupVersion::kV2) {
    EXPECT_EQ(slurp(cg.cpu_quota_file()), "50000 100000\n");
  } else if (d.cpu.version == CgroupVersion::kV1) {
    EXPECT_EQ(slurp(cg.cpu_quota_file()), "50000\n") << cg.cpu_quota_file();
    const std::string dir = cg.cpu_quota_file().substr(0, cg.cpu_quota_file().rfind('/'));
    EXPECT_EQ(slurp(dir + "/cpu.cfs_period_us"), "100000\n");
  }
}

TEST_P(CgroupTest, UnlimitedLeavesTheKernelDefaults) {
  SandboxCgroup cg = create("sb-unlimited", 0, 0);
  if (manager_->detection().cpu.version == CgroupVersion::kV1) {
    EXPECT_EQ(slurp(cg.cpu_quota_file()), "-1\n");
  }
  if (manager_->detection().cpu.version == CgroupVersion::kV2) {
    EXPECT_EQ(slurp(cg.cpu_quota_file()), "max 100000\n");
  }
}

TEST_P(CgroupTest, OperationsOnAMissingCgroupFailClearly) {
  SandboxCgroup cg = manager_->sandbox("sb-never-created");
  Status frozen = cg.freeze();
  ASSERT_FALSE(frozen.ok());
  EXPECT_EQ(frozen.error(), Error::kNotFound);
  EXPECT_NE(frozen.message().find("sb-never-created"), std::string::npos) << frozen.message();
  EXPECT_FALSE(cg.is_frozen().ok());
  EXPECT_EQ(cg.add_pid(::getpid()).error(), Error::kNotFound);
  // Releasing what is already gone is success: cleanup must be safe to repeat.
  EXPECT_TRUE(cg.kill_all().ok());
  EXPECT_TRUE(cg.remove().ok());
}

TEST_P(CgroupTest, CreateRejectsIdsThatEscapeTheParent) {
  EXPECT_EQ(manager_->create("../escape", 1, 64).error(), Error::kInvalidArgument);
  EXPECT_EQ(manager_->create("", 1, 64).error(), Error::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(CgroupLayouts, CgroupTest, ::testing::Values(Layout::kDetected, Layout::kV1Only),
                         [](const auto& info) { return info.param == Layout::kDetected ? "Detected" : "V1Only"; });

// A "mount" that is a plain directory: mkdir works but the controller files do not exist, as on a
// misdetected or half-mounted hierarchy. create() must fail with the file's name and leave nothing behind.
TEST(CgroupManagerTest, CreateFailureNamesTheFileAndLeavesNothingBehind) {
  char tmpl[] = "/tmp/sgtest-cgroup-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string root = tmpl;
  CgroupMounts mounts;
  mounts.v1_mounts["memory"] = root;
  CgroupManager manager(choose_cgroup_features(mounts, {}), "parent/nested");

  auto cg = manager.create("sb-broken", 0, 64);
  ASSERT_FALSE(cg.ok());
  EXPECT_EQ(cg.error(), Error::kNotFound);
  EXPECT_NE(cg.message().find(root + "/parent/nested/sb-broken/memory.limit_in_bytes"), std::string::npos)
      << cg.message();
  EXPECT_TRUE(exists(root + "/parent/nested")) << "parents are created as needed";
  EXPECT_FALSE(exists(root + "/parent/nested/sb-broken"));
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace sg
