#include "noderuntime/api_server.h"

#include "noderuntime/api_request.h"
#include "noderuntime/fork.h"
#include "noderuntime/sandbox_registry.h"
#include "noderuntime/uv_handles.h"
#include "common/accounts.h"
#include "common/metrics.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <charconv>
#include <ctime>
#include <deque>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

namespace sg {

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
using Response = ApiServer::Response;

constexpr HttpLimits kRequestLimits{16 * 1024, 1024 * 1024, false};
// Back-pressure: a client that pipelines without reading answers stops being read from.
constexpr size_t kMaxPendingResponses = 64;
constexpr size_t kMaxQueuedWriteBytes = 4 * 1024 * 1024;
constexpr size_t kReadBufferBytes = 64 * 1024;
// After the last answer on a closing connection, how long unread input is drained before giving up.
constexpr uint64_t kLingerMs = 2'000;
// The send buffer was full when an answer with a descriptor reached the front; poll again this soon.
constexpr uint64_t kFdRetryMs = 5;
constexpr uint32_t kDefaultWakeTimeoutMs = 30'000;
constexpr uint32_t kMaxWakeTimeoutMs = 600'000;

int http_status(Error e) {
  switch (e) {
    case Error::kInvalidArgument: return 400;
    case Error::kNotFound: return 404;
    case Error::kAlreadyExists: return 409;
    case Error::kConflict: return 409;
    case Error::kUnsupported: return 400;
    case Error::kPermissionDenied: return 403;
    case Error::kLimitExceeded: return 429;
    case Error::kTimeout: return 504;
    case Error::kUnavailable: return 503;
    case Error::kUnreachable: return 502;
    case Error::kIo: return 500;
    case Error::kInternal: return 500;
  }
  return 500;
}

// Strings in answers come from clients (already valid UTF-8, the parser checked) or from the system
// (error messages, paths): replace rather than throw if one is not valid UTF-8.
template <typename Json>
std::string to_text(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Response error_response(int status, Error code, std::string_view message) {
  ordered_json body = {{"error", error_name(code)}, {"message", message}};
  return Response{status, to_text(body), {}, ""};
}

Response error_response(const Failure& f) {
  // A create this node cannot take for want of its image says so in a field (placement.h), so a placing
  // node asks the next node instead of passing the 404 on.
  if (f.code == Error::kNotFound && f.message.starts_with(kNoImageHere)) {
    ordered_json body = {{"error", error_name(f.code)}, {"message", f.message}, {kMissingField, kMissingImage}};
    return Response{404, to_text(body), {}, ""};
  }
  Response r = error_response(http_status(f.code), f.code, f.message);
  // A fenced fleet node (or one whose etcd is unreachable) refuses for a moment, not for good.
  if (f.code == Error::kUnavailable && f.message.starts_with("fleet:")) r.extra_headers = "Retry-After: 2\r\n";
  return r;
}

Response invalid(std::string_view message) { return error_response(400, Error::kInvalidArgument, message); }

// 401 has no place in the shared error vocabulary (common/error.h): only credential checks make it (the
// proxy's internal/open, and the TCP listeners' operator token).
Response unauthorized(std::string_view message) {
  ordered_json body = {{"error", "unauthorized"}, {"message", message}};
  return Response{401, to_text(body), {}, ""};
}

// The Host values a request on a TCP connection may carry: the address the client dialed ("127.0.0.1:8081",
// "[::1]:8081"), and "localhost:8081" on loopback. Any other name is one that resolved to this node without
// being meant for it: a web page whose own name an attacker pointed at 127.0.0.1 (DNS rebinding) would
// otherwise reach the API with the browser's help.
std::vector<std::string> own_hosts(const sockaddr* local) {
  std::string addr = format_peer(local);
  std::vector<std::string> out = {addr};
  std::string port = addr.substr(addr.rfind(':'));
  if (auto ep = parse_endpoint(addr); ep && is_loopback(*ep)) out.push_back("localhost" + port);
  // A client may leave out the default port.
  if (port == ":80")
    for (size_t i = 0, n = out.size(); i < n; ++i) out.push_back(out[i].substr(0, out[i].size() - port.size()));
  return out;
}

// "Bearer <token>" (scheme case-insensitive, RFC 7235), or nullopt.
std::optional<std::string> bearer_token(const HttpMessage& request) {
  const std::string* value = request.header("Authorization");
  if (value == nullptr) return std::nullopt;
  std::string_view v = *value;
  constexpr std::string_view kScheme = "bearer ";
  if (v.size() <= kScheme.size() || strncasecmp(v.data(), kScheme.data(), kScheme.size()) != 0) return std::nullopt;
  v.remove_prefix(kScheme.size());
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  return std::string(v);
}

// RFC 3339, UTC, milliseconds: 2026-11-29T10:00:00.000Z
std::string format_time(int64_t unix_ms) {
  int64_t secs = unix_ms >= 0 ? unix_ms / 1000 : (unix_ms - 999) / 1000;
  int millis = static_cast<int>(unix_ms - secs * 1000);
  time_t t = static_cast<time_t>(secs);
  tm parts{};
  gmtime_r(&t, &parts);
  char buf[40];
  size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &parts);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ", millis);
  return buf;
}

Result<uint32_t> parse_wake_timeout(const HttpMessage& request) {
  const std::string* header = request.header("X-Sandgate-Wake-Timeout-Ms");
  if (header == nullptr) return kDefaultWakeTimeoutMs;
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(header->data(), header->data() + header->size(), value);
  if (ec != std::errc() || end != header->data() + header->size() || value < 1 || value > kMaxWakeTimeoutMs)
    return fail(Error::kInvalidArgument, "X-Sandgate-Wake-Timeout-Ms: must be an integer between 1 and " +
                                             std::to_string(kMaxWakeTimeoutMs));
  return static_cast<uint32_t>(value);
}

ordered_json image_json(const snapshot::Image& image) {
  return ordered_json{{"name", image.name},
                      {"format", image.format},
                      {"parent", image.parent.empty() ? ordered_json(nullptr) : ordered_json(image.parent)},
                      {"config_digest", image.config_digest},
                      {"layers", image.layers},
                      {"size_bytes", image.size_bytes},
                      {"created_at", format_time(image.created_at_ms)},
                      {"config",
                       {{"env", image.config.env},
                        {"entrypoint", image.config.entrypoint},
                        {"cmd", image.config.cmd},
                        {"working_dir", image.config.working_dir}}}};
}

ordered_json snapshot_json(const snapshot::Snapshot& s) {
  ordered_json ports = ordered_json::array();
  for (const snapshot::SnapshotPort& p : s.ports)
    ports.push_back({{"port", p.port}, {"public", p.is_public}, {"protocol", p.protocol}});
  ordered_json j{{"id", s.id},
                      {"type", s.type},
                      {"source", {{"id", s.source_id}, {"name", s.source_name.empty() ? ordered_json(nullptr)
                                                                                         : ordered_json(s.source_name)}}},
                      {"driver", s.driver},
                      {"image", s.image},
                      {"layers", s.layers},
                      {"layer", s.layer.empty() ? ordered_json(nullptr) : ordered_json(s.layer)},
                      {"layer_bytes", s.layer_bytes},
                      {"created_at", format_time(s.created_at_ms)},
                      {"defaults", {{"command", s.command}, {"env", s.env}, {"cwd", s.cwd}, {"ports", std::move(ports)}}}};
  if (s.type == "memory") {
    j["memory_mb"] = s.memory_mb;
    j["cpus"] = s.cpus;
    j["state_bytes"] = s.state_bytes;
    j["ram_bytes"] = s.ram_bytes;
    j["disk_bytes"] = s.disk_bytes;
  } else if (s.is_vm_disk()) {
    j["disk_bytes"] = s.disk_bytes;  // a VM's filesystem checkpoint: its disk, not layers
  }
  if (!s.parent.empty()) j["parent"] = s.parent;
  // The answer to a removal that kept the disk for a later snapshot's (its files go with the last of them).
  if (s.removed) j["removed"] = "kept while a later snapshot's disk reads it";
  return j;
}

Response snapshot_response(int status, const Result<snapshot::Snapshot>& s) {
  return s ? Response{status, to_text(snapshot_json(*s)), {}, ""} : error_response(s.failure());
}

Response no_snapshots() { return error_response(503, Error::kUnavailable, "this node has no snapshot store"); }

Response image_response(int status, const Result<snapshot::Image>& image) {
  return image ? Response{status, to_text(image_json(*image)), {}, ""} : error_response(image.failure());
}

Response no_images() { return error_response(503, Error::kUnavailable, "this node has no image store"); }

std::string serialize(const Response& r, bool close) {
  std::string out = "HTTP/1.1 " + std::to_string(r.status) + " " + std::string(http_reason(r.status)) + "\r\n";
  // JSON unless the response names its own type (/metrics).
  if (!r.body.empty() && r.extra_headers.find("Content-Type:") == std::string::npos)
    out += "Content-Type: application/json\r\n";
  out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  out += r.extra_headers;
  if (close) out += "Connection: close\r\n";
  out += "\r\n";
  out += r.body;
  return out;
}

}  // namespace

