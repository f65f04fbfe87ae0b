#include "snapshot/layer_writer.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "snapshot/layer_store.h"
#include "snapshot/tar_reader.h"

namespace sg::snapshot {
namespace {

constexpr std::string_view kWhiteoutPrefix = ".wh.";
constexpr std::string_view kOpaqueMarker = ".wh..wh..opq";
constexpr size_t kCopyBlock = 64 * 1024;

// What went wrong writing the layer's tar: libarchive says only "Write error" when the disk is full, and
// keeps the reason in its errno (a write to our own file, so the errno is the system's).
std::string write_message(archive* a) {
  std::string out = TarReader::message(a);
  const int err = archive_errno(a);
  if (err > 0 && out.find(std::strerror(err)) == std::string::npos) out += std::string(": ") + std::strerror(err);
  return out;
}

struct ArchiveWriteFree {
  void operator()(archive* a) const { archive_write_free(a); }
};
struct EntryFree {
  void operator()(archive_entry* e) const { archive_entry_free(e); }
};
using Entry = std::unique_ptr<archive_entry, EntryFree>;

class Writer {
 public:
  Writer(const LayerSource& source, archive* out) : source_(source), out_(out) {}

  // `host` is the file on the host, `rel` its path in the image ("" for the upper dir's root, never written).
  Status walk(const std::string& host, const std::string& rel) {
    const DeltaPlan* delta = source_.delta;
    // Every parent of a planned entry is planned too, so nothing below an unplanned path is.
    if (delta != nullptr && !rel.empty() && delta->entries.count(rel) == 0) return {};
    struct stat st{};
    if (::lstat(host.c_str(), &st) != 0) return fail_errno("lstat " + host, errno);
    if (delta != nullptr && S_ISSOCK(st.st_mode)) return {};
    if (!rel.empty())
      if (auto s = emit(host, rel, st); !s) return s;
    if (!S_ISDIR(st.st_mode)) return {};
    bool opaque = delta != nullptr ? delta->opaque.count(rel) != 0
                                   : source_.kind == LayerSource::Kind::kOverlayUpper && is_opaque_dir(host);
    if (!rel.empty() && opaque)
      if (auto s = emit_marker(rel + "/" + std::string(kOpaqueMarker)); !s) return s;
    auto names = sorted_entries(host);
    if (!names) return names.failure();
    for (const std::string& name : *names)
      if (auto s = walk(host + "/" + name, rel.empty() ? name : rel + "/" + name); !s) return s;
    return {};
  }

  // A checkpoint's whiteouts (paths gone since the previous one), in the OCI form.
  Status emit_whiteouts() {
    if (source_.delta == nullptr) return {};
    for (const std::string& path : source_.delta->whiteouts) {
      size_t slash = path.rfind('/');
      std::string parent = slash == std::string::npos ? "" : path.substr(0, slash + 1);
      std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
      if (auto s = emit_marker(parent + std::string(kWhiteoutPrefix) + base); !s) return s;
    }
    return {};
  }

  uint64_t entries() const { return entries_; }

 private:
  Status count() {
    if (++entries_ > source_.max_entries)
      return fail(Error::kLimitExceeded, "the layer has more than " + std::to_string(source_.max_entries) +
                                             " entries (the layer entry limit)");
    return {};
  }

  Result<std::pair<uid_t, gid_t>> owner(const std::string& rel, const struct stat& st) const {
    if (source_.kind == LayerSource::Kind::kCopy) return std::make_pair(uid_t{0}, gid_t{0});
    const IdShift& s = source_.shift;
    auto in_range = [&](uint64_t id) { return id >= s.base && id < uint64_t{s.base} + s.count; };
    if (!in_range(st.st_uid) || !in_range(st.st_gid))
      return fail(Error::kInvalidArgument, "'/" + rel + "' is owned by host " + std::to_string(st.st_uid) + ":" +
                                               std::to_string(st.st_gid) + ", outside the build's id range " +
                                               std::to_string(s.base) + "+" + std::to_string(s.count));
    return std::make_pair(static_cast<uid_t>(st.st_uid - s.base), static_cast<gid_t>(st.st_gid - s.base));
  }

  Status write_header(archive_entry* e, const std::string& rel) {
    if (archive_write_header(out_, e) < ARCHIVE_WARN)
      return fail(Error::kIo, "tar entry '" + rel + "': " + write_message(out_));
    return {};
  }

  // An empty regular file owned by image root: the OCI form of a whiteout and of an opaque marker.
  Status emit_marker(const std::string& rel) {
    if (auto s = count(); !s) return s;
    Entry e(archive_entry_new());
    archive_entry_set_pathname(e.get(), rel.c_str());
    archive_entry_set_filetype(e.get(), AE_IFREG);
    archive_entry_set_perm(e.get(), 0);
    archive_entry_set_size(e.get(), 0);
    return write_header(e.get(), rel);
  }

