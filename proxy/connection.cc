#include "proxy/connection.h"

#include <netinet/in.h>
#include <openssl/err.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "proxy/worker.h"

namespace sg {
namespace {

// Per direction. A TLS record carries at most 16 KiB; two records per read keeps syscalls per byte low.
constexpr size_t kForwardBufferBytes = 32 * 1024;
// Per spliced direction. Pages in a pipe are pinned only while in flight, but a stalled reader keeps the
// whole pipe full: 128 KiB (32 slots) moves eight TLS records per splice without letting 10k stalled
// connections pin more than ~2.5 GiB.
constexpr size_t kSplicePipeBytes = 128 * 1024;
// After an error response: how long and how much unread client input we drain before closing.
constexpr uint32_t kLingerMs = 2000;
constexpr size_t kMaxLingerBytes = 4 * 1024 * 1024;

uint64_t now_ms(uv_loop_t* loop) { return uv_now(loop); }

// A filtered direction's queue (c2u_out_, u2c_out_): what was sent leaves the front, so the queue never grows
// with the bytes a connection moves, and an emptied queue gives back memory beyond one buffer's worth, so an
// idle connection after an upload does not keep it.
void compact(std::string& queue, size_t& sent) {
  if (sent == 0) return;
  if (sent == queue.size()) {
    if (queue.capacity() > kForwardBufferBytes) std::string().swap(queue);
    else queue.clear();
  } else if (sent >= kForwardBufferBytes) {
    queue.erase(0, sent);  // moves less than kMaxFilteredBytes
  } else {
    return;
  }
  sent = 0;
}

}  // namespace

Connection::Connection(Worker* worker, UniqueFd client, std::string peer)
    : worker_(worker),
      snapshot_(worker->shared()->snapshot()),
      cfg_(snapshot_->config.get()),
      tls_(snapshot_->tls.get()),
      client_fd_(std::move(client)),
      // The head must fit in the buffer that later forwards it; one byte more detects "too large".
      c2u_(std::max<size_t>(kForwardBufferBytes, cfg_->proxy.max_request_head_bytes + 1)) {
  rec_.started_at = std::chrono::system_clock::now();
  rec_.started_steady = std::chrono::steady_clock::now();
  rec_.client = std::move(peer);
  uv_loop_t* loop = worker_->loop();
  uv_poll_init(loop, &client_poll_, client_fd_.get());
  uv_timer_init(loop, &deadline_);
  uv_timer_init(loop, &idle_timer_);
  uv_idle_init(loop, &buffered_input_);
  client_poll_.data = deadline_.data = idle_timer_.data = upstream_poll_.data = buffered_input_.data = this;
  handles_open_ = 4;
}

Connection::~Connection() {
  if (ssl_) SSL_free(ssl_);
}

void Connection::start() {
  ssl_ = SSL_new(tls_->default_ctx());
  if (!ssl_) return close(TerminationCause::kHandshakeFailed, "SSL_new: " + take_ssl_error());
  SSL_set_fd(ssl_, client_fd_.get());
  SSL_set_accept_state(ssl_);
  SSL_set_ex_data(ssl_, hello_ex_index(), &hello_);
  if (tls_->ktls_possible()) ktls_rx_tracker_.attach(ssl_);
  arm_deadline(cfg_->proxy.handshake_timeout_ms, TerminationCause::kHandshakeTimeout);
  do_handshake();
}

void Connection::arm_deadline(uint32_t ms, TerminationCause cause) {
  deadline_cause_ = cause;
  uv_timer_start(&deadline_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->on_deadline(); }, ms, 0);
}

void Connection::on_deadline() {
  switch (phase_) {
    case Phase::kReadHead:
      return respond(408, "request head not received in time\n", TerminationCause::kHeadTimeout);
    case Phase::kOpening:
      return respond(503, "sandbox did not wake in time\n", TerminationCause::kWakeTimeout, {{"Retry-After", "5"}});
    case Phase::kConnecting:
      return respond(504, "sandbox port did not accept the connection in time\n",
                     TerminationCause::kUpstreamConnectTimeout);
    default:
      return close(deadline_cause_);
  }
}

void Connection::on_idle_timer() {
  uint64_t idle_ms = uint64_t{cfg_->proxy.idle_timeout_secs} * 1000;
  uint64_t quiet = now_ms(worker_->loop()) - last_activity_ms_;
  if (quiet >= idle_ms) return close(TerminationCause::kIdleTimeout);
  // Activity is recorded as a timestamp (no timer restart per read); re-arm for the remainder.
  uv_timer_start(&idle_timer_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->on_idle_timer(); },
                 idle_ms - quiet, 0);
}

void Connection::update_interest() {
  if (phase_ == Phase::kClosed) return;
  int want_client = 0;
  int want_upstream = 0;
  switch (phase_) {
    case Phase::kHandshake:
      if (!node_call_) want_client = handshake_wants_write_ ? UV_WRITABLE : UV_READABLE;
      break;
    case Phase::kReadHead:
      want_client = UV_READABLE;
      break;
    case Phase::kOpening:
      break;  // nothing to read until the sandbox is there; the deadline bounds the wait
    case Phase::kConnecting:
      want_upstream = UV_WRITABLE;
      break;
    case Phase::kResponding:
      want_client = UV_WRITABLE;
      break;
    case Phase::kLingering:
      want_client = UV_READABLE;
      break;
    case Phase::kForwarding:
      if (!client_eof_ && c2u_room()) want_client |= UV_READABLE;
      if (u2c_pending() > 0 || (upstream_eof_ && !client_shut_)) want_client |= UV_WRITABLE;
      if (!upstream_eof_ && u2c_room()) want_upstream |= UV_READABLE;
      if (c2u_pending() > 0) want_upstream |= UV_WRITABLE;
      break;
    case Phase::kClosed:
      return;
  }
  auto client_cb = [](uv_poll_t* p, int st, int ev) { static_cast<Connection*>(p->data)->on_client_io(st, ev); };
  auto upstream_cb = [](uv_poll_t* p, int st, int ev) { static_cast<Connection*>(p->data)->on_upstream_io(st, ev); };
  if (want_client != client_events_) {
    client_events_ = want_client;
    if (want_client) uv_poll_start(&client_poll_, want_client, client_cb);
    else uv_poll_stop(&client_poll_);
  }
  if (upstream_poll_started_ && want_upstream != upstream_events_) {
    upstream_events_ = want_upstream;
    if (want_upstream) uv_poll_start(&upstream_poll_, want_upstream, upstream_cb);
    else uv_poll_stop(&upstream_poll_);
  }
}

