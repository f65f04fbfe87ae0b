#include "noderuntime/build_sandbox.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/fd.h"

namespace sg {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// After a kill at the deadline, how long the pipe may take to report its end (the kernel tears the PID
// namespace down) before the reader gives up on it.
constexpr int kDrainAfterKillMs = 5'000;

// Device nodes a build step gets in its /dev, bound from the host's.
constexpr const char* kDevices[] = {"null", "zero", "full", "random", "urandom", "tty"};

struct Pipe {
  UniqueFd read, write;
};
Result<Pipe> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return fail_errno("pipe2", errno);
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// Splits the child's output into lines for `on_line` and the tail; the pipe ends when every process holding
// it has exited. Past the deadline, `kill` runs once and the pipe gets kDrainAfterKillMs more.
class OutputPump {
 public:
  OutputPump(const OutputLimits& limits, const OutputLine& on_line) : limits_(limits), on_line_(on_line) {}

  Status pump(int fd, Clock::time_point deadline, const std::function<void()>& kill, bool& timed_out) {
    char buf[16 * 1024];
    for (;;) {
      auto now = Clock::now();
      if (!timed_out && now >= deadline) {
        timed_out = true;
        kill();
        deadline = now + std::chrono::milliseconds(kDrainAfterKillMs);
      } else if (timed_out && now >= deadline) {
        break;
      }
      int wait_ms = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1);
      pollfd p{fd, POLLIN, 0};
      int rc = ::poll(&p, 1, wait_ms);
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) return fail_errno("poll", errno);
      if (rc == 0) continue;
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail_errno("read the command's output", errno);
      if (n == 0) break;
      feed(std::string_view(buf, static_cast<size_t>(n)));
    }
    if (!partial_.empty()) emit();
    return {};
  }

  std::deque<std::string> take_tail() { return std::move(tail_); }

 private:
  void feed(std::string_view data) {
    for (char c : data) {
      if (c == '\n' || c == '\r') {
        if (!partial_.empty() || cut_) emit();
        continue;
      }
      if (partial_.size() < kMaxOutputLineBytes) partial_.push_back(c);
      else cut_ = true;
    }
  }
  void emit() {
    if (cut_) partial_ += " [line cut at " + std::to_string(kMaxOutputLineBytes) + " bytes]";
    if (on_line_) on_line_(partial_);
    tail_.push_back(std::move(partial_));
    if (tail_.size() > limits_.tail_lines) tail_.pop_front();
    partial_.clear();
    cut_ = false;
  }

  const OutputLimits& limits_;
  const OutputLine& on_line_;
  std::string partial_;
  bool cut_ = false;
  std::deque<std::string> tail_;
};

