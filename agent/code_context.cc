#include "agent/code_context.h"

#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

extern char** environ;

namespace sg::agent {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr size_t kReadChunkBytes = 64 * 1024;
// A frame may carry a little more than an event: the driver's own framing fields.
constexpr size_t kFrameSlackBytes = 4096;

template <typename Json>
std::string line(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

uv_handle_t* handle(void* h) { return static_cast<uv_handle_t*>(h); }
uv_stream_t* stream(void* h) { return static_cast<uv_stream_t*>(h); }

// The agent's environment, with MPLBACKEND=Agg: a sandbox has no display, and Agg draws the PNGs that
// figures are sent as. PYTHONUNBUFFERED makes Python programs the code starts write their output at once.
std::vector<std::string> interpreter_environment() {
  std::vector<std::string> out;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    std::string_view kv(*entry);
    std::string_view name = kv.substr(0, kv.find('='));
    if (name != "MPLBACKEND" && name != "PYTHONUNBUFFERED") out.emplace_back(kv);
  }
  out.emplace_back("MPLBACKEND=Agg");
  out.emplace_back("PYTHONUNBUFFERED=1");
  return out;
}

}  // namespace

std::string_view context_state_name(ContextState s) {
  switch (s) {
    case ContextState::kIdle: return "idle";
    case ContextState::kRunning: return "running";
    case ContextState::kInterrupting: return "interrupting";
    case ContextState::kDead: return "dead";
  }
  return "unknown";
}

// ---- frames ----

std::string encode_frame(std::string_view payload) {
  auto n = static_cast<uint32_t>(payload.size());
  std::string out{static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                  static_cast<char>(n)};
  out.append(payload);
  return out;
}

Status FrameReader::feed(std::string_view data, std::vector<std::string>& frames) {
  if (broken_) return fail(Error::kInvalidArgument, "frame stream already broken");
  buf_.append(data);
  size_t pos = 0;
  while (buf_.size() - pos >= 4) {
    auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(buf_[pos + i])); };
    uint32_t n = (b(0) << 24) | (b(1) << 16) | (b(2) << 8) | b(3);
    if (n > max_) {
      broken_ = true;
      buf_.clear();
      return fail(Error::kLimitExceeded,
                  "a frame of " + std::to_string(n) + " bytes exceeds the limit of " + std::to_string(max_));
    }
    if (buf_.size() - pos - 4 < n) break;
    frames.emplace_back(buf_.substr(pos + 4, n));
    pos += 4 + n;
  }
  buf_.erase(0, pos);
  return {};
}

// ---- the interpreter process ----

// One python3 running the driver: its stdout and stderr (what programs the code starts write), the request
// pipe (fd 3) and the event pipe (fd 4). Owns libuv handles, so it frees itself: after detach(), once every
// handle has closed.
class Interpreter {
 public:
  // `language`: "python" or "bash" (the driver runs the cells itself, or through a persistent bash).
  static Result<Interpreter*> spawn(uv_loop_t* loop, const CodeSettings& settings, const std::string& language,
                                    CodeContext* owner);

  int pid() const { return process_.pid; }
  void send(std::string payload);
  void interrupt() {
    if (!exited_) ::kill(process_.pid, SIGINT);
  }
  void start_timer(uint64_t ms, bool grace);
  void stop_timer() { uv_timer_stop(&timer_); }
  void pause();
  void resume();
  // The owner is done with it: the process group is SIGKILLed, the handles close.
  void detach();

 private:
  explicit Interpreter(CodeContext* owner, size_t max_frame) : owner_(owner), reader_(max_frame) {}
  void on_read(uv_pipe_t* pipe, ssize_t nread, const char* data);
  void on_events(std::string_view data);
  void drain(uv_pipe_t* pipe);
  void close_handle(uv_handle_t* h);