void Connection::on_client_io(int status, int) {
  if (status < 0) {
    // Our answer is out and the client reset while we drained it: the connection still ended for the
    // reason we answered (a 401, a 403, ...).
    if (phase_ == Phase::kLingering) return close(respond_cause_, uv_strerror(status));
    if (phase_ == Phase::kForwarding || phase_ == Phase::kResponding)
      return close(TerminationCause::kClientReset, uv_strerror(status));
    return close(TerminationCause::kClientClosed, uv_strerror(status));
  }
  switch (phase_) {
    case Phase::kHandshake: return do_handshake();
    case Phase::kReadHead: return read_head();
    case Phase::kResponding: return flush_response();
    case Phase::kLingering: return linger();
    case Phase::kForwarding: return pump();
    default: return;
  }
}

void Connection::on_upstream_io(int status, int) {
  if (phase_ == Phase::kConnecting) return finish_connect();
  if (status < 0) {
    // libuv reports POLLERR as UV_EBADF; the socket's own error says what happened.
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(upstream_fd_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    upstream_failed(err != 0 ? std::strerror(err) : uv_strerror(status));
    return;
  }
  if (phase_ == Phase::kForwarding) pump();
}

void Connection::do_handshake() {
  ERR_clear_error();
  int r = SSL_do_handshake(ssl_);
  rec_.sni = hello_.sni;
  if (r == 1) return after_handshake();
  int err = SSL_get_error(ssl_, r);
  if (err == SSL_ERROR_WANT_CLIENT_HELLO_CB) return look_up_port_policy();
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
    handshake_wants_write_ = err == SSL_ERROR_WANT_WRITE;
    return update_interest();
  }
  if (!rec_.sni.empty() && tls_->select(rec_.sni) == nullptr)
    return close(TerminationCause::kUnknownSni, "no certificate for " + rec_.sni);
  // A peer that connects and leaves (health checks, port scans) did not fail a handshake.
  if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0))
    return close(TerminationCause::kClientClosed, "closed during the TLS handshake");
  close(TerminationCause::kHandshakeFailed, take_ssl_error());
}

// The ClientHello callback paused the handshake: the ALPN choice and the connection's mode depend on the
// routed port's policy (tls.cc). The node answers from memory, without waking the sandbox.
void Connection::look_up_port_policy() {
  auto route = parse_route(hello_.sni, cfg_->domain);
  if (!route || route->kind == RouteKind::kApi) {
    hello_.policy_known = true;  // nothing to look up; the request head decides
    return do_handshake();
  }
  uint16_t port = route->kind == RouteKind::kSdk ? cfg_->agent_port : route->port;
  // A port seen within the cache's bound needs no node round trip here: the open is the connection's only one.
  if (auto known = worker_->routes().find(route->target, port, now_ms(worker_->loop()))) {
    hello_.policy_known = true;
    hello_.port_protocol = known->protocol;
    hello_.port_public = known->is_public;
    return do_handshake();
  }
  // Bounded well inside the handshake deadline: a node that does not answer soon costs only the port's
  // policy (no h2 offer, no raw-TCP mode), and the request head then gets the node's real answer (or 503).
  uint32_t lookup_ms = std::min(cfg_->proxy.wake_timeout_ms, cfg_->proxy.handshake_timeout_ms / 2);
  node_call_ = worker_->node().lookup(route->target, port, lookup_ms, [this, target = route->target](Result<LookupAnswer> r) {
    on_lookup_result(target, std::move(r));
  });
  update_interest();
}

void Connection::on_lookup_result(const std::string& target, Result<LookupAnswer> r) {
  auto call = std::move(node_call_);  // destroyed when this function returns, after its callback
  // Whatever the answer, the handshake goes on: an unknown sandbox or port is answered (404/403) over
  // HTTP once the head names it, which a client can show, unlike a failed handshake.
  hello_.policy_known = true;
  if (r && r->status == 200) {
    hello_.port_protocol = r->policy.protocol;
    hello_.port_public = r->policy.is_public;
    worker_->routes().store(target, r->port, r->policy, now_ms(worker_->loop()));
  } else if (!r) {
    spdlog::warn("port policy lookup failed: {}", r.message());
  }
  do_handshake();
}

void Connection::after_handshake() {
  ktls_rx_tracker_.handshake_finished();
  const unsigned char* alpn = nullptr;
  unsigned alpn_len = 0;
  SSL_get0_alpn_selected(ssl_, &alpn, &alpn_len);
  h2_ = alpn_len == 2 && std::memcmp(alpn, "h2", 2) == 0;
  rec_.tls_version = SSL_get_version(ssl_);
  plan_data_path(BIO_get_ktls_send(SSL_get_wbio(ssl_)), BIO_get_ktls_recv(SSL_get_rbio(ssl_)));
  if (cfg_->proxy.ktls == KtlsMode::kOn && (!ktls_tx_ || rx_handover_ == RxHandover::kNone))
    return close(TerminationCause::kKtlsRequired, "ktls = on but this connection could not be offloaded");
  // A public raw-TCP port (sshd speaks first) has no request head: the SNI names the destination.
  if (hello_.policy_known && hello_.port_protocol == "tcp" && hello_.port_public) {
    auto route = parse_route(rec_.sni, cfg_->domain);
    if (route && route->kind == RouteKind::kPort) {
      rec_.host = rec_.sni;
      route_ = std::move(*route);
      rec_.sandbox = route_.target;
      rec_.port = route_.port;
      return open_sandbox();
    }
  }
  phase_ = Phase::kReadHead;
  if (h2_) {
    // Everything scanned stays in c2u_ to be forwarded, so the scan may not outgrow it.
    h2_scanner_ = std::make_unique<H2RequestScanner>(H2ScanLimits{
        .max_bytes_before_request = c2u_.space() - 1, .max_header_list_bytes = cfg_->proxy.max_request_head_bytes});
  } else {
    head_parser_ = std::make_unique<HttpParser>(
        HttpParser::Kind::kRequest, HttpLimits{cfg_->proxy.max_request_head_bytes, 0, /*stop_after_head=*/true});
  }
  arm_deadline(cfg_->proxy.request_head_timeout_ms, TerminationCause::kHeadTimeout);
  read_head();
}

