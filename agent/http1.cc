// HTTP/1.1: one exchange at a time per connection. Pipelined requests wait (buffered, bounded) until the
// response before them has ended; a streamed response uses the chunked coding.
#include <strings.h>

#include <charconv>
#include <optional>

#include "agent/body_decoder.h"
#include "agent/connection.h"

namespace sg::agent {
namespace {

// Input read ahead of the current exchange (pipelined requests, or a body being uploaded faster than it
// is written) beyond which the socket is not read, so TCP pushes back on the client.
constexpr size_t kMaxBufferedInput = 256 * 1024;

bool ends_with_chunked(std::string_view te) {
  while (!te.empty() && (te.back() == ' ' || te.back() == '\t')) te.remove_suffix(1);
  constexpr std::string_view kChunked = "chunked";
  return te.size() >= kChunked.size() &&
         strncasecmp(te.data() + te.size() - kChunked.size(), kChunked.data(), kChunked.size()) == 0;
}

class Http1Protocol : public Protocol, private Responder {
 public:
  explicit Http1Protocol(Connection& conn)
      : conn_(conn), parser_(HttpParser::Kind::kRequest, HttpLimits{conn.limits().max_head_bytes, 0, true}) {}

  void on_input(std::string_view data) override {
    in_.append(data);
    process();
  }

  // A client that stops sending mid-exchange has gone away (a half-close is taken as a close, as Go's
  // net/http does): the running command is killed instead of waiting for output that nobody reads.
  void on_eof() override {
    peer_eof_ = true;
    if (handler_ != nullptr && !response_ended_) return conn_.close_now();
    process();
  }

  void on_written() override {
    if (drain_wanted_ && handler_ != nullptr && queued_bytes() < kLowWatermark) {
      drain_wanted_ = false;
      handler_->on_drain();
    }
    process();
  }

  void on_soon() override {
    if (abandoned_) return conn_.close_now();
    process();
  }

  void on_close() override {
    handler_.reset();
    phase_ = Phase::kDone;
  }

 private:
  enum class Phase { kHead, kBody, kAwaitResponse, kDone };

  // ---- Responder ----
  void start(int status, std::vector<HttpHeader> headers, int64_t content_length) override {
    response_started_ = true;
    // Answered before the request body was read: the rest of it is never read, so the connection ends.
    if (body_ && !body_->done()) close_after_ = true;
    chunked_ = content_length < 0 && !http10_;
    if (content_length < 0 && http10_) close_after_ = true;  // the body ends where the connection does
    std::string head = "HTTP/1.1 " + std::to_string(status) + " " + std::string(http_reason(status)) + "\r\n";
    for (const HttpHeader& h : headers) head += h.name + ": " + h.value + "\r\n";
    if (content_length >= 0 && status != 204) head += "Content-Length: " + std::to_string(content_length) + "\r\n";
    if (chunked_) head += "Transfer-Encoding: chunked\r\n";
    if (close_after_)
      head += "Connection: close\r\n";
    else if (http10_)
      head += "Connection: keep-alive\r\n";
    head += "\r\n";
    conn_.write(std::move(head));
  }

  void write(std::string_view data) override {
    if (data.empty()) return;
    if (!chunked_) {
      conn_.write(std::string(data));
    } else {
      char size[20];
      auto [end, ec] = std::to_chars(size, size + sizeof size, data.size(), 16);
      std::string chunk(size, end);
      chunk.reserve(chunk.size() + data.size() + 4);
      chunk += "\r\n";
      chunk += data;
      chunk += "\r\n";
      conn_.write(std::move(chunk));
    }
    if (queued_bytes() > kHighWatermark) drain_wanted_ = true;
  }

  void end() override {
    if (chunked_) conn_.write("0\r\n\r\n");
    response_ended_ = true;
    conn_.schedule();
  }

  void abandon() override {
    abandoned_ = true;
    response_ended_ = true;
    phase_ = Phase::kDone;
    conn_.schedule();
  }

  size_t queued_bytes() const override { return conn_.write_queue_bytes(); }
  bool started() const override { return response_started_; }

