#include "agent/code_service.h"

#include <random>

#include <nlohmann/json.hpp>

#include "agent/routes.h"

namespace sg::agent {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr size_t kContextBodyBytes = 64 * 1024;
// JSON escaping makes a string up to six times longer (\u0000); the code itself is checked after parsing.
constexpr size_t kJsonEscapeFactor = 6;
constexpr size_t kRunBodySlackBytes = 64 * 1024;
constexpr uint64_t kMaxTimeoutSecs = 1'000'000'000;  // keeps timeout_secs * 1000 far from overflowing
constexpr size_t kMaxIdBytes = 64;

std::string to_text(const ordered_json& j) { return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace); }
std::string line(const ordered_json& j) { return to_text(j) + "\n"; }

ordered_json describe(const CodeContext& c) {
  return {{"id", c.id()},     {"language", c.language()}, {"state", context_state_name(c.state())},
          {"pid", c.pid()},   {"runs", c.runs()}};
}

bool valid_id(std::string_view id) {
  if (id.empty() || id.size() > kMaxIdBytes) return false;
  for (char ch : id)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_') return false;
  return true;
}

std::string random_id() {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id;
  for (int i = 0; i < 4; ++i) {
    uint32_t v = rd();
    for (int k = 0; k < 8; ++k) id += kHex[(v >> (4 * k)) & 0xF];
  }
  return id;
}

int status_for(Error e) {
  switch (e) {
    case Error::kInvalidArgument: return 400;
    case Error::kNotFound: return 404;
    case Error::kConflict: return 409;
    case Error::kLimitExceeded: return 429;
    case Error::kUnavailable: return 503;
    default: return 500;
  }
}

// Collects a JSON request body up to a limit, then answers through finish().
class BodyHandler : public Handler {
 public:
  BodyHandler(size_t max_body_bytes, Responder& out) : max_(max_body_bytes), out_(out) {}
  void on_body(std::string_view data) override {
    if (out_.started()) return;  // answered already
    if (body_.size() + data.size() > max_)
      return out_.respond_error(413, Error::kLimitExceeded, "request body exceeds " + std::to_string(max_) + " bytes");
    body_.append(data);
  }
  void on_body_end() override {
    if (!out_.started()) finish(std::exchange(body_, {}));
  }

 protected:
  virtual void finish(std::string body) = 0;
  size_t max_;
  Responder& out_;
  std::string body_;
};

class CreateHandler : public BodyHandler {
 public:
  CreateHandler(CodeService& service, Responder& out) : BodyHandler(kContextBodyBytes, out), service_(service) {}
  void finish(std::string body) override {
    auto language = parse_context_request(body);
    if (!language) return out_.respond_error(400, language.error(), language.message());
    auto ctx = service_.create(random_id(), *language);
    if (!ctx) return out_.respond_error(status_for(ctx.error()), ctx.error(), ctx.message());
    out_.respond(201, {{"Content-Type", "application/json"}}, to_text(describe(**ctx)));
  }

 private:
  CodeService& service_;
};

class ResetHandler : public BodyHandler {
 public:
  ResetHandler(CodeService& service, std::string id, Responder& out)
      : BodyHandler(kContextBodyBytes, out), service_(service), id_(std::move(id)) {}
  void finish(std::string) override {
    CodeContext* ctx = service_.find(id_);
    if (ctx == nullptr) return out_.respond_error(404, Error::kNotFound, "no such context: " + id_);
    if (auto s = ctx->reset(); !s) return out_.respond_error(status_for(s.error()), s.error(), s.message());
    out_.respond(200, {{"Content-Type", "application/json"}}, to_text(describe(*ctx)));
  }

 private:
  CodeService& service_;
  std::string id_;
};

// Streams one run's events; destroying it (client gone) interrupts the run and keeps the context.
class RunHandler : public BodyHandler, public RunObserver {
 public:
  RunHandler(CodeService& service, Responder& out)
      : BodyHandler(kJsonEscapeFactor * service.limits().max_code_bytes + kRunBodySlackBytes, out),
        service_(service) {}
  ~RunHandler() override {
    if (ctx_ != nullptr) ctx_->detach_run();
  }