// Transmit is the kernel's when OpenSSL offloaded it; bytes from the sandbox then splice into the socket.
// Receive is OpenSSL's for TLS 1.2 when it offloaded it, ours to hand over for TLS 1.3 (proxy/ktls.h);
// either way the client socket is spliced only after the request head, once OpenSSL holds no input.
void Connection::plan_data_path(bool ktls_tx, bool ktls_rx) {
  ktls_tx_ = ktls_tx;
  if (ktls_rx) rx_handover_ = RxHandover::kOffloadedByOpenSsl;
  else if (ktls_tx && SSL_version(ssl_) == TLS1_3_VERSION) rx_handover_ = RxHandover::kInstallTls13Key;
  set_data_path_label(ktls_tx_, rx_handover_ != RxHandover::kNone);
  std::string why;
  if (cfg_->proxy.ktls == KtlsMode::kOff) {
    why = "ktls = off in the config";
  } else if (!tls_->ktls_kernel_reason().empty()) {
    why = tls_->ktls_kernel_reason();
  } else if (!ktls_tx || rx_handover_ == RxHandover::kNone) {
    why = fmt::format("OpenSSL did not offload {} for {} {}: cipher not offloadable", ktls_tx ? "receive" : "transmit",
                      SSL_get_version(ssl_), SSL_get_cipher_name(ssl_));
  }
  if (!why.empty()) log_ktls_fallback_once(why);
}

void Connection::set_data_path_label(bool tx_spliced, bool rx_spliced) {
  rec_.data_path = tx_spliced && rx_spliced ? "ktls-splice"
                   : tx_spliced             ? "ktls-tx-only"
                   : rx_spliced             ? "ktls-rx-only"
                                            : "userspace";
}

// A direction planned for kTLS that cannot splice after all: with ktls = on that refuses the connection,
// otherwise it carries on through SSL_read/SSL_write (OpenSSL still uses whatever the kernel took over).
bool Connection::ktls_downgrade(std::string why) {
  log_ktls_fallback_once(why);
  set_data_path_label(u2c_pipe_ != nullptr, c2u_pipe_ != nullptr || rx_handover_ != RxHandover::kNone);
  if (cfg_->proxy.ktls != KtlsMode::kOn) return true;
  close(TerminationCause::kKtlsRequired, std::move(why));
  return false;
}

void Connection::read_head() {
  for (;;) {
    ERR_clear_error();
    int n = SSL_read(ssl_, c2u_.write_ptr(), static_cast<int>(c2u_.space()));
    if (n <= 0) {
      int err = SSL_get_error(ssl_, n);
      if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) return update_interest();
      if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0))
        return close(TerminationCause::kClientClosed, "closed before a request head");
      return close(TerminationCause::kClientReset, take_ssl_error());
    }
    const char* fresh = c2u_.write_ptr();
    c2u_.produced(static_cast<size_t>(n));
    if (h2_) {
      auto scanned = h2_scanner_->scan(std::string_view(c2u_.read_ptr(), c2u_.readable()));
      if (!scanned) {
        bool too_large = scanned.error() == Error::kLimitExceeded;
        rec_.detail = scanned.message();
        // A malformed request is an error of its stream only (RFC 9113 §8.1.1): a 400 the client can read on
        // it, then GOAWAY(NO_ERROR). A broken connection gets GOAWAY with the error code.
        if (const uint32_t stream = h2_scanner_->malformed_stream(); stream != 0) {
          h2_stream_ = stream;
          return respond(400, scanned.message() + "\n", TerminationCause::kBadRequest);
        }
        return respond_bytes(h2_goaway(h2_scanner_->goaway_code(), scanned.message()),
                             too_large ? TerminationCause::kHeadTooLarge : TerminationCause::kBadRequest);
      }
      if (!*scanned) continue;
      H2Request& req = **scanned;
      h2_stream_ = req.stream_id;
      return on_request(req.authority, req.method, req.path, req.headers);
    }
    switch (head_parser_->feed(fresh, static_cast<size_t>(n))) {
      case HttpParser::State::kNeedMore:
        continue;
      case HttpParser::State::kHeadComplete:
      case HttpParser::State::kMessageComplete:
        head_bytes_ = c2u_.readable() - static_cast<size_t>(n) + head_parser_->consumed();
        return on_head();
      case HttpParser::State::kError:
        if (head_parser_->failure().code == Error::kLimitExceeded)
          return respond(431, "request head too large\n", TerminationCause::kHeadTooLarge);
        return respond(400, head_parser_->failure().message + "\n", TerminationCause::kBadRequest);
    }
  }
}

void Connection::on_head() {
  const HttpMessage& msg = head_parser_->message();
  const std::string* host_header = msg.header("host");
  on_request(host_header ? *host_header : rec_.sni, msg.method, msg.target, msg.headers);
}

