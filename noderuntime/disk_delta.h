// Filesystem checkpoints of a live QEMU guest's disk as QEMU backup jobs, so that a checkpoint costs the
// clusters the guest wrote since the sandbox's last one, not its whole overlay (docs/snapshots.md#filesystem-checkpoints-of-a-qemu-sandbox).
//
// Every disk checkpoint adds a persistent dirty bitmap named after its snapshot to the guest's overlay (kept
// in the qcow2 file, so it lives through hibernation and QEMU restarts) in the same QMP transaction that
// starts its backup job, so the bitmap records exactly the writes after the point the job copies. The next
// checkpoint then copies only the clusters that bitmap marks (`sync: bitmap`) into a qcow2 overlay of the
// last checkpoint's disk; the first one, or one whose base is gone (its snapshot removed, its bitmap lost
// to a killed QEMU), copies the overlay's own clusters (`sync: top`) onto the overlay's backing file. The
// guest runs throughout: the job's copy-before-write keeps the point in time.
//
// <sandbox dir>/disk.checkpoint says which checkpoint the next one may start from: written once a job has
// finished, before the node records its snapshot; if the record never comes, its disk is missing and the
// next checkpoint copies the whole overlay again (never a delta over something that is not there).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"

namespace sg {

inline constexpr const char* kDiskCheckpointMarker = "disk.checkpoint";
// The QMP node a checkpoint writes through, and its job's id.
inline constexpr const char* kCheckpointNode = "sg-checkpoint";

struct LastDiskCheckpoint {
  std::string id;    // its snapshot, which is also the name of the bitmap that started with it
  std::string disk;  // its snapshot's disk, where it stays once recorded
  uint32_t chain = 1;  // how many of this sandbox's checkpoint disks that one reads through, itself included
};
// nullopt when there is none or it cannot be read (the next checkpoint copies the whole overlay).
std::optional<LastDiskCheckpoint> read_last_disk_checkpoint(const std::string& sandbox_dir);
Status write_last_disk_checkpoint(const std::string& sandbox_dir, const LastDiskCheckpoint& last);

struct DiskDeltaPlan {
  uint64_t virtual_size = 0;
  std::string backing;         // the new disk's backing file: the last checkpoint's disk, or the overlay's own
  std::string backing_format;  // of that file: "qcow2" or "raw"
  std::string base_id;         // the last checkpoint when the new disk holds only what changed since it
  std::vector<std::string> stale_bitmaps;  // ours ("snap-...") that no checkpoint will start from
  uint32_t chain = 1;                      // the new disk's chain (LastDiskCheckpoint::chain)
  // Set when the disks under the overlay (those of the snapshot the sandbox was made from, and theirs) are
  // max_chain or more: a block-stream job first copies their data into the overlay, whose backing file is
  // then the chain's bottom (the image's base disk), the new disk's backing file too.
  std::string stream_base_node;
  bool delta() const { return !base_id.empty(); }
};

// From QEMU's answer to query-named-block-nodes (flat): the qcow2 node whose file is `overlay` (its size,
// backing file, bitmaps, and the nodes of its backing chain) and the last checkpoint, whose disk must still be
// readable and whose bitmap must be there, consistent, to start from it, and whose chain must be shorter than
// `max_chain` (else the whole overlay is copied, which starts a new chain, on a chain of inherited disks
// shorter than `max_chain` too: stream_base_node). kInternal naming what is missing when QEMU's answer lacks
// the node.
Result<DiskDeltaPlan> plan_disk_delta(const nlohmann::json& nodes, const std::string& overlay,
                                      const std::optional<LastDiskCheckpoint>& last, uint32_t max_chain);

// The QMP arguments of the block-stream job that flattens the overlay's chain onto plan.stream_base_node.
nlohmann::json disk_stream_arguments(const DiskDeltaPlan& plan);

// The QMP transaction: the bitmap `new_id` and the backup of the guest's disk ("root") into kCheckpointNode.
nlohmann::json disk_delta_transaction(const DiskDeltaPlan& plan, const std::string& new_id);

enum class BackupJob { kRunning, kConcluded, kAbsent };
// Where kCheckpointNode's job stands in QEMU's answer to query-jobs; a concluded job that failed is a
// failure carrying QEMU's reason.
Result<BackupJob> backup_job_state(const nlohmann::json& jobs);

}  // namespace sg