  void finish(std::string body) override {
    auto req = parse_run_request(body, service_.limits().max_code_bytes);
    if (!req) return out_.respond_error(req.error() == Error::kLimitExceeded ? 413 : 400, req.error(), req.message());
    CodeContext* ctx = nullptr;
    // Without a context, the language's default one (made at its first run).
    const bool bash = req->language == "bash";
    if (req->context.empty()) req->context = bash ? kDefaultBashContext : kDefaultContext;
    if (req->context == kDefaultContext || req->context == kDefaultBashContext) {
      ctx = service_.find(req->context);
      if (ctx == nullptr) {
        auto made = service_.create(req->context, req->context == kDefaultBashContext ? "bash" : "python");
        if (!made) return out_.respond_error(status_for(made.error()), made.error(), made.message());
        ctx = *made;
      }
    } else {
      ctx = service_.find(req->context);
      if (ctx == nullptr) return out_.respond_error(404, Error::kNotFound, "no such context: " + req->context);
    }
    if (!req->language.empty() && req->language != ctx->language())
      return out_.respond_error(400, Error::kInvalidArgument,
                                "language: context " + ctx->id() + " runs " + ctx->language() + ", not " + req->language);
    std::string death = ctx->last_death();
    auto started = ctx->run(req->code, req->timeout_secs, this);
    if (!started) return out_.respond_error(status_for(started.error()), started.error(), started.message());
    ctx_ = ctx;
    out_.start(200, {{"Content-Type", "application/x-ndjson"}, {"Cache-Control", "no-store"}}, -1);
    if (started->restarted)
      out_.write(line({{"type", "restarted"},
                       {"message", "the context's interpreter " + death +
                                       "; this run starts a fresh one: names defined before are gone"}}));
  }

  void on_drain() override {
    if (ctx_ != nullptr) ctx_->resume_output();
  }
  void on_event(std::string text) override {
    out_.write(text);
    if (out_.queued_bytes() > kHighWatermark && ctx_ != nullptr) ctx_->pause_output();
  }
  void on_end(std::string text) override {
    ctx_ = nullptr;
    out_.write(text);
    out_.end();
  }

 private:
  CodeService& service_;
  CodeContext* ctx_ = nullptr;  // while the run is ours
};

Failure wrong_type(std::string_view field, std::string_view expected, const json& got) {
  return fail(Error::kInvalidArgument,
              std::string(field) + ": must be " + std::string(expected) + ", got " + got.type_name());
}

}  // namespace

bool supported_language(std::string_view language) { return language == "python" || language == "bash"; }

Result<RunRequest> parse_run_request(std::string_view body, size_t max_code_bytes) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return fail(Error::kInvalidArgument, "request body is not valid JSON");
  if (!j.is_object())
    return fail(Error::kInvalidArgument, std::string("request body must be a JSON object, got ") + j.type_name());
  RunRequest req;
  bool has_code = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "code") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
      req.code = v.get<std::string>();
      if (req.code.size() > max_code_bytes)
        return fail(Error::kLimitExceeded, "code: " + std::to_string(req.code.size()) + " bytes exceeds the limit of " +
                                               std::to_string(max_code_bytes));
      has_code = true;
    } else if (key == "context") {
      if (!v.is_null()) {
        if (!v.is_string()) return wrong_type(key, "a context id (string)", v);
        req.context = v.get<std::string>();
        if (!valid_id(req.context))
          return fail(Error::kInvalidArgument, "context: not a context id (1 to 64 of A-Z a-z 0-9 - _)");
      }
    } else if (key == "language") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
      req.language = v.get<std::string>();
      if (!supported_language(req.language))
        return fail(Error::kInvalidArgument,
                    "language: '" + req.language + "' is not supported (supported: " + std::string(kLanguages) + ")");
    } else if (key == "timeout_secs") {
      if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0) ||
          v.get<uint64_t>() > kMaxTimeoutSecs)
        return fail(Error::kInvalidArgument,
                    "timeout_secs: must be an integer from 0 (none) to " + std::to_string(kMaxTimeoutSecs));
      req.timeout_secs = v.get<uint64_t>();
    } else {
      return fail(Error::kInvalidArgument, "unknown field '" + key + "' (allowed: code, context, language, timeout_secs)");
    }
  }
  if (!has_code) return fail(Error::kInvalidArgument, "code is required (a string of Python or bash)");
  return req;
}