// ---- listeners ----

struct ApiServer::Listener {
  union {
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  } handle;
  ApiServer* server = nullptr;
  bool is_unix = false;
  std::string unix_path;  // removed when the listener closes
};

// ---- connections ----

// One client connection: parses requests in arrival order, gives each a response slot, and writes slots
// strictly in order as they complete. Owned by ApiServer::connections_; asynchronous answers hold a
// weak_ptr, so a client that disconnects mid-wake simply has its answer dropped.
class ApiServer::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ApiServer* server, bool is_unix) : server_(server), is_unix_(is_unix) {}

  uv_stream_t* stream() { return &handle_.stream; }
  Status init(uv_loop_t* loop) {
    int rc = is_unix_ ? uv_pipe_init(loop, &handle_.pipe, 0) : uv_tcp_init(loop, &handle_.tcp);
    if (rc < 0) return fail(Error::kIo, std::string("init connection: ") + uv_strerror(rc));
    handle_.stream.data = this;
    timer_ = new uv_timer_t;
    uv_timer_init(loop, timer_);
    timer_->data = this;
    return {};
  }
  // `hosts`: own_hosts() of a TCP connection, empty on the unix socket.
  void start(const std::string& peer, std::vector<std::string> hosts) {
    peer_ = peer;
    hosts_ = std::move(hosts);
    start_reading();
  }
  void close_now();

 private:
  struct Slot {
    bool ready = false;
    bool close_after = false;
    std::string bytes;
    std::vector<UniqueFd> fds;
    bool route_events = false;
    std::shared_ptr<Stream> stream;
    std::string method, target;  // for the request log line
    Clock::time_point started;
  };
  struct WriteReq {
    uv_write_t req;
    std::string data;
  };

  void start_reading();
  void on_read(ssize_t nread, const uv_buf_t* buf);
  void process(const char* data, size_t len);
  bool backlogged() const;
  void handle_request(HttpMessage& request);
  void respond(uint64_t seq, Response response);
  void answer_parse_error();
  void flush();
  bool send_with_descriptor(Slot& slot);
  void write(std::string data);
  void begin_close();
  void maybe_send_continue();
  void stream_route_events();
  void attach_stream(std::shared_ptr<Stream> stream);

  ApiServer* server_;
  bool is_unix_;
  union {
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  } handle_;
  uv_timer_t* timer_ = nullptr;  // fd-send retry, then linger
  std::string peer_;
  std::vector<std::string> hosts_;
  HttpParser parser_{HttpParser::Kind::kRequest, kRequestLimits};
  std::unique_ptr<char[]> read_buf_ = std::make_unique<char[]>(kReadBufferBytes);
  std::string unparsed_;  // input held back while backlogged
  std::deque<Slot> slots_;
  uint64_t first_seq_ = 0;  // sequence number of slots_.front()
  uint64_t next_seq_ = 0;
  bool reading_ = false;
  bool in_process_ = false;
  bool input_done_ = false;  // no further requests are read (Connection: close, parse error, EOF)
  bool peer_eof_ = false;
  bool shutdown_started_ = false;
  bool draining_ = false;  // after shutdown: discard input until EOF or the linger timer
  bool closing_ = false;
  bool continue_sent_ = false;
  bool streaming_ = false;     // internal/events: the connection carries RouteEvents now
  uint64_t subscription_ = 0;  // Node::subscribe's id while streaming
};

void ApiServer::Connection::start_reading() {
  if (reading_ || closing_ || peer_eof_) return;
  reading_ = true;
  uv_read_start(
      stream(),
      [](uv_handle_t* h, size_t, uv_buf_t* buf) {
        auto* self = static_cast<Connection*>(h->data);
        *buf = uv_buf_init(self->read_buf_.get(), kReadBufferBytes);
      },
      [](uv_stream_t* s, ssize_t nread, const uv_buf_t* buf) {
        static_cast<Connection*>(s->data)->on_read(nread, buf);
      });
}

void ApiServer::Connection::on_read(ssize_t nread, const uv_buf_t* buf) {
  if (closing_) return;
  if (nread < 0) {
    if (nread != UV_EOF || draining_) return close_now();
    // The peer finished sending; it may still read the answers to what it sent.
    peer_eof_ = true;
    reading_ = false;
    uv_read_stop(stream());
    input_done_ = true;  // a request is never delimited by EOF, so a partial one is simply dropped
    return flush();
  }
  if (draining_ || input_done_) return;
  process(buf->base, static_cast<size_t>(nread));
}

bool ApiServer::Connection::backlogged() const {
  return slots_.size() >= kMaxPendingResponses ||
         uv_stream_get_write_queue_size(&handle_.stream) >= kMaxQueuedWriteBytes;
}

void ApiServer::Connection::process(const char* data, size_t len) {
  in_process_ = true;
  while (len > 0 && !input_done_ && !closing_) {
    if (backlogged()) {
      unparsed_.append(data, len);
      reading_ = false;
      uv_read_stop(stream());
      break;
    }
    HttpParser::State st = parser_.feed(data, len);
    size_t used = parser_.consumed();
    data += used;
    len -= used;
    if (st == HttpParser::State::kMessageComplete) {
      handle_request(parser_.message());
      parser_.reset();
      continue_sent_ = false;
    } else if (st == HttpParser::State::kError) {
      answer_parse_error();
    } else {
      maybe_send_continue();
      // kNeedMore may stop early (the parser bounds how much of a chunk can still be head); feed the rest.
      if (used == 0) break;
    }
  }
  in_process_ = false;
  if (input_done_ && reading_ && !draining_) {
    reading_ = false;
    uv_read_stop(stream());
  }
  flush();
}

// curl and others wait (up to a second) for "100 Continue" before sending a body they announced with
// Expect. Only safe when no earlier answer is still owed, or the interim answer would overtake it.
void ApiServer::Connection::maybe_send_continue() {
  if (continue_sent_ || !slots_.empty()) return;
  const HttpMessage& m = parser_.message();
  const std::string* expect = m.header("Expect");
  if (expect == nullptr || strcasecmp(expect->c_str(), "100-continue") != 0 || m.http_minor < 1) return;
  continue_sent_ = true;
  write("HTTP/1.1 100 Continue\r\n\r\n");
}

