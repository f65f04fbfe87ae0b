#include "agent/ssh_server.h"

#include <fcntl.h>
#include <libssh/callbacks.h>
#include <libssh/libssh.h>
#include <libssh/server.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/ssh_public_key.h"

extern char** environ;

namespace sg::agent {
namespace {

constexpr size_t kReadChunk = 32 * 1024;
// What a channel holds for its child's stdin (or its socket) before it stops taking the client's data; the
// rest waits in libssh, whose window then stops the client.
constexpr size_t kMaxPendingInput = 1024 * 1024;
constexpr size_t kMaxAuthorizedKeysBytes = 1024 * 1024;
constexpr int kTcpConnectTimeoutMs = 10'000;
constexpr int kPtyDrainMs = 500;
using Clock = std::chrono::steady_clock;

void log(const char* fmt, const std::string& a = "", const std::string& b = "") {
  std::fprintf(stderr, "sandgate-agent ssh: ");
  std::fprintf(stderr, fmt, a.c_str(), b.c_str());
  std::fprintf(stderr, "\n");
}

bool set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

std::string shell_path() {
  return ::access("/bin/bash", X_OK) == 0 ? "/bin/bash" : "/bin/sh";
}

// The child's environment: the agent's (the sandbox's env and PATH), with what a login sets.
std::vector<std::string> child_environment(const std::string& shell, const std::string& term) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  env["HOME"] = "/root";
  env["USER"] = "root";
  env["LOGNAME"] = "root";
  env["SHELL"] = shell;
  if (!term.empty()) env["TERM"] = term;
  std::vector<std::string> out;
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

enum class ChannelKind { kSession, kTcp };
// A session channel's life: waiting for its request (shell, exec, subsystem), then running a child, then
// finished (exit status sent, closed on our side), then gone once the client closed it too.
enum class ChannelState { kAwaitingRequest, kRunning, kFinished };

struct Channel {
  ChannelKind kind = ChannelKind::kSession;
  ChannelState state = ChannelState::kAwaitingRequest;
  ssh_channel ch = nullptr;
  ssh_channel_callbacks_struct callbacks{};
  class Connection* conn = nullptr;
  // session
  bool pty = false;
  std::string term;
  winsize ws{};
  pid_t pid = 0;
  bool exited = false;
  int exit_code = 0;
  Clock::time_point exited_at{};
  // fds: in (to the child or the socket), out (from it), err (stderr, sessions without a pty)
  int in_fd = -1, out_fd = -1, err_fd = -1;
  bool out_polled = false, err_polled = false, in_polled = false;
  bool out_eof = false, err_eof = false;
  bool client_eof = false, peer_closed = false;
  bool eof_sent = false;  // tcp: the socket's EOF was passed on
  std::string pending;  // bytes for in_fd not written yet
};

class Connection {
 public:
  Connection(ssh_session session, const SshServerOptions& opts) : s_(session), opts_(opts) {}
  int run();

 private:
  // libssh callbacks (static trampolines below)
  int auth_pubkey(const char* user, ssh_key pubkey, char state);
  ssh_channel open_session();
  int on_message(ssh_message msg);

  bool key_authorized(ssh_key pubkey);
  int spawn(Channel* c, const std::vector<std::string>& argv);
  void read_output(Channel* c, int fd, bool is_stderr);
  void flush_input(Channel* c);
  void pull_buffered(Channel* c);
  void reap();
  void housekeeping();
  void finish(Channel* c);
  void close_fd(Channel* c, int* fd, bool* polled);
  void set_channel_callbacks(Channel* c);
  Channel* channel_for_pid(pid_t pid);

  static int fd_event(socket_t fd, int revents, void* userdata);

  ssh_session s_;
  const SshServerOptions& opts_;
  ssh_event event_ = nullptr;
  ssh_server_callbacks_struct server_callbacks_{};
  std::vector<std::unique_ptr<Channel>> channels_;
  bool authenticated_ = false;
  int auth_attempts_ = 0;
  int sigchld_fd_ = -1;
  // which channel an fd belongs to (fd_event gets the fd and this map)
  std::map<int, Channel*> fd_owner_;
};

// The file's text, or "" when it is missing, unreadable or larger than `max` (logged: no key then works).
std::string read_keys_file(const std::string& path, size_t max) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno != ENOENT) log("cannot open %s: %s", path, std::strerror(errno));
    return "";
  }
  std::string text;
  char buf[8192];
  ssize_t n;
  while ((n = ::read(fd.get(), buf, sizeof buf)) > 0) {
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > max) {
      log("%s is larger than the limit (%s bytes): no key is accepted", path, std::to_string(max));
      return "";
    }
  }
  return text;
}

