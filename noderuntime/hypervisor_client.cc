#include "noderuntime/hypervisor_client.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <poll.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <spdlog/spdlog.h>

#include "common/http_client.h"
#include "noderuntime/uv_handles.h"

namespace sg {
namespace {

// Raw syscalls: Debian 12's <sys/pidfd.h> declares the glibc wrappers without C linkage.
int pidfd_open(int pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }
int pidfd_send_signal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

uint64_t now_ms() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

// /proc/<pid>/stat: the state (field 3) and the start time (field 22), read after the last ')' because the
// command name (field 2) may contain spaces and parentheses.
struct ProcStat {
  char state = '?';
  uint64_t start_time_ticks = 0;
};
std::optional<ProcStat> read_proc_stat(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  ProcStat st;
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3) st.state = field.empty() ? '?' : field[0];
    if (i == 22) st.start_time_ticks = std::strtoull(field.c_str(), nullptr, 10);
  }
  return st;
}

// A pidfd for `process`, or an invalid fd when it is gone (exited, or its pid now belongs to another process).
// The start time is checked after pidfd_open, so the pidfd refers to our process even if the pid is reused.
Result<UniqueFd> open_pidfd(const VmmProcess& process) {
  if (process.pid <= 0) return UniqueFd();
  UniqueFd pidfd(pidfd_open(process.pid));
  if (!pidfd.valid()) {
    if (errno == ESRCH) return UniqueFd();
    return fail_errno("pidfd_open " + std::to_string(process.pid), errno);
  }
  auto st = read_proc_stat(process.pid);
  if (!st || st->start_time_ticks != process.start_time_ticks) return UniqueFd();
  return pidfd;
}

}  // namespace

// ---- HTTP over the API socket ----

class HypervisorClient::Request {
 public:
  Request(HypervisorClient* client, Callback done)
      : client_(client),
        done_(std::move(done)),
        reader_({.max_head_bytes = 16 * 1024, .max_body_bytes = client->options_.max_response_bytes}) {
    deadline_ = new uv_timer_t;
    uv_timer_init(client->loop_, deadline_);
    deadline_->data = this;
    retry_ = new uv_timer_t;
    uv_timer_init(client->loop_, retry_);
    retry_->data = this;
  }
  ~Request() {
    close_and_free(poll_);
    close_and_free(deadline_);
    close_and_free(retry_);
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  // The first connect attempt runs from the loop too, so even an immediate failure is reported after
  // request() has returned.
  void start(std::string wire) {
    out_ = std::move(wire);
    const HypervisorClientOptions& o = client_->options_;
    connect_deadline_ms_ = now_ms() + o.connect_wait_ms;
    uv_timer_start(deadline_, [](uv_timer_t* t) { static_cast<Request*>(t->data)->on_deadline(); }, o.timeout_ms, 0);
    uv_timer_start(retry_, [](uv_timer_t* t) { static_cast<Request*>(t->data)->try_connect(); }, 0, 0);
  }
  void start_failed(Failure failure) {
    early_failure_ = std::move(failure);
    uv_timer_start(retry_, [](uv_timer_t* t) {
      auto* self = static_cast<Request*>(t->data);
      self->finish(*self->early_failure_);
    }, 0, 0);
  }

 private:
  std::string what() const { return client_->peer_ + " API at " + client_->socket_path_; }

  void try_connect() {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (client_->socket_path_.size() >= sizeof addr.sun_path)
      return finish(fail(Error::kInvalidArgument, "socket path too long for a unix socket: " + client_->socket_path_));
    std::memcpy(addr.sun_path, client_->socket_path_.c_str(), client_->socket_path_.size() + 1);
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return finish(fail_errno("socket", errno));
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS) {
      int err = errno;
      // A VMM spawned a moment ago has not bound (ENOENT) or not yet listened (ECONNREFUSED); a full backlog
      // (EAGAIN) clears by itself. Retry those within connect_wait_ms.
      bool transient = err == ENOENT || err == ECONNREFUSED || err == EAGAIN;
      if (transient && now_ms() < connect_deadline_ms_) {
        uv_timer_start(retry_, [](uv_timer_t* t) { static_cast<Request*>(t->data)->try_connect(); }, 5, 0);
        return;
      }
      return finish(fail(Error::kUnavailable, "cannot reach " + what() + ": " + std::strerror(err)));
    }
    fd_ = std::move(fd);
    poll_ = new uv_poll_t;
    if (int rc = uv_poll_init(client_->loop_, poll_, fd_.get()); rc != 0) {
      delete poll_;  // never initialised, so there is nothing for uv_close to do
      poll_ = nullptr;
      return finish(fail(Error::kIo, std::string("uv_poll_init: ") + uv_strerror(rc)));
    }
    poll_->data = this;
    arm(UV_WRITABLE);
  }

