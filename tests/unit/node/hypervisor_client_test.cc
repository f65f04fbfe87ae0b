// pidfile_holder: how the QEMU driver finds a QEMU the record does not name (QEMU keeps an fcntl write lock
// on its -pidfile while it runs). A real process takes the lock here, as QEMU does. spawn_vmm's scheduling
// policy.
#include "noderuntime/hypervisor_client.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <iterator>

#include "tests/etcd_process.h"
#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

TEST(PidfileHolder, IsTheLiveProcessLockingTheFileAndNoneOnceItIsGone) {
  sg::testing::TempDir dir;
  const std::string pidfile = dir.path() + "/qemu.pid";
  EXPECT_FALSE(pidfile_holder(pidfile)) << "no file";
  // The lock QEMU takes (util/oslib-posix.c qemu_write_pidfile: F_SETLK, F_WRLCK, the whole file).
  auto locker = spawn_vmm("locker", "/usr/bin/python3",
                          {"-c",
                           "import fcntl, sys, time\n"
                           "f = open(sys.argv[1], 'w')\n"
                           "fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                           "time.sleep(600)\n",
                           pidfile},
                          dir.path() + "/locker.log");
  ASSERT_TRUE(locker) << locker.message();
  ASSERT_TRUE(sg::testing::wait_until([&] { return pidfile_holder(pidfile).has_value(); }, std::chrono::seconds(10)));
  auto holder = pidfile_holder(pidfile);
  ASSERT_TRUE(holder);
  EXPECT_EQ(holder->pid, locker->pid);
  EXPECT_EQ(holder->start_time_ticks, locker->start_time_ticks);
  ASSERT_TRUE(kill_vmm(*locker));
  ::waitpid(locker->pid, nullptr, 0);  // our child: reaped here, as a stray QEMU's parent (init) reaps it
  EXPECT_TRUE(sg::testing::wait_until([&] { return !pidfile_holder(pidfile).has_value(); }, std::chrono::seconds(10)));
  EXPECT_TRUE(std::filesystem::exists(pidfile)) << "a file left by a dead process has no holder";
}

// node.batch_scheduling: the VMM starts under SCHED_BATCH, so the threads it creates (vCPUs, I/O) have it too;
// off, it is an ordinary process.
TEST(VmmSpawn, BatchSchedulingAppliesToTheVmmAndEveryThreadItStarts) {
  sg::testing::TempDir dir;
  for (bool batch : {true, false}) {
    SCOPED_TRACE(batch ? "batch" : "normal");
    auto vmm = spawn_vmm("threads", "/usr/bin/python3",
                         {"-c",
                          "import threading, time\n"
                          "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
                          "time.sleep(600)\n"},
                         dir.path() + "/threads.log", {.cwd = dir.path(), .batch_scheduling = batch});
    ASSERT_TRUE(vmm) << vmm.message();
    EXPECT_EQ(::sched_getscheduler(0), SCHED_OTHER) << "the spawning thread has its own policy back";
    const std::string tasks = "/proc/" + std::to_string(vmm->pid) + "/task";
    auto thread_count = [&] {
      std::error_code ec;
      auto it = std::filesystem::directory_iterator(tasks, ec);
      return ec ? 0L : static_cast<long>(std::distance(it, std::filesystem::directory_iterator()));
    };
    ASSERT_TRUE(sg::testing::wait_until([&] { return thread_count() == 2; }, std::chrono::seconds(10)));
    for (const auto& task : std::filesystem::directory_iterator(tasks)) {
      const pid_t tid = static_cast<pid_t>(std::stol(task.path().filename().string()));
      EXPECT_EQ(::sched_getscheduler(tid), batch ? SCHED_BATCH : SCHED_OTHER) << "thread " << tid;
    }
    ASSERT_TRUE(kill_vmm(*vmm));
    ::waitpid(vmm->pid, nullptr, 0);
  }
}

}  // namespace
}  // namespace sg
