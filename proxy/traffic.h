// Per-sandbox accounting at the ingress. Bytes are counted on each worker without atomics (one add per
// read, on the worker's own thread) and reported to the node as deltas about once a second; the
// connection limits (per sandbox, per client address) are the one thing shared across workers.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

namespace sg {

struct SandboxTraffic {
  uint64_t bytes_in = 0;   // client -> sandbox since the last report
  uint64_t bytes_out = 0;  // sandbox -> client since the last report
  uint32_t connections = 0;
  bool reported_connections_dirty = true;  // the count changed since the last report
};

// One per worker thread; never touched by another thread.
class WorkerTraffic {
 public:
  // Stable until release_connection() of the last connection and the following report.
  SandboxTraffic* open_connection(const std::string& sandbox_id);
  void close_connection(const std::string& sandbox_id);
  // Where connections count bytes that belong to no sandbox of this node (api.<domain>, a hop to another
  // node's proxy, which counts them there): never reported.
  SandboxTraffic* unattributed() { return &unattributed_; }

  // JSON body for POST /v1/internal/activity with the deltas since the previous call, or "" when nothing
  // changed. Entries with no connections left are dropped after they are reported.
  std::string take_report(const std::string& reporter);
  // The bytes the reports since the previous call carried, both directions (for /metrics).
  struct Totals {
    uint64_t bytes_in = 0, bytes_out = 0;
  };
  Totals take_reported_totals() { return std::exchange(reported_, Totals{}); }

 private:
  std::unordered_map<std::string, SandboxTraffic> by_sandbox_;
  SandboxTraffic unattributed_;
  Totals reported_;
};

// Shared by all workers: open connections per key against a limit. One instance counts per sandbox id
// (max_connections_per_sandbox), another per client address (max_connections_per_client). The limit is
// passed on each acquire, so a reload that changes it applies to the next connection.
class ConnectionLimits {
 public:
  bool try_acquire(const std::string& key, uint32_t limit);
  void release(const std::string& key);
  uint32_t count(const std::string& key) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, uint32_t> open_;
};

}  // namespace sg