void Connection::on_request(std::string_view host, std::string_view method, std::string_view target,
                            std::span<const HttpHeader> headers) {
  rec_.host = std::string(host);
  if (host.empty()) return respond(400, "missing Host header\n", TerminationCause::kBadRequest);
  // The connection is bound to what its first request names; a Host that contradicts the TLS server name
  // would let one certificate's connection reach another name's sandbox.
  if (!rec_.sni.empty() && normalize_host(host) != rec_.sni)
    return respond(421, "Host does not match the TLS server name\n", TerminationCause::kMisdirected);
  auto route = parse_route(host, cfg_->domain);
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
  if (route_.kind == RouteKind::kSdk) route_.port = cfg_->agent_port;
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
  const std::string bound = normalize_host(rec_.host);
  std::string_view named = authority;
  for (std::string_view scheme : {"http://", "https://"}) {
    if (target.size() > scheme.size() &&
        std::equal(scheme.begin(), scheme.end(), target.begin(), [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); })) {
      std::string_view rest = target.substr(scheme.size());
      std::string_view target_authority = rest.substr(0, rest.find_first_of("/?#"));
      if (normalize_host(target_authority) != bound) named = target_authority;
    }
  }
  if (named.empty() || normalize_host(named) != bound)
    return RequestRefusal{421, TerminationCause::kMisdirected,
                          "this connection was opened for " + rec_.host + ", not " + std::string(named) +
                              ": send the request on a connection of its own\n"};
  return cross_origin_refusal(authority, method, target, headers);
}

Http1Verdict Connection::check_http1_request(Http1Request& r) {
  // HTTP/1.0 may omit Host: such a request is for the connection's own route.
  const std::string* host = r.header("host");
  if (auto refusal = later_request_refusal(host ? std::string_view(*host) : rec_.host, r.method, r.target, r.headers)) {
    Http1Verdict verdict{refusal->status, refusal->message};
    pending_refusal_ = std::move(refusal);
    return verdict;
  }
  strip_credentials(r.target, r.headers, consumed_);
  return {};
}

H2Verdict Connection::check_h2_request(H2Request& r) {
  if (auto refusal = later_request_refusal(r.authority, r.method, r.path, r.headers)) {
    log_refused_stream(r.stream_id, r.authority, *refusal);
    return {refusal->status};
  }
  strip_credentials(r.path, r.headers, consumed_);
  return {};
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
}

void Connection::start_request_filters() {
  // What the edge consumed is recognised in every request and taken out: the credential the node accepted
  // (none on a public port), the operator token, and the sandbox's own token whatever the port.
  consumed_ = ConsumedCredentials{};
  if (!snapshot_->operator_token.empty()) consumed_.tokens.push_back(snapshot_->operator_token);
  if (!opened_public_ && credential_index_ < credentials_.size())
    consumed_.tokens.push_back(credentials_[credential_index_].token);
  consumed_.sandbox_token_sha256 = sandbox_token_sha256_;
  if (h2_) {
    h2_filter_ = std::make_unique<H2ClientFilter>(
        H2FilterLimits{.max_header_list_bytes = cfg_->proxy.max_request_head_bytes},
        [this](H2Request& r) { return check_h2_request(r); });
    h2_filter_->set_on_malformed([this](uint32_t stream, std::string_view why) {
      log_refused_stream(stream, "", RequestRefusal{400, TerminationCause::kBadRequest, std::string(why)});
    });
    h2_frames_ = std::make_unique<H2ServerFrames>();
  } else {
    h1_filter_ = std::make_unique<Http1RequestFilter>(cfg_->proxy.max_request_head_bytes,
                                                      [this](Http1Request& r) { return check_http1_request(r); });
  }
}

bool Connection::filter_client_bytes() {
  if (!filtered() || c2u_.readable() == 0) return true;
  std::string_view in(c2u_.read_ptr(), c2u_.readable());
  compact(c2u_out_, c2u_out_sent_);
  if (h1_filter_) {
    const bool was_reading = h1_filter_->state() == Http1RequestFilter::State::kRequests;
    const auto state = h1_filter_->feed(in, c2u_out_);
    c2u_.consumed(in.size());
    if (was_reading && state == Http1RequestFilter::State::kRefused) {
      if (!pending_refusal_) {  // malformed or oversized, found by the filter itself
        const auto& r = h1_filter_->refusal();
        pending_refusal_ = RequestRefusal{r.status, r.status == 431 ? TerminationCause::kHeadTooLarge
                                                                    : TerminationCause::kBadRequest,
                                          r.reason + "\n"};
      }
      // Nothing more is read or forwarded: the sandbox gets a FIN after the requests before the refused one,
      // answers them, closes, and then the refusal is answered (handle_half_close).
      client_eof_ = true;
    }
    return true;
  }
  to_client_frames_.clear();
  Status st = h2_filter_->feed(in, c2u_out_, to_client_frames_);
  c2u_.consumed(in.size());
  if (!st) {
    close(st.error() == Error::kLimitExceeded ? TerminationCause::kHeadTooLarge : TerminationCause::kBadRequest,
          "HTTP/2 from the client: " + st.message());
    return false;
  }
  if (to_client_frames_.empty()) return true;
  if (Status queued = h2_frames_->inject(to_client_frames_); !queued) {
    close(TerminationCause::kBadRequest, "HTTP/2: too many refused streams waiting: " + queued.message());
    return false;
  }
  return frame_upstream_bytes();
}

bool Connection::frame_upstream_bytes() {
  if (!h2_frames_) return true;
  compact(u2c_out_, u2c_out_sent_);
  std::string_view in(u2c_->read_ptr(), u2c_->readable());
  auto announced = h2_frames_->feed(in, u2c_out_);
  u2c_->consumed(in.size());
  if (!announced) {
    close(TerminationCause::kUpstreamReset, "HTTP/2 from the sandbox: " + announced.message());
    return false;
  }
  if (*announced) h2_filter_->set_sandbox_header_table_size(**announced);
  return true;
}

void Connection::open_sandbox() {
  phase_ = Phase::kOpening;
  update_interest();
  uint32_t wake_ms = cfg_->proxy.wake_timeout_ms;
  arm_deadline(wake_ms, TerminationCause::kWakeTimeout);
  if (open_started_ms_ == 0) open_started_ms_ = now_ms(worker_->loop());
  // Every candidate in one request: the node says which verified (an application's own Bearer may come first).
  std::vector<std::string> candidates;
  for (const Credential& c : credentials_) candidates.push_back(c.token);
  // A running sandbox this worker reached recently: the cached route answers what the node would have.
  if (!cached_route_failed_) {
    if (auto cached = worker_->routes().open(route_.target, route_.port, candidates, now_ms(worker_->loop()))) {
      rec_.route_cached = true;
      if (cached->wants_refill) worker_->refill_route(cached->sandbox_id, cached->port);
      OpenAnswer a;
      a.status = 200;
      OpenedSocket& o = a.opened;
      o.id = cached->sandbox_id;
      o.port = cached->port;
      o.policy = std::move(cached->policy);
      o.connect_port = cached->connect_port;
      o.opened_at = cached->opened_at;
      o.token_sha256 = std::move(cached->token_sha256);
      o.credential = cached->credential;
      o.socket = std::move(cached->socket);
      return on_open_result(std::move(a));
    }
  }
  node_call_ = worker_->node().open(route_.target, route_.port, candidates, wake_ms,
                                    [this](Result<OpenAnswer> r) { on_open_result(std::move(r)); });
}


