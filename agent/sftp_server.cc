#include "agent/sftp_server.h"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iterator>
#include <limits>
#include <optional>
#include <vector>

namespace sg::agent {
namespace {

// draft-ietf-secsh-filexfer-02 (version 3, what OpenSSH speaks) and OpenSSH's PROTOCOL.sftp.
enum : uint8_t {
  kInit = 1,
  kVersion = 2,
  kOpen = 3,
  kClose = 4,
  kRead = 5,
  kWrite = 6,
  kLstat = 7,
  kFstat = 8,
  kSetstat = 9,
  kFsetstat = 10,
  kOpendir = 11,
  kReaddir = 12,
  kRemove = 13,
  kMkdir = 14,
  kRmdir = 15,
  kRealpath = 16,
  kStat = 17,
  kRename = 18,
  kReadlink = 19,
  kSymlink = 20,
  kStatus = 101,
  kHandle = 102,
  kData = 103,
  kName = 104,
  kAttrs = 105,
  kExtended = 200,
  kExtendedReply = 201,
};

enum StatusCode : uint32_t {
  kOk = 0,
  kEof = 1,
  kNoSuchFile = 2,
  kPermissionDenied = 3,
  kFailure = 4,
  kBadMessage = 5,
  kOpUnsupported = 8,
};

constexpr uint32_t kAttrSize = 0x1, kAttrUidGid = 0x2, kAttrPermissions = 0x4, kAttrAcModTime = 0x8,
                   kAttrExtended = 0x80000000;
constexpr uint32_t kOpenRead = 0x1, kOpenWrite = 0x2, kOpenAppend = 0x4, kOpenCreate = 0x8, kOpenTruncate = 0x10,
                   kOpenExclusive = 0x20;

// Extensions offered in VERSION, with the version string OpenSSH's sftp-server gives each.
constexpr std::pair<const char*, const char*> kExtensions[] = {
    {"posix-rename@openssh.com", "1"}, {"statvfs@openssh.com", "2"}, {"fstatvfs@openssh.com", "2"},
    {"hardlink@openssh.com", "1"},     {"fsync@openssh.com", "1"},   {"lsetstat@openssh.com", "1"},
    {"limits@openssh.com", "1"},       {"expand-path@openssh.com", "1"},
};

// Bounds-checked reading of a request: a short or lying field makes ok() false, never a read past the end.
class Reader {
 public:
  explicit Reader(std::string_view d) : d_(d) {}
  uint8_t u8() { return need(1) ? static_cast<uint8_t>(d_[pos_++]) : 0; }
  uint32_t u32() {
    if (!need(4)) return 0;
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(d_[pos_++]);
    return v;
  }
  uint64_t u64() {
    uint64_t hi = u32();
    return (hi << 32) | u32();
  }
  std::string_view bytes() {
    uint32_t n = u32();
    if (!need(n)) return {};
    std::string_view s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  // A path or name: no NUL inside (it would cut the string the system call sees).
  std::string text() {
    std::string_view s = bytes();
    if (s.find('\0') != std::string_view::npos) ok_ = false;
    return std::string(s);
  }
  bool ok() const { return ok_; }

 private:
  bool need(size_t n) {
    if (!ok_ || d_.size() - pos_ < n) ok_ = false;
    return ok_;
  }
  std::string_view d_;
  size_t pos_ = 0;
  bool ok_ = true;
};

class Writer {
 public:
  Writer& u8(uint8_t v) {
    out_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out_.push_back(static_cast<char>((v >> s) & 0xff));
    return *this;
  }
  Writer& u64(uint64_t v) { return u32(static_cast<uint32_t>(v >> 32)).u32(static_cast<uint32_t>(v)); }
  Writer& str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.append(s);
    return *this;
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

struct Attrs {
  uint32_t flags = 0;
  uint64_t size = 0;
  uint32_t uid = 0, gid = 0, permissions = 0, atime = 0, mtime = 0;
};

Attrs read_attrs(Reader& r) {
  Attrs a;
  a.flags = r.u32();
  if (a.flags & kAttrSize) a.size = r.u64();
  if (a.flags & kAttrUidGid) {
    a.uid = r.u32();
    a.gid = r.u32();
  }
  if (a.flags & kAttrPermissions) a.permissions = r.u32();
  if (a.flags & kAttrAcModTime) {
    a.atime = r.u32();
    a.mtime = r.u32();
  }
  if (a.flags & kAttrExtended) {
    uint32_t count = r.u32();
    for (uint32_t i = 0; i < count && r.ok(); ++i) {  // each pair takes 8 bytes at least: bounded by the packet
      r.bytes();
      r.bytes();
    }
  }
  return a;
}

void put_attrs(Writer& w, const struct stat& st) {
  w.u32(kAttrSize | kAttrUidGid | kAttrPermissions | kAttrAcModTime)
      .u64(static_cast<uint64_t>(st.st_size))
      .u32(st.st_uid)
      .u32(st.st_gid)
      .u32(st.st_mode)
      .u32(static_cast<uint32_t>(st.st_atime))
      .u32(static_cast<uint32_t>(st.st_mtime));
}

uint32_t status_of(int err) {
  switch (err) {
    case 0:
      return kOk;
    case ENOENT:
    case ENOTDIR:
    case EBADF:
    case ELOOP:
      return kNoSuchFile;
    case EPERM:
    case EACCES:
    case EFAULT:
      return kPermissionDenied;
    case ENAMETOOLONG:
    case EINVAL:
      return kBadMessage;
    case ENOSYS:
    case EOPNOTSUPP:
      return kOpUnsupported;
    default:
      return kFailure;
  }
}

// `ls -l`'s line for READDIR's long name (the sftp client's `ls -l` prints it). Owners are numeric: the
// agent is static, and a static glibc cannot look names up through NSS.
std::string long_name(const std::string& name, const struct stat& st) {
  char mode[11] = "?---------";
  switch (st.st_mode & S_IFMT) {
    case S_IFREG: mode[0] = '-'; break;
    case S_IFDIR: mode[0] = 'd'; break;
    case S_IFLNK: mode[0] = 'l'; break;
    case S_IFCHR: mode[0] = 'c'; break;
    case S_IFBLK: mode[0] = 'b'; break;
    case S_IFIFO: mode[0] = 'p'; break;
    case S_IFSOCK: mode[0] = 's'; break;
  }
  const char* rwx = "rwxrwxrwx";
  for (int i = 0; i < 9; ++i)
    if (st.st_mode & (0400 >> i)) mode[1 + i] = rwx[i];
  if (st.st_mode & S_ISUID) mode[3] = (st.st_mode & S_IXUSR) ? 's' : 'S';
  if (st.st_mode & S_ISGID) mode[6] = (st.st_mode & S_IXGRP) ? 's' : 'S';
  if (st.st_mode & S_ISVTX) mode[9] = (st.st_mode & S_IXOTH) ? 't' : 'T';
  char when[32] = "";
  struct tm tm{};
  time_t mtime = st.st_mtime;
  if (::localtime_r(&mtime, &tm) != nullptr) {
    // Like ls: the time of day for the last six months, the year for anything older or in the future.
    time_t now = ::time(nullptr);
    bool recent = mtime <= now && now - mtime < 182 * 24 * 3600;
    std::strftime(when, sizeof when, recent ? "%b %e %H:%M" : "%b %e  %Y", &tm);
  }
  char line[128];
  std::snprintf(line, sizeof line, "%s %3lu %-8u %-8u %8llu %s ", mode, static_cast<unsigned long>(st.st_nlink),
                st.st_uid, st.st_gid, static_cast<unsigned long long>(st.st_size), when);
  return line + name;
}

// "~" is the session's home, which is where it started (the SSH server starts every session in root's
// home, or in / when there is none), as OpenSSH's sftp-server takes it; "~name" is that user's home from
// /etc/passwd, read with fgetpwent, since a static binary cannot look users up through NSS.
std::optional<std::string> home_of(const std::string& user) {
  if (user.empty()) {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof cwd) == nullptr) return std::nullopt;
    return std::string(cwd);
  }
  FILE* f = std::fopen("/etc/passwd", "re");
  if (f == nullptr) return std::nullopt;
  std::optional<std::string> home;
  while (passwd* pw = ::fgetpwent(f))
    if (user == pw->pw_name && pw->pw_dir != nullptr) {
      home = pw->pw_dir;
      break;
    }
  std::fclose(f);
  return home;
}

// realpath(3) that also answers for a path whose last component does not exist yet (the destination of an
// upload), as OpenSSH's sftp-server does.
std::optional<std::string> resolve(const std::string& path, int& err) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) != nullptr) return std::string(buf);
  err = errno;
  if (err != ENOENT) return std::nullopt;
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  size_t slash = p.rfind('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : p.substr(0, slash));
  std::string base = slash == std::string::npos ? p : p.substr(slash + 1);
  if (base.empty() || base == "." || base == ".." || ::realpath(dir.c_str(), buf) == nullptr) return std::nullopt;
  std::string out = buf;
  if (out.back() != '/') out += '/';
  return out + base;
}

}  // namespace

