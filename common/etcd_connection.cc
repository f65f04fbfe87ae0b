#include "common/etcd_connection.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/tls_client.h"

namespace sg::etcd {

std::string Member::to_string() const { return (tls ? "https://" : "http://") + endpoint.to_string(); }

Result<Member> parse_member(std::string_view text) {
  std::string_view rest = text;
  Member m;
  if (rest.starts_with("https://")) {
    rest.remove_prefix(8);
    m.tls = true;
  } else if (rest.starts_with("http://")) {
    rest.remove_prefix(7);
  } else if (rest.find("://") != std::string_view::npos) {
    return fail(Error::kInvalidArgument, "etcd member " + std::string(text) + ": only http:// and https:// are supported");
  }
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  auto ep = parse_endpoint(rest);
  if (!ep || ep->kind != Endpoint::Kind::kTcp)
    return fail(Error::kInvalidArgument, "etcd member " + std::string(text) + ": must be http(s)://IP:PORT");
  m.endpoint = std::move(*ep);
  return m;
}

namespace {

// OpenSSL writes to the socket with write(2), not send(MSG_NOSIGNAL): a member that reset the connection
// would raise SIGPIPE, which kills a process that does not ignore it. Blocked in this thread around each
// TLS call, and one raised meanwhile is taken off again.
class NoSigpipe {
 public:
  NoSigpipe() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    blocked_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~NoSigpipe() {
    if (!blocked_) return;
    const int saved = errno;
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      const timespec now{0, 0};
      sigtimedwait(&pipe_, nullptr, &now);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    errno = saved;
  }
  NoSigpipe(const NoSigpipe&) = delete;
  NoSigpipe& operator=(const NoSigpipe&) = delete;

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false, blocked_ = false;
};

// OpenSSL's errors for a failed TLS read, write or handshake; when the member refused our certificate (or
// its absence), with what to set.
Failure tls_failure(const std::string& where) {
  // A system call's failure leaves OpenSSL's queue empty: errno says what happened.
  if (ERR_peek_error() == 0)
    return fail(Error::kUnavailable, where + (errno != 0 ? std::strerror(errno) : "the connection ended"));
  const int reason = ERR_GET_REASON(ERR_peek_last_error());
  const bool certificate_refused = reason == SSL_R_SSLV3_ALERT_BAD_CERTIFICATE ||
                                   reason == SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED ||
                                   reason == SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN ||
                                   reason == SSL_R_TLSV1_ALERT_UNKNOWN_CA;
  return fail(Error::kUnavailable,
              where + openssl_errors() +
                  (certificate_refused ? " (the member refused this client's certificate, or its absence: set "
                                         "fleet.etcd_cert and etcd_key to one signed by its --trusted-ca-file)"
                                       : ""));
}

}  // namespace

// ---- TlsSetup ----

Result<std::shared_ptr<TlsSetup>> TlsSetup::create(const TlsFiles& files, size_t members) {
  if (files.cert.empty() != files.key.empty())
    return fail(Error::kInvalidArgument, "etcd TLS: etcd_cert and etcd_key go together (one is missing)");
  ERR_clear_error();
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  if (ctx == nullptr) return fail(Error::kInternal, "etcd TLS setup: " + openssl_errors());
  std::shared_ptr<TlsSetup> setup(new TlsSetup(ctx, files.server_name, members));
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  // An answer is delimited by its own framing (the reader notices a cut one): a member that drops TCP
  // without close_notify has still ended the stream.
  SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Sessions are kept per member by this class (a new connection per request), not by OpenSSL's cache.
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
  SSL_CTX_sess_set_new_cb(ctx, on_new_session);
  if (SSL_CTX_set_ex_data(ctx, context_slot(), setup.get()) != 1)
    return fail(Error::kInternal, "etcd TLS setup: " + openssl_errors());
  const int loaded = files.cacert.empty() ? SSL_CTX_set_default_verify_paths(ctx)
                                          : SSL_CTX_load_verify_locations(ctx, files.cacert.c_str(), nullptr);
  if (loaded != 1)
    return fail(Error::kInvalidArgument,
                "etcd TLS: cannot load the CA certificates" + (files.cacert.empty() ? "" : " from " + files.cacert) +
                    ": " + openssl_errors());
  if (!files.cert.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, files.cert.c_str()) != 1)
      return fail(Error::kInvalidArgument, "etcd TLS: cannot load the client certificate " + files.cert + ": " + openssl_errors());
    const bool key_loaded = SSL_CTX_use_PrivateKey_file(ctx, files.key.c_str(), SSL_FILETYPE_PEM) == 1;
    if (!key_loaded && ERR_GET_REASON(ERR_peek_last_error()) != X509_R_KEY_VALUES_MISMATCH)
      return fail(Error::kInvalidArgument, "etcd TLS: cannot load the client key " + files.key + ": " + openssl_errors());
    if (!key_loaded || SSL_CTX_check_private_key(ctx) != 1) {
      ERR_clear_error();
      return fail(Error::kInvalidArgument, "etcd TLS: the key " + files.key + " does not belong to " + files.cert);
    }
  }
  return setup;
}

