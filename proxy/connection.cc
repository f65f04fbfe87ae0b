#include "proxy/connection.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "common/net.h"
#include "proxy/fleet_context.h"
#include "proxy/fleet_hop.h"
#include "proxy/h2_filter.h"
#include "proxy/h2_head.h"
#include "proxy/http1_filter.h"
#include "proxy/http1_response_tracker.h"
#include "proxy/ktls.h"
#include "proxy/worker.h"

namespace sg {
namespace {

// Per direction. A TLS record carries at most 16 KiB; two records per read keeps syscalls per byte low.
constexpr size_t kForwardBufferBytes = 32 * 1024;
// After an error response: how long and how much unread client input we drain before closing.
constexpr uint32_t kLingerMs = 2000;
// Rounds of moving bytes each way per pump before the loop serves the other connections (ForwardPhase::pump).
constexpr int kPumpRounds = 8;
constexpr size_t kMaxLingerBytes = 4 * 1024 * 1024;

uint64_t now_ms(uv_loop_t* loop) { return uv_now(loop); }

}  // namespace

// ---- The phases ----------------------------------------------------------------------------------------

// What every phase answers to. The defaults are "nothing to do here": a phase overrides the events it
// waits for.
class Connection::Phase {
 public:
  explicit Phase(Connection& c) : c_(c) {}
  virtual ~Phase() = default;
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

  virtual PhaseKind kind() const = 0;
  // What it waits for on each socket (UV_READABLE / UV_WRITABLE).
  virtual int client_interest() const { return 0; }
  virtual int upstream_interest() const { return 0; }
  virtual void on_client() {}
  virtual void on_upstream(int /*status*/) {}
  // poll() reported the socket readable, before on_client()/on_upstream() of the same event.
  virtual void client_readable() {}
  virtual void upstream_readable() {}
  // Its deadline passed (arm_deadline).
  virtual void on_deadline() { c_.close(c_.deadline_cause_); }
  // Why the connection ended when the client's socket fails while this phase polls it.
  virtual TerminationCause client_failure_cause() const { return TerminationCause::kClientClosed; }
  // The phase is left (or the connection closed): what it started must not call back.
  virtual void stop() {}
  // The proxy drains (Worker::drain): a phase that can end the connection cleanly does so.
  virtual void drain_tick() {}
  // The connection has been quiet for a while: memory kept for the next bytes goes back. True while some
  // is still held (bytes in flight).
  virtual bool release_memory_while_idle() { return false; }

 protected:
  Connection& c_;
};

// TLS handshake, paused at the ClientHello while the node is asked for the routed port's policy.
class Connection::HandshakePhase final : public Phase {
 public:
  using Phase::Phase;
  PhaseKind kind() const override { return PhaseKind::kHandshake; }
  int client_interest() const override { return lookup_ ? 0 : wants_write_ ? UV_WRITABLE : UV_READABLE; }
  void on_client() override { run(); }
  void stop() override { lookup_.reset(); }

  void run();

 private:
  void look_up_port_policy();
  void on_lookup_result(const std::string& target, Result<LookupAnswer> r);
  // Whether this ClientHello should start waking its sandbox (proxy.wake_at_client_hello): it names a
  // sandbox port that no live cached route says is running. Asked once per connection.
  bool wants_prewake(const Route& route, uint16_t port);
  void send_prewake(const Route& route, uint16_t port);
  void finished();

  bool wants_write_ = false;
  std::unique_ptr<NodeCall> lookup_;
};

// The first request: an HTTP/1.1 head, or on h2 the first HEADERS; it routes the connection.
class Connection::HeadPhase final : public Phase {
 public:
  explicit HeadPhase(Connection& c);
  PhaseKind kind() const override { return PhaseKind::kHead; }
  int client_interest() const override { return UV_READABLE; }
  void on_client() override { read(); }
  void on_deadline() override {
    c_.respond(408, "request head not received in time\n", TerminationCause::kHeadTimeout);
  }

  void read();

 private:
  // Bytes already in the buffer when the phase starts (on a hop: what followed the preamble), parsed first.
  size_t leftover_ = 0;
  std::unique_ptr<HttpParser> parser_;        // HTTP/1.1
  std::unique_ptr<H2RequestScanner> scanner_;  // h2
};

// The node opens the sandbox port, waking the sandbox if needed. Nothing is read meanwhile.
class Connection::OpenPhase final : public Phase {
 public:
  using Phase::Phase;
  PhaseKind kind() const override { return PhaseKind::kOpen; }
  void on_deadline() override {
    c_.respond(503, "sandbox did not wake in time\n", TerminationCause::kWakeTimeout, {{"Retry-After", "5"}});
  }
  void stop() override { call_.reset(); }

  std::unique_ptr<NodeCall> call_;
};

// The fleet listener, after the mutual-TLS handshake: the first proxy's preamble (fleet_hop.h) names the
// client's host, protocol and address. This node's directory view decides: it owns the sandbox (or does not
// know it: its own node answers, 404 if it has none) and answers "ok", or names the owner it knows of.
class Connection::PreamblePhase final : public Phase {
 public:
  explicit PreamblePhase(Connection& c) : Phase(c) {
    c.arm_deadline(c.cfg()->proxy.request_head_timeout_ms, TerminationCause::kHeadTimeout);
  }
  PhaseKind kind() const override { return PhaseKind::kPreamble; }
  int client_interest() const override { return UV_READABLE; }
  void on_client() override { read(); }
  void on_deadline() override { c_.close(TerminationCause::kHeadTimeout, "no hop preamble in time"); }

  void read();

 private:
  void received(fleet::Preamble p, size_t consumed);
};

// The first proxy's side of a hop: connect to the owning node's fleet listener, mutual TLS (the peer must
// be the node the directory names), send the preamble, and wait for the answer before any client byte
// goes: a redirect is then followed (once) with nothing sent anywhere yet.
class Connection::HopPhase final : public Phase {
 public:
  HopPhase(Connection& c, fleet::NodeInfo node) : Phase(c), node_(std::move(node)) {}
  ~HopPhase() override { close_attempt(); }
  PhaseKind kind() const override { return PhaseKind::kHop; }
  void on_deadline() override { failed("no answer within proxy.connect_timeout_ms"); }
  void stop() override { close_attempt(); }

  void begin();

 private:
  enum class Step { kConnecting, kHandshaking, kSending, kAwaitingAnswer };
  void poll_for(int events);
  void advance();
  // TLS says what it waits for; false when the hop failed (answered).
  bool wait_for(int ssl_result, const char* what);
  void answered(const fleet::Answer& a);
  void failed(const std::string& why);
  void close_poll();
  void close_attempt();

  fleet::NodeInfo node_;
  int redirects_ = 0;
  Step step_ = Step::kConnecting;
  UniqueFd fd_;
  SSL* ssl_ = nullptr;
  uv_poll_t* poll_ = nullptr;  // its own handle per attempt: a redirect's retry polls another socket
  std::string out_;
  size_t sent_ = 0;
  std::string in_;
};

// A non-blocking connect to the sandbox port (or to the node's socket for api.<domain>).
class Connection::ConnectPhase final : public Phase {
 public:
  using Phase::Phase;
  PhaseKind kind() const override { return PhaseKind::kConnect; }
  int upstream_interest() const override { return UV_WRITABLE; }
  void on_upstream(int) override;
  void on_deadline() override {
    c_.respond(504, "sandbox port did not accept the connection in time\n", TerminationCause::kUpstreamConnectTimeout);
  }
};

// Both directions, each a Direction between the two transports; on HTTP routes every request goes
// through the request filter (checked, its credentials taken out), and on h2 the proxy's own answers to
// refused streams go between the sandbox's frames.
class Connection::ForwardPhase final : public Phase {
 public:
  explicit ForwardPhase(Connection& c);
  PhaseKind kind() const override { return PhaseKind::kForward; }
  int client_interest() const override {
    return (c2u_.wants_source_readable() ? UV_READABLE : 0) | (u2c_.wants_sink_writable() ? UV_WRITABLE : 0);
  }
  int upstream_interest() const override {
    return (u2c_.wants_source_readable() ? UV_READABLE : 0) | (c2u_.wants_sink_writable() ? UV_WRITABLE : 0);
  }
  void on_client() override { pump(); }
  void on_upstream(int status) override;
  void client_readable() override { c2u_.source_readable(); }
  void upstream_readable() override { u2c_.source_readable(); }
  TerminationCause client_failure_cause() const override { return TerminationCause::kClientReset; }

  // HTTP routes: every client byte goes through the request filter of the connection's protocol.
  void start_request_filters();
  void pump();
  bool spliced_to_client() const { return u2c_.spliced(); }
  bool spliced_from_client() const { return c2u_.spliced(); }
  bool start() { return c2u_.run_stage(); }
  void drain_tick() override;
  bool release_memory_while_idle() override {
    c2u_.release_memory_while_idle();
    u2c_.release_memory_while_idle();
    c_.client_->release_memory_while_idle();
    c_.upstream_->release_memory_while_idle();
    if (h1_filter_) h1_filter_->release_memory_while_idle();
    return holds_memory();
  }

 private:
  // Each direction's events, declared before the directions that hold them. What both directions do alike
  // is in the base.
  class Events : public DirectionEvents {
   public:
    explicit Events(ForwardPhase& f) : f_(f) {}
    bool splice_refused(std::string why) override { return f_.c_.ktls_downgrade(std::move(why)); }

   protected:
    ForwardPhase& f_;
  };
  class ClientToSandboxEvents final : public Events {
   public:
    using Events::Events;
    void received(size_t n) override;
    bool source_finished() override;
    bool source_failed(IoResult r) override;
    bool sink_failed(IoResult r) override;
    bool may_splice() const override;
  };
  class SandboxToClientEvents final : public Events {
   public:
    using Events::Events;
    void received(size_t n) override;
    void observe(std::string_view bytes) override;
    uint64_t splice_budget() const override;
    void passed_unseen(size_t n) override;
    bool source_finished() override;
    bool source_failed(IoResult r) override;
    bool sink_failed(IoResult r) override;
    bool may_splice() const override;
  };
  // The client -> sandbox stage: the client's bytes through the filter (and the proxy's own h2 frames
  // toward the client); false when the connection was closed.
  bool filter_client_bytes(std::string_view in, std::string& out);
  // The sandbox -> client stage on h2: the sandbox's frames, with the proxy's own inserted.
  bool frame_upstream_bytes(std::string_view in, std::string& out);
  Http1Verdict check_http1_request(Http1Request& r);
  H2Verdict check_h2_request(H2Request& r);
  // The client's input must go through the HTTP/1.1 or h2 filter (not be spliced past it).
  bool requests_are_read() const {
    return h2_filter_ || (h1_filter_ && (h1_filter_->state() == Http1RequestFilter::State::kRequests ||
                                         h1_filter_->state() == Http1RequestFilter::State::kAwaitingSwitch));
  }
  // The sandbox's bytes, watched by responses_ (an Upgrade's answer releases what the filter held).
  void observe_responses(std::string_view bytes);
  // Each side that finished sending is told so once its bytes are delivered; false when closed.
  bool handle_half_close();
  // The request on an HTTP route has had no byte back from the sandbox yet (so a 502 can still answer it).
  bool awaiting_first_response() const;
  bool holds_memory() const { return c2u_.holds_memory() || u2c_.holds_memory(); }
  // The sandbox side failed (detail: how); answers 502 while awaiting_first_response(). Always false.
  bool upstream_failed(std::string detail);
  void count(uint64_t& record, uint64_t& traffic, size_t n);

