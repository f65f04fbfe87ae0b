// Named images on the node: an ordered list of layers in the LayerStore plus the parts of the image config a
// sandbox will start from (Env, Entrypoint, Cmd, WorkingDir). Each image is one small JSON file,
// <state_dir>/images/<name>.json, written crash-safely; its layers live in <state_dir>/layers (layer_store.h).
//
// import() reads a `docker save` archive (manifest.json + config + layer tars, old or new layout) or an OCI
// image layout (oci-layout, index.json, blobs/sha256/), as a tar, possibly compressed. Every blob is checked
// against its digest before it is used; every limit below is explicit and a breach is a clear error naming the
// archive member, never a crash. Sandboxes do not use images yet (docs/status.md, issue 10).
//
// Thread safety: import() and remove() may run on worker threads; they are serialized by a mutex. list() and
// get() take no lock (each image file appears by an atomic rename), so they never wait for an import.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "snapshot/names.h"
#include "snapshot/layer_store.h"

namespace sg::snapshot {

inline constexpr size_t kMaxImageLayers = 128;           // overlayfs stacks about this many lowerdirs
inline constexpr size_t kMaxArchiveMembers = 4096;       // files in the outer archive
inline constexpr size_t kMaxJsonBytes = 1024 * 1024;     // manifest.json, index.json, configs, OCI manifests

struct ImageConfig {
  std::vector<std::string> env;  // "K=V"
  std::vector<std::string> entrypoint;
  std::vector<std::string> cmd;
  std::string working_dir;
};

struct Image {
  std::string name;
  std::string format;  // "docker-save", "oci" or "build"
  std::string parent;  // a built image: the image it was built --from ("" for none); remove() refuses the parent
  std::string config_digest;
  std::vector<std::string> layers;  // bottom first
  ImageConfig config;
  uint64_t size_bytes = 0;  // sum of the layer blobs, as stored
  int64_t created_at_ms = 0;
};


class ImageStore {
 public:
  // Who else uses an image (sandboxes, snapshots). remove() calls `claim` on its thread (a libuv pool thread in
  // the node) under the store's lock, so it must be thread-safe: it returns why `name` is in use, or nullopt
  // after marking it as being removed, and from then until `release` (called once remove() is done, whatever
  // its outcome) nothing may start using the image. Whatever starts using an image registers first and then
  // checks that the image still exists (noderuntime/image_users.h).
  using ClaimForRemoval = std::function<std::optional<std::string>(const std::string& name)>;
  using ReleaseRemoval = std::function<void(const std::string& name)>;

  // The layers someone besides the images holds (snapshots, snapshot_store.h): the GC keeps them. A failure
  // makes the GC remove nothing. Called under the store's lock, from any thread: it must be thread-safe and
  // must not call back into the ImageStore.
  using LayerHolders = std::function<Result<std::set<std::string>>()>;

  // <state_dir>/images and <state_dir>/layers; collects layers no image and no holder uses (an import or a
  // checkpoint a crash interrupted).
  static Result<std::unique_ptr<ImageStore>> open(const std::string& state_dir, LayerHolders holders = {});

  void set_users(ClaimForRemoval claim, ReleaseRemoval release) {
    claim_ = std::move(claim);
    release_ = std::move(release);
  }

  // kAlreadyExists if `name` exists; kInvalidArgument for an archive that is malformed, corrupted (digest
  // mismatch), unsafe or missing a member; kLimitExceeded past a bound; kNotFound if `archive_path` is missing.
  Result<Image> import(const std::string& archive_path, const std::string& name);
  Result<std::vector<Image>> list() const;
  // The images' names, sorted, from the directory alone (no image file is read): cheap enough for a fleet
  // node to publish on every lease renewal, from its lease thread.
  Result<std::vector<std::string>> names() const;
  Result<Image> get(const std::string& name) const;
  // kConflict while the image's users say it is in use, or another image was built --from it (its layers
  // are shared, so the parent stays while a child names it). Layers no other image uses are removed with it.
  Result<Image> remove(const std::string& name);

  // Image builds (image_builder.h). A build's layers are pinned from the moment it uses them until it ends,
  // so a concurrent remove() (whose garbage collection takes every layer no image names) cannot take them.
  // get() of `name` and a pin on its layers, in one step (a --from parent removed meanwhile keeps its layers).
  Result<Image> get_and_pin(const std::string& name);
  // LayerStore::add, pinned in the same step.
  Result<std::string> add_pinned_layer(const std::string& blob_path, std::string_view digest, std::string_view label);
  // Ends a build's pins; the layers no image names then (a failed build's) are removed.
  void unpin(const std::vector<std::string>& layers);
  // Pins layers that must already be in the store (a checkpoint's chain): kNotFound naming the first missing
  // one, and then nothing is pinned.
  Status pin_existing(const std::vector<std::string>& layers);
  // Removes every layer no image, pin or holder names (after a snapshot record is removed).
  Status collect_unused();
  // Writes the record of a built image whose layers are pinned: kAlreadyExists if the name was taken while
  // it was built, kNotFound if `image.parent` was removed meanwhile.
  Result<Image> create(Image image);
  LayerStore& layers() { return layers_; }

 private:
  ImageStore(std::string images_dir, LayerStore layers, LayerHolders holders)
      : images_dir_(std::move(images_dir)), layers_(std::move(layers)), holders_(std::move(holders)) {}
  std::string image_file(const std::string& name) const { return images_dir_ + "/" + name + ".json"; }
  // Removes every layer no image file names. Called with mu_ held.
  Status collect_garbage();

  std::string images_dir_;
  LayerStore layers_;
  ClaimForRemoval claim_;
  ReleaseRemoval release_;
  LayerHolders holders_;
  std::multiset<std::string> pinned_;  // layers of builds in progress, once per build using them
  std::mutex mu_;
};

}  // namespace sg::snapshot
