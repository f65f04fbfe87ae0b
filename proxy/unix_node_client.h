// NodeClient over the node API's unix socket (one short-lived NodeRequest per call, node_client.h): builds
// the internal/lookup, internal/open, internal/sockets and internal/activity bodies, reads internal/events, and turns the JSON answers into the typed
// ones of node_api.h, so nothing else in the proxy parses the node's JSON.
#pragma once

#include <uv.h>

#include "proxy/node_api.h"
#include "proxy/node_client.h"

namespace sg {

struct ProxyShared;

class UnixNodeClient : public NodeClient {
 public:
  // The node's address is read from the current snapshot at each call, so a reload that moves it applies
  // to the next request.
  // Its requests' sockets are watched in `sockets` (the worker's, polled from `loop`).
  UnixNodeClient(uv_loop_t* loop, SocketWatchSet* sockets, const ProxyShared* shared)
      : loop_(loop), sockets_(sockets), shared_(shared) {}

  std::unique_ptr<NodeCall> lookup(const std::string& sandbox, uint16_t port, const ClientHint& client,
                                   uint32_t timeout_ms, std::function<void(Result<LookupAnswer>)> done) override;
  std::unique_ptr<NodeCall> open(const std::string& sandbox, uint16_t port, std::span<const std::string> credentials,
                                 const ClientHint& client, uint32_t wake_timeout_ms,
                                 std::function<void(Result<OpenAnswer>)> done) override;
  std::unique_ptr<NodeCall> report_activity(std::string report_json,
                                            std::function<void(Result<ActivityCuts>)> done) override;
  std::unique_ptr<NodeCall> spare_sockets(const std::string& sandbox_id, uint16_t port, size_t count,
                                          std::function<void(Result<RouteGrant>)> done) override;
  std::unique_ptr<NodeCall> watch_routes(std::function<void(const RouteStreamEvent&)> on_event,
                                         std::function<void(Failure)> ended) override;
  bool accepting() override;

 private:
  uv_loop_t* loop_;
  SocketWatchSet* sockets_;
  const ProxyShared* shared_;
};

// The answers' parsers, apart so they are tested on their own (garbage from the node is an error, never a
// crash). `status` is the node's HTTP status; `fd` the descriptor that came with an open.
Result<LookupAnswer> parse_lookup_answer(int status, std::string_view body);
Result<OpenAnswer> parse_open_answer(int status, std::string_view body, std::vector<UniqueFd> fds);
Result<RouteGrant> parse_sockets_answer(int status, std::string_view body, std::vector<UniqueFd> fds);
Result<RouteStreamEvent> parse_route_event(std::string_view line);
Result<ActivityCuts> parse_activity_answer(int status, std::string_view body);

}  // namespace sg
