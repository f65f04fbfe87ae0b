// The client -> sandbox direction of an HTTP/1.1 route, after the connection is open: every request head on
// a keep-alive (or pipelining) connection is parsed and put to the connection's check before any of it is
// forwarded, not only the first one. A head that passes is forwarded as the check left it (credentials
// taken out) and re-serialized; bodies (Content-Length or chunked, framing included) pass through unchanged
// as they arrive. A head that is refused stops the direction: neither it nor anything after it reaches the
// sandbox, and the connection answers it once the sandbox has answered the requests before it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/http.h"

namespace sg {

struct Http1Request {
  std::string method;
  std::string target;
  int http_major = 1;
  int http_minor = 1;
  std::vector<HttpHeader> headers;  // names as sent, in order
  bool upgrade = false;             // asks to switch protocols (Upgrade + Connection: upgrade, or CONNECT)

  // First field with this name (case-insensitive), or nullptr.
  const std::string* header(std::string_view name) const;
};

// 0: forward; otherwise the status the connection answers the refused request with (e.g. 421).
struct Http1Verdict {
  int refuse_status = 0;
  std::string reason;
};

class Http1RequestFilter {
 public:
  using OnRequest = std::function<Http1Verdict(Http1Request&)>;
  enum class State {
    kRequests,         // parsing heads, forwarding heads and bodies
    kAwaitingSwitch,   // an Upgrade or CONNECT request was forwarded: what follows is held until the sandbox
                       // answers it (resolve_upgrade), since it is either the new protocol or more requests
    kTunnel,           // the protocol switched: what follows is the new protocol's, passed as is
    kRefused,          // a head was refused (refusal() says how): nothing more is forwarded
  };
  struct Refusal {
    int status = 0;
    std::string reason;  // for the answer's body and the access log
  };

  // `max_head_bytes` bounds each head (431 beyond it). After an Upgrade/CONNECT request, what follows is held
  // until resolve_upgrade() (the connection watches the answers).
  Http1RequestFilter(size_t max_head_bytes, OnRequest on_request);
  ~Http1RequestFilter();
  Http1RequestFilter(const Http1RequestFilter&) = delete;
  Http1RequestFilter& operator=(const Http1RequestFilter&) = delete;

  // Consumes all of `in` (any split); appends what goes to the sandbox to `out`. A malformed or oversized
  // head is a refusal too (400 / 431), since the requests before it may still be answered.
  State feed(std::string_view in, std::string& out);
  State state() const { return state_; }
  const Refusal& refusal() const { return refusal_; }
  // Requests whose heads were forwarded so far.
  size_t forwarded() const { return forwarded_; }
  // No part of a request (head or body) has been read since the last one ended.
  bool between_requests() const;
  // The sandbox answered the Upgrade/CONNECT request (kAwaitingSwitch): switched -> kTunnel, the held bytes
  // released as they are; refused -> kRequests, the held bytes parsed as requests. Either way what is released
  // goes out with the next feed() (which may be given no input).
  void resolve_upgrade(bool switched);
  bool has_released() const { return !held_.empty() && state_ != State::kAwaitingSwitch; }
  // The connection has been quiet for a while: the last request's parsed head, and the header list kept for
  // the next one, go back (not a head being read).
  void release_memory_while_idle();

  // Bytes held in kAwaitingSwitch at most (a client that sends more before the answer gets a 400).
  static constexpr size_t kMaxHeldBytes = 64 * 1024;

 private:
  struct Parser;
  std::unique_ptr<Parser> parser_;
  OnRequest on_request_;
  size_t max_head_bytes_;
  State state_ = State::kRequests;
  Refusal refusal_;
  size_t forwarded_ = 0;
  std::string held_;  // kAwaitingSwitch: what the client sent after the Upgrade request; then until released
};

// Makes the request ask the server to close after answering it: every Connection field becomes one
// "Connection: close, <the other options they named>" (keep-alive dropped), other fields untouched.
void ask_to_close(std::vector<HttpHeader>& headers);

// "METHOD target HTTP/x.y\r\n" + "name: value\r\n"... + "\r\n".
std::string serialize_request_head(const Http1Request& r);
// The same, appended to `out` (the filter's output, without a string of its own per request).
void append_request_head(const Http1Request& r, std::string& out);

}  // namespace sg
