#include "common/tls_client.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cerrno>

namespace sg {
namespace {

bool is_localhost_name(std::string_view host) {
  std::string lower(host);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower.ends_with(".")) lower.pop_back();
  return lower == "localhost" || lower.ends_with(".localhost");
}

}  // namespace

std::string openssl_errors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    out += (out.empty() ? "" : "; ") + std::string(buf);
  }
  return out.empty() ? "unknown TLS error" : out;
}

bool token_fits_header(std::string_view token) {
  return !token.empty() &&
         std::none_of(token.begin(), token.end(), [](unsigned char c) { return c <= 0x20 || c == 0x7f; });
}

Result<UniqueFd> connect_tcp(const Ingress& to, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  // The loopback names are answered here (see the header); AI_NUMERICHOST keeps them off DNS entirely.
  const bool loopback = is_localhost_name(to.host);
  if (loopback) hints.ai_flags = AI_NUMERICHOST;
  const std::string host = loopback ? "127.0.0.1" : to.host;
  addrinfo* list = nullptr;
  std::string port = std::to_string(to.port);
  if (int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &list); rc != 0)
    return fail(Error::kUnavailable, "cannot resolve " + to.host + ": " + gai_strerror(rc));
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(list, ::freeaddrinfo);
  const std::string where = to.host + ":" + port;
  Failure last{Error::kUnavailable, "no address for " + to.host};
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) {
      last = fail_errno("socket", errno);
      continue;
    }
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = fail_errno("connect to " + where, errno);
      continue;
    }
    if (auto s = wait_fd(fd.get(), POLLOUT, deadline, "connecting to " + where); !s) {
      last = s.failure();
      continue;
    }
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      last = fail_errno("connect to " + where, err);
      continue;
    }
    int one = 1;  // interactive sessions: keystrokes must not wait for Nagle
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
  }
  return last;
}

Result<TlsConnection> tls_connect(const TlsClientOptions& opts, Clock::time_point deadline) {
  auto setup_failed = [] { return fail(Error::kInternal, "TLS setup: " + openssl_errors()); };
  auto sock = connect_tcp(opts.dial, deadline);
  if (!sock) {
    if (sock.error() == Error::kTimeout) return sock.failure();
    return fail(Error::kUnavailable,
                "cannot reach sandgate-proxy (" + sock.message() + "). Is it running and listening there?" +
                    (opts.dial_hint.empty() ? "" : " If it listens elsewhere, " + opts.dial_hint));
  }
  TlsConnection conn;
  conn.sock = std::move(*sock);
  conn.ctx.reset(SSL_CTX_new(TLS_client_method()));
  if (!conn.ctx) return setup_failed();
  SSL_CTX* ctx = conn.ctx.get();
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  // A server that drops TCP without close_notify has still ended the stream: ssh guards its own integrity,
  // and an HTTP answer is delimited by its own framing (HttpParser notices a truncated one).
  SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  int loaded = opts.cacert.empty() ? SSL_CTX_set_default_verify_paths(ctx)
                                   : SSL_CTX_load_verify_locations(ctx, opts.cacert.c_str(), nullptr);
  if (loaded != 1)
    return fail(Error::kInvalidArgument, "cannot load CA certificates" +
                                             (opts.cacert.empty() ? "" : " from " + opts.cacert) + ": " +
                                             openssl_errors());
  conn.ssl.reset(SSL_new(ctx));
  SSL* ssl = conn.ssl.get();
  static constexpr unsigned char kAlpn[] = "\x08http/1.1";
  if (!ssl || SSL_set_fd(ssl, conn.sock.get()) != 1 || SSL_set_tlsext_host_name(ssl, opts.host.c_str()) != 1 ||
      SSL_set1_host(ssl, opts.host.c_str()) != 1 || SSL_set_alpn_protos(ssl, kAlpn, sizeof kAlpn - 1) != 0)
    return setup_failed();
  for (;;) {
    int ret = SSL_connect(ssl);
    if (ret == 1) return conn;
    if (long v = SSL_get_verify_result(ssl); v != X509_V_OK) {
      // Two different fixes: the wrong CA (or none) on this side, or a name the ingress does not serve.
      if (v == X509_V_ERR_HOSTNAME_MISMATCH)
        return fail(Error::kUnavailable, "the ingress's certificate is not valid for " + opts.host +
                                             " (hostname mismatch): is that the domain the ingress serves? Check "
                                             "--domain / SANDGATE_DOMAIN, or the host in --api");
      return fail(Error::kUnavailable,
                  "the ingress's certificate for " + opts.host + " is not trusted (" +
                      X509_verify_cert_error_string(v) +
                      "): pass the CA that signed it with --cacert or SANDGATE_CACERT (deploy/quickstart.sh's is "
                      "<state dir>/tls/ca.pem)");
    }
    if (auto s = ssl_wait(ssl, conn.sock.get(), ret, deadline, "in the TLS handshake with the ingress"); !s)
      return s.failure();
  }
}

Status ssl_wait(SSL* ssl, int fd, int ret, Clock::time_point deadline, std::string_view what) {
  int err = SSL_get_error(ssl, ret);
  if (err == SSL_ERROR_WANT_READ) return wait_fd(fd, POLLIN, deadline, what);
  if (err == SSL_ERROR_WANT_WRITE) return wait_fd(fd, POLLOUT, deadline, what);
  if (err == SSL_ERROR_ZERO_RETURN) return fail(Error::kUnavailable, "the ingress closed the connection " + std::string(what));
  if (err == SSL_ERROR_SYSCALL && errno != 0) return fail_errno(what, errno);
  return fail(Error::kUnavailable, std::string(what) + ": " + openssl_errors());
}

Result<size_t> ssl_read_some(SSL* ssl, int fd, char* buf, size_t cap, Clock::time_point deadline,
                             std::string_view what) {
  for (;;) {
    size_t got = 0;
    int ret = SSL_read_ex(ssl, buf, cap, &got);
    if (ret == 1) return got;
    int err = SSL_get_error(ssl, ret);
    if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)) return size_t{0};
    if (auto s = ssl_wait(ssl, fd, ret, deadline, what); !s) return s.failure();
  }
}

Status ssl_write_all(SSL* ssl, int fd, std::string_view data, Clock::time_point deadline, std::string_view what) {
  while (!data.empty()) {
    size_t sent = 0;
    int ret = SSL_write_ex(ssl, data.data(), data.size(), &sent);
    if (ret == 1) {
      data.remove_prefix(sent);
      continue;
    }
    if (auto s = ssl_wait(ssl, fd, ret, deadline, what); !s) return s;
  }
  return {};
}

Result<Ingress> parse_ingress(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return fail(Error::kInvalidArgument, "invalid ingress '" + std::string(text) + "': " + std::string(why) +
                                             " (expected HOST:PORT or [IPV6]:PORT)");
  };
  Ingress out;
  std::string_view host, port;
  if (text.starts_with("[")) {
    size_t close = text.find("]:");
    if (close == std::string_view::npos) return bad("no ]: after the IPv6 address");
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    for (char c : host)
      if (!std::isxdigit(static_cast<unsigned char>(c)) && c != ':' && c != '.') return bad("not an IPv6 address");
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return bad("no port");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    for (char c : host)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-') return bad("not a host name");
  }
  if (host.empty()) return bad("no host");
  int n = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), n);
  if (ec != std::errc() || end != port.data() + port.size() || n < 1 || n > 65535) return bad("port must be 1-65535");
  out.host = std::string(host);
  out.port = static_cast<uint16_t>(n);
  return out;
}

}  // namespace sg
