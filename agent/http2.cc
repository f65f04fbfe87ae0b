// h2c with prior knowledge, on an nghttp2 server session fed from memory (mem_recv / mem_send), so the
// connection keeps the one libuv socket. Every stream is an exchange of its own; nghttp2 enforces the
// SETTINGS we advertise (max concurrent streams, flow control windows).
#include <nghttp2/nghttp2.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>

#include "agent/connection.h"

namespace sg::agent {
namespace {

// Above this much unsent output, nghttp2 is not asked for more frames and the socket is not read: a
// client that stops reading cannot make the agent buffer without bound.
constexpr size_t kMaxQueuedOutput = 1024 * 1024;
constexpr size_t kWriteBatchBytes = 64 * 1024;
// Uploads stream at disk speed: windows this large keep a fast client from stalling on WINDOW_UPDATEs.
constexpr int32_t kStreamWindowBytes = 1024 * 1024;
constexpr int32_t kConnectionWindowBytes = 16 * 1024 * 1024;
// A request body still to come when the answer is already sent is read and dropped up to this size (its
// declared length); a larger or unbounded one is stopped with RST_STREAM (on_frame_send).
constexpr size_t kDiscardedBodyBytes = 64 * 1024;
// RFC 9113 §6.5.2: each header field counts its name, its value and 32 bytes of overhead.
constexpr size_t kHeaderFieldOverhead = 32;

class Http2Protocol : public Protocol {
 public:
  explicit Http2Protocol(Connection& conn);
  ~Http2Protocol() override;

  void on_input(std::string_view data) override;
  void on_eof() override { conn_.close_now(); }  // h2 clients do not half-close; this one is gone
  void on_written() override { flush(); }
  void on_soon() override { flush(); }
  void on_close() override;

 private:
  struct Stream : Responder {
    Stream(Http2Protocol& owner, int32_t id) : owner(owner), id(id) {}
    void start(int status, std::vector<HttpHeader> headers, int64_t content_length) override;
    void write(std::string_view data) override;
    void end() override;
    void abandon() override;
    size_t queued_bytes() const override { return out.size() - out_offset; }
    bool started() const override { return response_started; }
    void resume();

    Http2Protocol& owner;
    int32_t id;
    std::string method, path;
    int64_t content_length = -1;
    std::string content_type;
    size_t header_bytes = 0;
    bool headers_too_large = false;
    bool request_complete = false;  // END_STREAM received
    std::unique_ptr<Handler> handler;
    std::string out;  // response body queued for DATA frames: out[out_offset..]
    size_t out_offset = 0;
    bool response_started = false;
    bool ended = false;
    bool deferred = false;  // nghttp2 is waiting for resume_data()
    bool drain_wanted = false;
  };

  Stream* stream(int32_t id) {
    return static_cast<Stream*>(nghttp2_session_get_stream_user_data(session_, id));
  }
  void dispatch(Stream& s);
  void request_complete(Stream& s);
  void flush();
  void fail_session(std::string_view why, int error_code);

  static int on_begin_headers(nghttp2_session*, const nghttp2_frame* frame, void* user);
  static int on_header(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen,
                       const uint8_t* value, size_t valuelen, uint8_t flags, void* user);
  static int on_frame_recv(nghttp2_session*, const nghttp2_frame* frame, void* user);
  static int on_data_chunk(nghttp2_session*, uint8_t flags, int32_t id, const uint8_t* data, size_t len, void* user);
  static int on_frame_send(nghttp2_session*, const nghttp2_frame* frame, void* user);
  static int on_stream_close(nghttp2_session*, int32_t id, uint32_t error_code, void* user);
  static ssize_t read_body(nghttp2_session*, int32_t id, uint8_t* buf, size_t length, uint32_t* flags,
                           nghttp2_data_source* source, void* user);

  Connection& conn_;
  nghttp2_session* session_ = nullptr;
  std::map<int32_t, std::unique_ptr<Stream>> streams_;
  std::vector<int32_t> drained_;  // streams whose queue fell below the low mark while frames were made
  bool flushing_ = false;
  bool failed_ = false;
};

Http2Protocol::Http2Protocol(Connection& conn) : conn_(conn) {
  nghttp2_session_callbacks* cbs = nullptr;
  nghttp2_session_callbacks_new(&cbs);
  nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, on_begin_headers);
  nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk);
  nghttp2_session_callbacks_set_on_frame_send_callback(cbs, on_frame_send);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
  nghttp2_session_server_new(&session_, cbs, this);
  nghttp2_session_callbacks_del(cbs);
  const AgentLimits& limits = conn.limits();
  nghttp2_settings_entry settings[] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, static_cast<uint32_t>(kStreamWindowBytes)},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, static_cast<uint32_t>(limits.max_head_bytes)},
  };
  nghttp2_submit_settings(session_, NGHTTP2_FLAG_NONE, settings, std::size(settings));
  nghttp2_session_set_local_window_size(session_, NGHTTP2_FLAG_NONE, 0, kConnectionWindowBytes);
}

