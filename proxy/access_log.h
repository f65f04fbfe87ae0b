// One JSON object per line per connection, written when the connection ends, with the recorded reason it
// ended. Shared by all workers: a line is formatted on the worker and written under a mutex in one write.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/error.h"

namespace sg {

// Why a connection ended. Every connection records exactly one; the access log prints it as "cause".
enum class TerminationCause {
  kClientClosed,        // forwarding finished after the client closed first
  kUpstreamClosed,      // forwarding finished after the sandbox closed first
  kClientReset,         // I/O error on the client side (reset, broken TLS record)
  kUpstreamReset,       // I/O error on the sandbox side
  kHandshakeFailed,     // not TLS, no shared cipher, bad ClientHello
  kHandshakeTimeout,
  kUnknownSni,          // SNI names a host this ingress does not serve
  kHeadTimeout,         // no complete request head in time
  kHeadTooLarge,
  kBadRequest,          // malformed HTTP or Host
  kMisdirected,         // Host outside our domain or not matching SNI
  kUnknownSandbox,
  kPortNotExposed,
  kNotServed,           // a route kind this ingress does not serve (yet)
  kUnauthorized,        // no valid token for a non-public port or api.<domain>; the sandbox was not woken
  kAuthRedirect,        // a valid ?sandgate_token= was turned into a cookie by a redirect
  kCrossOrigin,         // a cross-origin request to the SDK route, or one the sandgate cookie would authorize
  kSandboxConnLimit,
  kClientConnLimit,     // the client's address has max_connections_per_client open; refused at accept
  kTooManyConnections,
  kWakeFailed,
  kWakeTimeout,
  kNodeUnavailable,
  kUpstreamConnectFailed,
  kUpstreamConnectTimeout,
  kIdleTimeout,
  kSandboxSuspended,    // the sandbox was suspended while this connection was open (it can reach it no more)
  kTokenRevoked,        // the sandbox's token was rotated while this connection (authorized by it) was open
  kPortClosed,          // the port this connection reached was closed (unexposed) while it was open
  kKtlsRequired,        // ktls = on and this connection could not be offloaded
  kKtlsKeyUpdate,       // the client rotated its TLS 1.3 keys (KeyUpdate) on a kTLS socket the kernel cannot rekey
  kDrained,             // idle between HTTP/1.1 requests while the proxy handed its listeners to a new process
  kFleetOwnerGone,      // the sandbox's owning node is gone from the fleet (its lease expired): 503 + Retry-After
  kFleetHopFailed,      // the owning node's fleet ingress could not be reached or broke the hop protocol
  kFleetRedirect,       // fleet ingress: this node does not own the sandbox; the hop was sent to the owner
  kSocketWatchFailed,   // the proxy could not watch one of the connection's sockets (epoll_ctl: ENOMEM, ENOSPC)
  kShutdown,
};

std::string_view cause_name(TerminationCause c);

struct AccessRecord {
  std::chrono::system_clock::time_point started_at;
  std::chrono::steady_clock::time_point started_steady;
  std::string client;
  std::string sni;
  std::string host;
  std::string sandbox_id;
  std::string sandbox;  // the name or id used in the host
  uint16_t port = 0;
  int status = 0;  // HTTP status when the proxy answered itself; 0 when forwarded
  uint64_t bytes_in = 0;   // client -> sandbox
  uint64_t bytes_out = 0;  // sandbox -> client
  bool woke = false;
  double wake_ms = 0;
  bool route_cached = false;  // routed from the worker's route cache: no node round trip
  bool prewake = false;       // the ClientHello asked the node to start waking the sandbox
  std::string_view tls_version;  // OpenSSL's name for it (static storage)
  bool tls_resumed = false;      // the handshake resumed a session (a ticket) instead of a full handshake
  std::string_view data_path;    // "userspace", "ktls-tx-only", "ktls-splice"
  TerminationCause cause = TerminationCause::kClientClosed;
  // The phase the connection ended in ("handshake", "head", "open", "connect", "forward"); for an answer the
  // edge gave itself, the phase that decided on it (not the respond/linger that carried it out).
  std::string_view phase;
  std::string detail;     // e.g. the OpenSSL error for a failed handshake
  // Cross-node hop: the node this proxy carried the connection to, or the node whose proxy carried it here.
  std::string hop_to;
  std::string hop_from;
};

class AccessLog {
 public:
  // "-" = stdout, "" = disabled, else a file opened for append.
  static Result<std::unique_ptr<AccessLog>> open(const std::string& target);
  ~AccessLog();
  void write(const AccessRecord& r);
  static std::string format(const AccessRecord& r);

 private:
  std::mutex mu_;
  FILE* out_ = nullptr;
  bool owned_ = false;
};

}  // namespace sg
