#include "proxy/socket_maker.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/magic.h>
#include <linux/nsfs.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/log.h"
#include "common/net.h"
#include "common/vouched_netns.h"

namespace sg {
namespace {

constexpr uint32_t kProtocolVersion = 1;
struct Request {
  uint32_t version;
  uint32_t count;
};
struct Answer {
  int32_t error;  // 0 or an errno
  uint32_t count;
};

// ---- the maker's side ----

[[noreturn]] void die(const char* what, int err) {
  fprintf(stderr, "sandgate-proxy socket maker: %s: %s\n", what, strerror(err));
  _exit(1);
}

bool parse_number(const char* text, unsigned long max, unsigned long* out) {
  char* end = nullptr;
  errno = 0;
  unsigned long v = std::strtoul(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v > max) return false;
  *out = v;
  return true;
}

// Closes every descriptor from 3 up but `keep` (sorted).
void close_all_but(const std::vector<int>& keep) {
  unsigned first = 3;
  for (int fd : keep) {
    if (static_cast<unsigned>(fd) > first && ::close_range(first, static_cast<unsigned>(fd) - 1, 0) != 0)
      die("close_range", errno);
    first = static_cast<unsigned>(fd) + 1;
  }
  if (::close_range(first, ~0U, 0) != 0) die("close_range", errno);
}

// CAP_SYS_ADMIN alone, as uid:gid, for good.
void keep_only_sys_admin(uid_t uid, gid_t gid) {
  if (::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0) die("clear ambient capabilities", errno);
  for (int cap = 0; cap < 64; ++cap) {
    if (cap == CAP_SYS_ADMIN) continue;
    if (::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
      if (errno == EINVAL) break;  // past the kernel's last capability
      die("drop a capability from the bounding set", errno);
    }
  }
  if (::prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0) die("PR_SET_KEEPCAPS", errno);
  if (::setgroups(0, nullptr) != 0) die("setgroups", errno);
  if (::setresgid(gid, gid, gid) != 0) die("setresgid", errno);
  if (::setresuid(uid, uid, uid) != 0) die("setresuid", errno);
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  data[CAP_TO_INDEX(CAP_SYS_ADMIN)].effective = CAP_TO_MASK(CAP_SYS_ADMIN);
  data[CAP_TO_INDEX(CAP_SYS_ADMIN)].permitted = CAP_TO_MASK(CAP_SYS_ADMIN);
  if (::syscall(SYS_capset, &header, data) != 0) die("capset", errno);
  if (::prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0) != 0) die("PR_SET_KEEPCAPS off", errno);
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("PR_SET_NO_NEW_PRIVS", errno);
  // Checked, not assumed: what is left is what the comment above says.
  __user_cap_data_struct now[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, now) != 0) die("capget", errno);
  for (unsigned i = 0; i < _LINUX_CAPABILITY_U32S_3; ++i) {
    const uint32_t want = i == CAP_TO_INDEX(CAP_SYS_ADMIN) ? CAP_TO_MASK(CAP_SYS_ADMIN) : 0;
    if (now[i].effective != want || now[i].permitted != want || now[i].inheritable != 0)
      die("capabilities other than CAP_SYS_ADMIN are left", EPERM);
  }
  uid_t ru, eu, su;
  if (::getresuid(&ru, &eu, &su) != 0 || ru != uid || eu != uid || su != uid) die("the uid did not switch", EPERM);
}

// A descriptor of a network namespace: nsfs first, so no file of a FUSE mount is asked an ioctl.
bool is_network_namespace(int fd) {
  struct statfs fs{};
  return ::fstatfs(fd, &fs) == 0 && fs.f_type == NSFS_MAGIC && ::ioctl(fd, NS_GET_NSTYPE) == CLONE_NEWNET;
}

