// run_code's contexts: one persistent python3 per context running the driver (agent/code_driver.py, compiled
// into the agent), the framed pipes between them, and one run at a time streamed as NDJSON events
// (docs/code-interpreter.md).
#pragma once

#include <uv.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "agent/exec.h"
#include "common/error.h"

namespace sg::agent {

// The driver's Python source, generated from agent/code_driver.py at configure time.
std::string_view code_driver_source();

struct CodeSettings {
  std::string python = "python3";             // looked up in PATH
  size_t max_event_bytes = 4 * 1024 * 1024;   // one event (a PNG display, a stdout chunk); the driver splits or trims
  size_t max_run_output_bytes = 64 * 1024 * 1024;  // stdout, stderr, result and display events of one run
  uint64_t interrupt_grace_ms = 2000;         // after the SIGINT of a timeout, until the interpreter is killed
};

// Frames on the driver's event pipe: a 4-byte big-endian length, then that many bytes of JSON.
class FrameReader {
 public:
  explicit FrameReader(size_t max_frame_bytes) : max_(max_frame_bytes) {}
  // Appends `data`; complete frames are moved into `frames`. Fails (for good) on a frame over the limit.
  Status feed(std::string_view data, std::vector<std::string>& frames);

 private:
  size_t max_;
  std::string buf_;
  bool broken_ = false;
};

// One length-prefixed frame.
std::string encode_frame(std::string_view payload);

// idle -> running -> (interrupting ->) idle; any state -> dead when the interpreter exits (a run on a dead
// context starts a new interpreter: dead -> idle).
enum class ContextState { kIdle, kRunning, kInterrupting, kDead };
std::string_view context_state_name(ContextState s);

class RunObserver {
 public:
  virtual ~RunObserver() = default;
  // One NDJSON line (with its '\n'). The observer may call pause_output() when its client is slow.
  virtual void on_event(std::string line) = 0;
  // The run's last line, the end event; nothing is reported after it.
  virtual void on_end(std::string line) = 0;
};

class Interpreter;

class CodeContext {
 public:
  // Starts the interpreter. Fails (not found, unavailable) when python3 cannot be started.
  static Result<std::unique_ptr<CodeContext>> start(uv_loop_t* loop, std::string id, std::string language,
                                                    const CodeSettings& settings);
  // Kills the interpreter (its whole process group); a run in progress ends with an error event.
  ~CodeContext();
  CodeContext(const CodeContext&) = delete;
  CodeContext& operator=(const CodeContext&) = delete;

  struct RunStart {
    bool restarted = false;  // the interpreter had died: this run starts a fresh one, earlier state is lost
  };
  // kConflict while a run is in progress. timeout_secs 0: none. Events go to `observer` from the loop.
  Result<RunStart> run(const std::string& code, uint64_t timeout_secs, RunObserver* observer);
  // The observer is going away (client gone): the run is interrupted like a timeout, its events dropped.
  void detach_run();
  void pause_output();
  void resume_output();
  // A fresh interpreter; a run in progress ends with an error event first.
  Status reset();

  const std::string& id() const { return id_; }
  const std::string& language() const { return language_; }
  ContextState state() const { return state_; }
  int pid() const;
  uint64_t runs() const { return runs_; }
  // "exited with code 0", "was killed by signal 9", ...: why the last interpreter died (empty: none did).
  const std::string& last_death() const { return death_; }

  // Called by the interpreter (from the loop).
  void on_frame(std::string_view payload);
  void on_raw_output(bool is_stderr, std::string_view bytes);
  void on_exit(int64_t code, int signal);
  void on_timeout();
  void on_grace_expired();

 private:
  CodeContext(uv_loop_t* loop, std::string id, std::string language, const CodeSettings& settings)
      : loop_(loop), id_(std::move(id)), language_(std::move(language)), settings_(settings) {}
  Status spawn();
  Status transition(ContextState to);
  void kill_interpreter();
  void emit(std::string line);
  void end_run(std::string_view error_name, std::string_view message);
  void broken(std::string_view why);
  // A run is in progress (its observer may be gone): it ends when the driver says done or the interpreter dies.
  bool in_run() const { return state_ == ContextState::kRunning || state_ == ContextState::kInterrupting; }

  uv_loop_t* loop_;
  std::string id_;
  std::string language_;
  CodeSettings settings_;
  ContextState state_ = ContextState::kDead;
  Interpreter* interp_ = nullptr;  // frees itself after detach()
  std::string death_;              // why the last interpreter died, for the next run's notice
  std::string kill_reason_;        // why the agent is killing it, once it has decided to
  RunObserver* observer_ = nullptr;
  bool timed_out_ = false;
  bool truncated_ = false;
  size_t run_output_bytes_ = 0;
  uint64_t run_started_ms_ = 0;
  uint64_t runs_ = 0;
  Utf8Carry carry_[2];
};

}  // namespace sg::agent
