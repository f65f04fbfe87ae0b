// sandgate-init: PID 1 inside a process sandbox's fresh PID, mount, network, UTS, IPC and cgroup namespaces.
//
//   sandgate-init --hostname NAME --cwd DIR --log FILE --log-max BYTES --sandbox-dir DIR --userns-fd FD --uid-base UID
//                 --layer TREE [--layer TREE]... [--disk FILE] [--agent PATH --agent-listen ADDR:PORT]
//                 [--agent-ssh-listen ADDR:PORT --ssh-host-dir DIR --ssh-keys-dir DIR] [--sched batch|normal]
//                 -- CMD ARGS...
//
// The node starts it as host root in namespaces owned by the initial user namespace, so the mounts below are
// made by host root and the sandbox's root (which only ever has capabilities in its own user namespace) can
// change none of them. It then builds the sandbox's root filesystem and moves into it (docs/security.md,
// "Process sandbox boundary"):
//   1. each --layer (bottom first) made an idmapped mount onto the user namespace FD (on-disk uid 0 appears
//      as the sandbox's root), under <sandbox-dir>/lower/N;
//   2. an overlayfs of those with <sandbox-dir>/upper (owned by UID, the sandbox's root on the host) and
//      <sandbox-dir>/work, mounted at <sandbox-dir>/root; with --disk FILE (disk_mb), upper and work live on
//      that ext4 file instead, mounted through a loop device at <sandbox-dir>/disk, so writes past its size
//      fail with ENOSPC;
//   3. pivot_root into it, the old root detached;
//   4. a minimal /dev, a proc of this PID namespace with /proc/sys read-only and the usual paths masked, /sys
//      read-only, and PATH (sandgate-agent) bind-mounted read-only at /.sandgate/agent (the host's files
//      cloned as detached mounts before the pivot, attached after it);
//   5. setns into the user namespace and setresuid/setresgid 0 there (host uid UID);
//   6. confinement (noderuntime/confinement.h): Docker's default capabilities, no_new_privs, seccomp.
// With --sched batch (node.batch_scheduling) it and everything it starts run under SCHED_BATCH: a sandbox's
// process woken by a packet does not preempt the task that woke it (the proxy, the node), it gets its CPU
// share at the next scheduler tick instead (docs/security.md, "CPU scheduling").
// It opens the sandbox log (a host file, opened first; see Log below: capped at BYTES, one older generation
// in FILE.1), then runs CMD with the environment it was given, its output relayed to the log. As PID 1 it must forward signals (the kernel drops unhandled signals aimed at a namespace init) and
// reap orphans (they are reparented to it). It exits with CMD's status; the kernel then kills whatever else
// is left in the namespace.
//
// With --agent it also runs `/.sandgate/agent --listen ADDR:PORT` next to CMD, same namespaces, cgroup and
// environment. The agent is a helper, not the sandbox: when it exits it is restarted after a backoff
// (1 s doubling to 30 s, back to 1 s after it has run for 30 s), and it never ends the sandbox. Signals go to
// CMD only; the agent dies with the namespace when CMD ends. With --agent-ssh-listen the agent also serves
// SSH there (docs/ssh.md): the host's --ssh-host-dir (the sandbox's host key) appears read-only at
// /.sandgate/ssh and --ssh-keys-dir (the node's authorized_keys, rewritten by renames the bind shows at
// once) read-only at /.sandgate/ssh-keys.
//
// Deliberately libc-only (plus the static libseccomp of confinement.cc): it runs in every sandbox and
// should start fast and never break with the daemon's dependencies.
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <grp.h>
#include <linux/loop.h>
#include <sched.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "noderuntime/confinement.h"