  void arm(int events) {
    uv_poll_start(poll_, events, [](uv_poll_t* p, int status, int ev) {
      static_cast<Request*>(p->data)->on_io(status, ev);
    });
  }

  void on_io(int status, int events) {
    if (status < 0) return finish(fail(Error::kIo, what() + ": " + uv_strerror(status)));
    if ((events & UV_WRITABLE) && out_off_ < out_.size()) {
      ssize_t n = ::send(fd_.get(), out_.data() + out_off_, out_.size() - out_off_, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EINTR) {
        int err = errno;
        // The VMM closed before reading the whole request: the same as closing before answering.
        if (err == EPIPE || err == ECONNRESET)
          return finish(fail(Error::kUnavailable, what() + " closed the connection before answering"));
        return finish(fail_errno("send to " + what(), err));
      }
      if (n > 0) out_off_ += static_cast<size_t>(n);
      if (out_off_ == out_.size()) arm(UV_READABLE);
      return;
    }
    if (!(events & UV_READABLE)) return;
    char buf[8192];
    for (;;) {
      ssize_t n = ::recv(fd_.get(), buf, sizeof buf, 0);
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return;
        if (errno == ECONNRESET)
          return finish(fail(Error::kUnavailable, what() + " reset the connection before a complete answer"));
        return finish(fail_errno("recv from " + what(), errno));
      }
      HttpResponseReader::State st = n == 0 ? reader_.finish() : reader_.feed(buf, static_cast<size_t>(n));
      if (st == HttpResponseReader::State::kComplete) {
        HypervisorResponse r;
        r.status = reader_.message().status;
        r.body = std::move(reader_.message().body);
        return finish(std::move(r));
      }
      if (st == HttpResponseReader::State::kError) {
        HttpResponseError e = reader_.error();
        if (e == HttpResponseError::kClosedBeforeResponse || e == HttpResponseError::kClosedMidResponse)
          return finish(fail(Error::kUnavailable, what() + " closed the connection before a complete answer"));
        const char* kind = e == HttpResponseError::kMalformed ? "malformed" : "oversized";
        return finish(fail(Error::kUnavailable, std::string(kind) + " answer from " + what() + ": " +
                                                   reader_.failure().message));
      }
    }
  }

  void on_deadline() {
    const HypervisorClientOptions& o = client_->options_;
    finish(fail(Error::kTimeout, what() + " did not answer within " + std::to_string(o.timeout_ms) + " ms"));
  }

  void finish(Result<HypervisorResponse> r) {
    if (poll_) uv_poll_stop(poll_);
    uv_timer_stop(deadline_);
    uv_timer_stop(retry_);
    fd_.reset();
    client_->finished(this, std::move(r));  // destroys *this
  }

  HypervisorClient* client_;
  Callback done_;
  friend class HypervisorClient;
  HttpResponseReader reader_;
  std::string out_;
  size_t out_off_ = 0;
  UniqueFd fd_;
  // Handles are heap-allocated and freed in their close callbacks, which run after this object is gone.
  uv_poll_t* poll_ = nullptr;
  uv_timer_t* deadline_ = nullptr;
  uv_timer_t* retry_ = nullptr;
  uint64_t connect_deadline_ms_ = 0;
  std::optional<Failure> early_failure_;
};

HypervisorClient::HypervisorClient(uv_loop_t* loop, std::string socket_path, std::string peer,
                                   HypervisorClientOptions options)
    : loop_(loop), socket_path_(std::move(socket_path)), peer_(std::move(peer)), options_(options) {}

HypervisorClient::~HypervisorClient() = default;