  CodeContext* owner_;
  FrameReader reader_;
  uv_process_t process_{};
  uv_pipe_t out_{}, err_{}, req_{}, ev_{};
  uv_timer_t timer_{};
  std::string read_buf_ = std::string(kReadChunkBytes, '\0');
  int open_handles_ = 0;
  bool exited_ = false;
  bool grace_ = false;
  bool detached_ = false;
};

Result<Interpreter*> Interpreter::spawn(uv_loop_t* loop, const CodeSettings& settings, const std::string& language,
                                        CodeContext* owner) {
  auto* p = new Interpreter(owner, settings.max_event_bytes + kFrameSlackBytes);
  for (uv_pipe_t* pipe : {&p->out_, &p->err_, &p->req_, &p->ev_}) {
    uv_pipe_init(loop, pipe, 0);
    pipe->data = p;
    ++p->open_handles_;
  }
  uv_timer_init(loop, &p->timer_);
  p->timer_.data = p;
  ++p->open_handles_;

  std::string driver(code_driver_source());
  std::string max_event = std::to_string(settings.max_event_bytes);
  std::string dash_c = "-c";
  std::string lang = language;
  std::vector<char*> argv = {const_cast<char*>(settings.python.c_str()), dash_c.data(), driver.data(),
                             max_event.data(), lang.data(), nullptr};
  std::vector<std::string> env = interpreter_environment();
  std::vector<char*> envp;
  for (std::string& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);

  uv_stdio_container_t stdio[5];
  stdio[0].flags = UV_IGNORE;  // /dev/null: input() gets EOF instead of stealing the agent's stdin
  auto pipe_to = [&](int i, uv_pipe_t* pipe, int direction) {
    stdio[i].flags = static_cast<uv_stdio_flags>(UV_CREATE_PIPE | direction);
    stdio[i].data.stream = stream(pipe);
  };
  pipe_to(1, &p->out_, UV_WRITABLE_PIPE);
  pipe_to(2, &p->err_, UV_WRITABLE_PIPE);
  pipe_to(3, &p->req_, UV_READABLE_PIPE);
  pipe_to(4, &p->ev_, UV_WRITABLE_PIPE);

  uv_process_options_t options{};
  options.exit_cb = [](uv_process_t* h, int64_t status, int term_signal) {
    auto* self = static_cast<Interpreter*>(h->data);
    self->exited_ = true;
    uv_timer_stop(&self->timer_);
    // Events written before the exit may still sit in the pipes: they belong before the exit's report.
    self->drain(&self->ev_);
    self->drain(&self->out_);
    self->drain(&self->err_);
    if (self->owner_ != nullptr) self->owner_->on_exit(status, term_signal);
  };
  options.file = argv[0];
  options.args = argv.data();
  options.env = envp.data();
  // Its own session and process group: kill(-pid) reaches whatever the code started.
  options.flags = UV_PROCESS_DETACHED;
  options.stdio_count = 5;
  options.stdio = stdio;
  int rc = uv_spawn(loop, &p->process_, &options);
  p->process_.data = p;
  ++p->open_handles_;
  if (rc < 0) {
    p->exited_ = true;
    p->detach();
    Error code = rc == UV_ENOENT || rc == UV_EACCES ? Error::kNotFound : Error::kUnavailable;
    return fail(code, "cannot start the interpreter '" + settings.python + "': " + uv_strerror(rc));
  }
  p->resume();
  return p;
}

void Interpreter::send(std::string payload) {
  struct Write {
    uv_write_t req;
    std::string data;
  };
  auto* w = new Write{{}, encode_frame(payload)};
  uv_buf_t buf = uv_buf_init(w->data.data(), static_cast<unsigned>(w->data.size()));
  // A dead interpreter fails the write (EPIPE); its exit is reported on its own.
  if (uv_write(&w->req, stream(&req_), &buf, 1, [](uv_write_t* r, int) { delete reinterpret_cast<Write*>(r); }) < 0)
    delete w;
}

