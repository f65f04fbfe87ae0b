// One client connection through the ingress, following its path: accept -> TLS handshake (ClientHello
// picks the certificate) -> first request head -> route -> ask the node to open the sandbox port (waking
// it if needed) -> connect -> forward bytes both ways until both sides are done. Two timers, as in h2o: a
// deadline for whichever phase is waiting (handshake, head, wake, connect) and an idle timer while
// forwarding. Every connection ends in close(cause), which writes the access log line.
#pragma once

#include <openssl/ssl.h>
#include <uv.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "common/fd.h"
#include "common/http.h"
#include "proxy/access_log.h"
#include "proxy/edge_auth.h"
#include "proxy/h2_filter.h"
#include "proxy/h2_head.h"
#include "proxy/http1_filter.h"
#include "proxy/ktls.h"
#include "proxy/node_api.h"
#include "proxy/route.h"
#include "proxy/splice_pipe.h"
#include "proxy/tls.h"
#include "proxy/traffic.h"

namespace sg {

class Worker;
struct Config;
struct ProxySnapshot;

// A fixed-size byte buffer filled at the end and drained from the front; never reallocated.
class ByteBuffer {
 public:
  explicit ByteBuffer(size_t capacity) : data_(new char[capacity]), cap_(capacity) {}
  char* read_ptr() { return data_.get() + start_; }
  size_t readable() const { return end_ - start_; }
  char* write_ptr() { return data_.get() + end_; }
  size_t space() const { return cap_ - end_; }
  void produced(size_t n) { end_ += n; }
  void consumed(size_t n) {
    start_ += n;
    if (start_ == end_) start_ = end_ = 0;
  }
  // Moves unread bytes to the front when the tail is full (rare: only after a partial drain).
  void make_room() {
    if (end_ == cap_ && start_ > 0) {
      std::memmove(data_.get(), data_.get() + start_, end_ - start_);
      end_ -= start_;
      start_ = 0;
    }
  }
  void clear() { start_ = end_ = 0; }

 private:
  std::unique_ptr<char[]> data_;
  size_t cap_;
  size_t start_ = 0;
  size_t end_ = 0;
};

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
  bool filtered() const { return h1_filter_ || h2_filter_; }
  // Moves what c2u_ holds through the filter into c2u_out_ (and the proxy's own h2 frames toward the
  // client); false when the connection was closed.
  bool filter_client_bytes();
  // h2: moves the sandbox's frames from u2c_ into u2c_out_, with the proxy's own frames inserted.
  bool frame_upstream_bytes();
  void open_sandbox();
  void open_node_api();
  void on_open_result(Result<OpenAnswer> r);
  void start_connect(UniqueFd socket, const sockaddr* addr, socklen_t addr_len, bool already_connected);
  // Gives back the per-sandbox slot and traffic count an open took (close, or a cached route that failed).
  void release_sandbox_slot();
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

  // Forwarding primitives; each returns false when the connection was closed. The userspace ones move
  // bytes through c2u_/u2c_ with SSL_read/SSL_write; the splice ones through a pipe, with the kernel
  // doing the TLS record crypto (kTLS).
  bool read_client();
  bool write_client();
  bool read_upstream();
  bool write_upstream();
  bool splice_from_client();
  bool read_client_control_record();
  bool splice_to_upstream();
  bool splice_from_upstream();
  bool splice_to_client();
  bool handle_half_close();
  // The request on an HTTP route has had no byte back from the sandbox yet (so a 502 can still answer it).
  bool awaiting_first_response() const;
  // The sandbox side failed (detail: how); answers 502 while awaiting_first_response(). Always false.
  bool upstream_failed(std::string detail);
  void client_finished_sending();

  // kTLS: decides per connection which directions can splice and logs why not (once per reason).
  void plan_data_path(bool ktls_tx, bool ktls_rx);
  // Hands client receive to the kernel once OpenSSL holds no unread input; false when closed.
  bool take_over_client_receive();
  void set_data_path_label(bool tx_spliced, bool rx_spliced);
  // A direction planned for splice cannot; false when that closed the connection (ktls = on).
  bool ktls_downgrade(std::string why);