// api.<domain>: the node API, behind the operator token, forwarded to the node's unix socket.
void Connection::open_node_api() {
  const std::string& token = snapshot_->operator_token;
  bool allowed = false;
  for (const auto& c : credentials_) allowed = allowed || (!token.empty() && token_matches(c.token, token));
  if (!allowed) {
    return respond(401, "api." + cfg_->domain + " needs the operator token: Authorization: Bearer <token>\n",
                   TerminationCause::kUnauthorized, {{"WWW-Authenticate", std::string(kBearerChallenge)}});
  }
  rec_.sandbox = "api";
  traffic_ = &node_api_traffic_;
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& path = cfg_->node_socket.path;
  if (!fd.valid() || path.size() >= sizeof addr.sun_path)
    return respond(503, "sandbox runtime unavailable\n", TerminationCause::kNodeUnavailable, {{"Retry-After", "5"}});
  std::memcpy(addr.sun_path, path.data(), path.size());
  start_connect(std::move(fd), reinterpret_cast<sockaddr*>(&addr), sizeof addr, false);
}

void Connection::on_open_result(Result<OpenAnswer> r) {
  auto call = std::move(node_call_);  // destroyed when this function returns, after its callback
  if (!r) {
    if (r.error() == Error::kTimeout)
      return respond(503, "sandbox did not wake in time\n", TerminationCause::kWakeTimeout, {{"Retry-After", "5"}});
    spdlog::warn("node request failed: {}", r.message());
    if (r.error() == Error::kInternal)
      return respond(502, "bad answer from the sandbox runtime\n", TerminationCause::kNodeUnavailable);
    return respond(503, "sandbox runtime unavailable\n", TerminationCause::kNodeUnavailable, {{"Retry-After", "5"}});
  }
  const std::string& message = r->message;
  switch (r->status) {
    case 200:
      break;
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
  OpenedSocket& opened = r->opened;
  rec_.sandbox_id = opened.id;
  // For the next connection's ClientHello (the route's target is the SNI's: Host must equal it), and with
  // spares, for the next connections' opens.
  worker_->routes().store(route_.target, opened.port, opened.policy, now_ms(worker_->loop()));
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
                                       .spares = std::move(opened.spares)},
                            now_ms(worker_->loop()));
  opened_at_ = opened.opened_at;
  rec_.woke = opened.woke;
  rec_.wake_ms = opened.wake_ms;
  const bool port_public = opened.policy.is_public;
  opened_public_ = port_public;
  // none verified (a public port checks none)
  credential_index_ = opened.credential && *opened.credential < credentials_.size() ? *opened.credential
                                                                                   : credentials_.size();
  sandbox_token_sha256_ = opened.token_sha256;
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
  if (!shared->sandbox_limits.try_acquire(rec_.sandbox_id, cfg_->proxy.max_connections_per_sandbox)) {
    return respond(429, "too many connections to this sandbox\n", TerminationCause::kSandboxConnLimit,
                   {{"Retry-After", "1"}});
  }
  holds_sandbox_slot_ = true;
  traffic_ = worker_->traffic().open_connection(rec_.sandbox_id);
  // How to use the socket depends on the driver: connect it to the sandbox-side port (normally the routed
  // port), or take it as it is when the driver already connected it (e.g. a vsock stream).
  const uint16_t connect_port = opened.connect_port;
  const bool connected = opened.connected;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(connect_port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  start_connect(std::move(opened.socket), reinterpret_cast<sockaddr*>(&addr), sizeof addr, connected);
}

void Connection::start_connect(UniqueFd socket, const sockaddr* addr, socklen_t addr_len, bool already_connected) {
  int one = 1;
  ::setsockopt(socket.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  bool connected = already_connected || ::connect(socket.get(), addr, addr_len) == 0;
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
  uv_poll_init(worker_->loop(), &upstream_poll_, upstream_fd_.get());
  upstream_poll_started_ = true;
  ++handles_open_;
  phase_ = Phase::kConnecting;
  if (connected) return begin_forwarding();
  arm_deadline(cfg_->proxy.connect_timeout_ms, TerminationCause::kUpstreamConnectTimeout);
  update_interest();
}

void Connection::finish_connect() {
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(upstream_fd_.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    rec_.detail = std::strerror(err);
    return respond(502, "sandbox is not accepting connections on port " + std::to_string(route_.port) + "\n",
                   TerminationCause::kUpstreamConnectFailed);
  }
  begin_forwarding();
}

void Connection::begin_forwarding() {
  uv_timer_stop(&deadline_);
  phase_ = Phase::kForwarding;
  head_parser_.reset();
  h2_scanner_.reset();
  if (tunnel_) {
    // The head was for the proxy. A fresh socket has room for these few bytes, so one write does it.
    rec_.bytes_in += head_bytes_;
    traffic_->bytes_in += head_bytes_;
    c2u_.consumed(head_bytes_);
    static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
    ERR_clear_error();
    if (SSL_write(ssl_, kEstablished.data(), static_cast<int>(kEstablished.size())) !=
        static_cast<int>(kEstablished.size()))
      return close(TerminationCause::kClientReset, "CONNECT answer: " + take_ssl_error());
    rec_.status = 200;
  }
  if (!tunnel_ && (answers_request_ || route_.kind == RouteKind::kApi)) start_request_filters();
  // h2 frames from the sandbox are parsed (the proxy inserts its own), so they are copied, not spliced.
  if (ktls_tx_ && !h2_frames_) {
    auto pipe = SplicePipe::create(kSplicePipeBytes);
    if (pipe) u2c_pipe_ = std::move(*pipe);
    else if (!ktls_downgrade("no pipe to splice into the kTLS socket: " + pipe.message())) return;
  }
  if (!u2c_pipe_) u2c_ = std::make_unique<ByteBuffer>(kForwardBufferBytes);
  // The request head and anything after it are already in c2u_: they count as client bytes.
  rec_.bytes_in += c2u_.readable();
  traffic_->bytes_in += c2u_.readable();
  last_activity_ms_ = now_ms(worker_->loop());
  uv_timer_start(&idle_timer_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->on_idle_timer(); },
                 uint64_t{cfg_->proxy.idle_timeout_secs} * 1000, 0);
  if (!filter_client_bytes()) return;
  pump();
}

