// One layer that stands for a stack of layers (docs/snapshots.md#flattening): what a checkpoint chain is
// flattened into once it grows long, so that a session checkpointed a thousand times, or a line of sandboxes
// each created from the last one's checkpoint, never reaches overlayfs's layer limit (kMaxImageLayers).
//
// The stack's trees (layer_store.h: overlayfs form, whiteouts as 0:0 char devices, opaque directories marked
// trusted.overlay.opaque=y) are merged bottom up into a scratch tree in the store's tmp/, as overlayfs would
// show them over whatever lies below the stack:
//   - a file, symlink, device or whiteout replaces what the scratch tree holds at its path (a directory
//     included, with all under it); it is a hard link to the layer's own inode, so nothing is copied and its
//     owner, mode and times are the layer's;
//   - a directory is made (over a non-directory) or kept, and takes the layer's owner, mode and times; an
//     opaque one first drops everything the layers below put there, and stays opaque;
//   - a whiteout stays a whiteout in the result (the path may exist below the stack).
// The scratch tree is then written as a layer tar (layer_writer.h) and added to the store, pinned. Hard links
// inside one layer stay hard links; the layers are never written to.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "snapshot/image_store.h"

namespace sg::snapshot {

// `layers` (bottom first, all in the store and pinned by the caller) as one layer, added to the store pinned:
// its digest, or "" when the stack holds nothing. The caller unpins it. `label` names it in errors.
Result<std::string> squash_layers(ImageStore& images, const std::vector<std::string>& layers, std::string_view label);

}  // namespace sg::snapshot