void HypervisorClient::request(std::string_view method, std::string_view path, std::string body, Callback done) {
  HttpRequest req{.method = method, .target = path, .host = "localhost", .headers = {}, .body = body};
  req.headers = {{"Connection", "close"}, {"Accept", "application/json"}};
  if (!body.empty()) req.headers.push_back({"Content-Type", "application/json"});
  // Both VMMs' HTTP servers want a Content-Length on PUT/PATCH even when there is no body (the builder's
  // default).
  auto wire = build_http_request(req);
  if (!wire) return reject(fail(wire.error(), peer_ + " API request " + std::string(path) + ": " + wire.message()),
                           std::move(done));
  requests_.push_back(std::make_unique<Request>(this, std::move(done)));
  requests_.back()->start(std::move(*wire));
}

void HypervisorClient::reject(Failure failure, Callback done) {
  requests_.push_back(std::make_unique<Request>(this, std::move(done)));
  requests_.back()->start_failed(std::move(failure));
}

void HypervisorClient::finished(Request* request, Result<HypervisorResponse> result) {
  std::unique_ptr<Request> owned;
  for (auto it = requests_.begin(); it != requests_.end(); ++it) {
    if (it->get() == request) {
      owned = std::move(*it);
      requests_.erase(it);
      break;
    }
  }
  Callback done = std::move(owned->done_);
  owned.reset();
  done(std::move(result));  // may destroy this client; nothing touches members afterwards
}

Status run_on_private_loop(const std::function<std::shared_ptr<void>(uv_loop_t*, std::function<void(Status)>)>& op) {
  uv_loop_t loop;
  if (int rc = uv_loop_init(&loop); rc != 0) return fail(Error::kIo, std::string("uv_loop_init: ") + uv_strerror(rc));
  std::optional<Status> result;
  std::shared_ptr<void> keep = op(&loop, [&result](Status s) { result = std::move(s); });
  while (!result && uv_run(&loop, UV_RUN_ONCE) != 0) {
  }
  // What `op` keeps alive owns handles on this loop: destroy it first, then let the close callbacks run.
  keep.reset();
  uv_walk(&loop, [](uv_handle_t* h, void*) {
    if (!uv_is_closing(h)) uv_close(h, nullptr);
  }, nullptr);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  if (!result) return fail(Error::kInternal, "operation ended without reporting a result");
  return std::move(*result);
}

// ---- the VMM process ----

Result<VmmProcess> spawn_vmm(std::string_view peer, const std::string& binary, const std::vector<std::string>& args,
                             const std::string& log_path, const VmmSpawnOptions& options) {
  struct stat st{};
  if (::stat(binary.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || ::access(binary.c_str(), X_OK) != 0)
    return fail(Error::kUnsupported, std::string(peer) + " binary not found at " + binary);

  posix_spawn_file_actions_t files;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&files);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0640);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  if (!options.cwd.empty()) posix_spawn_file_actions_addchdir_np(&files, options.cwd.c_str());
  // Its own session (survives the node, not hit by a terminal's signals), default signal dispositions and an
  // empty mask whatever the node's loop has blocked.
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The child inherits the spawning thread's policy, so it has SCHED_BATCH from its first instruction and
  // every thread it creates does too (glibc's posix_spawnattr_setschedpolicy takes only FIFO, RR and OTHER).
  // This thread is SCHED_BATCH for the length of the spawn only.
  const int own_policy = ::sched_getscheduler(0);
  sched_param own_priority{};
  const bool switch_policy = options.batch_scheduling && own_policy != SCHED_BATCH;
  if (switch_policy) {
    const sched_param batch_priority{};
    if (own_policy < 0 || ::sched_getparam(0, &own_priority) != 0 ||
        ::sched_setscheduler(0, SCHED_BATCH, &batch_priority) != 0) {
      const int err = errno;
      posix_spawn_file_actions_destroy(&files);
      posix_spawnattr_destroy(&attr);
      return fail_errno("cannot start " + std::string(peer) + " under SCHED_BATCH", err);
    }
  }
  pid_t pid = 0;
  int rc = ::posix_spawn(&pid, binary.c_str(), &files, &attr, argv.data(), environ);
  if (switch_policy && ::sched_setscheduler(0, own_policy, &own_priority) != 0)
    spdlog::warn("the node's thread stays SCHED_BATCH after starting {}: sched_setscheduler: {}", peer,
                 std::strerror(errno));
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return fail(Error::kIo, "cannot start " + std::string(peer) + " (" + binary + "): " + std::strerror(rc));
  auto ps = read_proc_stat(pid);
  if (!ps) return fail(Error::kUnavailable, std::string(peer) + " exited right after it was started; see " + log_path);
  return VmmProcess{pid, ps->start_time_ticks};
}

