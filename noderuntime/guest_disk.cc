#include "noderuntime/guest_disk.h"

#include <fcntl.h>
#include <openssl/sha.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <vector>

#include "common/fd.h"
#include "common/hex.h"

namespace sg {
namespace {

namespace fs = std::filesystem;

std::mutex build_mu;  // one base build at a time, node-wide

std::string key_of(const std::vector<std::string>& trees) {
  std::string joined;
  for (const std::string& t : trees) joined += t + "\n";
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(joined.data()), joined.size(), md);
  return hex_encode(md);
}

// Runs argv[0] (a PATH name) with stdout and stderr to `log`; the log's tail is the error.
Status run_tool(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, argv[0].c_str(), &files, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  if (rc != 0) return fail(Error::kUnsupported, "cannot run " + argv[0] + ": " + std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {};
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string out = ss.str();
  if (out.size() > 400) out = out.substr(out.size() - 400);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return fail(Error::kIo, argv[0] + " failed: " + out);
}

uint64_t tree_bytes(const std::string& root) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::none, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    total += 4096;  // an inode and a directory entry, roughly
    if (it->is_regular_file(ec) && !it->is_symlink(ec)) total += it->file_size(ec);
  }
  return total;
}

// The merged tree of `trees` (bottom first) as ext4 in `base`, written to a temp file and renamed into place.
Status build_base(const std::vector<std::string>& trees, const std::string& base) {
  const std::string tmp = base + ".tmp", mnt = base + ".mnt", log = base + ".log";
  std::error_code ec;
  fs::remove(tmp, ec);
  std::string src = trees.front();
  bool mounted = false;
  if (trees.size() > 1) {
    // overlayfs lists the top layer first.
    std::string lower;
    for (auto t = trees.rbegin(); t != trees.rend(); ++t) lower += (lower.empty() ? "" : ":") + *t;
    const std::string options = "lowerdir=" + lower;
    if (options.size() >= 4096)
      return fail(Error::kLimitExceeded, "the image has too many layers for one overlayfs mount option (" +
                                             std::to_string(options.size()) + " bytes, 4095 at most)");
    ::umount2(mnt.c_str(), MNT_DETACH);  // left by a build a crash interrupted
    fs::create_directories(mnt, ec);
    // Only mkfs reads it: nothing of the image may act on the host (device nodes, setuid, binaries).
    if (::mount("overlay", mnt.c_str(), "overlay", MS_RDONLY | MS_NODEV | MS_NOSUID | MS_NOEXEC, options.c_str()) != 0)
      return fail_errno("mount the image's layers (overlay) on " + mnt, errno);
    mounted = true;
    src = mnt;
  }
  const uint64_t bytes = tree_bytes(src);
  const uint64_t size_mb = (bytes + bytes / 4 + kGuestDiskFreeBytes) >> 20;
  Status made = run_tool({"mkfs.ext4", "-q", "-F", "-L", "sandgate-root", "-d", src, tmp,
                          std::to_string(size_mb) + "M"},
                         log);
  if (mounted) {
    ::umount2(mnt.c_str(), MNT_DETACH);
    fs::remove(mnt, ec);
  }
  if (!made) return made;
  UniqueFd fd(::open(tmp.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid() || ::fsync(fd.get()) != 0 || ::fchmod(fd.get(), 0444) != 0) return fail_errno("fsync " + tmp, errno);
  if (::rename(tmp.c_str(), base.c_str()) != 0) return fail_errno("rename " + tmp, errno);
  fs::remove(log, ec);
  return {};
}

// <base>.trees: the trees the base was made of, one per line. Written before the base is renamed into place.
std::string trees_file(const std::string& base) { return base.substr(0, base.size() - 4) + ".trees"; }

Status write_trees_file(const std::vector<std::string>& trees, const std::string& base) {
  const std::string path = trees_file(base), tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const std::string& t : trees) out << t << "\n";
    out.flush();
    if (!out) return fail(Error::kIo, "write " + tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail_errno("rename " + tmp, errno);
  return {};
}

// <sandbox_dir>/disk.qcow2 on `backing` (of `format`), made under a temp name, unless it exists already.
Result<std::string> make_overlay_on(const std::string& backing, const char* format, const std::string& sandbox_dir) {
  const std::string disk = sandbox_dir + "/disk.qcow2";
  if (::access(disk.c_str(), F_OK) == 0) return disk;  // the sandbox's own: never recreated
  const std::string tmp = disk + ".tmp";
  if (Status s = run_tool({"qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", format, tmp},
                          sandbox_dir + "/disk.log");
      !s)
    return s.failure();
  if (::rename(tmp.c_str(), disk.c_str()) != 0) return fail_errno("rename " + tmp, errno);
  std::error_code ec;
  fs::remove(sandbox_dir + "/disk.log", ec);
  return disk;
}

Result<std::string> make_overlay(const std::vector<std::string>& trees, const std::string& dir,
                                 const std::string& sandbox_dir) {
  const std::string disk = sandbox_dir + "/disk.qcow2";
  if (::access(disk.c_str(), F_OK) == 0) return disk;  // the sandbox's own: never recreated
  if (trees.empty()) return fail(Error::kInvalidArgument, "the image has no layers");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fail(Error::kIo, "create " + dir + ": " + ec.message());
  const std::string base = dir + "/" + key_of(trees) + ".raw";
  {
    std::lock_guard lock(build_mu);
    if (::access(base.c_str(), F_OK) != 0) {
      if (Status s = write_trees_file(trees, base); !s) return s.failure();
      if (Status s = build_base(trees, base); !s) return fail(s.error(), "base disk " + base + ": " + s.message());
    }
  }
  return make_overlay_on(base, "raw", sandbox_dir);
}

// Copies [src, end) of `in` to the same offsets of `out` through a buffer, leaving all-zero pages as holes:
// for a source on another filesystem than its copy (a guest's RAM memfd), where copy_file_range gives EXDEV.
Status copy_through_buffer(int in, int out, off_t src, off_t end, const std::string& what) {
  constexpr size_t kChunk = size_t{1} << 20, kPage = 4096;
  static const char zeros[kPage] = {};
  std::vector<char> buf(kChunk);
  while (src < end) {
    ssize_t n = ::pread(in, buf.data(), std::min<off_t>(kChunk, end - src), src);
    if (n < 0) return fail_errno("read " + what, errno);
    if (n == 0) break;  // the file shrank under us: what is there is copied
    // Runs of non-zero pages are written whole; zero pages are skipped.
    for (ssize_t at = 0; at < n;) {
      auto page_len = [&](ssize_t i) { return static_cast<size_t>(std::min<ssize_t>(kPage, n - i)); };
      if (std::memcmp(buf.data() + at, zeros, page_len(at)) == 0) {
        at += static_cast<ssize_t>(page_len(at));
        continue;
      }
      ssize_t run = at;
      while (run < n && std::memcmp(buf.data() + run, zeros, page_len(run)) != 0) run += static_cast<ssize_t>(page_len(run));
      for (ssize_t w = at; w < run;) {
        ssize_t k = ::pwrite(out, buf.data() + w, static_cast<size_t>(run - w), src + w);
        if (k < 0) return fail_errno("write the copy of " + what, errno);
        w += k;
      }
      at = run;
    }
    src += n;
  }
  return {};
}

// Data extents only (SEEK_DATA/SEEK_HOLE), each with copy_file_range, which shares the blocks on a
// filesystem that can (XFS, btrfs) and copies in the kernel elsewhere.
Result<std::string> sparse_copy(const std::string& from, const std::string& to) {
  UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in.valid()) return fail_errno("open " + from, errno);
  struct stat st{};
  if (::fstat(in.get(), &st) != 0) return fail_errno("stat " + from, errno);
  UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!out.valid()) return fail_errno("open " + to, errno);
  if (::ftruncate(out.get(), st.st_size) != 0) return fail_errno("truncate " + to, errno);
  off_t at = 0;
  while (at < st.st_size) {
    off_t data = ::lseek(in.get(), at, SEEK_DATA);
    if (data < 0) {
      if (errno == ENXIO) break;  // only a hole is left
      return fail_errno("seek " + from, errno);
    }
    off_t hole = ::lseek(in.get(), data, SEEK_HOLE);
    if (hole < 0) return fail_errno("seek " + from, errno);
    off_t src = data, dst = data;
    while (src < hole) {
      ssize_t n = ::copy_file_range(in.get(), &src, out.get(), &dst, static_cast<size_t>(hole - src), 0);
      if (n < 0 && (errno == EXDEV || errno == EOPNOTSUPP || errno == EINVAL)) {
        if (Status s = copy_through_buffer(in.get(), out.get(), src, hole, from); !s) return s.failure();
        break;
      }
      if (n < 0) return fail_errno("copy " + from + " to " + to, errno);
      if (n == 0) break;  // the file shrank under us: what is there is copied
    }
    at = hole;
  }
  return to;  // not synced here: see GuestDisks::copy
}

}  // namespace

