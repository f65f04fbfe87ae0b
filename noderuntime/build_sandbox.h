// Running the commands of an image build (docs/images.md): a host tool (mmdebstrap) as a child process, or a
// build step's shell command inside the image being built, in a sandbox:
//   - a user namespace of its own: image root is host uid/gid `ids.base`, ids.count ids mapped;
//   - a mount namespace: each layer tree is cloned as an idmapped mount (open_tree + mount_setattr
//     MOUNT_ATTR_IDMAP onto that user namespace, so host-root files show as image root), the overlay of them
//     (lower) and a fresh upper dir is the new root (pivot_root; the host's root is detached), with /proc, a
//     small tmpfs /dev (null zero full random urandom tty bound from the host, shm, the fd links) and the
//     host's /etc/resolv.conf bound read-only over the image's when it has one;
//   - a PID namespace (the command is its PID 1: when it exits, or on timeout, everything it started dies);
//   - the host's network (apt needs the mirror); the mounts are made by the host-root setup process before it
//     enters the user namespace, so the command can mount nothing (its mount namespace is not its own).
// Every mount lives in the step's mount namespace and goes away with its last process: a node that crashes
// mid-step leaves no mount behind, only the step's directories in the layer store's tmp/.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "snapshot/layer_writer.h"

namespace sg {

inline constexpr size_t kMaxOutputLineBytes = 4096;  // a longer line is cut (and marked) before it is forwarded

struct OutputLimits {
  size_t tail_lines = 20;  // lines kept for the error message of a failed command
};

// How a command ended: exit_code >= 0, or killed by `signal`; timed_out when the deadline killed it.
struct CommandOutcome {
  int exit_code = -1;
  int signal = 0;
  bool timed_out = false;
  std::deque<std::string> tail;  // its last output lines (stdout and stderr interleaved)
};

using OutputLine = std::function<void(std::string_view line)>;

// A host program (argv[0] an absolute path), stdin /dev/null, stdout+stderr to `on_line`; extra env on top
// of a minimal PATH/HOME/LANG. Killed (its whole process group) at `deadline`.
Result<CommandOutcome> run_host_command(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                                        std::chrono::steady_clock::time_point deadline, const OutputLimits& limits,
                                        const OutputLine& on_line);

struct SandboxStep {
  std::vector<std::string> lower_trees;  // layer tree dirs, bottom first (at least one)
  std::string step_dir;                  // an empty directory of the caller's (same filesystem as the store):
                                         // upper/, work/, root/ and the lower mount points go in it
  snapshot::IdShift ids;
  std::string command;                   // run as /bin/sh -c COMMAND by image root
  std::vector<std::string> env;          // the whole environment, "K=V"
  std::string workdir = "/";             // absolute, inside the image; must exist there
};

// Runs the step; its changes are left in `step_dir`/upper (in overlayfs form, owners in the host range).
// A failure to set the sandbox up is kInvalidArgument/kIo naming what failed (e.g. "the image has no
// /bin/sh"); the command's own failure is a CommandOutcome with its exit code.
Result<CommandOutcome> run_in_sandbox(const SandboxStep& step, std::chrono::steady_clock::time_point deadline,
                                      const OutputLimits& limits, const OutputLine& on_line);

}  // namespace sg
