#include "snapshot/layer_store.h"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <filesystem>
#include <memory>
#include <optional>
#include <utility>

#include "common/fd.h"
#include "common/hex.h"
#include "snapshot/tar_reader.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kSha256Prefix = "sha256:";
constexpr std::string_view kWhiteoutPrefix = ".wh.";
constexpr std::string_view kOpaqueMarker = ".wh..wh..opq";
constexpr size_t kCopyBlock = 64 * 1024;

std::string_view hex_of(std::string_view digest) { return digest.substr(kSha256Prefix.size()); }

struct ArchiveWriteFree {
  void operator()(archive* a) const { archive_write_free(a); }
};
using WriteArchive = std::unique_ptr<archive, ArchiveWriteFree>;

std::string archive_message(archive* a) { return TarReader::message(a); }

// A layer entry's path: "./a//b/" -> "a/b"; any ".." is refused (it could land outside the layer once a
// symlink is involved), so is an absolute path.
std::optional<std::string> clean_relative(std::string_view path) { return normalize_relative(path, false); }

// Opens the directory `rel` under `root_fd` one component at a time with O_NOFOLLOW, so a symlink that an
// earlier entry of the layer planted (say "etc -> /etc") can never redirect a whiteout out of the layer.
// `create`: make missing components (mode 0755), as tar does for an entry whose parent was not listed.
Result<UniqueFd> open_dir_beneath(int root_fd, std::string_view rel, bool create) {
  UniqueFd cur(::dup(root_fd));
  if (!cur.valid()) return fail_errno("dup", errno);
  size_t i = 0;
  while (i < rel.size()) {
    size_t j = rel.find('/', i);
    if (j == std::string_view::npos) j = rel.size();
    std::string part(rel.substr(i, j - i));
    i = j + 1;
    int fd = ::openat(cur.get(), part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && create) {
      if (::mkdirat(cur.get(), part.c_str(), 0755) != 0 && errno != EEXIST) return fail_errno("mkdir " + part, errno);
      fd = ::openat(cur.get(), part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
      if (errno == ELOOP || errno == ENOTDIR)
        return fail(Error::kInvalidArgument, "'" + std::string(rel) + "' passes through a symlink or a non-directory");
      return fail_errno("open " + std::string(rel), errno);
    }
    cur.reset(fd);
  }
  return cur;
}

std::pair<std::string, std::string> split_parent(const std::string& rel) {
  size_t slash = rel.rfind('/');
  if (slash == std::string::npos) return {"", rel};
  return {rel.substr(0, slash), rel.substr(slash + 1)};
}

// Removes whatever is at `name` in `dir_fd` (a file, or a directory tree the same layer created earlier).
Status remove_beneath(int dir_fd, const std::string& name) {
  if (::unlinkat(dir_fd, name.c_str(), 0) == 0 || errno == ENOENT) return {};
  if (errno != EISDIR && errno != EPERM) return fail_errno("unlink " + name, errno);
  int fd = ::openat(dir_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return fail_errno("open " + name, errno);
  UniqueFd sub(fd);
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", sub.get());
  std::error_code ec;
  fs::path real = fs::read_symlink(path, ec);
  if (ec) return fail(Error::kIo, "resolve " + name + ": " + ec.message());
  fs::remove_all(real, ec);
  if (ec) return fail(Error::kIo, "remove " + real.string() + ": " + ec.message());
  return {};
}

// Drops the entry's trusted.* extended attributes: trusted.overlay.* would steer overlayfs itself (redirects,
// opaque dirs, metacopy), which only the store may decide. Other xattrs (security.capability) are kept.
void drop_trusted_xattrs(archive_entry* e) {
  struct Attr {
    std::string name;
    std::string value;
  };
  std::vector<Attr> keep;
  bool dropped = false;
  archive_entry_xattr_reset(e);
  const char* name = nullptr;
  const void* value = nullptr;
  size_t size = 0;
  while (archive_entry_xattr_next(e, &name, &value, &size) == ARCHIVE_OK) {
    if (std::string_view(name).starts_with("trusted.")) {
      dropped = true;
      continue;
    }
    keep.push_back({name, std::string(static_cast<const char*>(value), size)});
  }
  if (!dropped) return;
  archive_entry_xattr_clear(e);
  for (const Attr& a : keep) archive_entry_xattr_add_entry(e, a.name.c_str(), a.value.data(), a.value.size());
}

}  // namespace

bool is_opaque_dir(const std::string& dir) {
  char value[2] = {};
  return ::lgetxattr(dir.c_str(), "trusted.overlay.opaque", value, sizeof value) == 1 && value[0] == 'y';
}

Result<std::vector<std::string>> sorted_entries(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return fail_errno("opendir " + dir, errno);
  std::vector<std::string> out;
  while (dirent* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n != "." && n != "..") out.emplace_back(n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

RemovedOnExit::~RemovedOnExit() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

bool valid_digest(std::string_view digest) {
  if (!digest.starts_with(kSha256Prefix) || digest.size() != kSha256Prefix.size() + 64) return false;
  return std::all_of(digest.begin() + kSha256Prefix.size(), digest.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

Result<std::string> sha256_file(const std::string& path) {
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) return fail_errno("open " + path, errno);
  UniqueFd fd(raw);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1)
    return fail(Error::kInternal, "cannot start a SHA-256 digest");
  std::vector<unsigned char> buf(kCopyBlock);
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail_errno("read " + path, errno);
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), md, &len);
  std::string out(kSha256Prefix);
  hex_append(std::span(md, len), out);
  return out;
}

Status fsync_dir(const std::string& path) {
  int raw = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (raw < 0) return fail_errno("open " + path, errno);
  UniqueFd fd(raw);
  if (::fsync(fd.get()) != 0) return fail_errno("fsync " + path, errno);
  return {};
}

Status write_file_atomic(const std::string& path, std::string_view data) {
  fs::path target(path);
  std::string tmp = (target.parent_path() / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
  int raw = ::mkstemp(tmp.data());
  if (raw < 0) return fail_errno("create " + tmp, errno);
  UniqueFd fd(raw);
  auto cleanup = [&](Failure f) -> Status {
    ::unlink(tmp.c_str());
    return f;
  };
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd.get(), data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return cleanup(fail_errno("write " + tmp, errno));
    done += static_cast<size_t>(n);
  }
  if (::fchmod(fd.get(), 0644) != 0) return cleanup(fail_errno("chmod " + tmp, errno));
  if (::fsync(fd.get()) != 0) return cleanup(fail_errno("fsync " + tmp, errno));
  fd.reset();
  if (::rename(tmp.c_str(), path.c_str()) != 0) return cleanup(fail_errno("rename " + tmp, errno));
  return fsync_dir(target.parent_path().string());
}

Result<LayerStore> LayerStore::open(const std::string& root) {
  std::error_code ec;
  fs::create_directories(fs::path(root) / "sha256", ec);
  if (!ec) fs::create_directories(fs::path(root) / "tmp", ec);
  if (ec) return fail(Error::kIo, "create the layer store " + root + ": " + ec.message());
  char real[PATH_MAX];
  if (::realpath(root.c_str(), real) == nullptr) return fail_errno("realpath " + root, errno);
  LayerStore store{std::string(real)};
  // Whatever is in tmp/ is an interrupted import or removal: never complete, never referenced.
  for (const auto& entry : fs::directory_iterator(fs::path(store.root_) / "tmp", ec)) {
    std::error_code rm;
    fs::remove_all(entry.path(), rm);
    if (rm) return fail(Error::kIo, "remove leftover " + entry.path().string() + ": " + rm.message());
  }
  if (ec) return fail(Error::kIo, "read " + store.root_ + "/tmp: " + ec.message());
  return store;
}

Result<std::string> LayerStore::make_temp_dir(std::string_view prefix) const {
  std::string tmpl = root_ + "/tmp/" + std::string(prefix) + "XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) return fail_errno("mkdtemp " + tmpl, errno);
  return tmpl;
}

std::string LayerStore::layer_dir(std::string_view digest) const {
  return root_ + "/sha256/" + std::string(hex_of(digest));
}

std::string LayerStore::tree_path(std::string_view digest) const { return layer_dir(digest) + "/tree"; }

bool LayerStore::contains(std::string_view digest) const {
  if (!valid_digest(digest)) return false;
  struct stat st{};
  return ::stat(layer_dir(digest).c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

Status LayerStore::verify(std::string_view digest) const {
  if (!contains(digest)) return fail(Error::kNotFound, "layer " + std::string(digest) + " is not in the store");
  auto got = sha256_file(layer_dir(digest) + "/blob");
  if (!got) return got.failure();
  if (*got != digest)
    return fail(Error::kInvalidArgument, "layer " + std::string(digest) + " is corrupted: its blob hashes to " + *got);
  return {};
}

Result<std::string> LayerStore::add(const std::string& blob_path, std::string_view expected_digest,
                                    std::string_view label) {
  if (!valid_digest(expected_digest))
    return fail(Error::kInvalidArgument, std::string(label) + ": '" + std::string(expected_digest) +
                                             "' is not a sha256 digest (sha256:<64 hex digits>)");
  std::string digest(expected_digest);
  // Verified before anything else looks at the bytes, including when the store already has the layer: a
  // corrupted archive is refused, whatever the store holds.
  auto got = sha256_file(blob_path);
  if (!got) return fail(got.error(), std::string(label) + ": " + got.message());
  if (*got != digest)
    return fail(Error::kInvalidArgument, std::string(label) + ": digest mismatch: expected " + digest +
                                             ", the content is " + *got + " (corrupted or altered archive)");
  if (contains(digest)) return digest;

  auto tmp = make_temp_dir("layer-");
  if (!tmp) return tmp.failure();
  auto abandon = [&](Failure f) -> Result<std::string> {
    std::error_code ec;
    fs::remove_all(*tmp, ec);
    return f;
  };
  std::string blob = *tmp + "/blob";
  if (::rename(blob_path.c_str(), blob.c_str()) != 0) return abandon(fail_errno("move " + blob_path, errno));
  if (auto s = unpack(blob, *tmp + "/tree", label); !s) return abandon(s.failure());
  // One syncfs covers every file and directory of the new layer, cheaper than an fsync per file.
  {
    int raw = ::open(tmp->c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (raw < 0) return abandon(fail_errno("open " + *tmp, errno));
    UniqueFd fd(raw);
    if (::syncfs(fd.get()) != 0) return abandon(fail_errno("syncfs " + *tmp, errno));
  }
  if (::rename(tmp->c_str(), layer_dir(digest).c_str()) != 0) {
    // Another import finished the same layer first: theirs is as good as ours.
    if ((errno == EEXIST || errno == ENOTEMPTY) && contains(digest)) {
      std::error_code ec;
      fs::remove_all(*tmp, ec);
      return digest;
    }
    return abandon(fail_errno("rename " + *tmp + " into the store", errno));
  }
  if (auto s = fsync_dir(root_ + "/sha256"); !s) return s.failure();
  return digest;
}

Status LayerStore::unpack(const std::string& blob, const std::string& tree, std::string_view label) const {
  if (::mkdir(tree.c_str(), 0755) != 0) return fail_errno("mkdir " + tree, errno);
  int raw = ::open(tree.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (raw < 0) return fail_errno("open " + tree, errno);
  UniqueFd tree_fd(raw);

  std::string where(label);
  auto reader = TarReader::open(blob, where, kMaxLayerEntries);
  if (!reader) return reader.failure();
  archive* in = reader->get();
  WriteArchive out(archive_write_disk_new());
  if (!out) return fail(Error::kInternal, "libarchive: out of memory");
  // OWNER/PERM: a root filesystem keeps its owners and setuid bits. SECURE_SYMLINKS: no entry is written
  // through a symlink an earlier entry created; NODOTDOT is checked here too (clean_relative) for a clearer error.
  archive_write_disk_set_options(out.get(), ARCHIVE_EXTRACT_OWNER | ARCHIVE_EXTRACT_PERM | ARCHIVE_EXTRACT_TIME |
                                                ARCHIVE_EXTRACT_XATTR | ARCHIVE_EXTRACT_SECURE_SYMLINKS |
                                                ARCHIVE_EXTRACT_SECURE_NODOTDOT);
  for (;;) {
    auto next = reader->next();
    if (!next) return next.failure();
    archive_entry* e = *next;
    if (e == nullptr) break;
    const char* name = archive_entry_pathname(e);
    std::string shown = name != nullptr ? name : "";
    auto rel = clean_relative(shown);
    if (!rel)
      return fail(Error::kInvalidArgument,
                  where + ": entry '" + shown + "' is an absolute path or contains '..' (refused: it could write outside the layer)");
    if (rel->empty()) continue;  // "./": the layer root, which exists
    auto [parent, base] = split_parent(*rel);

    // OCI whiteouts, converted to what overlayfs reads (see layer_store.h).
    if (base == kOpaqueMarker) {
      auto dir = open_dir_beneath(tree_fd.get(), parent, true);
      if (!dir) return fail(dir.error(), where + ": opaque marker '" + shown + "': " + dir.message());
      if (::fsetxattr(dir->get(), "trusted.overlay.opaque", "y", 1, 0) != 0)
        return fail_errno(where + ": mark '" + parent + "' opaque (setxattr trusted.overlay.opaque; needs root)", errno);
      continue;
    }
    if (std::string_view(base).starts_with(kWhiteoutPrefix)) {
      std::string victim = base.substr(kWhiteoutPrefix.size());
      if (victim.empty() || victim == "." || victim == "..")
        return fail(Error::kInvalidArgument, where + ": whiteout '" + shown + "' names no entry");
      auto dir = open_dir_beneath(tree_fd.get(), parent, true);
      if (!dir) return fail(dir.error(), where + ": whiteout '" + shown + "': " + dir.message());
      if (auto s = remove_beneath(dir->get(), victim); !s) return fail(s.error(), where + ": " + s.message());
      if (::mknodat(dir->get(), victim.c_str(), S_IFCHR | 0000, makedev(0, 0)) != 0)
        return fail_errno(where + ": whiteout '" + shown + "' (mknod of the 0:0 device; needs root)", errno);
      continue;
    }

    if (const char* link = archive_entry_hardlink(e); link != nullptr) {
      auto target = clean_relative(link);
      if (!target || target->empty())
        return fail(Error::kInvalidArgument, where + ": entry '" + shown + "' is a hard link to '" + link +
                                                 "', outside the layer (refused)");
      // The link target's directories must be real directories of this layer, not symlinks out of it.
      auto dir = open_dir_beneath(tree_fd.get(), split_parent(*target).first, false);
      if (!dir) return fail(dir.error(), where + ": hard link '" + shown + "': " + dir.message());
      archive_entry_set_hardlink(e, (tree + "/" + *target).c_str());
    }
    drop_trusted_xattrs(e);
    archive_entry_set_pathname(e, (tree + "/" + *rel).c_str());
    if (auto s = check_free_space(static_cast<uint64_t>(std::max<la_int64_t>(archive_entry_size(e), 0)),
                                  where + ": entry '" + shown + "'");
        !s)
      return s;
    int r = archive_write_header(out.get(), e);
    if (r < ARCHIVE_WARN)
      return fail(Error::kInvalidArgument, where + ": entry '" + shown + "': " + archive_message(out.get()));
    if (archive_entry_size(e) > 0 && archive_entry_hardlink(e) == nullptr) {
      const void* buf = nullptr;
      size_t size = 0;
      la_int64_t offset = 0;
      for (;;) {
        r = archive_read_data_block(in, &buf, &size, &offset);
        if (r == ARCHIVE_EOF) break;
        if (r < ARCHIVE_WARN)
          return fail(Error::kInvalidArgument, where + ": entry '" + shown + "': " + archive_message(in));
        if (archive_write_data_block(out.get(), buf, size, offset) < ARCHIVE_WARN)
          return fail(Error::kIo, where + ": write '" + shown + "': " + archive_message(out.get()));
      }
    }
    if (archive_write_finish_entry(out.get()) < ARCHIVE_WARN)
      return fail(Error::kIo, where + ": finish '" + shown + "': " + archive_message(out.get()));
  }
  // Applies the directory modes and times that were deferred until their contents were written.
  if (archive_write_close(out.get()) != ARCHIVE_OK)
    return fail(Error::kIo, where + ": " + archive_message(out.get()));
  return {};
}

Status LayerStore::check_free_space(uint64_t bytes, std::string_view where) const {
  struct statvfs st {};
  if (::statvfs(root_.c_str(), &st) != 0) return fail_errno("statvfs " + root_, errno);
  const uint64_t available = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  if (available >= free_space_reserve_ && available - free_space_reserve_ >= bytes) return {};
  return fail(Error::kLimitExceeded, std::string(where) + ": writing " + std::to_string(bytes) + " more bytes would leave less than " +
                                         std::to_string(free_space_reserve_ >> 20) + " MiB free on the layer store's filesystem (" +
                                         std::to_string(available >> 20) + " MiB free; node.store_free_space_reserve_mb)");
}

Result<std::vector<std::string>> LayerStore::list() const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root_ + "/sha256", ec)) {
    std::string digest = std::string(kSha256Prefix) + entry.path().filename().string();
    if (valid_digest(digest)) out.push_back(std::move(digest));
  }
  if (ec) return fail(Error::kIo, "read " + root_ + "/sha256: " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

Status LayerStore::remove(std::string_view digest) {
  if (!contains(digest)) return fail(Error::kNotFound, "layer " + std::string(digest) + " is not in the store");
  auto tmp = make_temp_dir("rm-");
  if (!tmp) return tmp.failure();
  // Out of sha256/ in one step: a crash halfway through the delete leaves only tmp/ debris.
  if (::rename(layer_dir(digest).c_str(), (*tmp + "/layer").c_str()) != 0)
    return fail_errno("move " + layer_dir(digest) + " out of the store", errno);
  if (auto s = fsync_dir(root_ + "/sha256"); !s) return s;
  std::error_code ec;
  fs::remove_all(*tmp, ec);
  if (ec) return fail(Error::kIo, "remove " + *tmp + ": " + ec.message());
  return {};
}

}  // namespace sg::snapshot