struct SftpSession::State {
  enum class Kind { kFree, kFile, kDir };
  struct Handle {
    Kind kind = Kind::kFree;
    int fd = -1;
    bool append = false;
    DIR* dir = nullptr;
  };

  SftpLimits limits;
  bool initialized = false;
  std::vector<Handle> handles;

  ~State() {
    for (Handle& h : handles) release(h);
  }

  static void release(Handle& h) {
    if (h.fd >= 0) ::close(h.fd);
    if (h.dir != nullptr) ::closedir(h.dir);
    h = Handle{};
  }

  // Handles go out as 4-byte slot numbers; anything else, or a closed slot, is no handle.
  Handle* find(std::string_view id, Kind kind) {
    if (id.size() != 4) return nullptr;
    uint32_t slot = 0;
    for (char c : id) slot = (slot << 8) | static_cast<uint8_t>(c);
    if (slot >= handles.size() || handles[slot].kind != kind) return nullptr;
    return &handles[slot];
  }
  std::optional<std::string> add(Handle h) {
    size_t slot = 0;
    while (slot < handles.size() && handles[slot].kind != Kind::kFree) ++slot;
    if (slot == limits.max_handles) return std::nullopt;
    if (slot == handles.size()) handles.emplace_back();
    handles[slot] = h;
    return Writer().u32(static_cast<uint32_t>(slot)).take();
  }