  // ---- exchanges ----
  void process() {
    if (processing_) return;  // a handler answered synchronously; the loop below picks that up
    processing_ = true;
    while (!conn_.closing() && phase_ != Phase::kDone) {
      if (phase_ == Phase::kHead) {
        HttpParser::State st = in_.empty() ? HttpParser::State::kNeedMore : parser_.feed(in_);
        size_t used = in_.empty() ? 0 : parser_.consumed();
        in_.erase(0, used);
        if (st == HttpParser::State::kError) {
          reply_parse_error();
        } else if (st == HttpParser::State::kHeadComplete) {
          begin_request();
        } else if (used == 0) {
          // A request cut short by EOF is dropped: requests are never delimited by the connection's end.
          if (peer_eof_) finish_connection();
          break;
        }
      } else if (phase_ == Phase::kBody) {
        if (response_ended_) {
          phase_ = Phase::kAwaitResponse;
          continue;
        }
        if (in_.empty()) break;
        auto used = body_->decode(in_, [this](std::string_view chunk) { handler_->on_body(chunk); });
        if (!used) {
          close_after_ = true;
          phase_ = Phase::kAwaitResponse;
          if (!response_started_) respond_error(400, used.error(), used.message());
          if (!response_ended_) abandon();
          continue;
        }
        in_.erase(0, *used);
        if (body_->done()) {
          phase_ = Phase::kAwaitResponse;
          handler_->on_body_end();
        }
      } else {  // kAwaitResponse
        if (!response_ended_) break;
        if (close_after_) {
          finish_connection();
          break;
        }
        next_exchange();
      }
    }
    processing_ = false;
    if (!conn_.closing()) conn_.set_reading(in_.size() < kMaxBufferedInput);
  }

  void begin_request() {
    HttpMessage& m = parser_.message();
    Request request{m.method, m.target, -1, {}};
    http10_ = m.http_major == 1 && m.http_minor == 0;
    // Every answer has a body, which a HEAD client would not read; closing keeps it from being taken for
    // the next response.
    close_after_ = !m.keep_alive || m.method == "HEAD";
    if (const std::string* te = m.header("Transfer-Encoding")) {
      if (!ends_with_chunked(*te)) {
        body_.reset();
        close_after_ = true;
        handler_ = std::make_unique<Handler>();
        phase_ = Phase::kAwaitResponse;
        return respond_error(400, Error::kInvalidArgument, "Transfer-Encoding must end with chunked");
      }
      body_ = BodyDecoder::chunked();
    } else if (const std::string* cl = m.header("Content-Length")) {
      uint64_t length = 0;
      std::from_chars(cl->data(), cl->data() + cl->size(), length);  // llhttp has checked the syntax
      request.content_length = static_cast<int64_t>(length);
      body_ = BodyDecoder::fixed(length);
    } else {
      body_ = BodyDecoder::fixed(0);
    }
    if (const std::string* ct = m.header("Content-Type")) request.content_type = *ct;
    phase_ = body_->done() ? Phase::kAwaitResponse : Phase::kBody;
    handler_ = conn_.router().route(request, *this);
    const std::string* expect = m.header("Expect");
    // curl waits up to a second for this before sending a body it announced with Expect.
    if (phase_ == Phase::kBody && !response_started_ && expect != nullptr && !http10_ &&
        strcasecmp(expect->c_str(), "100-continue") == 0)
      conn_.write("HTTP/1.1 100 Continue\r\n\r\n");
    if (phase_ == Phase::kAwaitResponse) handler_->on_body_end();
  }

  void reply_parse_error() {
    const Failure& f = parser_.failure();
    body_.reset();
    close_after_ = true;  // the stream position is lost; nothing after this can be parsed
    handler_ = std::make_unique<Handler>();
    phase_ = Phase::kAwaitResponse;
    respond_error(f.code == Error::kLimitExceeded ? 431 : 400, f.code, f.message);
  }

  void next_exchange() {
    handler_.reset();
    body_.reset();
    parser_.reset();
    response_started_ = response_ended_ = chunked_ = drain_wanted_ = false;
    phase_ = Phase::kHead;
  }

  void finish_connection() {
    handler_.reset();
    phase_ = Phase::kDone;
    conn_.end_after_writes();
  }

  Connection& conn_;
  HttpParser parser_;
  std::string in_;  // read, not yet parsed
  Phase phase_ = Phase::kHead;
  std::optional<BodyDecoder> body_;
  std::unique_ptr<Handler> handler_;
  bool http10_ = false;
  bool close_after_ = false;
  bool response_started_ = false;
  bool response_ended_ = false;
  bool chunked_ = false;
  bool drain_wanted_ = false;
  bool abandoned_ = false;
  bool peer_eof_ = false;
  bool processing_ = false;
};

}  // namespace

std::unique_ptr<Protocol> make_http1(Connection& conn) { return std::make_unique<Http1Protocol>(conn); }

}  // namespace sg::agent