// One request on `end`: exactly a Request and one descriptor; anything else is refused. false: the
// worker's end is gone (or unusable).
bool answer_one(int end, const std::string& vouched, int home) {
  Request request{};
  iovec iov{&request, sizeof request};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 2)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = ::recvmsg(end, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  if (n == 0) return false;  // the worker's end closed
  std::vector<UniqueFd> passed;  // closed on return, whatever the answer (the kernel closed any beyond `control`)
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      passed.emplace_back(fd);
    }
  }
  Answer answer{0, 0};
  std::vector<UniqueFd> made;
  if (n != sizeof request || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || passed.size() != 1 ||
      request.version != kProtocolVersion || request.count == 0 || request.count > kMaxSpareSockets) {
    answer.error = EINVAL;
  } else if (!is_network_namespace(passed[0].get())) {
    answer.error = EINVAL;
  } else if (::setns(passed[0].get(), CLONE_NEWNET) != 0) {
    answer.error = errno;
  } else {
    for (uint32_t i = 0; i < request.count && answer.error == 0; ++i) {
      UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (s.valid()) made.push_back(std::move(s));
      else answer.error = errno;
      // The first socket tells the namespace's cookie, which names the node's mark (never an inode number,
      // which a later namespace may get).
      if (i == 0 && answer.error == 0 && !check_vouched(vouched, made.front().get())) answer.error = EACCES;
    }
    // Every later socket would be made in the sandbox's namespace: no way to go on.
    if (::setns(home, CLONE_NEWNET) != 0) die("setns back into its own network namespace", errno);
    if (answer.error != 0) made.clear();
  }
  passed.clear();  // before the answer: once the worker has it, the maker holds nothing of the request
  answer.count = static_cast<uint32_t>(made.size());
  std::vector<int> raw;
  for (const UniqueFd& s : made) raw.push_back(s.get());
  auto sent = send_with_fds(end, &answer, sizeof answer, raw);
  return sent && *sent == sizeof answer;
}

int serve(std::vector<int> ends, const std::string& vouched, int home) {
  while (!ends.empty()) {
    std::vector<pollfd> polls;
    for (int fd : ends) polls.push_back(pollfd{fd, POLLIN, 0});
    if (::poll(polls.data(), polls.size(), -1) < 0) {
      if (errno == EINTR) continue;
      die("poll", errno);
    }
    std::vector<int> open;
    for (const pollfd& p : polls) {
      bool keep = true;
      if (p.revents & POLLIN) keep = answer_one(p.fd, vouched, home);
      else if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) keep = false;
      if (keep) open.push_back(p.fd);
      else ::close(p.fd);
    }
    ends = std::move(open);
  }
  return 0;  // every worker's end closed: the proxy is gone
}

}  // namespace

// ---- the proxy's side ----

namespace {

// The maker's answer to one request on `end`: its errno (0 or why it refused) and the sockets. A failure:
// no usable answer (the end must not be used again: a late answer would be read as the next one's).
struct Answered {
  int error = 0;
  std::vector<UniqueFd> sockets;
};
Result<Answered> exchange(int end, int netns, size_t count) {
  const Request request{kProtocolVersion, static_cast<uint32_t>(count)};
  const int fds[] = {netns};
  auto sent = send_with_fds(end, &request, sizeof request, fds);
  if (!sent || *sent != sizeof request)
    return fail(Error::kUnavailable, "socket maker: " + (sent ? std::string("short send") : sent.message()));
  pollfd p{end, POLLIN, 0};
  int ready;
  do {
    ready = ::poll(&p, 1, SocketMakerClient::kAnswerTimeoutMs);
  } while (ready < 0 && errno == EINTR);
  if (ready <= 0)
    return fail(Error::kTimeout, "the socket maker did not answer within " +
                                     std::to_string(SocketMakerClient::kAnswerTimeoutMs) + " ms");
  Answer answer{};
  Answered out;
  bool would_block = false;
  auto n = recv_with_fds(end, &answer, sizeof answer, &out.sockets, &would_block);
  if (!n || would_block || *n != sizeof answer || answer.count != out.sockets.size() || out.sockets.size() > count ||
      (answer.error != 0 && answer.count != 0))
    return fail(Error::kUnavailable, "the socket maker's answer is unusable");
  out.error = answer.error;
  return out;
}

}  // namespace

Result<std::vector<UniqueFd>> SocketMakerClient::make(int netns, size_t count) {
  if (!end_.valid()) return fail(Error::kUnavailable, "the socket maker stopped answering");
  if (count == 0 || count > kMaxSpareSockets) return fail(Error::kInvalidArgument, "socket maker: bad count");
  auto answered = exchange(end_.get(), netns, count);
  if (!answered) return give_up(answered.failure());
  if (answered->error != 0) {
    const int err = answered->error;
    const Error code = err == EACCES ? Error::kPermissionDenied : err == EINVAL ? Error::kInvalidArgument : Error::kIo;
    // Each refusal is a connection answered 503 during an outage: said, but not once per connection.
    if (refusals_++ % 1000 == 0)
      spdlog::warn("the socket maker refused to make sockets ({} refusals so far): {}", refusals_, std::strerror(err));
    return fail(code, std::string("socket maker: ") + std::strerror(err));
  }
  return std::move(answered->sockets);
}

Failure SocketMakerClient::give_up(Failure why) {
  end_.reset();
  spdlog::error("{}: this worker makes no more sockets while the node is down", why.message);
  return why;
}

