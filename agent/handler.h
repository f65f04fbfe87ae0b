// The seam between the transports (HTTP/1.1 and h2c) and the endpoints. A transport parses a request head,
// asks the Router for a Handler, feeds it the request body and gives it a Responder to answer through. The
// endpoints never see which protocol carries them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/http.h"

namespace sg::agent {

struct Request {
  std::string method;
  std::string target;           // path and query, as sent
  int64_t content_length = -1;  // -1: not announced (chunked, or h2 without content-length)
  std::string content_type;     // as sent; empty when absent
};

// A response whose queued bytes exceed the high mark asks its handler to stop producing (a handler checks
// queued_bytes() after writing); Handler::on_drain() says the queue fell below the low mark again.
constexpr size_t kHighWatermark = 256 * 1024;
constexpr size_t kLowWatermark = 64 * 1024;

class Responder {
 public:
  virtual ~Responder() = default;
  // content_length < 0: the length is not known and the body is streamed (chunked on HTTP/1.1).
  virtual void start(int status, std::vector<HttpHeader> headers, int64_t content_length) = 0;
  // Takes a copy; the bytes leave as soon as the connection can take them.
  virtual void write(std::string_view data) = 0;
  virtual void end() = 0;
  // The response cannot be completed (e.g. a file shrank under a Content-Length): the client must see a
  // broken message, not a short one. HTTP/1.1 closes the connection, h2 resets the stream.
  virtual void abandon() = 0;
  // Bytes accepted by write() that the kernel has not taken yet.
  virtual size_t queued_bytes() const = 0;
  virtual bool started() const = 0;

  // A whole response in one call.
  void respond(int status, std::vector<HttpHeader> headers, std::string_view body);
  // {"error":"<error_name>","message":"..."} as application/json.
  void respond_error(int status, Error code, std::string_view message, std::vector<HttpHeader> headers = {});
};

// Destroying a handler before its response ended cancels its work (an exec's process group is killed, a
// partial upload removed): that is how transports report a client that went away.
class Handler {
 public:
  virtual ~Handler() = default;
  virtual void on_body(std::string_view data) { (void)data; }
  virtual void on_body_end() {}
  virtual void on_drain() {}
};

}  // namespace sg::agent