void Interpreter::start_timer(uint64_t ms, bool grace) {
  grace_ = grace;
  uv_timer_start(
      &timer_,
      [](uv_timer_t* t) {
        auto* self = static_cast<Interpreter*>(t->data);
        if (self->owner_ == nullptr) return;
        if (self->grace_)
          self->owner_->on_grace_expired();
        else
          self->owner_->on_timeout();
      },
      ms, 0);
}

void Interpreter::pause() {
  for (uv_pipe_t* pipe : {&out_, &err_, &ev_})
    if (!uv_is_closing(handle(pipe))) uv_read_stop(stream(pipe));
}

void Interpreter::resume() {
  for (uv_pipe_t* pipe : {&out_, &err_, &ev_}) {
    if (uv_is_closing(handle(pipe))) continue;
    uv_read_start(
        stream(pipe),
        [](uv_handle_t* h, size_t, uv_buf_t* buf) {
          auto* self = static_cast<Interpreter*>(h->data);
          *buf = uv_buf_init(self->read_buf_.data(), static_cast<unsigned>(self->read_buf_.size()));
        },
        [](uv_stream_t* s, ssize_t nread, const uv_buf_t* buf) {
          static_cast<Interpreter*>(s->data)->on_read(reinterpret_cast<uv_pipe_t*>(s), nread, buf->base);
        });
  }
}

void Interpreter::on_read(uv_pipe_t* pipe, ssize_t nread, const char* data) {
  if (nread < 0) {
    close_handle(handle(pipe));  // EOF or an error: this pipe is done (the exit is reported on its own)
    return;
  }
  if (nread == 0 || owner_ == nullptr) return;
  std::string_view bytes(data, static_cast<size_t>(nread));
  if (pipe == &ev_) return on_events(bytes);
  owner_->on_raw_output(pipe == &err_, bytes);
}

void Interpreter::on_events(std::string_view data) {
  std::vector<std::string> frames;
  Status s = reader_.feed(data, frames);
  for (const std::string& frame : frames) {
    // The driver reads its fds 1 and 2 itself (code_driver.py, _Capture) and sends their output as events;
    // these pipes carry only what the interpreter wrote before it took them over or after it lost them
    // (Python's own startup and fatal errors), reported ahead of the frame that followed it.
    drain(&out_);
    drain(&err_);
    if (owner_ == nullptr) return;
    owner_->on_frame(frame);
  }
  if (!s && owner_ != nullptr) owner_->on_frame(std::string_view{});  // an empty frame is a protocol error
}

// Reads what is in the pipe now, without waiting (the pipes are non-blocking).
void Interpreter::drain(uv_pipe_t* pipe) {
  uv_os_fd_t fd;
  if (uv_is_closing(handle(pipe)) || uv_fileno(handle(pipe), &fd) != 0) return;
  char buf[16 * 1024];
  while (owner_ != nullptr) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) return;  // EAGAIN: nothing more now; EOF and errors: the read callback sees them too
    std::string_view bytes(buf, static_cast<size_t>(n));
    if (pipe == &ev_)
      on_events(bytes);
    else
      owner_->on_raw_output(pipe == &err_, bytes);
  }
}

void Interpreter::detach() {
  detached_ = true;
  owner_ = nullptr;
  // Only while the leader is unreaped: its pid (the group id) cannot have been reused yet.
  if (!exited_) ::kill(-process_.pid, SIGKILL);
  for (uv_handle_t* h : {handle(&out_), handle(&err_), handle(&req_), handle(&ev_), handle(&timer_)}) close_handle(h);
  // The process handle closes once the exit is seen (closing it earlier would leave a zombie behind).
  if (exited_) close_handle(handle(&process_));
  else
    process_.exit_cb = [](uv_process_t* h, int64_t, int) {
      static_cast<Interpreter*>(h->data)->close_handle(reinterpret_cast<uv_handle_t*>(h));
    };
}

