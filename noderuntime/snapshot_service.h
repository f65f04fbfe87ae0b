// The node's snapshots (snapshot/snapshot_store.h) behind the libuv loop, as ImageService is for images: a
// checkpoint walks an upper dir and writes a layer, a removal deletes layer trees, so both run on libuv's
// thread pool and answer on the loop; list and get read small files and answer at once. The node (node.h)
// decides whether a sandbox may be checkpointed and hands the job here, and registers each sandbox created
// from a snapshot as its user: `snapshot rm` is refused (409 naming the sandbox) while one lives.
#pragma once

#include <uv.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "noderuntime/image_users.h"
#include "snapshot/checkpointer.h"
#include "snapshot/image_store.h"
#include "snapshot/snapshot_store.h"

namespace sg {

class SnapshotService {
 public:
  using CheckpointDone = std::function<void(Result<snapshot::CheckpointResult>)>;
  using Done = std::function<void(Result<snapshot::Snapshot>)>;

  // `loop` and `images` must outlive the service; so must the service every job it started.
  SnapshotService(uv_loop_t* loop, std::unique_ptr<snapshot::SnapshotStore> store, snapshot::ImageStore* images)
      : loop_(loop), store_(std::move(store)), images_(images) {}

  // `user` ("sandbox box (sb-...)") now runs on snapshot `id`: kNotFound if the record is gone (a removal
  // that won the race). One lock with remove()'s check, so a snapshot is never removed under a new user.
  Status add_user(const std::string& id, const std::string& user);
  void remove_user(const std::string& id, const std::string& user) { users_.remove(id, user); }
  // Which snapshots name `image` (for the claim main.cc hands ImageStore::set_users; any thread).
  std::optional<std::string> image_user(const std::string& image) const;
  // A VM checkpoint's files (memory, or a disk) are written by the driver into new_files_dir(id) (made empty
  // here, on the loop: a directory); commit_files() then syncs them, renames the directory into place and writes the
  // record, last; discard_files() removes what a failed one left.
  Result<std::string> begin_files(const std::string& id);
  void commit_files(snapshot::Snapshot record, Done done);
  void discard_files(const std::string& id);
  std::string files_dir(const std::string& id) const { return store_->files_dir(id); }
  // `done` runs on the loop thread.
  void checkpoint(snapshot::CheckpointJob job, std::unique_ptr<snapshot::Freezer> freezer, CheckpointDone done);
  // Re-hashes the layers snapshot `id` added on top of its image (the image's are trusted as they are for
  // any sandbox) and a memory snapshot's files (state, RAM, disk) against the digests its record holds:
  // kInvalidArgument naming a damaged one, so a create from it is refused rather than started.
  // A blob that hashed right is not hashed again while its file is unchanged (same inode, size, mtime and
  // ctime): a golden snapshot's sessions would otherwise each re-read all of its layers (2 s for 256 MiB,
  // bench/RESULTS.md). Bit rot under an unchanged file after the first check is not caught.
  void verify(std::string id, std::function<void(Status)> done);
  // kConflict naming the sandbox while one created from the snapshot lives; the layers no image or other
  // snapshot holds are removed with it. A snapshot whose disk another one's reads (a later checkpoint's
  // delta, a checkpoint of a sandbox created from it) is only marked removed (the answer's `removed`): its
  // files go with the last of those, as do the removed ones under it.
  void remove(std::string id, Done done);
  // The snapshots a user sees: the removed ones are not listed, and get() does not find them.
  Result<std::vector<snapshot::Snapshot>> list() const;
  Result<snapshot::Snapshot> get(std::string_view id) const;

 private:
  template <typename T>
  void run(std::function<Result<T>()> job, std::function<void(Result<T>)> done);
  static std::string file_stamp(const std::string& path);

  uv_loop_t* loop_;
  std::unique_ptr<snapshot::SnapshotStore> store_;
  snapshot::ImageStore* images_;
  ImageUsers users_;  // snapshot id -> the sandboxes created from it
  std::mutex mu_;     // add_user's check against remove()'s
  // Layers and files that hashed right, with their stat then ("ino size mtime ctime"), under verified_mu_.
  std::map<std::string, std::string> verified_;
  std::mutex verified_mu_;
};

}  // namespace sg