  ClientToSandboxEvents client_to_sandbox_events_{*this};
  SandboxToClientEvents sandbox_to_client_events_{*this};
  Direction c2u_;  // client -> sandbox
  Direction u2c_;  // sandbox -> client
  std::unique_ptr<Http1RequestFilter> h1_filter_;
  // HTTP/1.1 on a copied sandbox -> client direction: where the sandbox's answers end (for a refused request
  // after forwarded ones, and for an Upgrade the sandbox may refuse). Not on a direction that splices into
  // kTLS: there the stream passes unseen, and a refusal waits for the sandbox to close.
  std::unique_ptr<Http1ResponseTracker> responses_;
  std::unique_ptr<H2ClientFilter> h2_filter_;
  std::unique_ptr<H2ServerFrames> h2_frames_;  // h2: the sandbox's frames, with the proxy's answers inserted
  ConsumedCredentials consumed_;
  std::string to_client_frames_;  // scratch: what the h2 filter answers itself
  // An HTTP/1.1 request after the first was refused: nothing more goes to the sandbox, and the refusal is
  // answered once the sandbox has answered (and closed) the requests before it.
  std::optional<RequestRefusal> pending_refusal_;
  bool client_closed_first_ = false;
  // Draining: the h2 client was told GOAWAY; the bytes both ways at the last tick (UINT64_MAX: none yet).
  bool drain_goaway_sent_ = false;
  uint64_t drain_seen_bytes_ = UINT64_MAX;
  // h2: the client broke the connection in a later request (an HPACK failure, an oversized block). Its
  // GOAWAY is queued between the sandbox's frames; once it is out nothing more is read from either side,
  // and the connection ends with this cause when what is buffered has been delivered.
  struct ConnectionError {
    TerminationCause cause;
    std::string detail;
  };
  std::optional<ConnectionError> goaway_;
  // The GOAWAY has left the frame queue: stop reading the sandbox (false when closed).
  bool stop_after_goaway();
};

// The proxy's own answer going out; a client that does not read it is bounded by the deadline.
class Connection::RespondPhase final : public Phase {
 public:
  RespondPhase(Connection& c, std::string bytes, TerminationCause cause)
      : Phase(c), out_(std::move(bytes)), cause_(cause) {}
  PhaseKind kind() const override { return PhaseKind::kRespond; }
  int client_interest() const override { return UV_WRITABLE; }
  void on_client() override { flush(); }
  TerminationCause client_failure_cause() const override { return TerminationCause::kClientReset; }

  void flush();

 private:
  std::string out_;
  size_t sent_ = 0;
  TerminationCause cause_;
};

// The answer is out: the client's unread input is drained (and dropped) for a moment, so closing does not
// turn into a TCP reset that destroys the answer before it is read.
class Connection::LingerPhase final : public Phase {
 public:
  LingerPhase(Connection& c, TerminationCause cause) : Phase(c), cause_(cause) {}
  PhaseKind kind() const override { return PhaseKind::kLinger; }
  int client_interest() const override { return UV_READABLE; }
  void on_client() override { drain(); }
  // The client reset while we drained: the connection still ended for the reason we answered.
  TerminationCause client_failure_cause() const override { return cause_; }

  void drain();

 private:
  TerminationCause cause_;
  size_t drained_ = 0;
};

class Connection::ClosedPhase final : public Phase {
 public:
  using Phase::Phase;
  PhaseKind kind() const override { return PhaseKind::kClosed; }
  void on_deadline() override {}
};

template <class P, class... Args>
P& Connection::enter(Args&&... args) {
  if (phase_) {
    phase_->stop();
    left_phases_.push_back(std::move(phase_));
  }
  auto next = std::make_unique<P>(*this, std::forward<Args>(args)...);
  P& p = *next;
  phase_ = std::move(next);
  return p;
}

Connection::PhaseKind Connection::phase() const { return phase_->kind(); }

std::string_view Connection::phase_name(PhaseKind k) {
  switch (k) {
    case PhaseKind::kHandshake: return "handshake";
    case PhaseKind::kPreamble: return "preamble";
    case PhaseKind::kHop: return "hop";
    case PhaseKind::kHead: return "head";
    case PhaseKind::kOpen: return "open";
    case PhaseKind::kConnect: return "connect";
    case PhaseKind::kForward: return "forward";
    case PhaseKind::kRespond: return "respond";
    case PhaseKind::kLinger: return "linger";
    case PhaseKind::kClosed: return "closed";
  }
  return "unknown";
}

void Connection::drop_left_phases() { left_phases_.clear(); }

const Config* Connection::cfg() const { return snapshot_->config.get(); }
TlsContexts* Connection::tls() const { return snapshot_->tls.get(); }
const FleetContext* Connection::fleet() const { return snapshot_->fleet.get(); }

void Connection::pump_again() {
  pump_again_queued_ = false;
  drop_left_phases();
  if (phase() == PhaseKind::kForward) static_cast<ForwardPhase*>(phase_.get())->pump();
}

// ---- The connection ------------------------------------------------------------------------------------

Connection::Connection(Worker* worker, UniqueFd client, std::string peer, bool via_fleet)
    : worker_(worker),
      snapshot_(worker->shared()->snapshot()),
      client_fd_(std::move(client)),
      // The head must fit in the buffer that later forwards it; one byte more detects "too large".
      request_(std::max<size_t>(kForwardBufferBytes, snapshot_->config->proxy.max_request_head_bytes + 1)) {
  via_fleet_ = via_fleet;
  rec_.started_at = std::chrono::system_clock::now();
  rec_.started_steady = std::chrono::steady_clock::now();
  rec_.client = std::move(peer);
  uv_loop_t* loop = worker_->loop();
  client_watch_.init(&worker_->sockets(), client_fd_.get(), [](void* self, int st, int ev) {
    static_cast<Connection*>(self)->on_client_io(st, ev);
  }, this);
  uv_timer_init(loop, &deadline_);
  uv_timer_init(loop, &idle_timer_);
  deadline_.data = idle_timer_.data = this;
  handles_open_ = 2;
  enter<HandshakePhase>();
}

Connection::~Connection() = default;

void Connection::start() {
  auto& handshake = static_cast<HandshakePhase&>(*phase_);
  // A reload may have turned the fleet off while the listener stays bound (listeners are read at start).
  if (via_fleet_ && !fleet()) return close(TerminationCause::kHandshakeFailed, "proxy.fleet_cert is no longer set");
  SSL* ssl = SSL_new(via_fleet_ ? fleet()->server.get() : tls()->default_ctx());
  if (!ssl) return close(TerminationCause::kHandshakeFailed, "SSL_new: " + take_ssl_error());
  // The fleet's contexts track secrets only where kTLS can take them.
  std::unique_ptr<Tls13SecretTracker> secrets;
  if (via_fleet_ ? tls()->ktls_possible() : tls()->tracks_tls13_secrets())
    secrets = std::make_unique<Tls13SecretTracker>();
  const bool may_leave_openssl = !via_fleet_ && tls()->own_record_layer();
  auto tls = std::make_unique<TlsTransport>(ssl, client_fd_.get(), std::move(secrets), may_leave_openssl);
  client_tls_ = tls.get();
  client_ = std::move(tls);
  SSL_set_fd(ssl, client_fd_.get());
  SSL_set_accept_state(ssl);
  SSL_set_ex_data(ssl, hello_ex_index(), &hello_);
  arm_deadline(cfg()->proxy.handshake_timeout_ms, TerminationCause::kHandshakeTimeout);
  handshake.run();
}

void Connection::arm_deadline(uint32_t ms, TerminationCause cause) {
  deadline_cause_ = cause;
  uv_timer_start(&deadline_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->on_deadline(); }, ms, 0);
}

void Connection::on_deadline() {
  drop_left_phases();
  phase_->on_deadline();
}

void Connection::on_idle_timer() {
  uint64_t idle_ms = uint64_t{cfg()->proxy.idle_timeout_secs} * 1000;
  uint64_t quiet = now_ms(worker_->loop()) - last_activity_ms_;
  if (quiet >= idle_ms) return close(TerminationCause::kIdleTimeout);
  // Activity is recorded as a timestamp (no timer restart per read); re-arm for the remainder.
  uint64_t next = idle_ms - quiet;
  if (holding_buffers_) {
    if (quiet < kReleaseIdleMemoryAfterMs) {
      next = std::min(next, kReleaseIdleMemoryAfterMs - quiet);
    } else {
      const bool in_flight = phase_->release_memory_while_idle();
      note_own_records();
      if (in_flight) {
        next = std::min(next, kReleaseIdleMemoryAfterMs);  // bytes in flight keep their memory: again later
      } else {
        holding_buffers_ = false;
        worker_->shared()->metrics.buffers_held(-1);
      }
    }
  }
  arm_idle_timer(next);
}

void Connection::arm_idle_timer(uint64_t ms) {
  uv_timer_start(&idle_timer_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->on_idle_timer(); }, ms, 0);
}

void Connection::release_memory_when_quiet() {
  if (holding_buffers_) return;
  holding_buffers_ = true;
  worker_->shared()->metrics.buffers_held(1);
  // The timer is due at the idle timeout (tens of seconds) or sooner.
  if (!uv_is_active(reinterpret_cast<uv_handle_t*>(&idle_timer_)) ||
      uv_timer_get_due_in(&idle_timer_) > kReleaseIdleMemoryAfterMs)
    arm_idle_timer(kReleaseIdleMemoryAfterMs);
}

// May close the connection (the kernel refused to watch a socket): a caller that goes on checks phase().
void Connection::update_interest() {
  if (phase() == PhaseKind::kClosed) return;
  Status s = client_watch_.set(phase_->client_interest());
  if (s && upstream_watch_.initialized()) s = upstream_watch_.set(phase_->upstream_interest());
  if (!s) close(TerminationCause::kSocketWatchFailed, s.failure().message);
}

void Connection::watch_upstream() {
  upstream_watch_.init(&worker_->sockets(), upstream_fd_.get(), [](void* self, int st, int ev) {
    static_cast<Connection*>(self)->on_upstream_io(st, ev);
  }, this);
}

void Connection::on_client_io(int status, int events) {
  drop_left_phases();
  if (status < 0) return close(phase_->client_failure_cause(), uv_strerror(status));
  if (events & UV_READABLE) phase_->client_readable();
  phase_->on_client();
}

void Connection::on_upstream_io(int status, int events) {
  drop_left_phases();
  if (status == 0 && (events & UV_READABLE)) phase_->upstream_readable();
  phase_->on_upstream(status);
}

// ---- Handshake ----

