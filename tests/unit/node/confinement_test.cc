// The confinement a process sandbox's init applies to itself, on the real kernel: a forked child confines
// itself and reports what the kernel then lets it do.
#include "noderuntime/confinement.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace sg {
namespace {

// Runs `probe` in a confined child; its exit code is the test's verdict (0 = as expected, else a step number).
int in_confined_child(int (*probe)()) {
  pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (!confine_current_process()) ::_exit(100);
    ::_exit(probe());
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -2;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 200 + WTERMSIG(status);
}

std::string status_field(const std::string& name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + ":", 0) == 0) return line.substr(name.size() + 1);
  return {};
}

TEST(Confinement, KeepsDockersDefaultCapabilities) {
  uint64_t keep = kept_capabilities();
  EXPECT_EQ(keep, (1ull << CAP_CHOWN) | (1ull << CAP_DAC_OVERRIDE) | (1ull << CAP_FOWNER) | (1ull << CAP_FSETID) |
                      (1ull << CAP_KILL) | (1ull << CAP_SETGID) | (1ull << CAP_SETUID) | (1ull << CAP_SETPCAP) |
                      (1ull << CAP_NET_BIND_SERVICE) | (1ull << CAP_NET_RAW) | (1ull << CAP_SYS_CHROOT) |
                      (1ull << CAP_MKNOD) | (1ull << CAP_AUDIT_WRITE) | (1ull << CAP_SETFCAP));
  EXPECT_EQ(keep & (1ull << CAP_SYS_ADMIN), 0u);
}

TEST(Confinement, CapabilitySetsAreReducedAndNoNewPrivsIsSet) {
  ASSERT_EQ(::geteuid(), 0u) << "needs root: the test starts with every capability";
  EXPECT_EQ(in_confined_child([] {
              const uint64_t keep = kept_capabilities();
              for (const char* set : {"CapEff", "CapPrm", "CapBnd"}) {
                std::string v = status_field(set);
                if (std::stoull(v, nullptr, 16) != keep) return 1;
              }
              if (std::stoull(status_field("CapAmb"), nullptr, 16) != 0) return 2;
              if (status_field("NoNewPrivs").find('1') == std::string::npos) return 3;
              if (status_field("Seccomp").find('2') == std::string::npos) return 4;
              return 0;
            }),
            0);
}

TEST(Confinement, MountUnshareOfAUserNamespaceAndKexecFailWithEperm) {
  EXPECT_EQ(in_confined_child([] {
              if (::mount("none", "/mnt", "tmpfs", 0, nullptr) == 0 || errno != EPERM) return 1;
              if (::umount2("/", MNT_DETACH) == 0 || errno != EPERM) return 2;
              if (::unshare(CLONE_NEWUSER) == 0 || errno != EPERM) return 3;
              if (::syscall(SYS_kexec_load, 0, 0, nullptr, 0) == 0 || errno != EPERM) return 4;
              if (::syscall(SYS_bpf, 0, nullptr, 0) == 0 || errno != EPERM) return 5;
              if (::syscall(SYS_setns, 0, 0) == 0 || errno != EPERM) return 6;
              if (::syscall(SYS_clone3, nullptr, 0) == 0 || errno != ENOSYS) return 7;
              // clone with CLONE_NEWUSER is refused; a plain fork still works.
              if (::syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, nullptr, nullptr, nullptr, nullptr) >= 0 ||
                  errno != EPERM)
                return 8;
              pid_t child = ::fork();
              if (child < 0) return 9;
              if (child == 0) ::_exit(0);
              int status = 0;
              if (::waitpid(child, &status, 0) != child || !WIFEXITED(status)) return 10;
              return 0;
            }),
            0);
}

}  // namespace
}  // namespace sg