  // What is waiting to go each way, and whether reading the source can make progress. On a filtered
  // direction the source's bytes (c2u_, u2c_) are moved at once into what goes out (c2u_out_, u2c_out_).
  size_t c2u_out_pending() const { return c2u_out_.size() - c2u_out_sent_; }
  size_t u2c_out_pending() const { return u2c_out_.size() - u2c_out_sent_; }
  size_t c2u_queued() const { return filtered() ? c2u_out_pending() : c2u_.readable(); }
  size_t u2c_queued() const { return h2_frames_ ? u2c_out_pending() : u2c_->readable(); }
  size_t c2u_pending() const { return c2u_.readable() + c2u_out_pending() + (c2u_pipe_ ? c2u_pipe_->buffered() : 0); }
  size_t u2c_pending() const { return u2c_pipe_ ? u2c_pipe_->buffered() : u2c_->readable() + u2c_out_pending(); }
  bool c2u_room() const {
    // Spliced bytes go out only after what c2u_ holds (the request head), so the pipe fills once it is empty.
    return c2u_pipe_ ? c2u_.readable() == 0 && c2u_out_pending() == 0 && c2u_pipe_->accepts_more() &&
                           !control_record_waits_
                     : c2u_.space() > 0 && c2u_out_pending() < kMaxFilteredBytes;
  }
  bool u2c_room() const {
    return u2c_pipe_ ? u2c_pipe_->accepts_more() : u2c_->space() > 0 && u2c_out_pending() < kMaxFilteredBytes;
  }
  // Filtered bytes waiting to be sent, per direction, before the source is read again.
  static constexpr size_t kMaxFilteredBytes = 64 * 1024;
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
  SSL* ssl_ = nullptr;
  uv_poll_t client_poll_{};
  uv_poll_t upstream_poll_{};
  bool upstream_poll_started_ = false;
  uv_timer_t deadline_{};
  uv_timer_t idle_timer_{};
  // Read-ahead can leave whole records inside OpenSSL after the socket ran dry; poll() never reports them,
  // so a pump that stops with such input re-runs from this idle handle on the next loop turn.
  uv_idle_t buffered_input_{};
  bool client_read_filled_buffer_ = false;  // the last read_client stopped for room, not for want of input
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
  size_t head_bytes_ = 0;                  // length of the HTTP/1.1 head at the front of c2u_
  std::vector<Credential> credentials_;    // all sent in one open; the node checks them (a 401 never wakes)
  size_t credential_index_ = 0;            // the one the node accepted; credentials_.size() for none
  std::string request_authority_;          // for the redirect that takes a query-parameter token out of the URL
  std::string request_target_;
  SandboxTraffic node_api_traffic_;        // api.<domain> bytes belong to no sandbox
  ByteBuffer c2u_;                  // client -> upstream; also holds the request head until forwarded
  std::unique_ptr<ByteBuffer> u2c_; // upstream -> client (or the proxy's own response)
  Route route_;
  uint64_t open_started_ms_ = 0;
  uint64_t opened_at_ = 0;  // the node's stamp of the open that gave the socket (0: not opened)
  bool opened_public_ = false;  // the port needed no token
  bool cached_route_failed_ = false;  // the route cache's socket did not connect: this open asks the node
  std::string sandbox_token_sha256_;  // from the node's open: recognised (and removed) in every request

  // HTTP routes (not CONNECT, not raw TCP): every request is checked and its credentials removed.
  std::unique_ptr<Http1RequestFilter> h1_filter_;
  std::unique_ptr<H2ClientFilter> h2_filter_;
  std::unique_ptr<H2ServerFrames> h2_frames_;  // h2: the sandbox's frames, with the proxy's answers inserted
  ConsumedCredentials consumed_;
  std::string c2u_out_;  // filtered client bytes for the sandbox
  size_t c2u_out_sent_ = 0;
  std::string u2c_out_;  // h2: the sandbox's frames and the proxy's own for the client
  size_t u2c_out_sent_ = 0;
  std::string to_client_frames_;  // scratch: what the h2 filter answers itself
  // An HTTP/1.1 request after the first was refused: nothing more goes to the sandbox, and the refusal is
  // answered once the sandbox has answered (and closed) the requests before it.
  std::optional<RequestRefusal> pending_refusal_;

  SandboxTraffic* traffic_ = nullptr;  // worker-owned counters of this connection's sandbox
  bool holds_sandbox_slot_ = false;
  std::string client_slot_;  // the address whose slot this connection holds; "" = none
  bool client_eof_ = false;
  bool upstream_eof_ = false;
  bool upstream_shut_ = false;       // FIN sent to the sandbox
  bool client_shut_ = false;         // close_notify sent to the client
  bool client_closed_first_ = false;
  uint64_t last_activity_ms_ = 0;
  TerminationCause respond_cause_ = TerminationCause::kBadRequest;
  size_t lingered_bytes_ = 0;

  // kTLS + splice. ktls_tx_ is the kernel's (OpenSSL offloaded it). Receive is handed over once the
  // request head is read and OpenSSL holds nothing more (rx_handover_); until then it is SSL_read.
  enum class RxHandover { kNone, kOffloadedByOpenSsl, kInstallTls13Key };
  KtlsRxTracker ktls_rx_tracker_;
  bool ktls_tx_ = false;
  RxHandover rx_handover_ = RxHandover::kNone;
  std::unique_ptr<SplicePipe> c2u_pipe_;  // set: client -> sandbox is spliced
  std::unique_ptr<SplicePipe> u2c_pipe_;  // set: sandbox -> client is spliced
  // splice stopped at a non-data TLS record while the pipe still held bytes for the sandbox: the record
  // is read (recvmsg) only once those are delivered, so the order of the stream is kept.
  bool control_record_waits_ = false;

  AccessRecord rec_;
};

}  // namespace sg
