// One client connection through the ingress, following its path: accept -> TLS handshake (ClientHello
// picks the certificate) -> first request head -> route -> ask the node to open the sandbox port (waking
// it if needed) -> connect -> forward bytes both ways until both sides are done. Two timers, as in h2o: a
// deadline for whichever phase is waiting (handshake, head, wake, connect) and an idle timer while
// forwarding. Every connection ends in close(cause), which writes the access log line.
#pragma once

#include <openssl/ssl.h>
#include <uv.h>

#include <memory>
#include <optional>
#include <string>

#include "common/fd.h"
#include "common/http.h"
#include "proxy/access_log.h"
#include "proxy/edge_auth.h"
#include "proxy/forwarder.h"
#include "proxy/h2_filter.h"
#include "proxy/h2_head.h"
#include "proxy/http1_filter.h"
#include "proxy/ktls.h"
#include "proxy/node_api.h"
#include "proxy/route.h"
#include "proxy/tls.h"
#include "proxy/traffic.h"
#include "proxy/transport.h"

namespace sg {

class Worker;
struct Config;
struct ProxySnapshot;

class Connection {
 public:
  Connection(Worker* worker, UniqueFd client, std::string peer);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  void start();
  void close(TerminationCause cause, std::string detail = {});
  // The connection holds one of its client address's slots in ProxyShared::client_limits; close() gives
  // it back.
  void hold_client_slot(std::string address) { client_slot_ = std::move(address); }

  // Why the node wants older connections of a sandbox gone (its answer to an activity report).
  enum class Cut {
    kSuspended,     // frozen: their bytes can no longer reach it
    kTokenRevoked,  // its token was rotated: they were authorized by the old one (public ports are kept)
  };
  // Closes this connection if it belongs to `sandbox_id` and was opened before `stamp` (the node's stamps).
  // True when it was closed.
  bool cut_if_opened_before(const std::string& sandbox_id, uint64_t stamp, Cut why);

 private:
  // kLingering: our error response is sent; the client's unread input is drained (and discarded) for a
  // moment so closing does not turn into a TCP reset that destroys the response before it is read.
  enum class Phase { kHandshake, kReadHead, kOpening, kConnecting, kForwarding, kResponding, kLingering, kClosed };

  void on_client_io(int status, int events);
  void on_upstream_io(int status, int events);
  void on_deadline();
  void on_idle_timer();

  void do_handshake();
  void look_up_port_policy();
  void on_lookup_result(const std::string& target, Result<LookupAnswer> r);
  void after_handshake();
  void read_head();
  void on_head();
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
  Http1Verdict check_http1_request(Http1Request& r);
  H2Verdict check_h2_request(H2Request& r);
  // An h2 stream the proxy answered itself: its own access-log line (the connection goes on).
  void log_refused_stream(uint32_t stream_id, std::string_view authority, const RequestRefusal& refusal);
  // HTTP routes: every client byte goes through the request filter of the connection's protocol.
  void start_request_filters();
  // The client -> sandbox stage: the client's bytes through the filter (and the proxy's own h2 frames
  // toward the client); false when the connection was closed.
  bool filter_client_bytes(std::string_view in, std::string& out);
  // The sandbox -> client stage on h2: the sandbox's frames, with the proxy's own inserted.
  bool frame_upstream_bytes(std::string_view in, std::string& out);
  void open_sandbox();
  void open_node_api();
  void on_open_result(Result<OpenAnswer> r);
  void start_connect(UniqueFd socket, const sockaddr* addr, socklen_t addr_len, bool already_connected);
  void finish_connect();
  void begin_forwarding();
  void pump();
  // The proxy's own answer (HTTP/1.1, or HTTP/2 frames on an h2 connection), then a graceful close.
  void respond(int status, std::string_view body, TerminationCause cause, std::vector<HttpHeader> extra_headers = {});
  void respond_bytes(std::string bytes, TerminationCause cause);
  void flush_response();
  void linger();
  void arm_deadline(uint32_t ms, TerminationCause cause);
  void update_interest();

  // Both directions: each is one Direction (proxy/forwarder.h) between the two transports.
  void start_directions();
  bool handle_half_close();
  // The request on an HTTP route has had no byte back from the sandbox yet (so a 502 can still answer it).
  bool awaiting_first_response() const;
  // The sandbox side failed (detail: how); answers 502 while awaiting_first_response(). Always false.
  bool upstream_failed(std::string detail);

