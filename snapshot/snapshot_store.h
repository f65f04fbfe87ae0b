// Snapshot records (docs/node-api.md#snapshots): a filesystem checkpoint of a sandbox is the ordered list of
// layers its root filesystem is made of at that moment (the image's, then the checkpoint layers) plus what a
// sandbox created from it starts with by default (command, env, cwd, ports). The layers live in the shared
// content-addressed LayerStore (layer_store.h); a record only names them.
//
//   <root>/<snap-id>.json   one record, written by write_file_atomic (temp + fsync + rename)
//   <root>/<snap-id>.d/     a VM snapshot's files (its saved state, its disk), renamed into place
//                           complete before the record is written, removed after it
//
// A checkpoint writes its record LAST, after its layer is complete in the store: a crash before that leaves an
// unnamed layer (collected by the image store's GC at the next start, which asks layers_in_use()) and no
// record, so no half snapshot is ever listed. Reads take no lock (every record appears by an atomic rename).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace sg::snapshot {

// Bounds on a record (the node's own file, still read defensively) and on what a snapshot may hold.
inline constexpr size_t kMaxSnapshotRecordBytes = 1024 * 1024;
inline constexpr size_t kMaxSnapshots = 4096;

struct SnapshotPort {
  uint16_t port = 0;
  bool is_public = false;
  std::string protocol = "http1";
};

// A VM snapshot's disk, in its files_dir: a qcow2 overlay of the image's base disk (or of its parent's).
inline constexpr const char* kDiskFile = "disk.qcow2";

struct Snapshot {
  std::string id;    // "snap-" + 12 of [a-z0-9]
  // "filesystem" (layers, or a VM's disk in files_dir) or "memory" (a VM's saved state and disk, in files_dir)
  std::string type;
  std::string source_id;
  std::string source_name;
  std::string driver;  // the source's driver; a sandbox from the snapshot runs on it too
  std::string image;   // the image under the layers (image rm is refused while a snapshot names it)
  std::vector<std::string> layers;  // the whole root filesystem, bottom first: image layers, then checkpoints
  std::string layer;                // the layer this checkpoint added ("" when nothing had changed)
  uint64_t layer_bytes = 0;         // its blob's size
  // Defaults for a sandbox created from it.
  std::vector<std::string> command;
  std::map<std::string, std::string> env;
  std::string cwd = "/";
  std::vector<SnapshotPort> ports;
  int64_t created_at_ms = 0;
  // Memory snapshots: the VM's shape, which a sandbox made from it must have (the saved devices and RAM are
  // of that shape), and the sizes of its files.
  uint32_t memory_mb = 0;
  double cpus = 0;
  uint64_t state_bytes = 0;  // the saved state: devices, and the RAM pages when ram_bytes is 0
  uint64_t ram_bytes = 0;    // the guest's RAM saved as a file of its own (allocated bytes)
  uint64_t disk_bytes = 0;   // the copy of its disk overlay (0: it booted without a disk)
  // The snapshot whose disk this one's disk is an overlay of ("" for none): a VM checkpointed while it ran
  // on a snapshot's disk. That one cannot be removed while this one exists.
  std::string parent;
  // Removed by its owner while a snapshot whose disk reads its disk exists (its `parent`): unlisted, no
  // sandbox can start from it, and its record and files go with the last such child.
  bool removed = false;
  // Each of its files (state, ram, disk.qcow2) -> "sha256:<hex>", checked before a sandbox starts from it.
  // Empty for memory records written before the digests.
  std::map<std::string, std::string> file_digests;

  // A filesystem snapshot that is a VM's disk rather than layers.
  bool is_vm_disk() const { return type == "filesystem" && file_digests.contains(kDiskFile); }
};

// "snap-" + 12 of [a-z0-9]: a file name and a URL path segment as it is. kInvalidArgument naming it otherwise.
Status check_snapshot_id(std::string_view id);
std::string generate_snapshot_id();

class SnapshotStore {
 public:
  // Creates `root` as needed and removes what an interrupted write left (temp files, files dirs without a
  // record).
  static Result<SnapshotStore> open(const std::string& root);

  const std::string& root() const { return root_; }
  // Where a VM snapshot's files are (complete once its record exists), and where they are written first.
  std::string files_dir(std::string_view id) const { return root_ + "/" + std::string(id) + ".d"; }
  std::string new_files_dir(std::string_view id) const { return root_ + "/" + std::string(id) + ".d.tmp"; }
  // kAlreadyExists if the id is taken, kLimitExceeded past kMaxSnapshots. Written crash-safely.
  Status create(const Snapshot& snapshot);
  Result<Snapshot> get(std::string_view id) const;
  // Every record, oldest first. A damaged record is an error naming its file (never skipped: its layers
  // must not be collected).
  Result<std::vector<Snapshot>> list() const;
  // Deletes the record (kNotFound if absent), then its files. The caller collects its layers afterwards.
  Status remove(std::string_view id);
  // Rewrites the record with `removed` set (crash-safely); its files stay.
  Status mark_removed(std::string_view id);
  // Every layer some record names: what the image store's GC must keep.
  Result<std::set<std::string>> layers_in_use() const;
  // A snapshot whose parent is `id` (removed ones count: their disks still read it), or nullopt.
  Result<std::optional<std::string>> first_child_of(std::string_view id) const;
  // A snapshot whose image is `image`, described for a refusal ("snapshot snap-..."), or nullopt.
  Result<std::optional<std::string>> first_user_of_image(const std::string& image) const;

 private:
  explicit SnapshotStore(std::string root) : root_(std::move(root)) {}
  std::string file(std::string_view id) const { return root_ + "/" + std::string(id) + ".json"; }

  std::string root_;
};

}  // namespace sg::snapshot