bool Connection::key_authorized(ssh_key pubkey) {
  std::string text = read_keys_file(opts_.authorized_keys_file, kMaxAuthorizedKeysBytes);
  for (const PublicKey& key : parse_authorized_keys(text)) {
    ssh_key candidate = nullptr;
    if (ssh_pki_import_pubkey_base64(key.base64.c_str(), ssh_key_type_from_name(key.type.c_str()), &candidate) !=
        SSH_OK)
      continue;
    bool same = ssh_key_cmp(candidate, pubkey, SSH_KEY_CMP_PUBLIC) == 0;
    ssh_key_free(candidate);
    if (same) return true;
  }
  return false;
}

int Connection::auth_pubkey(const char*, ssh_key pubkey, char state) {
  if (++auth_attempts_ > opts_.max_auth_attempts) {
    ssh_disconnect(s_);
    return SSH_AUTH_DENIED;
  }
  if (!key_authorized(pubkey)) return SSH_AUTH_DENIED;
  // NONE: the client asks whether this key would do (libssh answers PK_OK); VALID: it proved it holds it.
  if (state == SSH_PUBLICKEY_STATE_NONE) {
    --auth_attempts_;  // the query and its signed attempt are one try
    return SSH_AUTH_SUCCESS;
  }
  if (state != SSH_PUBLICKEY_STATE_VALID) return SSH_AUTH_DENIED;
  authenticated_ = true;
  ::alarm(0);  // the auth deadline is met
  return SSH_AUTH_SUCCESS;
}

void Connection::set_channel_callbacks(Channel* c) {
  ssh_channel_callbacks_struct& cb = c->callbacks;
  cb = {};
  cb.userdata = c;
  cb.channel_data_function = [](ssh_session, ssh_channel, void* data, uint32_t len, int, void* u) -> int {
    auto* c = static_cast<Channel*>(u);
    if (c->in_fd < 0) return static_cast<int>(len);  // nothing to feed: discard, as sshd does
    size_t room = c->pending.size() < kMaxPendingInput ? kMaxPendingInput - c->pending.size() : 0;
    size_t take = std::min<size_t>(room, len);
    c->pending.append(static_cast<const char*>(data), take);
    return static_cast<int>(take);
  };
  cb.channel_eof_function = [](ssh_session, ssh_channel, void* u) { static_cast<Channel*>(u)->client_eof = true; };
  cb.channel_close_function = [](ssh_session, ssh_channel, void* u) {
    auto* c = static_cast<Channel*>(u);
    c->peer_closed = true;
    c->client_eof = true;
  };
  if (c->kind == ChannelKind::kSession) {
    cb.channel_pty_request_function = [](ssh_session, ssh_channel, const char* term, int w, int h, int pw, int ph,
                                         void* u) -> int {
      auto* c = static_cast<Channel*>(u);
      if (c->state != ChannelState::kAwaitingRequest) return -1;
      c->pty = true;
      c->term = term != nullptr ? term : "";
      c->ws = winsize{static_cast<unsigned short>(h), static_cast<unsigned short>(w), static_cast<unsigned short>(pw),
                      static_cast<unsigned short>(ph)};
      return 0;
    };
    cb.channel_pty_window_change_function = [](ssh_session, ssh_channel, int w, int h, int pw, int ph,
                                               void* u) -> int {
      auto* c = static_cast<Channel*>(u);
      c->ws = winsize{static_cast<unsigned short>(h), static_cast<unsigned short>(w), static_cast<unsigned short>(pw),
                      static_cast<unsigned short>(ph)};
      if (c->pty && c->in_fd >= 0) ::ioctl(c->in_fd, TIOCSWINSZ, &c->ws);
      return 0;
    };
    cb.channel_shell_request_function = [](ssh_session, ssh_channel, void* u) -> int {
      auto* c = static_cast<Channel*>(u);
      std::string shell = shell_path();
      std::string argv0 = "-" + shell.substr(shell.rfind('/') + 1);  // a login shell reads /etc/profile
      return c->conn->spawn(c, {shell, argv0});
    };
    cb.channel_exec_request_function = [](ssh_session, ssh_channel, const char* command, void* u) -> int {
      auto* c = static_cast<Channel*>(u);
      std::string shell = shell_path();
      return c->conn->spawn(c, {shell, shell, "-c", command != nullptr ? command : ""});
    };
    cb.channel_subsystem_request_function = [](ssh_session, ssh_channel, const char* name, void* u) -> int {
      auto* c = static_cast<Channel*>(u);
      if (name == nullptr || std::strcmp(name, "sftp") != 0) return -1;
      c->pty = false;  // sftp is a byte stream; a pty would mangle it
      std::string server = find_sftp_server();
      if (!server.empty()) return c->conn->spawn(c, {server, server});
      // The agent's own server: this very binary, which every sandbox has.
      return c->conn->spawn(c, {"/proc/self/exe", "sandgate-agent", "--sftp-server"});
    };
  }
  ssh_callbacks_init(&cb);
  ssh_set_channel_callbacks(c->ch, &cb);
}

