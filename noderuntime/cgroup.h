// Per-sandbox cgroups on whatever layout the host offers: pure cgroup v2, hybrid (v1 controllers plus a
// controller-less cgroup2 mount, as on Debian's older systemd setups) or pure v1. Detection reads
// /proc/self/mountinfo instead of assuming /sys/fs/cgroup is one thing or the other, then picks one hierarchy
// per feature (freeze, memory limit, cpu limit). A sandbox's cgroup is the set of directories
// <mount>/<parent_name>/<sandbox id>, one per hierarchy in use.
//
// Nothing here is RAII: the directories outlive the node process on purpose (a restarted node adopts running
// sandboxes), so a SandboxCgroup is just the paths plus the operations on the kernel files behind them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace sg {

enum class CgroupVersion { kNone, kV1, kV2 };
std::string_view cgroup_version_name(CgroupVersion v);

// Which hierarchy serves one feature. `mount` is the hierarchy's mount point; empty when version is kNone.
struct CgroupFeature {
  CgroupVersion version = CgroupVersion::kNone;
  std::string mount;
};

// The cgroup mounts found in a mountinfo table.
struct CgroupMounts {
  std::string v2_mount;                          // first cgroup2 mount; empty if none
  std::map<std::string, std::string> v1_mounts;  // v1 controller name ("freezer", "memory", ...) -> mount point
};

struct CgroupDetection {
  CgroupMounts mounts;
  std::vector<std::string> v2_controllers;  // cgroup.controllers of the cgroup2 mount's root
  CgroupFeature freeze;
  CgroupFeature memory;
  CgroupFeature cpu;
  CgroupFeature pids;  // pids.max: the process-count limit (a fork bomb stops there)

  // One human-readable line per feature, e.g. "freeze: v2 /sys/fs/cgroup/unified".
  std::string describe() const;
};

// Parses /proc/<pid>/mountinfo text. Pure, so layouts this host does not have can be tested.
CgroupMounts parse_cgroup_mounts(std::string_view mountinfo);
// The per-feature policy: v2 whenever it can serve the feature, else the v1 controller, else none.
// Freezing needs no v2 controller (cgroup.freeze is core), memory and cpu need theirs in `v2_controllers`.
CgroupDetection choose_cgroup_features(CgroupMounts mounts, std::vector<std::string> v2_controllers);
// Reads /proc/self/mountinfo and the cgroup2 root's cgroup.controllers, then applies the policy.
Result<CgroupDetection> detect_cgroups();

// One sandbox's cgroup. Operations act on every hierarchy in use; a directory that no longer exists is
// treated as already released (kill_all, remove), so cleanup after a partial failure or a crash is safe.
class SandboxCgroup {
 public:
  // Moves `pid` (and so its future descendants) into the sandbox's cgroup in every hierarchy.
  Status add_pid(int pid) const;
  // Requests freezing / thawing; completion is observed with is_frozen() (freezing is asynchronous).
  Status freeze() const;
  Status thaw() const;
  // Reads the kernel's view: cgroup.events "frozen 1" (v2) or freezer.state "FROZEN" (v1). A freeze still in
  // progress reads as not frozen.
  Result<bool> is_frozen() const;
  // Kills every process: cgroup.kill when the kernel has it, else SIGKILL each pid in cgroup.procs of every
  // hierarchy and thaws the group (a frozen v1 task only dies once thawed).
  Status kill_all() const;
  // Removes the directories. The kernel refuses (EBUSY) while exiting tasks are still listed, so this
  // retries for up to about a second.
  Status remove() const;

  bool can_freeze() const { return freezer_.version != CgroupVersion::kNone; }
  // Every directory of this sandbox (one per hierarchy in use).
  const std::vector<std::string>& dirs() const { return dirs_; }
  // The real kernel files, for tests and diagnostics; empty when the feature has no hierarchy.
  std::string freezer_state_file() const;  // cgroup.events (v2) or freezer.state (v1)
  std::string memory_limit_file() const;   // memory.max (v2) or memory.limit_in_bytes (v1)
  std::string cpu_quota_file() const;      // cpu.max (v2) or cpu.cfs_quota_us (v1)
  std::string pids_max_file() const;       // pids.max (v1 and v2)

 private:
  friend class CgroupManager;
  struct Placement {
    CgroupVersion version = CgroupVersion::kNone;
    std::string dir;
  };

  std::string v2_dir_;  // empty when no feature uses cgroup v2
  Placement freezer_;
  Placement memory_;
  Placement cpu_;
  Placement pids_;
  std::vector<std::string> dirs_;
};

// Creates and finds sandbox cgroups under <mount>/<parent_name> in each hierarchy the detection selected.
class CgroupManager {
 public:
  CgroupManager(CgroupDetection detection, std::string parent_name);

  const CgroupDetection& detection() const { return detection_; }
  // The cgroup of sandbox `id` whether or not it exists (used for sandboxes adopted after a restart).
  SandboxCgroup sandbox(const std::string& id) const;
  // Creates the directories (and missing parents) and applies the limits. cpus <= 0, memory_mb == 0 or
  // pids_max == 0 means unlimited. On failure nothing created for `id` is left behind.
  Result<SandboxCgroup> create(const std::string& id, double cpus, uint32_t memory_mb, uint32_t pids_max = 0) const;
  // <mount>/<parent_name> of every hierarchy in use.
  std::vector<std::string> parent_dirs() const;

 private:
  // The distinct mount points in use, in a stable order.
  std::vector<std::string> mounts_in_use() const;
  Status prepare_parents(const std::string& mount) const;

  CgroupDetection detection_;
  std::string parent_name_;
};

}  // namespace sg