uint64_t file_bytes(const std::string& path, bool allocated) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return allocated ? static_cast<uint64_t>(st.st_blocks) * 512 : static_cast<uint64_t>(st.st_size);
}

bool vmm_alive(const VmmProcess& process) {
  if (process.pid <= 0) return false;
  auto st = read_proc_stat(process.pid);
  return st && st->state != 'Z' && st->state != 'X' && st->start_time_ticks == process.start_time_ticks;
}

std::optional<VmmProcess> pidfile_holder(const std::string& pidfile) {
  UniqueFd fd(::open(pidfile.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return std::nullopt;
  struct flock lock{};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  if (::fcntl(fd.get(), F_GETLK, &lock) != 0 || lock.l_type == F_UNLCK || lock.l_pid <= 0) return std::nullopt;
  auto st = read_proc_stat(lock.l_pid);
  if (!st || st->state == 'Z' || st->state == 'X') return std::nullopt;
  return VmmProcess{lock.l_pid, st->start_time_ticks};
}

Status kill_vmm(const VmmProcess& process) {
  auto pidfd = open_pidfd(process);
  if (!pidfd) return pidfd.failure();
  if (!pidfd->valid()) return {};  // already gone
  if (pidfd_send_signal(pidfd->get(), SIGKILL) != 0 && errno != ESRCH)
    return fail_errno("kill " + std::to_string(process.pid), errno);
  return {};
}

Result<std::unique_ptr<VmmExitWatch>> VmmExitWatch::start(uv_loop_t* loop, const VmmProcess& process,
                                                          std::function<void()> on_exit) {
  auto pidfd = open_pidfd(process);
  if (!pidfd) return pidfd.failure();
  std::unique_ptr<VmmExitWatch> w(new VmmExitWatch());
  w->on_exit_ = std::move(on_exit);
  w->pidfd_ = std::move(*pidfd);
  if (!w->pidfd_.valid()) {
    w->gone_ = new uv_timer_t;
    uv_timer_init(loop, w->gone_);
    w->gone_->data = w.get();
    uv_timer_start(w->gone_, [](uv_timer_t* t) { static_cast<VmmExitWatch*>(t->data)->fire(); }, 0, 0);
    return w;
  }
  w->poll_ = new uv_poll_t;
  if (int rc = uv_poll_init(loop, w->poll_, w->pidfd_.get()); rc != 0) {
    delete w->poll_;
    w->poll_ = nullptr;
    return fail(Error::kIo, std::string("uv_poll_init on pidfd: ") + uv_strerror(rc));
  }
  w->poll_->data = w.get();
  // A pidfd turns readable once the process has exited, whether or not it is our child.
  uv_poll_start(w->poll_, UV_READABLE, [](uv_poll_t* p, int, int) { static_cast<VmmExitWatch*>(p->data)->fire(); });
  return w;
}

VmmExitWatch::~VmmExitWatch() {
  close_and_free(poll_);
  close_and_free(gone_);
}

void VmmExitWatch::fire() {
  if (poll_) uv_poll_stop(poll_);
  if (pidfd_.valid()) {
    // Reap it if it is our child; for an adopted VMM (ECHILD) its real parent does.
    siginfo_t si{};
    ::waitid(P_PIDFD, static_cast<id_t>(pidfd_.get()), &si, WEXITED | WNOHANG);
  }
  if (!on_exit_) return;
  auto cb = std::move(on_exit_);
  on_exit_ = nullptr;
  cb();  // may destroy this watch
}

// ---- hybrid vsock ----

Result<UniqueFd> vsock_connect(const std::string& uds_path, uint16_t port, int timeout_ms) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (uds_path.empty() || uds_path.size() >= sizeof addr.sun_path)
    return fail(Error::kInvalidArgument, "bad vsock socket path '" + uds_path + "'");
  std::memcpy(addr.sun_path, uds_path.c_str(), uds_path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return fail_errno("socket", errno);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0)
    return fail(Error::kUnavailable, "cannot reach vsock socket " + uds_path + ": " + std::strerror(errno));
  const std::string hello = "CONNECT " + std::to_string(port) + "\n";
  if (::send(fd.get(), hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size()))
    return fail_errno("send to vsock socket " + uds_path, errno);
  // One byte at a time: whatever follows the "OK" line is already the guest's stream and must stay unread.
  std::string line;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (line.empty() || line.back() != '\n') {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd pfd{fd.get(), POLLIN, 0};
    if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) == 0)
      return fail(Error::kUnreachable, "guest port " + std::to_string(port) + ": no answer to CONNECT on " + uds_path);
    char c = 0;
    ssize_t n = ::recv(fd.get(), &c, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || line.size() > 64)
      return fail(Error::kUnreachable, "guest port " + std::to_string(port) + " refused through " + uds_path);
    line.push_back(c);
  }
  if (line.rfind("OK ", 0) != 0)
    return fail(Error::kUnreachable, "guest port " + std::to_string(port) + ": unexpected answer '" +
                                         line.substr(0, line.size() - 1) + "' from " + uds_path);
  int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) return fail_errno("fcntl", errno);
  return fd;
}

