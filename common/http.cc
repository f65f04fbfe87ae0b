#include "common/http.h"

#include <llhttp.h>
#include <strings.h>

#include <algorithm>

namespace sg {

const std::string* find_header(std::span<const HttpHeader> headers, std::string_view name) {
  for (const auto& h : headers)
    if (h.name.size() == name.size() && strncasecmp(h.name.data(), name.data(), name.size()) == 0) return &h.value;
  return nullptr;
}

const std::string* HttpMessage::header(std::string_view name) const { return find_header(headers, name); }

struct HttpParser::Impl {
  llhttp_t parser;
  llhttp_settings_t settings;
  HttpParser* self;

  static HttpParser* of(llhttp_t* p) { return static_cast<Impl*>(p->data)->self; }

  static int on_url(llhttp_t* p, const char* at, size_t len) {
    of(p)->msg_.target.append(at, len);
    return 0;
  }
  static int on_method(llhttp_t* p, const char* at, size_t len) {
    of(p)->msg_.method.append(at, len);
    return 0;
  }
  static int on_header_field(llhttp_t* p, const char* at, size_t len) {
    HttpParser* self = of(p);
    if (self->last_was_value_ || self->msg_.headers.empty()) self->msg_.headers.push_back({});
    self->last_was_value_ = false;
    self->msg_.headers.back().name.append(at, len);
    return 0;
  }
  static int on_header_value(llhttp_t* p, const char* at, size_t len) {
    HttpParser* self = of(p);
    self->last_was_value_ = true;
    self->msg_.headers.back().value.append(at, len);
    return 0;
  }
  static int on_headers_complete(llhttp_t* p) {
    HttpParser* self = of(p);
    self->in_head_ = false;
    self->msg_.http_major = llhttp_get_http_major(p);
    self->msg_.http_minor = llhttp_get_http_minor(p);
    self->msg_.status = llhttp_get_status_code(p);
    self->msg_.upgrade = llhttp_get_upgrade(p) != 0;
    self->msg_.keep_alive = llhttp_should_keep_alive(p) != 0;
    if (self->limits_.stop_after_head) return HPE_PAUSED;
    return 0;
  }
  static int on_body(llhttp_t* p, const char* at, size_t len) {
    HttpParser* self = of(p);
    if (self->msg_.body.size() + len > self->limits_.max_body_bytes) {
      self->failure_ = fail(Error::kLimitExceeded,
                            "body exceeds " + std::to_string(self->limits_.max_body_bytes) + " bytes");
      return HPE_USER;
    }
    self->msg_.body.append(at, len);
    return 0;
  }
  static int on_message_complete(llhttp_t* p) {
    of(p)->state_ = State::kMessageComplete;
    return HPE_PAUSED;  // one message per feed() so callers see pipelined requests one at a time
  }
};

HttpParser::HttpParser(Kind kind, HttpLimits limits) : impl_(std::make_unique<Impl>()), limits_(limits) {
  llhttp_settings_init(&impl_->settings);
  impl_->settings.on_url = Impl::on_url;
  impl_->settings.on_method = Impl::on_method;
  impl_->settings.on_header_field = Impl::on_header_field;
  impl_->settings.on_header_value = Impl::on_header_value;
  impl_->settings.on_headers_complete = Impl::on_headers_complete;
  impl_->settings.on_body = Impl::on_body;
  impl_->settings.on_message_complete = Impl::on_message_complete;
  llhttp_init(&impl_->parser, kind == Kind::kRequest ? HTTP_REQUEST : HTTP_RESPONSE, &impl_->settings);
  impl_->parser.data = impl_.get();
  impl_->self = this;
}

HttpParser::~HttpParser() = default;

void HttpParser::reset() {
  llhttp_reset(&impl_->parser);
  msg_ = HttpMessage{};
  state_ = State::kNeedMore;
  consumed_ = 0;
  head_bytes_ = 0;
  in_head_ = true;
  last_was_value_ = false;
}

HttpParser::State HttpParser::feed(const char* data, size_t len) {
  consumed_ = 0;
  if (state_ == State::kError || state_ == State::kMessageComplete || state_ == State::kHeadComplete) return state_;
  auto head_too_large = [this] {
    failure_ = fail(Error::kLimitExceeded, "head exceeds " + std::to_string(limits_.max_head_bytes) + " bytes");
    state_ = State::kError;
    return state_;
  };
  for (;;) {
    const char* at = data + consumed_;
    const size_t rest = len - consumed_;
    // Bound the head before llhttp sees it: while in the head, only what is left of max_head_bytes is parsed,
    // so a head of exactly the limit passes and one byte more is refused, however the bytes are split.
    const size_t to_parse = in_head_ ? std::min(rest, limits_.max_head_bytes - head_bytes_) : rest;
    if (to_parse == 0) return head_too_large();  // still in the head, the limit used up, and more bytes came
    llhttp_errno_t err = llhttp_execute(&impl_->parser, at, to_parse);
    const char* stop = err == HPE_OK ? at + to_parse : llhttp_get_error_pos(&impl_->parser);
    const size_t used = static_cast<size_t>(stop - at);
    consumed_ += used;
    if (in_head_) head_bytes_ += used;
    if (err == HPE_PAUSED) {
      llhttp_resume(&impl_->parser);
      if (state_ != State::kMessageComplete) state_ = State::kHeadComplete;
      return state_;
    }
    if (err == HPE_PAUSED_UPGRADE) {
      llhttp_resume_after_upgrade(&impl_->parser);
      state_ = State::kMessageComplete;
      return state_;
    }
    if (err != HPE_OK) {
      if (err != HPE_USER)
        failure_ = fail(Error::kInvalidArgument,
                        std::string("malformed HTTP: ") + llhttp_get_error_reason(&impl_->parser));
      state_ = State::kError;
      return state_;
    }
    if (consumed_ == len) return state_;
    // Only the head bound stops short of the chunk's end. If the head ended inside the bounded part, the rest
    // of the chunk is body (or the next message) and is parsed too; otherwise the loop refuses the head.
  }
}

HttpParser::State HttpParser::finish() {
  if (state_ != State::kNeedMore) return state_;
  llhttp_errno_t err = llhttp_finish(&impl_->parser);
  if (state_ == State::kMessageComplete) return state_;
  if (err != HPE_OK && err != HPE_PAUSED) {
    failure_ = fail(Error::kInvalidArgument, "connection closed mid-message");
    state_ = State::kError;
  } else {
    failure_ = fail(Error::kInvalidArgument, "connection closed before a complete message");
    state_ = State::kError;
  }
  return state_;
}

std::string_view http_reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 301: return "Moved Permanently";
    case 302: return "Found";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 421: return "Misdirected Request";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
  }
}

}  // namespace sg