ssh_channel Connection::open_session() {
  if (!authenticated_) return nullptr;
  auto c = std::make_unique<Channel>();
  c->conn = this;
  c->ch = ssh_channel_new(s_);
  if (c->ch == nullptr) return nullptr;
  set_channel_callbacks(c.get());
  ssh_channel ch = c->ch;
  channels_.push_back(std::move(c));
  return ch;
}

// A connected socket to host:port, or -1. Non-blocking connect with a deadline: an address outside the
// sandbox that drops packets must not hang the whole connection.
int connect_tcp(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  int out = -1;
  for (addrinfo* ai = res; ai != nullptr && out < 0; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      out = fd;
      break;
    }
    if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof err;
      if (::poll(&p, 1, kTcpConnectTimeoutMs) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
          err == 0) {
        out = fd;
        break;
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

int Connection::on_message(ssh_message msg) {
  if (!authenticated_ || ssh_message_type(msg) != SSH_REQUEST_CHANNEL_OPEN ||
      ssh_message_subtype(msg) != SSH_CHANNEL_DIRECT_TCPIP)
    return 1;  // libssh answers with its default refusal
  const char* host = ssh_message_channel_request_open_destination(msg);
  int port = ssh_message_channel_request_open_destination_port(msg);
  if (host == nullptr || port <= 0 || port > 65535) return 1;
  int fd = connect_tcp(host, port);
  if (fd < 0) {
    log("ssh -L: cannot connect to %s port %s", host, std::to_string(port));
    return 1;
  }
  ssh_channel ch = ssh_message_channel_request_open_reply_accept(msg);
  if (ch == nullptr) {
    ::close(fd);
    return 0;
  }
  auto c = std::make_unique<Channel>();
  c->kind = ChannelKind::kTcp;
  c->state = ChannelState::kRunning;
  c->conn = this;
  c->ch = ch;
  c->in_fd = fd;
  c->out_fd = ::dup(fd);
  set_nonblocking(c->out_fd);
  c->err_eof = true;
  c->exited = true;  // no process: the channel ends when both directions have
  set_channel_callbacks(c.get());
  channels_.push_back(std::move(c));
  return 0;
}

int Connection::spawn(Channel* c, const std::vector<std::string>& argv) {
  if (c->state != ChannelState::kAwaitingRequest) return -1;
  int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
  int master = -1, slave = -1;
  if (c->pty) {
    if (::openpty(&master, &slave, nullptr, nullptr, &c->ws) != 0) {
      log("openpty: %s", std::strerror(errno));
      return -1;
    }
  } else if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    log("pipe: %s", std::strerror(errno));
    for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1]})
      if (fd >= 0) ::close(fd);
    return -1;
  }
  std::vector<std::string> env = child_environment(argv[0], c->pty ? c->term : "");
  std::vector<char*> envp, args;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy(argv.begin() + 1, argv.end());
  for (std::string& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) {
    log("fork: %s", std::strerror(errno));
    for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1], master, slave})
      if (fd >= 0) ::close(fd);
    return -1;
  }
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGPIPE, SIGCHLD, SIGALRM, SIGTERM, SIGHUP, SIGINT}) ::signal(sig, SIG_DFL);
    ::setsid();
    if (c->pty) {
      ::ioctl(slave, TIOCSCTTY, 0);
      ::dup2(slave, 0);
      ::dup2(slave, 1);
      ::dup2(slave, 2);
    } else {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
    }
    ::close_range(3, ~0U, 0);
    if (::chdir("/root") != 0 && ::chdir("/") != 0) _exit(126);
    ::execve(argv[0].c_str(), args.data(), envp.data());
    std::fprintf(stderr, "sandgate-agent ssh: cannot execute %s: %s\n", argv[0].c_str(), std::strerror(errno));
    _exit(127);
  }
  c->pid = pid;
  c->state = ChannelState::kRunning;
  if (c->pty) {
    ::close(slave);
    c->in_fd = master;
    c->out_fd = ::dup(master);
    ::fcntl(c->out_fd, F_SETFD, FD_CLOEXEC);
    c->err_eof = true;
  } else {
    ::close(in[0]);
    ::close(out[1]);
    ::close(err[1]);
    c->in_fd = in[1];
    c->out_fd = out[0];
    c->err_fd = err[0];
  }
  for (int fd : {c->in_fd, c->out_fd, c->err_fd})
    if (fd >= 0) set_nonblocking(fd);
  return 0;
}