void Connection::HandshakePhase::run() {
  clear_stale_ssl_errors();
  SSL* ssl = c_.client_tls_->ssl();
  int r = SSL_do_handshake(ssl);
  c_.rec_.sni = c_.hello_.sni;
  int err = r == 1 ? SSL_ERROR_NONE : SSL_get_error(ssl, r);
  if (err == SSL_ERROR_WANT_CLIENT_HELLO_CB) return look_up_port_policy();
  // The ClientHello was read and answered without a lookup (a cached policy, or an HTTP/1.1-only ALPN). On
  // loopback the client's Finished may even arrive within this same call (r == 1).
  if ((r == 1 || err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) && !c_.prewake_asked_ &&
      !c_.hello_.sni.empty() && c_.cfg()->proxy.wake_at_client_hello) {
    auto route = parse_route(c_.hello_.sni, c_.cfg()->domain);
    if (route && route->kind != RouteKind::kApi) {
      uint16_t port = route->kind == RouteKind::kSdk ? c_.cfg()->agent_port : route->port;
      if (wants_prewake(*route, port)) send_prewake(*route, port);
    } else {
      c_.prewake_asked_ = true;  // nothing to wake: not parsed again at the next handshake step
    }
  }
  if (r == 1) return finished();
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
    wants_write_ = err == SSL_ERROR_WANT_WRITE;
    return c_.update_interest();
  }
  if (!c_.rec_.sni.empty() && c_.tls()->select(c_.rec_.sni) == nullptr)
    return c_.close(TerminationCause::kUnknownSni, "no certificate for " + c_.rec_.sni);
  // A peer that connects and leaves (health checks, port scans) did not fail a handshake.
  if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0))
    return c_.close(TerminationCause::kClientClosed, "closed during the TLS handshake");
  c_.close(TerminationCause::kHandshakeFailed, take_ssl_error());
}

// The ClientHello callback paused the handshake: the ALPN choice and the connection's mode depend on the
// routed port's policy (tls.cc). The node answers from memory, without waking the sandbox.
void Connection::HandshakePhase::look_up_port_policy() {
  HelloState& hello = c_.hello_;
  auto route = parse_route(hello.sni, c_.cfg()->domain);
  if (!route || route->kind == RouteKind::kApi) {
    hello.policy_known = true;  // nothing to look up; the request head decides
    return run();
  }
  uint16_t port = route->kind == RouteKind::kSdk ? c_.cfg()->agent_port : route->port;
  // Another node's sandbox: its policy is the one its owner published in etcd (this node has none for it),
  // and the owner's node decides the connection itself once the hop reaches it.
  if (c_.fleet() && c_.fleet()->directory && !c_.via_fleet_) {
    fleet::Decision d = fleet::decide(c_.fleet()->directory.get(), c_.fleet()->self, route->target);
    if (d.kind != fleet::Decision::Kind::kLocal) {
      hello.policy_known = true;
      c_.prewake_asked_ = true;  // woken on its own node, by the hop
      if (d.ports)
        for (const fleet::PortRoute& p : *d.ports)
          if (p.port == port) {
            hello.port_protocol = p.protocol;
            hello.port_public = p.is_public;
          }
      return run();
    }
  }
  const bool prewake = wants_prewake(*route, port);
  // A port seen within the cache's bound needs no node round trip here: the open is the connection's only one.
  if (auto known = c_.worker_->routes().find(route->target, port, now_ms(c_.worker_->loop()))) {
    hello.policy_known = true;
    hello.port_protocol = known->protocol;
    hello.port_public = known->is_public;
    if (prewake) send_prewake(*route, port);
    return run();
  }
  // Bounded well inside the handshake deadline: a node that does not answer soon costs only the port's
  // policy (no h2 offer, no raw-TCP mode), and the request head then gets the node's real answer (or 503).
  uint32_t lookup_ms = std::min(c_.cfg()->proxy.wake_timeout_ms, c_.cfg()->proxy.handshake_timeout_ms / 2);
  c_.worker_->shared()->metrics.node_call(NodeCallKind::kLookup);
  c_.rec_.prewake = prewake;
  lookup_ = c_.worker_->node().lookup(route->target, port, ClientHint{c_.client_address(), prewake}, lookup_ms,
                                      [this, target = route->target](Result<LookupAnswer> r) {
                                        c_.drop_left_phases();
                                        on_lookup_result(target, std::move(r));
                                      });
  c_.update_interest();
}

void Connection::HandshakePhase::on_lookup_result(const std::string& target, Result<LookupAnswer> r) {
  auto call = std::move(lookup_);  // destroyed when this function returns, after its callback
  // Whatever the answer, the handshake goes on: an unknown sandbox or port is answered (404/403) over
  // HTTP once the head names it, which a client can show, unlike a failed handshake.
  HelloState& hello = c_.hello_;
  hello.policy_known = true;
  if (r && r->status == 200) {
    hello.port_protocol = r->policy.protocol;
    hello.port_public = r->policy.is_public;
    c_.remember_lookup(target, *r);
  } else if (!r) {
    spdlog::warn("port policy lookup failed: {}", r.message());
  }
  run();
}

bool Connection::HandshakePhase::wants_prewake(const Route& route, uint16_t port) {
  if (c_.prewake_asked_) return false;
  c_.prewake_asked_ = true;
  if (!c_.cfg()->proxy.wake_at_client_hello || c_.via_fleet_) return false;
  // Another node's sandbox is woken by the hop's own connection on its node; this node does not know it.
  if (c_.fleet() && c_.fleet()->directory &&
      fleet::decide(c_.fleet()->directory.get(), c_.fleet()->self, route.target).kind != fleet::Decision::Kind::kLocal)
    return false;
  // A sandbox this worker routes from its cache, or that the node said was awake, is running: nothing to
  // wake, and no node call.
  return !c_.worker_->routes().known_awake(route.target, port, now_ms(c_.worker_->loop()));
}

// The policy is known without the node, so the wake is asked for by a lookup of its own, whose answer only
// refreshes the cached policy. It belongs to the connection, not this phase: the handshake may finish first.
void Connection::HandshakePhase::send_prewake(const Route& route, uint16_t port) {
  Connection& c = c_;
  c.rec_.prewake = true;
  c.worker_->shared()->metrics.node_call(NodeCallKind::kLookup);
  uint32_t lookup_ms = std::min(c.cfg()->proxy.wake_timeout_ms, c.cfg()->proxy.handshake_timeout_ms / 2);
  c.prewake_ = c.worker_->node().lookup(route.target, port, ClientHint{c.client_address(), true}, lookup_ms,
                                        [&c, target = route.target](Result<LookupAnswer> r) {
                                          auto call = std::move(c.prewake_);  // destroyed after its callback
                                          if (r && r->status == 200) c.remember_lookup(target, *r);
                                        });
}

// The policy for the next ClientHellos, and when the node said the sandbox is running or waking, that the
// next ones need not ask it to wake.
void Connection::remember_lookup(const std::string& target, const LookupAnswer& a) {
  const uint64_t now = now_ms(worker_->loop());
  worker_->routes().store(target, a.port, a.policy, now);
  if (a.prewake == "not_asleep" || a.prewake == "woke") worker_->routes().mark_awake(target, a.port, now);
}

void Connection::HandshakePhase::finished() {
  Connection& c = c_;  // this phase is left below
  SSL* ssl = c.client_tls_->ssl();
  c.client_tls_->handshake_finished();
  c.rec_.tls_resumed = SSL_session_reused(ssl) == 1;
  c.worker_->shared()->metrics.handshake_done(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - c.rec_.started_steady).count(),
      c.rec_.tls_resumed);
  const unsigned char* alpn = nullptr;
  unsigned alpn_len = 0;
  SSL_get0_alpn_selected(ssl, &alpn, &alpn_len);
  c.h2_ = alpn_len == 2 && std::memcmp(alpn, "h2", 2) == 0;
  c.rec_.tls_version = SSL_get_version(ssl);
  if (c.via_fleet_) c.rec_.hop_from = peer_node_name(ssl);
  c.plan_data_path();  // may free the SSL
  if (c.cfg()->proxy.ktls == KtlsMode::kOn && c.client_tls_ != nullptr)
    return c.close(TerminationCause::kKtlsRequired, "ktls = on but this connection could not be offloaded");
  if (c.via_fleet_) return c.enter<PreamblePhase>().read();
  // A public raw-TCP port (sshd speaks first) has no request head: the SNI names the destination.
  if (c.headless_tcp()) {
    auto route = parse_route(c.rec_.sni, c.cfg()->domain);
    if (route && route->kind == RouteKind::kPort) {
      c.headless_ = true;
      c.rec_.host = c.rec_.sni;
      c.route_ = std::move(*route);
      c.rec_.sandbox = c.route_.target;
      c.rec_.port = c.route_.port;
      return c.open_sandbox();
    }
  }
  c.enter<HeadPhase>().read();
}

// Transmit is the kernel's when OpenSSL offloaded it; bytes from the sandbox can then splice into the socket.
// Receive is OpenSSL's for TLS 1.2 when it offloaded it, ours to hand over for TLS 1.3 (proxy/ktls.h). With
// both the kernel's, OpenSSL has nothing left to do: the SSL is freed, and the connection reads and writes
// the socket itself (KernelTlsTransport); both directions can splice.
void Connection::plan_data_path() {
  TlsTransport& openssl = *client_tls_;
  openssl.plan_ktls();
  const bool tx = openssl.ktls_tx();
  std::string why;
  if (cfg()->proxy.ktls == KtlsMode::kOff) {
    why = "ktls = off in the config";
  } else if (!tls()->ktls_kernel_reason().empty()) {
    why = tls()->ktls_kernel_reason();
  } else if (auto st = openssl.hand_receive_to_kernel(); !st) {
    why = st.message();
  } else {
    openssl.keep_session_when_freed();
    client_tls_ = nullptr;
    client_ = std::make_unique<KernelTlsTransport>(client_fd_.get());
  }
  if (client_tls_) client_tls_->forget_secrets_unless_needed();
  set_data_path_label(tx, client_tls_ == nullptr);
  if (!why.empty()) log_ktls_fallback_once(why);
}

// The client transport may have left OpenSSL for the proxy's own record layer (TlsTransport, at a read or
// while the connection was quiet): the access log and the metrics say so, once.
void Connection::note_own_records() {
  if (client_tls_ == nullptr || !client_tls_->own_records() || rec_.data_path == kOwnRecordsPath) return;
  rec_.data_path = kOwnRecordsPath;
  worker_->shared()->metrics.tls_own_records();
}

void Connection::set_data_path_label(bool tx_spliced, bool rx_spliced) {
  rec_.data_path = tx_spliced && rx_spliced ? "ktls-splice"
                   : tx_spliced             ? "ktls-tx-only"
                   : rx_spliced             ? "ktls-rx-only"
                                            : "userspace";
}