// ---- VmmDriver ----

struct VmmDriver::Run {
  std::unique_ptr<Op> op;
  std::vector<Step> steps;
  size_t index = 0;
  Step on_failure;
  std::function<void(Op*, Status)> finish;
  ~Run() {
    if (op) close_and_free(op->timer);
  }
};

VmmDriver::VmmDriver(uv_loop_t* loop, std::string peer, VmmDriverOptions options)
    : loop_(loop), peer_(std::move(peer)), options_(std::move(options)) {}

VmmDriver::~VmmDriver() = default;

HypervisorClientOptions VmmDriver::api_options(bool just_spawned) const {
  HypervisorClientOptions o = options_.api;
  if (just_spawned) {
    o.connect_wait_ms = options_.spawn_connect_wait_ms;
    o.timeout_ms += options_.spawn_connect_wait_ms;
  }
  return o;
}

std::unique_ptr<VmmDriver::Op> VmmDriver::new_op(const SandboxSpec& spec, std::string what, const RuntimeInfo& info) {
  auto op = std::make_unique<Op>();
  op->sandbox_id = spec.id;
  op->what = std::move(what);
  op->info = info;
  op->process = VmmProcess{info.pid, info.start_time_ticks};
  return op;
}

VmmDriver::Op* VmmDriver::in_flight(const std::string& sandbox_id) {
  for (auto& [op, run] : runs_) {
    if (op->sandbox_id == sandbox_id && !op->terminate) return op;
  }
  return nullptr;
}

void VmmDriver::run(std::unique_ptr<Op> op, std::vector<Step> steps, Step on_failure,
                    std::function<void(Op*, Status)> finish) {
  Op* key = op.get();
  auto r = std::make_unique<Run>();
  r->op = std::move(op);
  r->steps = std::move(steps);
  r->on_failure = std::move(on_failure);
  r->finish = std::move(finish);
  key->timer = new uv_timer_t;
  uv_timer_init(loop_, key->timer);
  key->timer->data = key;
  runs_[key] = std::move(r);
  // The first step (often a spawn that can fail at once) runs from the loop: callbacks never run before the
  // call that started the operation returns.
  start_timer(key, 0, [this, key] { next(key); });
}

void VmmDriver::start_timer(Op* op, uint64_t ms, std::function<void()> fn) {
  op->timer_fn = std::move(fn);
  uv_timer_start(op->timer, [](uv_timer_t* t) {
    auto* o = static_cast<Op*>(t->data);
    auto fn = std::move(o->timer_fn);
    o->timer_fn = nullptr;
    fn();
  }, ms, 0);
}

void VmmDriver::next(Op* op) {
  Run* r = runs_.at(op).get();
  if (op->superseded) return end(op, fail(Error::kConflict, "sandbox " + op->sandbox_id + ": terminated while " + op->what));
  if (r->index == r->steps.size()) return end(op, {});
  Step& step = r->steps[r->index++];
  step(op, [this, op](Status s) {
    if (!s) return end(op, std::move(s));
    next(op);
  });
}

