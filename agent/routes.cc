#include "agent/routes.h"

#include <sys/stat.h>

#include <cctype>

#include <nlohmann/json.hpp>

#include "agent/exec.h"
#include "agent/files.h"
#include "agent/identity.h"

namespace sg::agent {
namespace {

using ordered_json = nlohmann::ordered_json;

std::string to_text(const ordered_json& j) { return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace); }

// Streams a command's output as NDJSON while it runs; destroying it (client gone) kills the command.
class ExecHandler : public Handler, public ExecObserver {
 public:
  ExecHandler(uv_loop_t* loop, size_t max_body_bytes, size_t max_execs, size_t* running, Responder& out)
      : loop_(loop), max_body_bytes_(max_body_bytes), max_execs_(max_execs), running_(running), out_(out) {}
  ~ExecHandler() override {
    if (process_ != nullptr) process_->detach();
  }

  void on_body(std::string_view data) override {
    if (out_.started()) return;  // already answered
    if (body_.size() + data.size() > max_body_bytes_)
      return out_.respond_error(413, Error::kLimitExceeded,
                                "exec request exceeds " + std::to_string(max_body_bytes_) + " bytes");
    body_.append(data);
  }

  void on_body_end() override {
    if (out_.started()) return;
    auto spec = parse_exec_request(body_);
    if (!spec) return out_.respond_error(400, spec.error(), spec.message());
    body_.clear();
    if (*running_ >= max_execs_)
      return out_.respond_error(429, Error::kLimitExceeded,
                                std::to_string(max_execs_) + " commands are already running; retry later");
    auto process = ExecProcess::spawn(loop_, *spec, this, running_);
    if (!process) return out_.respond_error(process.error() == Error::kUnavailable ? 503 : 400, process.error(),
                                            process.message());
    process_ = *process;
    out_.start(200, {{"Content-Type", "application/x-ndjson"}, {"Cache-Control", "no-store"}}, -1);
    out_.write(start_event(process_->pid()));
  }

  void on_drain() override {
    if (process_ != nullptr) process_->resume_output();
  }

  void on_output(bool is_stderr, std::string_view bytes) override {
    std::string text = carry_[is_stderr].take(bytes);
    if (text.empty()) return;
    out_.write(output_event(is_stderr, text));
    if (out_.queued_bytes() > kHighWatermark) process_->pause_output();
  }

  void on_exit(const ExecExit& exit) override {
    for (bool is_stderr : {false, true}) {
      std::string rest = carry_[is_stderr].flush();
      if (!rest.empty()) out_.write(output_event(is_stderr, rest));
    }
    out_.write(exit_event(exit));
    out_.end();
  }

 private:
  uv_loop_t* loop_;
  size_t max_body_bytes_;
  size_t max_execs_;
  size_t* running_;
  Responder& out_;
  std::string body_;
  ExecProcess* process_ = nullptr;  // frees itself after detach()
  Utf8Carry carry_[2];              // stdout, stderr
};

}  // namespace

bool is_json_media_type(std::string_view value) {
  std::string_view type = value.substr(0, value.find(';'));
  while (!type.empty() && (type.back() == ' ' || type.back() == '\t')) type.remove_suffix(1);
  constexpr std::string_view kJson = "application/json";
  if (type.size() != kJson.size()) return false;
  for (size_t i = 0; i < type.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(type[i])) != kJson[i]) return false;
  return true;
}

namespace {

mode_t umask_now() {
  mode_t mask = ::umask(0);
  ::umask(mask);
  return mask;
}

}  // namespace

void Responder::respond(int status, std::vector<HttpHeader> headers, std::string_view body) {
  start(status, std::move(headers), static_cast<int64_t>(body.size()));
  if (!body.empty()) write(body);
  end();
}

void Responder::respond_error(int status, Error code, std::string_view message, std::vector<HttpHeader> headers) {
  headers.push_back({"Content-Type", "application/json"});
  respond(status, std::move(headers), to_text(ordered_json{{"error", error_name(code)}, {"message", message}}));
}

Router::Router(uv_loop_t* loop, AgentLimits limits)
    : loop_(loop), limits_(limits), new_file_mode_(0666 & ~umask_now()), code_(loop, limits.code) {}

std::unique_ptr<Handler> Router::route(const Request& request, Responder& out) {
  std::string_view path = request.target;
  path = path.substr(0, path.find('?'));
  const std::string& method = request.method;
  auto answered = [] { return std::make_unique<Handler>(); };
  auto method_not_allowed = [&](std::string allowed) {
    out.respond_error(405, Error::kUnsupported,
                      method + " is not allowed on " + std::string(path) + " (use " + allowed + ")",
                      {{"Allow", allowed}});
    return answered();
  };

  if (path == "/health") {
    if (method != "GET") return method_not_allowed("GET");
    ordered_json health{{"status", "ok"}, {"version", kAgentVersion}};
    // Which sandbox this is, as the node last told the guest (QEMU guests: deploy/build-guest-image.sh); a
    // guest restored from a memory snapshot learns its new identity that way, so this is the id to trust.
    if (std::string id = sandbox_identity(); !id.empty()) health["sandbox_id"] = id;
    out.respond(200, {{"Content-Type", "application/json"}}, to_text(health));
    return answered();
  }
  if (path == "/exec") {
    if (method != "POST") return method_not_allowed("POST");
    // A browser sends a cross-origin text/plain or form POST without a CORS preflight; one that must be
    // application/json cannot be sent that way, so a page on another sandbox cannot run commands here.
    if (!is_json_media_type(request.content_type)) {
      out.respond_error(415, Error::kInvalidArgument,
                        "exec needs Content-Type: application/json, got '" + request.content_type + "'");
      return answered();
    }
    if (request.content_length > static_cast<int64_t>(limits_.max_exec_body_bytes)) {
      out.respond_error(413, Error::kLimitExceeded,
                        "exec request exceeds " + std::to_string(limits_.max_exec_body_bytes) + " bytes");
      return answered();
    }
    return std::make_unique<ExecHandler>(loop_, limits_.max_exec_body_bytes, limits_.max_execs, &running_execs_,
                                         out);
  }
  if (CodeService::serves(path)) return code_.route(request, path, out);
  if (path == "/files") {
    if (method != "GET" && method != "PUT") return method_not_allowed("GET, PUT");
    auto file = file_path_param(request.target);
    if (!file) {
      out.respond_error(400, file.error(), file.message());
      return answered();
    }
    if (method == "GET") return download(*file, out);
    return upload(*file, request.content_length, limits_.max_upload_bytes, new_file_mode_, out);
  }
  out.respond_error(404, Error::kNotFound, "no such endpoint: " + method + " " + std::string(path));
  return answered();
}

}  // namespace sg::agent