// A direction that could splice cannot after all (no pipe): with ktls = on that refuses the connection,
// otherwise its bytes are copied through the same transports.
bool Connection::ktls_downgrade(std::string why) {
  log_ktls_fallback_once(why);
  auto* forward = phase() == PhaseKind::kForward ? static_cast<ForwardPhase*>(phase_.get()) : nullptr;
  set_data_path_label(forward && forward->spliced_to_client(),
                      (forward && forward->spliced_from_client()) || client_tls_ == nullptr);
  if (cfg()->proxy.ktls != KtlsMode::kOn) return true;
  close(TerminationCause::kKtlsRequired, std::move(why));
  return false;
}

// ---- Head ----

Connection::HeadPhase::HeadPhase(Connection& c) : Phase(c) {
  if (c.h2_) {
    // Everything scanned stays in request_ to be forwarded, so the scan may not outgrow it.
    scanner_ = std::make_unique<H2RequestScanner>(H2ScanLimits{
        .max_bytes_before_request = c.request_.space() - 1, .max_header_list_bytes = c.cfg()->proxy.max_request_head_bytes});
  } else {
    parser_ = std::make_unique<HttpParser>(
        HttpParser::Kind::kRequest, HttpLimits{c.cfg()->proxy.max_request_head_bytes, 0, /*stop_after_head=*/true});
  }
  leftover_ = c.request_.readable();
  c.arm_deadline(c.cfg()->proxy.request_head_timeout_ms, TerminationCause::kHeadTimeout);
}

void Connection::HeadPhase::read() {
  ByteBuffer& buf = c_.request_;
  for (;;) {
    const size_t leftover = std::exchange(leftover_, 0);
    IoResult r = leftover > 0 ? IoResult::ok(leftover) : c_.client_->read(std::span<char>(buf.write_ptr(), buf.space()));
    if (r.bytes > 0) {
      const char* fresh = leftover > 0 ? buf.read_ptr() : buf.write_ptr();
      if (leftover == 0) buf.produced(r.bytes);
      if (scanner_) {
        auto scanned = scanner_->scan(std::string_view(buf.read_ptr(), buf.readable()));
        if (!scanned) {
          bool too_large = scanned.error() == Error::kLimitExceeded;
          c_.rec_.detail = scanned.message();
          // A malformed request is an error of its stream only (RFC 9113 §8.1.1): a 400 the client can read
          // on it, then GOAWAY(NO_ERROR). A broken connection gets GOAWAY with the error code.
          if (const uint32_t stream = scanner_->malformed_stream(); stream != 0) {
            c_.h2_stream_ = stream;
            return c_.respond(400, scanned.message() + "\n", TerminationCause::kBadRequest);
          }
          return c_.respond_bytes(h2_goaway(scanner_->goaway_code(), scanned.message()),
                                  too_large ? TerminationCause::kHeadTooLarge : TerminationCause::kBadRequest);
        }
        if (*scanned) {
          H2Request& req = **scanned;
          c_.h2_stream_ = req.stream_id;
          return c_.on_request(req.authority, req.method, req.path, req.headers);
        }
      } else {
        switch (parser_->feed(fresh, r.bytes)) {
          case HttpParser::State::kNeedMore:
            break;
          case HttpParser::State::kHeadComplete:
          case HttpParser::State::kMessageComplete: {
            c_.head_bytes_ = buf.readable() - r.bytes + parser_->consumed();
            const HttpMessage& msg = parser_->message();
            const std::string* host_header = msg.header("host");
            return c_.on_request(host_header ? *host_header : c_.rec_.sni, msg.method, msg.target, msg.headers);
          }
          case HttpParser::State::kError:
            if (parser_->failure().code == Error::kLimitExceeded)
              return c_.respond(431, "request head too large\n", TerminationCause::kHeadTooLarge);
            return c_.respond(400, parser_->failure().message + "\n", TerminationCause::kBadRequest);
        }
      }
    }
    switch (r.status) {
      case IoResult::Status::kOk:
        continue;
      case IoResult::Status::kWouldBlock:
        return c_.update_interest();
      case IoResult::Status::kEof:
        return c_.close(TerminationCause::kClientClosed, "closed before a request head");
      case IoResult::Status::kError:
      case IoResult::Status::kNotData:
        return c_.close(TerminationCause::kClientReset, r.detail);
    }
  }
}

void Connection::on_request(std::string_view host, std::string_view method, std::string_view target,
                            std::span<const HttpHeader> headers) {
  rec_.host = std::string(host);
  answering_head_ = method == "HEAD";
  if (host.empty()) return respond(400, "missing Host header\n", TerminationCause::kBadRequest);
  // The connection is bound to what its first request names; a Host that contradicts the TLS server name
  // would let one certificate's connection reach another name's sandbox.
  if (!rec_.sni.empty() && normalize_host(host) != rec_.sni)
    return respond(421, "Host does not match the TLS server name\n", TerminationCause::kMisdirected);
  auto route = parse_route(host, cfg()->domain);
  if (!route) {
    if (route.error() == Error::kNotFound) return respond(421, route.message() + "\n", TerminationCause::kMisdirected);
    return respond(400, route.message() + "\n", TerminationCause::kBadRequest);
  }
  route_ = std::move(*route);
  rec_.sandbox = route_.target;
  credentials_ = find_credentials(target, headers);
  // Each candidate costs the node a digest check (all go in the one open): a head full of token cookies
  // must not turn into hundreds of them.
  if (credentials_.size() > kMaxCredentialCandidates)
    return respond(400,
                   "too many sandgate credentials (" + std::to_string(credentials_.size()) + "): send at most " +
                       std::to_string(kMaxCredentialCandidates) +
                       " (Authorization: Bearer headers, __Host-sandgate_token cookies and sandgate_token parameters together)\n",
                   TerminationCause::kBadRequest);
  request_authority_ = std::string(host);
  request_target_ = std::string(target);
  if (route_.kind == RouteKind::kApi) return open_node_api();
  // ?sandgate_token= becomes a week-long cookie, and cookies are forwarded to the sandbox's application on
  // every request: the operator token (which opens every sandbox and api.<domain>) must never be one. Refused
  // with a 400 that says what to use rather than redirected without the cookie, which would land the browser
  // on an unexplained 401; and refused here, before the node is asked, so nothing is woken for it.
  if (const std::string& op = snapshot_->operator_token; !op.empty())
    for (const Credential& c : credentials_)
      if (c.source == CredentialSource::kQueryParameter && token_matches(c.token, op))
        return respond(400,
                       "the operator token is not accepted in ?sandgate_token= (it would be stored in a cookie "
                       "that reaches the sandbox): use this sandbox's own token there, or an Authorization: "
                       "Bearer header\n",
                       TerminationCause::kBadRequest);
  // Decided before the node is asked.
  if (auto refusal = cross_origin_refusal(host, method, target, headers))
    return respond(refusal->status, refusal->message, refusal->cause);
  if (route_.kind == RouteKind::kSdk) route_.port = cfg()->agent_port;
  // CONNECT (sandgate ssh-proxy): the sandbox and port come from Host like any request; the proxy answers
  // 200 itself and the bytes after the head are the tunnel's.
  // An HTTP/2 CONNECT here is an extended CONNECT (RFC 8441, e.g. a WebSocket): a request for the sandbox.
  tunnel_ = !h2_ && method == "CONNECT";
  answers_request_ = !tunnel_;
  rec_.port = route_.port;
  open_sandbox();
}

// Cross-site request forgery between sandboxes (one site to a browser): the SDK route runs commands, and a
// request the sandgate cookie may authorize can change state, so neither is taken from another origin. GET
// and HEAD stay open so links between sandboxes keep working.
std::optional<Connection::RequestRefusal> Connection::cross_origin_refusal(std::string_view host,
                                                                           std::string_view method,
                                                                           std::string_view target,
                                                                           std::span<const HttpHeader> headers) const {
  // The origin first: most requests come from their own, and then no credential needs scanning.
  if (!is_cross_origin_request(host, headers)) return std::nullopt;
  const bool safe_method = method == "GET" || method == "HEAD";
  const auto credentials = route_.kind == RouteKind::kSdk || safe_method ? std::vector<Credential>()
                                                                          : find_credentials(target, headers);
  const bool carries_cookie = std::any_of(credentials.begin(), credentials.end(),
                                          [](const Credential& c) { return c.source == CredentialSource::kCookie; });
  if (route_.kind == RouteKind::kSdk || carries_cookie)
    return RequestRefusal{403, TerminationCause::kCrossOrigin,
                          "cross-origin request refused: the sandgate credential is not used for requests from "
                          "another origin (send Authorization: Bearer from your own code instead)\n"};
  return std::nullopt;
}

std::optional<Connection::RequestRefusal> Connection::later_request_refusal(std::string_view authority,
                                                                            std::string_view method,
                                                                            std::string_view target,
                                                                            std::span<const HttpHeader> headers) const {
  // Browsers reuse a connection for every host the wildcard certificate covers (h2 coalescing), and any
  // client may send another Host on a keep-alive connection: the connection is bound to its first request's
  // route, so a request naming another goes nowhere. An absolute-form target names its host too.
  // The same bytes as the first request's Host (the usual case) name the same route without normalizing.
  auto names_bound_route = [this](std::string_view host) {
    return host == rec_.host || normalize_host(host) == normalize_host(rec_.host);
  };
  std::string_view named = authority;
  for (std::string_view scheme : {"http://", "https://"}) {
    if (target.size() > scheme.size() &&
        std::equal(scheme.begin(), scheme.end(), target.begin(), [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); })) {
      std::string_view rest = target.substr(scheme.size());
      std::string_view target_authority = rest.substr(0, rest.find_first_of("/?#"));
      if (!names_bound_route(target_authority)) named = target_authority;
    }
  }
  if (named.empty() || !names_bound_route(named))
    return RequestRefusal{421, TerminationCause::kMisdirected,
                          "this connection was opened for " + rec_.host + ", not " + std::string(named) +
                              ": send the request on a connection of its own\n"};
  return cross_origin_refusal(authority, method, target, headers);
}

void Connection::log_refused_stream(uint32_t stream_id, std::string_view authority, const RequestRefusal& refusal) {
  AccessRecord line = rec_;
  line.host = std::string(authority);
  line.status = refusal.status;
  line.cause = refusal.cause;
  line.bytes_in = line.bytes_out = 0;
  line.detail = "h2 stream " + std::to_string(stream_id) + ": " + refusal.message;
  if (!line.detail.empty() && line.detail.back() == '\n') line.detail.pop_back();
  worker_->shared()->access_log->write(line);
  worker_->shared()->metrics.stream_refused(refusal.cause);
}

// ---- Preamble (the fleet listener) ----

void Connection::PreamblePhase::read() {
  ByteBuffer& buf = c_.request_;
  for (;;) {
    IoResult r = c_.client_->read(std::span<char>(buf.write_ptr(), buf.space()));
    if (r.bytes > 0) {
      buf.produced(r.bytes);
      size_t consumed = 0;
      auto p = fleet::parse_preamble(std::string_view(buf.read_ptr(), buf.readable()), &consumed);
      if (!p)
        return c_.close(p.error() == Error::kLimitExceeded ? TerminationCause::kHeadTooLarge : TerminationCause::kBadRequest,
                        p.message());
      if (*p) return received(std::move(**p), consumed);
    }
    switch (r.status) {
      case IoResult::Status::kOk:
        continue;
      case IoResult::Status::kWouldBlock:
        return c_.update_interest();
      case IoResult::Status::kEof:
        return c_.close(TerminationCause::kClientClosed, "the hop closed before its preamble");
      case IoResult::Status::kError:
      case IoResult::Status::kNotData:
        return c_.close(TerminationCause::kClientReset, r.detail);
    }
  }
}

