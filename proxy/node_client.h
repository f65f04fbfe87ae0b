// Step 5 of a connection's path (... -> auth -> *wake* -> forward): the proxy's asynchronous client for the
// node API on its unix socket. One short-lived unix connection per request keeps the protocol trivial (no
// pipelining, no head-of-line blocking behind a slow wake) and costs ~10 µs on loopback.
#pragma once

#include <uv.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/error.h"
#include "common/fd.h"
#include "common/http.h"
#include "common/net.h"

namespace sg {

struct NodeResponse {
  int status = 0;
  std::string body;
  UniqueFd passed_fd;  // a descriptor that arrived with the response (internal/open), if any
};

class NodeRequest {
 public:
  using Callback = std::function<void(Result<NodeResponse>)>;

  // Starts the request; `done` runs once on the loop (never before start() returns) unless the request is
  // destroyed first, which cancels it. `timeout_ms` bounds the whole exchange.
  static std::unique_ptr<NodeRequest> start(uv_loop_t* loop, const Endpoint& node, std::string method,
                                            std::string path, std::string body, uint32_t timeout_ms,
                                            std::string extra_headers, Callback done);
  ~NodeRequest();
  NodeRequest(const NodeRequest&) = delete;
  NodeRequest& operator=(const NodeRequest&) = delete;

 private:
  NodeRequest() = default;
  void on_io(int status, int events);
  void finish(Result<NodeResponse> r);
  void arm(int events);

  uv_loop_t* loop_ = nullptr;
  UniqueFd fd_;
  // Handles are heap-allocated and freed in their close callbacks, which may run after this object is gone.
  uv_poll_t* poll_ = nullptr;
  uv_timer_t* timer_ = nullptr;
  std::string out_;
  size_t out_off_ = 0;
  HttpParser parser_{HttpParser::Kind::kResponse, HttpLimits{16 * 1024, 1024 * 1024, false}};
  UniqueFd passed_fd_;
  Callback done_;
  std::optional<Failure> connect_failure_;
  bool finished_ = false;
};

}  // namespace sg