int Connection::fd_event(socket_t fd, int, void* userdata) {
  auto* self = static_cast<Connection*>(userdata);
  if (fd == self->sigchld_fd_) {
    signalfd_siginfo info;
    while (::read(fd, &info, sizeof info) > 0) {
    }
    return 0;
  }
  auto it = self->fd_owner_.find(fd);
  if (it == self->fd_owner_.end()) return 0;
  Channel* c = it->second;
  if (fd == c->out_fd) self->read_output(c, fd, false);
  else if (fd == c->err_fd) self->read_output(c, fd, true);
  else if (fd == c->in_fd) self->flush_input(c);
  return 0;
}

void Connection::read_output(Channel* c, int fd, bool is_stderr) {
  char buf[kReadChunk];
  // Only as much as the client's window takes now, so the write below never waits inside this callback.
  uint32_t window = ssh_channel_window_size(c->ch);
  if (window == 0 && !c->peer_closed) return;
  ssize_t n = ::read(fd, buf, std::min<size_t>(sizeof buf, window == 0 ? sizeof buf : window));
  if (n > 0) {
    if (c->peer_closed) return;  // nobody to send to; keep draining so the child is not blocked
    int w = is_stderr ? ssh_channel_write_stderr(c->ch, buf, static_cast<uint32_t>(n))
                      : ssh_channel_write(c->ch, buf, static_cast<uint32_t>(n));
    if (w == SSH_ERROR) c->peer_closed = true;
    return;
  }
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  // 0 (the writers are gone) or EIO (a pty whose processes all closed it): this direction is over.
  (is_stderr ? c->err_eof : c->out_eof) = true;
}