void Interpreter::close_handle(uv_handle_t* h) {
  if (uv_is_closing(h)) return;
  uv_close(h, [](uv_handle_t* closed) {
    auto* self = static_cast<Interpreter*>(closed->data);
    if (--self->open_handles_ == 0 && self->detached_) delete self;
  });
}

// ---- the context ----

Result<std::unique_ptr<CodeContext>> CodeContext::start(uv_loop_t* loop, std::string id, std::string language,
                                                        const CodeSettings& settings) {
  std::unique_ptr<CodeContext> ctx(new CodeContext(loop, std::move(id), std::move(language), settings));
  if (auto s = ctx->spawn(); !s) return s.failure();
  return ctx;
}

CodeContext::~CodeContext() {
  if (in_run()) end_run("ContextDeleted", "the context was deleted during the run");
  kill_interpreter();
}

int CodeContext::pid() const { return interp_ != nullptr ? interp_->pid() : 0; }

Status CodeContext::transition(ContextState to) {
  using S = ContextState;
  bool ok = false;
  switch (state_) {
    case S::kIdle: ok = to == S::kRunning || to == S::kDead; break;
    case S::kRunning: ok = to == S::kIdle || to == S::kInterrupting || to == S::kDead; break;
    case S::kInterrupting: ok = to == S::kIdle || to == S::kDead; break;
    case S::kDead: ok = to == S::kIdle; break;
  }
  if (!ok)
    return fail(Error::kConflict, "context " + id_ + ": no transition from " +
                                      std::string(context_state_name(state_)) + " to " +
                                      std::string(context_state_name(to)));
  state_ = to;
  return {};
}

Status CodeContext::spawn() {
  auto interp = Interpreter::spawn(loop_, settings_, language_, this);
  if (!interp) return interp.failure();
  interp_ = *interp;
  kill_reason_.clear();
  return transition(ContextState::kIdle);
}

void CodeContext::kill_interpreter() {
  if (interp_ == nullptr) return;
  interp_->detach();
  interp_ = nullptr;
  if (state_ != ContextState::kDead) (void)transition(ContextState::kDead);  // every state may die
}

Result<CodeContext::RunStart> CodeContext::run(const std::string& code, uint64_t timeout_secs, RunObserver* observer) {
  if (state_ == ContextState::kRunning || state_ == ContextState::kInterrupting)
    return fail(Error::kConflict, "context '" + id_ + "' is running code: one run at a time per context");
  RunStart start;
  if (state_ == ContextState::kDead) {
    if (auto s = spawn(); !s) return s.failure();
    start.restarted = true;
  }
  if (auto s = transition(ContextState::kRunning); !s) return s.failure();
  observer_ = observer;
  timed_out_ = false;
  truncated_ = false;
  run_output_bytes_ = 0;
  run_started_ms_ = uv_now(loop_);
  ++runs_;
  interp_->send(line(json{{"code", code}}));
  if (timeout_secs > 0) interp_->start_timer(timeout_secs * 1000, false);
  return start;
}

void CodeContext::detach_run() {
  observer_ = nullptr;
  // Nobody reads the rest: stop the code as a timeout would, and keep the context.
  if (state_ == ContextState::kRunning) on_timeout();
  if (interp_ != nullptr) interp_->resume();
}

void CodeContext::pause_output() {
  if (interp_ != nullptr) interp_->pause();
}

void CodeContext::resume_output() {
  if (interp_ != nullptr) interp_->resume();
}

Status CodeContext::reset() {
  if (in_run()) end_run("ContextReset", "the context was reset during the run: its state is gone");
  kill_interpreter();
  death_.clear();
  return spawn();
}

void CodeContext::emit(std::string text) {
  if (observer_ != nullptr) observer_->on_event(std::move(text));
}

