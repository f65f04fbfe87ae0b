// A filesystem checkpoint of a process sandbox (docs/snapshots.md), the whole of it on the calling thread (a
// libuv pool thread in the node):
//   1. the sandbox's previous checkpoint index (checkpoint_delta.h) and the layers it stacks on, pinned in the
//      store (a chain whose layer was removed meanwhile, or a damaged index, starts over from the base layers:
//      a full upper dir, never a wrong delta);
//   1b. a chain whose layers above the image's reach max_layers_above_image (or whose whole would pass
//      kMaxImageLayers) is flattened first: those layers become one showing the same tree (layer_squash.h),
//      so the chain stays short however many checkpoints and creates-from-a-checkpoint came before;
//   2. freeze; walk the upper dir, write only the changed entries as a layer tar; thaw. The pause is the walk
//      plus the copy of the changed bytes;
//   3. the tar into the layer store (hashed, unpacked), pinned;
//   4. the snapshot record, written LAST (crash-safe); then the sandbox's new index; then the pins end.
// A failure at any step leaves no record, thaws the sandbox, and the GC takes the unnamed layer; the source
// never stops running beyond the freeze.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/error.h"
#include "snapshot/image_store.h"
#include "snapshot/layer_writer.h"
#include "snapshot/snapshot_store.h"

namespace sg::snapshot {

// Holds a sandbox still while its upper dir is read.
class Freezer {
 public:
  virtual ~Freezer() = default;
  // Returns once every process is frozen (or with the error, nothing frozen).
  virtual Status freeze() = 0;
  virtual Status thaw() = 0;
};

// How many layers a chain may hold above its image's before a checkpoint flattens them: each is one more
// lowerdir for overlayfs to look through, and a flattening copies their bytes once.
inline constexpr size_t kMaxLayersAboveImage = 32;

struct CheckpointJob {
  std::string upper_dir;
  IdShift shift;                         // the sandbox's host id range (owners are shifted back to image ids)
  std::string index_path;                // where the sandbox keeps its last checkpoint's index
  std::vector<std::string> base_layers;  // its root filesystem below the upper dir, bottom first
  // The record to write: source, driver, image and the create defaults; the rest is filled in.
  Snapshot record;
  uint64_t max_entries = kMaxLayerEntries;
  size_t max_layers_above_image = kMaxLayersAboveImage;
};

// The written record (pause_ms: how long the sandbox was frozen).
struct CheckpointResult {
  Snapshot snapshot;
  double pause_ms = 0;
  uint64_t entries = 0;  // entries in the new layer (0: nothing had changed, no layer)
  size_t flattened = 0;  // the layers the chain's top was flattened from first (0: not flattened)
};

Result<CheckpointResult> checkpoint(ImageStore& images, SnapshotStore& snapshots, const CheckpointJob& job,
                                    Freezer& freezer);

}  // namespace sg::snapshot
