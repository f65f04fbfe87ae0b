// Root disks for QEMU guests made from images (snapshot/image_store.h).
//
// Per image content a base disk, <dir>/<key>.raw (key: the sha256 of the image's layer tree paths, which
// name the layers' digests, so an image removed and made again under the same name with other layers gets
// another base, and images of the same layers share one): ext4 made by `mkfs.ext4 -d` from the image's
// merged tree (its layer trees stacked by a read-only overlayfs mount, or its one tree as it is), built
// once, read-only (0444) and shared by every sandbox of the image, kept across node restarts. Beside it,
// <key>.trees names those trees, so a base whose layers are gone can be found (remove_orphaned_guest_disks).
// Per sandbox a qcow2 overlay on it,
// <sandbox dir>/disk.qcow2 (`qemu-img create -f qcow2 -b BASE -F raw`), which takes everything the guest
// writes: it stays with the sandbox through suspend, hibernate and node restarts, and goes with its dir.
//
// mount, mkfs and qemu-img block, so they run on libuv's thread pool; base builds are serialized (a second
// sandbox of the same image waits, then finds the disk built).
#pragma once

#include <uv.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"

namespace sg {

// The base disk's size: the tree's bytes plus a quarter (ext4 metadata) plus this, the free space each
// sandbox's filesystem starts with (its writes go to its overlay, which grows up to the same size).
inline constexpr uint64_t kGuestDiskFreeBytes = 256ull << 20;

// Removes the base disks in `dir` one of whose layer trees is gone: the layer store removes a layer when no
// image names it any more, and `image rm` is refused while a sandbox uses the image, so no sandbox's overlay
// is backed by such a base. A base without its .trees file (made before it existed) is kept. Blocks (it
// waits for a base build in progress): for a pool thread or the node's start.
void remove_orphaned_guest_disks(const std::string& dir);

// Where the node keeps the base disks: <state_dir>/qemu-disks.
inline std::string guest_disks_dir(const std::string& state_dir) { return state_dir + "/qemu-disks"; }

class GuestDisks {
 public:
  using Done = std::function<void(Result<std::string>)>;  // the overlay's path

  GuestDisks(uv_loop_t* loop, std::string dir);
  // A build in flight finishes on its pool thread; its completion is dropped.
  ~GuestDisks();
  GuestDisks(const GuestDisks&) = delete;
  GuestDisks& operator=(const GuestDisks&) = delete;

  // `trees`: the image's layer trees, bottom first. Makes <sandbox_dir>/disk.qcow2 on the image's base disk
  // (built first if missing) unless it exists already. `done` runs on the loop, after this returns (at once
  // only if the loop refuses the work, which it does only while closing).
  void overlay(std::vector<std::string> trees, std::string sandbox_dir, Done done);
  // Makes <sandbox_dir>/disk.qcow2 on `backing` (a memory snapshot's qcow2 disk) unless it exists already.
  void overlay_on(std::string backing, std::string sandbox_dir, Done done);
  // Copies the file `from` (a qcow2 disk, a guest's RAM) to `to`, sparse (holes stay holes; from another
  // filesystem, zero pages become holes too; reflinked where the filesystem can). Not synced: a memory
  // checkpoint copies while its guest stands still, and syncs every file of the snapshot once the guest runs
  // again. `done` gets `to`.
  void copy(std::string from, std::string to, Done done);
  // Makes `to`: an empty qcow2 overlay of `backing` (a `format` file, named in its header, not opened) of
  // `virtual_size` bytes, which a disk checkpoint's backup job fills. `done` gets `to`.
  void delta_target(std::string backing, std::string format, uint64_t virtual_size, std::string to, Done done);

 private:
  void submit(std::function<Result<std::string>()> job, Done done);

  uv_loop_t* loop_;
  std::string dir_;
  std::shared_ptr<bool> alive_;
};

}  // namespace sg
