// A real TLS server standing in for sandgate-proxy in the CLI's unit tests (ssh-proxy and the https API).
#pragma once

#include <netinet/in.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "tests/unit/test_cert.h"

namespace sg::cli {

using sg::test_support::TestCert;

// One connection: TLS, reads a request head (a CONNECT, or an API request without a body), answers `answer`; on a 200 it echoes until the client's
// close_notify, then sends `after_eof` (the server's last bytes after the client's half-close) and closes.
class FakeIngress {
 public:
  FakeIngress(const TestCert& cert, std::string answer, std::string after_eof)
      : answer_(std::move(answer)), after_eof_(std::move(after_eof)) {
    ctx_ = SSL_CTX_new(TLS_server_method());
    SSL_CTX_use_certificate(ctx_, cert.cert);
    SSL_CTX_use_PrivateKey(ctx_, cert.key);
    SSL_CTX_set_alpn_select_cb(
        ctx_,
        [](SSL*, const unsigned char** out, unsigned char* outlen, const unsigned char* in, unsigned inlen,
           void* arg) {
          static_cast<FakeIngress*>(arg)->alpn_offered_.assign(reinterpret_cast<const char*>(in), inlen);
          if (inlen < 9) return SSL_TLSEXT_ERR_NOACK;
          *out = in + 1;
          *outlen = in[0];
          return SSL_TLSEXT_ERR_OK;
        },
        this);
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(listen_fd_, 4);
    socklen_t len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeIngress() {
    join();
    ::close(listen_fd_);
    SSL_CTX_free(ctx_);
  }
  uint16_t port() const { return port_; }
  // Valid once the client's run ended (the thread has finished with them by then, or joins first).
  std::string head() {
    join();
    return head_;
  }
  std::string sni() {
    join();
    return sni_;
  }
  std::string alpn_offered() {
    join();
    return alpn_offered_;
  }
  size_t echoed() {
    join();
    return echoed_;
  }

 private:
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  void serve() {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 10'000) != 1) return;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    timeval tv{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    SSL* ssl = SSL_new(ctx_);
    SSL_set_fd(ssl, fd);
    if (SSL_accept(ssl) == 1) {
      if (const char* name = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name)) sni_ = name;
      char buf[16384];
      while (head_.find("\r\n\r\n") == std::string::npos) {
        int n = SSL_read(ssl, buf, sizeof buf);
        if (n <= 0) break;
        head_.append(buf, static_cast<size_t>(n));
      }
      SSL_write(ssl, answer_.data(), static_cast<int>(answer_.size()));
      if (answer_.starts_with("HTTP/1.1 200")) {
        for (;;) {
          int n = SSL_read(ssl, buf, sizeof buf);
          if (n <= 0) break;  // the client's close_notify: its half-close
          echoed_ += static_cast<size_t>(n);
          SSL_write(ssl, buf, n);
        }
        SSL_write(ssl, after_eof_.data(), static_cast<int>(after_eof_.size()));
      }
      SSL_shutdown(ssl);
    }
    SSL_free(ssl);
    ::close(fd);
  }

  SSL_CTX* ctx_ = nullptr;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::string answer_, after_eof_;
  std::string head_, sni_, alpn_offered_;
  size_t echoed_ = 0;
  std::thread thread_;
};

}  // namespace sg::cli
