// The client side of TLS to sandgate-proxy, shared by `sandgate ssh-proxy` (CONNECT tunnels) and the API
// client's https transport (api.<domain>): dialing, a verified handshake, and deadline-bound reads/writes on
// the non-blocking socket underneath.
#pragma once

#include <openssl/ssl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/error.h"
#include "common/fd.h"
#include "common/http_client.h"

namespace sg {

using Clock = std::chrono::steady_clock;

struct Ingress {
  std::string host;  // a DNS name or an IP address (IPv6 without brackets)
  uint16_t port = 0;
};

// "HOST:PORT" or "[V6]:PORT"; HOST limited to letters, digits, '.', '-' (and ':' inside brackets).
Result<Ingress> parse_ingress(std::string_view text);

// remaining_ms() and wait_fd() (the deadline-bound poll every step here uses) are sg's, from
// common/http_client.h.
// Drains OpenSSL's error queue into one line.
std::string openssl_errors();

// A token can go into an "Authorization: Bearer" line: non-empty, no spaces, no control characters (one
// that could end the line would let it forge more headers).
bool token_fits_header(std::string_view token);

// A non-blocking TCP connection to `to`. "localhost" and "*.localhost" dial loopback without asking the
// resolver (RFC 6761, as curl does): glibc does not resolve subdomains of localhost, and the default
// ingress domain is one.
Result<UniqueFd> connect_tcp(const Ingress& to, Clock::time_point deadline);

struct SslDeleter {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
  void operator()(SSL* s) const { SSL_free(s); }
};

struct TlsConnection {
  UniqueFd sock;
  std::unique_ptr<SSL_CTX, SslDeleter> ctx;
  std::unique_ptr<SSL, SslDeleter> ssl;
};

struct TlsClientOptions {
  Ingress dial;          // where to connect
  std::string host;      // SNI and the name the certificate must carry
  std::string cacert;    // empty: the system's trust store
  std::string dial_hint; // how to point the caller elsewhere, e.g. "pass --ingress HOST:PORT or set SANDGATE_INGRESS"
};

// Connects, handshakes (TLS 1.2+, ALPN http/1.1) and verifies the certificate against opts.host; a
// certificate that does not verify is always an error. Failing to connect or to verify is kUnavailable with
// the next step in the message: start the proxy or dial elsewhere (dial_hint), pass the CA, check the domain.
Result<TlsConnection> tls_connect(const TlsClientOptions& opts, Clock::time_point deadline);

// After an SSL call on a non-blocking socket returned `ret` <= 0: waits for what OpenSSL needs, or fails.
Status ssl_wait(SSL* ssl, int fd, int ret, Clock::time_point deadline, std::string_view what);
// Reads up to `cap` bytes; 0 = the peer closed the TLS stream.
Result<size_t> ssl_read_some(SSL* ssl, int fd, char* buf, size_t cap, Clock::time_point deadline,
                             std::string_view what);
Status ssl_write_all(SSL* ssl, int fd, std::string_view data, Clock::time_point deadline, std::string_view what);

}  // namespace sg
