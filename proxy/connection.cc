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
// After an error response: how long and how much unread client input we drain before closing.
constexpr uint32_t kLingerMs = 2000;
constexpr size_t kMaxLingerBytes = 4 * 1024 * 1024;

uint64_t now_ms(uv_loop_t* loop) { return uv_now(loop); }

}  // namespace

Connection::Connection(Worker* worker, UniqueFd client, std::string peer)
    : worker_(worker),
      snapshot_(worker->shared()->snapshot()),
      cfg_(snapshot_->config.get()),
      tls_(snapshot_->tls.get()),
      client_fd_(std::move(client)),
      // The head must fit in the buffer that later forwards it; one byte more detects "too large".
      request_(std::max<size_t>(kForwardBufferBytes, cfg_->proxy.max_request_head_bytes + 1)) {
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

Connection::~Connection() = default;

void Connection::start() {
  SSL* ssl = SSL_new(tls_->default_ctx());
  if (!ssl) return close(TerminationCause::kHandshakeFailed, "SSL_new: " + take_ssl_error());
  client_ = std::make_unique<TlsTransport>(ssl, client_fd_.get(), &ktls_rx_tracker_);
  SSL_set_fd(ssl, client_fd_.get());
  SSL_set_accept_state(ssl);
  SSL_set_ex_data(ssl, hello_ex_index(), &hello_);
  if (tls_->ktls_possible()) ktls_rx_tracker_.attach(ssl);
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
      if (c2u_->wants_source_readable()) want_client |= UV_READABLE;
      if (u2c_->wants_sink_writable()) want_client |= UV_WRITABLE;
      if (u2c_->wants_source_readable()) want_upstream |= UV_READABLE;
      if (c2u_->wants_sink_writable()) want_upstream |= UV_WRITABLE;
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
  int r = SSL_do_handshake(client_->ssl());
  rec_.sni = hello_.sni;
  if (r == 1) return after_handshake();
  int err = SSL_get_error(client_->ssl(), r);
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
  if (auto known = worker_->port_policies().find(route->target, port, now_ms(worker_->loop()))) {
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
    worker_->port_policies().store(target, r->port, r->policy, now_ms(worker_->loop()));
  } else if (!r) {
    spdlog::warn("port policy lookup failed: {}", r.message());
  }
  do_handshake();
}

void Connection::after_handshake() {
  ktls_rx_tracker_.handshake_finished();
  const unsigned char* alpn = nullptr;
  unsigned alpn_len = 0;
  SSL_get0_alpn_selected(client_->ssl(), &alpn, &alpn_len);
  h2_ = alpn_len == 2 && std::memcmp(alpn, "h2", 2) == 0;
  rec_.tls_version = SSL_get_version(client_->ssl());
  plan_data_path();
  if (cfg_->proxy.ktls == KtlsMode::kOn && (!client_->ktls_tx() || !client_->ktls_rx_planned()))
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
    // Everything scanned stays in request_ to be forwarded, so the scan may not outgrow it.
    h2_scanner_ = std::make_unique<H2RequestScanner>(H2ScanLimits{
        .max_bytes_before_request = request_.space() - 1, .max_header_list_bytes = cfg_->proxy.max_request_head_bytes});
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
void Connection::plan_data_path() {
  client_->plan_ktls();
  const bool tx = client_->ktls_tx();
  const bool rx = client_->ktls_rx_planned();
  set_data_path_label(tx, rx);
  std::string why;
  if (cfg_->proxy.ktls == KtlsMode::kOff) {
    why = "ktls = off in the config";
  } else if (!tls_->ktls_kernel_reason().empty()) {
    why = tls_->ktls_kernel_reason();
  } else if (!tx || !rx) {
    SSL* ssl = client_->ssl();
    why = fmt::format("OpenSSL did not offload {} for {} {}: cipher not offloadable", tx ? "receive" : "transmit",
                      SSL_get_version(ssl), SSL_get_cipher_name(ssl));
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
  set_data_path_label(u2c_ && u2c_->spliced(), (c2u_ && c2u_->spliced()) || client_->ktls_rx_planned());
  if (cfg_->proxy.ktls != KtlsMode::kOn) return true;
  close(TerminationCause::kKtlsRequired, std::move(why));
  return false;
}

void Connection::read_head() {
  for (;;) {
    IoResult r = client_->read(std::span<char>(request_.write_ptr(), request_.space()));
    if (r.bytes > 0) {
      const char* fresh = request_.write_ptr();
      request_.produced(r.bytes);
      if (h2_) {
        auto scanned = h2_scanner_->scan(std::string_view(request_.read_ptr(), request_.readable()));
        if (!scanned) {
          bool too_large = scanned.error() == Error::kLimitExceeded;
          rec_.detail = scanned.message();
          return respond_bytes(h2_goaway(too_large ? H2ErrorCode::kEnhanceYourCalm : H2ErrorCode::kProtocolError,
                                         scanned.message()),
                               too_large ? TerminationCause::kHeadTooLarge : TerminationCause::kBadRequest);
        }
        if (*scanned) {
          H2Request& req = **scanned;
          h2_stream_ = req.stream_id;
          return on_request(req.authority, req.method, req.path, req.headers);
        }
      } else {
        switch (head_parser_->feed(fresh, r.bytes)) {
          case HttpParser::State::kNeedMore:
            break;
          case HttpParser::State::kHeadComplete:
          case HttpParser::State::kMessageComplete:
            head_bytes_ = request_.readable() - r.bytes + head_parser_->consumed();
            return on_head();
          case HttpParser::State::kError:
            if (head_parser_->failure().code == Error::kLimitExceeded)
              return respond(431, "request head too large\n", TerminationCause::kHeadTooLarge);
            return respond(400, head_parser_->failure().message + "\n", TerminationCause::kBadRequest);
        }
      }
    }
    switch (r.status) {
      case IoResult::Status::kOk:
        continue;
      case IoResult::Status::kWouldBlock:
        return update_interest();
      case IoResult::Status::kEof:
        return close(TerminationCause::kClientClosed, "closed before a request head");
      case IoResult::Status::kError:
      case IoResult::Status::kNotData:
        return close(TerminationCause::kClientReset, r.detail);
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
  tunnel_ = method == "CONNECT";
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

bool Connection::filter_client_bytes(std::string_view in, std::string& out) {
  if (in.empty()) return true;
  if (h1_filter_) {
    const bool was_reading = h1_filter_->state() == Http1RequestFilter::State::kRequests;
    const auto state = h1_filter_->feed(in, out);
    if (was_reading && state == Http1RequestFilter::State::kRefused) {
      if (!pending_refusal_) {  // malformed or oversized, found by the filter itself
        const auto& r = h1_filter_->refusal();
        pending_refusal_ = RequestRefusal{r.status, r.status == 431 ? TerminationCause::kHeadTooLarge
                                                                    : TerminationCause::kBadRequest,
                                          r.reason + "\n"};
      }
      // Nothing more is read or forwarded: the sandbox gets a FIN after the requests before the refused one,
      // answers them, closes, and then the refusal is answered (handle_half_close).
      c2u_->stop_reading();
    }
    return true;
  }
  to_client_frames_.clear();
  Status st = h2_filter_->feed(in, out, to_client_frames_);
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
  return u2c_->run_stage();
}

bool Connection::frame_upstream_bytes(std::string_view in, std::string& out) {
  auto announced = h2_frames_->feed(in, out);
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
      worker_->port_policies().erase(route_.target, route_.port);
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
  // For the next connection's ClientHello (the route's target is the SNI's: Host must equal it).
  worker_->port_policies().store(route_.target, opened.port, opened.policy, now_ms(worker_->loop()));
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
  upstream_fd_ = std::move(socket);
  upstream_ = std::make_unique<TcpTransport>(upstream_fd_.get());
  int one = 1;
  ::setsockopt(upstream_fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  uv_poll_init(worker_->loop(), &upstream_poll_, upstream_fd_.get());
  upstream_poll_started_ = true;
  ++handles_open_;
  phase_ = Phase::kConnecting;
  if (already_connected) return begin_forwarding();
  if (::connect(upstream_fd_.get(), addr, addr_len) == 0) return begin_forwarding();
  if (errno != EINPROGRESS) {
    return respond(502, "sandbox is not accepting connections on port " + std::to_string(route_.port) + "\n",
                   TerminationCause::kUpstreamConnectFailed);
  }
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
    request_.consumed(head_bytes_);
    static constexpr std::string_view kEstablished = "HTTP/1.1 200 Connection established\r\n\r\n";
    if (IoResult r = client_->write(kEstablished); r.bytes != kEstablished.size())
      return close(TerminationCause::kClientReset, "CONNECT answer: " + r.detail);
    rec_.status = 200;
  }
  // The request head and anything after it are already in request_: they count as client bytes.
  rec_.bytes_in += request_.readable();
  traffic_->bytes_in += request_.readable();
  start_directions();
  if (!tunnel_ && (answers_request_ || route_.kind == RouteKind::kApi)) {
    start_request_filters();
    c2u_->set_stage([this](std::string_view in, std::string& out) { return filter_client_bytes(in, out); });
    if (h2_frames_)
      u2c_->set_stage([this](std::string_view in, std::string& out) { return frame_upstream_bytes(in, out); });
  }
  last_activity_ms_ = now_ms(worker_->loop());
  uv_timer_start(&idle_timer_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->on_idle_timer(); },
                 uint64_t{cfg_->proxy.idle_timeout_secs} * 1000, 0);
  if (!c2u_->run_stage()) return;
  pump();
}

void Connection::start_directions() {
  auto client_failed = [this](IoResult r) {
    close(r.cause.value_or(TerminationCause::kClientReset), std::move(r.detail));
    return false;
  };
  auto sandbox_failed = [this](IoResult r) { return upstream_failed(std::move(r.detail)); };
  auto downgrade = [this](std::string why) { return ktls_downgrade(std::move(why)); };
  Direction::Hooks to_sandbox{
      .received =
          [this](size_t n) {
            rec_.bytes_in += n;
            traffic_->bytes_in += n;
            last_activity_ms_ = now_ms(worker_->loop());
          },
      .source_finished =
          [this] {
            if (!u2c_->source_done()) client_closed_first_ = true;
            return true;
          },
      .source_failed = client_failed,
      .sink_failed = sandbox_failed,
      // Request heads must be read by the filter, so the kernel takes receive over only once none will come.
      .may_splice = [this] { return !requests_are_read(); },
      .splice_refused = downgrade,
  };
  Direction::Hooks to_client{
      .received =
          [this](size_t n) {
            rec_.bytes_out += n;
            traffic_->bytes_out += n;
            last_activity_ms_ = now_ms(worker_->loop());
          },
      .source_finished =
          [this] { return !awaiting_first_response() || upstream_failed("the sandbox closed the connection"); },
      .source_failed = sandbox_failed,
      .sink_failed = client_failed,
      // h2 frames from the sandbox are parsed (the proxy inserts its own), so they are copied, not spliced.
      .may_splice = [this] { return !h2_frames_; },
      .splice_refused = downgrade,
  };
  c2u_ = std::make_unique<Direction>(client_.get(), upstream_.get(), std::move(request_), std::move(to_sandbox));
  u2c_ = std::make_unique<Direction>(upstream_.get(), client_.get(), ByteBuffer(kForwardBufferBytes),
                                     std::move(to_client));
}

// Moves bytes until every side would block, a side finished, or the budget is spent. Polling is
// level-triggered, so stopping early only yields the loop to other connections; nothing is lost.
void Connection::pump() {
  for (int round = 0; round < 8; ++round) {
    uint64_t before = rec_.bytes_in + rec_.bytes_out;
    size_t pending_before = c2u_->pending() + u2c_->pending();
    if (!c2u_->move()) return;
    if (!u2c_->move()) return;
    if (!handle_half_close()) return;
    if (rec_.bytes_in + rec_.bytes_out == before && c2u_->pending() + u2c_->pending() == pending_before) break;
  }
  update_interest();
  // Only after a read that stopped for room: one that stopped at WANT_READ left at most a partial record,
  // whose remainder makes the socket readable.
  if (c2u_->hidden_input() || u2c_->hidden_input()) {
    uv_idle_start(&buffered_input_, [](uv_idle_t* h) {
      uv_idle_stop(h);
      auto* self = static_cast<Connection*>(h->data);
      if (self->phase_ == Phase::kForwarding) self->pump();
    });
  }
}

// A side that finished sending is told so once its buffered bytes are delivered: FIN to the sandbox,
// close_notify (then FIN) to the client. The connection ends when both directions are done.
bool Connection::handle_half_close() {
  c2u_->shut_sink_when_done();
  if (u2c_->source_done() && u2c_->pending() == 0 && pending_refusal_) {
    // The sandbox answered the requests before the refused one: now the refusal, then the connection ends.
    RequestRefusal refusal = std::move(*pending_refusal_);
    pending_refusal_.reset();
    rec_.detail = refusal.message.substr(0, refusal.message.find_last_not_of('\n') + 1);
    respond(refusal.status, refusal.message, refusal.cause);
    return false;
  }
  u2c_->shut_sink_when_done();
  if (c2u_->sink_shut() && u2c_->sink_shut()) {
    close(client_closed_first_ ? TerminationCause::kClientClosed : TerminationCause::kUpstreamClosed);
    return false;
  }
  return true;
}

bool Connection::awaiting_first_response() const {
  return answers_request_ && rec_.bytes_out == 0 && c2u_ && !c2u_->source_done() && !c2u_->spliced() && !pending_refusal_;
}

// A sandbox that resets (or closes) before its first byte leaves the client's request unanswered: on an
// HTTP route the client gets a 502 that names the cause, as from nginx, instead of a reset of its own.
bool Connection::upstream_failed(std::string detail) {
  if (!awaiting_first_response()) {
    close(TerminationCause::kUpstreamReset, std::move(detail));
    return false;
  }
  rec_.detail = "port " + std::to_string(route_.port) + ": " + detail + ", before any response";
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
  response_ = std::make_unique<ByteBuffer>(out.size());
  std::memcpy(response_->write_ptr(), out.data(), out.size());
  response_->produced(out.size());
  phase_ = Phase::kResponding;
  // A response must not wait forever on a client that does not read.
  arm_deadline(cfg_->proxy.request_head_timeout_ms, cause);
  flush_response();
}

void Connection::flush_response() {
  while (response_->readable() > 0) {
    IoResult r = client_->write(std::span<const char>(response_->read_ptr(), response_->readable()));
    if (r.status == IoResult::Status::kWouldBlock) return update_interest();
    if (r.status == IoResult::Status::kError) return close(respond_cause_, std::move(r.detail));
    response_->consumed(r.bytes);
  }
  // Once: a close_notify that cannot be sent now is not waited for (the client has its answer).
  if (!client_->shutdown_write()) ::shutdown(client_fd_.get(), SHUT_WR);
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

void Connection::close(TerminationCause cause, std::string detail) {
  if (phase_ == Phase::kClosed) return;
  phase_ = Phase::kClosed;
  rec_.cause = cause;
  if (!detail.empty() && rec_.detail.empty()) rec_.detail = std::move(detail);
  node_call_.reset();
  worker_->shared()->access_log->write(rec_);
  if (holds_sandbox_slot_) worker_->shared()->sandbox_limits.release(rec_.sandbox_id);
  if (!client_slot_.empty()) worker_->shared()->client_limits.release(client_slot_);
  if (traffic_) worker_->traffic().close_connection(rec_.sandbox_id);
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
  // The directions and transports stay until the handles are closed: close() may run inside one of them.
  client_fd_.reset();
  upstream_fd_.reset();
}

}  // namespace sg