  static std::string status(uint32_t id, uint32_t code, std::string_view message = {}) {
    static const char* const kDefault[] = {"Success",           "End of file", "No such file", "Permission denied",
                                           "Failure",           "Bad message", "No connection", "Connection lost",
                                           "Operation unsupported"};
    if (message.empty() && code < std::size(kDefault)) message = kDefault[code];
    return Writer().u8(kStatus).u32(id).u32(code).str(message).str("").take();
  }
  static std::string errno_status(uint32_t id, int err) { return status(id, status_of(err), std::strerror(err)); }
  static std::string done(uint32_t id, int rc) { return rc == 0 ? status(id, kOk) : errno_status(id, errno); }
  static std::string one_name(uint32_t id, const std::string& name) {
    return Writer().u8(kName).u32(id).u32(1).str(name).str(name).u32(0).take();
  }
  static std::string attrs_reply(uint32_t id, int rc, const struct stat& st) {
    if (rc != 0) return errno_status(id, errno);
    Writer w;
    w.u8(kAttrs).u32(id);
    put_attrs(w, st);
    return w.take();
  }

  // Applies `a` in OpenSSH's order: size, permissions, times, owner. `fd` >= 0 works on the open file,
  // else on `path` (not following a last symlink when `nofollow`).
  static int apply(const Attrs& a, int fd, const std::string& path, bool nofollow) {
    if (a.flags & kAttrSize) {
      if (nofollow) {
        errno = EINVAL;  // a symlink has no size to set
        return -1;
      }
      if ((fd >= 0 ? ::ftruncate(fd, static_cast<off_t>(a.size)) : ::truncate(path.c_str(), static_cast<off_t>(a.size))) != 0)
        return -1;
    }
    int at_flags = nofollow ? AT_SYMLINK_NOFOLLOW : 0;
    if (a.flags & kAttrPermissions) {
      mode_t mode = a.permissions & 07777;
      if ((fd >= 0 ? ::fchmod(fd, mode) : ::fchmodat(AT_FDCWD, path.c_str(), mode, at_flags)) != 0) return -1;
    }
    if (a.flags & kAttrAcModTime) {
      timespec times[2] = {{static_cast<time_t>(a.atime), 0}, {static_cast<time_t>(a.mtime), 0}};
      if ((fd >= 0 ? ::futimens(fd, times) : ::utimensat(AT_FDCWD, path.c_str(), times, at_flags)) != 0) return -1;
    }
    if (a.flags & kAttrUidGid) {
      if ((fd >= 0 ? ::fchown(fd, a.uid, a.gid) : ::fchownat(AT_FDCWD, path.c_str(), a.uid, a.gid, at_flags)) != 0)
        return -1;
    }
    return 0;
  }

