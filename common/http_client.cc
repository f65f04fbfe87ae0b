#include "common/http_client.h"

#include <poll.h>
#include <strings.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace sg {
namespace {

// RFC 9110 tchar: what a method or a header name may consist of.
bool is_token(std::string_view s) {
  static constexpr std::string_view kSpecials = "!#$%&'*+-.^_`|~";
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           kSpecials.find(static_cast<char>(c)) != std::string_view::npos;
  });
}

// A header value: visible bytes, spaces and tabs (obs-text allowed). CR and LF would end the line and let
// the rest forge headers or a second request; NUL and the other controls are refused by servers anyway.
bool is_field_value(std::string_view s) {
  return std::none_of(s.begin(), s.end(), [](unsigned char c) { return (c < 0x20 && c != '\t') || c == 0x7f; });
}

// A request-target: visible ASCII only, no spaces (a space would end the target and start a forged version).
bool is_target(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return c > 0x20 && c < 0x7f; });
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && strncasecmp(a.data(), b.data(), a.size()) == 0;
}

Failure invalid(std::string what) { return fail(Error::kInvalidArgument, "cannot build the request: " + what); }

Error code_of(HttpResponseError e) {
  switch (e) {
    case HttpResponseError::kMalformed: return Error::kInvalidArgument;
    case HttpResponseError::kHeadTooLarge:
    case HttpResponseError::kBodyTooLarge: return Error::kLimitExceeded;
    case HttpResponseError::kClosedBeforeResponse:
    case HttpResponseError::kClosedMidResponse: return Error::kUnavailable;
    case HttpResponseError::kTimeout: return Error::kTimeout;
    case HttpResponseError::kIo: return Error::kIo;
    case HttpResponseError::kNone: break;
  }
  return Error::kInternal;
}

}  // namespace

Result<std::string> build_http_request(const HttpRequest& r, const HttpRequestLimits& limits) {
  if (!is_token(r.method)) return invalid("the method is not an HTTP token");
  if (r.target.size() > limits.max_target_bytes)
    return fail(Error::kLimitExceeded, "request target exceeds " + std::to_string(limits.max_target_bytes) + " bytes");
  if (!is_target(r.target)) return invalid("the target is empty or holds spaces or control bytes");
  if (r.host.empty() || !is_field_value(r.host)) return invalid("the Host is empty or holds control bytes");
  if (r.body.size() > limits.max_body_bytes)
    return fail(Error::kLimitExceeded, "request body exceeds " + std::to_string(limits.max_body_bytes) + " bytes");
  for (const HttpHeader& h : r.headers) {
    if (!is_token(h.name)) return invalid("a header name is empty or not an HTTP token");
    if (!is_field_value(h.value)) return invalid("the value of header " + h.name + " holds control bytes");
    if (iequals(h.name, "Host") || iequals(h.name, "Content-Length") || iequals(h.name, "Transfer-Encoding"))
      return invalid("header " + h.name + " is set by the request builder itself");
  }
  std::string out;
  out.reserve(128 + r.target.size() + r.body.size());
  out.append(r.method).append(" ").append(r.target).append(" HTTP/1.1\r\n");
  out.append("Host: ").append(r.host).append("\r\n");
  for (const HttpHeader& h : r.headers) out.append(h.name).append(": ").append(h.value).append("\r\n");
  if (!r.body.empty() || r.content_length_when_empty)
    out.append("Content-Length: ").append(std::to_string(r.body.size())).append("\r\n");
  out.append("\r\n");
  if (out.size() > limits.max_head_bytes)
    return fail(Error::kLimitExceeded, "request head exceeds " + std::to_string(limits.max_head_bytes) + " bytes");
  out.append(r.body);
  return out;
}

HttpResponseReader::HttpResponseReader(HttpResponseLimits limits)
    : limits_(limits), parser_(HttpParser::Kind::kResponse, HttpLimits{limits.max_head_bytes, limits.max_body_bytes, false}) {}

HttpResponseReader::State HttpResponseReader::fail_with(HttpResponseError error, std::string detail) {
  if (state_ != State::kNeedMore) return state_;
  error_ = error;
  failure_ = fail(code_of(error), std::move(detail));
  state_ = State::kError;
  return state_;
}

HttpResponseReader::State HttpResponseReader::fail_parse() {
  const Failure& f = parser_.failure();
  if (f.code != Error::kLimitExceeded) return fail_with(HttpResponseError::kMalformed, "malformed answer: " + f.message);
  if (parser_.head_done())
    return fail_with(HttpResponseError::kBodyTooLarge,
                     "the answer's body exceeds " + std::to_string(limits_.max_body_bytes) + " bytes");
  return fail_with(HttpResponseError::kHeadTooLarge,
                   "the answer's head exceeds " + std::to_string(limits_.max_head_bytes) + " bytes");
}