namespace {

// Exit codes follow the shell's conventions: 127 = the command could not be executed; 125 = the sandbox
// itself could not be set up (so the two are never confused with the command's own failures).
constexpr int kExitSetupFailed = 125;
constexpr int kExitExecFailed = 127;
constexpr int kExitUsage = 2;

constexpr int kForwardedSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

constexpr long kAgentBackoffMinMs = 1'000;
constexpr long kAgentBackoffMaxMs = 30'000;
constexpr long kAgentHealthyRunMs = 30'000;  // an agent that ran this long gets the minimum backoff again

// overlayfs stacks at most this many lower layers (snapshot::kMaxImageLayers).
constexpr int kMaxLayers = 128;
// Where the node's sandgate-agent appears inside every sandbox (read-only bind mount).
constexpr const char* kAgentInSandbox = "/.sandgate/agent";
constexpr const char* kSshHostDirInSandbox = "/.sandgate/ssh";
constexpr const char* kSshKeysDirInSandbox = "/.sandgate/ssh-keys";
constexpr const char* kSshHostKeyInSandbox = "/.sandgate/ssh/host_ed25519";
constexpr const char* kSshAuthorizedKeysInSandbox = "/.sandgate/ssh-keys/authorized_keys";

struct Options {
  const char* hostname = nullptr;
  const char* cwd = nullptr;
  const char* log = nullptr;
  const char* log_max = nullptr;       // bytes output.log may reach before it is rotated to <log>.1
  const char* agent = nullptr;         // optional: sandgate-agent's path
  const char* agent_listen = nullptr;  // its --listen argument
  const char* agent_ssh_listen = nullptr;  // optional, with --agent: its --ssh-listen argument
  const char* ssh_host_dir = nullptr;      // host dir holding host_ed25519, bound at kSshHostDirInSandbox
  const char* ssh_keys_dir = nullptr;      // host dir holding authorized_keys, bound at kSshKeysDirInSandbox
  const char* sandbox_dir = nullptr;   // upper/, work/, lower/N and root/ live here
  const char* userns_fd = nullptr;     // the sandbox's user namespace, inherited from the node
  const char* uid_base = nullptr;      // host uid (and gid) of the sandbox's root
  const char* disk = nullptr;          // optional: ext4 file the upper dir lives on (disk_mb)
  const char* sched = nullptr;         // optional: "batch" or "normal" (the default)
  const char* layers[kMaxLayers] = {};  // image layer trees, bottom first
  int layer_count = 0;
  char** command = nullptr;            // NULL-terminated, from argv
};

bool parse_options(int argc, char** argv, Options* out) {
  int i = 1;
  for (; i < argc; ++i) {
    if (strcmp(argv[i], "--") == 0) break;
    if (i + 1 >= argc) return false;
    const char** target = nullptr;
    if (strcmp(argv[i], "--hostname") == 0) target = &out->hostname;
    if (strcmp(argv[i], "--cwd") == 0) target = &out->cwd;
    if (strcmp(argv[i], "--log") == 0) target = &out->log;
    if (strcmp(argv[i], "--log-max") == 0) target = &out->log_max;
    if (strcmp(argv[i], "--agent") == 0) target = &out->agent;
    if (strcmp(argv[i], "--agent-listen") == 0) target = &out->agent_listen;
    if (strcmp(argv[i], "--agent-ssh-listen") == 0) target = &out->agent_ssh_listen;
    if (strcmp(argv[i], "--ssh-host-dir") == 0) target = &out->ssh_host_dir;
    if (strcmp(argv[i], "--ssh-keys-dir") == 0) target = &out->ssh_keys_dir;
    if (strcmp(argv[i], "--sandbox-dir") == 0) target = &out->sandbox_dir;
    if (strcmp(argv[i], "--userns-fd") == 0) target = &out->userns_fd;
    if (strcmp(argv[i], "--uid-base") == 0) target = &out->uid_base;
    if (strcmp(argv[i], "--disk") == 0) target = &out->disk;
    if (strcmp(argv[i], "--sched") == 0) target = &out->sched;
    if (strcmp(argv[i], "--layer") == 0) {
      if (out->layer_count == kMaxLayers) return false;
      target = &out->layers[out->layer_count++];
    }
    if (target == nullptr) return false;
    *target = argv[++i];
  }
  if (i + 1 >= argc || !out->hostname || !out->cwd || !out->log || !out->log_max || !out->sandbox_dir ||
      !out->userns_fd ||
      !out->uid_base || out->layer_count == 0)
    return false;
  if ((out->agent == nullptr) != (out->agent_listen == nullptr)) return false;
  bool ssh = out->agent_ssh_listen != nullptr;
  if (ssh != (out->ssh_host_dir != nullptr) || ssh != (out->ssh_keys_dir != nullptr)) return false;
  if (ssh && out->agent == nullptr) return false;
  if (out->sched != nullptr && strcmp(out->sched, "batch") != 0 && strcmp(out->sched, "normal") != 0) return false;
  out->command = argv + i + 1;
  return true;
}

[[noreturn]] void die(const char* what, const char* detail) {
  fprintf(stderr, "sandgate-init: %s%s%s: %s\n", what, detail ? " " : "", detail ? detail : "", strerror(errno));
  exit(kExitSetupFailed);
}

void bring_loopback_up() {
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) die("socket for configuring", "lo");
  struct ifreq req;
  memset(&req, 0, sizeof req);
  strncpy(req.ifr_name, "lo", IFNAMSIZ - 1);
  if (ioctl(fd, SIOCGIFFLAGS, &req) != 0) die("SIOCGIFFLAGS", "lo");
  req.ifr_flags = static_cast<short>(req.ifr_flags | IFF_UP | IFF_RUNNING);
  if (ioctl(fd, SIOCSIFFLAGS, &req) != 0) die("SIOCSIFFLAGS", "lo");
  close(fd);
}