void Connection::PreamblePhase::received(fleet::Preamble p, size_t consumed) {
  Connection& c = c_;  // this phase is left below
  c.rec_.client = p.client;
  c.request_.consumed(consumed);
  fleet::Answer answer;  // ok
  auto route = parse_route(p.host, c.cfg()->domain);
  if (route && route->kind == RouteKind::kApi) {
    // Each node's API is reached on its own (the CLI names it): a hop never carries the operator token.
    c.rec_.host = p.host;
    return c.close(TerminationCause::kMisdirected, "api." + c.cfg()->domain + " is not served over a hop");
  }
  if (route) {
    c.rec_.sandbox = route->target;
    fleet::Decision d = fleet::decide(c.fleet()->directory.get(), c.fleet()->self, route->target);
    if (d.kind == fleet::Decision::Kind::kRemote) answer = {fleet::Answer::Kind::kRedirect, d.owner};
    if (d.kind == fleet::Decision::Kind::kOwnerGone) answer = {fleet::Answer::Kind::kGone, d.owner};
  }
  // A malformed host gets "ok": the head phase answers it (400, 421) as it would the client itself.
  const std::string line = fleet::encode_answer(answer);
  // A fresh connection has room for these few bytes, so one write does it.
  if (IoResult w = c.client_->write(line); w.bytes != line.size())
    return c.close(TerminationCause::kClientReset, "hop answer: " + w.detail);
  if (answer.kind != fleet::Answer::Kind::kOk) {
    c.rec_.host = p.host;
    c.client_->shutdown_write();
    return c.close(TerminationCause::kFleetRedirect, "node " + answer.node + " owns it, as this node sees it");
  }
  // From here the connection is the client's own, as if it had arrived here with this SNI and ALPN.
  c.hello_.sni = p.host;
  c.rec_.sni = p.host;
  c.h2_ = p.protocol == fleet::HopProtocol::kHttp2;
  if (p.protocol == fleet::HopProtocol::kTcp) {
    // A public tcp port as the first proxy's view had it: opened at once, with no credentials, so this
    // node's open refuses it unless the port is public here too.
    if (!route || route->kind != RouteKind::kPort) {
      c.rec_.host = p.host;
      return c.close(TerminationCause::kBadRequest, "a tcp hop names no sandbox port: " + p.host);
    }
    c.headless_ = true;
    c.rec_.host = p.host;
    c.route_ = std::move(*route);
    c.rec_.port = c.route_.port;
    return c.open_sandbox();
  }
  c.enter<HeadPhase>().read();
}

// ---- Hop (the first proxy) ----