// Moves bytes until every side would block, a side finished, or the budget is spent. Polling is
// level-triggered, so stopping early only yields the loop to other connections; nothing is lost.
void Connection::pump() {
  for (int round = 0; round < 8; ++round) {
    uint64_t before = rec_.bytes_in + rec_.bytes_out;
    size_t pending_before = c2u_pending() + u2c_pending();
    if (!client_eof_ && c2u_room() && !(c2u_pipe_ ? splice_from_client() : read_client())) return;
    if (!filter_client_bytes()) return;
    if (c2u_queued() > 0 && !write_upstream()) return;
    if (c2u_pipe_ && c2u_pipe_->buffered() > 0 && !splice_to_upstream()) return;
    if (!upstream_eof_ && u2c_room() && !(u2c_pipe_ ? splice_from_upstream() : read_upstream())) return;
    if (!frame_upstream_bytes()) return;
    if (u2c_pending() > 0 && !(u2c_pipe_ ? splice_to_client() : write_client())) return;
    if (!handle_half_close()) return;
    if (rec_.bytes_in + rec_.bytes_out == before && c2u_pending() + u2c_pending() == pending_before) break;
  }
  update_interest();
  // Only after a read that stopped for room: one that stopped at WANT_READ left at most a partial record,
  // whose remainder makes the socket readable.
  if (client_read_filled_buffer_ && !client_eof_ && !c2u_pipe_ && c2u_room() && SSL_has_pending(ssl_)) {
    uv_idle_start(&buffered_input_, [](uv_idle_t* h) {
      uv_idle_stop(h);
      auto* self = static_cast<Connection*>(h->data);
      if (self->phase_ == Phase::kForwarding) self->pump();
    });
  }
}

bool Connection::read_client() {
  // Request heads must be read by the filter, so the kernel takes receive over only once none will come.
  if (rx_handover_ != RxHandover::kNone && !SSL_has_pending(ssl_) && !requests_are_read())
    return take_over_client_receive();
  c2u_.make_room();
  // SSL_read returns one record at a time: keep reading until the buffer is full or the socket is dry, so
  // the sandbox gets one large send instead of one per record.
  int n = 0;
  size_t got = 0;
  while (c2u_.space() > 0) {
    ERR_clear_error();
    n = SSL_read(ssl_, c2u_.write_ptr(), static_cast<int>(c2u_.space()));
    if (n <= 0) break;
    c2u_.produced(static_cast<size_t>(n));
    got += static_cast<size_t>(n);
    if (rx_handover_ != RxHandover::kNone) break;  // the kernel takes over at the next record boundary
  }
  client_read_filled_buffer_ = n > 0;
  if (got > 0) {
    rec_.bytes_in += got;
    traffic_->bytes_in += got;
    last_activity_ms_ = now_ms(worker_->loop());
    if (n > 0) return true;  // buffer full; an EOF or error behind the data is seen on the next read
  }
  int err = SSL_get_error(ssl_, n);
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) return true;
  if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)) {
    client_finished_sending();
    return true;
  }
  close(TerminationCause::kClientReset, take_ssl_error());
  return false;
}

void Connection::client_finished_sending() {
  client_eof_ = true;
  if (!upstream_eof_) client_closed_first_ = true;
}

// OpenSSL has handed out every byte it read, so the socket is at a record boundary: from here the kernel
// decrypts and the client's bytes are spliced (the next pump round; c2u_ is delivered first).
bool Connection::take_over_client_receive() {
  RxHandover how = std::exchange(rx_handover_, RxHandover::kNone);
  auto pipe = SplicePipe::create(kSplicePipeBytes);
  if (!pipe) return ktls_downgrade("no pipe to splice from the kTLS socket: " + pipe.message());
  if (how == RxHandover::kInstallTls13Key) {
    if (auto st = ktls_rx_tracker_.install_tls13_rx(ssl_, client_fd_.get()); !st)
      return ktls_downgrade("TLS 1.3 receive not handed to the kernel: " + st.message());
  }
  c2u_pipe_ = std::move(*pipe);
  return true;
}

bool Connection::splice_from_client() {
  ssize_t n = c2u_pipe_->fill(client_fd_.get());
  if (n > 0) {
    rec_.bytes_in += static_cast<uint64_t>(n);
    traffic_->bytes_in += static_cast<uint64_t>(n);
    last_activity_ms_ = now_ms(worker_->loop());
    return true;
  }
  if (n == 0) {
    client_finished_sending();
    return true;
  }
  if (errno == EAGAIN || errno == EINTR) return true;
  // The next record is not application data (an alert, a post-handshake message): splice cannot carry
  // it. It is read once the pipe has delivered what came before it.
  if (errno == EINVAL) {
    if (c2u_pipe_->buffered() == 0) return read_client_control_record();
    control_record_waits_ = true;
    return true;
  }
  close(TerminationCause::kClientReset, std::strerror(errno));
  return false;
}

