#include "agent/exec.h"

#include <signal.h>
#include <cerrno>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/base64.h"

extern char** environ;

namespace sg::agent {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr size_t kReadChunkBytes = 64 * 1024;
// After the command exits, how long its pipes may stay open (a background child that inherited them)
// before the exit is reported anyway.
constexpr uint64_t kExitDrainMs = 500;
// Keeps timeout_secs * 1000 far from overflowing; 31 years is no practical limit.
constexpr uint64_t kMaxTimeoutSecs = 1'000'000'000;

Failure wrong_type(std::string_view field, std::string_view expected, const json& got) {
  return fail(Error::kInvalidArgument,
              std::string(field) + ": must be " + std::string(expected) + ", got " + got.type_name());
}

// execve() and chdir() take C strings: an embedded NUL would silently cut the value short.
Status no_nul(std::string_view field, std::string_view value) {
  if (value.find('\0') != std::string_view::npos)
    return fail(Error::kInvalidArgument, std::string(field) + ": must not contain NUL bytes");
  return {};
}

template <typename Json>
std::string line(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::vector<std::string> merged_environment(const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::vector<std::string> out;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    std::string_view kv(*entry);
    std::string_view name = kv.substr(0, kv.find('='));
    bool overridden = false;
    for (const auto& [key, value] : overrides) overridden = overridden || key == name;
    if (!overridden) out.emplace_back(kv);
  }
  for (const auto& [key, value] : overrides) out.push_back(key + "=" + value);
  return out;
}

}  // namespace

Result<ExecSpec> parse_exec_request(std::string_view body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return fail(Error::kInvalidArgument, "request body is not valid JSON");
  if (!j.is_object())
    return fail(Error::kInvalidArgument, std::string("request body must be a JSON object, got ") + j.type_name());
  ExecSpec spec;
  bool has_command = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "command") {
      if (!v.is_array() || v.empty()) return wrong_type(key, "a non-empty array of strings", v);
      for (const json& arg : v) {
        if (!arg.is_string()) return wrong_type("command[]", "a string", arg);
        if (auto s = no_nul("command[]", arg.get_ref<const std::string&>()); !s) return s.failure();
        spec.command.push_back(arg.get<std::string>());
      }
      if (spec.command[0].empty()) return fail(Error::kInvalidArgument, "command[0]: must not be empty");
      has_command = true;
    } else if (key == "env") {
      if (!v.is_object()) return wrong_type(key, "an object of strings", v);
      for (auto e = v.begin(); e != v.end(); ++e) {
        if (!e.value().is_string()) return wrong_type("env." + e.key(), "a string", e.value());
        if (e.key().empty() || e.key().find('=') != std::string::npos)
          return fail(Error::kInvalidArgument, "env: '" + e.key() + "' is not a valid variable name");
        if (auto s = no_nul("env." + e.key(), e.key() + e.value().get<std::string>()); !s) return s.failure();
        spec.env.emplace_back(e.key(), e.value().get<std::string>());
      }
    } else if (key == "cwd") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
      spec.cwd = v.get<std::string>();
      if (auto s = no_nul(key, spec.cwd); !s) return s.failure();
    } else if (key == "stdin") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
      spec.stdin_data = v.get<std::string>();
    } else if (key == "timeout_secs") {
      if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0) ||
          v.get<uint64_t>() > kMaxTimeoutSecs)
        return fail(Error::kInvalidArgument,
                    "timeout_secs: must be an integer from 0 (none) to " + std::to_string(kMaxTimeoutSecs));
      spec.timeout_secs = v.get<uint64_t>();
    } else {
      return fail(Error::kInvalidArgument,
                  "unknown field '" + key + "' (allowed: command, env, cwd, stdin, timeout_secs)");
    }
  }
  if (!has_command) return fail(Error::kInvalidArgument, "command is required (a non-empty array of strings: argv)");
  return spec;
}

// ---- the process ----