void Connection::HopPhase::begin() {
  c_.rec_.hop_to = node_.name;
  c_.arm_deadline(c_.cfg()->proxy.connect_timeout_ms, TerminationCause::kFleetHopFailed);
  step_ = Step::kConnecting;
  auto ep = parse_endpoint(node_.ingress);
  if (!ep || ep->kind != Endpoint::Kind::kTcp) return failed("bad fleet ingress address \"" + node_.ingress + "\"");
  auto sa = to_sockaddr(*ep);
  if (!sa) return failed(sa.message());
  fd_ = UniqueFd(::socket(sa->storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd_.valid()) return failed(std::string("socket: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(fd_.get(), sa->get(), sa->len) != 0 && errno != EINPROGRESS)
    return failed(std::string("connect: ") + std::strerror(errno));
  poll_ = new uv_poll_t;
  uv_poll_init(c_.worker_->loop(), poll_, fd_.get());
  poll_->data = this;
  poll_for(UV_WRITABLE);
}

void Connection::HopPhase::poll_for(int events) {
  uv_poll_start(poll_, events, [](uv_poll_t* p, int status, int) {
    auto* self = static_cast<HopPhase*>(p->data);
    self->c_.drop_left_phases();
    // A failed socket (POLLERR) says why in SO_ERROR, which the connect step reads.
    if (status < 0 && self->step_ != Step::kConnecting) return self->failed(uv_strerror(status));
    self->advance();
  });
}

bool Connection::HopPhase::wait_for(int ssl_result, const char* what) {
  int err = SSL_get_error(ssl_, ssl_result);
  if (err == SSL_ERROR_WANT_READ) return poll_for(UV_READABLE), true;
  if (err == SSL_ERROR_WANT_WRITE) return poll_for(UV_WRITABLE), true;
  std::string why;
  if (long v = SSL_get_verify_result(ssl_); v != X509_V_OK) why = X509_verify_cert_error_string(v);
  else if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)) why = "closed";
  else why = take_ssl_error();
  failed(std::string(what) + ": " + why);
  return false;
}

void Connection::HopPhase::advance() {
  if (step_ == Step::kConnecting) {
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return failed(std::string("connect: ") + std::strerror(err));
    ssl_ = SSL_new(c_.fleet()->client.get());
    if (!ssl_) return failed("SSL_new: " + take_ssl_error());
    SSL_set_fd(ssl_, fd_.get());
    SSL_set_connect_state(ssl_);
    SSL_set_tlsext_host_name(ssl_, node_.name.c_str());
    // The peer must be the node the directory names, not merely some member of the fleet.
    SSL_set1_host(ssl_, node_.name.c_str());
    if (SSL_SESSION* resumed = c_.fleet()->sessions->get(node_.name)) {
      SSL_set_session(ssl_, resumed);
      SSL_SESSION_free(resumed);
    }
    step_ = Step::kHandshaking;
  }
  if (step_ == Step::kHandshaking) {
    clear_stale_ssl_errors();
    if (int r = SSL_do_handshake(ssl_); r != 1) {
      wait_for(r, "TLS handshake");
      return;
    }
    const fleet::HopProtocol protocol = c_.headless_       ? fleet::HopProtocol::kTcp
                                        : c_.h2_           ? fleet::HopProtocol::kHttp2
                                                           : fleet::HopProtocol::kHttp1;
    out_ = fleet::encode_preamble({normalize_host(c_.rec_.host), protocol, c_.rec_.client});
    step_ = Step::kSending;
  }
  if (step_ == Step::kSending) {
    while (sent_ < out_.size()) {
      clear_stale_ssl_errors();
      int n = SSL_write(ssl_, out_.data() + sent_, static_cast<int>(out_.size() - sent_));
      if (n <= 0) {
        wait_for(n, "sending the preamble");
        return;
      }
      sent_ += static_cast<size_t>(n);
    }
    step_ = Step::kAwaitingAnswer;
  }
  char buf[fleet::kMaxAnswerBytes];
  for (;;) {
    clear_stale_ssl_errors();
    int n = SSL_read(ssl_, buf, sizeof buf);
    if (n <= 0) {
      wait_for(n, "awaiting the answer");
      return;
    }
    in_.append(buf, static_cast<size_t>(n));
    size_t consumed = 0;
    auto a = fleet::parse_answer(in_, &consumed);
    if (!a) return failed(a.message());
    if (!*a) continue;
    // The owning proxy says nothing more until the request arrives: anything else is not the protocol.
    if (consumed != in_.size()) return failed("bytes after the hop answer, before the request was sent");
    return answered(**a);
  }
}

void Connection::HopPhase::answered(const fleet::Answer& a) {
  const std::string& target = c_.route_.target;
  switch (a.kind) {
    case fleet::Answer::Kind::kOk: {
      // The connection polls the same socket from now on: this handle stops first.
      close_poll();
      return c_.begin_hop_forwarding(std::move(fd_), std::exchange(ssl_, nullptr));
    }
    case fleet::Answer::Kind::kGone:
      c_.rec_.detail = "node " + node_.name + ": its owner " + a.node + " is gone";
      return c_.respond(503, "sandbox " + target + " is on node " + a.node + ", which is not reachable now; try again shortly\n",
                        TerminationCause::kFleetOwnerGone, {{"Retry-After", "5"}});
    case fleet::Answer::Kind::kRedirect:
      break;
  }
  // The client's bytes go only after "ok", so a redirect always comes before any was sent.
  const fleet::RedirectAction action = fleet::on_redirect(redirects_, /*sent_upstream=*/false, a.node, c_.fleet()->self);
  ++redirects_;
  switch (action) {
    case fleet::RedirectAction::kRefuse:
      c_.rec_.detail = "node " + node_.name + " redirected to " + a.node + " after " + std::to_string(redirects_ - 1) +
                       " redirect(s)";
      return c_.respond(502, "the fleet's nodes disagree on who owns sandbox " + target + "; try again shortly\n",
                        TerminationCause::kFleetHopFailed, {{"Retry-After", "1"}});
    case fleet::RedirectAction::kRetryLocal:
      spdlog::info("sandbox {}: node {} says this node owns it; opening it here", target, node_.name);
      close_attempt();
      c_.rec_.hop_to.clear();
      return c_.open_local_sandbox();
    case fleet::RedirectAction::kRetryRemote: {
      auto info = c_.fleet()->directory ? c_.fleet()->directory->node(a.node) : std::nullopt;
      if (!info || info->ingress.empty()) {
        c_.rec_.detail = "node " + node_.name + " redirected to " + a.node + ", which is gone";
        return c_.respond(503, "sandbox " + target + " is on node " + a.node + ", which is not reachable now; try again shortly\n",
                          TerminationCause::kFleetOwnerGone, {{"Retry-After", "5"}});
      }
      spdlog::info("sandbox {}: node {} redirected the hop to node {}", target, node_.name, a.node);
      close_attempt();
      node_ = std::move(*info);
      out_.clear();
      in_.clear();
      sent_ = 0;
      return begin();
    }
  }
}

void Connection::HopPhase::failed(const std::string& why) {
  c_.rec_.detail = "hop to node " + node_.name + " (" + node_.ingress + "): " + why;
  c_.respond(503, "sandbox " + c_.route_.target + " is on node " + node_.name + ", which cannot be reached now; try again shortly\n",
             TerminationCause::kFleetHopFailed, {{"Retry-After", "5"}});
}

void Connection::HopPhase::close_poll() {
  // uv_close stops polling at once; the handle's memory goes when the loop is done with it.
  if (!poll_) return;
  poll_->data = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(poll_), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
  poll_ = nullptr;
}

void Connection::HopPhase::close_attempt() {
  close_poll();  // before the descriptor closes
  if (ssl_) SSL_free(std::exchange(ssl_, nullptr));
  fd_.reset();
}

void Connection::begin_hop_forwarding(UniqueFd fd, SSL* ssl) {
  hopped_ = true;
  // The owning node's proxy counts this connection's bytes for its node's idle tracking; here they belong
  // to no sandbox of this node.
  traffic_ = worker_->traffic().unattributed();
  upstream_fd_ = std::move(fd);
  upstream_ = std::make_unique<TlsTransport>(ssl, upstream_fd_.get(), nullptr);
  watch_upstream();
  begin_forwarding();
}

// ---- Open ----

void Connection::open_sandbox() {
  // The fleet's routing decision, from this proxy's directory view (memory, no I/O). Fleet off: one test.
  if (fleet() && fleet()->directory && !via_fleet_) {
    fleet::Decision d = fleet::decide(fleet()->directory.get(), fleet()->self, route_.target);
    switch (d.kind) {
      case fleet::Decision::Kind::kLocal:
        break;
      case fleet::Decision::Kind::kOwnerGone:
        rec_.hop_to = d.owner;
        rec_.detail = "owner " + d.owner + " is gone from the fleet";
        return respond(503, "sandbox " + route_.target + " is on node " + d.owner + ", which is not reachable now; try again shortly\n",
                       TerminationCause::kFleetOwnerGone, {{"Retry-After", "5"}});
      case fleet::Decision::Kind::kRemote: {
        auto& hop = enter<HopPhase>(std::move(*d.node));
        update_interest();
        if (phase() == PhaseKind::kClosed) return;  // the socket could not be watched
        return hop.begin();
      }
    }
  }
  open_local_sandbox();
}

void Connection::open_local_sandbox() {
  auto& open = enter<OpenPhase>();
  update_interest();
  if (phase() == PhaseKind::kClosed) return;  // the socket could not be watched
  uint32_t wake_ms = cfg()->proxy.wake_timeout_ms;
  arm_deadline(wake_ms, TerminationCause::kWakeTimeout);
  // Every candidate in one request: the node says which verified (an application's own Bearer may come first).
  std::vector<std::string> candidates;
  for (const Credential& c : credentials_) candidates.push_back(c.token);
  // A running sandbox this worker reached recently: the cached route answers what the node would have.
  if (!cached_route_failed_) {
    worker_->recheck_node();
    if (auto cached = worker_->routes().open(route_.target, route_.port, candidates, now_ms(worker_->loop()))) {
      rec_.route_cached = true;
      worker_->shared()->metrics.route_cache(true);
      if (cached->made_without_node > 0) worker_->shared()->metrics.sockets_made_without_node(cached->made_without_node);
      if (cached->refill > 0)
        worker_->refill_route(route_.target, cached->opened.id, cached->opened.port, cached->refill);
      return use_opened(std::move(cached->opened));
    }
  }
  worker_->shared()->metrics.node_call(NodeCallKind::kOpen);
  worker_->shared()->metrics.route_cache(false);
  open.call_ = worker_->node().open(route_.target, route_.port, candidates, ClientHint{client_address()}, wake_ms,
                                    [this, &open](Result<OpenAnswer> r) {
    drop_left_phases();
    auto call = std::move(open.call_);  // destroyed when this function returns, after its callback
    on_open_result(std::move(r));
  });
}

void Connection::on_open_result(Result<OpenAnswer> r) {
  if (!r) {
    if (r.error() == Error::kTimeout)
      return respond(503, "sandbox did not wake in time\n", TerminationCause::kWakeTimeout, {{"Retry-After", "5"}});
    spdlog::warn("node request failed: {}", r.message());
    if (r.error() == Error::kInternal)
      return respond(502, "bad answer from the sandbox runtime\n", TerminationCause::kNodeUnavailable);
    // Right after a crash: the node is gone, but the worker may not know yet (its event stream's end found
    // the dying node still listening). Then the outage starts now, and the cache answers as it would.
    if (!looked_for_outage_ && !cached_route_failed_) {
      looked_for_outage_ = true;
      if (worker_->outage_found()) return open_sandbox();
    }
    return respond(503, "sandbox runtime unavailable\n", TerminationCause::kNodeUnavailable, {{"Retry-After", "5"}});
  }
  const std::string& message = r->message;
  switch (r->status) {
    case 200:
      return use_opened(std::move(r->opened));
    case 401:
      rec_.detail = message;
      return respond(401, "this sandbox port needs its token: Authorization: Bearer <token>\n",
                     TerminationCause::kUnauthorized, {{"WWW-Authenticate", std::string(kBearerChallenge)}});
    case 404:
      worker_->routes().erase(route_.target, route_.port);
      return respond(404, "no sandbox named " + route_.target + "\n", TerminationCause::kUnknownSandbox);
    case 403:
      return respond(403, "port " + std::to_string(route_.port) + " is not exposed by sandbox " + route_.target + "\n",
                     TerminationCause::kPortNotExposed);
    case 504:
      return respond(503, "sandbox did not wake in time\n", TerminationCause::kWakeTimeout, {{"Retry-After", "5"}});
    case 502:
      // Running, but the port cannot be reached (e.g. a guest image without the agent): the node says why.
      rec_.detail = message;
      return respond(502, "sandbox " + route_.target + " port " + std::to_string(route_.port) +
                              " cannot be reached: " + message + "\n",
                     TerminationCause::kUpstreamConnectFailed);
    default:
      rec_.detail = message;
      return respond(503, "sandbox is not available: " + message + "\n", TerminationCause::kWakeFailed,
                     {{"Retry-After", "5"}});
  }
}

void Connection::use_opened(OpenedSocket opened) {
  rec_.sandbox_id = opened.id;
  // For the next connection's ClientHello (the route's target is the SNI's: Host must equal it), and with
  // spares, for the next connections' opens.
  worker_->routes().store(route_.target, opened.port, opened.policy, now_ms(worker_->loop()));
  worker_->routes().mark_awake(route_.target, opened.port, now_ms(worker_->loop()));
  if (!opened.spares.empty())
    worker_->routes().grant(route_.target,
                            RouteGrant{.sandbox_id = opened.id,
                                       .port = opened.port,
                                       .policy = opened.policy,
                                       .connect_port = opened.connect_port,
                                       .opened_at = opened.opened_at,
                                       .token_sha256 = opened.token_sha256,
                                       .operator_token_sha256 = std::move(opened.operator_token_sha256),
                                       .cache_ms = opened.cache_ms,
                                       .spares = std::move(opened.spares),
                                       .netns = std::move(opened.netns)},
                            now_ms(worker_->loop()));
  // A policy that changed since the ClientHello (or since the first proxy's view of it, on a hop): the bytes
  // would pass unfiltered (credentials, Host) to a port that now expects HTTP or a token.
  if (headless_ && !(opened.policy.protocol == "tcp" && opened.policy.is_public))
    return close(TerminationCause::kUnauthorized,
                 "port " + std::to_string(opened.port) + " is no longer a public tcp port; a raw connection needs one");
  opened_at_ = opened.opened_at;
  rec_.woke = opened.woke;
  rec_.wake_ms = opened.wake_ms;
  const bool port_public = opened.policy.is_public;
  opened_public_ = port_public;
  // none verified (a public port checks none)
  credential_index_ = opened.credential && *opened.credential < credentials_.size() ? *opened.credential
                                                                                   : credentials_.size();
  sandbox_token_sha256_ = opened.token_sha256;
  credential_sha256_ = opened.credential_sha256;
  // A browser's one-time ?sandgate_token=: now verified, it becomes a cookie and leaves the URL. Not on a
  // public port, where the node verified nothing.
  if (!port_public && credential_index_ < credentials_.size() &&
      credentials_[credential_index_].source == CredentialSource::kQueryParameter) {
    auto location = token_redirect_location(request_authority_, request_target_);
    if (!location) return respond(400, location.message() + "\n", TerminationCause::kBadRequest);
    return respond(302, "", TerminationCause::kAuthRedirect,
                   {{"Location", *location},
                    {"Set-Cookie", token_cookie(credentials_[credential_index_].token, kTokenCookieMaxAgeSecs)}});
  }

  ProxyShared* shared = worker_->shared();
  if (!shared->sandbox_limits.try_acquire(rec_.sandbox_id, cfg()->proxy.max_connections_per_sandbox)) {
    return respond(429, "too many connections to this sandbox\n", TerminationCause::kSandboxConnLimit,
                   {{"Retry-After", "1"}});
  }
  holds_sandbox_slot_ = true;
  traffic_ = worker_->traffic().open_connection(rec_.sandbox_id);
  // How to use the socket depends on the driver: connect it to the sandbox-side port (normally the routed
  // port), or take it as it is when the driver already connected it (e.g. a vsock stream).
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(opened.connect_port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  start_connect(std::move(opened.socket), reinterpret_cast<sockaddr*>(&addr), sizeof addr, opened.connected);
}

// api.<domain>: the node API, behind the operator token, forwarded to the node's unix socket.
void Connection::open_node_api() {
  const std::string& token = snapshot_->operator_token;
  bool allowed = false;
  for (const auto& c : credentials_) allowed = allowed || (!token.empty() && token_matches(c.token, token));
  if (!allowed) {
    return respond(401, "api." + cfg()->domain + " needs the operator token: Authorization: Bearer <token>\n",
                   TerminationCause::kUnauthorized, {{"WWW-Authenticate", std::string(kBearerChallenge)}});
  }
  rec_.sandbox = "api";
  traffic_ = worker_->traffic().unattributed();
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& path = cfg()->node_socket.path;
  if (!fd.valid() || path.size() >= sizeof addr.sun_path)
    return respond(503, "sandbox runtime unavailable\n", TerminationCause::kNodeUnavailable, {{"Retry-After", "5"}});
  std::memcpy(addr.sun_path, path.data(), path.size());
  start_connect(std::move(fd), reinterpret_cast<sockaddr*>(&addr), sizeof addr, false);
}

// ---- Connect ----

void Connection::start_connect(UniqueFd socket, const sockaddr* addr, socklen_t addr_len, bool already_connected) {
  int one = 1;
  ::setsockopt(socket.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const bool connected = already_connected || ::connect(socket.get(), addr, addr_len) == 0;
  if (!connected && errno != EINPROGRESS) {
    rec_.detail = std::strerror(errno);
    if (rec_.route_cached) {
      // The cached route is stale (its sandbox changed before the node's event came): nothing was sent,
      // so the node is asked as if the cache had missed.
      spdlog::info("sandbox {}: cached route did not connect ({}); asking the node", route_.target, rec_.detail);
      worker_->routes().erase(route_.target, route_.port);
      release_sandbox_slot();
      rec_.route_cached = false;
      rec_.detail.clear();
      cached_route_failed_ = true;
      return open_sandbox();
    }
    return respond(502, "sandbox is not accepting connections on port " + std::to_string(route_.port) + "\n",
                   TerminationCause::kUpstreamConnectFailed);
  }
  upstream_fd_ = std::move(socket);
  upstream_ = std::make_unique<TcpTransport>(upstream_fd_.get());
  watch_upstream();
  auto& connecting = enter<ConnectPhase>();
  if (connected) return begin_forwarding();
  // A sandbox's port is on loopback in its namespace, where the handshake has usually finished inside
  // connect(): asking now forwards in this turn, without the epoll calls and the loop turn of waiting for
  // the socket to be writable.
  pollfd ready{upstream_fd_.get(), POLLOUT, 0};
  if (::poll(&ready, 1, 0) == 1) return connecting.on_upstream(UV_WRITABLE);
  arm_deadline(cfg()->proxy.connect_timeout_ms, TerminationCause::kUpstreamConnectTimeout);
  update_interest();
}

void Connection::ConnectPhase::on_upstream(int) {
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(c_.upstream_fd_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    c_.rec_.detail = std::strerror(err);
    return c_.respond(502, "sandbox is not accepting connections on port " + std::to_string(c_.route_.port) + "\n",
                      TerminationCause::kUpstreamConnectFailed);
  }
  c_.begin_forwarding();
}

// ---- Forward ----

void Connection::begin_forwarding() {
  uv_timer_stop(&deadline_);
  // On a hop the owning node's proxy answers CONNECT, as it filters every request: the bytes go as they came.
  if (tunnel_ && !hopped_) {
    // The head was for the proxy. A fresh socket has room for these few bytes, so one write does it.
    rec_.bytes_in += head_bytes_;
    traffic_->bytes_in += head_bytes_;
    request_.consumed(head_bytes_);
    static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
    if (IoResult r = client_->write(kEstablished); r.bytes != kEstablished.size())
      return close(TerminationCause::kClientReset, "CONNECT answer: " + r.detail);
    rec_.status = 200;
  }
  // The request head and anything after it are already in request_: they count as client bytes.
  rec_.bytes_in += request_.readable();
  traffic_->bytes_in += request_.readable();
  auto& forward = enter<ForwardPhase>();
  if (!hopped_ && !tunnel_ && (answers_request_ || route_.kind == RouteKind::kApi)) forward.start_request_filters();
  last_activity_ms_ = now_ms(worker_->loop());
  arm_idle_timer(uint64_t{cfg()->proxy.idle_timeout_secs} * 1000);
  if (!forward.start()) return;
  forward.pump();
}

Connection::ForwardPhase::ForwardPhase(Connection& c)
    : Phase(c),
      c2u_(c.client_.get(), c.upstream_.get(), std::move(c.request_), client_to_sandbox_events_),
      u2c_(c.upstream_.get(), c.client_.get(), ByteBuffer(kForwardBufferBytes), sandbox_to_client_events_) {}

void Connection::ForwardPhase::count(uint64_t& record, uint64_t& traffic, size_t n) {
  record += n;
  traffic += n;
  c_.last_activity_ms_ = now_ms(c_.worker_->loop());
}

// Client -> sandbox: no watcher (the request filter is this direction's stage).
void Connection::ForwardPhase::ClientToSandboxEvents::received(size_t n) {
  f_.count(f_.c_.rec_.bytes_in, f_.c_.traffic_->bytes_in, n);
}
bool Connection::ForwardPhase::ClientToSandboxEvents::source_finished() {
  if (!f_.u2c_.source_done()) f_.client_closed_first_ = true;
  return true;
}
bool Connection::ForwardPhase::ClientToSandboxEvents::source_failed(IoResult r) {
  f_.c_.close(r.cause.value_or(TerminationCause::kClientReset), std::move(r.detail));
  return false;
}
bool Connection::ForwardPhase::ClientToSandboxEvents::sink_failed(IoResult r) {
  return f_.upstream_failed(std::move(r.detail));
}
// Request heads must be read by the filter, so the kernel takes receive over only once none will come.
bool Connection::ForwardPhase::ClientToSandboxEvents::may_splice() const { return !f_.requests_are_read(); }

// Sandbox -> client: the response tracker watches it.
void Connection::ForwardPhase::SandboxToClientEvents::received(size_t n) {
  f_.count(f_.c_.rec_.bytes_out, f_.c_.traffic_->bytes_out, n);
}
void Connection::ForwardPhase::SandboxToClientEvents::observe(std::string_view bytes) {
  if (f_.responses_) f_.observe_responses(bytes);
}
// Spliced into kTLS, a response's body passes unseen; heads and chunk framing are copied and parsed.
uint64_t Connection::ForwardPhase::SandboxToClientEvents::splice_budget() const {
  return f_.responses_ ? f_.responses_->unseen_allowed() : UINT64_MAX;
}
void Connection::ForwardPhase::SandboxToClientEvents::passed_unseen(size_t n) {
  if (f_.responses_) f_.responses_->skip(n);
}
bool Connection::ForwardPhase::SandboxToClientEvents::source_finished() {
  return !f_.awaiting_first_response() || f_.upstream_failed("the sandbox closed the connection");
}
bool Connection::ForwardPhase::SandboxToClientEvents::source_failed(IoResult r) {
  return f_.upstream_failed(std::move(r.detail));
}
bool Connection::ForwardPhase::SandboxToClientEvents::sink_failed(IoResult r) {
  f_.c_.close(TerminationCause::kClientReset, std::move(r.detail));
  return false;
}
// h2 frames from the sandbox are parsed (the proxy inserts its own), so they are copied, not spliced.
bool Connection::ForwardPhase::SandboxToClientEvents::may_splice() const { return !f_.h2_frames_; }

void Connection::ForwardPhase::start_request_filters() {
  // What the edge consumed is recognised in every request and taken out: the credential the node accepted
  // (none on a public port), the operator token, and the sandbox's own token whatever the port.
  if (c_.snapshot_->operator_token_sha256) consumed_.add_digest(*c_.snapshot_->operator_token_sha256);
  if (!c_.opened_public_ && c_.credential_index_ < c_.credentials_.size()) {
    if (c_.credential_sha256_) consumed_.add_digest(*c_.credential_sha256_);
    else consumed_.add_token(c_.credentials_[c_.credential_index_].token);
  }
  consumed_.add_token_digest_hex(c_.sandbox_token_sha256_);
  const size_t max_head = c_.cfg()->proxy.max_request_head_bytes;
  if (c_.h2_) {
    h2_filter_ = std::make_unique<H2ClientFilter>(H2FilterLimits{.max_header_list_bytes = max_head},
                                                  [this](H2Request& r) { return check_h2_request(r); });
    h2_filter_->set_on_malformed([this](uint32_t stream, std::string_view why) {
      c_.log_refused_stream(stream, "", RequestRefusal{400, TerminationCause::kBadRequest, std::string(why)});
    });
    h2_frames_ = std::make_unique<H2ServerFrames>();
    u2c_.set_stage([this](std::string_view in, std::string& out) { return frame_upstream_bytes(in, out); });
  } else {
    responses_ = std::make_unique<Http1ResponseTracker>();
    h1_filter_ = std::make_unique<Http1RequestFilter>(
        max_head, [this](Http1Request& r) { return check_http1_request(r); });
  }
  c2u_.set_stage([this](std::string_view in, std::string& out) { return filter_client_bytes(in, out); });
}

Http1Verdict Connection::ForwardPhase::check_http1_request(Http1Request& r) {
  // HTTP/1.0 may omit Host: such a request is for the connection's own route.
  const std::string* host = r.header("host");
  if (auto refusal =
          c_.later_request_refusal(host ? std::string_view(*host) : c_.rec_.host, r.method, r.target, r.headers)) {
    Http1Verdict verdict{refusal->status, refusal->message};
    pending_refusal_ = std::move(refusal);
    c_.answering_head_ = r.method == "HEAD";
    return verdict;
  }
  strip_credentials(r.target, r.headers, consumed_);
  // Draining: the sandbox is asked to close after this answer, which then says Connection: close, so the
  // client opens its next connection to the new process instead of losing a request to a closed one.
  if (c_.worker_->draining() && !r.upgrade) ask_to_close(r.headers);
  if (responses_) responses_->expect(r.method, r.upgrade);
  return {};
}

void Connection::ForwardPhase::drain_tick() {
  if (h2_filter_) {
    if (drain_goaway_sent_ || goaway_) return;
    drain_goaway_sent_ = true;
    // RFC 9113 §6.8: GOAWAY with the largest stream id announces the shutdown without refusing a stream the
    // client may have sent meanwhile; the client opens no new ones and closes once its streams are done.
    if (!h2_frames_->inject(h2_goaway_frame(0x7fffffff, H2ErrorCode::kNoError, "draining"))) return;
    if (u2c_.run_stage()) c_.update_interest();
    return;
  }
  // Only where the answers are followed (every HTTP/1 route, spliced responses included) can "between
  // requests" be known; a tunnel finishes on its own or meets the drain deadline.
  if (!h1_filter_ || !responses_) return;
  const uint64_t moved = c_.rec_.bytes_in + c_.rec_.bytes_out;
  const bool idle = h1_filter_->between_requests() && responses_->idle() && c2u_.pending() == 0 && u2c_.pending() == 0;
  // Idle for a whole tick: a client that was about to send its next request has had the time to.
  if (idle && moved == drain_seen_bytes_) return c_.close(TerminationCause::kDrained);
  drain_seen_bytes_ = moved;
}

void Connection::ForwardPhase::observe_responses(std::string_view bytes) {
  responses_->observe(bytes);
  if (h1_filter_->state() != Http1RequestFilter::State::kAwaitingSwitch) return;
  if (auto switched = responses_->take_upgrade_outcome()) h1_filter_->resolve_upgrade(*switched);
}

H2Verdict Connection::ForwardPhase::check_h2_request(H2Request& r) {
  if (auto refusal = c_.later_request_refusal(r.authority, r.method, r.path, r.headers)) {
    c_.log_refused_stream(r.stream_id, r.authority, *refusal);
    return {refusal->status};
  }
  strip_credentials(r.path, r.headers, consumed_);
  return {};
}

bool Connection::ForwardPhase::filter_client_bytes(std::string_view in, std::string& out) {
  if (in.empty() && !(h1_filter_ && h1_filter_->has_released())) return true;
  if (h1_filter_) {
    const bool was_reading = h1_filter_->state() == Http1RequestFilter::State::kRequests;
    auto state = h1_filter_->feed(in, out);
    // The sandbox may have answered the Upgrade before the filter saw its end (a request with a body).
    if (state == Http1RequestFilter::State::kAwaitingSwitch && responses_) {
      if (auto switched = responses_->take_upgrade_outcome()) {
        h1_filter_->resolve_upgrade(*switched);
        state = h1_filter_->feed({}, out);
      }
    }
    if (was_reading && state == Http1RequestFilter::State::kRefused) {
      if (!pending_refusal_) {  // malformed or oversized, found by the filter itself
        const auto& r = h1_filter_->refusal();
        pending_refusal_ = RequestRefusal{r.status, r.status == 431 ? TerminationCause::kHeadTooLarge
                                                                    : TerminationCause::kBadRequest,
                                          r.reason + "\n"};
      }
      // Nothing more is read or forwarded: the sandbox gets a FIN after the requests before the refused one
      // and answers them; the refusal is answered once those answers are through (responses_ knows where
      // they end) or the sandbox closes (handle_half_close).
      c2u_.stop_reading();
    }
    return true;
  }
  to_client_frames_.clear();
  if (goaway_) return true;  // the filter failed for good: what the client sends after it is dropped
  Status st = h2_filter_->feed(in, out, to_client_frames_);
  if (!st) {
    const bool too_large = st.error() == Error::kLimitExceeded;
    const std::string detail = "HTTP/2 from the client: " + st.message();
    // RFC 9113 §5.4.1: a connection error is answered with GOAWAY, whose last stream id lets the client
    // know which of its earlier requests the sandbox may still have processed.
    if (!h2_frames_->inject(
            h2_goaway_frame(h2_filter_->last_forwarded_stream(), h2_filter_->goaway_code(), st.message()))) {
      c_.close(too_large ? TerminationCause::kHeadTooLarge : TerminationCause::kBadRequest, detail);
      return false;
    }
    goaway_ = ConnectionError{too_large ? TerminationCause::kHeadTooLarge : TerminationCause::kBadRequest, detail};
    c2u_.stop_reading();
    c_.rec_.detail = detail;
    return u2c_.run_stage() && stop_after_goaway();
  }
  if (to_client_frames_.empty()) return true;
  if (Status queued = h2_frames_->inject(to_client_frames_); !queued) {
    c_.close(TerminationCause::kBadRequest, "HTTP/2: too many refused streams waiting: " + queued.message());
    return false;
  }
  return u2c_.run_stage();
}

bool Connection::ForwardPhase::frame_upstream_bytes(std::string_view in, std::string& out) {
  auto announced = h2_frames_->feed(in, out);
  if (!announced) {
    c_.close(TerminationCause::kUpstreamReset, "HTTP/2 from the sandbox: " + announced.message());
    return false;
  }
  if (*announced) h2_filter_->set_sandbox_header_table_size(**announced);
  if (auto enabled = h2_frames_->extended_connect()) h2_filter_->set_sandbox_extended_connect(*enabled);
  return !goaway_ || stop_after_goaway();
}

bool Connection::ForwardPhase::stop_after_goaway() {
  // Still queued: the sandbox is inside a frame, and the GOAWAY goes out at its end.
  if (!h2_frames_->has_queued()) u2c_.stop_reading();
  return true;
}

void Connection::ForwardPhase::on_upstream(int status) {
  if (status < 0) {
    // libuv reports POLLERR as UV_EBADF; the socket's own error says what happened.
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(c_.upstream_fd_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    upstream_failed(err != 0 ? std::strerror(err) : uv_strerror(status));
    return;
  }
  pump();
}

// Moves bytes until a round moves none (every side would block, or a side finished), or the budget of
// rounds is spent. A pump that stops on its budget has not settled: a round can leave work that no socket
// event announces (the sandbox's answer to an Upgrade, seen in the last round, releases the client's next
// request to the filter, and its refusal is answered only once that request is read), so it goes on at the
// next turn of the loop, after the other connections' events, as when a source holds input poll() does not
// report.
void Connection::ForwardPhase::pump() {
  AccessRecord& rec = c_.rec_;
  bool settled = false;
  for (int round = 0; round < kPumpRounds && !settled; ++round) {
    uint64_t before = rec.bytes_in + rec.bytes_out;
    size_t pending_before = c2u_.pending() + u2c_.pending();
    if (!c2u_.move()) return;
    if (!u2c_.move()) return;
    if (!handle_half_close()) return;
    settled = rec.bytes_in + rec.bytes_out == before && c2u_.pending() + u2c_.pending() == pending_before;
  }
  c_.update_interest();
  if (c_.phase() == PhaseKind::kClosed) return;  // a socket could not be watched
  if (holds_memory()) c_.release_memory_when_quiet();
  // Hidden input only after a read that stopped for room: one that stopped at WANT_READ left at most a
  // partial record, whose remainder makes the socket readable.
  if ((!settled || c2u_.hidden_input() || u2c_.hidden_input()) && !std::exchange(c_.pump_again_queued_, true))
    c_.worker_->pump_again(&c_);
}

// A side that finished sending is told so once its buffered bytes are delivered: FIN to the sandbox,
// close_notify (then FIN) to the client. The connection ends when both directions are done.
bool Connection::ForwardPhase::handle_half_close() {
  c2u_.shut_sink_when_done();
  // Known answered: the sandbox closed, or (watching its answers) it answered every request it was given.
  const bool answered = u2c_.source_done() || (responses_ && responses_->idle());
  if (answered && u2c_.pending() == 0 && pending_refusal_) {
    // The sandbox answered the requests before the refused one: now the refusal, then the connection ends.
    RequestRefusal refusal = std::move(*pending_refusal_);
    pending_refusal_.reset();
    c_.rec_.detail = refusal.message.substr(0, refusal.message.find_last_not_of('\n') + 1);
    c_.respond(refusal.status, refusal.message, refusal.cause);
    return false;
  }
  u2c_.shut_sink_when_done();
  if (c2u_.sink_shut() && u2c_.sink_shut()) {
    if (goaway_) c_.close(goaway_->cause, std::move(goaway_->detail));
    else c_.close(client_closed_first_ ? TerminationCause::kClientClosed : TerminationCause::kUpstreamClosed);
    return false;
  }
  return true;
}

bool Connection::ForwardPhase::awaiting_first_response() const {
  return c_.answers_request_ && c_.rec_.bytes_out == 0 && !c2u_.source_done() && !c2u_.spliced() &&
         !pending_refusal_;
}

// A sandbox that resets (or closes) before its first byte leaves the client's request unanswered: on an
// HTTP route the client gets a 502 that names the cause, as from nginx, instead of a reset of its own.
bool Connection::ForwardPhase::upstream_failed(std::string detail) {
  if (!awaiting_first_response()) {
    c_.close(TerminationCause::kUpstreamReset, std::move(detail));
    return false;
  }
  c_.rec_.detail = "port " + std::to_string(c_.route_.port) + ": " + detail + ", before any response";
  c_.respond(502, "sandbox " + c_.route_.target + ", " + c_.rec_.detail + "\n", TerminationCause::kUpstreamReset);
  return false;
}

// ---- Respond, linger ----

void Connection::respond(int status, std::string_view body, TerminationCause cause,
                         std::vector<HttpHeader> extra_headers) {
  rec_.status = status;
  static constexpr std::string_view kText = "text/plain; charset=utf-8";
  // A response to HEAD has no content (RFC 9110 §9.3.2); content after it would be read as the next response.
  if (answering_head_) body = {};
  Result<std::string> out = !h2_             ? http1_refusal(status, kText, body, extra_headers)
                            : h2_stream_ != 0 ? h2_refusal(h2_stream_, status, kText, body, extra_headers)
                                              // no request yet to answer on: end the connection
                                              : Result<std::string>(h2_goaway(H2ErrorCode::kProtocolError, body));
  if (!out) return close(cause, "cannot build the response: " + out.message());
  respond_bytes(std::move(*out), cause);
}

void Connection::respond_bytes(std::string out, TerminationCause cause) {
  uv_timer_stop(&deadline_);
  if (rec_.phase.empty()) rec_.phase = phase_name(phase());  // the phase that decided on this answer
  auto& respond = enter<RespondPhase>(std::move(out), cause);
  // A response must not wait forever on a client that does not read.
  arm_deadline(cfg()->proxy.request_head_timeout_ms, cause);
  respond.flush();
}

void Connection::RespondPhase::flush() {
  while (sent_ < out_.size()) {
    IoResult r = c_.client_->write(std::span<const char>(out_.data() + sent_, out_.size() - sent_));
    if (r.status == IoResult::Status::kWouldBlock) return c_.update_interest();
    if (r.status == IoResult::Status::kError) return c_.close(cause_, std::move(r.detail));
    sent_ += r.bytes;
  }
  // Once: a close_notify that cannot be sent now is not waited for (the client has its answer).
  if (!c_.client_->shutdown_write()) ::shutdown(c_.client_fd_.get(), SHUT_WR);
  Connection& c = c_;  // this phase is left below
  auto& linger = c.enter<LingerPhase>(cause_);
  c.arm_deadline(kLingerMs, cause_);
  linger.drain();
}

void Connection::LingerPhase::drain() {
  char scratch[16 * 1024];
  for (;;) {
    ssize_t n = ::recv(c_.client_fd_.get(), scratch, sizeof scratch, 0);
    if (n > 0) {
      drained_ += static_cast<size_t>(n);
      if (drained_ > kMaxLingerBytes) return c_.close(cause_);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return c_.update_interest();
    return c_.close(cause_);  // EOF or error: the client is done
  }
}

// ---- The end ----

void Connection::drain_tick() {
  drop_left_phases();
  phase_->drain_tick();
}

bool Connection::cut_if_opened_before(const std::string& sandbox_id, uint64_t stamp, Cut why, uint16_t port) {
  if (opened_at_ == 0 || opened_at_ >= stamp || rec_.sandbox_id != sandbox_id || phase() == PhaseKind::kClosed)
    return false;
  switch (why) {
    case Cut::kTokenRevoked:
      if (opened_public_) return false;
      close(TerminationCause::kTokenRevoked, "the sandbox's token was rotated while the connection was open");
      return true;
    case Cut::kPortClosed:
      if (rec_.port != port) return false;
      close(TerminationCause::kPortClosed, "port " + std::to_string(port) + " was closed while the connection was open");
      return true;
    case Cut::kSuspended:
      close(TerminationCause::kSandboxSuspended, "the sandbox was suspended while the connection was open");
      return true;
  }
  return false;
}

void Connection::release_sandbox_slot() {
  if (holds_sandbox_slot_) worker_->shared()->sandbox_limits.release(rec_.sandbox_id);
  holds_sandbox_slot_ = false;
  if (traffic_) worker_->traffic().close_connection(rec_.sandbox_id);
  traffic_ = nullptr;
}

void Connection::close(TerminationCause cause, std::string detail) {
  if (phase() == PhaseKind::kClosed) return;
  if (rec_.phase.empty()) rec_.phase = phase_name(phase());
  enter<ClosedPhase>();
  rec_.cause = cause;
  if (!detail.empty() && rec_.detail.empty()) rec_.detail = std::move(detail);
  note_own_records();
  worker_->shared()->access_log->write(rec_);
  worker_->shared()->metrics.connection_ended(rec_);
  release_sandbox_slot();
  if (!client_slot_.empty()) worker_->shared()->client_limits.release(client_slot_);
  worker_->shared()->open_connections.fetch_sub(1, std::memory_order_relaxed);
  if (std::exchange(holding_buffers_, false)) worker_->shared()->metrics.buffers_held(-1);
  worker_->forget(this);
  if (std::exchange(pump_again_queued_, false)) worker_->cancel_pump_again(this);
  prewake_.reset();  // a wake for a client that left is not wanted any more

  auto on_closed = [](uv_handle_t* h) {
    auto* self = static_cast<Connection*>(h->data);
    if (--self->handles_open_ == 0) delete self;
  };
  // Stop watching before the descriptors close (a closed descriptor may be reused at once), then free the
  // handles.
  client_watch_.stop();
  upstream_watch_.stop();
  uv_close(reinterpret_cast<uv_handle_t*>(&deadline_), on_closed);
  uv_close(reinterpret_cast<uv_handle_t*>(&idle_timer_), on_closed);
  // The phases and transports stay until the handles are closed: close() may run inside one of them.
  client_fd_.reset();
  upstream_fd_.reset();
}

}  // namespace sg