Http2Protocol::~Http2Protocol() {
  streams_.clear();  // handlers first: they may still refer to their stream
  nghttp2_session_del(session_);
}

void Http2Protocol::on_input(std::string_view data) {
  if (failed_) return;
  ssize_t rv = nghttp2_session_mem_recv(session_, reinterpret_cast<const uint8_t*>(data.data()), data.size());
  if (rv < 0) return fail_session(nghttp2_strerror(static_cast<int>(rv)), NGHTTP2_PROTOCOL_ERROR);
  flush();
}

void Http2Protocol::on_close() {
  failed_ = true;
  for (auto& [id, s] : streams_) s->handler.reset();
}

// A broken peer (bad preface, protocol violation): GOAWAY, then end the connection once it is sent.
void Http2Protocol::fail_session(std::string_view why, int error_code) {
  std::fprintf(stderr, "sandgate-agent: h2 connection: %.*s\n", static_cast<int>(why.size()), why.data());
  nghttp2_session_terminate_session(session_, static_cast<uint32_t>(error_code));
  flush();
  failed_ = true;
  for (auto& [id, s] : streams_) s->handler.reset();
  conn_.end_after_writes();
}

void Http2Protocol::flush() {
  if (flushing_ || conn_.closing()) return;
  flushing_ = true;
  std::string batch;
  while (conn_.write_queue_bytes() + batch.size() < kMaxQueuedOutput) {
    const uint8_t* data = nullptr;
    ssize_t n = nghttp2_session_mem_send(session_, &data);
    if (n < 0) {
      flushing_ = false;
      return conn_.close_now();
    }
    if (n == 0) break;
    batch.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
    if (batch.size() >= kWriteBatchBytes) conn_.write(std::exchange(batch, {}));
  }
  conn_.write(std::move(batch));
  flushing_ = false;
  if (conn_.closing()) return;
  // Handlers refill their streams; what they write is sent on the next flush, which they schedule.
  for (int32_t id : std::exchange(drained_, {})) {
    auto it = streams_.find(id);
    if (it != streams_.end() && it->second->handler != nullptr) it->second->handler->on_drain();
  }
  if (!failed_ && !nghttp2_session_want_read(session_) && !nghttp2_session_want_write(session_))
    return conn_.end_after_writes();  // GOAWAY exchanged and every stream done
  conn_.set_reading(conn_.write_queue_bytes() < kMaxQueuedOutput);
}

void Http2Protocol::dispatch(Stream& s) {
  if (s.headers_too_large) {
    s.handler = std::make_unique<Handler>();
    return s.respond_error(431, Error::kLimitExceeded,
                           "header list exceeds " + std::to_string(conn_.limits().max_head_bytes) + " bytes");
  }
  s.handler = conn_.router().route(Request{s.method, s.path, s.content_length, s.content_type}, s);
}

void Http2Protocol::request_complete(Stream& s) {
  s.request_complete = true;
  if (s.handler != nullptr) s.handler->on_body_end();
}

int Http2Protocol::on_begin_headers(nghttp2_session*, const nghttp2_frame* frame, void* user) {
  auto* self = static_cast<Http2Protocol*>(user);
  if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
  auto s = std::make_unique<Stream>(*self, frame->hd.stream_id);
  nghttp2_session_set_stream_user_data(self->session_, frame->hd.stream_id, s.get());
  self->streams_[frame->hd.stream_id] = std::move(s);
  return 0;
}

int Http2Protocol::on_header(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen,
                             const uint8_t* value, size_t valuelen, uint8_t, void* user) {
  auto* self = static_cast<Http2Protocol*>(user);
  Stream* s = self->stream(frame->hd.stream_id);
  if (s == nullptr || s->handler != nullptr) return 0;  // trailers carry nothing we use
  s->header_bytes += namelen + valuelen + kHeaderFieldOverhead;
  if (s->header_bytes > self->conn_.limits().max_head_bytes) s->headers_too_large = true;
  if (s->headers_too_large) return 0;
  std::string_view n(reinterpret_cast<const char*>(name), namelen);
  std::string_view v(reinterpret_cast<const char*>(value), valuelen);
  if (n == ":method") {
    s->method = v;
  } else if (n == ":path") {
    s->path = v;
  } else if (n == "content-length") {
    int64_t length = -1;
    std::from_chars(v.data(), v.data() + v.size(), length);  // nghttp2 has checked it is a number
    s->content_length = length;
  } else if (n == "content-type") {
    s->content_type = v;
  }
  return 0;
}

int Http2Protocol::on_frame_recv(nghttp2_session*, const nghttp2_frame* frame, void* user) {
  auto* self = static_cast<Http2Protocol*>(user);
  Stream* s = self->stream(frame->hd.stream_id);
  if (s == nullptr || self->failed_) return 0;
  bool end_stream = (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0;
  if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST) self->dispatch(*s);
  if ((frame->hd.type == NGHTTP2_HEADERS || frame->hd.type == NGHTTP2_DATA) && end_stream) self->request_complete(*s);
  return 0;
}

