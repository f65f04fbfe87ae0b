// What the proxy counts for /metrics (proxy.metrics_listen, docs/observability.md): every ended connection by
// its termination cause, bytes by direction, TLS handshake and wake latencies, node round trips by call, and
// route-cache hits. One instance in ProxyShared, updated by every worker (relaxed atomics), rendered on scrape.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "common/metrics.h"
#include "proxy/access_log.h"

namespace sg {

enum class NodeCallKind { kLookup, kOpen, kActivity, kSpareSockets, kRouteEvents };
inline constexpr size_t kNodeCallKinds = 5;
std::string_view node_call_name(NodeCallKind k);

inline constexpr size_t kTerminationCauses = static_cast<size_t>(TerminationCause::kShutdown) + 1;

class ProxyMetrics {
 public:
  // A connection ended (or an h2 stream was refused by the edge, `stream` true): its cause, its wake.
  void connection_ended(const AccessRecord& r);
  void stream_refused(TerminationCause cause) { refused_streams_[index(cause)].add(); }
  // A TLS handshake finished: full, or resumed from a session ticket.
  void handshake_done(double seconds, bool resumed) {
    handshake_.observe(seconds);
    (resumed ? resumed_handshakes_ : full_handshakes_).add();
  }
  void bytes(uint64_t client_to_sandbox, uint64_t sandbox_to_client) {
    bytes_in_.add(client_to_sandbox);
    bytes_out_.add(sandbox_to_client);
  }
  void node_call(NodeCallKind k) { node_calls_[static_cast<size_t>(k)].add(); }
  // A connection's route came from the worker's cache (hit) or from a node call (miss).
  void route_cache(bool hit) { (hit ? route_hits_ : route_misses_).add(); }
  // The socket maker made `n` sockets for a cached route while the node was down.
  void sockets_made_without_node(size_t n) { made_without_node_.add(n); }
  // Routes kept dormant for a node outage (route_cache.h), as each worker's count changes.
  void dormant_routes(int64_t delta) { dormant_routes_.fetch_add(delta, std::memory_order_relaxed); }
  // A connection's TLS 1.3 records left OpenSSL for the proxy's own record layer (its SSL freed).
  void tls_own_records() { own_records_.add(); }
  // A connection took forwarding memory it keeps between bursts (+1), or gave it back or ended (-1).
  void buffers_held(int delta) { holding_buffers_.fetch_add(delta, std::memory_order_relaxed); }
  int64_t connections_holding_buffers() const { return holding_buffers_.load(std::memory_order_relaxed); }

  // The exposition, with the gauges the caller reads at scrape time.
  std::string render(uint32_t open_connections, uint32_t max_connections) const;

 private:
  static size_t index(TerminationCause c) { return static_cast<size_t>(c); }
  std::array<Counter, kTerminationCauses> ended_;
  std::array<Counter, kTerminationCauses> refused_streams_;
  std::array<Counter, kNodeCallKinds> node_calls_;
  Counter bytes_in_, bytes_out_, wakes_, own_records_, route_hits_, route_misses_, full_handshakes_, resumed_handshakes_;
  Counter made_without_node_;
  std::atomic<int64_t> holding_buffers_{0};
  std::atomic<int64_t> dormant_routes_{0};
  Histogram handshake_ = make_handshake_histogram();
  Histogram wake_ = make_wake_histogram();
};

}  // namespace sg
