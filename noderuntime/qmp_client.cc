#include "noderuntime/qmp_client.h"
#include "noderuntime/uv_handles.h"

#include <utility>

namespace sg {
namespace {

// A socket path that does not exist yet or refuses connections belongs to a QEMU still starting.
constexpr uint64_t kConnectRetryMs = 20;


}  // namespace

Failure qmp_failure(std::string_view what, const nlohmann::json& error) {
  std::string cls = error.is_object() && error.contains("class") && error["class"].is_string()
                        ? error["class"].get<std::string>()
                        : "";
  std::string desc = error.is_object() && error.contains("desc") && error["desc"].is_string()
                         ? error["desc"].get<std::string>()
                         : "error without a description";
  Error code = cls == "GenericError"      ? Error::kInvalidArgument
               : cls == "CommandNotFound" ? Error::kUnsupported
               : cls == "DeviceNotActive" ? Error::kConflict
                                          : Error::kInternal;
  return fail(code, std::string(what) + ": " + desc);
}

QmpClient::QmpClient(uv_loop_t* loop, std::string socket_path, std::string peer, QmpOptions options)
    : loop_(loop), socket_path_(std::move(socket_path)), peer_(std::move(peer)), options_(options) {}

QmpClient::~QmpClient() {
  *alive_ = false;
  if (connect_req_ != nullptr) connect_req_->data = nullptr;  // its callback still runs (cancelled); it frees it
  close_and_free(pipe_);
  close_and_free(timer_);
  close_and_free(deferred_timer_);
  for (auto& [id, p] : pending_) close_and_free(p->timer);
}

void QmpClient::defer(std::function<void()> fn) {
  deferred_.push_back(std::move(fn));
  if (deferred_timer_ == nullptr) {
    deferred_timer_ = new uv_timer_t;
    uv_timer_init(loop_, deferred_timer_);
    deferred_timer_->data = this;
  }
  uv_timer_start(deferred_timer_, [](uv_timer_t* t) {
    auto* self = static_cast<QmpClient*>(t->data);
    auto fns = std::move(self->deferred_);
    self->deferred_.clear();
    auto alive = self->alive_;
    for (auto& fn : fns) {
      if (!*alive) return;  // a callback destroyed the client
      fn();
    }
  }, 0, 0);
}

void QmpClient::connect(std::function<void(Status)> done) {
  connect_done_ = std::move(done);
  uv_update_time(loop_);
  connect_started_ms_ = uv_now(loop_);
  timer_ = new uv_timer_t;
  uv_timer_init(loop_, timer_);
  timer_->data = this;
  // Deadline for the whole handshake; a refused connect reschedules the timer as its retry instead.
  uv_timer_start(timer_, [](uv_timer_t* t) { static_cast<QmpClient*>(t->data)->try_connect(); }, 0, 0);
}

void QmpClient::try_connect() {
  if (closed_) return;
  pipe_ = new uv_pipe_t;
  uv_pipe_init(loop_, pipe_, 0);
  pipe_->data = this;
  connect_req_ = new uv_connect_t;
  connect_req_->data = this;
  uv_pipe_connect(connect_req_, pipe_, socket_path_.c_str(), [](uv_connect_t* req, int status) {
    auto* self = static_cast<QmpClient*>(req->data);
    delete req;
    if (self == nullptr) return;
    self->connect_req_ = nullptr;
    self->on_connected(status);
  });
}

void QmpClient::on_connected(int status) {
  if (status != 0) {
    close_and_free(pipe_);
    uv_update_time(loop_);
    const bool retryable = status == UV_ENOENT || status == UV_ECONNREFUSED;
    if (retryable && uv_now(loop_) - connect_started_ms_ + kConnectRetryMs <= options_.connect_wait_ms) {
      uv_timer_start(timer_, [](uv_timer_t* t) { static_cast<QmpClient*>(t->data)->try_connect(); }, kConnectRetryMs, 0);
      return;
    }
    return shut(fail(Error::kUnavailable, "cannot connect to " + peer_ + " at " + socket_path_ + ": " +
                                              uv_strerror(status)));
  }
  uv_timer_start(timer_, [](uv_timer_t* t) {
    auto* self = static_cast<QmpClient*>(t->data);
    self->shut(fail(Error::kTimeout, self->peer_ + ": no QMP greeting within " +
                                         std::to_string(self->options_.timeout_ms) + " ms"));
  }, options_.timeout_ms, 0);
  start_reading();
}

void QmpClient::start_reading() {
  uv_read_start(reinterpret_cast<uv_stream_t*>(pipe_),
                [](uv_handle_t*, size_t suggested, uv_buf_t* buf) {
                  buf->base = new char[suggested];
                  buf->len = suggested;
                },
                [](uv_stream_t* s, ssize_t n, const uv_buf_t* buf) {
                  std::unique_ptr<char[]> owned(buf->base);
                  auto* self = static_cast<QmpClient*>(s->data);
                  if (self == nullptr || n == 0) return;
                  if (n < 0) {
                    return self->shut(fail(Error::kUnavailable,
                                           self->peer_ + " closed the QMP connection" +
                                               (n == UV_EOF ? "" : std::string(": ") + uv_strerror(static_cast<int>(n)))));
                  }
                  self->on_data(buf->base, static_cast<size_t>(n));
                });
}

void QmpClient::on_data(const char* data, size_t len) {
  inbuf_.append(data, len);
  auto alive = alive_;
  size_t start = 0;
  while (!closed_) {
    size_t nl = inbuf_.find('\n', start);
    if (nl == std::string::npos) break;
    std::string line = inbuf_.substr(start, nl - start);
    start = nl + 1;
    if (line.size() > options_.max_message_bytes) {
      return shut(fail(Error::kUnavailable, peer_ + " sent a QMP message over " +
                                                std::to_string(options_.max_message_bytes) + " bytes"));
    }
    handle_message(line);
    if (!*alive) return;  // a callback destroyed the client
  }
  if (closed_) return;
  inbuf_.erase(0, start);
  if (inbuf_.size() > options_.max_message_bytes) {
    shut(fail(Error::kUnavailable, peer_ + " sent a QMP message over " +
                                       std::to_string(options_.max_message_bytes) + " bytes"));
  }
}

void QmpClient::handle_message(const std::string& line) {
  if (line.find_first_not_of(" \t\r") == std::string::npos) return;
  nlohmann::json msg = nlohmann::json::parse(line, nullptr, false);
  if (msg.is_discarded() || !msg.is_object())
    return shut(fail(Error::kUnavailable, peer_ + " sent a QMP message that is not a JSON object"));
  if (!greeted_) {
    if (!msg.contains("QMP")) return shut(fail(Error::kUnavailable, peer_ + " did not greet with QMP"));
    greeted_ = true;
    send_raw(R"({"execute":"qmp_capabilities","id":0})");
    return;
  }
  if (msg.contains("event")) {
    if (!msg["event"].is_string()) return shut(fail(Error::kUnavailable, peer_ + " sent an event without a name"));
    if (on_event_) on_event_(msg["event"].get<std::string>(), msg.value("data", nlohmann::json::object()));
    return;
  }
  if (!msg.contains("id") || !msg["id"].is_number_unsigned())
    return shut(fail(Error::kUnavailable, peer_ + " sent a QMP answer without an id"));
  const uint64_t id = msg["id"].get<uint64_t>();
  Result<nlohmann::json> result = msg.contains("return")  ? Result<nlohmann::json>(msg["return"])
                                  : msg.contains("error") ? Result<nlohmann::json>(qmp_failure(peer_, msg["error"]))
                                                          : Result<nlohmann::json>(fail(Error::kUnavailable, ""));
  if (!result && result.error() == Error::kUnavailable)
    return shut(fail(Error::kUnavailable, peer_ + " sent a QMP answer with neither return nor error"));
  if (id == 0 && !ready_) {
    if (!result) return shut(result.failure());
    return finish_connect({});
  }
  if (pending_.find(id) == pending_.end())
    return shut(fail(Error::kUnavailable, peer_ + " answered QMP command id " + std::to_string(id) + ", never sent"));
  complete(id, std::move(result));
}

void QmpClient::finish_connect(Status s) {
  if (s) ready_ = true;
  if (timer_ != nullptr) uv_timer_stop(timer_);
  auto done = std::move(connect_done_);
  connect_done_ = nullptr;
  if (done) done(std::move(s));
}

void QmpClient::send_raw(const std::string& line) {
  auto* req = new uv_write_t;
  auto* text = new std::string(line + "\n");
  req->data = text;
  uv_buf_t buf = uv_buf_init(text->data(), static_cast<unsigned>(text->size()));
  int rc = uv_write(req, reinterpret_cast<uv_stream_t*>(pipe_), &buf, 1, [](uv_write_t* r, int) {
    delete static_cast<std::string*>(r->data);
    delete r;
  });
  if (rc != 0) {
    delete text;
    delete req;
    shut(fail(Error::kUnavailable, "cannot write to " + peer_ + ": " + uv_strerror(rc)));
  }
}

void QmpClient::execute(const std::string& command, nlohmann::json arguments, Reply done) {
  if (!ready_ || closed_) {
    std::string why = peer_ + ": QMP " + (closed_ ? "connection is closed" : "is not connected");
    defer([done = std::move(done), why] { done(fail(Error::kUnavailable, why)); });
    return;
  }
  const uint64_t id = next_id_++;
  nlohmann::json msg = {{"execute", command}, {"id", id}};
  if (!arguments.is_null()) msg["arguments"] = std::move(arguments);
  auto p = std::make_unique<Pending>();
  p->done = std::move(done);
  p->client = this;
  p->timer = new uv_timer_t;
  uv_timer_init(loop_, p->timer);
  p->timer->data = p.get();
  uv_timer_start(p->timer, [](uv_timer_t* t) {
    auto* pend = static_cast<Pending*>(t->data);
    QmpClient* self = pend->client;
    // A command that never answers leaves the connection unusable (a late answer would be misread).
    self->shut(fail(Error::kTimeout, self->peer_ + ": no answer to QMP command within " +
                                         std::to_string(self->options_.timeout_ms) + " ms"));
  }, options_.timeout_ms, 0);
  pending_[id] = std::move(p);
  send_raw(msg.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

void QmpClient::complete(uint64_t id, Result<nlohmann::json> result) {
  auto it = pending_.find(id);
  std::unique_ptr<Pending> p = std::move(it->second);
  pending_.erase(it);
  close_and_free(p->timer);
  p->done(std::move(result));
}

void QmpClient::shut(Failure why) {
  if (closed_) return;
  closed_ = true;
  ready_ = false;
  close_and_free(pipe_);
  if (timer_ != nullptr) uv_timer_stop(timer_);
  std::vector<Reply> waiters;
  for (auto& [id, p] : pending_) {
    close_and_free(p->timer);
    waiters.push_back(std::move(p->done));
  }
  pending_.clear();
  auto connect_done = std::move(connect_done_);
  connect_done_ = nullptr;
  auto alive = alive_;
  // Every waiter learns the connection is gone; a command that timed out gets the timeout itself.
  if (connect_done) {
    connect_done(why);
    if (!*alive) return;
  }
  for (auto& done : waiters) {
    done(why);
    if (!*alive) return;
  }
}

}  // namespace sg
