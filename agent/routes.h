// The agent's endpoints: GET /health, POST /exec, GET and PUT /files, and run_code's (agent/code_service.h).
// See agent/README.md for the API.
#pragma once

#include <sys/types.h>
#include <uv.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "agent/code_service.h"
#include "agent/handler.h"

namespace sg::agent {

inline constexpr std::string_view kAgentVersion = "0.1.0";

struct AgentLimits {
  size_t max_head_bytes = 16 * 1024;         // HTTP/1.1 request head; h2 header list (431 beyond)
  size_t max_exec_body_bytes = 1024 * 1024;  // POST /exec JSON (413 beyond)
  uint64_t max_upload_bytes = uint64_t{1} << 30;  // PUT /files (413 beyond)
  size_t max_execs = 64;                     // commands running at once (429 beyond)
  size_t max_connections = 1024;             // accepted and closed at once beyond
  uint32_t max_concurrent_streams = 100;     // per h2 connection, advertised in SETTINGS
  CodeLimits code;                           // run_code's contexts
};

// "application/json", any case, optionally followed by parameters ("; charset=utf-8").
bool is_json_media_type(std::string_view value);

class Router {
 public:
  Router(uv_loop_t* loop, AgentLimits limits);

  // Answers at once when it can (errors, /health); otherwise the returned handler answers through `out`.
  std::unique_ptr<Handler> route(const Request& request, Responder& out);
  const AgentLimits& limits() const { return limits_; }
  // Agent shutdown: kills the interpreters of run_code's contexts.
  void close() { code_.close(); }

 private:
  uv_loop_t* loop_;
  AgentLimits limits_;
  size_t running_execs_ = 0;  // ExecProcess counts itself in and out
  mode_t new_file_mode_;  // 0666 minus the umask the agent started with, as open(O_CREAT) would give
  CodeService code_;
};

}  // namespace sg::agent