// The sandbox's output (command and agent, stdout and stderr) reaches the log through a pipe the init reads,
// so the log on the host stays within --log-max bytes: when the next chunk would pass it, output.log is
// copied to output.log.1 (one older generation) and starts again empty. Both files are opened before the
// pivot (they are host files); the init itself writes its few lines straight to output.log.
constexpr size_t kRelayChunk = 64 * 1024;  // also the smallest --log-max the node sends

struct Log {
  int fd = -1;        // output.log: O_APPEND, readable for the copy
  int previous = -1;  // output.log.1
  long long max = 0;
  int pipe_read = -1;   // non-blocking
  int pipe_write = -1;  // what the command and the agent get as stdout and stderr
};

Log open_log(const char* log_path, const char* max_text) {
  Log log;
  char* end = nullptr;
  log.max = strtoll(max_text, &end, 10);
  if (*end != '\0' || log.max < static_cast<long long>(kRelayChunk)) die("bad --log-max", max_text);
  int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) die("open", "/dev/null");
  // O_APPEND: the log survives restarts of the sandbox and concurrent writers never overwrite each other.
  log.fd = open(log_path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log.fd < 0) die("open log", log_path);
  if (dup2(null_fd, STDIN_FILENO) < 0 || dup2(log.fd, STDOUT_FILENO) < 0 || dup2(log.fd, STDERR_FILENO) < 0)
    die("dup2 onto stdio for", log_path);
  close(null_fd);
  char previous[4096];
  if (snprintf(previous, sizeof previous, "%s.1", log_path) >= static_cast<int>(sizeof previous)) {
    errno = ENAMETOOLONG;
    die("open", log_path);
  }
  log.previous = open(previous, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (log.previous < 0) die("open", previous);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) die("pipe2 for", "the sandbox's output");
  log.pipe_read = fds[0];
  log.pipe_write = fds[1];
  if (fcntl(log.pipe_read, F_SETFL, O_NONBLOCK) != 0) die("fcntl O_NONBLOCK", "on the output pipe");
  return log;
}

// output.log -> output.log.1, output.log empty. A failure keeps the current log growing rather than losing
// output: the cap is then exceeded, which the message says.
void rotate(const Log& log) {
  if (ftruncate(log.previous, 0) != 0) {
    fprintf(stderr, "sandgate-init: cannot truncate the previous log: %s\n", strerror(errno));
    return;
  }
  loff_t in = 0, out = 0;
  for (;;) {
    ssize_t n = copy_file_range(log.fd, &in, log.previous, &out, 1 << 30, 0);
    if (n == 0) break;
    if (n < 0) {
      fprintf(stderr, "sandgate-init: cannot rotate the log: %s\n", strerror(errno));
      return;
    }
  }
  if (ftruncate(log.fd, 0) != 0) fprintf(stderr, "sandgate-init: cannot truncate the log: %s\n", strerror(errno));
}

// Moves what the pipe holds to the log, one chunk per call (`drain`: until it is empty).
void relay(const Log& log, bool drain) {
  static char buf[kRelayChunk];
  do {
    ssize_t n = read(log.pipe_read, buf, sizeof buf);
    if (n <= 0) return;  // EAGAIN: empty for now
    struct stat st;
    if (fstat(log.fd, &st) == 0 && st.st_size > 0 && st.st_size + n > log.max) rotate(log);
    ssize_t written = 0;
    while (written < n) {
      ssize_t w = write(log.fd, buf + written, static_cast<size_t>(n - written));
      if (w <= 0) return;  // a full disk: the output is dropped rather than blocking the sandbox
      written += w;
    }
  } while (drain);
}

