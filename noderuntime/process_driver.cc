#include "noderuntime/process_driver.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <sched.h>
#include <spawn.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/log.h"
#include "noderuntime/cgroup.h"
#include "noderuntime/companion_files.h"
#include "noderuntime/sandbox_egress.h"
#include "noderuntime/ssh_keys.h"
#include "noderuntime/uv_handles.h"
#include "snapshot/image_store.h"

namespace sg {
namespace {

constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
// How often a pending freeze/thaw re-reads the kernel's state. Freezing an idle tree takes well under a
// millisecond, so a coarser poll would dominate pause/resume latency.
constexpr uint64_t kFreezePollMs = 1;
// An init that survives SIGKILL this long is stuck in the kernel (e.g. uninterruptible I/O).
constexpr uint64_t kTerminateWaitMs = 5'000;
// Exit statuses of the child when it never reaches execve or execve fails. start() reaps it and reports the
// errno instead, so these only show up in traces; they follow the shell's conventions all the same.
constexpr int kChildAborted = 125;
constexpr int kChildExecFailed = 127;

// Raw syscalls: Debian 12's <sys/pidfd.h> declares the glibc wrappers without C linkage, so C++ cannot link
// against them.
int pidfd_open(int pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }
int pidfd_send_signal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

Failure with_context(const std::string& sandbox_id, const Failure& f) {
  return Failure{f.code, "sandbox " + sandbox_id + ": " + f.message};
}

std::string errno_text(std::string_view what, int err) {
  std::string s(what);
  s += ": ";
  s += std::strerror(err);
  return s;
}

struct ProcStat {
  char state = '?';
  uint64_t start_time_ticks = 0;
};

// /proc/<pid>/stat: "pid (comm) state ppid ... starttime(22) ...". comm may contain spaces and ')', so fields
// are counted from the last ')'.
Result<ProcStat> read_proc_stat(int pid) {
  if (pid <= 0) return fail(Error::kInvalidArgument, "invalid pid " + std::to_string(pid));
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return fail(errno == ENOENT ? Error::kNotFound : Error::kIo, errno_text("open " + path, errno));
  char buf[1024];
  ssize_t n;
  do {
    n = ::read(fd.get(), buf, sizeof buf - 1);
  } while (n < 0 && errno == EINTR);
  // A process reaped between open and read makes the read fail with ESRCH.
  if (n <= 0) return fail(Error::kNotFound, errno_text("read " + path, n < 0 ? errno : ENODATA));
  std::string_view text(buf, static_cast<size_t>(n));
  size_t paren = text.rfind(')');
  if (paren == std::string_view::npos) return fail(Error::kInternal, "unparseable " + path);
  text.remove_prefix(paren + 1);

  ProcStat st;
  int field = 2;  // the comm field just ended
  size_t i = 0;
  while (i < text.size() && field < 22) {
    while (i < text.size() && text[i] == ' ') ++i;
    size_t start = i;
    while (i < text.size() && text[i] != ' ') ++i;
    if (i == start) break;
    ++field;
    std::string_view value = text.substr(start, i - start);
    if (field == 3) st.state = value[0];
    if (field == 22) st.start_time_ticks = std::strtoull(std::string(value).c_str(), nullptr, 10);
  }
  if (field < 22) return fail(Error::kInternal, "truncated " + path);
  return st;
}

bool is_live_instance(const RuntimeInfo& info) {
  auto st = read_proc_stat(info.pid);
  return st && st->state != 'Z' && st->state != 'X' && st->start_time_ticks == info.start_time_ticks;
}

// A pidfd for the instance `info` describes, or an invalid fd when that process is gone (exited, or its pid
// now belongs to someone else). Checking the start time *after* opening pins the identity: if it matches,
// the pidfd refers to our process and stays valid for it even if the pid is later reused.
Result<UniqueFd> open_instance_pidfd(const RuntimeInfo& info) {
  if (info.pid <= 0) return UniqueFd();
  UniqueFd pidfd(pidfd_open(info.pid));
  if (!pidfd.valid()) {
    if (errno == ESRCH) return UniqueFd();
    return fail_errno("pidfd_open " + std::to_string(info.pid), errno);
  }
  auto st = read_proc_stat(info.pid);
  if (!st || st->start_time_ticks != info.start_time_ticks) return UniqueFd();
  return pidfd;
}

// Reaps the process behind `pidfd` if it is our child and has exited; adopted instances (ECHILD) are reaped
// by their real parent. Returns a description of how it ended, or "" if nothing was reaped.
std::string reap(int pidfd) {
  siginfo_t si;
  std::memset(&si, 0, sizeof si);
  if (::waitid(P_PIDFD, static_cast<id_t>(pidfd), &si, WEXITED | WNOHANG) != 0 || si.si_pid == 0) return {};
  if (si.si_code == CLD_EXITED) return "exit status " + std::to_string(si.si_status);
  return "killed by signal " + std::to_string(si.si_status);
}

Status make_dirs(const std::string& path, mode_t mode) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), mode) != 0 && errno != EEXIST) return fail_errno("mkdir " + prefix, errno);
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return fail_errno("stat " + path, errno);
  if (!S_ISDIR(st.st_mode)) return fail(Error::kConflict, path + " exists and is not a directory");
  return {};
}

Result<std::string> default_init_path() {
  auto dir = exe_dir();
  if (!dir) return dir.failure();
  return *dir + "sandgate-init";
}

// sandgate-agent: node.agent_path, else next to this executable (noderuntime/companion_files.h). Empty when
// none is executable: sandboxes then run without an agent, which is said once here rather than at every start.
std::string find_agent(const NodeConfig& cfg) {
  CompanionLookup agent = find_agent_binary(cfg.agent_path);
  if (!agent.path.empty()) {
    spdlog::info("process driver: sandboxes run sandgate-agent {}", agent.path);
  } else {
    spdlog::warn("process driver: no executable sandgate-agent (tried {}); sandboxes run without an agent",
                 agent.tried_text());
  }
  return agent.path;
}