void ApiServer::Connection::handle_request(HttpMessage& request) {
  uint64_t seq = next_seq_++;
  Slot& slot = slots_.emplace_back();
  slot.method = request.method;
  // For the log line only, so without the query: no endpoint takes one, and whatever a client put there
  // (a token pasted by mistake) must not reach the log.
  slot.target = request.target.substr(0, request.target.find('?'));
  slot.started = Clock::now();
  // Every answer has a body, which a HEAD client would not read; closing keeps it from being taken
  // for the next response.
  slot.close_after = !request.keep_alive || request.method == "HEAD";
  if (slot.close_after) input_done_ = true;
  if (!is_unix_) {
    if (auto refusal = server_->refuse_tcp(request, hosts_)) return respond(seq, std::move(*refusal));
  }
  std::weak_ptr<Connection> weak = weak_from_this();
  server_->route(request, is_unix_, [weak, seq](Response r) {
    if (auto self = weak.lock(); self && !self->closing_) self->respond(seq, std::move(r));
  });
}

void ApiServer::Connection::respond(uint64_t seq, Response response) {
  if (seq < first_seq_ || seq - first_seq_ >= slots_.size()) return;
  Slot& slot = slots_[seq - first_seq_];
  slot.ready = true;
  slot.bytes = serialize(response, slot.close_after);
  slot.fds = std::move(response.fds);
  slot.route_events = response.route_events;
  slot.stream = std::move(response.stream);
  if (slot.route_events || slot.stream) {
    // A close-delimited body of JSON lines (no Content-Length: it never ends on its own).
    slot.bytes = "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nCache-Control: no-store\r\n"
                 "Connection: close\r\n\r\n";
    slot.close_after = true;
    input_done_ = true;
  }
  spdlog::debug("{} {} {} -> {} ({:.1f} ms)", peer_, slot.method, slot.target, response.status,
                std::chrono::duration<double, std::milli>(Clock::now() - slot.started).count());
  if (!in_process_) flush();
}

void ApiServer::Connection::answer_parse_error() {
  const Failure& f = parser_.failure();
  int status = 400;
  if (f.code == Error::kLimitExceeded) status = f.message.starts_with("head") ? 431 : 413;
  Slot& slot = slots_.emplace_back();
  slot.method = "?";
  slot.target = "?";
  slot.started = Clock::now();
  slot.close_after = true;  // the stream position is lost; nothing after this can be parsed
  input_done_ = true;
  respond(next_seq_++, error_response(status, f.code, f.message));
}

void ApiServer::Connection::flush() {
  if (closing_ || streaming_) return;  // a stream's lines are written as events come
  while (!slots_.empty() && slots_.front().ready) {
    Slot& slot = slots_.front();
    if (!slot.fds.empty()) {
      // The descriptor must ride on these exact bytes, so everything before them has to be in the kernel.
      if (uv_stream_get_write_queue_size(stream()) > 0) return;  // the write callback flushes again
      if (!send_with_descriptor(slot)) return;
    } else {
      write(std::move(slot.bytes));
    }
    if (closing_) return;
    if (slot.route_events) {
      slots_.pop_front();
      ++first_seq_;
      return stream_route_events();
    }
    if (slot.stream) {
      std::shared_ptr<Stream> stream = std::move(slot.stream);
      slots_.pop_front();
      ++first_seq_;
      return attach_stream(std::move(stream));
    }
    bool close_after = slot.close_after;
    slots_.pop_front();
    ++first_seq_;
    if (close_after) break;  // input_done_ was set when this request (or parse error) arrived
  }
  if (closing_) return;
  if (input_done_) {
    if (slots_.empty()) begin_close();
    return;
  }
  if (in_process_ || reading_ || backlogged()) return;
  // Caught up after back-pressure: parse what was held back, then read again.
  std::string held = std::move(unparsed_);
  unparsed_.clear();
  start_reading();
  if (!held.empty()) process(held.data(), held.size());
}

bool ApiServer::Connection::send_with_descriptor(Slot& slot) {
  int fd = -1;
  uv_fileno(reinterpret_cast<uv_handle_t*>(stream()), &fd);
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, 0) == 0) {
    // Send buffer full and libuv has nothing queued, so no write callback will come: poll again shortly.
    uv_timer_start(timer_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->flush(); }, kFdRetryMs, 0);
    return false;
  }
  std::vector<int> raw;
  for (const UniqueFd& f : slot.fds) raw.push_back(f.get());
  auto sent = send_with_fds(fd, slot.bytes.data(), slot.bytes.size(), raw);
  if (!sent) {
    spdlog::debug("{}: cannot pass descriptor: {}", peer_, sent.message());
    close_now();
    return false;
  }
  slot.fds.clear();  // the peer holds its own copies now
  if (*sent < slot.bytes.size()) write(slot.bytes.substr(*sent));
  return true;
}

void ApiServer::Connection::write(std::string data) {
  auto* req = new WriteReq;
  req->data = std::move(data);
  req->req.data = this;
  uv_buf_t buf = uv_buf_init(req->data.data(), static_cast<unsigned>(req->data.size()));
  int rc = uv_write(&req->req, stream(), &buf, 1, [](uv_write_t* w, int status) {
    auto* r = reinterpret_cast<WriteReq*>(w);
    auto* self = static_cast<Connection*>(w->data);
    delete r;
    // Callbacks of cancelled writes run before the close callback, so `self` is still alive here.
    if (self->closing_) return;
    if (status < 0) return self->close_now();
    self->flush();
  });
  if (rc < 0) {
    delete req;
    close_now();
  }
}

// All answers are queued: send FIN after them, then drain what the client still sends until it closes
// (closing with unread input would reset the connection and could destroy the answer in flight).
void ApiServer::Connection::begin_close() {
  if (shutdown_started_ || closing_) return;
  shutdown_started_ = true;
  auto* req = new uv_shutdown_t;
  req->data = this;
  int rc = uv_shutdown(req, stream(), [](uv_shutdown_t* r, int status) {
    auto* self = static_cast<Connection*>(r->data);
    delete r;
    if (self->closing_) return;
    if (status < 0 || self->peer_eof_) return self->close_now();
    self->draining_ = true;
    self->start_reading();
    uv_timer_start(self->timer_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->close_now(); }, kLingerMs, 0);
  });
  if (rc < 0) {
    delete req;
    close_now();
  }
}

// The proxy's route cache listens here: the first line gives the stamp from which it saw every event, then
// one line per RouteEvent, written before the call that caused it is answered. A proxy that reads too
// slowly is cut off (it drops its whole cache when the stream breaks), so a stuck one costs bounded memory.
void ApiServer::Connection::stream_route_events() {
  streaming_ = true;
  Node* node = server_->node_;
  write(to_text(ordered_json{{"event", "hello"}, {"stamp", node->current_stamp()}}) + "\n");
  std::weak_ptr<Connection> weak = weak_from_this();
  subscription_ = node->subscribe([weak](const RouteEvent& e) {
    auto self = weak.lock();
    if (!self || self->closing_) return;
    if (uv_stream_get_write_queue_size(self->stream()) >= kMaxQueuedWriteBytes) return self->close_now();
    ordered_json j = {{"event", e.id.empty() ? "flush" : "invalidate"},
                      {"id", e.id},
                      {"name", e.name.empty() ? ordered_json(nullptr) : ordered_json(e.name)},
                      {"reason", e.reason},
                      {"stamp", e.stamp}};
    self->write(to_text(j) + "\n");
  });
  // Reading goes on only to see the proxy close its end.
  draining_ = true;
  start_reading();
}

void ApiServer::Stream::send(std::string line, bool droppable) {
  if (ended_) return;
  if (sink_) return sink_(std::move(line), droppable);
  pending_.emplace_back(std::move(line), droppable);
}

void ApiServer::Stream::attach(std::function<void(std::string, bool)> sink, std::function<void()> on_end) {
  sink_ = std::move(sink);
  on_end_ = std::move(on_end);
  for (auto& [line, droppable] : pending_) sink_(std::move(line), droppable);
  pending_.clear();
  if (ended_) on_end_();
}