void VmmDriver::end(Op* op, Status status) {
  Run* r = runs_.at(op).get();
  auto complete = [this, op](Status st) {
    auto it = runs_.find(op);
    std::unique_ptr<Run> owned = std::move(it->second);
    runs_.erase(it);
    auto finish = std::move(owned->finish);
    finish(op, std::move(st));  // `owned` (and the op) die after the caller's callback
  };
  if (status.ok() || !r->on_failure) return complete(std::move(status));
  Step cleanup = std::move(r->on_failure);
  r->on_failure = nullptr;
  cleanup(op, [complete, status = std::move(status)](Status) { complete(status); });
}

void VmmDriver::checkpoint_paused(const SandboxSpec& spec, const RuntimeInfo& info, bool paused, Step pause,
                                  Step save, Step resume, std::function<VmCheckpoint()> sizes,
                                  std::function<void(Result<VmCheckpoint>)> done) {
  // A VM suspended in memory is saved as it stands, and stays paused: no pause of ours, nothing to resume.
  if (paused) pause = resume = [](Op*, StepDone d) { d({}); };
  auto paused_at = std::make_shared<std::chrono::steady_clock::time_point>();
  auto pause_ms = std::make_shared<double>(0);
  std::vector<Step> steps;
  steps.push_back([paused_at, pause](Op* o, StepDone d) {
    *paused_at = std::chrono::steady_clock::now();
    pause(o, std::move(d));
  });
  steps.push_back(std::move(save));
  steps.push_back([paused_at, pause_ms, resume, paused](Op* o, StepDone d) {
    resume(o, [paused_at, pause_ms, paused, d](Status s) {
      if (!paused)
        *pause_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - *paused_at).count();
      d(std::move(s));
    });
  });
  Step resume_anyway = [resume](Op* o, StepDone d) { resume(o, [d](Status) { d({}); }); };
  run(new_op(spec, "checkpointing", info), std::move(steps), std::move(resume_anyway),
      [pause_ms, sizes = std::move(sizes), done = std::move(done)](Op*, Status s) {
        if (!s) return done(s.failure());
        VmCheckpoint out = sizes();
        out.pause_ms = *pause_ms;
        done(out);
      });
}

VmmDriver::Step VmmDriver::spawn_step(std::vector<std::string> args) {
  return [this, args = std::move(args)](Op* op, StepDone done) {
    const std::string& sock = op->info.driver_data[kApiSocket];
    std::error_code ec;
    std::filesystem::remove(sock, ec);  // a stale socket of a dead VMM would make the new one fail to bind
    // In the sandbox's directory: the socket paths a snapshot records are relative to it (kVsockName), so a
    // sandbox started from another's memory snapshot binds its own.
    auto p = spawn_vmm(peer_, options_.binary, args, op->info.sandbox_dir + "/" + peer_ + ".log",
                       {.cwd = op->info.sandbox_dir, .batch_scheduling = options_.batch_scheduling});
    if (!p) return done(p.failure());
    op->process = *p;
    op->spawned = true;
    op->info.pid = p->pid;
    op->info.start_time_ticks = p->start_time_ticks;
    done({});
  };
}

VmmDriver::Step VmmDriver::kill_step() {
  return [this](Op* op, StepDone done) {
    if (op->process.pid <= 0) return done({});
    if (Status s = kill_vmm(op->process); !s) return done(s);
    auto once = std::make_shared<StepDone>(std::move(done));
    auto w = VmmExitWatch::start(loop_, op->process, [op, once] {
      uv_timer_stop(op->timer);
      if (*once) std::exchange(*once, nullptr)({});
    });
    if (!w) return std::exchange(*once, nullptr)(w.failure());
    op->exit_wait = std::move(*w);
    std::string message = peer_ + " (pid " + std::to_string(op->process.pid) + ") did not exit after SIGKILL";
    start_timer(op, options_.exit_wait_ms, [once, message] {
      if (*once) std::exchange(*once, nullptr)(fail(Error::kTimeout, message));
    });
  };
}
VmmDriver::Step VmmDriver::commit_state_step() {
  return [](Op* op, StepDone done) {
    const std::string& dir = op->info.sandbox_dir;
    std::error_code ec;
    // A leftover ".old" is from a commit interrupted by a crash; the rename order below keeps one complete
    // state on disk at every moment.
    std::filesystem::remove_all(state_dir(dir) + ".old", ec);
    if (std::filesystem::exists(state_dir(dir), ec)) {
      std::filesystem::rename(state_dir(dir), state_dir(dir) + ".old", ec);
      if (ec) return done(fail(Error::kIo, "cannot move the previous saved state aside: " + ec.message()));
    }
    std::filesystem::rename(new_state_dir(dir), state_dir(dir), ec);
    if (ec) {
      std::error_code ignored;
      std::filesystem::rename(state_dir(dir) + ".old", state_dir(dir), ignored);
      return done(fail(Error::kIo, "cannot commit the saved state: " + ec.message()));
    }
    std::filesystem::remove_all(state_dir(dir) + ".old", ec);
    op->info.driver_data[kStateDir] = state_dir(dir);
    done({});
  };
}

