#include "snapshot/layer_squash.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <climits>
#include <filesystem>

#include "snapshot/layer_writer.h"

namespace sg::snapshot {
namespace {

constexpr const char* kOpaqueXattr = "trusted.overlay.opaque";

Status remove_path(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return fail(Error::kIo, "remove " + path + ": " + ec.message());
  return {};
}

// Owner, mode and times of the layer's directory `st` on the scratch tree's `dir` (times last: adding the
// children moved them).
Status copy_dir_metadata(const std::string& dir, const struct stat& st) {
  if (::lchown(dir.c_str(), st.st_uid, st.st_gid) != 0) return fail_errno("chown " + dir, errno);
  if (::chmod(dir.c_str(), st.st_mode & 07777) != 0) return fail_errno("chmod " + dir, errno);
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  if (::utimensat(AT_FDCWD, dir.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0) return fail_errno("utimensat " + dir, errno);
  return {};
}

// Lays the layer tree `from` over the scratch tree `to` (both directories), as the header says.
Status merge_into(const std::string& from, const std::string& to, uint64_t& entries) {
  auto names = sorted_entries(from);
  if (!names) return names.failure();
  for (const std::string& name : *names) {
    if (++entries > kMaxLayerEntries)
      return fail(Error::kLimitExceeded, "the layers hold more than " + std::to_string(kMaxLayerEntries) + " entries");
    const std::string src = from + "/" + name, dst = to + "/" + name;
    struct stat st{}, have{};
    if (::lstat(src.c_str(), &st) != 0) return fail_errno("lstat " + src, errno);
    bool exists = ::lstat(dst.c_str(), &have) == 0;
    if (S_ISDIR(st.st_mode)) {
      const bool opaque = is_opaque_dir(src);
      if (exists && (!S_ISDIR(have.st_mode) || opaque)) {
        if (Status s = remove_path(dst); !s) return s;
        exists = false;
      }
      if (!exists && ::mkdir(dst.c_str(), 0700) != 0) return fail_errno("mkdir " + dst, errno);
      if (opaque && ::lsetxattr(dst.c_str(), kOpaqueXattr, "y", 1, 0) != 0)
        return fail_errno("mark " + dst + " opaque (setxattr " + kOpaqueXattr + "; needs root)", errno);
      if (Status s = merge_into(src, dst, entries); !s) return s;
      if (Status s = copy_dir_metadata(dst, st); !s) return s;
      continue;
    }
    if (exists) {
      Status removed = S_ISDIR(have.st_mode) ? remove_path(dst)
                       : ::unlink(dst.c_str()) == 0 ? Status()
                                                    : Status(fail_errno("unlink " + dst, errno));
      if (!removed) return removed;
    }
    // The layer's own inode (never followed, a symlink included): no bytes copied, its metadata as it is.
    if (::linkat(AT_FDCWD, src.c_str(), AT_FDCWD, dst.c_str(), 0) != 0) return fail_errno("link " + src, errno);
  }
  return {};
}

}  // namespace

Result<std::string> squash_layers(ImageStore& images, const std::vector<std::string>& layers, std::string_view label) {
  auto dir = images.layers().make_temp_dir("squash-");
  if (!dir) return dir.failure();
  RemovedOnExit cleanup{*dir};  // the scratch tree's links only: the layers' inodes stay
  const std::string tree = *dir + "/tree", blob = *dir + "/layer.tar";
  if (::mkdir(tree.c_str(), 0755) != 0) return fail_errno("mkdir " + tree, errno);
  uint64_t entries = 0;
  for (const std::string& layer : layers)
    if (Status s = merge_into(images.layers().tree_path(layer), tree, entries); !s)
      return fail(s.error(), std::string(label) + ": layer " + layer + ": " + s.message());
  // The trees hold image ids already: no shift.
  LayerSource source{LayerSource::Kind::kOverlayUpper, tree, "", IdShift{0, UINT32_MAX}, kMaxLayerEntries, nullptr};
  auto written = write_layer(source, blob);
  if (!written) return fail(written.error(), std::string(label) + ": " + written.message());
  if (written->entries == 0) return std::string();
  return images.add_pinned_layer(blob, written->digest, label);
}

}  // namespace sg::snapshot