void CodeContext::end_run(std::string_view error_name, std::string_view message) {
  if (!error_name.empty())
    emit(line(ordered_json{{"type", "error"}, {"name", error_name}, {"message", message},
                           {"traceback", json::array()}}));
  for (bool is_stderr : {false, true}) {
    std::string rest = carry_[is_stderr].flush();
    if (!rest.empty()) emit(output_event(is_stderr, rest));
  }
  ordered_json end = {{"type", "end"}, {"context", id_}, {"duration_ms", uv_now(loop_) - run_started_ms_}};
  if (timed_out_) end["timed_out"] = true;
  if (truncated_) end["output_truncated"] = true;
  if (interp_ != nullptr) interp_->stop_timer();
  RunObserver* observer = std::exchange(observer_, nullptr);
  if (observer != nullptr) observer->on_end(line(end));
}

void CodeContext::broken(std::string_view why) {
  bool was_running = in_run();
  kill_interpreter();
  death_ = "broke the driver protocol (" + std::string(why) + ") and was killed";
  if (was_running)
    end_run("InterpreterDied", "the interpreter " + death_ +
                                   ": the context's state is lost; the next run starts a fresh interpreter");
}

void CodeContext::on_frame(std::string_view payload) {
  // Ordered: the events keep the driver's field order, "type" first.
  ordered_json j = ordered_json::parse(payload, nullptr, false);
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    return broken(payload.empty() ? "a frame over the event size limit" : "a frame that is not a JSON event");
  const std::string& type = j["type"].get_ref<const std::string&>();
  if (type == "ready") return;
  if (!in_run()) return;  // output of a thread the code left running, between runs: nobody asked for it
  if (type == "done") {
    end_run({}, {});
    if (auto s = transition(ContextState::kIdle); !s) broken(s.message());
    return;
  }
  if (type != "stdout" && type != "stderr" && type != "result" && type != "display" && type != "error")
    return broken("an unknown event type");
  std::string text = line(j);
  if (type != "error") {
    if (truncated_ || run_output_bytes_ + text.size() > settings_.max_run_output_bytes) {
      truncated_ = true;
      return;
    }
    run_output_bytes_ += text.size();
  }
  emit(std::move(text));
}

void CodeContext::on_raw_output(bool is_stderr, std::string_view bytes) {
  if (!in_run()) return;
  std::string text = carry_[is_stderr].take(bytes);
  if (text.empty()) return;
  std::string event = output_event(is_stderr, text);
  if (truncated_ || run_output_bytes_ + event.size() > settings_.max_run_output_bytes) {
    truncated_ = true;
    return;
  }
  run_output_bytes_ += event.size();
  emit(std::move(event));
}

void CodeContext::on_exit(int64_t code, int signal) {
  if (interp_ != nullptr) {
    interp_->detach();
    interp_ = nullptr;
  }
  death_ = !kill_reason_.empty() ? std::exchange(kill_reason_, {})
           : signal != 0           ? "was killed by signal " + std::to_string(signal)
                                   : "exited with code " + std::to_string(code);
  bool was_running = in_run();
  if (auto s = transition(ContextState::kDead); !s) return;  // dead already: reported when it happened
  if (was_running)
    end_run("InterpreterDied", "the interpreter " + death_ +
                                   " during the run: the context's state is lost; the next run starts a fresh "
                                   "interpreter");
}

void CodeContext::on_timeout() {
  if (state_ != ContextState::kRunning || interp_ == nullptr) return;
  if (observer_ != nullptr) timed_out_ = true;
  if (auto s = transition(ContextState::kInterrupting); !s) return broken(s.message());
  interp_->interrupt();  // KeyboardInterrupt in the code
  interp_->start_timer(settings_.interrupt_grace_ms, true);
}

void CodeContext::on_grace_expired() {
  kill_reason_ = "did not stop within " + std::to_string(settings_.interrupt_grace_ms) +
                 " ms of the KeyboardInterrupt and was killed";
  if (interp_ != nullptr) ::kill(-interp_->pid(), SIGKILL);  // the exit is reported through on_exit
}

}  // namespace sg::agent