Result<SocketMaker> start_socket_maker(size_t workers, uid_t uid, gid_t gid, const std::string& vouched_dir,
                                       const std::string& executable) {
  if (::geteuid() != 0) return fail(Error::kPermissionDenied, "the socket maker needs root to start (it keeps CAP_SYS_ADMIN)");
  SocketMaker maker;
  std::vector<UniqueFd> ours, theirs;
  for (size_t i = 0; i < workers; ++i) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) return fail_errno("socketpair", errno);
    ours.emplace_back(pair[0]);
    theirs.emplace_back(pair[1]);
  }
  std::vector<std::string> args = {"sandgate-proxy", kSocketMakerFlag, std::to_string(uid), std::to_string(gid),
                                   std::to_string(::getpid()), vouched_dir};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  for (const UniqueFd& fd : theirs) {
    // A dup2 onto itself clears close-on-exec (glibc 2.29 on): each end stays at its number in the maker.
    posix_spawn_file_actions_adddup2(&actions, fd.get(), fd.get());
    args.push_back(std::to_string(fd.get()));
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  char* no_environment[] = {nullptr};  // nothing of the proxy's it needs
  const int spawned = ::posix_spawn(&pid, executable.c_str(), &actions, nullptr, argv.data(), no_environment);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return fail_errno("start the socket maker", spawned);
  maker.pid = pid;
  theirs.clear();  // the maker holds them now: its end of a worker's pair closes only when it exits
  // Each end answers, from a maker that dropped what it should (it exits before serving otherwise): it
  // enters our own namespace (so its CAP_SYS_ADMIN works here) and refuses it, since no node vouches for it.
  UniqueFd own(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  Status checked = own.valid() ? Status{} : Status(fail_errno("open /proc/thread-self/ns/net", errno));
  for (size_t i = 0; i < ours.size() && checked; ++i) {
    auto answered = exchange(ours[i].get(), own.get(), 1);
    if (!answered) checked = answered.failure();
    else if (answered->error != EACCES)
      checked = fail(Error::kInternal, std::string("it answered the proxy's own namespace with ") +
                                           (answered->error == 0 ? "sockets" : std::strerror(answered->error)));
  }
  if (!checked) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return fail(checked.error(), "the socket maker did not start: " + checked.message());
  }
  for (UniqueFd& end : ours) maker.clients.push_back(std::make_unique<SocketMakerClient>(std::move(end)));
  return maker;
}

int socket_maker_main(int argc, char** argv) {
  // sandgate-proxy --socket-maker UID GID PARENT_PID VOUCHED_DIR FD...
  unsigned long uid, gid, parent;
  if (argc < 7 || std::strcmp(argv[1], kSocketMakerFlag) != 0 || !parse_number(argv[2], UINT32_MAX - 1, &uid) ||
      !parse_number(argv[3], UINT32_MAX - 1, &gid) || !parse_number(argv[4], INT32_MAX, &parent) ||
      argv[5][0] != '/') {
    fprintf(stderr, "sandgate-proxy --socket-maker is started by sandgate-proxy itself\n");
    return 2;
  }
  const std::string vouched = argv[5];
  // Its life is the proxy's: a signal for the proxy's process group (a terminal's ^C, a hangup) is not its.
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGHUP, SIG_IGN);
  ::signal(SIGPIPE, SIG_IGN);
  std::vector<int> ends;
  for (int i = 6; i < argc; ++i) {
    unsigned long fd;
    if (!parse_number(argv[i], INT32_MAX, &fd) || fd < 3) {
      fprintf(stderr, "sandgate-proxy socket maker: bad descriptor %s\n", argv[i]);
      return 2;
    }
    ends.push_back(static_cast<int>(fd));
  }
  std::sort(ends.begin(), ends.end());
  ends.erase(std::unique(ends.begin(), ends.end()), ends.end());
  close_all_but(ends);
  for (int fd : ends) {
    int type = 0;
    socklen_t len = sizeof type;
    if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_SEQPACKET) {
      fprintf(stderr, "sandgate-proxy socket maker: descriptor %d is not a worker's socket\n", fd);
      return 2;
    }
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  const int home = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (home < 0) die("open /proc/thread-self/ns/net", errno);
  keep_only_sys_admin(static_cast<uid_t>(uid), static_cast<gid_t>(gid));
  // After the switch, which clears the parent-death signal; then the parent is checked: a proxy that died
  // before this line made it an orphan.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) die("PR_SET_PDEATHSIG", errno);
  if (::getppid() != static_cast<pid_t>(parent)) return 1;
  return serve(std::move(ends), vouched, home);
}

}  // namespace sg
