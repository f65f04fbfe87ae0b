// What the proxy knows about a sandbox port between connections: its protocol and whether it is public,
// which the ClientHello needs (the ALPN offer, raw TCP mode) before any request head. Without it every new
// connection costs a node round trip at the handshake (internal/lookup) before the one that opens the port;
// with it, a connection to a port seen recently costs only the open.
//
// One per worker (no locking). A port's policy is fixed for a sandbox's life (specs are immutable), so an
// entry is only wrong after the name is given to a new sandbox: entries expire after `ttl_ms`, and an open
// whose answer names another sandbox id (or no sandbox) replaces or drops the entry.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace sg {

struct PortPolicy {
  std::string sandbox_id;
  std::string protocol;  // "http1", "h2c", "tcp"
  bool is_public = false;
};

class PortPolicyCache {
 public:
  // ttl_ms 0 disables the cache (every lookup misses). At most `max_entries` are kept: a full cache is
  // cleared rather than tracked for recency (refilling costs one lookup per port).
  PortPolicyCache(uint64_t ttl_ms, size_t max_entries) : ttl_ms_(ttl_ms), max_entries_(max_entries) {}

  std::optional<PortPolicy> find(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms);
  void store(std::string_view sandbox_ref, uint16_t port, PortPolicy policy, uint64_t now_ms);
  void erase(std::string_view sandbox_ref, uint16_t port);
  // Every entry of a sandbox, whatever ref it was stored under (it was deleted, or its token rotated).
  void erase_sandbox(std::string_view sandbox_id);
  size_t size() const { return entries_.size(); }
  void set_ttl_ms(uint64_t ttl_ms) { ttl_ms_ = ttl_ms; }

 private:
  struct Entry {
    PortPolicy policy;
    uint64_t expires_ms = 0;
  };
  static std::string key(std::string_view sandbox_ref, uint16_t port);

  uint64_t ttl_ms_;
  size_t max_entries_;
  std::unordered_map<std::string, Entry> entries_;
};

}  // namespace sg