void remove_orphaned_guest_disks(const std::string& dir) {
  std::lock_guard lock(build_mu);
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string path = it->path().string();
    if (it->path().extension() != ".trees") continue;
    const std::string base = path.substr(0, path.size() - 6) + ".raw";
    bool whole = ::access(base.c_str(), F_OK) == 0;  // a .trees whose build never finished goes too
    std::ifstream in(path);
    for (std::string tree; whole && std::getline(in, tree);) whole = ::access(tree.c_str(), F_OK) == 0;
    if (whole) continue;
    std::error_code ignored;
    fs::remove(base, ignored);
    fs::remove(path, ignored);
  }
}

namespace {

struct Work {
  uv_work_t req;
  std::function<Result<std::string>()> job;
  std::optional<Result<std::string>> result;
  std::shared_ptr<bool> alive;
  GuestDisks::Done done;
};

}  // namespace

GuestDisks::GuestDisks(uv_loop_t* loop, std::string dir)
    : loop_(loop), dir_(std::move(dir)), alive_(std::make_shared<bool>(true)) {}

GuestDisks::~GuestDisks() { *alive_ = false; }

void GuestDisks::overlay(std::vector<std::string> trees, std::string sandbox_dir, Done done) {
  submit([trees = std::move(trees), dir = dir_, sandbox_dir = std::move(sandbox_dir)] {
    return make_overlay(trees, dir, sandbox_dir);
  }, std::move(done));
}