  // kTLS: what the handshake offloaded, and why not (logged once per reason).
  void plan_data_path();
  void set_data_path_label(bool tx_spliced, bool rx_spliced);
  // A direction planned for splice cannot; false when that closed the connection (ktls = on).
  bool ktls_downgrade(std::string why);
  // The client's input must go through the HTTP/1.1 or h2 filter (not be spliced past it).
  bool requests_are_read() const {
    return h2_filter_ || (h1_filter_ && h1_filter_->state() == Http1RequestFilter::State::kRequests);
  }

  Worker* worker_;
  std::shared_ptr<const ProxySnapshot> snapshot_;  // the reload this connection was accepted under
  const Config* cfg_;                               // snapshot_'s parts
  TlsContexts* tls_;
  Phase phase_ = Phase::kHandshake;
  UniqueFd client_fd_;
  UniqueFd upstream_fd_;
  std::unique_ptr<TlsTransport> client_;   // the client's TLS (set by start())
  std::unique_ptr<TcpTransport> upstream_;  // the sandbox's socket, once the node gave it
  uv_poll_t client_poll_{};
  uv_poll_t upstream_poll_{};
  bool upstream_poll_started_ = false;
  uv_timer_t deadline_{};
  uv_timer_t idle_timer_{};
  // Read-ahead can leave whole records inside OpenSSL after the socket ran dry; poll() never reports them,
  // so a pump that stops with such input re-runs from this idle handle on the next loop turn.
  uv_idle_t buffered_input_{};
  int handles_open_ = 0;
  TerminationCause deadline_cause_ = TerminationCause::kHandshakeTimeout;
  int client_events_ = 0;    // currently polled
  int upstream_events_ = 0;
  bool handshake_wants_write_ = false;

  std::unique_ptr<HttpParser> head_parser_;
  std::unique_ptr<H2RequestScanner> h2_scanner_;
  HelloState hello_;                       // SNI and the routed port's policy, filled during the handshake
  std::unique_ptr<NodeCall> node_call_;  // the lookup at the ClientHello or the open; one at a time
  bool h2_ = false;                        // ALPN h2: the first request arrives as an HTTP/2 HEADERS frame
  uint32_t h2_stream_ = 0;                 // that request's stream, which the proxy's own answers go to
  bool tunnel_ = false;                    // HTTP/1.1 CONNECT: the proxy answers 200, the head is not forwarded
  bool answers_request_ = false;           // an HTTP request (not CONNECT, not raw TCP) is being forwarded
  size_t head_bytes_ = 0;                  // length of the HTTP/1.1 head at the front of request_
  std::vector<Credential> credentials_;    // all sent in one open; the node checks them (a 401 never wakes)
  size_t credential_index_ = 0;            // the one the node accepted; credentials_.size() for none
  std::string request_authority_;          // for the redirect that takes a query-parameter token out of the URL
  std::string request_target_;
  SandboxTraffic node_api_traffic_;        // api.<domain> bytes belong to no sandbox
  ByteBuffer request_;  // the request head and what came after it; client -> sandbox's buffer once forwarding
  std::unique_ptr<Direction> c2u_;  // client -> sandbox
  std::unique_ptr<Direction> u2c_;  // sandbox -> client
  std::unique_ptr<ByteBuffer> response_;  // the proxy's own answer
  Route route_;
  uint64_t open_started_ms_ = 0;
  uint64_t opened_at_ = 0;  // the node's stamp of the open that gave the socket (0: not opened)
  bool opened_public_ = false;  // the port needed no token
  std::string sandbox_token_sha256_;  // from the node's open: recognised (and removed) in every request

  // HTTP routes (not CONNECT, not raw TCP): every request is checked and its credentials removed.
  std::unique_ptr<Http1RequestFilter> h1_filter_;
  std::unique_ptr<H2ClientFilter> h2_filter_;
  std::unique_ptr<H2ServerFrames> h2_frames_;  // h2: the sandbox's frames, with the proxy's answers inserted
  ConsumedCredentials consumed_;
  std::string to_client_frames_;  // scratch: what the h2 filter answers itself
  // An HTTP/1.1 request after the first was refused: nothing more goes to the sandbox, and the refusal is
  // answered once the sandbox has answered (and closed) the requests before it.
  std::optional<RequestRefusal> pending_refusal_;

  SandboxTraffic* traffic_ = nullptr;  // worker-owned counters of this connection's sandbox
  bool holds_sandbox_slot_ = false;
  std::string client_slot_;  // the address whose slot this connection holds; "" = none
  bool client_closed_first_ = false;
  uint64_t last_activity_ms_ = 0;
  TerminationCause respond_cause_ = TerminationCause::kBadRequest;
  size_t lingered_bytes_ = 0;

  KtlsRxTracker ktls_rx_tracker_;  // what OpenSSL's callbacks saw, for the TLS 1.3 receive handover

  AccessRecord rec_;
};

}  // namespace sg