bool Connection::read_client_control_record() {
  uint8_t type = 0;
  // c2u_ is empty while splicing (c2u_room), so a whole record (at most 16 KiB) fits.
  ssize_t n = recv_tls_record(client_fd_.get(), c2u_.write_ptr(), c2u_.space(), &type);
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return true;
    close(TerminationCause::kClientReset, std::string("kTLS receive: ") + std::strerror(errno));
    return false;
  }
  if (n == 0) {
    client_finished_sending();
    return true;
  }
  const auto* record = reinterpret_cast<const unsigned char*>(c2u_.write_ptr());
  switch (type) {
    case SSL3_RT_APPLICATION_DATA:
      c2u_.produced(static_cast<size_t>(n));
      rec_.bytes_in += static_cast<uint64_t>(n);
      traffic_->bytes_in += static_cast<uint64_t>(n);
      last_activity_ms_ = now_ms(worker_->loop());
      return true;
    case SSL3_RT_ALERT:
      if (n >= 2 && record[1] == SSL_AD_CLOSE_NOTIFY) {
        client_finished_sending();
        return true;
      }
      if (n >= 2 && record[1] == SSL_AD_USER_CANCELLED) return true;  // a close_notify follows
      close(TerminationCause::kClientClosed,
            std::string("TLS alert from the client: ") + SSL_alert_desc_string_long(n >= 2 ? record[1] : 0));
      return false;
    case SSL3_RT_HANDSHAKE:
      if (record[0] == SSL3_MT_KEY_UPDATE) {
        close(TerminationCause::kKtlsKeyUpdate, "the client sent a TLS 1.3 KeyUpdate; this kernel cannot rekey kTLS");
        return false;
      }
      close(TerminationCause::kClientReset, fmt::format("unexpected TLS handshake message {} after the handshake", record[0]));
      return false;
    default:
      close(TerminationCause::kClientReset, fmt::format("unexpected TLS record type {}", type));
      return false;
  }
}

bool Connection::splice_to_upstream() {
  ssize_t n = c2u_pipe_->drain(upstream_fd_.get());
  if (n >= 0) {
    if (c2u_pipe_->buffered() == 0) control_record_waits_ = false;
    return true;
  }
  if (errno == EAGAIN || errno == EINTR) return true;
  return upstream_failed(std::strerror(errno));
}

bool Connection::splice_from_upstream() {
  ssize_t n = u2c_pipe_->fill(upstream_fd_.get());
  if (n > 0) {
    rec_.bytes_out += static_cast<uint64_t>(n);
    traffic_->bytes_out += static_cast<uint64_t>(n);
    last_activity_ms_ = now_ms(worker_->loop());
    return true;
  }
  if (n == 0) {
    if (awaiting_first_response()) return upstream_failed("the sandbox closed the connection");
    upstream_eof_ = true;
    return true;
  }
  if (errno == EAGAIN || errno == EINTR) return true;
  return upstream_failed(std::strerror(errno));
}

bool Connection::splice_to_client() {
  // The kernel cuts the spliced bytes into TLS records as it sends them.
  ssize_t n = u2c_pipe_->drain(client_fd_.get());
  if (n >= 0 || errno == EAGAIN || errno == EINTR) return true;
  close(TerminationCause::kClientReset, std::strerror(errno));
  return false;
}

bool Connection::write_upstream() {
  const char* data = filtered() ? c2u_out_.data() + c2u_out_sent_ : c2u_.read_ptr();
  ssize_t n = ::send(upstream_fd_.get(), data, c2u_queued(), MSG_NOSIGNAL);
  if (n >= 0) {
    if (filtered()) {
      c2u_out_sent_ += static_cast<size_t>(n);
      compact(c2u_out_, c2u_out_sent_);
    } else {
      c2u_.consumed(static_cast<size_t>(n));
    }
    return true;
  }
  if (errno == EAGAIN || errno == EINTR) return true;
  return upstream_failed(std::strerror(errno));
}

bool Connection::read_upstream() {
  u2c_->make_room();
  ssize_t n = ::recv(upstream_fd_.get(), u2c_->write_ptr(), u2c_->space(), 0);
  if (n > 0) {
    u2c_->produced(static_cast<size_t>(n));
    rec_.bytes_out += static_cast<uint64_t>(n);
    traffic_->bytes_out += static_cast<uint64_t>(n);
    last_activity_ms_ = now_ms(worker_->loop());
    return true;
  }
  if (n == 0) {
    if (awaiting_first_response()) return upstream_failed("the sandbox closed the connection");
    upstream_eof_ = true;
    return true;
  }
  if (errno == EAGAIN || errno == EINTR) return true;
  return upstream_failed(std::strerror(errno));
}

bool Connection::write_client() {
  ERR_clear_error();
  const char* data = h2_frames_ ? u2c_out_.data() + u2c_out_sent_ : u2c_->read_ptr();
  int n = SSL_write(ssl_, data, static_cast<int>(u2c_queued()));
  if (n > 0) {
    if (h2_frames_) {
      u2c_out_sent_ += static_cast<size_t>(n);
      compact(u2c_out_, u2c_out_sent_);
    } else {
      u2c_->consumed(static_cast<size_t>(n));
    }
    return true;
  }
  int err = SSL_get_error(ssl_, n);
  if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) return true;
  close(TerminationCause::kClientReset, err == SSL_ERROR_SYSCALL ? std::strerror(errno) : take_ssl_error());
  return false;
}

// A side that finished sending is told so once its buffered bytes are delivered: FIN to the sandbox,
// close_notify (then FIN) to the client. The connection ends when both directions are done.
bool Connection::handle_half_close() {
  if (client_eof_ && c2u_pending() == 0 && !upstream_shut_) {
    ::shutdown(upstream_fd_.get(), SHUT_WR);
    upstream_shut_ = true;
  }
  if (upstream_eof_ && u2c_pending() == 0 && pending_refusal_) {
    // The sandbox answered the requests before the refused one: now the refusal, then the connection ends.
    RequestRefusal refusal = std::move(*pending_refusal_);
    pending_refusal_.reset();
    u2c_pipe_.reset();
    rec_.detail = refusal.message.substr(0, refusal.message.find_last_not_of('\n') + 1);
    respond(refusal.status, refusal.message, refusal.cause);
    return false;
  }
  if (upstream_eof_ && u2c_pending() == 0 && !client_shut_) {
    ERR_clear_error();
    int r = SSL_shutdown(ssl_);
    if (r < 0) {
      int err = SSL_get_error(ssl_, r);
      if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) return true;  // retried when writable
    }
    ::shutdown(client_fd_.get(), SHUT_WR);
    client_shut_ = true;
  }
  if (upstream_shut_ && client_shut_) {
    close(client_closed_first_ ? TerminationCause::kClientClosed : TerminationCause::kUpstreamClosed);
    return false;
  }
  return true;
}