void Connection::flush_input(Channel* c) {
  while (!c->pending.empty() && c->in_fd >= 0) {
    ssize_t n = ::write(c->in_fd, c->pending.data(), c->pending.size());
    if (n > 0) {
      c->pending.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    c->pending.clear();  // the reader is gone (EPIPE): what is left has nowhere to go
  }
}

// Data the channel callback could not take (the pending buffer was full) stays in libssh's buffer and is not
// offered again until more arrives: take it here once there is room.
void Connection::pull_buffered(Channel* c) {
  if (c->peer_closed || c->in_fd < 0 || c->pending.size() >= kMaxPendingInput / 2) return;
  char buf[kReadChunk];
  int n = ssh_channel_read_nonblocking(c->ch, buf, sizeof buf, 0);
  if (n > 0) c->pending.append(buf, static_cast<size_t>(n));
}

Channel* Connection::channel_for_pid(pid_t pid) {
  for (auto& c : channels_)
    if (c->pid == pid) return c.get();
  return nullptr;
}

void Connection::reap() {
  int status = 0;
  pid_t pid;
  while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
    Channel* c = channel_for_pid(pid);
    if (c == nullptr) continue;
    c->exited = true;
    c->exited_at = Clock::now();
    c->exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
}

void Connection::close_fd(Channel* c, int* fd, bool* polled) {
  if (*fd < 0) return;
  if (*polled) ssh_event_remove_fd(event_, *fd);
  *polled = false;
  fd_owner_.erase(*fd);
  ::close(*fd);
  *fd = -1;
  (void)c;
}

void Connection::finish(Channel* c) {
  c->state = ChannelState::kFinished;
  close_fd(c, &c->in_fd, &c->in_polled);
  close_fd(c, &c->out_fd, &c->out_polled);
  close_fd(c, &c->err_fd, &c->err_polled);
  if (!c->peer_closed) {
    if (c->kind == ChannelKind::kSession) ssh_channel_request_send_exit_status(c->ch, c->exit_code);
    ssh_channel_send_eof(c->ch);
    ssh_channel_close(c->ch);
  }
}

// After every poll round: move bytes that can move, (un)register fds for what they wait on, end what ended.
// Done here rather than inside the callbacks, so no callback changes the poll set it is called from.
void Connection::housekeeping() {
  reap();
  for (auto& owned : channels_) {
    Channel* c = owned.get();
    if (c->state != ChannelState::kRunning) continue;
    pull_buffered(c);
    flush_input(c);
    // The client sent EOF and all of it reached the child: its stdin ends too (a pty has no EOF of its
    // own; the shell ends when the client's `exit` or ^D reaches it).
    if (c->client_eof && c->pending.empty() && c->in_fd >= 0 && !c->pty) {
      if (c->kind == ChannelKind::kTcp) ::shutdown(c->in_fd, SHUT_WR);
      else close_fd(c, &c->in_fd, &c->in_polled);
    }
    if (c->peer_closed && c->pid > 0 && !c->exited) ::kill(-c->pid, SIGHUP);
    // A pty's output ends with EIO once every process closed it (the poll reports it like data). A
    // background job that keeps the pty open after the shell exited must not keep the session: its output
    // ends kPtyDrainMs after the exit.
    if (c->pty && c->exited && !c->out_eof && Clock::now() - c->exited_at > std::chrono::milliseconds(kPtyDrainMs))
      c->out_eof = true;
    if (c->kind == ChannelKind::kTcp && c->out_eof && !c->peer_closed && !c->eof_sent) {
      ssh_channel_send_eof(c->ch);
      c->eof_sent = true;
    }
    bool done = c->exited && c->out_eof && c->err_eof;
    if (c->kind == ChannelKind::kTcp) done = (c->out_eof && c->client_eof && c->pending.empty()) || c->peer_closed;
    if (done) {
      finish(c);
      continue;
    }
    auto watch = [&](int fd, bool* polled, short events, bool want) {
      if (fd < 0 || *polled == want) return;
      if (want) {
        fd_owner_[fd] = c;
        ssh_event_add_fd(event_, fd, events, &Connection::fd_event, this);
      } else {
        ssh_event_remove_fd(event_, fd);
      }
      *polled = want;
    };
    bool window_open = ssh_channel_window_size(c->ch) > 0 || c->peer_closed;
    watch(c->out_fd, &c->out_polled, POLLIN, !c->out_eof && window_open);
    watch(c->err_fd, &c->err_polled, POLLIN, !c->err_eof && window_open);
    // A pty's master is both in_fd and (a dup) out_fd: each has its own registration.
    watch(c->in_fd, &c->in_polled, POLLOUT, !c->pending.empty());
  }
  for (size_t i = 0; i < channels_.size();) {
    Channel* c = channels_[i].get();
    bool gone = c->state == ChannelState::kFinished && (c->peer_closed || ssh_channel_is_closed(c->ch));
    bool abandoned = c->state == ChannelState::kAwaitingRequest && c->peer_closed;
    if (gone || abandoned) {
      // libssh may keep the channel until the client's close arrives: it must not call back into freed memory.
      ssh_remove_channel_callbacks(c->ch, &c->callbacks);
      ssh_channel_free(c->ch);
      channels_.erase(channels_.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
}

int Connection::run() {
  ::alarm(static_cast<unsigned>(opts_.auth_timeout_secs));  // SIGALRM's default action ends a slow client
  server_callbacks_.userdata = this;
  server_callbacks_.auth_pubkey_function = [](ssh_session, const char* user, ssh_key_struct* key, char state,
                                              void* u) -> int {
    return static_cast<Connection*>(u)->auth_pubkey(user, key, state);
  };
  server_callbacks_.channel_open_request_session_function = [](ssh_session, void* u) -> ssh_channel {
    return static_cast<Connection*>(u)->open_session();
  };
  ssh_callbacks_init(&server_callbacks_);
  ssh_set_server_callbacks(s_, &server_callbacks_);
  ssh_set_message_callback(
      s_, [](ssh_session, ssh_message msg, void* u) -> int { return static_cast<Connection*>(u)->on_message(msg); },
      this);
  if (ssh_handle_key_exchange(s_) != SSH_OK) {
    log("key exchange failed: %s", ssh_get_error(s_));
    return 1;
  }
  ssh_set_auth_methods(s_, SSH_AUTH_METHOD_PUBLICKEY);

  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, nullptr);
  sigchld_fd_ = ::signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
  event_ = ssh_event_new();
  if (event_ == nullptr || sigchld_fd_ < 0 || ssh_event_add_session(event_, s_) != SSH_OK ||
      ssh_event_add_fd(event_, sigchld_fd_, POLLIN, &Connection::fd_event, this) != SSH_OK) {
    log("cannot set up the event loop%s", "");
    return 1;
  }
  while (ssh_is_connected(s_)) {
    // A bounded wait: a pty drain deadline (kPtyDrainMs) and libssh's own timers are looked at again at
    // least this often.
    if (ssh_event_dopoll(event_, 100) == SSH_ERROR && !ssh_is_connected(s_)) break;
    housekeeping();
  }
  for (auto& c : channels_)
    if (c->pid > 0 && !c->exited) ::kill(-c->pid, SIGHUP);
  ssh_event_remove_session(event_, s_);
  ssh_event_free(event_);
  return 0;
}

void serve_connection(int fd, const SshServerOptions& opts) {
  ssh_bind bind = ssh_bind_new();
  ssh_session session = ssh_new();
  if (bind == nullptr || session == nullptr) _exit(1);
  if (ssh_bind_options_set(bind, SSH_BIND_OPTIONS_HOSTKEY, opts.host_key_file.c_str()) != SSH_OK) {
    log("host key %s: %s", opts.host_key_file, ssh_get_error(bind));
    _exit(1);
  }
  if (ssh_bind_accept_fd(bind, session, fd) != SSH_OK) {
    log("accept: %s", ssh_get_error(bind));
    _exit(1);
  }
  Connection conn(session, opts);
  int rc = conn.run();
  ssh_disconnect(session);
  ssh_free(session);
  ssh_bind_free(bind);
  _exit(rc);
}

[[noreturn]] void listener_main(int listen_fd, const SshServerOptions& opts) {
  size_t running = 0;
  for (;;) {
    int status = 0;
    while (running > 0 && ::waitpid(-1, &status, WNOHANG) > 0) --running;
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
        if (errno == EMFILE || errno == ENFILE) ::usleep(100'000);  // no fd to accept with: let one close
        continue;
      }
      log("accept: %s", std::strerror(errno));
      _exit(1);
    }
    while (running > 0 && ::waitpid(-1, &status, WNOHANG) > 0) --running;
    if (running >= opts.max_sessions) {
      log("refusing a connection: %s connections are open (the limit)", std::to_string(running));
      ::close(fd);
      continue;
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(listen_fd);
      serve_connection(fd, opts);
    }
    ::close(fd);
    if (pid > 0) ++running;
    else log("fork: %s", std::strerror(errno));
  }
}

}  // namespace

std::string find_sftp_server() {
  for (const char* path : {"/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server",
                           "/usr/libexec/sftp-server", "/usr/lib/ssh/sftp-server", "/usr/lib/sftp-server"})
    if (::access(path, X_OK) == 0) return path;
  return "";
}

Result<pid_t> start_ssh_listener(int listen_fd, const SshServerOptions& opts) {
  ssh_init();  // a static libssh has no constructor that does it
  // Checked here, once, so a missing key is one clear line in the log rather than every connection failing.
  ssh_key host_key = nullptr;
  if (ssh_pki_import_privkey_file(opts.host_key_file.c_str(), nullptr, nullptr, nullptr, &host_key) != SSH_OK)
    return fail(Error::kNotFound, "cannot read the SSH host key " + opts.host_key_file);
  ssh_key_free(host_key);
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) return fail_errno("fork the SSH listener", errno);
  if (pid > 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) _exit(0);  // the agent died before the line above took effect
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGINT, SIG_DFL);
  int flags = ::fcntl(listen_fd, F_GETFL);  // the listener blocks in accept(); it has nothing else to do
  if (flags < 0 || ::fcntl(listen_fd, F_SETFL, flags & ~O_NONBLOCK) != 0) _exit(1);
  listener_main(listen_fd, opts);
}

}  // namespace sg::agent
