// POST /exec: the request format, the running command, and the NDJSON events that report it.
#pragma once

#include <uv.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/error.h"

namespace sg::agent {

struct ExecSpec {
  std::vector<std::string> command;                          // argv; command[0] is looked up in PATH
  std::vector<std::pair<std::string, std::string>> env;      // set over the agent's own environment
  std::string cwd;                                           // empty: the agent's working directory
  std::optional<std::string> stdin_data;                     // absent: stdin is /dev/null
  uint64_t timeout_secs = 0;                                 // 0: no timeout
};

// {"command": [..], "env": {..}, "cwd": "..", "stdin": "..", "timeout_secs": N}; unknown fields are errors.
Result<ExecSpec> parse_exec_request(std::string_view body);

struct ExecExit {
  int code = 0;
  int signal = 0;  // non-zero: killed by this signal, `code` is meaningless
  bool timed_out = false;
};

class ExecObserver {
 public:
  virtual ~ExecObserver() = default;
  virtual void on_output(bool is_stderr, std::string_view bytes) = 0;
  // Once the process has exited and its output pipes reached EOF (or stayed open too long after the exit,
  // because a background child inherited them). Nothing is reported after this.
  virtual void on_exit(const ExecExit& exit) = 0;
};

// A command running in its own session and process group, its stdout and stderr read through pipes.
// The object owns libuv handles, so it frees itself: after detach(), once every handle has closed.
class ExecProcess {
 public:
  // `running` counts live processes (the agent's concurrency limit); it is decremented when this one is
  // reaped and must outlive it.
  static Result<ExecProcess*> spawn(uv_loop_t* loop, const ExecSpec& spec, ExecObserver* observer, size_t* running);

  int pid() const { return process_.pid; }
  // Back-pressure: stop reading the pipes while the client is slow, so the command blocks on a full pipe.
  void pause_output();
  void resume_output();
  // The observer is going away. A command still running is killed with its whole process group (what
  // is left after a normal exit, e.g. a daemon started with `&`, is not touched).
  void detach();

 private:
  ExecProcess(ExecObserver* observer, size_t* running) : observer_(observer), running_(running) {}
  void on_read(uv_pipe_t* pipe, ssize_t nread);
  void on_process_exit(int64_t status, int term_signal);
  void close_output(uv_pipe_t* pipe);
  void maybe_report_exit();
  void kill_group();
  void close_handle(uv_handle_t* handle);
  void on_handle_closed();

  ExecObserver* observer_;
  size_t* running_;
  uv_process_t process_{};
  uv_pipe_t stdin_{}, stdout_{}, stderr_{};
  uv_timer_t timer_{};  // the timeout while running, then how long output may stay open after the exit
  uv_write_t stdin_write_{};
  std::string stdin_data_;
  std::string read_buf_;
  ExecExit exit_;
  int open_handles_ = 0;
  int open_outputs_ = 0;
  bool has_stdin_ = false;
  bool exited_ = false;
  bool reported_ = false;
  bool detached_ = false;
  bool paused_ = false;
};

// NDJSON events, one line each (the trailing '\n' included).
std::string start_event(int pid);
// "data" when the bytes are valid UTF-8, otherwise "data_b64" (standard base64 of the raw bytes), so no
// output is lost or altered.
std::string output_event(bool is_stderr, std::string_view bytes);
std::string exit_event(const ExecExit& exit);

bool is_valid_utf8(std::string_view s);

// A read can end inside a multi-byte UTF-8 character; holding those bytes back until the next read keeps
// valid text from being reported as binary.
class Utf8Carry {
 public:
  // The bytes to report now: `chunk` after what was held back, minus an incomplete character at the end.
  std::string take(std::string_view chunk);
  // What is still held back (at EOF).
  std::string flush() { return std::exchange(held_, {}); }

 private:
  std::string held_;
};

}  // namespace sg::agent