// The per-netns sysctl that lets an unprivileged user bind ports below 1024. The network namespace belongs
// to the initial user namespace, where the sandbox's root has no CAP_NET_BIND_SERVICE; sshd on port 22 must
// still work, and the namespace holds nothing but the sandbox's own loopback.
void allow_low_ports() {
  int fd = open("/proc/sys/net/ipv4/ip_unprivileged_port_start", O_WRONLY | O_CLOEXEC);
  if (fd < 0) die("open", "/proc/sys/net/ipv4/ip_unprivileged_port_start");
  if (write(fd, "0", 1) != 1) die("write", "/proc/sys/net/ipv4/ip_unprivileged_port_start");
  close(fd);
}

// "<a>/<b>" into buf, or die: every path here is bounded by PATH_MAX.
const char* join(char* buf, size_t size, const char* a, const char* b) {
  int n = snprintf(buf, size, "%s/%s", a, b);
  if (n < 0 || static_cast<size_t>(n) >= size) {
    errno = ENAMETOOLONG;
    die("build a path under", a);
  }
  return buf;
}

// A directory the sandbox's root owns (created as host root, so chown it into the sandbox's range).
void make_dir(const char* path, mode_t mode, uid_t owner) {
  if (mkdir(path, mode) != 0) {
    if (errno == EEXIST) return;
    die("mkdir", path);
  }
  if (chown(path, owner, owner) != 0) die("chown", path);
}

void make_file(const char* path, uid_t owner) {
  int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0755);
  if (fd < 0) die("create", path);
  if (fchown(fd, owner, owner) != 0) die("chown", path);
  close(fd);
}

void make_symlink(const char* target, const char* path, uid_t owner) {
  if (symlink(target, path) != 0) die("symlink", path);
  if (lchown(path, owner, owner) != 0) die("chown", path);
}

void bind(const char* from, const char* to, unsigned long extra_flags) {
  if (mount(from, to, nullptr, MS_BIND | MS_REC, nullptr) != 0) die("bind mount onto", to);
  // A bind mount ignores flags; they take effect on the remount.
  if (extra_flags != 0 && mount(nullptr, to, nullptr, MS_REMOUNT | MS_BIND | extra_flags, nullptr) != 0)
    die("remount read-only", to);
}

