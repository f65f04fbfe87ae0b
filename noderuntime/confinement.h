// What a process sandbox's init does to itself right before it starts the agent and the command, after it
// has entered the sandbox's user namespace (noderuntime/sandbox_init.cc): capabilities down to a container
// runtime's default set, no_new_privs, and a seccomp filter refusing the kernel interfaces a sandbox has no
// business with. Everything the init starts inherits all three, and nothing can undo them.
// docs/security.md ("Process sandbox boundary") lists what is refused and why.
#pragma once

#include <cstdint>

#include "common/error.h"

namespace sg {

// Docker's default capability set: CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID, SETPCAP,
// NET_BIND_SERVICE, NET_RAW, SYS_CHROOT, MKNOD, AUDIT_WRITE, SETFCAP, as a CapEff-style mask.
uint64_t kept_capabilities();

// Drops every other capability from the bounding, ambient, inheritable, permitted and effective sets, sets
// PR_SET_NO_NEW_PRIVS and loads the seccomp filter (refused calls fail with EPERM; clone3 with ENOSYS so
// that libc falls back to clone, whose flags the filter can see). Irreversible for this process and every
// descendant. Single-threaded callers only (the filter applies to the calling thread).
Status confine_current_process();

}  // namespace sg