CommandOutcome finish(pid_t pid, OutputPump& pump, bool timed_out) {
  CommandOutcome out;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) out.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) out.signal = WTERMSIG(status);
  out.timed_out = timed_out;
  out.tail = pump.take_tail();
  return out;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (std::string& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// ---- in the child, between clone and execve: system calls only (the node is multi-threaded, so another
// thread may hold the allocator's lock at the moment of the clone) ----

void write_str(int fd, const char* s) {
  size_t len = std::strlen(s);
  while (len > 0) {
    ssize_t n = ::write(fd, s, len);
    if (n <= 0) return;
    s += n;
    len -= static_cast<size_t>(n);
  }
}

[[noreturn]] void child_fail(int err_fd, const char* what, const char* path) {
  int e = errno;
  char num[16];
  int i = sizeof num - 1;
  num[i] = '\0';
  do {
    num[--i] = static_cast<char>('0' + e % 10);
    e /= 10;
  } while (e > 0 && i > 0);
  write_str(err_fd, what);
  if (path != nullptr) {
    write_str(err_fd, " ");
    write_str(err_fd, path);
  }
  write_str(err_fd, ": errno ");
  write_str(err_fd, num + i);
  _exit(127);
}

// What the sandboxed child needs, all prepared before the clone.
struct Prepared {
  std::vector<std::string> trees, mounts;
  std::string step_dir, overlay_options, workdir;
  std::vector<std::string> argv, env;
  std::vector<std::string> dev_paths;  // root/dev/<name> for kDevices
  std::vector<std::string> dev_sources;
  int userns_fd = -1;
  int out_fd = -1;
  int err_fd = -1;
};

bool is_dir(const char* p) {
  struct stat st{};
  return ::lstat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

[[noreturn]] void sandbox_child(Prepared& p, char** argv, char** envp) {
  const int err = p.err_fd;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::chdir(p.step_dir.c_str()) != 0) child_fail(err, "chdir", p.step_dir.c_str());
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) child_fail(err, "make / private", nullptr);
  for (size_t i = 0; i < p.trees.size(); ++i) {
    int fd = static_cast<int>(::syscall(SYS_open_tree, AT_FDCWD, p.trees[i].c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
    if (fd < 0) child_fail(err, "open_tree", p.trees[i].c_str());
    mount_attr attr{};
    attr.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    attr.userns_fd = static_cast<uint64_t>(p.userns_fd);
    if (::syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0)
      child_fail(err, "idmap (mount_setattr)", p.trees[i].c_str());
    if (::syscall(SYS_move_mount, fd, "", AT_FDCWD, p.mounts[i].c_str(), MOVE_MOUNT_F_EMPTY_PATH) != 0)
      child_fail(err, "move_mount", p.mounts[i].c_str());
    ::close(fd);
  }
  if (::mount("overlay", "root", "overlay", 0, p.overlay_options.c_str()) != 0)
    child_fail(err, "mount the overlay", p.overlay_options.c_str());
  if (is_dir("root/proc") && ::mount("proc", "root/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
    child_fail(err, "mount", "/proc");
  if (is_dir("root/dev")) {
    if (::mount("tmpfs", "root/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=1024k") != 0)
      child_fail(err, "mount a tmpfs on", "/dev");
    for (size_t i = 0; i < p.dev_paths.size(); ++i) {
      int fd = ::open(p.dev_paths[i].c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
      if (fd < 0) child_fail(err, "create", p.dev_paths[i].c_str());
      ::close(fd);
      if (::mount(p.dev_sources[i].c_str(), p.dev_paths[i].c_str(), nullptr, MS_BIND, nullptr) != 0)
        child_fail(err, "bind", p.dev_sources[i].c_str());
    }
    if (::mkdir("root/dev/shm", 01777) != 0 ||
        ::mount("tmpfs", "root/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=65536k") != 0)
      child_fail(err, "mount", "/dev/shm");
    if (::mkdir("root/dev/pts", 0755) != 0 ||
        ::mount("devpts", "root/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") != 0)
      child_fail(err, "mount", "/dev/pts");
    if (::symlink("pts/ptmx", "root/dev/ptmx") != 0 || ::symlink("/proc/self/fd", "root/dev/fd") != 0 ||
        ::symlink("/proc/self/fd/0", "root/dev/stdin") != 0 || ::symlink("/proc/self/fd/1", "root/dev/stdout") != 0 ||
        ::symlink("/proc/self/fd/2", "root/dev/stderr") != 0)
      child_fail(err, "populate", "/dev");
  }
  struct stat st{};
  if (::lstat("root/etc/resolv.conf", &st) == 0 && S_ISREG(st.st_mode)) {
    if (::mount("/etc/resolv.conf", "root/etc/resolv.conf", nullptr, MS_BIND, nullptr) != 0 ||
        ::mount(nullptr, "root/etc/resolv.conf", nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY, nullptr) != 0)
      child_fail(err, "bind the host's", "/etc/resolv.conf");
  }
  if (::chdir("root") != 0) child_fail(err, "chdir", "root");
  if (::syscall(SYS_pivot_root, ".", ".") != 0) child_fail(err, "pivot_root", nullptr);
  if (::umount2(".", MNT_DETACH) != 0) child_fail(err, "detach the host's root", nullptr);
  if (::chdir("/") != 0) child_fail(err, "chdir", "/");
  if (::setns(p.userns_fd, CLONE_NEWUSER) != 0) child_fail(err, "enter the build's user namespace", nullptr);
  if (::setgroups(0, nullptr) != 0 || ::setresgid(0, 0, 0) != 0 || ::setresuid(0, 0, 0) != 0)
    child_fail(err, "become image root", nullptr);
  if (::chdir(p.workdir.c_str()) != 0) child_fail(err, "the working directory is missing in the image:", p.workdir.c_str());
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) devnull = ::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);  // an image without /dev
  if (devnull < 0 || ::dup2(devnull, 0) < 0 || ::dup2(p.out_fd, 1) < 0 || ::dup2(p.out_fd, 2) < 0)
    child_fail(err, "set up stdio", nullptr);
  ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);  // the step's commands get stdio, nothing of the node's
  ::execve("/bin/sh", argv, envp);
  child_fail(err, "the image has no usable /bin/sh: execve", "/bin/sh");
}

// /proc/PID/uid_map and gid_map: one write each, as the kernel wants them.
Status write_id_maps(const std::string& proc, const std::string& map) {
  for (const char* file : {"/uid_map", "/gid_map"}) {
    std::string path = proc + file;
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd.valid()) return fail_errno("open " + path, errno);
    if (::write(fd.get(), map.data(), map.size()) != static_cast<ssize_t>(map.size()))
      return fail_errno("write " + path + " (" + map.substr(0, map.size() - 1) + ")", errno);
  }
  return {};
}

// A user namespace mapping image ids 0..count-1 to host ids base..: a child clones into it and waits while
// its maps are written, then the namespace is kept by a descriptor and the child released.
Result<UniqueFd> make_user_namespace(const snapshot::IdShift& ids) {
  auto hold = make_pipe();
  if (!hold) return hold.failure();
  long pid = ::syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, nullptr, nullptr, nullptr, nullptr);
  if (pid < 0) return fail_errno("clone a user namespace", errno);
  if (pid == 0) {
    char c;
    ::close(hold->write.get());
    while (::read(hold->read.get(), &c, 1) < 0 && errno == EINTR) {
    }
    _exit(0);
  }
  hold->read.reset();
  std::string proc = "/proc/" + std::to_string(pid);
  std::string map = "0 " + std::to_string(ids.base) + " " + std::to_string(ids.count) + "\n";
  Status wrote = write_id_maps(proc, map);
  UniqueFd ns(wrote ? ::open((proc + "/ns/user").c_str(), O_RDONLY | O_CLOEXEC) : -1);
  int open_errno = errno;
  hold->write.reset();
  while (::waitpid(static_cast<pid_t>(pid), nullptr, 0) < 0 && errno == EINTR) {
  }
  if (!wrote) return wrote.failure();
  if (!ns.valid()) return fail_errno("open the build's user namespace", open_errno);
  return ns;
}

}  // namespace