// Layer `index` of the image as an idmapped mount at lower/<index>: files owned by 0 on disk appear owned
// by the sandbox's root. Read-only: the layer store is shared by every sandbox on the node.
void mount_layer(const char* tree, int index, int userns_fd) {
  char target[64];
  snprintf(target, sizeof target, "lower/%d", index);
  if (mkdir(target, 0700) != 0 && errno != EEXIST) die("mkdir", target);
  int tree_fd = static_cast<int>(open_tree(AT_FDCWD, tree, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
  if (tree_fd < 0) die("open_tree", tree);
  struct mount_attr attr;
  memset(&attr, 0, sizeof attr);
  attr.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
  attr.userns_fd = static_cast<uint64_t>(userns_fd);
  if (mount_setattr(tree_fd, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0) die("idmap the mount of", tree);
  if (move_mount(tree_fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) != 0) die("move_mount onto", target);
  close(tree_fd);
}

// disk_mb: `image` on a free loop device (released by the kernel with the last mount of it, i.e. when the
// sandbox's mount namespace goes), its ext4 mounted at `target`; upper/ and work/ are made in it.
void mount_disk(const char* image, const char* target, uid_t owner) {
  if (mkdir(target, 0700) != 0 && errno != EEXIST) die("mkdir", target);
  int control = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
  if (control < 0) die("open", "/dev/loop-control");
  for (int attempt = 0;; ++attempt) {
    int number = ioctl(control, LOOP_CTL_GET_FREE);
    if (number < 0) die("LOOP_CTL_GET_FREE for", image);
    char device[32];
    snprintf(device, sizeof device, "/dev/loop%d", number);
    int loop = open(device, O_RDWR | O_CLOEXEC);
    if (loop < 0) die("open", device);
    int file = open(image, O_RDWR | O_CLOEXEC);
    if (file < 0) die("open", image);
    struct loop_config config;
    memset(&config, 0, sizeof config);
    config.fd = static_cast<uint32_t>(file);
    config.info.lo_flags = LO_FLAGS_AUTOCLEAR;
    int rc = ioctl(loop, LOOP_CONFIGURE, &config);
    close(file);
    // EBUSY: another process took that free device first; ask for the next one.
    if (rc != 0 && (errno != EBUSY || attempt == 16)) die("LOOP_CONFIGURE", device);
    if (rc == 0) {
      if (mount(device, target, "ext4", MS_NOSUID | MS_NODEV, nullptr) != 0) die("mount ext4 of", image);
      close(loop);
      break;
    }
    close(loop);
  }
  close(control);
  char path[64];
  snprintf(path, sizeof path, "%s/upper", target);
  make_dir(path, 0755, owner);
  snprintf(path, sizeof path, "%s/work", target);
  if (mkdir(path, 0700) != 0 && errno != EEXIST) die("mkdir", path);
}

// Steps 1-2: the overlay at <sandbox-dir>/root. Relative lowerdir paths (resolved against the cwd, the
// sandbox dir) keep the option string short even with kMaxLayers layers.
void mount_root(const Options& opts, int userns_fd, uid_t owner) {
  if (chdir(opts.sandbox_dir) != 0) die("chdir", opts.sandbox_dir);
  if (opts.disk != nullptr) mount_disk(opts.disk, "disk", owner);
  if (mkdir("lower", 0700) != 0 && errno != EEXIST) die("mkdir", "lower");
  for (int i = 0; i < opts.layer_count; ++i) mount_layer(opts.layers[i], i, userns_fd);
  // overlayfs lists the top layer first.
  char options[4096] = "lowerdir=";
  size_t used = strlen(options);
  for (int i = opts.layer_count - 1; i >= 0; --i) {
    int n = snprintf(options + used, sizeof options - used, "lower/%d%s", i, i > 0 ? ":" : "");
    used += static_cast<size_t>(n);
  }
  // Every change a plain entry of the upper dir, whatever the kernel's defaults: a checkpoint seals the upper
  // dir as a layer (snapshot/checkpoint_delta.h), which a redirect or a metacopy-only file would leave
  // incomplete (the data would stay in a lower layer under another path).
  snprintf(options + used, sizeof options - used, "%s,redirect_dir=off,index=off,metacopy=off",
           opts.disk != nullptr ? ",upperdir=disk/upper,workdir=disk/work" : ",upperdir=upper,workdir=work");
  if (mkdir("root", 0700) != 0 && errno != EEXIST) die("mkdir", "root");
  if (mount("overlay", "root", "overlay", MS_NOSUID | MS_NODEV, options) != 0) die("mount overlay on", "root");
}

// Host files bound into /dev; the sandbox cannot create device nodes of its own (no CAP_MKNOD over them in
// the initial user namespace, and the tmpfs is nodev for anything but these binds).
constexpr const char* kDevices[] = {"null", "zero", "full", "random", "urandom", "tty"};
constexpr int kDeviceCount = sizeof kDevices / sizeof kDevices[0];
// Docker's masked /proc paths: kernel memory, keys, timers and the magic sysrq key.
constexpr const char* kMaskedFiles[] = {"proc/kcore",       "proc/keys",         "proc/timer_list",
                                        "proc/sched_debug", "proc/latency_stats", "proc/sysrq-trigger"};
constexpr const char* kMaskedDirs[] = {"proc/acpi", "proc/scsi", "sys/firmware"};
constexpr const char* kReadOnlyProc[] = {"proc/sys", "proc/irq", "proc/bus", "proc/fs"};

// What the sandbox's root gets from the host, cloned as detached mounts while the host's tree is still
// there. They are attached only after pivot_root, so every path they land on is resolved inside the sandbox's
// root: a symlink the sandbox left in its upper dir (/dev -> /etc, say) can never point a host-root mkdir,
// chown or mount at the host's files.
struct HostMounts {
  int devices[kDeviceCount];
  int agent = -1;
  int ssh_host_dir = -1;
  int ssh_keys_dir = -1;
};

int clone_tree(const char* path, unsigned int extra_attrs) {
  int fd = static_cast<int>(open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
  if (fd < 0) die("open_tree", path);
  if (extra_attrs != 0) {
    struct mount_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.attr_set = extra_attrs;
    if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0) die("mount_setattr", path);
  }
  return fd;
}

HostMounts clone_host_mounts(const Options& opts) {
  HostMounts m;
  char path[64];
  for (int i = 0; i < kDeviceCount; ++i) m.devices[i] = clone_tree(join(path, sizeof path, "/dev", kDevices[i]), 0);
  if (opts.agent != nullptr) m.agent = clone_tree(opts.agent, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
  const unsigned int data_only = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
  if (opts.ssh_host_dir != nullptr) m.ssh_host_dir = clone_tree(opts.ssh_host_dir, data_only);
  if (opts.ssh_keys_dir != nullptr) m.ssh_keys_dir = clone_tree(opts.ssh_keys_dir, data_only);
  return m;
}

void attach(int tree_fd, const char* target) {
  if (move_mount(tree_fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) != 0) die("move_mount onto", target);
  close(tree_fd);
}

// Step 4, in the sandbox's root (cwd and root: "/").
void populate_root(const HostMounts& host, uid_t owner) {
  char buf[4096];
  make_dir("proc", 0555, owner);
  if (mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) die("mount proc on", "/proc");
  for (const char* path : kReadOnlyProc) {
    struct stat st;
    if (stat(path, &st) == 0) bind(path, path, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC);
  }

  make_dir("sys", 0555, owner);
  if (mount("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
    die("mount sysfs on", "/sys");
  for (const char* path : kMaskedDirs) {
    struct stat st;
    if (stat(path, &st) == 0 && mount("tmpfs", path, "tmpfs", MS_RDONLY, "size=4k") != 0) die("mask", path);
  }

  make_dir("dev", 0755, owner);
  snprintf(buf, sizeof buf, "mode=755,size=1m,uid=%u,gid=%u", owner, owner);
  if (mount("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, buf) != 0) die("mount tmpfs on", "/dev");
  for (int i = 0; i < kDeviceCount; ++i) {
    join(buf, sizeof buf, "dev", kDevices[i]);
    make_file(buf, owner);
    attach(host.devices[i], buf);
  }
  // /dev/null is the host's now: the masks are binds of it.
  for (const char* path : kMaskedFiles) {
    struct stat st;
    if (stat(path, &st) == 0) bind("dev/null", path, 0);
  }
  make_dir("dev/pts", 0755, owner);
  if (mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") != 0)
    die("mount devpts on", "/dev/pts");
  make_symlink("pts/ptmx", "dev/ptmx", owner);
  make_dir("dev/shm", 01777, owner);
  snprintf(buf, sizeof buf, "mode=1777,uid=%u,gid=%u", owner, owner);
  if (mount("tmpfs", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, buf) != 0) die("mount tmpfs on", "/dev/shm");
  const char* links[][2] = {{"/proc/self/fd", "dev/fd"},
                            {"/proc/self/fd/0", "dev/stdin"},
                            {"/proc/self/fd/1", "dev/stdout"},
                            {"/proc/self/fd/2", "dev/stderr"}};
  for (const auto& link : links) make_symlink(link[0], link[1], owner);

  if (host.agent >= 0) {
    make_dir(".sandgate", 0755, owner);
    make_file(kAgentInSandbox + 1, owner);
    attach(host.agent, kAgentInSandbox + 1);
  }
  if (host.ssh_host_dir >= 0) {
    make_dir(kSshHostDirInSandbox + 1, 0700, owner);
    attach(host.ssh_host_dir, kSshHostDirInSandbox + 1);
  }
  if (host.ssh_keys_dir >= 0) {
    make_dir(kSshKeysDirInSandbox + 1, 0755, owner);
    attach(host.ssh_keys_dir, kSshKeysDirInSandbox + 1);
  }
}

// Step 3: the overlay becomes "/", and nothing of the host's tree stays reachable.
void enter_root() {
  if (syscall(SYS_pivot_root, ".", ".") != 0) die("pivot_root into", "the sandbox root");
  if (umount2(".", MNT_DETACH) != 0) die("detach the old root", nullptr);
  if (chdir("/") != 0) die("chdir", "/");
}

// Step 5. After setns the process's ids are host root's, which the namespace does not map: become its root.
void enter_user_namespace(int userns_fd) {
  if (setns(userns_fd, CLONE_NEWUSER) != 0) die("setns into the sandbox's user namespace", nullptr);
  close(userns_fd);
  if (setgroups(0, nullptr) != 0) die("setgroups", nullptr);
  if (setresgid(0, 0, 0) != 0) die("setresgid", "0");
  if (setresuid(0, 0, 0) != 0) die("setresuid", "0");
}

void set_up_namespaces(const Options& opts) {
  // Private first, so nothing mounted below ever propagates to the host.
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) die("make mounts private under", "/");
  // The node put this process into its cgroup before letting it run: that cgroup becomes the namespace's root.
  if (unshare(CLONE_NEWCGROUP) != 0) die("unshare", "the cgroup namespace");
  bring_loopback_up();
  allow_low_ports();
  if (sethostname(opts.hostname, strlen(opts.hostname)) != 0) die("sethostname", opts.hostname);

  char* end = nullptr;
  long userns_fd = strtol(opts.userns_fd, &end, 10);
  if (*end != '\0' || userns_fd < 0) die("bad --userns-fd", opts.userns_fd);
  unsigned long owner = strtoul(opts.uid_base, &end, 10);
  if (*end != '\0' || owner == 0) die("bad --uid-base", opts.uid_base);
  mount_root(opts, static_cast<int>(userns_fd), static_cast<uid_t>(owner));
  if (chdir("root") != 0) die("chdir", "root");
  const HostMounts host = clone_host_mounts(opts);
  enter_root();
  populate_root(host, static_cast<uid_t>(owner));
  enter_user_namespace(static_cast<int>(userns_fd));
}

int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return kExitSetupFailed;
}

long now_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000 + ts.tv_nsec / 1'000'000;
}

// The agent's supervision state: PID 1 restarts it, never waits for it.
struct Agent {
  const char* path = nullptr;
  const char* listen = nullptr;
  const char* ssh_listen = nullptr;  // NULL: no SSH server
  pid_t pid = 0;            // 0 while not running
  long started_ms = 0;
  long backoff_ms = kAgentBackoffMinMs;
  long restart_at_ms = -1;  // when the next start is due; -1 = none pending
  int output = -1;          // its stdout and stderr: the log pipe
};

void start_agent(Agent* agent, const sigset_t* original_mask) {
  agent->restart_at_ms = -1;
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "sandgate-init: cannot fork sandgate-agent: %s; retrying in %ld ms\n", strerror(errno),
            agent->backoff_ms);
    agent->restart_at_ms = now_ms() + agent->backoff_ms;
    return;
  }
  if (pid == 0) {
    sigprocmask(SIG_SETMASK, original_mask, nullptr);
    if (dup2(agent->output, STDOUT_FILENO) < 0 || dup2(agent->output, STDERR_FILENO) < 0) _exit(kExitSetupFailed);
    char* args[] = {const_cast<char*>(agent->path), const_cast<char*>("--listen"),
                          const_cast<char*>(agent->listen), const_cast<char*>("--ssh-listen"),
                          const_cast<char*>(agent->ssh_listen), const_cast<char*>("--ssh-host-key"),
                          const_cast<char*>(kSshHostKeyInSandbox), const_cast<char*>("--ssh-authorized-keys"),
                          const_cast<char*>(kSshAuthorizedKeysInSandbox), nullptr};
    if (agent->ssh_listen == nullptr) args[3] = nullptr;  // no SSH: the argument list ends after --listen
    execv(agent->path, args);
    fprintf(stderr, "sandgate-init: cannot execute %s: %s\n", agent->path, strerror(errno));
    _exit(kExitExecFailed);
  }
  agent->pid = pid;
  agent->started_ms = now_ms();
}

void agent_exited(Agent* agent, int wait_status) {
  long ran_ms = now_ms() - agent->started_ms;
  if (ran_ms >= kAgentHealthyRunMs) agent->backoff_ms = kAgentBackoffMinMs;
  fprintf(stderr, "sandgate-init: sandgate-agent (pid %d) exited with status %d after %ld ms; restarting in %ld ms\n",
          agent->pid, exit_code_of(wait_status), ran_ms, agent->backoff_ms);
  agent->pid = 0;
  agent->restart_at_ms = now_ms() + agent->backoff_ms;
  agent->backoff_ms = agent->backoff_ms * 2 > kAgentBackoffMaxMs ? kAgentBackoffMaxMs : agent->backoff_ms * 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options opts;
  if (!parse_options(argc, argv, &opts)) {
    fprintf(stderr,
            "usage: sandgate-init --hostname NAME --cwd DIR --log FILE --log-max BYTES --sandbox-dir DIR --userns-fd FD "
            "--uid-base UID --layer TREE... [--disk FILE] [--agent PATH --agent-listen ADDR:PORT] [--agent-ssh-listen ADDR:PORT --ssh-host-dir DIR "
            "--ssh-keys-dir DIR] [--sched batch|normal] -- CMD [ARGS...]\n");
    return kExitUsage;
  }
  // The log comes first so that every later setup error lands where the sandbox's owner will look.
  const Log log = open_log(opts.log, opts.log_max);
  set_up_namespaces(opts);
  if (chdir(opts.cwd) != 0) die("chdir", opts.cwd);
  if (opts.sched != nullptr && strcmp(opts.sched, "batch") == 0) {
    // Inherited by every process of the sandbox (fork keeps the policy). Not a boundary: a process may go
    // back to SCHED_OTHER itself, which costs only its neighbours.
    const struct sched_param param = {0};
    if (sched_setscheduler(0, SCHED_BATCH, &param) != 0) die("sched_setscheduler(SCHED_BATCH)", nullptr);
  }
  // From here on the init itself is confined, and so is everything it starts.
  if (sg::Status s = sg::confine_current_process(); !s) {
    fprintf(stderr, "sandgate-init: %s\n", s.message().c_str());
    return kExitSetupFailed;
  }

  // Blocked signals are queued for PID 1 instead of dropped, and the signalfd then hands them over one at a
  // time without async-signal-safety concerns. Blocking before fork() also means no SIGCHLD can be missed.
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGCHLD);
  for (int sig : kForwardedSignals) sigaddset(&handled, sig);
  sigset_t original_mask;
  if (sigprocmask(SIG_BLOCK, &handled, &original_mask) != 0) die("sigprocmask", nullptr);
  const int signals = signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signals < 0) die("signalfd", nullptr);

  pid_t command_pid = fork();
  if (command_pid < 0) die("fork", nullptr);
  if (command_pid == 0) {
    sigprocmask(SIG_SETMASK, &original_mask, nullptr);
    if (dup2(log.pipe_write, STDOUT_FILENO) < 0 || dup2(log.pipe_write, STDERR_FILENO) < 0) _exit(kExitSetupFailed);
    execvp(opts.command[0], opts.command);
    fprintf(stderr, "sandgate-init: cannot execute %s: %s\n", opts.command[0], strerror(errno));
    _exit(kExitExecFailed);
  }

  Agent agent;
  agent.path = opts.agent != nullptr ? kAgentInSandbox : nullptr;
  agent.listen = opts.agent_listen;
  agent.ssh_listen = opts.agent_ssh_listen;
  agent.output = log.pipe_write;
  if (agent.path != nullptr) start_agent(&agent, &original_mask);

  for (;;) {
    int timeout_ms = -1;
    if (agent.restart_at_ms >= 0) {
      long wait_ms = agent.restart_at_ms - now_ms();
      if (wait_ms <= 0) {
        start_agent(&agent, &original_mask);
        continue;
      }
      timeout_ms = static_cast<int>(wait_ms);
    }
    struct pollfd fds[2] = {{signals, POLLIN, 0}, {log.pipe_read, POLLIN, 0}};
    if (poll(fds, 2, timeout_ms) <= 0) continue;  // the restart is due, or EINTR
    if (fds[1].revents != 0) relay(log, false);
    struct signalfd_siginfo info;
    while (read(signals, &info, sizeof info) == static_cast<ssize_t>(sizeof info)) {
      const int sig = static_cast<int>(info.ssi_signo);
      if (sig != SIGCHLD) {
        kill(command_pid, sig);
        continue;
      }
      // SIGCHLD coalesces: one delivery may stand for many exits, so reap until nothing is left.
      int status = 0;
      pid_t pid;
      while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        if (pid == command_pid) {
          relay(log, true);  // what the command wrote last
          return exit_code_of(status);
        }
        if (pid == agent.pid) agent_exited(&agent, status);
      }
    }
  }
}