void ApiServer::Stream::end() {
  if (ended_) return;
  ended_ = true;
  if (on_end_) on_end_();
}

// The stream's lines go out as they come; the client closing its end only shows as a failed write, after
// which the stream's lines are dropped (the work behind it goes on: a build still finishes its image).
void ApiServer::Connection::attach_stream(std::shared_ptr<Stream> stream) {
  streaming_ = true;
  std::weak_ptr<Connection> weak = weak_from_this();
  stream->attach(
      [weak](std::string line, bool droppable) {
        auto self = weak.lock();
        if (!self || self->closing_) return;
        if (droppable && uv_stream_get_write_queue_size(self->stream()) >= kMaxQueuedWriteBytes) return;
        self->write(std::move(line) + "\n");
      },
      [weak] {
        if (auto self = weak.lock(); self && !self->closing_) self->begin_close();
      });
}

void ApiServer::Connection::close_now() {
  if (closing_) return;
  closing_ = true;
  if (subscription_ != 0) server_->node_->unsubscribe(subscription_);
  slots_.clear();  // closes descriptors that were never sent
  uv_timer_stop(timer_);
  close_and_free(timer_);
  uv_close(reinterpret_cast<uv_handle_t*>(stream()), [](uv_handle_t* h) {
    auto* self = static_cast<Connection*>(h->data);
    ApiServer* server = self->server_;
    server->connections_.erase(self);  // destroys *self
    server->on_handle_closed();
  });
}

// ---- server ----

ApiServer::ApiServer(uv_loop_t* loop, Node* node, const ConfigHolder* config)
    : loop_(loop), node_(node), config_(config) {}

Status ApiServer::listen(const Endpoint& ep) {
  if (closing_) return fail(Error::kUnavailable, "server is closing");
  auto fd = listen_on(ep, false);
  if (!fd) return fd.failure();
  bool is_unix = ep.kind == Endpoint::Kind::kUnix;
  // Owner and group only: the socket controls every sandbox on the node.
  if (is_unix && ::chmod(ep.path.c_str(), 0660) != 0) return fail_errno("chmod " + ep.path, errno);
  // node.socket_group: the group that may use it besides root, such as the one of a proxy that dropped root
  // (proxy.user). Looked up again here, not only at config load: the group may have gone since.
  if (const std::string& group = config_->get()->node.socket_group; is_unix && !group.empty()) {
    auto gid = find_group(group);
    if (!gid) return fail(gid.error(), "node.socket_group: " + gid.message());
    if (!*gid) return fail(Error::kNotFound, "node.socket_group: no group named \"" + group + "\"");
    if (::chown(ep.path.c_str(), static_cast<uid_t>(-1), **gid) != 0)
      return fail_errno("chown " + ep.path + " to group " + group, errno);
  }
  // The address as bound, so port 0 in the config logs the port the kernel chose.
  Endpoint bound = ep;
  if (!is_unix) {
    if (auto port = local_port(fd->get())) bound.port = *port;
  }
  auto* l = new Listener;
  l->server = this;
  l->is_unix = is_unix;
  if (is_unix) l->unix_path = ep.path;
  int rc = is_unix ? uv_pipe_init(loop_, &l->handle.pipe, 0) : uv_tcp_init(loop_, &l->handle.tcp);
  if (rc < 0) {
    delete l;
    return fail(Error::kIo, "listen " + ep.to_string() + ": " + uv_strerror(rc));
  }
  l->handle.stream.data = l;
  ++open_handles_;
  listeners_.push_back(l);
  rc = is_unix ? uv_pipe_open(&l->handle.pipe, fd->get()) : uv_tcp_open(&l->handle.tcp, fd->get());
  if (rc == 0) {
    fd->release();  // the handle owns it now
    rc = uv_listen(&l->handle.stream, 1024, [](uv_stream_t* s, int status) {
      auto* listener = static_cast<Listener*>(s->data);
      listener->server->on_connection(listener, status);
    });
  }
  if (rc < 0) return fail(Error::kIo, "listen " + ep.to_string() + ": " + uv_strerror(rc));
  spdlog::info("node API listening on {}", bound.to_string());
  return {};
}

void ApiServer::on_connection(Listener* listener, int status) {
  if (status < 0) {
    spdlog::warn("accept: {}", uv_strerror(status));
    return;
  }
  auto conn = std::make_shared<Connection>(this, listener->is_unix);
  if (auto s = conn->init(loop_); !s) {
    spdlog::warn("{}", s.message());
    return;
  }
  ++open_handles_;
  connections_.emplace(conn.get(), conn);
  if (int rc = uv_accept(&listener->handle.stream, conn->stream()); rc < 0) {
    spdlog::warn("accept: {}", uv_strerror(rc));
    conn->close_now();
    return;
  }
  std::string peer = "unix";
  std::vector<std::string> hosts;
  if (!listener->is_unix) {
    auto* tcp = reinterpret_cast<uv_tcp_t*>(conn->stream());
    sockaddr_storage ss{};
    int len = sizeof ss;
    if (uv_tcp_getpeername(tcp, reinterpret_cast<sockaddr*>(&ss), &len) == 0)
      peer = format_peer(reinterpret_cast<sockaddr*>(&ss));
    len = sizeof ss;
    // Without its own address the connection accepts no Host at all, which refuses every request on it.
    if (uv_tcp_getsockname(tcp, reinterpret_cast<sockaddr*>(&ss), &len) == 0)
      hosts = own_hosts(reinterpret_cast<sockaddr*>(&ss));
  }
  conn->start(peer, std::move(hosts));
}

void ApiServer::close(std::function<void()> done) {
  closing_ = true;
  close_done_ = std::move(done);
  for (Listener* l : listeners_) {
    if (!l->unix_path.empty()) ::unlink(l->unix_path.c_str());
    uv_close(reinterpret_cast<uv_handle_t*>(&l->handle.stream), [](uv_handle_t* h) {
      auto* listener = static_cast<Listener*>(h->data);
      ApiServer* server = listener->server;
      delete listener;
      server->on_handle_closed();
    });
  }
  listeners_.clear();
  std::vector<std::shared_ptr<Connection>> open;
  for (auto& [ptr, conn] : connections_) open.push_back(conn);
  for (auto& conn : open) conn->close_now();
  if (open_handles_ == 0) on_handle_closed();
}

void ApiServer::on_handle_closed() {
  if (open_handles_ > 0) --open_handles_;
  if (!closing_ || open_handles_ != 0 || !close_done_) return;
  auto done = std::move(close_done_);
  close_done_ = nullptr;
  done();
}

// ---- routes ----

std::optional<Response> ApiServer::refuse_tcp(const HttpMessage& request, const std::vector<std::string>& hosts) const {
  const std::string* host = request.header("Host");
  if (host == nullptr) return invalid("the TCP node API needs a Host header (this listener's address)");
  bool own = std::any_of(hosts.begin(), hosts.end(),
                         [&](const std::string& h) { return strcasecmp(h.c_str(), host->c_str()) == 0; });
  if (!own) {
    ordered_json body = {{"error", "misdirected_request"},
                         {"message", "Host '" + *host + "' is not this node API's address (" +
                                         (hosts.empty() ? std::string("unknown") : hosts.front()) + ")"}};
    return Response{421, to_text(body), {}, ""};
  }
  // Browsers send Origin on cross-site requests; nothing legitimate drives the node API from a web page.
  if (request.header("Origin") != nullptr)
    return error_response(403, Error::kPermissionDenied,
                          "requests with an Origin header (from a web page) are refused by the node API");
  CredentialCheck check = node_->check_operator_token(bearer_token(request));
  if (check == CredentialCheck::kAccepted) return std::nullopt;
  Response r = unauthorized(check == CredentialCheck::kMissing
                                ? "the TCP node API needs the operator token (Authorization: Bearer)"
                                : "invalid operator token");
  r.extra_headers = "WWW-Authenticate: Bearer realm=\"sandgate-node\"\r\n";
  return r;
}

