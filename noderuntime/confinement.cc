#include "noderuntime/confinement.h"

#include <errno.h>
#include <linux/capability.h>
#include <sched.h>
#include <seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <string>

namespace sg {
namespace {

constexpr int kKept[] = {CAP_CHOWN,    CAP_DAC_OVERRIDE,     CAP_FOWNER,  CAP_FSETID,     CAP_KILL,
                         CAP_SETGID,   CAP_SETUID,           CAP_SETPCAP, CAP_NET_BIND_SERVICE,
                         CAP_NET_RAW,  CAP_SYS_CHROOT,       CAP_MKNOD,   CAP_AUDIT_WRITE, CAP_SETFCAP};

// Refused outright: mounting (the new mount API included), changing root, kexec, kernel modules, bpf,
// perf events, the kernel keyring, userfaultfd (a classic exploitation aid), and joining other namespaces.
constexpr int kRefused[] = {SCMP_SYS(mount),           SCMP_SYS(umount2),       SCMP_SYS(move_mount),
                            SCMP_SYS(open_tree),       SCMP_SYS(fsopen),        SCMP_SYS(fsmount),
                            SCMP_SYS(fsconfig),        SCMP_SYS(fspick),        SCMP_SYS(mount_setattr),
                            SCMP_SYS(pivot_root),      SCMP_SYS(kexec_load),    SCMP_SYS(kexec_file_load),
                            SCMP_SYS(init_module),     SCMP_SYS(finit_module),  SCMP_SYS(delete_module),
                            SCMP_SYS(bpf),             SCMP_SYS(perf_event_open), SCMP_SYS(keyctl),
                            SCMP_SYS(add_key),         SCMP_SYS(request_key),   SCMP_SYS(userfaultfd),
                            SCMP_SYS(setns)};

Status drop_capabilities() {
  const uint64_t keep = kept_capabilities();
  // The bounding set first (needs CAP_SETPCAP, which is kept): afterwards no execve can regain a capability.
  for (int cap = 0; cap <= 63; ++cap) {
    if ((keep >> cap) & 1) continue;
    if (::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
      if (errno == EINVAL) break;  // past the kernel's last capability
      return fail_errno("PR_CAPBSET_DROP " + std::to_string(cap), errno);
    }
  }
  if (::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
    return fail_errno("PR_CAP_AMBIENT_CLEAR_ALL", errno);
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  for (int i = 0; i < 2; ++i) {
    const auto word = static_cast<uint32_t>(keep >> (32 * i));
    data[i].effective = data[i].permitted = data[i].inheritable = word;
  }
  if (::syscall(SYS_capset, &header, data) != 0) return fail_errno("capset", errno);
  return {};
}

Status load_filter() {
  scmp_filter_ctx ctx = ::seccomp_init(SCMP_ACT_ALLOW);
  if (ctx == nullptr) return fail(Error::kInternal, "seccomp_init failed");
  auto done = [ctx](Status s) {
    ::seccomp_release(ctx);
    return s;
  };
  for (int sys : kRefused) {
    if (int rc = ::seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), sys, 0); rc != 0)
      return done(fail_errno("seccomp_rule_add " + std::to_string(sys), -rc));
  }
  // A new user namespace would give back every capability inside it (and with it mount, the new mount API's
  // idmapping, ...): refused through both calls that create one. unshare without CLONE_NEWUSER is left to the
  // capability checks, which refuse every other namespace without CAP_SYS_ADMIN.
  for (int sys : {SCMP_SYS(unshare), SCMP_SYS(clone)}) {
    if (int rc = ::seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), sys, 1,
                                    SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER));
        rc != 0)
      return done(fail_errno("seccomp_rule_add clone/unshare", -rc));
  }
  // clone3 passes its flags in memory, where seccomp cannot look: ENOSYS makes glibc fall back to clone.
  if (int rc = ::seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0); rc != 0)
    return done(fail_errno("seccomp_rule_add clone3", -rc));
  if (int rc = ::seccomp_load(ctx); rc != 0) return done(fail_errno("seccomp_load", -rc));
  return done({});
}

}  // namespace

uint64_t kept_capabilities() {
  uint64_t mask = 0;
  for (int cap : kKept) mask |= uint64_t{1} << cap;
  return mask;
}

Status confine_current_process() {
  if (Status s = drop_capabilities(); !s) return s;
  // Also what lets an unprivileged process load a seccomp filter at all.
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail_errno("PR_SET_NO_NEW_PRIVS", errno);
  return load_filter();
}

}  // namespace sg
