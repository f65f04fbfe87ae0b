#include "proxy/metrics.h"

#include <algorithm>

namespace sg {

std::string_view node_call_name(NodeCallKind k) {
  switch (k) {
    case NodeCallKind::kLookup: return "lookup";
    case NodeCallKind::kOpen: return "open";
    case NodeCallKind::kActivity: return "activity";
    case NodeCallKind::kSpareSockets: return "sockets";
    case NodeCallKind::kRouteEvents: return "events";
  }
  return "unknown";
}

void ProxyMetrics::connection_ended(const AccessRecord& r) {
  ended_[index(r.cause)].add();
  if (r.woke) {
    wakes_.add();
    wake_.observe(r.wake_ms / 1000.0);
  }
}

std::string ProxyMetrics::render(uint32_t open_connections, uint32_t max_connections) const {
  MetricsText m;
  m.family("sandgate_proxy_connections_total", "counter",
           "Client connections that ended, by the termination cause recorded for them (access log \"cause\").");
  for (size_t i = 0; i < kTerminationCauses; ++i)
    m.sample("sandgate_proxy_connections_total", {{"cause", cause_name(static_cast<TerminationCause>(i))}},
             ended_[i].value());
  m.family("sandgate_proxy_refused_streams_total", "counter",
           "HTTP/2 streams the edge answered itself (421, 403, ...) on a connection that went on, by cause.");
  for (size_t i = 0; i < kTerminationCauses; ++i)
    if (uint64_t n = refused_streams_[i].value(); n != 0)
      m.sample("sandgate_proxy_refused_streams_total", {{"cause", cause_name(static_cast<TerminationCause>(i))}}, n);
  m.family("sandgate_proxy_connections_open", "gauge", "Client connections open now.");
  m.sample("sandgate_proxy_connections_open", {}, uint64_t{open_connections});
  m.family("sandgate_proxy_connections_max", "gauge",
           "Effective connection limit: proxy.max_connections or what RLIMIT_NOFILE carries, the smaller.");
  m.sample("sandgate_proxy_connections_max", {}, uint64_t{max_connections});
  m.family("sandgate_proxy_connections_holding_buffers", "gauge",
           "Open connections holding forwarding buffers: active within the last second, or with bytes in flight. "
           "The others hold none.");
  m.sample("sandgate_proxy_connections_holding_buffers", {},
           static_cast<uint64_t>(std::max<int64_t>(holding_buffers_.load(std::memory_order_relaxed), 0)));
  m.family("sandgate_proxy_bytes_total", "counter",
           "Bytes forwarded, by direction (counted as the workers report activity to the node, about once a second).");
  m.sample("sandgate_proxy_bytes_total", {{"direction", "client_to_sandbox"}}, bytes_in_.value());
  m.sample("sandgate_proxy_bytes_total", {{"direction", "sandbox_to_client"}}, bytes_out_.value());
  m.histogram("sandgate_proxy_tls_handshake_duration_seconds",
              "From accept to a finished TLS handshake with the client.", handshake_);
  m.family("sandgate_proxy_tls_handshakes_total", "counter",
           "Finished TLS handshakes with clients: full, or resumed from a session ticket.");
  m.sample("sandgate_proxy_tls_handshakes_total", {{"resumed", "false"}}, full_handshakes_.value());
  m.sample("sandgate_proxy_tls_handshakes_total", {{"resumed", "true"}}, resumed_handshakes_.value());
  m.family("sandgate_proxy_tls_own_record_layer_total", "counter",
           "Client connections whose TLS 1.3 records moved from OpenSSL to the proxy's own record layer after the "
           "handshake, freeing OpenSSL's per-connection state (access log path \"own-records\").");
  m.sample("sandgate_proxy_tls_own_record_layer_total", {}, own_records_.value());
  m.family("sandgate_proxy_wakes_total", "counter", "Connections that waited for their sandbox to wake.");
  m.sample("sandgate_proxy_wakes_total", {}, wakes_.value());
  m.histogram("sandgate_proxy_wake_duration_seconds",
              "How long a connection waited for its sandbox to wake (resume or restore), as the node answered.", wake_);
  m.family("sandgate_proxy_node_requests_total", "counter", "Requests the proxy made to its node, by call.");
  for (size_t i = 0; i < kNodeCallKinds; ++i)
    m.sample("sandgate_proxy_node_requests_total", {{"call", node_call_name(static_cast<NodeCallKind>(i))}},
             node_calls_[i].value());
  m.family("sandgate_proxy_route_cache_total", "counter",
           "Connections routed from a worker's route cache (hit: no node round trip) or through the node (miss).");
  m.sample("sandgate_proxy_route_cache_total", {{"result", "hit"}}, route_hits_.value());
  m.sample("sandgate_proxy_route_cache_total", {{"result", "miss"}}, route_misses_.value());
  m.family("sandgate_proxy_sockets_made_without_node_total", "counter",
           "Sockets the socket maker made in sandboxes' network namespaces for cached routes while the node was down.");
  m.sample("sandgate_proxy_sockets_made_without_node_total", {}, made_without_node_.value());
  m.family("sandgate_proxy_route_cache_dormant_routes", "gauge",
           "Cached routes past their cache_ms kept, with their sandbox's network namespace, for a node outage.");
  m.sample("sandgate_proxy_route_cache_dormant_routes", {},
           static_cast<uint64_t>(std::max<int64_t>(dormant_routes_.load(std::memory_order_relaxed), 0)));
  return m.text();
}

}  // namespace sg