Result<CommandOutcome> run_host_command(const std::vector<std::string>& argv_in, const std::vector<std::string>& env_in,
                                        Clock::time_point deadline, const OutputLimits& limits,
                                        const OutputLine& on_line) {
  if (argv_in.empty() || !argv_in[0].starts_with("/"))
    return fail(Error::kInternal, "run_host_command: argv[0] must be an absolute path");
  auto out = make_pipe();
  if (!out) return out.failure();
  auto err = make_pipe();
  if (!err) return err.failure();
  std::vector<std::string> argv_s = argv_in;
  std::vector<std::string> env_s = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root",
                                    "LANG=C.UTF-8"};
  env_s.insert(env_s.end(), env_in.begin(), env_in.end());
  std::vector<char*> argv = c_strings(argv_s), envp = c_strings(env_s);
  pid_t pid = ::fork();
  if (pid < 0) return fail_errno("fork", errno);
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::setpgid(0, 0);  // one group, killed as one at the deadline
    int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0 || ::dup2(devnull, 0) < 0 || ::dup2(out->write.get(), 1) < 0 || ::dup2(out->write.get(), 2) < 0)
      child_fail(err->write.get(), "set up stdio", nullptr);
    // Nothing the node inherited or opened goes along: mmdebstrap hands apt a descriptor by number, and dash
    // (its /bin/sh) cannot redirect to one above 9, so the tool must find the low numbers free.
    ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    ::execve(argv[0], argv.data(), envp.data());
    child_fail(err->write.get(), "execve", argv[0]);
  }
  out->write.reset();
  err->write.reset();
  auto setup = read_at_most(err->read.get(), 4096, "the command's setup");
  OutputPump pump(limits, on_line);
  bool timed_out = false;
  Status pumped = pump.pump(out->read.get(), deadline, [pid] { ::kill(-pid, SIGKILL); }, timed_out);
  CommandOutcome outcome = finish(pid, pump, timed_out);
  if (setup && !setup->empty()) return fail(Error::kIo, "cannot run " + argv_in[0] + ": " + *setup);
  if (!pumped) return pumped.failure();
  return outcome;
}