TlsSetup::TlsSetup(SSL_CTX* ctx, std::string server_name, size_t members)
    : ctx_(ctx), server_name_(std::move(server_name)), sessions_(members, nullptr) {}

TlsSetup::~TlsSetup() {
  for (SSL_SESSION* s : sessions_) SSL_SESSION_free(s);
  SSL_CTX_free(ctx_);
}

SSL_SESSION* TlsSetup::session(size_t i) const {
  std::lock_guard lock(mu_);
  if (i >= sessions_.size() || sessions_[i] == nullptr) return nullptr;
  SSL_SESSION_up_ref(sessions_[i]);
  return sessions_[i];
}

// OpenSSL hands each session (a TLS 1.3 ticket arrives after the handshake) to this callback. A copy is
// kept, so the session other threads resume is never the object a live connection still updates.
int TlsSetup::on_new_session(SSL* ssl, SSL_SESSION* session) {
  auto* setup = static_cast<TlsSetup*>(SSL_CTX_get_ex_data(SSL_get_SSL_CTX(ssl), context_slot()));
  auto* index = static_cast<size_t*>(SSL_get_ex_data(ssl, connection_slot()));
  if (setup == nullptr || index == nullptr || SSL_SESSION_is_resumable(session) != 1) return 0;
  SSL_SESSION* copy = SSL_SESSION_dup(session);
  if (copy == nullptr) return 0;
  std::lock_guard lock(setup->mu_);
  if (*index >= setup->sessions_.size()) {
    SSL_SESSION_free(copy);
    return 0;
  }
  SSL_SESSION_free(setup->sessions_[*index]);
  setup->sessions_[*index] = copy;
  return 0;  // the original stays OpenSSL's
}

int TlsSetup::context_slot() {
  static const int slot = SSL_CTX_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return slot;
}

int TlsSetup::connection_slot() {
  static const int slot = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return slot;
}

size_t TlsSetup::resumed() const {
  std::lock_guard lock(mu_);
  return resumed_;
}

void TlsSetup::count_handshake(bool resumed) {
  std::lock_guard lock(mu_);
  if (resumed) resumed_++;
}

// ---- MemberConnection ----

Result<MemberConnection> MemberConnection::open(const Member& member, size_t index, TlsSetup* tls,
                                                Clock::time_point deadline) {
  const std::string where = member.to_string();
  auto fd = connect_blocking(member.endpoint, std::max(remaining_ms(deadline), 1));
  if (!fd) return fd.failure();
  ::fcntl(fd->get(), F_SETFL, ::fcntl(fd->get(), F_GETFL) | O_NONBLOCK);
  if (!member.tls) return MemberConnection(std::move(*fd), nullptr, nullptr);
  if (tls == nullptr) return fail(Error::kInternal, where + ": an https member without TLS set up");
  ERR_clear_error();
  std::unique_ptr<SSL, SslFree> ssl(SSL_new(tls->context()));
  if (!ssl || SSL_set_fd(ssl.get(), fd->get()) != 1) return fail(Error::kInternal, "etcd TLS setup: " + openssl_errors());
  // The certificate must name what we dialled: the configured server name, or else the member's address.
  const std::string& name = tls->server_name();
  const bool named = !name.empty() ? SSL_set_tlsext_host_name(ssl.get(), name.c_str()) == 1 &&
                                         SSL_set1_host(ssl.get(), name.c_str()) == 1
                                   : X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()),
                                                                   member.endpoint.host.c_str()) == 1;
  if (!named) return fail(Error::kInternal, "etcd TLS setup: " + openssl_errors());
  // The member's index, for on_new_session: it lives in the connection, which outlives its SSL.
  auto slot = std::make_unique<size_t>(index);
  if (SSL_set_ex_data(ssl.get(), TlsSetup::connection_slot(), slot.get()) != 1)
    return fail(Error::kInternal, "etcd TLS setup: " + openssl_errors());
  if (SSL_SESSION* s = tls->session(index)) {
    SSL_set_session(ssl.get(), s);
    SSL_SESSION_free(s);
  }
  for (;;) {
    ERR_clear_error();
    errno = 0;
    const NoSigpipe no_sigpipe;
    int ret = SSL_connect(ssl.get());
    if (ret == 1) break;
    if (long v = SSL_get_verify_result(ssl.get()); v != X509_V_OK) {
      const std::string expected = name.empty() ? "its address " + member.endpoint.host : name;
      if (v == X509_V_ERR_HOSTNAME_MISMATCH || v == X509_V_ERR_IP_ADDRESS_MISMATCH)
        return fail(Error::kUnavailable, where + ": its certificate does not name " + expected +
                                             " (set fleet.etcd_server_name to the name it carries)");
      return fail(Error::kUnavailable, where + ": its certificate is not trusted (" +
                                           X509_verify_cert_error_string(v) +
                                           "): set fleet.etcd_cacert to the CA that signed it");
    }
    int err = SSL_get_error(ssl.get(), ret);
    short events = err == SSL_ERROR_WANT_READ ? POLLIN : err == SSL_ERROR_WANT_WRITE ? POLLOUT : 0;
    if (events == 0) return tls_failure(where + ": TLS handshake failed: ");
    if (Status s = wait_fd(fd->get(), events, deadline, "in the TLS handshake with " + where); !s) return s.failure();
  }
  tls->count_handshake(SSL_session_reused(ssl.get()) == 1);
  return MemberConnection(std::move(*fd), std::move(ssl), std::move(slot));
}