HttpResponseReader::State HttpResponseReader::feed(const char* data, size_t len) {
  if (state_ != State::kNeedMore || len == 0) return state_;
  bytes_ += len;
  for (;;) {
    HttpParser::State st = parser_.feed(data, len);
    message_bytes_ += parser_.consumed();
    if (st == HttpParser::State::kError) return fail_parse();
    if (st != HttpParser::State::kMessageComplete) return state_;
    const int status = parser_.message().status;
    // 101 is final for us (we never ask to upgrade, so whoever sends it is not the server we want to talk to).
    if (status < 100 || status >= 200 || status == 101) {
      state_ = State::kComplete;
      return state_;
    }
    // An interim answer: skip it and read on. Their heads count against the head limit together, so a peer
    // cannot keep us reading forever with an endless stream of 1xx lines.
    interim_head_bytes_ += message_bytes_;
    message_bytes_ = 0;
    if (interim_head_bytes_ > limits_.max_head_bytes)
      return fail_with(HttpResponseError::kHeadTooLarge, "interim (1xx) answers exceed " +
                                                              std::to_string(limits_.max_head_bytes) + " bytes");
    const size_t used = parser_.consumed();
    parser_.reset();
    data += used;
    len -= used;
    if (len == 0) return state_;
  }
}

HttpResponseReader::State HttpResponseReader::finish() {
  if (state_ != State::kNeedMore) return state_;
  if (!started()) return fail_with(HttpResponseError::kClosedBeforeResponse, "the connection closed without an answer");
  if (parser_.finish() == HttpParser::State::kMessageComplete) {
    state_ = State::kComplete;
    return state_;
  }
  return fail_with(HttpResponseError::kClosedMidResponse, "the connection closed before the answer was complete");
}

int remaining_ms(HttpDeadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return left.count() > 0 ? static_cast<int>(std::min<long long>(left.count(), INT_MAX)) : 0;
}

Status wait_fd(int fd, short events, HttpDeadline deadline, std::string_view what) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return {};
    if (n == 0) return fail(Error::kTimeout, "timed out " + std::string(what));
    if (errno != EINTR) return fail_errno("poll", errno);
  }
}

HttpByteStream http_fd_stream(int fd, HttpDeadline deadline) {
  HttpByteStream s;
  s.write_all = [fd, deadline](std::string_view data) -> Status {
    while (!data.empty()) {
      if (auto ready = wait_fd(fd, POLLOUT, deadline, "sending the request"); !ready) return ready;
      ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        if (errno == EPIPE || errno == ECONNRESET)
          return fail(Error::kUnavailable, "the connection closed before the request was sent");
        return fail_errno("send", errno);
      }
      data.remove_prefix(static_cast<size_t>(n));
    }
    return {};
  };
  s.read_some = [fd, deadline](char* buf, size_t cap) -> Result<size_t> {
    for (;;) {
      if (auto ready = wait_fd(fd, POLLIN, deadline, "waiting for the answer"); !ready) return ready.failure();
      ssize_t n = ::recv(fd, buf, cap, MSG_DONTWAIT);
      if (n >= 0) return static_cast<size_t>(n);
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      if (errno == ECONNRESET) return fail(Error::kUnavailable, "the connection was reset");
      return fail_errno("recv", errno);
    }
  };
  return s;
}

Status http_exchange(const HttpByteStream& stream, std::string_view request, HttpResponseReader& reader) {
  // A stream failure becomes the reader's, so callers look in one place for what went wrong.
  auto record = [&reader](const Failure& f) {
    HttpResponseError e = f.code == Error::kTimeout       ? HttpResponseError::kTimeout
                          : f.code != Error::kUnavailable ? HttpResponseError::kIo
                          : reader.started()              ? HttpResponseError::kClosedMidResponse
                                                          : HttpResponseError::kClosedBeforeResponse;
    reader.fail_with(e, f.message);
  };
  Status sent = stream.write_all(request);
  // A server may answer (413, say) and close before reading all of the request: its answer is still worth
  // reading. Any other failure to send ends the exchange.
  if (!sent && sent.error() != Error::kUnavailable) {
    record(sent.failure());
    return reader.failure();
  }
  char buf[16 * 1024];
  while (reader.state() == HttpResponseReader::State::kNeedMore) {
    auto n = stream.read_some(buf, sizeof buf);
    if (!n) {
      record(!sent && !reader.started() ? sent.failure() : n.failure());
    } else if (*n == 0) {
      if (!sent && !reader.started()) record(sent.failure());
      reader.finish();
    } else {
      reader.feed(buf, *n);
    }
  }
  if (reader.state() == HttpResponseReader::State::kComplete) return {};
  return reader.failure();
}

Status http_exchange(int fd, std::string_view request, HttpResponseReader& reader, HttpDeadline deadline) {
  return http_exchange(http_fd_stream(fd, deadline), request, reader);
}

}  // namespace sg
