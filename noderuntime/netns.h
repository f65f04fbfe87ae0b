// Network namespaces for sandboxes whose processes the node spawns itself (the QEMU driver): a fresh one per
// instance, and the setns() pair that runs a piece of code (a socket(), a posix_spawn()) inside it.
//
// setns() and unshare(CLONE_NEWNET) change only the calling thread, and a socket or a child process keeps
// the namespace it was created in, so the node's other threads never see the switch. Both need
// CAP_SYS_ADMIN (the node runs as root).
#pragma once

#include <functional>

#include "common/error.h"
#include "common/fd.h"

namespace sg {

// The calling thread's current network namespace (/proc/thread-self/ns/net), to return to after a switch.
Result<UniqueFd> current_netns();

// A new, empty network namespace with its loopback up (and nothing else: no route out of it), created
// through the calling thread, which is back in `home` when this returns (success or not). The namespace
// lives as long as the returned fd or a process inside it.
Result<UniqueFd> create_netns(int home);

// Runs `fn` with the calling thread in namespace `target`, then switches back to `home`. A failure to switch
// back is logged as critical (every later connection of this thread would go to the wrong network) and
// returned; `fn`'s own outcome is the caller's business.
Status in_netns(int target, int home, const std::function<void()>& fn);

}  // namespace sg