Response ApiServer::sandbox_response(int status, const SandboxInfo& info) const {
  auto cfg = config_->get();
  ordered_json urls = ordered_json::object();
  const std::string& host_ref = info.spec.name.empty() ? info.spec.id : info.spec.name;
  for (uint16_t port : info.spec.exposed_ports) urls[std::to_string(port)] = cfg->port_url(port, host_ref);
  ordered_json ports = ordered_json::array();
  for (uint16_t port : info.spec.exposed_ports) {
    auto policy = port_policy(info.spec, port);
    ports.push_back({{"port", port},
                     {"public", policy && policy->is_public},
                     {"protocol", protocol_name(policy ? policy->protocol : PortProtocol::kHttp1)}});
  }
  ordered_json j = {
      {"id", info.spec.id},
      {"name", info.spec.name.empty() ? ordered_json(nullptr) : ordered_json(info.spec.name)},
      {"state", state_name(info.state)},
      {"state_reason", info.state_reason},
      {"ephemeral", info.spec.ephemeral},
      {"driver", info.spec.driver},
      {"command", info.spec.command},
      {"env", info.spec.env},
      {"cwd", info.spec.cwd},
      {"exposed_ports", info.spec.exposed_ports},
      {"ports", std::move(ports)},
      {"allow_unauthenticated_access", info.spec.allow_unauthenticated_access},
      {"agent_port", info.spec.agent_port != 0 ? ordered_json(info.spec.agent_port) : ordered_json(nullptr)},
      {"timeout_secs", info.spec.timeout_secs},
      {"hibernate_after_secs", info.spec.hibernate_after_secs},
      {"cpus", info.spec.cpus},
      {"memory_mb", info.spec.memory_mb},
      {"image", info.spec.image},
      {"snapshot", info.spec.snapshot.empty() ? ordered_json(nullptr) : ordered_json(info.spec.snapshot)},
      {"pids_max", info.spec.pids_max},
      {"disk_mb", info.spec.disk_mb},
      {"allow_internet_access", info.spec.allow_internet_access},
      {"allow_out", info.spec.allow_out},
      {"deny_out", info.spec.deny_out},
      {"pid", info.runtime.pid > 0 ? ordered_json(info.runtime.pid) : ordered_json(nullptr)},
      {"created_at", format_time(info.created_at_ms)},
      {"last_activity_at", format_time(info.last_activity_at_ms)},
      {"idle_deadline_at",
       info.idle_deadline_at_ms ? ordered_json(format_time(*info.idle_deadline_at_ms)) : ordered_json(nullptr)},
      {"tier", info.tier == SuspendTier::kNone ? ordered_json(nullptr) : ordered_json(tier_name(info.tier))},
      {"next_transition", info.next_transition.empty() ? ordered_json(nullptr) : ordered_json(info.next_transition)},
      {"next_transition_at",
       info.next_transition_at_ms ? ordered_json(format_time(*info.next_transition_at_ms)) : ordered_json(nullptr)},
      {"connections", info.connections},
      {"resumes", info.resumes},
      {"urls", std::move(urls)},
  };
  if (fleet_ != nullptr) j["node"] = fleet_->node_name();
  // Only create's answer has it: the node keeps nothing it could show again.
  if (!info.token.empty()) j["token"] = info.token;
  return Response{status, to_text(j), {}, ""};
}

