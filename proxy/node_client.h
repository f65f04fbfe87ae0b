// Step 5 of a connection's path (... -> auth -> *wake* -> forward): the proxy's asynchronous client for the
// node API on its unix socket. One short-lived unix connection per request keeps the protocol trivial (no
// pipelining, no head-of-line blocking behind a slow wake) and costs ~10 µs on loopback.
#pragma once

#include <uv.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "common/http.h"
#include "common/net.h"
#include "proxy/socket_watch.h"

namespace sg {

struct NodeResponse {
  int status = 0;
  std::string body;
  std::vector<UniqueFd> passed_fds;  // descriptors that arrived with the response (internal/open, sockets)
};

class NodeRequest {
 public:
  using Callback = std::function<void(Result<NodeResponse>)>;

  // Starts the request; `done` runs once on the loop (never before start() returns) unless the request is
  // destroyed first, which cancels it. `timeout_ms` bounds the whole exchange. The request's socket is
  // watched in `sockets`, which `loop` polls.
  static std::unique_ptr<NodeRequest> start(uv_loop_t* loop, SocketWatchSet* sockets, const Endpoint& node,
                                            std::string method,
                                            std::string path, std::string body, uint32_t timeout_ms,
                                            std::string extra_headers, Callback done);
  // A GET whose 200 answer never ends (internal/events): each line of its body goes to `on_line` (without
  // the newline) as it arrives; `ended` runs once when the stream ends: the node closed it, a read failed,
  // a line was longer than kMaxStreamLineBytes, or the answer did not start within `head_timeout_ms` or was
  // not a 200 (its status is then in NodeResponse, with the body read so far).
  using LineCallback = std::function<void(std::string_view line)>;
  static std::unique_ptr<NodeRequest> stream(uv_loop_t* loop, SocketWatchSet* sockets, const Endpoint& node,
                                             std::string path,
                                             uint32_t head_timeout_ms, LineCallback on_line, Callback ended);
  static constexpr size_t kMaxStreamLineBytes = 64 * 1024;
  ~NodeRequest();
  NodeRequest(const NodeRequest&) = delete;
  NodeRequest& operator=(const NodeRequest&) = delete;

 private:
  NodeRequest() = default;
  void on_io(int status, int events);
  void finish(Result<NodeResponse> r);
  Status arm(int events);
  // Stream mode: splits what follows the head into lines; false once finish() ran.
  bool deliver_lines(std::string_view bytes);

  uv_loop_t* loop_ = nullptr;
  UniqueFd fd_;
  SocketWatch watch_;  // of fd_ (declared after it: stopped before the descriptor closes)
  // Heap-allocated and freed in its close callback, which may run after this object is gone.
  uv_timer_t* timer_ = nullptr;
  std::string out_;
  size_t out_off_ = 0;
  std::unique_ptr<HttpParser> parser_ =
      std::make_unique<HttpParser>(HttpParser::Kind::kResponse, HttpLimits{16 * 1024, 1024 * 1024, false});
  std::vector<UniqueFd> passed_fds_;
  Callback done_;
  LineCallback on_line_;  // set: stream mode
  bool streaming_ = false;  // stream mode, after a 200 head
  std::string partial_line_;
  std::optional<Failure> connect_failure_;
  bool finished_ = false;
  bool* alive_ = nullptr;  // set while a line callback runs: cleared if that callback destroyed us
};

}  // namespace sg
