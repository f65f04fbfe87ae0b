// What a filesystem checkpoint of a running process sandbox writes (docs/snapshots.md): only what changed in
// its overlay's upper dir since its previous checkpoint. The live overlay cannot swap its upper dir, so the
// upper dir keeps growing; each checkpoint layer stacks on the ones before it (image layers, then this
// sandbox's earlier checkpoint layers) and holds:
//   - every entry of the upper dir that is new or whose inode, ctime, mtime, size, mode, owner, device or
//     opaque flag differs from the previous checkpoint's record (ctime changes on every write, chmod, chown,
//     rename and link, and the sandbox cannot set it), with the directories above it;
//   - a whole directory that became opaque since (deleted and made again: it hides everything below it);
//   - a whiteout for each path the previous checkpoint had that is gone now, at the topmost gone path.
// So the layer's size is the bytes of the files changed since the last checkpoint (a changed file is copied
// whole), and the walk that finds them is O(entries of the upper dir), reading only inodes.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace sg::snapshot {

// What a checkpoint remembers of one upper dir entry.
struct EntrySig {
  uint64_t ino = 0;
  int64_t ctime_ns = 0;
  int64_t mtime_ns = 0;
  uint64_t size = 0;
  uint32_t mode = 0;  // type and permission bits
  uint32_t uid = 0;
  uint32_t gid = 0;
  uint64_t rdev = 0;
  bool opaque = false;  // a directory with trusted.overlay.opaque=y

  bool operator==(const EntrySig&) const = default;
};

// Path relative to the upper dir ("etc/motd") -> signature. Sorted, so a subtree is a contiguous range.
using UpperIndex = std::map<std::string, EntrySig>;

// Walks `upper` (lstat only, never following a symlink). kLimitExceeded past `max_entries`.
Result<UpperIndex> scan_upper(const std::string& upper, uint64_t max_entries);

// File times come from the kernel's coarse clock (a tick of a few ms), so a write right after a checkpoint
// can leave an entry's ctime, size and inode as they were. Entries changed at or after `since_ns` (the
// CLOCK_REALTIME_COARSE time at the thaw, less one tick) are marked so that the next plan takes them
// whatever they look like then (git's "racily clean" entries).
void mark_racy(UpperIndex& index, int64_t since_ns);
// The threshold for mark_racy, read while the sandbox is frozen.
int64_t racy_threshold_now();
// The threshold for mark_racy once the clock has moved past every entry of `index`: waits (the sandbox
// still frozen, so nothing changes meanwhile) until racy_threshold_now() is later than the newest ctime,
// for at most `max_wait`, and returns the threshold then. So a file written just before the freeze costs
// the pause a tick or two instead of being copied whole again by the next checkpoint; only a wait that ran
// out (a clock set back) leaves racy entries.
int64_t racy_threshold_after(const UpperIndex& index, int64_t max_wait_ns);

struct DeltaPlan {
  std::set<std::string> entries;        // upper dir paths to write, their parent directories included
  std::set<std::string> opaque;         // directories among them written with an opaque marker
  std::vector<std::string> whiteouts;   // paths to hide (gone since the previous checkpoint), sorted
};

// The layer that takes the stack at `previous` (an empty index: the layers under the upper dir) to `current`.
DeltaPlan plan_delta(const UpperIndex& previous, const UpperIndex& current);

// The record a sandbox keeps of its last checkpoint: the layers that checkpoint's root filesystem was made of
// (the next delta stacks on exactly these), the upper dir's index at that moment, and the sandbox's base
// layers it was made for (empty in an index written before flattening: its chain then starts with them; a
// flattened chain does not, checkpointer.h).
struct CheckpointIndex {
  std::vector<std::string> chain;
  UpperIndex index;
  std::vector<std::string> base;
};
std::string encode_index(const CheckpointIndex& index);
// kInvalidArgument for anything that is not what encode_index wrote (the caller then starts from scratch).
Result<CheckpointIndex> decode_index(std::string_view text);

}  // namespace sg::snapshot