Result<MemberConnection::ReadNow> MemberConnection::read_now(char* buf, size_t cap) {
  ReadNow r;
  if (!ssl_) {
    for (;;) {
      ssize_t n = ::recv(fd_.get(), buf, cap, MSG_DONTWAIT);
      if (n > 0) r.bytes = static_cast<size_t>(n);
      else if (n == 0) r.ended = true;
      else if (errno == EINTR) continue;
      else if (errno == EAGAIN || errno == EWOULDBLOCK) r.wait_events = POLLIN;
      else if (errno == ECONNRESET) return fail(Error::kUnavailable, "the connection was reset");
      else return fail_errno("recv", errno);
      return r;
    }
  }
  ERR_clear_error();
  errno = 0;
  const NoSigpipe no_sigpipe;  // a read may write too (a key update's answer, an alert)
  size_t got = 0;
  int ret = SSL_read_ex(ssl_.get(), buf, cap, &got);
  if (ret == 1) {
    r.bytes = got;
    return r;
  }
  switch (SSL_get_error(ssl_.get(), ret)) {
    case SSL_ERROR_WANT_READ: r.wait_events = POLLIN; return r;
    case SSL_ERROR_WANT_WRITE: r.wait_events = POLLOUT; return r;
    case SSL_ERROR_ZERO_RETURN: r.ended = true; return r;
    case SSL_ERROR_SYSCALL:
      if (errno == ECONNRESET) return fail(Error::kUnavailable, "the connection was reset");
      if (ERR_peek_error() == 0 && errno == 0) {
        r.ended = true;
        return r;
      }
      [[fallthrough]];
    default:
      return tls_failure("TLS: ");
  }
}

Result<size_t> MemberConnection::read_some(char* buf, size_t cap, Clock::time_point deadline) {
  for (;;) {
    auto r = read_now(buf, cap);
    if (!r) return r.failure();
    if (r->bytes > 0 || r->ended) return r->bytes;
    if (Status s = wait_fd(fd_.get(), r->wait_events, deadline, "waiting for the answer"); !s) return s.failure();
  }
}

Status MemberConnection::write_all(std::string_view data, Clock::time_point deadline) {
  const Failure closed{Error::kUnavailable, "the connection closed before the request was sent"};
  while (!data.empty()) {
    short wait = 0;
    if (!ssl_) {
      ssize_t n = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) {
        data.remove_prefix(static_cast<size_t>(n));
        continue;
      }
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) return closed;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return fail_errno("send", errno);
      wait = POLLOUT;
    } else {
      ERR_clear_error();
      errno = 0;
      const NoSigpipe no_sigpipe;
      size_t sent = 0;
      int ret = SSL_write_ex(ssl_.get(), data.data(), data.size(), &sent);
      if (ret == 1) {
        data.remove_prefix(sent);
        continue;
      }
      int err = SSL_get_error(ssl_.get(), ret);
      if (err == SSL_ERROR_WANT_READ) wait = POLLIN;
      else if (err == SSL_ERROR_WANT_WRITE) wait = POLLOUT;
      else if (err == SSL_ERROR_SYSCALL && (errno == EPIPE || errno == ECONNRESET)) return closed;
      else return tls_failure("TLS: ");
    }
    if (Status s = wait_fd(fd_.get(), wait, deadline, "sending the request"); !s) return s;
  }
  return {};
}

HttpByteStream MemberConnection::stream(Clock::time_point deadline) {
  HttpByteStream s;
  s.write_all = [this, deadline](std::string_view data) { return write_all(data, deadline); };
  s.read_some = [this, deadline](char* buf, size_t cap) { return read_some(buf, cap, deadline); };
  return s;
}

}  // namespace sg::etcd