Result<std::string> parse_context_request(std::string_view body) {
  std::string language = "python";
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) return language;
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return fail(Error::kInvalidArgument, "request body is not valid JSON");
  if (!j.is_object())
    return fail(Error::kInvalidArgument, std::string("request body must be a JSON object, got ") + j.type_name());
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "language")
      return fail(Error::kInvalidArgument, "unknown field '" + it.key() + "' (allowed: language)");
    if (!it.value().is_string()) return wrong_type("language", "a string", it.value());
    language = it.value().get<std::string>();
  }
  if (!supported_language(language))
    return fail(Error::kInvalidArgument,
                "language: '" + language + "' is not supported (supported: " + std::string(kLanguages) + ")");
  return language;
}

bool CodeService::serves(std::string_view path) {
  return path == "/run_code" || path == "/contexts" || path.starts_with("/contexts/");
}

Result<CodeContext*> CodeService::create(std::string id, const std::string& language) {
  if (contexts_.size() >= limits_.max_contexts)
    return fail(Error::kLimitExceeded, std::to_string(limits_.max_contexts) +
                                           " contexts exist already (the limit): delete one first");
  if (contexts_.count(id) != 0) return fail(Error::kConflict, "context " + id + " exists already");
  auto ctx = CodeContext::start(loop_, id, language, limits_.settings);
  if (!ctx) return ctx.failure().code == Error::kNotFound ? fail(Error::kUnavailable, ctx.message()) : ctx.failure();
  CodeContext* raw = ctx->get();
  contexts_.emplace(std::move(id), std::move(*ctx));
  return raw;
}

CodeContext* CodeService::find(std::string_view id) {
  auto it = contexts_.find(id);
  return it == contexts_.end() ? nullptr : it->second.get();
}

std::unique_ptr<Handler> CodeService::route(const Request& request, std::string_view path, Responder& out) {
  const std::string& method = request.method;
  auto answered = [] { return std::make_unique<Handler>(); };
  auto method_not_allowed = [&](std::string allowed) {
    out.respond_error(405, Error::kUnsupported,
                      method + " is not allowed on " + std::string(path) + " (use " + allowed + ")",
                      {{"Allow", allowed}});
    return answered();
  };
  // As for /exec: a cross-origin page can POST text/plain or a form without a preflight, not JSON.
  auto json_required = [&]() -> bool {
    if (is_json_media_type(request.content_type)) return true;
    out.respond_error(415, Error::kInvalidArgument,
                      "POST " + std::string(path) + " needs Content-Type: application/json, got '" +
                          request.content_type + "'");
    return false;
  };

  if (path == "/run_code") {
    if (method != "POST") return method_not_allowed("POST");
    if (!json_required()) return answered();
    return std::make_unique<RunHandler>(*this, out);
  }
  if (path == "/contexts") {
    if (method == "GET") {
      ordered_json list = ordered_json::array();
      for (const auto& [id, ctx] : contexts_) list.push_back(describe(*ctx));
      out.respond(200, {{"Content-Type", "application/json"}}, to_text(ordered_json{{"contexts", list}}));
      return answered();
    }
    if (method != "POST") return method_not_allowed("GET, POST");
    if (!json_required()) return answered();
    return std::make_unique<CreateHandler>(*this, out);
  }
  // /contexts/ID and /contexts/ID/reset
  std::string_view rest = path.substr(std::string_view("/contexts/").size());
  bool reset = false;
  if (rest.ends_with("/reset")) {
    rest.remove_suffix(std::string_view("/reset").size());
    reset = true;
  }
  std::string id(rest);
  if (!valid_id(id)) {
    out.respond_error(404, Error::kNotFound, "no such endpoint: " + method + " " + std::string(path));
    return answered();
  }
  if (reset) {
    if (method != "POST") return method_not_allowed("POST");
    if (!json_required()) return answered();
    return std::make_unique<ResetHandler>(*this, std::move(id), out);
  }
  if (method != "GET" && method != "DELETE") return method_not_allowed("GET, DELETE");
  auto it = contexts_.find(id);
  if (it == contexts_.end()) {
    out.respond_error(404, Error::kNotFound, "no such context: " + id);
    return answered();
  }
  if (method == "GET") {
    out.respond(200, {{"Content-Type", "application/json"}}, to_text(describe(*it->second)));
    return answered();
  }
  contexts_.erase(it);  // kills the interpreter; a run in progress ends with an error event
  out.respond(204, {}, {});
  return answered();
}

}  // namespace sg::agent
