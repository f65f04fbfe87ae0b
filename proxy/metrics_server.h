// The proxy's /metrics listener (proxy.metrics_listen): plain HTTP/1.1, `GET /metrics` only, one request per
// connection, served on the main thread's loop so that scrapes never compete with a worker's connections.
// Bounded: at most kMaxClients connections at once, kMaxRequestBytes of request head, kTimeoutMs each.
#pragma once

#include <uv.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/net.h"

namespace sg {

class MetricsServer {
 public:
  static constexpr size_t kMaxClients = 16;
  static constexpr size_t kMaxRequestBytes = 8 * 1024;
  static constexpr uint64_t kTimeoutMs = 5'000;
  using Render = std::function<std::string()>;

  // Binds every endpoint (port 0 resolved, see bound()) and starts accepting on `loop`.
  static Result<std::unique_ptr<MetricsServer>> start(uv_loop_t* loop, const std::vector<Endpoint>& listen, Render render);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  const std::vector<Endpoint>& bound() const { return bound_; }
  // Closes the listeners and the open scrapes; the loop can then end.
  void close();

 private:
  struct Client;
  MetricsServer(uv_loop_t* loop, Render render) : loop_(loop), render_(std::move(render)) {}
  void on_accept(uv_poll_t* listener);
  void on_readable(Client* c);
  void answer(Client* c, int status, std::string_view body);
  void drop(Client* c);

  uv_loop_t* loop_;
  Render render_;
  std::vector<UniqueFd> fds_;
  std::vector<uv_poll_t*> polls_;
  std::vector<Endpoint> bound_;
  std::vector<Client*> clients_;
};

}  // namespace sg
