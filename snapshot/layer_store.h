// The node's content-addressed layer store (docs/node-api.md#images): every image layer once, shared by
// every image (and later sandbox and checkpoint) that uses it.
//
//   <root>/sha256/<hex>/blob   the layer tar exactly as imported (compressed or not); sha256(blob) == <hex>
//   <root>/sha256/<hex>/tree/  the blob unpacked: the future overlayfs lowerdir. OCI whiteouts are converted
//                              to overlayfs form: `.wh.NAME` becomes the char device 0:0 NAME, `.wh..wh..opq`
//                              the xattr trusted.overlay.opaque=y on its directory.
//   <root>/tmp/                work in progress; emptied by open(), never read
//
// Crash safety: a layer is built in <root>/tmp, synced (syncfs) and renamed into sha256/ in one step, so a
// layer directory under sha256/ is always complete; an interrupted import leaves only tmp/ debris, which the
// next open() removes. Removal renames out of sha256/ first, for the same reason.
// Not thread-safe: ImageStore serializes the writers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "snapshot/names.h"

namespace sg::snapshot {

// Bounds on one layer's contents (untrusted input): a clear error past them, never unbounded work.
inline constexpr uint64_t kMaxLayerEntries = 1'000'000;

// "sha256:<64 lowercase hex>"?
bool valid_digest(std::string_view digest);
// "sha256:<hex>" of the file's bytes (OpenSSL EVP, streamed).
Result<std::string> sha256_file(const std::string& path);
// Writes `data` to `path` crash-safely: temp file in the same directory, fsync, rename, fsync the directory.
Status write_file_atomic(const std::string& path, std::string_view data);
// fsync of a directory (after a rename into or out of it).
Status fsync_dir(const std::string& path);
// Whether `dir` carries overlayfs's opaque marker (trusted.overlay.opaque=y), as a store tree or an upper
// dir does for a directory that hides everything below it.
bool is_opaque_dir(const std::string& dir);
// The names in `dir` but "." and "..", sorted (the same tree is walked in the same order, so it gives the
// same tar and the same digest).
Result<std::vector<std::string>> sorted_entries(const std::string& dir);
// Removes `path` and everything under it when it goes out of scope (a make_temp_dir() directory).
struct RemovedOnExit {
  std::string path;
  ~RemovedOnExit();
};

class LayerStore {
 public:
  // Creates <root>/sha256 and <root>/tmp as needed and removes what an interrupted run left in tmp/.
  // `root` is resolved (realpath) once, so unpacking never follows a symlink in the store's own path.
  static Result<LayerStore> open(const std::string& root);

  const std::string& root() const { return root_; }
  // A fresh directory under tmp/ for the caller's staging files (same filesystem as the store, so a staged
  // blob can be renamed into a layer). The caller removes it.
  Result<std::string> make_temp_dir(std::string_view prefix) const;

  // Adds the blob at `blob_path` (a file the caller staged, normally in make_temp_dir()) as the layer
  // `expected_digest`. The blob's sha256 is checked first: a mismatch is kInvalidArgument naming `label` (where
  // the blob came from) and both digests, and nothing is stored. A layer already in the store is shared, not
  // unpacked again (the blob file is left where it is then). Otherwise the blob is moved into the store and
  // unpacked; an unsafe entry (absolute path, "..", a path through a symlink or over the entry bound) fails the
  // whole layer with a message naming the entry. Returns the digest.
  Result<std::string> add(const std::string& blob_path, std::string_view expected_digest, std::string_view label);

  // Free space that must remain on the store's filesystem (default 1 GiB): an import or a build that would
  // go below it stops with kLimitExceeded, so an archive, however large, cannot fill the node's disk.
  void set_free_space_reserve(uint64_t bytes) { free_space_reserve_ = bytes; }
  // kLimitExceeded (naming `where`) if writing `bytes` more would leave less than the reserve free.
  Status check_free_space(uint64_t bytes, std::string_view where) const;

  bool contains(std::string_view digest) const;
  std::string layer_dir(std::string_view digest) const;  // <root>/sha256/<hex>
  std::string tree_path(std::string_view digest) const;  // <root>/sha256/<hex>/tree
  // Re-hashes the stored blob: kInvalidArgument when it no longer matches (disk corruption, tampering).
  Status verify(std::string_view digest) const;
  // Every layer in the store ("sha256:<hex>"), sorted.
  Result<std::vector<std::string>> list() const;
  // Removes one layer (rename out of sha256/, then delete). kNotFound if it is not there.
  Status remove(std::string_view digest);

 private:
  explicit LayerStore(std::string root) : root_(std::move(root)) {}
  Status unpack(const std::string& blob, const std::string& tree, std::string_view label) const;

  std::string root_;
  uint64_t free_space_reserve_ = uint64_t{1} << 30;
};

}  // namespace sg::snapshot