  std::string open(uint32_t id, Reader& r) {
    std::string path = r.text();
    uint32_t pflags = r.u32();
    Attrs a = read_attrs(r);
    if (!r.ok()) return status(id, kBadMessage);
    int flags = O_CLOEXEC | O_NOCTTY;
    if ((pflags & kOpenRead) && (pflags & kOpenWrite)) flags |= O_RDWR;
    else if (pflags & kOpenWrite) flags |= O_WRONLY;
    else flags |= O_RDONLY;
    if (pflags & kOpenAppend) flags |= O_APPEND;
    if (pflags & kOpenCreate) flags |= O_CREAT;
    if (pflags & kOpenTruncate) flags |= O_TRUNC;
    if (pflags & kOpenExclusive) flags |= O_EXCL;
    mode_t mode = (a.flags & kAttrPermissions) ? (a.permissions & 07777) : 0666;
    if (!has_free_slot()) return status(id, kFailure, "too many open handles");
    // O_NONBLOCK for the open only: a FIFO would otherwise block it, and with it the whole session, until a
    // partner came (reads and writes on it then fail with ESPIPE, as pread/pwrite on a pipe do).
    int fd = ::open(path.c_str(), flags | O_NONBLOCK, mode);
    if (fd < 0) return errno_status(id, errno);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return handle_reply(id, Handle{Kind::kFile, fd, (pflags & kOpenAppend) != 0, nullptr});
  }

  std::string opendir(uint32_t id, Reader& r) {
    std::string path = r.text();
    if (!r.ok()) return status(id, kBadMessage);
    if (!has_free_slot()) return status(id, kFailure, "too many open handles");
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return errno_status(id, errno);
    return handle_reply(id, Handle{Kind::kDir, -1, false, dir});
  }

  bool has_free_slot() const {
    for (const Handle& h : handles)
      if (h.kind == Kind::kFree) return true;
    return handles.size() < limits.max_handles;
  }
  std::string handle_reply(uint32_t id, Handle h) {
    std::optional<std::string> name = add(h);
    if (!name) {
      release(h);
      return status(id, kFailure, "too many open handles");
    }
    return Writer().u8(kHandle).u32(id).str(*name).take();
  }

  std::string read(uint32_t id, Reader& r) {
    Handle* h = find(r.bytes(), Kind::kFile);
    uint64_t offset = r.u64();
    size_t len = std::min<size_t>(r.u32(), limits.max_read);
    if (!r.ok()) return status(id, kBadMessage);
    if (h == nullptr) return status(id, kFailure, "no such handle");
    if (offset > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) return status(id, kEof);
    std::string data(len, '\0');
    ssize_t n;
    do n = ::pread(h->fd, data.data(), len, static_cast<off_t>(offset));
    while (n < 0 && errno == EINTR);
    if (n < 0) return errno_status(id, errno);
    if (n == 0 && len > 0) return status(id, kEof);
    data.resize(static_cast<size_t>(n));
    return Writer().u8(kData).u32(id).str(data).take();
  }

