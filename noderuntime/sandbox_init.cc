// sandgate-init: PID 1 inside a process sandbox's fresh PID, mount, network, UTS and IPC namespaces.
//
//   sandgate-init --hostname NAME --cwd DIR --log FILE [--agent PATH --agent-listen ADDR:PORT] -- CMD ARGS...
//
// It finishes the namespace setup that only makes sense from inside (a private mount tree with its own /proc,
// loopback up, the hostname), points stdio at the sandbox log, then runs CMD with the environment it was
// given. As PID 1 it must forward signals (the kernel drops unhandled signals aimed at a namespace init) and
// reap orphans (they are reparented to it). It exits with CMD's status; the kernel then kills whatever else
// is left in the namespace.
//
// With --agent it also runs `PATH --listen ADDR:PORT` (sandgate-agent) next to CMD, same namespaces, cgroup
// and environment. The agent is a helper, not the sandbox: when it exits it is restarted after a backoff
// (1 s doubling to 30 s, back to 1 s after it has run for 30 s), and it never ends the sandbox. Signals go to
// CMD only; the agent dies with the namespace when CMD ends.
//
// Deliberately libc-only: it runs in every sandbox and should start fast and never break with the daemon's
// dependencies.
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

struct Options {
  const char* hostname = nullptr;
  const char* cwd = nullptr;
  const char* log = nullptr;
  const char* agent = nullptr;         // optional: sandgate-agent's path
  const char* agent_listen = nullptr;  // its --listen argument
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
    if (strcmp(argv[i], "--agent") == 0) target = &out->agent;
    if (strcmp(argv[i], "--agent-listen") == 0) target = &out->agent_listen;
    if (target == nullptr) return false;
    *target = argv[++i];
  }
  if (i + 1 >= argc || !out->hostname || !out->cwd || !out->log) return false;
  if ((out->agent == nullptr) != (out->agent_listen == nullptr)) return false;
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

void redirect_stdio(const char* log_path) {
  int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) die("open", "/dev/null");
  // O_APPEND: the log survives restarts of the sandbox and concurrent writers never overwrite each other.
  int log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log_fd < 0) die("open log", log_path);
  if (dup2(null_fd, STDIN_FILENO) < 0 || dup2(log_fd, STDOUT_FILENO) < 0 || dup2(log_fd, STDERR_FILENO) < 0)
    die("dup2 onto stdio for", log_path);
  close(null_fd);
  close(log_fd);
}

void set_up_namespaces(const Options& opts) {
  // Private first, so the /proc mounted next (and anything the command mounts) never propagates to the host.
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) die("make mounts private under", "/");
  // A proc of this PID namespace: `ps` inside shows only the sandbox's processes.
  if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) die("mount proc on", "/proc");
  bring_loopback_up();
  if (sethostname(opts.hostname, strlen(opts.hostname)) != 0) die("sethostname", opts.hostname);
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
  pid_t pid = 0;            // 0 while not running
  long started_ms = 0;
  long backoff_ms = kAgentBackoffMinMs;
  long restart_at_ms = -1;  // when the next start is due; -1 = none pending
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
    char* const args[] = {const_cast<char*>(agent->path), const_cast<char*>("--listen"),
                          const_cast<char*>(agent->listen), nullptr};
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
            "usage: sandgate-init --hostname NAME --cwd DIR --log FILE [--agent PATH --agent-listen ADDR:PORT] "
            "-- CMD [ARGS...]\n");
    return kExitUsage;
  }
  // The log comes first so that every later setup error lands where the sandbox's owner will look.
  redirect_stdio(opts.log);
  set_up_namespaces(opts);
  if (chdir(opts.cwd) != 0) die("chdir", opts.cwd);

  // Blocked signals are queued for PID 1 instead of dropped, and sigwaitinfo() then handles them one at a
  // time without async-signal-safety concerns. Blocking before fork() also means no SIGCHLD can be missed.
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGCHLD);
  for (int sig : kForwardedSignals) sigaddset(&handled, sig);
  sigset_t original_mask;
  if (sigprocmask(SIG_BLOCK, &handled, &original_mask) != 0) die("sigprocmask", nullptr);

  pid_t command_pid = fork();
  if (command_pid < 0) die("fork", nullptr);
  if (command_pid == 0) {
    sigprocmask(SIG_SETMASK, &original_mask, nullptr);
    execvp(opts.command[0], opts.command);
    fprintf(stderr, "sandgate-init: cannot execute %s: %s\n", opts.command[0], strerror(errno));
    _exit(kExitExecFailed);
  }

  Agent agent;
  agent.path = opts.agent;
  agent.listen = opts.agent_listen;
  if (agent.path != nullptr) start_agent(&agent, &original_mask);

  for (;;) {
    siginfo_t info;
    int sig;
    if (agent.restart_at_ms >= 0) {
      long wait_ms = agent.restart_at_ms - now_ms();
      if (wait_ms <= 0) {
        start_agent(&agent, &original_mask);
        continue;
      }
      struct timespec timeout = {wait_ms / 1000, (wait_ms % 1000) * 1'000'000};
      sig = sigtimedwait(&handled, &info, &timeout);
    } else {
      sig = sigwaitinfo(&handled, &info);
    }
    if (sig < 0) continue;  // the restart is due (EAGAIN), or EINTR from a signal outside the set (SIGSTOP...)
    if (sig != SIGCHLD) {
      kill(command_pid, sig);
      continue;
    }
    // SIGCHLD coalesces: one delivery may stand for many exits, so reap until nothing is left.
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      if (pid == command_pid) return exit_code_of(status);
      if (pid == agent.pid) agent_exited(&agent, status);
    }
  }
}