int Http2Protocol::on_data_chunk(nghttp2_session*, uint8_t, int32_t id, const uint8_t* data, size_t len, void* user) {
  auto* self = static_cast<Http2Protocol*>(user);
  Stream* s = self->stream(id);
  if (s != nullptr && s->handler != nullptr)
    s->handler->on_body(std::string_view(reinterpret_cast<const char*>(data), len));
  return 0;
}

// A response that ended before its request did (an error answered before the upload finished): a large or
// unbounded body is stopped (RST_STREAM(NO_ERROR), RFC 9113 §8.1) instead of received for nobody. A small
// one is read and dropped: clients such as curl 7.88 (Debian 12) report that reset as an error (92) while
// they are still sending, so a 415 would reach them as a failure depending on timing.
int Http2Protocol::on_frame_send(nghttp2_session* session, const nghttp2_frame* frame, void* user) {
  auto* self = static_cast<Http2Protocol*>(user);
  bool end_stream = (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0;
  if (!end_stream || (frame->hd.type != NGHTTP2_DATA && frame->hd.type != NGHTTP2_HEADERS)) return 0;
  Stream* s = self->stream(frame->hd.stream_id);
  if (s == nullptr || s->request_complete) return 0;
  if (s->content_length >= 0 && s->content_length <= static_cast<int64_t>(kDiscardedBodyBytes)) return 0;
  nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, frame->hd.stream_id, NGHTTP2_NO_ERROR);
  return 0;
}

// Closed either way (done, or reset by the client): dropping the handler cancels whatever still runs.
int Http2Protocol::on_stream_close(nghttp2_session*, int32_t id, uint32_t, void* user) {
  static_cast<Http2Protocol*>(user)->streams_.erase(id);
  return 0;
}

ssize_t Http2Protocol::read_body(nghttp2_session*, int32_t, uint8_t* buf, size_t length, uint32_t* flags,
                                 nghttp2_data_source* source, void*) {
  auto* s = static_cast<Stream*>(source->ptr);
  size_t n = std::min(length, s->queued_bytes());
  std::memcpy(buf, s->out.data() + s->out_offset, n);
  s->out_offset += n;
  if (s->out_offset == s->out.size()) {
    s->out.clear();
    s->out_offset = 0;
  } else if (s->out_offset > s->out.size() / 2) {
    s->out.erase(0, s->out_offset);  // amortized: each byte moves at most once
    s->out_offset = 0;
  }
  if (n == 0 && !s->ended) {
    s->deferred = true;
    return NGHTTP2_ERR_DEFERRED;
  }
  if (s->ended && s->queued_bytes() == 0) *flags |= NGHTTP2_DATA_FLAG_EOF;
  if (s->drain_wanted && s->queued_bytes() < kLowWatermark) {
    s->drain_wanted = false;
    s->owner.drained_.push_back(s->id);
  }
  return static_cast<ssize_t>(n);
}

// ---- Stream: the Responder of one exchange ----

void Http2Protocol::Stream::start(int status, std::vector<HttpHeader> headers, int64_t length) {
  response_started = true;
  std::string status_text = std::to_string(status);
  std::string length_text = std::to_string(length);
  for (HttpHeader& h : headers)  // HTTP/2 field names are lowercase (RFC 9113 §8.2.1)
    std::transform(h.name.begin(), h.name.end(), h.name.begin(), [](unsigned char c) { return std::tolower(c); });
  std::vector<nghttp2_nv> nva;
  auto add = [&nva](const std::string& name, const std::string& value) {
    nva.push_back(nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
                             reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(),
                             value.size(), NGHTTP2_NV_FLAG_NONE});
  };
  static const std::string kStatus = ":status", kContentLength = "content-length";
  add(kStatus, status_text);
  for (const HttpHeader& h : headers) add(h.name, h.value);
  if (length >= 0 && status != 204) add(kContentLength, length_text);
  nghttp2_data_provider provider{};
  provider.source.ptr = this;
  provider.read_callback = read_body;
  // No body at all: HEADERS carries END_STREAM.
  bool has_body = length != 0 && status != 204;
  nghttp2_submit_response(owner.session_, id, nva.data(), nva.size(), has_body ? &provider : nullptr);
  owner.conn_.schedule();
}

void Http2Protocol::Stream::write(std::string_view data) {
  out.append(data);
  if (queued_bytes() > kHighWatermark) drain_wanted = true;
  resume();
}

void Http2Protocol::Stream::end() {
  ended = true;
  resume();
}

void Http2Protocol::Stream::abandon() {
  ended = true;
  nghttp2_submit_rst_stream(owner.session_, NGHTTP2_FLAG_NONE, id, NGHTTP2_INTERNAL_ERROR);
  owner.conn_.schedule();
}

void Http2Protocol::Stream::resume() {
  if (deferred) {
    deferred = false;
    nghttp2_session_resume_data(owner.session_, id);
  }
  owner.conn_.schedule();
}

}  // namespace

std::unique_ptr<Protocol> make_http2(Connection& conn) { return std::make_unique<Http2Protocol>(conn); }

}  // namespace sg::agent
