// run_code's endpoints: POST/GET /contexts, GET/DELETE /contexts/ID, POST /contexts/ID/reset, POST /run_code
// (docs/code-interpreter.md, agent/README.md). Owns the contexts; a context lives as long as the agent.
#pragma once

#include <uv.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "agent/code_context.h"
#include "agent/handler.h"

namespace sg::agent {

struct CodeLimits {
  size_t max_contexts = 16;             // interpreters at once, the default context included (429 beyond)
  size_t max_code_bytes = 1024 * 1024;  // the code of one run (413 beyond)
  CodeSettings settings;
};

inline constexpr std::string_view kDefaultContext = "default";

// The languages a context can run; each has a default context a run without one goes to.
inline constexpr std::string_view kLanguages = "python, bash";
inline constexpr std::string_view kDefaultBashContext = "default-bash";
bool supported_language(std::string_view language);

struct RunRequest {
  std::string code;
  std::string context;   // empty: the default context of `language`
  std::string language;  // empty: the context's (python for the default context)
  uint64_t timeout_secs = 0;
};
// {"code": "...", "context": "ID", "language": "python"|"bash", "timeout_secs": N}; unknown fields are
// errors, code over the limit is kLimitExceeded.
Result<RunRequest> parse_run_request(std::string_view body, size_t max_code_bytes);
// {"language": "python"} (also the default when the body is empty or has no language).
Result<std::string> parse_context_request(std::string_view body);

class CodeService {
 public:
  CodeService(uv_loop_t* loop, CodeLimits limits) : loop_(loop), limits_(std::move(limits)) {}

  // True when `path` is one of run_code's endpoints.
  static bool serves(std::string_view path);
  // Answers at once when it can; otherwise the returned handler answers through `out`.
  std::unique_ptr<Handler> route(const Request& request, std::string_view path, Responder& out);
  // Kills every interpreter (agent shutdown); runs in progress end with an error event.
  void close() { contexts_.clear(); }

  // Used by the handlers.
  Result<CodeContext*> create(std::string id, const std::string& language);
  CodeContext* find(std::string_view id);
  const CodeLimits& limits() const { return limits_; }

 private:
  uv_loop_t* loop_;
  CodeLimits limits_;
  std::map<std::string, std::unique_ptr<CodeContext>, std::less<>> contexts_;
};

}  // namespace sg::agent