VmmDriver::Step VmmDriver::cancel_point_step() {
  return [](Op* o, StepDone d) {
    if (o->cancel_requested)
      return d(fail(Error::kConflict, "sandbox " + o->sandbox_id + ": hibernate cancelled; still paused in memory"));
    o->cancellable = false;
    d({});
  };
}

void VmmDriver::discard_new_state(const std::string& sandbox_dir) {
  std::error_code ec;
  std::filesystem::remove_all(new_state_dir(sandbox_dir), ec);
}

bool VmmDriver::cancel(const SandboxSpec& spec) {
  Op* op = in_flight(spec.id);
  if (op == nullptr || !op->cancellable) return false;
  op->cancel_requested = true;
  return true;
}

void VmmDriver::terminate(const SandboxSpec& spec, const RuntimeInfo& info, Done done) {
  if (Op* other = in_flight(spec.id)) other->superseded = true;
  // The exit this causes is not one the instance made by itself, so the watcher is not told.
  watches_.erase(spec.id);
  auto op = new_op(spec, "terminating", info);
  op->terminate = true;
  Step graceful = [this](Op* o, StepDone d) {
    if (!vmm_alive(o->process)) return d({});
    graceful_stop(o, [d](Status) { d({}); });  // best effort: SIGKILL follows either way
  };
  run(std::move(op), {std::move(graceful), kill_step()}, nullptr,
      [done = std::move(done)](Op*, Status s) { done(std::move(s)); });
}

Status VmmDriver::watch_exit(const SandboxSpec& spec, const RuntimeInfo& info, std::function<void()> on_exit) {
  auto w = VmmExitWatch::start(loop_, VmmProcess{info.pid, info.start_time_ticks}, [this, id = spec.id, on_exit] {
    auto it = watches_.find(id);
    std::unique_ptr<VmmExitWatch> owned = it != watches_.end() ? std::move(it->second) : nullptr;
    if (it != watches_.end()) watches_.erase(it);
    on_exit();
    // `owned` (the watch running this callback) is freed here; its fire() touches nothing after us.
  });
  if (!w) return fail(w.error(), "sandbox " + spec.id + ": " + w.message());
  watches_[spec.id] = std::move(*w);
  return {};
}

void VmmDriver::unwatch(const SandboxSpec& spec) { watches_.erase(spec.id); }

ObservedInstance VmmDriver::observe(const SandboxSpec&, const RuntimeInfo& info) {
  ObservedInstance o;
  o.alive = vmm_alive(VmmProcess{info.pid, info.start_time_ticks});
  if (o.alive) {
    auto paused = query_paused(info);
    // An alive VMM that does not answer is reported running: the node then pauses it again through the API,
    // which fails clearly if the VMM is wedged.
    o.paused = paused.ok() && *paused;
    return o;
  }
  auto it = info.driver_data.find(kStateDir);
  std::error_code ec;
  o.hibernated = it != info.driver_data.end() && std::filesystem::is_directory(it->second, ec) &&
                 !std::filesystem::is_empty(it->second, ec);
  return o;
}

Result<GuestSocket> VmmDriver::open_socket(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port) {
  auto it = info.driver_data.find(kVsockSocket);
  if (it == info.driver_data.end()) return fail(Error::kNotFound, "sandbox " + spec.id + " has no vsock device");
  auto fd = vsock_connect(it->second, port, static_cast<int>(options_.vsock_connect_timeout_ms));
  if (!fd) return fail(fd.error(), "sandbox " + spec.id + ": " + fd.message());
  return GuestSocket{.fd = std::move(*fd), .connected = true, .connect_port = port};
}

}  // namespace sg