void GuestDisks::overlay_on(std::string backing, std::string sandbox_dir, Done done) {
  submit([backing = std::move(backing), sandbox_dir = std::move(sandbox_dir)] {
    return make_overlay_on(backing, "qcow2", sandbox_dir);
  }, std::move(done));
}

void GuestDisks::copy(std::string from, std::string to, Done done) {
  submit([from = std::move(from), to = std::move(to)] { return sparse_copy(from, to); }, std::move(done));
}

void GuestDisks::delta_target(std::string backing, std::string format, uint64_t virtual_size, std::string to,
                              Done done) {
  submit([backing = std::move(backing), format = std::move(format), virtual_size, to = std::move(to)]()
             -> Result<std::string> {
    // -u: the backing file is the header's word only (it may be a snapshot's disk still to be renamed in).
    if (Status s = run_tool({"qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", format, "-u", to,
                             std::to_string(virtual_size)},
                            to + ".log");
        !s)
      return s.failure();
    std::error_code ec;
    fs::remove(to + ".log", ec);
    return to;
  }, std::move(done));
}

void GuestDisks::submit(std::function<Result<std::string>()> job, Done done) {
  auto* w = new Work{};
  w->req.data = w;
  w->job = std::move(job);
  w->alive = alive_;
  w->done = std::move(done);
  int rc = uv_queue_work(
      loop_, &w->req,
      [](uv_work_t* r) {
        auto* x = static_cast<Work*>(r->data);
        x->result.emplace(x->job());
      },
      [](uv_work_t* r, int status) {
        std::unique_ptr<Work> x(static_cast<Work*>(r->data));
        if (!*x->alive) return;
        if (status < 0 || !x->result) return x->done(fail(Error::kInternal, "disk job cancelled"));
        x->done(std::move(*x->result));
      });
  if (rc < 0) {
    std::unique_ptr<Work> owned(w);
    owned->done(fail(Error::kInternal, std::string("uv_queue_work: ") + uv_strerror(rc)));
  }
}

}  // namespace sg
