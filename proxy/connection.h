// One client connection through the ingress, following its path, one phase at a time: accept -> TLS
// handshake (ClientHello picks the certificate) -> first request head -> route -> ask the node to open the
// sandbox port (waking it if needed) -> connect -> forward bytes both ways (proxy/forwarder.h, over the
// transports of proxy/transport.h) until both sides are done. Two timers, as in h2o: a deadline for
// whichever phase is waiting (handshake, head, wake, connect, respond, linger) and an idle timer while
// forwarding. Every connection ends in close(cause), which writes the access log line.
#pragma once

#include <uv.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/http.h"
#include "proxy/access_log.h"
#include "proxy/edge_auth.h"
#include "proxy/forwarder.h"
#include "proxy/node_api.h"
#include "proxy/route.h"
#include "proxy/socket_watch.h"
#include "proxy/tls.h"
#include "proxy/traffic.h"
#include "proxy/transport.h"

namespace sg {

class Worker;
struct Config;
struct ProxySnapshot;
struct FleetContext;

class Connection {
 public:
  // `via_fleet`: accepted on proxy.fleet_listen, a hop from another node's proxy (docs/fleet.md).
  Connection(Worker* worker, UniqueFd client, std::string peer, bool via_fleet = false);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  void start();
  void close(TerminationCause cause, std::string detail = {});
  // The connection holds one of its client address's slots in ProxyShared::client_limits; close() gives
  // it back.
  void hold_client_slot(std::string address) { client_slot_ = std::move(address); }
  // The client's address without its port, as the node's early-wake gate knows it; "" when the peer has
  // none (a unix listener: every client would share one "address").
  std::string client_address() const {
    const size_t colon = rec_.client.rfind(':');
    return colon == std::string::npos || colon == 0 ? std::string() : rec_.client.substr(0, colon);
  }

  // Why the node wants older connections of a sandbox gone (its answer to an activity report).
  enum class Cut {
    kSuspended,     // frozen: their bytes can no longer reach it
    kTokenRevoked,  // its token was rotated: they were authorized by the old one (public ports are kept)
    kPortClosed,    // the port they reach was closed: only the connections to `port`
  };
  // Closes this connection if it belongs to `sandbox_id` (and, for kPortClosed, reaches `port`) and was
  // opened before `stamp` (the node's stamps). True when it was closed.
  bool cut_if_opened_before(const std::string& sandbox_id, uint64_t stamp, Cut why, uint16_t port = 0);
  // Worker::drain's tick (the proxy handed its listeners over): ends the connection at the next clean point.
  void drain_tick();
  // The worker's turn for a forwarding pump that asked to run again (Worker::pump_again).
  void pump_again();

 private:
  // Caches what a lookup answered (HandshakePhase).
  void remember_lookup(const std::string& target, const LookupAnswer& a);
  // The connection's state is its current phase, one object at a time: each phase handles the events
  // that mean something in it and owns the state only it needs, and the connection switches to the next
  // one as nghttpx's ClientHandler swaps its read_/write_ handlers (read_tls_handshake -> read_tls).
  //   handshake -> head -> open -> connect -> forward, with respond -> linger from any of them (the
  //   proxy's own answer, then the client's unread input drained so closing does not turn into a TCP reset
  //   that destroys the answer before it is read), and closed at the end.
  // A fleet: open -> hop -> forward when another node owns the sandbox (the first proxy), and
  //   handshake -> preamble -> head -> ... on the fleet listener (the owning proxy).
  enum class PhaseKind { kHandshake, kPreamble, kHead, kOpen, kHop, kConnect, kForward, kRespond, kLinger, kClosed };
  class Phase;
  class HandshakePhase;
  class PreamblePhase;
  class HopPhase;
  class HeadPhase;
  class OpenPhase;
  class ConnectPhase;
  class ForwardPhase;
  class RespondPhase;
  class LingerPhase;
  class ClosedPhase;

  // Makes a new P the current phase. The one it replaces may be running (it called this): it is stopped
  // (its node call cancelled) and kept until the event being handled has returned.
  template <class P, class... Args>
  P& enter(Args&&... args);
  PhaseKind phase() const;
  static std::string_view phase_name(PhaseKind k);
  // At the start of every event: the phases left during earlier ones are no longer running.
  void drop_left_phases();