void ApiServer::route(const HttpMessage& request, bool can_pass_fds, Reply reply) {
  std::string_view path = request.target;
  if (auto q = path.find('?'); q != std::string_view::npos) path = path.substr(0, q);
  const std::string& method = request.method;
  auto method_not_allowed = [&](std::string_view allowed) {
    std::string message = method + " is not allowed on " + std::string(path) + " (use " + std::string(allowed) + ")";
    Response r = error_response(405, Error::kUnsupported, message);
    r.extra_headers = "Allow: " + std::string(allowed) + "\r\n";
    reply(std::move(r));
  };

  // Prometheus scrapes this path by default; like every other path on the TCP API it needs the operator token.
  if (path == "/metrics") {
    if (method != "GET") return method_not_allowed("GET");
    Response r{200, node_->metrics_text(), {}, ""};
    r.extra_headers = "Content-Type: " + std::string(kMetricsContentType) + "\r\n";
    return reply(std::move(r));
  }
  if (path == "/v1/health") {
    if (method != "GET") return method_not_allowed("GET");
    ordered_json j = {{"status", "ok"},
                      {"sandboxes", node_->sandbox_count()},
                      {"driver", node_->default_driver_name()},
                      {"drivers", node_->driver_names()}};
    return reply(Response{200, to_text(j), {}, ""});
  }
  if (path == "/v1/sandboxes") {
    if (method == "POST") return handle_create(request, std::move(reply));
    if (method != "GET") return method_not_allowed("GET, POST");
    // Serialized piecewise: one Response per sandbox reuses the single-sandbox encoding.
    std::string body = "{\"sandboxes\":[";
    bool first = true;
    for (const SandboxInfo& info : node_->list()) {
      body += first ? "" : ",";
      body += sandbox_response(200, info).body;
      first = false;
    }
    body += "]}";
    return reply(Response{200, std::move(body), {}, ""});
  }
  if (path == "/v1/fleet/nodes" || path.starts_with("/v1/fleet/")) {
    if (fleet_ == nullptr)
      return reply(error_response(400, Error::kUnsupported, "this node is not in a fleet (no [fleet] in its config)"));
    if (path == "/v1/fleet/nodes") {
      if (method != "GET") return method_not_allowed("GET");
      ordered_json nodes = ordered_json::array();
      for (const fleet::NodeInfo& n : fleet_->fleet_nodes()) {
        nodes.push_back({{"name", n.name},
                         {"state", n.state == fleet::NodeState::kDraining ? "draining" : "ready"},
                         {"sandboxes", n.sandboxes},
                         {"capacity_sandboxes", n.capacity_sandboxes},
                         {"capacity_memory_mb", n.capacity_memory_mb},
                         {"reserved_memory_mb", n.reserved_memory_mb},
                         {"capacity_millicpus", n.capacity_millicpus},
                         {"reserved_millicpus", n.reserved_millicpus},
                         {"api", n.api},
                         {"ingress", n.ingress}});
        // null: the node publishes no list (more images than a node key carries).
        nodes.back()["images"] = n.images ? ordered_json(*n.images) : ordered_json(nullptr);
      }
      return reply(Response{200,
                            to_text(ordered_json{{"node", fleet_->node_name()},
                                                 {"nodes", std::move(nodes)},
                                                 {"conflicts", fleet_->conflicts()}}),
                            {}, ""});
    }
    constexpr std::string_view kNodes = "/v1/fleet/nodes/";
    if (path.starts_with(kNodes) && path.ends_with("/drain")) {
      std::string node(path.substr(kNodes.size(), path.size() - kNodes.size() - 6));
      bool name_ok = !node.empty() && node.size() <= 63;
      for (char c : node) name_ok = name_ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-');
      if (!name_ok) return reply(invalid("node name must be 1-63 characters of [a-z0-9-]"));
      if (method != "POST" && method != "DELETE") return method_not_allowed("POST, DELETE");
      bool draining = method == "POST";
      fleet_->set_draining(node, draining, [reply, node, draining](Result<std::vector<FleetAdmin::NodeSandbox>> r) {
        if (!r) return reply(error_response(r.failure()));
        ordered_json answer{{"node", node}, {"draining", draining}};
        if (draining) {
          ordered_json staying = ordered_json::array();
          for (const auto& sb : *r) staying.push_back({{"name", sb.name}, {"state", sb.state}});
          answer["sandboxes"] = std::move(staying);
        }
        reply(Response{200, to_text(answer), {}, ""});
      });
      return;
    }
    return reply(error_response(404, Error::kNotFound, "no such fleet path"));
  }
  if (path == "/v1/internal/open") {
    if (method != "POST") return method_not_allowed("POST");
    return handle_open(request, can_pass_fds, std::move(reply));
  }
  if (path == "/v1/internal/lookup") {
    if (method != "POST") return method_not_allowed("POST");
    return handle_lookup(request, can_pass_fds, reply);
  }
  if (path == "/v1/internal/sockets") {
    if (method != "POST") return method_not_allowed("POST");
    return handle_sockets(request, can_pass_fds, reply);
  }
  if (path == "/v1/internal/events") {
    if (method != "GET") return method_not_allowed("GET");
    // Tells which sandboxes a proxy may route to from its cache: the proxy's business only.
    if (!can_pass_fds) return reply(invalid("internal/events is served on the unix socket only"));
    Response r{200, "", {}, ""};
    r.route_events = true;
    return reply(std::move(r));
  }
  if (path == "/v1/internal/activity") {
    if (method != "POST") return method_not_allowed("POST");
    return handle_activity(request, reply);
  }
  if (path == "/v1/images/build" && method == "POST") return handle_image_build(request, can_pass_fds, std::move(reply));
  if (path == "/v1/images") {
    if (method == "POST") return handle_image_import(request, can_pass_fds, std::move(reply));
    if (method != "GET") return method_not_allowed("GET, POST");
    if (images_ == nullptr) return reply(no_images());
    auto images = images_->list();
    if (!images) return reply(error_response(images.failure()));
    ordered_json list = ordered_json::array();
    for (const snapshot::Image& image : *images) list.push_back(image_json(image));
    return reply(Response{200, to_text(ordered_json{{"images", std::move(list)}}), {}, ""});
  }
  constexpr std::string_view kImages = "/v1/images/";
  if (path.starts_with(kImages) && path.size() > kImages.size()) {
    // Image names are plain [A-Za-z0-9._:-] (check_image_name), so the segment is the name as it is.
    std::string name(path.substr(kImages.size()));
    if (method != "GET" && method != "DELETE") return method_not_allowed("GET, DELETE");
    if (images_ == nullptr) return reply(no_images());
    if (method == "GET") return reply(image_response(200, images_->get(name)));
    return images_->remove(name, [reply = std::move(reply)](Result<snapshot::Image> image) {
      reply(image_response(200, image));
    });
  }
  if (path == "/v1/snapshots") {
    if (method != "GET") return method_not_allowed("GET");
    if (snapshots_ == nullptr) return reply(no_snapshots());
    auto all = snapshots_->list();
    if (!all) return reply(error_response(all.failure()));
    ordered_json list = ordered_json::array();
    for (const snapshot::Snapshot& s : *all) list.push_back(snapshot_json(s));
    return reply(Response{200, to_text(ordered_json{{"snapshots", std::move(list)}}), {}, ""});
  }
  constexpr std::string_view kSnapshots = "/v1/snapshots/";
  if (path.starts_with(kSnapshots) && path.size() > kSnapshots.size()) {
    // Snapshot ids are snap-[a-z0-9]{12} (check_snapshot_id), so the segment is the id as it is.
    std::string id(path.substr(kSnapshots.size()));
    if (method != "GET" && method != "DELETE") return method_not_allowed("GET, DELETE");
    if (snapshots_ == nullptr) return reply(no_snapshots());
    if (method == "GET") return reply(snapshot_response(200, snapshots_->get(id)));
    return snapshots_->remove(id, [reply = std::move(reply)](Result<snapshot::Snapshot> s) {
      reply(snapshot_response(200, s));
    });
  }
  if (path == "/v1/ssh-keys" || path.starts_with("/v1/ssh-keys/")) return handle_ssh_keys(request, path, std::move(reply));
  constexpr std::string_view kSandboxes = "/v1/sandboxes/";
  if (path.starts_with(kSandboxes)) {
    std::string_view rest = path.substr(kSandboxes.size());
    std::string_view ref = rest.substr(0, rest.find('/'));
    std::string_view action = ref.size() < rest.size() ? rest.substr(ref.size() + 1) : std::string_view();
    if (!ref.empty() && ref.size() == rest.size()) {
      if (method == "GET") {
        auto info = node_->get(ref);
        return reply(info ? sandbox_response(200, *info) : error_response(info.failure()));
      }
      if (method != "DELETE") return method_not_allowed("GET, DELETE");
      return node_->remove(ref, [this, reply = std::move(reply)](Result<SandboxInfo> info) {
        reply(info ? sandbox_response(200, *info) : error_response(info.failure()));
      });
    }
    if (!ref.empty() && action == "token") {
      if (method != "POST") return method_not_allowed("POST");
      auto info = node_->rotate_token(ref);
      return reply(info ? sandbox_response(200, *info) : error_response(info.failure()));
    }
    if (!ref.empty() && action == "checkpoint") {
      if (method != "POST") return method_not_allowed("POST");
      auto type = parse_checkpoint(request.body);
      if (!type) return reply(error_response(type.failure()));
      return node_->checkpoint(ref, *type, [reply = std::move(reply)](Result<snapshot::CheckpointResult> r) {
        if (!r) return reply(error_response(r.failure()));
        ordered_json j = {{"snapshot_id", r->snapshot.id},
                          {"pause_ms", r->pause_ms},
                          {"entries", r->entries},
                          {"flattened_layers", r->flattened},
                          {"snapshot", snapshot_json(r->snapshot)}};
        reply(Response{201, to_text(j), {}, ""});
      });
    }
    if (!ref.empty() && action == "fork") {
      if (method != "POST") return method_not_allowed("POST");
      auto fork = parse_fork(request.body);
      if (!fork) return reply(error_response(fork.failure()));
      return fork_sandbox(*node_, std::string(ref), *fork, [this, reply = std::move(reply)](Result<ForkResult> r) {
        if (!r) return reply(error_response(r.failure()));
        std::string body = "{\"snapshot_id\":" + ordered_json(r->snapshot.id).dump() +
                           ",\"snapshot\":" + to_text(snapshot_json(r->snapshot)) + ",\"sandboxes\":[";
        for (size_t i = 0; i < r->sandboxes.size(); ++i)
          body += (i ? "," : "") + sandbox_response(201, r->sandboxes[i]).body;
        reply(Response{201, body + "]}", {}, ""});
      });
    }
    constexpr std::string_view kPorts = "ports/";
    if (!ref.empty() && action.starts_with(kPorts)) {
      std::string_view digits = action.substr(kPorts.size());
      int64_t port = 0;
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
      if (digits.empty() || digits.size() > 5 || ec != std::errc() || end != digits.data() + digits.size())
        return reply(error_response(400, Error::kInvalidArgument,
                                    "'" + std::string(digits) + "' is not a port number (1-65535)"));
      if (method == "DELETE") {
        auto info = node_->close_port(ref, port);
        return reply(info ? sandbox_response(200, *info) : error_response(info.failure()));
      }
      if (method != "PUT") return method_not_allowed("PUT, DELETE");
      auto expose = parse_expose(request.body);
      if (!expose) return reply(error_response(expose.failure()));
      return node_->expose_port(ref, port, *expose, [this, reply = std::move(reply)](Result<SandboxInfo> info) {
        reply(info ? sandbox_response(200, *info) : error_response(info.failure()));
      });
    }
    if (!ref.empty() && (action == "suspend" || action == "resume")) {
      if (method != "POST") return method_not_allowed("POST");
      auto outcome = action == "suspend" ? node_->suspend(ref) : node_->resume(ref);
      if (!outcome) return reply(error_response(outcome.failure()));
      return reply(sandbox_response(outcome->started ? 202 : 200, outcome->sandbox));
    }
  }
  reply(error_response(404, Error::kNotFound, "no such endpoint: " + method + " " + std::string(path)));
}