Result<ExecProcess*> ExecProcess::spawn(uv_loop_t* loop, const ExecSpec& spec, ExecObserver* observer,
                                        size_t* running) {
  auto* p = new ExecProcess(observer, running);
  p->read_buf_.resize(kReadChunkBytes);
  p->has_stdin_ = spec.stdin_data.has_value();
  for (uv_pipe_t* pipe : {&p->stdin_, &p->stdout_, &p->stderr_}) {
    uv_pipe_init(loop, pipe, 0);
    pipe->data = p;
    ++p->open_handles_;
  }
  uv_timer_init(loop, &p->timer_);
  p->timer_.data = p;
  ++p->open_handles_;

  std::vector<char*> argv;
  for (const std::string& arg : spec.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env = merged_environment(spec.env);
  std::vector<char*> envp;
  for (std::string& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);

  uv_stdio_container_t stdio[3];
  stdio[0].flags = p->has_stdin_ ? static_cast<uv_stdio_flags>(UV_CREATE_PIPE | UV_READABLE_PIPE) : UV_IGNORE;
  stdio[0].data.stream = reinterpret_cast<uv_stream_t*>(&p->stdin_);
  stdio[1].flags = static_cast<uv_stdio_flags>(UV_CREATE_PIPE | UV_WRITABLE_PIPE);
  stdio[1].data.stream = reinterpret_cast<uv_stream_t*>(&p->stdout_);
  stdio[2].flags = static_cast<uv_stdio_flags>(UV_CREATE_PIPE | UV_WRITABLE_PIPE);
  stdio[2].data.stream = reinterpret_cast<uv_stream_t*>(&p->stderr_);

  uv_process_options_t options{};
  options.exit_cb = [](uv_process_t* h, int64_t status, int term_signal) {
    static_cast<ExecProcess*>(h->data)->on_process_exit(status, term_signal);
  };
  options.file = argv[0];
  options.args = argv.data();
  options.env = envp.data();
  options.cwd = spec.cwd.empty() ? nullptr : spec.cwd.c_str();
  // setsid() in the child: its own session and process group, so kill(-pid) reaches everything it starts
  // and a signal aimed at the agent's group does not reach it.
  options.flags = UV_PROCESS_DETACHED;
  options.stdio_count = 3;
  options.stdio = stdio;

  int rc = uv_spawn(loop, &p->process_, &options);
  p->process_.data = p;
  ++p->open_handles_;  // the process handle is initialized even when the spawn fails
  if (rc < 0) {
    p->exited_ = true;
    p->reported_ = true;
    p->detached_ = true;
    for (uv_handle_t* h : {reinterpret_cast<uv_handle_t*>(&p->stdin_), reinterpret_cast<uv_handle_t*>(&p->stdout_),
                           reinterpret_cast<uv_handle_t*>(&p->stderr_), reinterpret_cast<uv_handle_t*>(&p->timer_),
                           reinterpret_cast<uv_handle_t*>(&p->process_)})
      p->close_handle(h);
    Error code = Error::kUnavailable;  // out of memory, processes or descriptors: may work later
    if (rc == UV_ENOENT || rc == UV_ENOTDIR) code = Error::kNotFound;
    if (rc == UV_EACCES || rc == UV_EPERM) code = Error::kPermissionDenied;
    if (rc == -ENOEXEC || rc == UV_EINVAL || rc == UV_ELOOP || rc == UV_ENAMETOOLONG) code = Error::kInvalidArgument;
    std::string where = spec.cwd.empty() ? "" : " in " + spec.cwd;
    return fail(code, "cannot run '" + spec.command[0] + "'" + where + ": " + uv_strerror(rc));
  }
  ++*running;
  p->open_outputs_ = 2;
  p->resume_output();
  if (p->has_stdin_) {
    p->stdin_data_ = *spec.stdin_data;
    p->stdin_write_.data = p;
    uv_buf_t buf = uv_buf_init(p->stdin_data_.data(), static_cast<unsigned>(p->stdin_data_.size()));
    // Closing stdin after the write gives the command EOF; a command that exits without reading it ends
    // the write with EPIPE, which is fine.
    int wrc = uv_write(&p->stdin_write_, reinterpret_cast<uv_stream_t*>(&p->stdin_), &buf, 1, [](uv_write_t* w, int) {
      auto* self = static_cast<ExecProcess*>(w->data);
      self->close_handle(reinterpret_cast<uv_handle_t*>(&self->stdin_));
    });
    if (wrc < 0) p->close_handle(reinterpret_cast<uv_handle_t*>(&p->stdin_));
  } else {
    p->close_handle(reinterpret_cast<uv_handle_t*>(&p->stdin_));
  }
  if (spec.timeout_secs > 0) {
    uv_timer_start(
        &p->timer_,
        [](uv_timer_t* t) {
          auto* self = static_cast<ExecProcess*>(t->data);
          self->exit_.timed_out = true;
          self->kill_group();
        },
        spec.timeout_secs * 1000, 0);
  }
  return p;
}

void ExecProcess::pause_output() {
  paused_ = true;
  for (uv_pipe_t* pipe : {&stdout_, &stderr_})
    if (!uv_is_closing(reinterpret_cast<uv_handle_t*>(pipe))) uv_read_stop(reinterpret_cast<uv_stream_t*>(pipe));
}

void ExecProcess::resume_output() {
  paused_ = false;
  for (uv_pipe_t* pipe : {&stdout_, &stderr_}) {
    if (uv_is_closing(reinterpret_cast<uv_handle_t*>(pipe))) continue;
    uv_read_start(
        reinterpret_cast<uv_stream_t*>(pipe),
        [](uv_handle_t* h, size_t, uv_buf_t* buf) {
          auto* self = static_cast<ExecProcess*>(h->data);
          *buf = uv_buf_init(self->read_buf_.data(), static_cast<unsigned>(self->read_buf_.size()));
        },
        [](uv_stream_t* s, ssize_t nread, const uv_buf_t*) {
          static_cast<ExecProcess*>(s->data)->on_read(reinterpret_cast<uv_pipe_t*>(s), nread);
        });
  }
}

void ExecProcess::detach() {
  detached_ = true;
  observer_ = nullptr;
  kill_group();
  resume_output();  // nobody wants the rest, but reading it lets the pipes reach EOF and close
  if (open_handles_ == 0) delete this;
}

void ExecProcess::on_read(uv_pipe_t* pipe, ssize_t nread) {
  if (nread > 0) {
    if (observer_ != nullptr) observer_->on_output(pipe == &stderr_, std::string_view(read_buf_.data(), nread));
  } else if (nread < 0) {
    close_output(pipe);  // EOF, or a read error that ends this stream just the same
  }
}

void ExecProcess::close_output(uv_pipe_t* pipe) {
  if (uv_is_closing(reinterpret_cast<uv_handle_t*>(pipe))) return;
  uv_read_stop(reinterpret_cast<uv_stream_t*>(pipe));
  close_handle(reinterpret_cast<uv_handle_t*>(pipe));
  --open_outputs_;
  maybe_report_exit();
}

void ExecProcess::on_process_exit(int64_t status, int term_signal) {
  exited_ = true;
  --*running_;
  exit_.code = static_cast<int>(status);
  exit_.signal = term_signal;
  uv_timer_stop(&timer_);
  if (open_outputs_ > 0) {
    uv_timer_start(
        &timer_,
        [](uv_timer_t* t) {
          auto* self = static_cast<ExecProcess*>(t->data);
          // Output held back by a slow client is still owed (the timer repeats); only stop waiting for an
          // EOF that may never come.
          if (self->paused_) return;
          self->close_output(&self->stdout_);
          self->close_output(&self->stderr_);
        },
        kExitDrainMs, kExitDrainMs);
  }
  maybe_report_exit();
}

void ExecProcess::maybe_report_exit() {
  if (!exited_ || open_outputs_ > 0 || reported_) return;
  reported_ = true;
  uv_timer_stop(&timer_);
  close_handle(reinterpret_cast<uv_handle_t*>(&timer_));
  close_handle(reinterpret_cast<uv_handle_t*>(&process_));
  close_handle(reinterpret_cast<uv_handle_t*>(&stdin_));  // cancels a write nobody will read
  if (observer_ != nullptr) observer_->on_exit(exit_);
}

void ExecProcess::kill_group() {
  // Only while the leader is unreaped: its pid (the group id) cannot have been reused yet.
  if (!exited_) ::kill(-process_.pid, SIGKILL);
}

void ExecProcess::close_handle(uv_handle_t* handle) {
  if (uv_is_closing(handle)) return;
  uv_close(handle, [](uv_handle_t* h) { static_cast<ExecProcess*>(h->data)->on_handle_closed(); });
}

void ExecProcess::on_handle_closed() {
  if (--open_handles_ == 0 && detached_) delete this;
}

// ---- events ----

std::string start_event(int pid) { return line(ordered_json{{"type", "start"}, {"pid", pid}}); }

std::string output_event(bool is_stderr, std::string_view bytes) {
  ordered_json j = {{"type", is_stderr ? "stderr" : "stdout"}};
  if (is_valid_utf8(bytes))
    j["data"] = bytes;
  else
    j["data_b64"] = base64_encode(bytes);
  return line(j);
}

std::string exit_event(const ExecExit& exit) {
  ordered_json j = {{"type", "exit"}};
  if (exit.signal != 0)
    j["signal"] = exit.signal;
  else
    j["code"] = exit.code;
  if (exit.timed_out) j["timed_out"] = true;
  return line(j);
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;  // a continuation byte first, an overlong 2-byte lead (C0, C1), or beyond U+10FFFF
    }
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong 3- and 4-byte forms, UTF-16 surrogates, and code points past U+10FFFF are not UTF-8.
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

std::string Utf8Carry::take(std::string_view chunk) {
  std::string text = std::exchange(held_, {});
  text.append(chunk);
  // Walk back over at most three continuation bytes to the last lead byte; hold it back if its character
  // needs more bytes than have arrived.
  for (size_t back = 1; back <= 4 && back <= text.size(); ++back) {
    auto c = static_cast<unsigned char>(text[text.size() - back]);
    if ((c & 0xC0) == 0x80) continue;
    // Only C2..F4 start a character; any other byte is invalid as it stands and is passed on.
    size_t needed = c >= 0xF5 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 1;
    if (needed > back) {
      held_ = text.substr(text.size() - back);
      text.resize(text.size() - back);
    }
    break;
  }
  return text;
}

}  // namespace sg::agent