  void on_client_io(int status, int events);
  void on_upstream_io(int status, int events);
  void on_deadline();
  void on_idle_timer();
  void arm_idle_timer(uint64_t ms);
  // Forwarding holds memory for the next bytes (buffers, TLS records): the idle timer gives it back once
  // the connection has been quiet for kReleaseIdleMemoryAfterMs.
  void release_memory_when_quiet();
  void arm_deadline(uint32_t ms, TerminationCause cause);
  void update_interest();
  // upstream_fd_ is set: watch it (for nothing yet) in the worker's set.
  void watch_upstream();

  // kTLS, right after the handshake: when the kernel can do the TLS both ways, client_ becomes a
  // KernelTlsTransport and the SSL is freed; why not is logged once per reason.
  void plan_data_path();
  void set_data_path_label(bool tx_spliced, bool rx_spliced);
  void note_own_records();
  static constexpr std::string_view kOwnRecordsPath = "own-records";
  // A direction planned for splice cannot; false when that closed the connection (ktls = on).
  bool ktls_downgrade(std::string why);

  // Route + authenticate the connection's first request (HTTP/1.1 head or HTTP/2 HEADERS), then open.
  void on_request(std::string_view host, std::string_view method, std::string_view target,
                  std::span<const HttpHeader> headers);
  // Why the connection's check refuses a request (first or later).
  struct RequestRefusal {
    int status = 0;
    TerminationCause cause = TerminationCause::kBadRequest;
    std::string message;
  };
  // Requests from another origin that the sandgate credential must not serve (cross-sandbox CSRF).
  std::optional<RequestRefusal> cross_origin_refusal(std::string_view host, std::string_view method,
                                                     std::string_view target,
                                                     std::span<const HttpHeader> headers) const;
  // Every request after the connection is open (the first one again included): it must name the route the
  // connection is bound to, and it passes the cross-origin check; then the edge's credentials are taken out.
  std::optional<RequestRefusal> later_request_refusal(std::string_view authority, std::string_view method,
                                                      std::string_view target,
                                                      std::span<const HttpHeader> headers) const;
  // An h2 stream the proxy answered itself: its own access-log line (the connection goes on).
  void log_refused_stream(uint32_t stream_id, std::string_view authority, const RequestRefusal& refusal);

  // The one place that asks the node to open the sandbox port (waking it if needed): the open phase.
  void open_sandbox();
  // After the fleet's routing decision: the local node opens the sandbox port.
  void open_local_sandbox();
  // The hop is answered "ok": its TLS stream is the upstream, and the client's bytes go through as they are.
  void begin_hop_forwarding(UniqueFd fd, SSL* ssl);
  // The node's answer to the open: refusals are answered, a socket goes on to use_opened().
  void on_open_result(Result<OpenAnswer> r);
  // An opened sandbox port, from wherever it came (the node's open): checks the credential, takes the
  // sandbox's connection slot and connects.
  void use_opened(OpenedSocket opened);
  void open_node_api();
  void start_connect(UniqueFd socket, const sockaddr* addr, socklen_t addr_len, bool already_connected);
  // Gives back the per-sandbox slot and traffic count an open took (close, or a cached route that failed).
  void release_sandbox_slot();
  void begin_forwarding();
  // The proxy's own answer (HTTP/1.1, or HTTP/2 frames on an h2 connection), then a graceful close.
  void respond(int status, std::string_view body, TerminationCause cause, std::vector<HttpHeader> extra_headers = {});
  void respond_bytes(std::string bytes, TerminationCause cause);

  // snapshot_'s parts.
  const Config* cfg() const;
  TlsContexts* tls() const;
  const FleetContext* fleet() const;  // null: off