namespace {

ordered_json ssh_key_json(const SshKeyEntry& e) {
  return ordered_json{{"label", e.label}, {"type", e.key.type}, {"fingerprint", e.fingerprint},
                      {"public_key", e.key.canonical()}};
}

}  // namespace

// GET /v1/ssh-keys, POST /v1/ssh-keys {"public_key": "...", "label": "..."}, DELETE /v1/ssh-keys/LABEL.
void ApiServer::handle_ssh_keys(const HttpMessage& request, std::string_view path, Reply reply) {
  const std::string& method = request.method;
  auto not_allowed = [&](std::string_view allowed) {
    Response r = error_response(405, Error::kUnsupported,
                                method + " is not allowed on " + std::string(path) + " (use " + std::string(allowed) + ")");
    r.extra_headers = "Allow: " + std::string(allowed) + "\r\n";
    reply(std::move(r));
  };
  if (ssh_keys_ == nullptr) return reply(error_response(503, Error::kUnavailable, "this node has no SSH key store"));
  if (path == "/v1/ssh-keys") {
    if (method == "GET") {
      ordered_json list = ordered_json::array();
      for (const SshKeyEntry& e : ssh_keys_->list()) list.push_back(ssh_key_json(e));
      return reply(Response{200, to_text(ordered_json{{"ssh_keys", std::move(list)}}), {}, ""});
    }
    if (method != "POST") return not_allowed("GET, POST");
    auto body = parse_object(request.body);
    if (!body) return reply(error_response(body.failure()));
    std::string label, key;
    for (auto it = body->begin(); it != body->end(); ++it) {
      if (it.key() != "label" && it.key() != "public_key")
        return reply(error_response(unknown_field(it.key(), "label, public_key")));
      if (!it->is_string()) return reply(error_response(wrong_type(it.key(), "a string", *it)));
      (it.key() == "label" ? label : key) = it->get<std::string>();
    }
    if (key.empty()) return reply(invalid("public_key is required: the content of a .pub file"));
    auto added = ssh_keys_->add(label, key);
    if (!added) return reply(error_response(added.failure()));
    node_->ssh_keys_changed();
    return reply(Response{201, to_text(ssh_key_json(*added)), {}, ""});
  }
  std::string_view label = path.substr(std::string_view("/v1/ssh-keys/").size());
  if (method != "DELETE") return not_allowed("DELETE");
  if (Status s = validate_ssh_key_label(label); !s) return reply(error_response(s.failure()));
  if (Status s = ssh_keys_->remove(label); !s) return reply(error_response(s.failure()));
  node_->ssh_keys_changed();
  return reply(Response{200, to_text(ordered_json{{"removed", std::string(label)}}), {}, ""});
}

// The archive is a path on the node's own disk, which only the local operator (the unix socket) may name:
// through the ingress or a TCP listener it would let a remote caller make the node read its files.
void ApiServer::handle_image_import(const HttpMessage& request, bool is_unix, Reply reply) {
  if (!is_unix)
    return reply(invalid("POST /v1/images reads an archive on the node's disk, so it is served on the unix socket "
                         "only (run sandgate on the node)"));
  if (images_ == nullptr) return reply(no_images());
  auto body = parse_object(request.body);
  if (!body) return reply(error_response(body.failure()));
  std::string name, archive;
  for (auto it = body->begin(); it != body->end(); ++it) {
    if (it.key() != "name" && it.key() != "archive") return reply(error_response(unknown_field(it.key(), "name, archive")));
    if (!it->is_string()) return reply(error_response(wrong_type(it.key(), "a string", *it)));
    (it.key() == "name" ? name : archive) = it->get<std::string>();
  }
  if (name.empty()) return reply(invalid("name is required"));
  if (archive.empty() || archive.front() != '/')
    return reply(invalid("archive is required: the absolute path of a docker save or OCI layout tar on the node"));
  images_->import(std::move(archive), std::move(name), [reply = std::move(reply)](Result<snapshot::Image> image) {
    reply(image_response(201, image));
  });
}

namespace {

ordered_json build_event_json(const BuildEvent& e) {
  switch (e.kind) {
    case BuildEvent::Kind::kStep:
      return {{"event", "step"}, {"step", e.step}, {"steps", e.steps}, {"what", e.text}};
    case BuildEvent::Kind::kOutput:
      return {{"event", "output"}, {"step", e.step}, {"line", e.text}};
    case BuildEvent::Kind::kLayer:
      return {{"event", "layer"},
              {"step", e.step},
              {"digest", e.text.empty() ? ordered_json(nullptr) : ordered_json(e.text)},
              {"size_bytes", e.size_bytes}};
  }
  return {};
}

}  // namespace

// Like an import, a build reads files on the node (its copy sources) and runs code there (in a build
// sandbox, but with the host's network): the local operator's, on the unix socket only. What can be checked
// before any work (the request, the names, the copy sources) is a plain error answer; once the build starts
// the answer is a stream of progress lines ending in {"event": "image"} or {"event": "error"}.
void ApiServer::handle_image_build(const HttpMessage& request, bool is_unix, Reply reply) {
  if (!is_unix)
    return reply(invalid("POST /v1/images/build runs build steps and reads files on the node, so it is served on the "
                         "unix socket only (run sandgate on the node)"));
  if (images_ == nullptr) return reply(no_images());
  auto body = parse_object(request.body);
  if (!body) return reply(error_response(body.failure()));
  auto build = parse_build(*body);
  if (!build) return reply(error_response(build.failure()));
  if (images_->get(build->name))
    return reply(error_response(409, Error::kAlreadyExists, "image " + build->name + " already exists (sandgate image rm " +
                                                             build->name + " first)"));
  if (!build->from.empty())
    if (auto parent = images_->get(build->from); !parent) return reply(error_response(parent.failure()));
  for (const BuildStep& s : build->steps)
    if (struct stat st{}; s.kind == BuildStep::Kind::kCopy && ::lstat(s.copy.host_path.c_str(), &st) != 0)
      return reply(error_response(404, Error::kNotFound, "copy source " + s.copy.host_path + " does not exist on the node"));
  auto stream = std::make_shared<Stream>();
  Response r{200, "", {}, ""};
  r.stream = stream;
  reply(std::move(r));
  images_->build(
      std::move(*build), [stream](const BuildEvent& e) { stream->send(to_text(build_event_json(e)), e.kind == BuildEvent::Kind::kOutput); },
      [stream](Result<snapshot::Image> image) {
        if (image) {
          stream->send(to_text(ordered_json{{"event", "image"}, {"image", image_json(*image)}}), false);
        } else {
          stream->send(to_text(ordered_json{{"event", "error"},
                                            {"error", error_name(image.error())},
                                            {"message", image.message()}}),
                       false);
        }
        stream->end();
      });
}

void ApiServer::handle_create(const HttpMessage& request, Reply reply) {
  auto body = parse_object(request.body);
  if (!body) return reply(error_response(body.failure()));
  auto create = parse_create(*body);
  if (!create) return reply(error_response(create.failure()));
  // A snapshot lives in this node's store, so a create from it stays here; so does a create another node
  // placed here (admitted or refused, never sent on).
  const bool stays_here = placer_ == nullptr || fleet_ == nullptr || create->snapshot_id.has_value() ||
                          request.header(kPlacedByHeader) != nullptr;
  // What the create reserves where it lands: what make_sandbox_spec gives it (a spec's defaults unless it says).
  PlacementDemand demand;
  demand.image = create->image.value_or("");
  demand.memory_mb = create->memory_mb.value_or(SandboxSpec{}.memory_mb);
  demand.millicpus = static_cast<int64_t>(millicpus(create->cpus.value_or(SandboxSpec{}.cpus)));
  auto here = [this, create = std::move(*create)](CreatePlacer::Done done) {
    node_->create(create, [this, done = std::move(done)](Result<SandboxInfo> info) {
      Response r = info ? sandbox_response(201, *info) : error_response(info.failure());
      done({r.status, std::move(r.body), std::move(r.extra_headers)});
    });
  };
  auto answer = [reply = std::move(reply)](CreatePlacer::Answer a) {
    reply(Response{a.status, std::move(a.body), {}, std::move(a.extra_headers)});
  };
  if (stays_here) return here(std::move(answer));
  placer_->place(request.body, placement_order(fleet_->fleet_nodes(), placement_rng_, demand), std::move(here),
                 std::move(answer));
}