  Status emit(const std::string& host, const std::string& rel, const struct stat& st) {
    if (source_.kind == LayerSource::Kind::kOverlayUpper && S_ISCHR(st.st_mode) && st.st_rdev == makedev(0, 0)) {
      size_t slash = rel.rfind('/');
      std::string parent = slash == std::string::npos ? "" : rel.substr(0, slash + 1);
      std::string base = slash == std::string::npos ? rel : rel.substr(slash + 1);
      return emit_marker(parent + std::string(kWhiteoutPrefix) + base);
    }
    if (auto s = count(); !s) return s;
    auto ids = owner(rel, st);
    if (!ids) return ids.failure();
    Entry e(archive_entry_new());
    archive_entry_copy_stat(e.get(), &st);
    archive_entry_set_pathname(e.get(), rel.c_str());
    archive_entry_set_uid(e.get(), ids->first);
    archive_entry_set_gid(e.get(), ids->second);
    archive_entry_set_uname(e.get(), nullptr);
    archive_entry_set_gname(e.get(), nullptr);
    if (S_ISLNK(st.st_mode)) {
      std::string target(static_cast<size_t>(st.st_size) + 1, '\0');
      ssize_t n = ::readlink(host.c_str(), target.data(), target.size());
      if (n < 0) return fail_errno("readlink " + host, errno);
      target.resize(static_cast<size_t>(n));
      archive_entry_set_symlink(e.get(), target.c_str());
      return write_header(e.get(), rel);
    }
    if (S_ISREG(st.st_mode) && st.st_nlink > 1) {
      auto key = std::make_pair(st.st_dev, st.st_ino);
      if (auto first = links_.find(key); first != links_.end()) {
        archive_entry_set_hardlink(e.get(), first->second.c_str());
        archive_entry_set_size(e.get(), 0);
        return write_header(e.get(), rel);
      }
      links_.emplace(key, rel);
    }
    if (S_ISDIR(st.st_mode) || S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) || S_ISFIFO(st.st_mode))
      return write_header(e.get(), rel);
    if (!S_ISREG(st.st_mode))
      return fail(Error::kInvalidArgument, "'/" + rel + "' is a socket, which a layer cannot hold");
    if (auto s = write_header(e.get(), rel); !s) return s;
    int raw = ::open(host.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (raw < 0) return fail_errno("open " + host, errno);
    UniqueFd fd(raw);
    std::vector<char> buf(kCopyBlock);
    for (;;) {
      ssize_t n = ::read(fd.get(), buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail_errno("read " + host, errno);
      if (n == 0) break;
      if (archive_write_data(out_, buf.data(), static_cast<size_t>(n)) < 0)
        return fail(Error::kIo, "tar entry '" + rel + "': " + write_message(out_));
    }
    return {};
  }

  const LayerSource& source_;
  archive* out_;
  uint64_t entries_ = 0;
  std::map<std::pair<dev_t, ino_t>, std::string> links_;
};

}  // namespace

Result<WrittenLayer> write_layer(const LayerSource& source, const std::string& out_path) {
  std::string dest;
  if (source.kind == LayerSource::Kind::kCopy) {
    auto rel = normalize_relative(std::string_view(source.dest).substr(source.dest.starts_with("/") ? 1 : 0), false);
    if (!rel) return fail(Error::kInvalidArgument, "copy destination '" + source.dest + "' contains '..'");
    dest = *rel;
    struct stat st{};
    if (::lstat(source.path.c_str(), &st) != 0) return fail_errno("copy source " + source.path, errno);
    // A file copied to "/dir/" keeps its name; a directory's contents go under the destination.
    if (!S_ISDIR(st.st_mode) && (dest.empty() || source.dest.ends_with("/"))) {
      std::string name = source.path.substr(source.path.rfind('/') + 1);
      dest = dest.empty() ? name : dest + "/" + name;
    }
  }
  int raw = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (raw < 0) return fail_errno("create " + out_path, errno);
  UniqueFd fd(raw);
  std::unique_ptr<archive, ArchiveWriteFree> out(archive_write_new());
  if (!out) return fail(Error::kInternal, "libarchive: out of memory");
  // pax: long names and large ids, as the store's reader (and every OCI tool) reads them.
  archive_write_set_format_pax_restricted(out.get());
  if (archive_write_open_fd(out.get(), fd.get()) != ARCHIVE_OK)
    return fail(Error::kIo, "open " + out_path + ": " + write_message(out.get()));
  Writer writer(source, out.get());
  if (auto s = writer.walk(source.path, dest); !s) return s.failure();
  if (auto s = writer.emit_whiteouts(); !s) return s.failure();
  if (archive_write_close(out.get()) != ARCHIVE_OK)
    return fail(Error::kIo, "write " + out_path + ": " + write_message(out.get()));
  WrittenLayer layer;
  layer.entries = writer.entries();
  if (layer.entries == 0) return layer;
  if (::fsync(fd.get()) != 0) return fail_errno("fsync " + out_path, errno);
  auto digest = sha256_file(out_path);
  if (!digest) return digest.failure();
  layer.digest = std::move(*digest);
  return layer;
}

}  // namespace sg::snapshot
