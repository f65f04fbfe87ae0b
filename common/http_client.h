// The HTTP/1.1 client pieces every sandgate client shares: the proxy's node client (async, libuv), the
// Firecracker / Cloud Hypervisor API client (async, libuv) and the CLI's API client (blocking, plain or TLS).
// Each of them sends one request per connection ("Connection: close") and reads one answer, so this is
// deliberately no more than that:
//   - build_http_request: the exact request bytes, refusing anything that could split a line (CR, LF, NUL)
//     or bust an explicit size limit, so no caller can be tricked into sending a second request or header;
//   - HttpResponseReader: an incremental reader over HttpParser with explicit head and body limits, which
//     names what went wrong (malformed, too large, closed early, timeout, I/O) so each caller can word it;
//   - http_exchange: the blocking send + read with one deadline, poll-based, for the CLI and tests.
// The async clients keep their own event-loop plumbing and use the first two.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/http.h"

namespace sg {

struct HttpRequestLimits {
  // The request line plus the headers. Our servers (node API, VMM APIs) refuse heads over 16 KiB.
  size_t max_head_bytes = 16 * 1024;
  // A request-target is a path with a short query; anything longer is a caller's bug, not a request.
  size_t max_target_bytes = 8 * 1024;
  // The node API refuses bodies over 1 MiB (noderuntime/api_server.cc), so there is no point sending more.
  size_t max_body_bytes = 1024 * 1024;
};

struct HttpRequest {
  std::string_view method = {};  // a token: "GET", "PUT", ...
  std::string_view target = {};  // origin-form, "/v1/sandboxes?x=1"
  std::string_view host = {};    // the Host header's value (always sent: HTTP/1.1 requires it)
  // Sent in this order after Host. Host, Content-Length and Transfer-Encoding are the builder's own and
  // refused here, so the framing cannot be contradicted.
  std::vector<HttpHeader> headers = {};
  std::string_view body = {};
  // Content-Length is sent whenever there is a body. Some servers (both VMMs on PUT/PATCH, the node on
  // POST) want it even for an empty body; RFC 9110 advises against it only where no body is expected.
  bool content_length_when_empty = true;
};

// The request's bytes, or kInvalidArgument (CR/LF/NUL or other control bytes in the method, target, Host,
// a header name or value; a method or name that is not a token; an empty target; a header the builder owns)
// or kLimitExceeded (target, head or body over `limits`).
Result<std::string> build_http_request(const HttpRequest& request, const HttpRequestLimits& limits = {});

struct HttpResponseLimits {
  size_t max_head_bytes = 16 * 1024;
  size_t max_body_bytes = 1024 * 1024;
};

// Why reading an answer failed. The Failure's code follows it: kInvalidArgument (malformed), kLimitExceeded
// (too large), kUnavailable (closed early), kTimeout, kIo.
enum class HttpResponseError {
  kNone,
  kMalformed,             // not an HTTP/1.x answer, or its framing is broken
  kHeadTooLarge,
  kBodyTooLarge,
  kClosedBeforeResponse,  // the peer closed (or reset) before sending a single byte
  kClosedMidResponse,     // the peer closed after part of the answer
  kTimeout,
  kIo,                    // a system call failed
};

// Reads one response, fed as the bytes arrive (any split: byte by byte works). Interim 1xx answers (100
// Continue, 103 Early Hints) are skipped: the final answer is the one that counts. Chunked bodies are
// decoded; a body delimited by the connection's end completes at finish().
class HttpResponseReader {
 public:
  enum class State { kNeedMore, kComplete, kError };

  explicit HttpResponseReader(HttpResponseLimits limits = {});

  // The next bytes from the peer. Bytes after the complete answer are ignored (one answer per connection).
  State feed(const char* data, size_t len);
  State feed(std::string_view s) { return feed(s.data(), s.size()); }
  // The peer closed its side: completes an answer delimited by the close, otherwise an error.
  State finish();
  // Ends the read with `error` (a timeout or an I/O failure seen by the caller); `detail` is the message.
  State fail_with(HttpResponseError error, std::string detail);

  State state() const { return state_; }
  // True once any byte arrived: tells "closed without answering" from "closed mid-answer".
  bool started() const { return bytes_ > 0; }
  // The answer, complete in kComplete.
  HttpMessage& message() { return parser_.message(); }
  const HttpMessage& message() const { return parser_.message(); }
  // Valid in kError.
  HttpResponseError error() const { return error_; }
  const Failure& failure() const { return failure_; }

 private:
  State fail_parse();

  HttpResponseLimits limits_;
  HttpParser parser_;
  State state_ = State::kNeedMore;
  HttpResponseError error_ = HttpResponseError::kNone;
  Failure failure_{Error::kInternal, {}};
  size_t bytes_ = 0;
  size_t message_bytes_ = 0;       // of the answer being parsed
  size_t interim_head_bytes_ = 0;  // skipped 1xx answers, together bounded by max_head_bytes
};

using HttpDeadline = std::chrono::steady_clock::time_point;

// Milliseconds left until `deadline` (for poll), 0 once it passed.
int remaining_ms(HttpDeadline deadline);
// Waits until `fd` has `events` or the deadline passes (kTimeout, "timed out <what>"). Shared with the CLI's
// TLS code, whose handshake and records wait on the same socket the same way.
Status wait_fd(int fd, short events, HttpDeadline deadline, std::string_view what);

// A connection's bytes, for http_exchange: plain (http_fd_stream) or anything else, such as the CLI's TLS.
// Both honour the caller's deadline and fail with kTimeout past it; read_some returns 0 at the stream's end.
// A peer that closed or reset while being written to is kUnavailable (its answer, if any, is then unread).
struct HttpByteStream {
  std::function<Status(std::string_view)> write_all = {};
  std::function<Result<size_t>(char*, size_t)> read_some = {};
};

// Poll-based, non-blocking I/O on a connected socket, bounded by `deadline`. MSG_NOSIGNAL: a peer that went
// away is an error, never a SIGPIPE.
HttpByteStream http_fd_stream(int fd, HttpDeadline deadline);

// Sends `request` (built by build_http_request) and reads one answer into `reader`. Returns the reader's
// failure (or the stream's, recorded in the reader as kTimeout, kIo or kClosedBeforeResponse); on success
// reader.message() is the answer.
Status http_exchange(const HttpByteStream& stream, std::string_view request, HttpResponseReader& reader);
// The same on a connected socket `fd`, everything done by `deadline`.
Status http_exchange(int fd, std::string_view request, HttpResponseReader& reader, HttpDeadline deadline);

}  // namespace sg