void ApiServer::enable_placement(PlacementOptions options, CreatePlacer::RemoteCreate remote) {
  placer_ = std::make_unique<CreatePlacer>(loop_, std::move(options), std::move(remote));
}

void ApiServer::handle_open(const HttpMessage& request, bool can_pass_fds, Reply reply) {
  if (!can_pass_fds)
    return reply(invalid("internal/open passes a file descriptor, so it only works on the unix socket"));
  auto wake_timeout = parse_wake_timeout(request);
  if (!wake_timeout) return reply(error_response(wake_timeout.failure()));
  auto body = parse_object(request.body);
  if (!body) return reply(error_response(body.failure()));
  auto req = parse_port_request(*body, PortRequestKind::kOpen);
  if (!req) return reply(error_response(req.failure()));
  // Checked before anything touches the sandbox: a refused credential must neither wake it nor count as
  // activity, or anyone could keep every sandbox awake.
  auto access = node_->lookup(req->ref, req->port);
  if (!access) return reply(error_response(access.failure()));
  // The candidate that verified (the proxy strips it and, for a query parameter, turns it into a cookie).
  std::optional<size_t> accepted;
  if (!access->is_public) {
    for (size_t i = 0; i < req->credentials.size() && !accepted; ++i)
      if (node_->check_credential(access->id, req->credentials[i]) == CredentialCheck::kAccepted) accepted = i;
    const bool none = std::all_of(req->credentials.begin(), req->credentials.end(),
                                  [](const std::string& c) { return c.empty(); });
    if (!accepted) return reply(unauthorized(none ? "missing token" : "invalid token"));
    node_->credential_verified(access->id, req->client);
  }
  node_->open(req->ref, req->port, *wake_timeout,
              [this, reply = std::move(reply), accepted, spares = req->sockets](Result<OpenedPort> r) {
    if (!r) return reply(error_response(r.failure()));
    ordered_json j = {{"id", r->id},
                      {"name", r->name.empty() ? ordered_json(nullptr) : ordered_json(r->name)},
                      {"port", r->port},
                      {"protocol", protocol_name(r->protocol)},
                      {"public", r->is_public},
                      {"woke", r->woke},
                      {"wake_ms", r->wake_ms},
                      {"connect_port", r->socket.connect_port},
                      {"connected", r->socket.connected},
                      {"opened_at", r->opened_at},
                      {"token_sha256", r->token_sha256},
                      {"credential", accepted ? ordered_json(*accepted) : ordered_json(nullptr)}};
    std::vector<UniqueFd> fds;
    fds.push_back(std::move(r->socket.fd));
    // The proxy's route cache: with these it routes the next connections itself, so the verdict it needs
    // (the digests, how long it may) travels along. A connected socket (vsock) cannot be reused that way.
    if (spares > 0 && !r->socket.connected) {
      if (auto more = node_->spare_sockets(r->id, r->port, spares)) {
        for (UniqueFd& fd : more->fds) fds.push_back(std::move(fd));
        j["spare_sockets"] = more->fds.size();
        j["cache_ms"] = more->cache_ms;
        j["operator_token_sha256"] = node_->operator_token_sha256();
        // Last, after the spares: where more like them can be made while the node is down.
        j["netns"] = more->netns.valid();
        if (more->netns.valid()) fds.push_back(std::move(more->netns));
      }
    }
    reply(Response{200, to_text(j), std::move(fds), ""});
  });
}

void ApiServer::handle_sockets(const HttpMessage& request, bool can_pass_fds, Reply& reply) {
  if (!can_pass_fds)
    return reply(invalid("internal/sockets passes file descriptors, so it only works on the unix socket"));
  auto body = parse_object(request.body);
  if (!body) return reply(error_response(body.failure()));
  auto req = parse_port_request(*body, PortRequestKind::kSockets);
  if (!req) return reply(error_response(req.failure()));
  // Only for a route the proxy already opened (and so authorized): by id, never by name, so a name given
  // to a new sandbox cannot refill an old entry.
  auto spares = node_->spare_sockets(req->ref, req->port, req->sockets);
  if (!spares) return reply(error_response(spares.failure()));
  ordered_json j = {{"id", req->ref},
                    {"port", req->port},
                    {"count", spares->fds.size()},
                    {"connect_port", spares->connect_port},
                    {"opened_at", spares->opened_at},
                    {"cache_ms", spares->cache_ms},
                    {"token_sha256", spares->token_sha256},
                    {"operator_token_sha256", node_->operator_token_sha256()},
                    {"netns", spares->netns.valid()}};
  if (spares->netns.valid()) spares->fds.push_back(std::move(spares->netns));  // after the `count` spares
  reply(Response{200, to_text(j), std::move(spares->fds), ""});
}

void ApiServer::handle_lookup(const HttpMessage& request, bool is_unix, Reply& reply) {
  // Internal like open: it tells which ports need no token, which is the proxy's business only.
  if (!is_unix) return reply(invalid("internal/lookup is served on the unix socket only"));
  auto body = parse_object(request.body);
  if (!body) return reply(error_response(body.failure()));
  auto req = parse_port_request(*body, PortRequestKind::kLookup);
  if (!req) return reply(error_response(req.failure()));
  auto access = node_->lookup(req->ref, req->port);
  if (!access) return reply(error_response(access.failure()));
  ordered_json j = {{"id", access->id},
                    {"name", access->name.empty() ? ordered_json(nullptr) : ordered_json(access->name)},
                    {"port", access->port},
                    {"protocol", protocol_name(access->protocol)},
                    {"public", access->is_public}};
  if (req->prewake) {
    Node::PrewakeOutcome woke = node_->prewake(access->id, req->port, req->client);
    j["prewake"] = woke == Node::PrewakeOutcome::kWoke        ? "woke"
                   : woke == Node::PrewakeOutcome::kRefused   ? "refused"
                   : woke == Node::PrewakeOutcome::kNotAsleep ? "not_asleep"
                                                              : "unavailable";
  }
  reply(Response{200, to_text(j), {}, ""});
}

void ApiServer::handle_activity(const HttpMessage& request, Reply& reply) {
  auto reports = parse_activity(request.body);
  if (!reports) return reply(error_response(reports.failure()));
  ActivityAnswer answer = node_->activity(*reports);
  ordered_json asleep = ordered_json::array(), revoked = ordered_json::array(), closed = ordered_json::array();
  for (const AsleepSandbox& a : answer.asleep) asleep.push_back({{"id", a.id}, {"suspended_at", a.suspended_at}});
  for (const RevokedToken& r : answer.revoked) revoked.push_back({{"id", r.id}, {"rotated_at", r.rotated_at}});
  for (const ClosedPort& c : answer.closed)
    closed.push_back({{"id", c.id}, {"port", c.port}, {"closed_at", c.closed_at}});
  reply(Response{200,
                 to_text(ordered_json{
                     {"asleep", std::move(asleep)}, {"revoked", std::move(revoked)}, {"closed", std::move(closed)}}),
                 {}, ""});
}

}  // namespace sg
