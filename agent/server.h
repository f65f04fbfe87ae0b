// sandgate-agent's server: one libuv loop, one TCP listener, HTTP/1.1 and h2c (prior knowledge) on the same
// port. The agent runs inside a sandbox, behind the ingress that authenticates; it does no auth itself.
#pragma once

#include <uv.h>

#include <string>
#include <unordered_set>

#include "agent/routes.h"
#include "common/net.h"

namespace sg::agent {

class Connection;

// Binds `ep` (TCP) and makes `handle` listen on it with `on_connection` (`handle->data` is the caller's to
// set). Once it returns, failed or not, `handle` is initialised and must be closed. The port bound, or why not.
Result<uint16_t> listen_tcp(uv_loop_t* loop, uv_tcp_t* handle, const Endpoint& ep, int backlog,
                            uv_connection_cb on_connection);

class AgentServer {
 public:
  AgentServer(uv_loop_t* loop, AgentLimits limits);
  // Only once the loop has finished what close() started.
  ~AgentServer();
  AgentServer(const AgentServer&) = delete;
  AgentServer& operator=(const AgentServer&) = delete;

  Status listen(const Endpoint& ep);
  // "127.0.0.1:41234": the address actually bound (port 0 resolved).
  const std::string& address() const { return address_; }
  // Stops accepting and closes every connection, which kills the commands they run. The loop ends once
  // those are reaped and every handle has closed.
  void close();

 private:
  friend class Connection;
  void on_connection(int status);

  uv_loop_t* loop_;
  Router router_;
  uv_tcp_t listener_{};
  bool listening_ = false;
  bool closing_ = false;
  std::string address_;
  std::unordered_set<Connection*> connections_;  // each frees itself and leaves this set when closed
};

}  // namespace sg::agent
