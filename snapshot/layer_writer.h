// Writing a layer blob (an OCI-style tar, docs/images.md) from a directory on the host, with libarchive:
// the sealing of an image build step. Two sources:
//   - an overlayfs upper dir after a build step ran over it (Source::kOverlayUpper): its whiteouts (0:0 char
//     devices) become `.wh.NAME` entries, its opaque directories (trusted.overlay.opaque=y) get a
//     `.wh..wh..opq` entry, and each owner is shifted back from the step's host uid/gid range to image ids
//     (host id - base); an owner outside the range is an error naming the file (nothing in the step could
//     have made it, so the upper dir is not what the step left);
//   - files to copy into the image (Source::kCopy, `image build --copy`): every entry owned by image root.
// Entries are sorted by name and carry no trusted.* or security.* xattrs (a file capability written inside
// the step's user namespace names the host range's root and would be wrong once shifted), so the same tree
// gives the same bytes. Hard links inside the source stay hard links.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "common/error.h"
#include "snapshot/checkpoint_delta.h"

namespace sg::snapshot {

struct IdShift {
  uid_t base = 0;      // host id that is image id 0
  uint32_t count = 0;  // ids mapped: [base, base + count)
};

struct LayerSource {
  enum class Kind { kOverlayUpper, kCopy } kind = Kind::kOverlayUpper;
  std::string path;         // kOverlayUpper: the upper dir; kCopy: a file or directory on the host
  std::string dest;         // kCopy: where `path` lands in the image ("/app" or "app"); a directory's contents go under it
  IdShift shift;            // kOverlayUpper only
  uint64_t max_entries = 0; // a clear kLimitExceeded past it
  // kOverlayUpper only, a checkpoint (checkpoint_delta.h): only these entries, opaque markers only on
  // `opaque`, the whiteouts added, and sockets left out (a socket is a live process's, nothing to restore).
  const DeltaPlan* delta = nullptr;
};

struct WrittenLayer {
  uint64_t entries = 0;  // 0: the source was empty; the (empty) tar is not hashed and the step adds no layer
  std::string digest;    // "sha256:<hex>" of the tar at `out_path`; "" when entries == 0
};

// Writes the tar to `out_path` (created, must not exist) and hashes it. kInvalidArgument for a source that
// cannot be represented (an owner outside the range, an unsafe `dest`, a file type tar cannot hold).
Result<WrittenLayer> write_layer(const LayerSource& source, const std::string& out_path);

}  // namespace sg::snapshot