  std::string write(uint32_t id, Reader& r) {
    Handle* h = find(r.bytes(), Kind::kFile);
    uint64_t offset = r.u64();
    std::string_view data = r.bytes();
    if (!r.ok()) return status(id, kBadMessage);
    if (h == nullptr) return status(id, kFailure, "no such handle");
    if (offset > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) return errno_status(id, EINVAL);
    size_t done_bytes = 0;
    while (done_bytes < data.size()) {
      // An append handle writes at the end whatever the offset says, as O_APPEND's pwrite does on Linux.
      ssize_t n = h->append ? ::write(h->fd, data.data() + done_bytes, data.size() - done_bytes)
                            : ::pwrite(h->fd, data.data() + done_bytes, data.size() - done_bytes,
                                       static_cast<off_t>(offset + done_bytes));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return errno_status(id, n < 0 ? errno : EIO);
      done_bytes += static_cast<size_t>(n);
    }
    return status(id, kOk);
  }

  std::string readdir(uint32_t id, Reader& r) {
    Handle* h = find(r.bytes(), Kind::kDir);
    if (!r.ok()) return status(id, kBadMessage);
    if (h == nullptr) return status(id, kFailure, "no such handle");
    Writer entries;
    uint32_t count = 0;
    while (count < limits.names_per_readdir) {
      errno = 0;
      dirent* e = ::readdir(h->dir);
      if (e == nullptr) {
        if (errno != 0 && count == 0) return errno_status(id, errno);
        break;
      }
      struct stat st{};
      if (::fstatat(::dirfd(h->dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone meanwhile
      entries.str(e->d_name).str(long_name(e->d_name, st));
      put_attrs(entries, st);
      ++count;
    }
    if (count == 0) return status(id, kEof);
    Writer w;
    w.u8(kName).u32(id).u32(count);
    return w.take() + entries.take();
  }

  std::string fstat(uint32_t id, Reader& r) {
    std::string_view name = r.bytes();
    if (!r.ok()) return status(id, kBadMessage);
    int fd = -1;
    if (Handle* f = find(name, Kind::kFile)) fd = f->fd;
    else if (Handle* d = find(name, Kind::kDir)) fd = ::dirfd(d->dir);
    if (fd < 0) return status(id, kFailure, "no such handle");
    struct stat st{};
    return attrs_reply(id, ::fstat(fd, &st), st);
  }

  std::string close(uint32_t id, Reader& r) {
    std::string_view name = r.bytes();
    if (!r.ok()) return status(id, kBadMessage);
    Handle* h = find(name, Kind::kFile);
    if (h == nullptr) h = find(name, Kind::kDir);
    if (h == nullptr) return status(id, kFailure, "no such handle");
    // close(2)'s error is the last word on a file written over NFS or a full disk: pass it on.
    int rc = h->fd >= 0 ? ::close(h->fd) : ::closedir(h->dir);
    int err = errno;
    *h = Handle{};
    return rc == 0 ? status(id, kOk) : errno_status(id, err);
  }

  // SFTP v3's RENAME must not replace an existing target (posix-rename@openssh.com is the one that does).
  static int rename_no_replace(const std::string& from, const std::string& to) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return 0;
    if (errno != EINVAL && errno != ENOSYS) return -1;
    struct stat st{};
    if (::lstat(to.c_str(), &st) == 0) {  // a filesystem without RENAME_NOREPLACE: check, then rename
      errno = EEXIST;
      return -1;
    }
    return ::rename(from.c_str(), to.c_str());
  }

  static std::string statvfs_reply(uint32_t id, int rc, const struct statvfs& s) {
    if (rc != 0) return errno_status(id, errno);
    uint64_t flag = ((s.f_flag & ST_RDONLY) ? 1 : 0) | ((s.f_flag & ST_NOSUID) ? 2 : 0);
    return Writer()
        .u8(kExtendedReply)
        .u32(id)
        .u64(s.f_bsize)
        .u64(s.f_frsize)
        .u64(s.f_blocks)
        .u64(s.f_bfree)
        .u64(s.f_bavail)
        .u64(s.f_files)
        .u64(s.f_ffree)
        .u64(s.f_favail)
        .u64(s.f_fsid)
        .u64(flag)
        .u64(s.f_namemax)
        .take();
  }

  std::string extended(uint32_t id, Reader& r) {
    std::string name = r.text();
    if (!r.ok()) return status(id, kBadMessage);
    if (name == "posix-rename@openssh.com" || name == "hardlink@openssh.com") {
      std::string from = r.text(), to = r.text();
      if (!r.ok()) return status(id, kBadMessage);
      return done(id, name[0] == 'p' ? ::rename(from.c_str(), to.c_str()) : ::link(from.c_str(), to.c_str()));
    }
    if (name == "statvfs@openssh.com") {
      std::string path = r.text();
      if (!r.ok()) return status(id, kBadMessage);
      struct statvfs s{};
      return statvfs_reply(id, ::statvfs(path.c_str(), &s), s);
    }
    if (name == "fstatvfs@openssh.com" || name == "fsync@openssh.com") {
      Handle* h = find(r.bytes(), Kind::kFile);
      if (!r.ok()) return status(id, kBadMessage);
      if (h == nullptr) return status(id, kFailure, "no such handle");
      if (name == "fsync@openssh.com") return done(id, ::fsync(h->fd));
      struct statvfs s{};
      return statvfs_reply(id, ::fstatvfs(h->fd, &s), s);
    }
    if (name == "lsetstat@openssh.com") {
      std::string path = r.text();
      Attrs a = read_attrs(r);
      if (!r.ok()) return status(id, kBadMessage);
      return done(id, apply(a, -1, path, true));
    }
    if (name == "limits@openssh.com") {
      return Writer()
          .u8(kExtendedReply)
          .u32(id)
          .u64(limits.max_packet)
          .u64(limits.max_read)
          .u64(limits.max_packet - 1024)  // a WRITE's data plus its header fits in one packet
          .u64(limits.max_handles)
          .take();
    }
    if (name == "expand-path@openssh.com") {
      std::string path = r.text();
      if (!r.ok()) return status(id, kBadMessage);
      if (!path.empty() && path[0] == '~') {
        size_t slash = std::min(path.find('/'), path.size());
        std::optional<std::string> home = home_of(path.substr(1, slash - 1));
        if (!home) return status(id, kNoSuchFile, "no such user");
        path = *home + path.substr(slash);
      }
      return realpath(id, path);
    }
    return status(id, kOpUnsupported, "unsupported extension " + name);
  }

  std::string realpath(uint32_t id, std::string path) {
    if (path.empty()) path = ".";
    int err = 0;
    std::optional<std::string> resolved = resolve(path, err);
    if (!resolved) return errno_status(id, err);
    return one_name(id, *resolved);
  }

  std::string request(uint8_t type, uint32_t id, Reader& r) {
    switch (type) {
      case kOpen: return open(id, r);
      case kClose: return close(id, r);
      case kRead: return read(id, r);
      case kWrite: return write(id, r);
      case kFstat: return fstat(id, r);
      case kOpendir: return opendir(id, r);
      case kReaddir: return readdir(id, r);
      case kExtended: return extended(id, r);
      case kFsetstat: {
        Handle* h = find(r.bytes(), Kind::kFile);
        Attrs a = read_attrs(r);
        if (!r.ok()) return status(id, kBadMessage);
        if (h == nullptr) return status(id, kFailure, "no such handle");
        return done(id, apply(a, h->fd, {}, false));
      }
      default: break;
    }
    if (type < kLstat || type > kSymlink) return status(id, kOpUnsupported);
    // The rest name one path first.
    std::string path = r.text();
    if (!r.ok()) return status(id, kBadMessage);
    switch (type) {
      case kLstat:
      case kStat: {
        struct stat st{};
        return attrs_reply(id, type == kStat ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st), st);
      }
      case kSetstat: {
        Attrs a = read_attrs(r);
        if (!r.ok()) return status(id, kBadMessage);
        return done(id, apply(a, -1, path, false));
      }
      case kRemove: return done(id, ::unlink(path.c_str()));
      case kMkdir: {
        Attrs a = read_attrs(r);
        if (!r.ok()) return status(id, kBadMessage);
        return done(id, ::mkdir(path.c_str(), (a.flags & kAttrPermissions) ? (a.permissions & 07777) : 0777));
      }
      case kRmdir: return done(id, ::rmdir(path.c_str()));
      case kRealpath: return realpath(id, path);
      case kReadlink: {
        char target[PATH_MAX];
        ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
        if (n < 0) return errno_status(id, errno);
        return one_name(id, std::string(target, static_cast<size_t>(n)));
      }
      case kRename:
      case kSymlink: {
        std::string second = r.text();
        if (!r.ok()) return status(id, kBadMessage);
        // SYMLINK's fields come target first, link second: OpenSSH swapped them against the draft, and
        // every client follows OpenSSH.
        return done(id, type == kRename ? rename_no_replace(path, second) : ::symlink(path.c_str(), second.c_str()));
      }
      default: return status(id, kOpUnsupported);
    }
  }
};

SftpSession::SftpSession(SftpLimits limits) : state_(std::make_unique<State>()) { state_->limits = limits; }
SftpSession::~SftpSession() = default;

Result<std::string> SftpSession::handle(std::string_view packet) {
  Reader r(packet);
  uint8_t type = r.u8();
  if (!r.ok()) return fail(Error::kInvalidArgument, "an empty packet");
  if (type == kInit) {
    if (state_->initialized) return fail(Error::kInvalidArgument, "a second INIT");
    r.u32();  // the client's version: we answer 3 whatever it asks, as OpenSSH does
    if (!r.ok()) return fail(Error::kInvalidArgument, "INIT without a version");
    state_->initialized = true;
    Writer w;
    w.u8(kVersion).u32(3);
    for (auto [name, version] : kExtensions) w.str(name).str(version);
    return w.take();
  }
  if (!state_->initialized) return fail(Error::kInvalidArgument, "a request before INIT");
  uint32_t id = r.u32();
  if (!r.ok()) return fail(Error::kInvalidArgument, "a request without an id");
  return state_->request(type, id, r);
}

namespace {

// Fills `buf` completely from fd: true, or false at EOF or an error (`got` says how much came).
bool read_full(int fd, char* buf, size_t n, size_t& got) {
  got = 0;
  while (got < n) {
    ssize_t k = ::read(fd, buf + got, n - got);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    got += static_cast<size_t>(k);
  }
  return true;
}

bool write_full(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t k = ::write(fd, data.data() + off, data.size() - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    off += static_cast<size_t>(k);
  }
  return true;
}

}  // namespace

int serve_sftp(int in_fd, int out_fd, const SftpLimits& limits) {
  ::signal(SIGPIPE, SIG_IGN);  // a client gone mid-reply is a failed write, not a signal
  SftpSession session(limits);
  std::string body;
  for (;;) {
    unsigned char head[4];
    size_t got = 0;
    if (!read_full(in_fd, reinterpret_cast<char*>(head), 4, got)) {
      if (got == 0) return 0;  // the client closed between packets: the normal end
      std::fprintf(stderr, "sandgate-agent sftp: the stream ended inside a packet's length\n");
      return 1;
    }
    uint32_t len = (uint32_t{head[0]} << 24) | (uint32_t{head[1]} << 16) | (uint32_t{head[2]} << 8) | head[3];
    if (len == 0 || len > limits.max_packet) {
      std::fprintf(stderr, "sandgate-agent sftp: a packet of %u bytes (the limit is %zu)\n", len, limits.max_packet);
      return 1;
    }
    body.resize(len);
    if (!read_full(in_fd, body.data(), len, got)) {
      std::fprintf(stderr, "sandgate-agent sftp: the stream ended inside a packet\n");
      return 1;
    }
    Result<std::string> reply = session.handle(body);
    if (!reply.ok()) {
      std::fprintf(stderr, "sandgate-agent sftp: %s\n", reply.message().c_str());
      return 1;
    }
    std::string framed = Writer().u32(static_cast<uint32_t>(reply->size())).take() + *reply;
    if (!write_full(out_fd, framed)) return 1;
  }
}

}  // namespace sg::agent