  // Members are ordered so that an idle connection's object stays small (no padding between flags): it is
  // one of the ~20 KiB each held connection costs (bench/soak.py).
  Worker* worker_;
  std::shared_ptr<const ProxySnapshot> snapshot_;  // the reload this connection was accepted under
  std::unique_ptr<Phase> phase_;
  std::vector<std::unique_ptr<Phase>> left_phases_;  // see enter()
  UniqueFd client_fd_;
  UniqueFd upstream_fd_;
  std::unique_ptr<Transport> client_;  // the client's TLS (set by start()): OpenSSL's, or the kernel's
  TlsTransport* client_tls_ = nullptr;  // client_ while it is OpenSSL's
  std::unique_ptr<Transport> upstream_;  // the sandbox's socket, once the node gave it (or the hop's TLS)
  SocketWatch client_watch_;    // in the worker's SocketWatchSet
  SocketWatch upstream_watch_;  // initialized with upstream_fd_
  uv_timer_t deadline_{};
  uv_timer_t idle_timer_{};
  int handles_open_ = 0;
  TerminationCause deadline_cause_ = TerminationCause::kHandshakeTimeout;
  uint64_t last_activity_ms_ = 0;  // forwarding: the idle timer's reference
  // A keep-alive client's next request comes within this as a rule; a connection quiet for longer holds no
  // forwarding memory (the RSS of idle connections, bench/soak.py).
  static constexpr uint64_t kReleaseIdleMemoryAfterMs = 1000;

  HelloState hello_;  // SNI and the routed port's policy, filled during the handshake (OpenSSL's callbacks)
  // The early wake this connection's ClientHello asks for (proxy.wake_at_client_hello): decided once; a call
  // of its own when no lookup was needed, kept until the node answered whatever phase the connection is in.
  std::unique_ptr<NodeCall> prewake_;

  // The first request: what every later phase goes by.
  // A public raw-TCP port (its policy known at the ClientHello): no request head, the server may speak
  // first, so the connection is opened as soon as the handshake is done.
  bool headless_tcp() const { return hello_.policy_known && hello_.port_protocol == "tcp" && hello_.port_public; }
  uint32_t h2_stream_ = 0;                 // the request's stream, which the proxy's own answers go to
  size_t head_bytes_ = 0;                  // length of the HTTP/1.1 head at the front of request_
  std::vector<Credential> credentials_;    // all sent in one open; the node checks them (a 401 never wakes)
  size_t credential_index_ = 0;            // the one the node accepted; credentials_.size() for none
  std::string request_authority_;          // for the redirect that takes a query-parameter token out of the URL
  std::string request_target_;
  Route route_;
  // The request head and what came after it: read by the head phase, forwarded first by the forward phase.
  ByteBuffer request_;

  // The open: what the node said about the sandbox port.
  std::optional<TokenDigest> credential_sha256_;  // the verified credential's, when the route cache hashed it
  uint64_t opened_at_ = 0;            // the node's stamp of the open that gave the socket (0: not opened)
  std::string sandbox_token_sha256_;  // recognised (and removed) in every request
  SandboxTraffic* traffic_ = nullptr;  // worker-owned counters of this connection's sandbox (or of none)
  std::string client_slot_;  // the address whose slot this connection holds; "" = none

  // Flags, side by side.
  // Forwarding memory may be held (sandgate_proxy_connections_holding_buffers): the idle timer fires by
  // kReleaseIdleMemoryAfterMs after the last activity.
  bool holding_buffers_ = false;
  bool pump_again_queued_ = false;  // in the worker's list for pump_again()
  bool prewake_asked_ = false;
  bool h2_ = false;  // ALPN h2: the first request arrives as an HTTP/2 HEADERS frame
  // Opened with no request head (headless_tcp here, or a "tcp" hop from another node's proxy): no filter
  // will see its bytes, so the open's answer must say the port is a public tcp port still.
  bool headless_ = false;
  bool answering_head_ = false;       // the request the edge answers itself is a HEAD: no content
  bool tunnel_ = false;               // HTTP/1.1 CONNECT: the proxy answers 200, the head is not forwarded
  bool answers_request_ = false;      // an HTTP request (not CONNECT, not raw TCP) is being forwarded
  bool opened_public_ = false;        // the port needed no token
  bool cached_route_failed_ = false;  // the route cache's socket did not connect: this open asks the node
  bool looked_for_outage_ = false;    // the node's open failed and Worker::outage_found was asked (once)
  bool holds_sandbox_slot_ = false;
  // Fleet: which end of a hop this connection is.
  bool via_fleet_ = false;  // accepted on the fleet listener: it never hops again
  bool hopped_ = false;     // forwarded to another node's proxy: that proxy filters, authenticates and counts

  AccessRecord rec_;
};

}  // namespace sg