// The sandbox's user namespace: sandbox ids [0, kUidRangeSize) are host ids [uid_base, uid_base +
// kUidRangeSize). A short-lived child creates it (a namespace is made by entering it); the node writes the
// maps as host root and keeps a descriptor, which holds the namespace after the child is gone.
Result<UniqueFd> make_user_namespace(uint32_t uid_base) {
  int hold[2];
  if (::pipe2(hold, O_CLOEXEC) != 0) return fail_errno("pipe2", errno);
  UniqueFd hold_read(hold[0]), hold_write(hold[1]);
  long ret = ::syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, nullptr, nullptr, nullptr, nullptr);
  if (ret < 0) return fail_errno("clone a user namespace", errno);
  if (ret == 0) {
    // Async-signal-safe only (see exec_init_in_child): wait for the parent to be done with the maps.
    ::close(hold[1]);
    char byte;
    while (::read(hold[0], &byte, 1) < 0 && errno == EINTR) {
    }
    ::_exit(0);
  }
  const int pid = static_cast<int>(ret);
  hold_read.reset();
  auto finish = [&](Result<UniqueFd> r) {
    hold_write.reset();  // EOF lets the child exit
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return r;
  };
  const std::string map = "0 " + std::to_string(uid_base) + " " + std::to_string(kUidRangeSize) + "\n";
  for (const char* file : {"uid_map", "gid_map"}) {
    const std::string path = "/proc/" + std::to_string(pid) + "/" + file;
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd.valid()) return finish(fail_errno("open " + path, errno));
    if (::write(fd.get(), map.data(), map.size()) != static_cast<ssize_t>(map.size()))
      return finish(fail_errno("write " + path, errno));
  }
  const std::string ns = "/proc/" + std::to_string(pid) + "/ns/user";
  UniqueFd fd(::open(ns.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return finish(fail_errno("open " + ns, errno));
  return finish(std::move(fd));
}

// The per-sandbox half of the overlay: upper/ holds what the sandbox writes (owned by its root, so its
// root directory is the sandbox's own), work/ is overlayfs's scratch space. Both persist across restarts of
// the sandbox, so files survive them; lower/ and root/ are only mount points in the sandbox's namespace.
Status prepare_root_dirs(const std::string& sandbox_dir, uint32_t uid_base) {
  const std::string upper = sandbox_dir + "/upper";
  if (::mkdir(upper.c_str(), 0755) != 0 && errno != EEXIST) return fail_errno("mkdir " + upper, errno);
  if (::chown(upper.c_str(), uid_base, uid_base) != 0) return fail_errno("chown " + upper, errno);
  const std::string work = sandbox_dir + "/work";
  if (::mkdir(work.c_str(), 0700) != 0 && errno != EEXIST) return fail_errno("mkdir " + work, errno);
  return {};
}

// argv/envp as the C arrays execve() wants. Built before forking: the child may only make
// async-signal-safe calls, which rules out allocating.
class CStringArray {
 public:
  explicit CStringArray(std::vector<std::string> strings) : strings_(std::move(strings)) {
    for (auto& s : strings_) pointers_.push_back(s.data());
    pointers_.push_back(nullptr);
  }
  char* const* get() const { return pointers_.data(); }

 private:
  std::vector<std::string> strings_;
  std::vector<char*> pointers_;
};

// disk_mb: the upper dir lives on <sandbox_dir>/disk.img, a sparse ext4 file of that size whose root the
// sandbox's root owns (sandgate-init mounts it through a loop device in the sandbox's namespace), so writes
// past the size fail with ENOSPC. Made once; later starts of the sandbox reuse it, files included.
Status prepare_disk(const std::string& sandbox_dir, uint32_t disk_mb, uint32_t uid_base) {
  const std::string image = sandbox_dir + "/disk.img";
  struct stat st;
  if (::stat(image.c_str(), &st) == 0) return {};
  const std::string staging = image + ".new";
  {
    UniqueFd fd(::open(staging.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd.valid()) return fail_errno("create " + staging, errno);
    if (::ftruncate(fd.get(), static_cast<off_t>(disk_mb) * 1024 * 1024) != 0)
      return fail_errno("size " + staging, errno);
  }
  const std::string owner = "root_owner=" + std::to_string(uid_base) + ":" + std::to_string(uid_base);
  std::vector<std::string> args = {"mkfs.ext4", "-q", "-F", "-E", owner, staging};
  const CStringArray argv(std::move(args));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, "mkfs.ext4", &actions, nullptr, argv.get(), ::environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return fail_errno("run mkfs.ext4 (e2fsprogs)", rc);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return fail(Error::kIo, "mkfs.ext4 " + staging + " failed (wait status " + std::to_string(status) + ")");
  if (::rename(staging.c_str(), image.c_str()) != 0) return fail_errno("rename " + staging, errno);
  return {};
}

// Runs in the freshly cloned child, which is PID 1 of the new PID namespace. Only async-signal-safe calls:
// the parent may have had other threads holding locks (malloc's included) at the time of the clone.
[[noreturn]] void exec_init_in_child(int go_read, int go_write, int error_read, int error_write, int userns_fd,
                                     const char* path, char* const* argv, char* const* envp) {
  ::close(go_write);  // else this process would keep its own "go" pipe open and never see the parent die
  ::close(error_read);
  // A new session: a Ctrl-C (or hangup) on the node's terminal must never reach the sandbox.
  ::setsid();
  // Handlers and the mask are the node's (libuv's signal pipe among them), and ignored dispositions would
  // survive execve: start the sandbox from the defaults.
  struct sigaction default_action;
  std::memset(&default_action, 0, sizeof default_action);
  default_action.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) ::sigaction(sig, &default_action, nullptr);
  sigset_t no_signals;
  ::sigemptyset(&no_signals);
  ::sigprocmask(SIG_SETMASK, &no_signals, nullptr);
  // None of the node's descriptors (listeners, the state database, ...) may leak into the sandbox.
  ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
  // ...except the user namespace, which sandgate-init enters once the root filesystem is built.
  if (::fcntl(userns_fd, F_SETFD, 0) != 0) ::_exit(kChildAborted);

  char go = 0;
  ssize_t n;
  do {
    n = ::read(go_read, &go, 1);
  } while (n < 0 && errno == EINTR);
  if (n != 1) ::_exit(kChildAborted);  // the parent gave up (or died) before the cgroup was ready

  ::execve(path, argv, envp);
  int err = errno;
  ssize_t ignored = ::write(error_write, &err, sizeof err);
  (void)ignored;  // nothing left to report to if even this fails
  ::_exit(kChildExecFailed);
}

class ProcessDriver final : public Driver {
 public:
  ProcessDriver(uv_loop_t* loop, const NodeConfig& cfg, snapshot::ImageStore* images, CgroupManager cgroups,
                std::string init_path, std::string agent_path, UniqueFd host_netns, SandboxEgress* egress)
      : loop_(loop),
        images_(images),
        suspend_timeout_ms_(cfg.suspend_timeout_ms),
        log_max_bytes_(cfg.log_max_bytes),
        batch_scheduling_(cfg.batch_scheduling),
        cgroups_(std::move(cgroups)),
        init_path_(std::move(init_path)),
        agent_path_(std::move(agent_path)),
        ssh_keys_dir_(ssh_keys_dir(cfg.state_dir)),
        host_netns_(std::move(host_netns)),
        egress_(egress) {}

  ~ProcessDriver() override {
    // Pending callbacks are dropped: their owners are being torn down along with the driver.
    for (auto& op : ops_) release_handles(*op);
    for (auto& [id, watch] : watches_) release_handles(*watch);
    // Leave no empty parent cgroups behind; rmdir fails (harmlessly) while sandboxes kept running are inside.
    for (const std::string& dir : cgroups_.parent_dirs()) ::rmdir(dir.c_str());
  }

  std::string_view name() const override { return "process"; }

  DriverCapabilities capabilities() const override {
    return DriverCapabilities{.pause = cgroups_.detection().freeze.version != CgroupVersion::kNone,
                              .hibernate = false,
                              .disk_limit = true};
  }

  // Spawning a process tree takes milliseconds, so the work is done synchronously; only the answer is
  // delivered from the loop, as the interface requires.
  void start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) override;
  void pause(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override;
  void resume(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override;
  // The host's file system is shared with the sandbox and a process tree's memory cannot be saved and
  // brought back by the kernel, so there is no disk tier (capabilities().hibernate is false).
  void hibernate(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override;
  void restore(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override;
  // A freeze in progress is undone by thawing; the pause then fails once the cgroup is thawed again.
  bool cancel(const SandboxSpec& spec) override;
  void terminate(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override;
  Status watch_exit(const SandboxSpec& spec, const RuntimeInfo& info, std::function<void()> on_exit) override;
  void unwatch(const SandboxSpec& spec) override;
  ObservedInstance observe(const SandboxSpec& spec, const RuntimeInfo& info) override;
  Result<GuestSocket> open_socket(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port) override;
  Result<UniqueFd> socket_namespace(const SandboxSpec& spec, const RuntimeInfo& info) override;
  Result<std::vector<GuestSocket>> open_sockets(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port,
                                                size_t count) override;
  Result<CheckpointSource> checkpoint_source(const SandboxSpec& spec, const RuntimeInfo& info) override;

 private:
  enum class OpKind { kStart, kPause, kResume, kTerminate };

  // An asynchronous pause/resume/terminate in flight. Its timer either polls the freezer (pause/resume), is
  // the deadline for the init to die (terminate), or fires once to report a result known up front (callbacks
  // must never run before the call that started them returns).
  struct Operation {
    ProcessDriver* driver = nullptr;
    OpKind kind = OpKind::kPause;
    std::string sandbox_id;
    SandboxCgroup cgroup;
    Done done;
    uint64_t started_ms = 0;
    std::optional<Failure> known_result;
    bool superseded = false;  // a terminate() for the same sandbox took over
    bool cancelled = false;   // a pause asked to stop: now waiting for the thaw
    std::optional<RuntimeInfo> started;  // start: the instance to hand back
    RuntimeDone start_done;
    int pid = 0;
    UniqueFd pidfd;  // terminate: the init being waited for
    uv_timer_t* timer = nullptr;
    uv_poll_t* exit_poll = nullptr;
  };

  struct ExitWatch {
    ProcessDriver* driver = nullptr;
    std::string sandbox_id;
    int pid = 0;
    UniqueFd pidfd;
    std::function<void()> on_exit;
    uv_poll_t* exit_poll = nullptr;
    uv_timer_t* already_gone = nullptr;  // the instance had exited before the watch began
  };

  // The sandbox's network namespace (an fd of netns_), opened once per instance.
  Result<int> netns_of(const SandboxSpec& spec, const RuntimeInfo& info);
  // The sandbox's network namespace, kept open so open_socket() needs one setns() pair and no /proc lookup.
  struct Netns {
    int pid = 0;
    uint64_t start_time_ticks = 0;
    UniqueFd fd;
  };

  static void on_operation_timer(uv_timer_t* timer) {
    auto* op = static_cast<Operation*>(timer->data);
    op->driver->step(op);
  }
  static void release_handles(Operation& op) {
    close_and_free(op.timer);
    close_and_free(op.exit_poll);
  }
  static void release_handles(ExitWatch& watch) {
    close_and_free(watch.exit_poll);
    close_and_free(watch.already_gone);
  }

  Result<RuntimeInfo> start_now(const SandboxSpec& spec, const std::string& sandbox_dir);
  Result<int> spawn_init(const SandboxSpec& spec, const std::string& sandbox_dir, const SandboxCgroup& cgroup);
  // The layers under the sandbox's upper dir (its snapshot's, else its image's) and their trees, bottom first.
  Result<std::vector<std::string>> base_layers(const SandboxSpec& spec);
  Result<std::vector<std::string>> layer_trees(const SandboxSpec& spec);
  Operation* add_operation(OpKind kind, const SandboxSpec& spec, Done done);
  void step(Operation* op);
  void step_freeze(Operation* op);
  void finish_termination(Operation* op, bool timed_out);
  void finish_start(Operation* op);
  void finish(Operation* op, Status status);
  void fire_exit(ExitWatch* watch);
  void stop_watch(const std::string& sandbox_id);

  uv_loop_t* loop_;
  snapshot::ImageStore* images_;
  uint32_t suspend_timeout_ms_;
  uint32_t log_max_bytes_;
  bool batch_scheduling_;  // node.batch_scheduling: sandgate-init --sched batch
  CgroupManager cgroups_;
  std::string init_path_;
  std::string agent_path_;  // empty: no agent found, sandboxes run without one
  std::string ssh_keys_dir_;  // the node's registered SSH keys (noderuntime/ssh_keys.h), bound into every sandbox
  UniqueFd host_netns_;
  Status attach_egress(const SandboxSpec& spec, int pid);
  SandboxEgress* egress_;  // the node's, shared with the QEMU driver; null: no internet access here
  std::vector<std::unique_ptr<Operation>> ops_;
  std::map<std::string, std::unique_ptr<ExitWatch>> watches_;
  std::map<std::string, Netns> netns_;
};

void ProcessDriver::start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) {
  auto started = start_now(spec, sandbox_dir);
  Operation* op = add_operation(OpKind::kStart, spec, nullptr);
  op->start_done = std::move(done);
  if (started) {
    op->started = std::move(*started);
  } else {
    op->known_result = started.failure();
  }
  uv_timer_start(op->timer, on_operation_timer, 0, 0);
}

void ProcessDriver::hibernate(const SandboxSpec& spec, const RuntimeInfo&, RuntimeDone done) {
  Operation* op = add_operation(OpKind::kStart, spec, nullptr);
  op->start_done = std::move(done);
  op->known_result = fail(Error::kUnsupported, "the process driver cannot hibernate sandboxes");
  uv_timer_start(op->timer, on_operation_timer, 0, 0);
}

void ProcessDriver::restore(const SandboxSpec& spec, const RuntimeInfo&, RuntimeDone done) {
  Operation* op = add_operation(OpKind::kStart, spec, nullptr);
  op->start_done = std::move(done);
  op->known_result = fail(Error::kUnsupported, "the process driver cannot restore sandboxes from disk");
  uv_timer_start(op->timer, on_operation_timer, 0, 0);
}

bool ProcessDriver::cancel(const SandboxSpec& spec) {
  for (auto& op : ops_) {
    if (op->sandbox_id != spec.id || op->kind != OpKind::kPause || op->known_result || op->cancelled) continue;
    if (Status s = op->cgroup.thaw(); !s) {
      spdlog::warn("sandbox {}: cannot cancel the freeze: {}", spec.id, s.message());
      return false;
    }
    op->cancelled = true;
    return true;
  }
  return false;
}

Result<RuntimeInfo> ProcessDriver::start_now(const SandboxSpec& spec, const std::string& sandbox_dir) {
  if (spec.id.empty()) return fail(Error::kInvalidArgument, "sandbox spec has no id");
  if (spec.command.empty()) return with_context(spec.id, fail(Error::kInvalidArgument, "empty command"));
  if (sandbox_dir.empty()) return with_context(spec.id, fail(Error::kInvalidArgument, "empty sandbox_dir"));
  if (Status s = make_dirs(sandbox_dir, 0700); !s) return with_context(spec.id, s.failure());
  if (spec.uid_base == 0)
    return with_context(spec.id, fail(Error::kInvalidArgument, "no uid range (created before user namespaces)"));
  if (Status s = spec.disk_mb > 0 ? prepare_disk(sandbox_dir, spec.disk_mb, spec.uid_base)
                                  : prepare_root_dirs(sandbox_dir, spec.uid_base);
      !s)
    return with_context(spec.id, s.failure());
  netns_.erase(spec.id);  // a namespace cached for an earlier instance of this sandbox is not this one's

  auto cgroup = cgroups_.create(spec.id, spec.cpus, spec.memory_mb, spec.pids_max);
  if (!cgroup) return with_context(spec.id, cgroup.failure());

  auto pid = spawn_init(spec, sandbox_dir, *cgroup);
  if (!pid) {
    (void)cgroup->remove();  // best effort: the spawn failure is the error worth reporting
    return with_context(spec.id, pid.failure());
  }
  auto st = read_proc_stat(*pid);
  if (!st) {
    (void)cgroup->kill_all();
    ::kill(*pid, SIGKILL);
    while (::waitpid(*pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    (void)cgroup->remove();
    return with_context(spec.id, st.failure());
  }
  spdlog::info("sandbox {}: started, init pid {}, command {}", spec.id, *pid, spec.command[0]);
  return RuntimeInfo{.pid = *pid, .start_time_ticks = st->start_time_ticks, .sandbox_dir = sandbox_dir, .driver_data = {}};
}

Result<std::vector<std::string>> ProcessDriver::base_layers(const SandboxSpec& spec) {
  // A sandbox created from a snapshot has the snapshot's layers (which snapshot rm keeps while it lives).
  if (!spec.layers.empty()) return spec.layers;
  if (spec.image.empty()) return fail(Error::kInvalidArgument, "no image (created before images existed)");
  auto image = images_->get(spec.image);
  if (!image) return fail(image.error(), "image '" + spec.image + "': " + image.message());
  return image->layers;
}

Result<std::vector<std::string>> ProcessDriver::layer_trees(const SandboxSpec& spec) {
  auto layers = base_layers(spec);
  if (!layers) return layers.failure();
  const std::string what = spec.snapshot.empty() ? "image '" + spec.image + "'" : "snapshot " + spec.snapshot;
  std::vector<std::string> trees;
  for (const std::string& digest : *layers) {
    if (!images_->layers().contains(digest))
      return fail(Error::kNotFound, what + ": layer " + digest + " is not in the store");
    trees.push_back(images_->layers().tree_path(digest));
  }
  if (trees.empty()) return fail(Error::kInvalidArgument, what + " has no layers");
  return trees;
}

// Freezes through the sandbox's cgroup from the checkpoint's worker thread, waiting for the kernel's word
// (a freeze of a busy tree is not instant). The node runs no pause or resume of the sandbox meanwhile.
class CgroupFreezer final : public snapshot::Freezer {
 public:
  CgroupFreezer(SandboxCgroup cgroup, uint32_t timeout_ms) : cgroup_(std::move(cgroup)), timeout_ms_(timeout_ms) {}

  Status freeze() override {
    if (auto s = cgroup_.freeze(); !s) return s;
    if (auto s = wait(true); !s) {
      (void)cgroup_.thaw();  // never leave a half-frozen sandbox behind; the freeze's error is the one to report
      return s;
    }
    return {};
  }
  Status thaw() override {
    if (auto s = cgroup_.thaw(); !s) return s;
    return wait(false);
  }

 private:
  Status wait(bool frozen) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
    for (;;) {
      auto state = cgroup_.is_frozen();
      if (!state) return state.failure();
      if (*state == frozen) return {};
      if (std::chrono::steady_clock::now() > deadline)
        return fail(Error::kTimeout, std::string(frozen ? "freeze" : "thaw") + " did not complete within " +
                                         std::to_string(timeout_ms_) + " ms");
      std::this_thread::sleep_for(std::chrono::milliseconds(kFreezePollMs));
    }
  }

  SandboxCgroup cgroup_;
  uint32_t timeout_ms_;
};

// A disk_mb sandbox's upper dir is on its ext4 file, mounted through a loop device in the sandbox's mount
// namespace alone. The same device mounted again gives the same filesystem (one superblock per device), so
// the node sees exactly what the sandbox wrote: as a detached mount (fsmount, attached to no namespace, so
// nothing else sees it), read-only, gone when its fd closes. The device is the one whose backing file is
// `image` (its device and inode, from LOOP_GET_STATUS64), held open meanwhile so that it cannot be released
// and taken by another sandbox, and it must be in use by a mount already (else mounting it would make a new,
// writable filesystem of a file no one mounts). `device_fd` gets the held device.
Result<UniqueFd> open_disk_view(const std::string& image, UniqueFd* device_fd) {
  struct stat want{};
  if (::stat(image.c_str(), &want) != 0) return fail_errno("stat " + image, errno);
  auto holds_image = [&](int fd) {
    loop_info64 info{};
    return ::ioctl(fd, LOOP_GET_STATUS64, &info) == 0 && info.lo_device == want.st_dev && info.lo_inode == want.st_ino;
  };
  std::string device;
  UniqueFd held;
  if (DIR* dir = ::opendir("/sys/block"); dir != nullptr) {
    while (dirent* e = ::readdir(dir)) {
      if (std::strncmp(e->d_name, "loop", 4) != 0) continue;
      const std::string path = std::string("/dev/") + e->d_name;
      UniqueFd loop(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      if (!loop.valid() || !holds_image(loop.get())) continue;
      if (held.valid()) {
        ::closedir(dir);
        return fail(Error::kConflict, "two loop devices hold " + image + " (" + device + ", " + path + ")");
      }
      device = path;
      held = std::move(loop);
    }
    ::closedir(dir);
  }
  if (!held.valid()) return fail(Error::kUnavailable, "no loop device holds " + image + " (the sandbox is not running)");
  // A mounted device refuses an exclusive open: one that does not is no one's filesystem.
  if (UniqueFd exclusive(::open(device.c_str(), O_RDONLY | O_EXCL | O_CLOEXEC)); exclusive.valid() || errno != EBUSY)
    return fail(Error::kUnavailable, device + " (" + image + ") is not mounted by its sandbox");
  UniqueFd context(::fsopen("ext4", FSOPEN_CLOEXEC));
  if (!context.valid()) return fail_errno("fsopen ext4", errno);
  if (::fsconfig(context.get(), FSCONFIG_SET_STRING, "source", device.c_str(), 0) != 0 ||
      ::fsconfig(context.get(), FSCONFIG_CMD_CREATE, nullptr, nullptr, 0) != 0)
    return fail_errno("open the ext4 on " + device + " (" + image + ")", errno);
  UniqueFd mount(::fsmount(context.get(), FSMOUNT_CLOEXEC,
                           MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC));
  if (!mount.valid()) return fail_errno("mount the ext4 on " + device + " (" + image + ")", errno);
  if (!holds_image(held.get())) return fail(Error::kConflict, device + " changed hands while it was mounted");
  *device_fd = std::move(held);
  return mount;
}

Result<CheckpointSource> ProcessDriver::checkpoint_source(const SandboxSpec& spec, const RuntimeInfo& info) {
  if (!capabilities().pause) return fail(Error::kUnsupported, "no cgroup freezer on this host: checkpoints need one");
  if (spec.uid_base == 0 || info.sandbox_dir.empty())
    return fail(Error::kUnsupported, "sandbox " + spec.id + " predates layered root filesystems");
  auto layers = base_layers(spec);
  if (!layers) return layers.failure();
  CheckpointSource source;
  source.upper_dir = info.sandbox_dir + "/upper";
  if (spec.disk_mb > 0) {
    auto held = std::make_shared<std::pair<UniqueFd, UniqueFd>>();  // the mount, and its loop device
    auto view = open_disk_view(info.sandbox_dir + "/disk.img", &held->second);
    if (!view) return fail(view.error(), "sandbox " + spec.id + " (disk_mb): " + view.message());
    source.upper_dir = "/proc/self/fd/" + std::to_string(view->get()) + "/upper";
    held->first = std::move(*view);
    source.hold = std::move(held);
  }
  source.shift = snapshot::IdShift{spec.uid_base, kUidRangeSize};
  source.base_layers = std::move(*layers);
  source.freezer = std::make_unique<CgroupFreezer>(cgroups_.sandbox(spec.id), suspend_timeout_ms_);
  return source;
}

Result<int> ProcessDriver::spawn_init(const SandboxSpec& spec, const std::string& sandbox_dir,
                                      const SandboxCgroup& cgroup) {
  auto trees = layer_trees(spec);
  if (!trees) return trees.failure();
  auto userns = make_user_namespace(spec.uid_base);
  if (!userns) return userns.failure();
  std::vector<std::string> args = {init_path_,
                                   "--hostname",
                                   spec.name.empty() ? spec.id : spec.name,
                                   "--cwd",
                                   spec.cwd,
                                   "--log",
                                   sandbox_dir + "/output.log",
                                   "--log-max",
                                   std::to_string(log_max_bytes_),
                                   "--sandbox-dir",
                                   sandbox_dir,
                                   "--userns-fd",
                                   std::to_string(userns->get()),
                                   "--uid-base",
                                   std::to_string(spec.uid_base)};
  for (const std::string& tree : *trees) args.insert(args.end(), {"--layer", tree});
  if (spec.disk_mb > 0) args.insert(args.end(), {"--disk", sandbox_dir + "/disk.img"});
  args.insert(args.end(), {"--sched", batch_scheduling_ ? "batch" : "normal"});
  // All addresses: the sandbox's network namespace has only its own loopback, which is where the node's
  // sockets connect from.
  if (!agent_path_.empty() && spec.agent_port != 0) {
    args.insert(args.end(), {"--agent", agent_path_, "--agent-listen", "0.0.0.0:" + std::to_string(spec.agent_port)});
    // SSH without an sshd (docs/ssh.md). The host key is made once, at the sandbox's first start, and kept
    // in its directory of the node's state, so it survives suspends, node restarts and sandbox restarts.
    if (uint16_t ssh_port = agent_ssh_port(spec); ssh_port != 0) {
      const std::string host_dir = sandbox_dir + "/ssh";
      auto host_key = ensure_host_key(host_dir, spec.uid_base);
      if (!host_key) return host_key.failure();
      if (::mkdir(ssh_keys_dir_.c_str(), 0755) != 0 && errno != EEXIST)
        return fail_errno("mkdir " + ssh_keys_dir_, errno);
      args.insert(args.end(), {"--agent-ssh-listen", "0.0.0.0:" + std::to_string(ssh_port), "--ssh-host-dir", host_dir,
                               "--ssh-keys-dir", ssh_keys_dir_});
    }
  }
  args.push_back("--");
  args.insert(args.end(), spec.command.begin(), spec.command.end());
  std::map<std::string, std::string> env = {{"PATH", kDefaultPath},
                                            {"HOME", "/root"},
                                            {"TERM", "xterm"},
                                            {"SANDGATE_SANDBOX_ID", spec.id},
                                            {"SANDGATE_SANDBOX_NAME", spec.name}};
  for (const auto& [key, value] : spec.env) env[key] = value;
  std::vector<std::string> env_strings;
  for (const auto& [key, value] : env) env_strings.push_back(key + "=" + value);
  const CStringArray argv(std::move(args));
  const CStringArray envp(std::move(env_strings));

  // "go": the child waits on it until it sits in the cgroup with limits applied, so not even the init runs
  // unconfined. "error": close-on-exec, so EOF means execve succeeded and an int means it failed.
  int go[2];
  int error[2];
  if (::pipe2(go, O_CLOEXEC) != 0) return fail_errno("pipe2", errno);
  UniqueFd go_read(go[0]), go_write(go[1]);
  if (::pipe2(error, O_CLOEXEC) != 0) return fail_errno("pipe2", errno);
  UniqueFd error_read(error[0]), error_write(error[1]);

  // A fork-like clone (no CLONE_VM, no new stack) straight into new namespaces. No CLONE_PARENT_SETTID or
  // PDEATHSIG: the sandbox must outlive the node so that a restarted node can adopt it.
  long ret = ::syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC | SIGCHLD,
                       nullptr, nullptr, nullptr, nullptr);
  if (ret < 0) return fail_errno("clone into new namespaces", errno);
  if (ret == 0) {
    exec_init_in_child(go_read.get(), go_write.get(), error_read.get(), error_write.get(), userns->get(),
                       init_path_.c_str(), argv.get(), envp.get());
  }
  const int pid = static_cast<int>(ret);
  go_read.reset();
  error_write.reset();

  auto abandon_child = [pid](Failure f) -> Result<int> {
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return f;
  };
  if (Status s = cgroup.add_pid(pid); !s) return abandon_child(s.failure());
  // Before the go: the command's first connect already finds its route (or none, without internet access).
  if (spec.allow_internet_access) {
    if (Status s = attach_egress(spec, pid); !s) return abandon_child(s.failure());
  }
  const char go_byte = 1;
  if (::write(go_write.get(), &go_byte, 1) != 1)
    return abandon_child(fail_errno("write to the child's go pipe", errno));
  go_write.reset();

  int exec_errno = 0;
  ssize_t n;
  do {
    n = ::read(error_read.get(), &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  if (n == 0) return pid;
  if (n < 0) return abandon_child(fail_errno("read the child's error pipe", errno));
  while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  return fail(exec_errno == ENOENT ? Error::kNotFound : Error::kIo,
              errno_text("cannot execute sandbox init " + init_path_, exec_errno));
}

ProcessDriver::Operation* ProcessDriver::add_operation(OpKind kind, const SandboxSpec& spec, Done done) {
  auto op = std::make_unique<Operation>();
  op->driver = this;
  op->kind = kind;
  op->sandbox_id = spec.id;
  op->cgroup = cgroups_.sandbox(spec.id);
  op->done = std::move(done);
  // The loop's clock is only refreshed per iteration; after a long synchronous stretch (a start(), a slow
  // cgroup removal) it lags, and a timeout measured from it would expire at once.
  uv_update_time(loop_);
  op->started_ms = uv_now(loop_);
  op->timer = new uv_timer_t;
  uv_timer_init(loop_, op->timer);
  op->timer->data = op.get();
  ops_.push_back(std::move(op));
  return ops_.back().get();
}

void ProcessDriver::pause(const SandboxSpec& spec, const RuntimeInfo&, Done done) {
  Operation* op = add_operation(OpKind::kPause, spec, std::move(done));
  if (Status s = op->cgroup.freeze(); !s) op->known_result = with_context(spec.id, s.failure());
  uv_timer_start(op->timer, on_operation_timer, 0, kFreezePollMs);
}

void ProcessDriver::resume(const SandboxSpec& spec, const RuntimeInfo&, Done done) {
  Operation* op = add_operation(OpKind::kResume, spec, std::move(done));
  if (Status s = op->cgroup.thaw(); !s) op->known_result = with_context(spec.id, s.failure());
  uv_timer_start(op->timer, on_operation_timer, 0, kFreezePollMs);
}

void ProcessDriver::terminate(const SandboxSpec& spec, const RuntimeInfo& info, Done done) {
  for (auto& other : ops_) {
    if (other->sandbox_id == spec.id && other->kind != OpKind::kTerminate) other->superseded = true;
  }
  // The exit this causes is not one the instance made "by itself", so the watcher is not told.
  stop_watch(spec.id);
  netns_.erase(spec.id);
  // Its address and chain go first: nothing leaves the sandbox while it is being killed.
  if (egress_ != nullptr) egress_->detach(spec);

  Operation* op = add_operation(OpKind::kTerminate, spec, std::move(done));
  op->pid = info.pid;
  auto pidfd = open_instance_pidfd(info);
  if (pidfd) {
    op->pidfd = std::move(*pidfd);
  } else {
    // The cgroup kill below still reaches the init (it lives in the cgroup); we just cannot wait on it.
    spdlog::warn("sandbox {}: {}", spec.id, pidfd.message());
  }
  // SIGKILL to a PID namespace's init takes down every process in the namespace.
  if (op->pidfd.valid() && pidfd_send_signal(op->pidfd.get(), SIGKILL) != 0 && errno != ESRCH)
    spdlog::warn("sandbox {}: {}", spec.id, errno_text("SIGKILL init pid " + std::to_string(info.pid), errno));
  if (Status s = op->cgroup.kill_all(); !s) spdlog::warn("sandbox {}: {}", spec.id, s.message());
  // Frozen tasks cannot act on a SIGKILL until thawed (v1) and thawing a v2 group is harmless.
  if (op->cgroup.can_freeze()) {
    Status s = op->cgroup.thaw();
    if (!s && s.error() != Error::kNotFound) spdlog::warn("sandbox {}: {}", spec.id, s.message());
  }

  if (!op->pidfd.valid()) {
    uv_timer_start(op->timer, on_operation_timer, 0, 0);
    return;
  }
  op->exit_poll = new uv_poll_t;
  if (int rc = uv_poll_init(loop_, op->exit_poll, op->pidfd.get()); rc != 0) {
    delete op->exit_poll;  // never initialised, so there is nothing for uv_close to do
    op->exit_poll = nullptr;
    op->known_result = fail(Error::kIo, "sandbox " + spec.id + ": uv_poll_init on pidfd: " + uv_strerror(rc));
    uv_timer_start(op->timer, on_operation_timer, 0, 0);
    return;
  }
  op->exit_poll->data = op;
  uv_poll_start(op->exit_poll, UV_READABLE, [](uv_poll_t* p, int, int) {
    auto* o = static_cast<Operation*>(p->data);
    o->driver->finish_termination(o, false);
  });
  uv_timer_start(op->timer, on_operation_timer, kTerminateWaitMs, 0);
}

Status ProcessDriver::attach_egress(const SandboxSpec& spec, int pid) {
  if (egress_ == nullptr) return fail(Error::kUnsupported, "internet access: this node's process driver has no egress");
  return egress_->attach(spec, "/proc/" + std::to_string(pid) + "/ns/net");
}

void ProcessDriver::step(Operation* op) {
  if (op->kind == OpKind::kStart) return finish_start(op);
  if (op->known_result) return finish(op, *op->known_result);
  // With a pidfd the timer is the deadline for the init to die; without one there was nothing to wait for.
  if (op->kind == OpKind::kTerminate) return finish_termination(op, op->pidfd.valid());
  step_freeze(op);
}

void ProcessDriver::step_freeze(Operation* op) {
  const bool pausing = op->kind == OpKind::kPause;
  if (op->superseded)
    return finish(op, fail(Error::kConflict, "sandbox " + op->sandbox_id + ": terminated while " +
                                                 (pausing ? "pausing" : "resuming")));
  auto frozen = op->cgroup.is_frozen();
  if (!frozen) {
    if (pausing) (void)op->cgroup.thaw();  // never leave a half-frozen sandbox behind
    return finish(op, with_context(op->sandbox_id, frozen.failure()));
  }
  if (op->cancelled) {
    if (!*frozen) return finish(op, fail(Error::kConflict, "sandbox " + op->sandbox_id + ": pause cancelled"));
  } else if (*frozen == pausing) {
    return finish(op, {});
  }
  if (uv_now(loop_) - op->started_ms < suspend_timeout_ms_) return;
  if (pausing) (void)op->cgroup.thaw();
  finish(op, fail(Error::kTimeout, "sandbox " + op->sandbox_id + ": " + (pausing ? "freeze" : "thaw") +
                                       " did not complete within " + std::to_string(suspend_timeout_ms_) + " ms"));
}

void ProcessDriver::finish_termination(Operation* op, bool timed_out) {
  if (op->pidfd.valid()) {
    std::string how = reap(op->pidfd.get());
    if (!how.empty()) spdlog::info("sandbox {}: init pid {} reaped ({})", op->sandbox_id, op->pid, how);
  }
  Status removed = op->cgroup.remove();
  if (timed_out) {
    return finish(op, fail(Error::kTimeout, "sandbox " + op->sandbox_id + ": init pid " + std::to_string(op->pid) +
                                                " still alive " + std::to_string(kTerminateWaitMs) +
                                                " ms after SIGKILL"));
  }
  if (!removed) return finish(op, with_context(op->sandbox_id, removed.failure()));
  spdlog::info("sandbox {}: terminated", op->sandbox_id);
  finish(op, {});
}

void ProcessDriver::finish_start(Operation* op) {
  RuntimeDone done = std::move(op->start_done);
  Result<RuntimeInfo> result = op->known_result ? Result<RuntimeInfo>(*op->known_result)
                                                : Result<RuntimeInfo>(std::move(*op->started));
  finish(op, {});
  if (done) done(std::move(result));
}

void ProcessDriver::finish(Operation* op, Status status) {
  Done done = std::move(op->done);
  release_handles(*op);
  auto it = std::find_if(ops_.begin(), ops_.end(), [op](const auto& p) { return p.get() == op; });
  ops_.erase(it);
  // Last: the callback may start new operations or even destroy the driver.
  if (done) done(std::move(status));
}

Status ProcessDriver::watch_exit(const SandboxSpec& spec, const RuntimeInfo& info, std::function<void()> on_exit) {
  auto pidfd = open_instance_pidfd(info);
  if (!pidfd) return with_context(spec.id, pidfd.failure());
  stop_watch(spec.id);

  auto watch = std::make_unique<ExitWatch>();
  watch->driver = this;
  watch->sandbox_id = spec.id;
  watch->pid = info.pid;
  watch->pidfd = std::move(*pidfd);
  watch->on_exit = std::move(on_exit);
  if (!watch->pidfd.valid()) {
    // Gone before we looked (e.g. it died while the node was down): report it, but from the loop.
    watch->already_gone = new uv_timer_t;
    uv_timer_init(loop_, watch->already_gone);
    watch->already_gone->data = watch.get();
    uv_timer_start(watch->already_gone, [](uv_timer_t* t) {
      auto* w = static_cast<ExitWatch*>(t->data);
      w->driver->fire_exit(w);
    }, 0, 0);
  } else {
    watch->exit_poll = new uv_poll_t;
    if (int rc = uv_poll_init(loop_, watch->exit_poll, watch->pidfd.get()); rc != 0) {
      delete watch->exit_poll;  // never initialised, so there is nothing for uv_close to do
      return fail(Error::kIo, "sandbox " + spec.id + ": uv_poll_init on pidfd: " + uv_strerror(rc));
    }
    watch->exit_poll->data = watch.get();
    // A pidfd turns readable once the process has exited, whether or not it is our child.
    uv_poll_start(watch->exit_poll, UV_READABLE, [](uv_poll_t* p, int, int) {
      auto* w = static_cast<ExitWatch*>(p->data);
      w->driver->fire_exit(w);
    });
  }
  watches_[spec.id] = std::move(watch);
  return {};
}

void ProcessDriver::fire_exit(ExitWatch* watch) {
  std::string how = watch->pidfd.valid() ? reap(watch->pidfd.get()) : std::string();
  spdlog::info("sandbox {}: init pid {} exited{}", watch->sandbox_id, watch->pid, how.empty() ? "" : " (" + how + ")");
  std::function<void()> on_exit = std::move(watch->on_exit);
  const std::string id = watch->sandbox_id;
  netns_.erase(id);
  stop_watch(id);  // destroys `watch`
  // Last: the callback may call back into the driver (terminate, start, even destroy it).
  if (on_exit) on_exit();
}

void ProcessDriver::stop_watch(const std::string& sandbox_id) {
  auto it = watches_.find(sandbox_id);
  if (it == watches_.end()) return;
  release_handles(*it->second);
  watches_.erase(it);
}

void ProcessDriver::unwatch(const SandboxSpec& spec) {
  stop_watch(spec.id);
  netns_.erase(spec.id);
}

ObservedInstance ProcessDriver::observe(const SandboxSpec& spec, const RuntimeInfo& info) {
  ObservedInstance seen;
  seen.alive = is_live_instance(info);
  if (seen.alive) {
    auto frozen = cgroups_.sandbox(spec.id).is_frozen();
    seen.paused = frozen && *frozen;
  }
  return seen;
}

Result<GuestSocket> ProcessDriver::open_socket(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port) {
  auto sockets = open_sockets(spec, info, port, 1);
  if (!sockets) return sockets.failure();
  return std::move(sockets->front());
}

Result<int> ProcessDriver::netns_of(const SandboxSpec& spec, const RuntimeInfo& info) {
  auto cached = netns_.find(spec.id);
  if (cached != netns_.end() &&
      (cached->second.pid != info.pid || cached->second.start_time_ticks != info.start_time_ticks)) {
    netns_.erase(cached);
    cached = netns_.end();
  }
  if (cached == netns_.end()) {
    if (info.pid <= 0) return fail(Error::kUnavailable, "sandbox " + spec.id + ": no process");
    const std::string path = "/proc/" + std::to_string(info.pid) + "/ns/net";
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return fail(Error::kUnavailable, "sandbox " + spec.id + ": " + errno_text("open " + path, errno));
    // Checked after opening, so the namespace cannot belong to a process that reused the pid.
    if (!is_live_instance(info)) return fail(Error::kUnavailable, "sandbox " + spec.id + ": not running");
    cached = netns_.emplace(spec.id, Netns{info.pid, info.start_time_ticks, std::move(fd)}).first;
  }
  return cached->second.fd.get();
}

Result<UniqueFd> ProcessDriver::socket_namespace(const SandboxSpec& spec, const RuntimeInfo& info) {
  auto netns = netns_of(spec, info);
  if (!netns) return netns.failure();
  UniqueFd copy(::fcntl(*netns, F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) return fail_errno("sandbox " + spec.id + ": dup of its network namespace", errno);
  return copy;
}

Result<std::vector<GuestSocket>> ProcessDriver::open_sockets(const SandboxSpec& spec, const RuntimeInfo& info,
                                                             uint16_t port, size_t count) {
  auto netns = netns_of(spec, info);
  if (!netns) return netns.failure();

  // setns() switches only the calling thread; a socket keeps the namespace it was created in. One setns()
  // pair for all `count`: a refill of a proxy's spares is one node call, and the pair is most of its cost
  // after the call itself.
  if (::setns(*netns, CLONE_NEWNET) != 0)
    return fail_errno("sandbox " + spec.id + ": setns into its network namespace", errno);
  std::vector<GuestSocket> sockets;
  sockets.reserve(count);
  int socket_errno = 0;
  for (size_t i = 0; i < count && socket_errno == 0; ++i) {
    UniqueFd sock(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!sock.valid()) socket_errno = errno;
    else sockets.push_back(GuestSocket{.fd = std::move(sock), .connected = false, .connect_port = port});
  }
  if (::setns(host_netns_.get(), CLONE_NEWNET) != 0) {
    // Every later connection of this thread would silently go to the wrong network: make it loud.
    const int err = errno;
    spdlog::critical("cannot return to the host network namespace: {}", std::strerror(err));
    return fail_errno("setns back into the host network namespace", err);
  }
  if (socket_errno != 0) return fail_errno("sandbox " + spec.id + ": socket", socket_errno);
  return sockets;
}

}  // namespace

Result<std::unique_ptr<Driver>> make_process_driver(uv_loop_t* loop, const NodeConfig& cfg,
                                                    snapshot::ImageStore* images, SandboxEgress* egress) {
  const std::string& parent = cfg.cgroup_name;
  if (parent.empty() || parent.front() == '/' || parent.find("..") != std::string::npos)
    return fail(Error::kInvalidArgument, "node.cgroup_name must be a relative path without \"..\": \"" + parent + "\"");

  auto detection = detect_cgroups();
  if (!detection) return detection.failure();
  const std::string description = detection->describe();
  std::string_view text = description;
  while (!text.empty()) {
    size_t end = text.find('\n');
    spdlog::info("process driver: {}", text.substr(0, end));
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  if (detection->freeze.version == CgroupVersion::kNone)
    spdlog::warn("process driver: no cgroup freezer on this host; sandboxes cannot be paused");
  if (detection->memory.version == CgroupVersion::kNone)
    spdlog::warn("process driver: no memory controller on this host; sandboxes run without memory limits");
  if (detection->cpu.version == CgroupVersion::kNone)
    spdlog::warn("process driver: no cpu controller on this host; sandboxes run without cpu limits");

  std::string init_path = cfg.init_path;
  if (init_path.empty()) {
    auto found = default_init_path();
    if (!found) return found.failure();
    init_path = std::move(*found);
  }
  // Not fatal: the operator may install it after starting; start() then reports the exact error.
  if (::access(init_path.c_str(), X_OK) != 0)
    spdlog::warn("process driver: {}", errno_text("sandbox init " + init_path + " is not executable", errno));

  // thread-self rather than self: setns() is per thread, and this is the thread the driver runs on.
  UniqueFd host_netns(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  if (!host_netns.valid()) return fail_errno("open /proc/thread-self/ns/net", errno);

  std::unique_ptr<Driver> driver =
      std::make_unique<ProcessDriver>(loop, cfg, images, CgroupManager(std::move(*detection), parent), std::move(init_path),
                                      find_agent(cfg), std::move(host_netns), egress);
  return driver;
}

}  // namespace sg