bool Connection::awaiting_first_response() const {
  return answers_request_ && rec_.bytes_out == 0 && !client_eof_ && !c2u_pipe_ && !pending_refusal_;
}

// A sandbox that resets (or closes) before its first byte leaves the client's request unanswered: on an
// HTTP route the client gets a 502 that names the cause, as from nginx, instead of a reset of its own.
bool Connection::upstream_failed(std::string detail) {
  if (!awaiting_first_response()) {
    close(TerminationCause::kUpstreamReset, std::move(detail));
    return false;
  }
  rec_.detail = "port " + std::to_string(route_.port) + ": " + detail + ", before any response";
  u2c_pipe_.reset();  // nothing came from the sandbox, so nothing is buffered there
  respond(502, "sandbox " + route_.target + ", " + rec_.detail + "\n", TerminationCause::kUpstreamReset);
  return false;
}

void Connection::respond(int status, std::string_view body, TerminationCause cause,
                         std::vector<HttpHeader> extra_headers) {
  rec_.status = status;
  static constexpr std::string_view kText = "text/plain; charset=utf-8";
  Result<std::string> out = !h2_             ? http1_refusal(status, kText, body, extra_headers)
                            : h2_stream_ != 0 ? h2_refusal(h2_stream_, status, kText, body, extra_headers)
                                              // no request yet to answer on: end the connection
                                              : Result<std::string>(h2_goaway(H2ErrorCode::kProtocolError, body));
  if (!out) return close(cause, "cannot build the response: " + out.message());
  respond_bytes(std::move(*out), cause);
}

void Connection::respond_bytes(std::string out, TerminationCause cause) {
  respond_cause_ = cause;
  uv_timer_stop(&deadline_);
  node_call_.reset();
  u2c_ = std::make_unique<ByteBuffer>(out.size());
  std::memcpy(u2c_->write_ptr(), out.data(), out.size());
  u2c_->produced(out.size());
  phase_ = Phase::kResponding;
  // A response must not wait forever on a client that does not read.
  arm_deadline(cfg_->proxy.request_head_timeout_ms, cause);
  flush_response();
}

void Connection::flush_response() {
  while (u2c_->readable() > 0) {
    ERR_clear_error();
    int n = SSL_write(ssl_, u2c_->read_ptr(), static_cast<int>(u2c_->readable()));
    if (n <= 0) {
      int err = SSL_get_error(ssl_, n);
      if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) return update_interest();
      return close(respond_cause_, take_ssl_error());
    }
    u2c_->consumed(static_cast<size_t>(n));
  }
  ERR_clear_error();
  SSL_shutdown(ssl_);
  ::shutdown(client_fd_.get(), SHUT_WR);
  phase_ = Phase::kLingering;
  lingered_bytes_ = 0;
  arm_deadline(kLingerMs, respond_cause_);
  linger();
}

void Connection::linger() {
  char scratch[16 * 1024];
  for (;;) {
    ssize_t n = ::recv(client_fd_.get(), scratch, sizeof scratch, 0);
    if (n > 0) {
      lingered_bytes_ += static_cast<size_t>(n);
      if (lingered_bytes_ > kMaxLingerBytes) return close(respond_cause_);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return update_interest();
    return close(respond_cause_);  // EOF or error: the client is done
  }
}

bool Connection::cut_if_opened_before(const std::string& sandbox_id, uint64_t stamp, Cut why) {
  if (opened_at_ == 0 || opened_at_ >= stamp || rec_.sandbox_id != sandbox_id || phase_ == Phase::kClosed)
    return false;
  if (why == Cut::kTokenRevoked) {
    if (opened_public_) return false;
    close(TerminationCause::kTokenRevoked, "the sandbox's token was rotated while the connection was open");
  } else {
    close(TerminationCause::kSandboxSuspended, "the sandbox was suspended while the connection was open");
  }
  return true;
}

void Connection::release_sandbox_slot() {
  if (holds_sandbox_slot_) worker_->shared()->sandbox_limits.release(rec_.sandbox_id);
  holds_sandbox_slot_ = false;
  if (traffic_) worker_->traffic().close_connection(rec_.sandbox_id);
  traffic_ = nullptr;
}

void Connection::close(TerminationCause cause, std::string detail) {
  if (phase_ == Phase::kClosed) return;
  phase_ = Phase::kClosed;
  rec_.cause = cause;
  if (!detail.empty() && rec_.detail.empty()) rec_.detail = std::move(detail);
  node_call_.reset();
  worker_->shared()->access_log->write(rec_);
  release_sandbox_slot();
  if (!client_slot_.empty()) worker_->shared()->client_limits.release(client_slot_);
  worker_->shared()->open_connections.fetch_sub(1, std::memory_order_relaxed);
  worker_->forget(this);

  auto on_closed = [](uv_handle_t* h) {
    auto* self = static_cast<Connection*>(h->data);
    if (--self->handles_open_ == 0) delete self;
  };
  // Stop polling before the descriptors close (libuv must not watch a closed fd), then free the handles.
  uv_close(reinterpret_cast<uv_handle_t*>(&client_poll_), on_closed);
  if (upstream_poll_started_) uv_close(reinterpret_cast<uv_handle_t*>(&upstream_poll_), on_closed);
  uv_close(reinterpret_cast<uv_handle_t*>(&deadline_), on_closed);
  uv_close(reinterpret_cast<uv_handle_t*>(&idle_timer_), on_closed);
  uv_close(reinterpret_cast<uv_handle_t*>(&buffered_input_), on_closed);
  if (ssl_) {
    SSL_free(ssl_);
    ssl_ = nullptr;
  }
  client_fd_.reset();
  upstream_fd_.reset();
  c2u_pipe_.reset();
  u2c_pipe_.reset();
}

}  // namespace sg