Result<CommandOutcome> run_in_sandbox(const SandboxStep& step, Clock::time_point deadline, const OutputLimits& limits,
                                      const OutputLine& on_line) {
  if (step.lower_trees.empty()) return fail(Error::kInternal, "run_in_sandbox: no layers");
  if (!step.workdir.starts_with("/"))
    return fail(Error::kInvalidArgument, "the working directory '" + step.workdir + "' is not absolute");
  Prepared p;
  p.step_dir = step.step_dir;
  p.trees = step.lower_trees;
  std::error_code ec;
  for (const char* d : {"upper", "work", "root", "l"}) {
    fs::create_directory(step.step_dir + "/" + d, ec);
    if (ec) return fail(Error::kIo, "create " + step.step_dir + "/" + d + ": " + ec.message());
  }
  // The merged root takes the upper dir's owner and mode: the top layer's root, shifted into the range,
  // so image root owns "/" as in the image.
  struct stat top{};
  if (::stat(step.lower_trees.back().c_str(), &top) != 0) return fail_errno("stat " + step.lower_trees.back(), errno);
  std::string upper = step.step_dir + "/upper";
  if (::chown(upper.c_str(), step.ids.base + top.st_uid, step.ids.base + top.st_gid) != 0 ||
      ::chmod(upper.c_str(), top.st_mode & 07777) != 0)
    return fail_errno("prepare " + upper, errno);
  // Relative lowerdir paths (the setup chdirs into step_dir): 128 absolute layer paths would not fit in the
  // one page of mount options.
  std::string lowers;
  for (size_t i = step.lower_trees.size(); i-- > 0;) {
    std::string m = "l/" + std::to_string(i);
    fs::create_directory(step.step_dir + "/" + m, ec);
    if (ec) return fail(Error::kIo, "create " + step.step_dir + "/" + m + ": " + ec.message());
    p.mounts.insert(p.mounts.begin(), m);
    lowers += (lowers.empty() ? "" : ":") + m;
  }
  // redirect_dir/index/metacopy off: a renamed directory is copied up whole and every change is a plain file
  // in upper/, which is what write_layer() turns into a tar.
  p.overlay_options = "lowerdir=" + lowers + ",upperdir=upper,workdir=work,redirect_dir=off,index=off,metacopy=off";
  if (p.overlay_options.size() >= 4000)
    return fail(Error::kLimitExceeded, "too many layers for one overlay mount (" +
                                           std::to_string(step.lower_trees.size()) + ")");
  for (const char* d : kDevices) {
    p.dev_paths.push_back(std::string("root/dev/") + d);
    p.dev_sources.push_back(std::string("/dev/") + d);
  }
  p.workdir = step.workdir;
  std::vector<std::string> argv_s = {"sh", "-c", step.command};
  std::vector<std::string> env_s = step.env;
  std::vector<char*> argv = c_strings(argv_s), envp = c_strings(env_s);

  auto userns = make_user_namespace(step.ids);
  if (!userns) return userns.failure();
  auto out = make_pipe();
  if (!out) return out.failure();
  auto err = make_pipe();
  if (!err) return err.failure();
  p.userns_fd = userns->get();
  p.out_fd = out->write.get();
  p.err_fd = err->write.get();
  // A new mount and PID namespace; the child is PID 1 of the step until its execve'd shell exits.
  long pid = ::syscall(SYS_clone, CLONE_NEWNS | CLONE_NEWPID | SIGCHLD, nullptr, nullptr, nullptr, nullptr);
  if (pid < 0) return fail_errno("clone the build step", errno);
  if (pid == 0) sandbox_child(p, argv.data(), envp.data());
  out->write.reset();
  err->write.reset();
  userns->reset();
  auto setup = read_at_most(err->read.get(), 4096, "the build step's setup");
  OutputPump pump(limits, on_line);
  bool timed_out = false;
  // Killing PID 1 of the step's PID namespace kills every process in it.
  Status pumped = pump.pump(out->read.get(), deadline, [pid] { ::kill(static_cast<pid_t>(pid), SIGKILL); }, timed_out);
  CommandOutcome outcome = finish(static_cast<pid_t>(pid), pump, timed_out);
  if (setup && !setup->empty()) return fail(Error::kInvalidArgument, "cannot start the build step: " + *setup);
  if (!pumped) return pumped.failure();
  return outcome;
}

}  // namespace sg
