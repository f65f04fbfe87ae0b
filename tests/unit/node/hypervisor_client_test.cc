// pidfile_holder: how the QEMU driver finds a QEMU the record does not name (QEMU keeps an fcntl write lock
// on its -pidfile while it runs). A real process takes the lock here, as QEMU does.
#include "noderuntime/hypervisor_client.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>

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

}  // namespace
}  // namespace sg
