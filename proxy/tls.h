// Step 2 of a connection's path (accept -> *ClientHello* -> route -> ...): the server-side TLS contexts.
// One SSL_CTX per configured certificate; the ClientHello callback picks one by SNI before the handshake
// proceeds, and refuses names this ingress does not serve (alert unrecognized_name).
#pragma once

#include <openssl/ssl.h>

#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/net.h"
#include "config/config.h"

namespace sg {

struct SslCtxDeleter {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxDeleter>;

class TlsContexts {
 public:
  // Loads every certificate; an unreadable file or a key that does not match its cert is an error.
  static Result<std::shared_ptr<TlsContexts>> create(const Config& cfg);

  // The context new connections start with (the first certificate). Its ClientHello callback switches
  // to the certificate matching the SNI.
  SSL_CTX* default_ctx() const { return certs_.front().ctx.get(); }

  // For tests and logs: which certificate would serve `sni` (nullptr: none, the handshake is refused).
  SSL_CTX* select(std::string_view sni) const;

  // kTLS: the configured mode, and why this kernel cannot offload at all ("" when it can).
  KtlsMode ktls_mode() const { return ktls_mode_; }
  const std::string& ktls_kernel_reason() const { return ktls_kernel_reason_; }
  // The mode allows kTLS and the kernel has the TLS ULP: connections try to offload.
  bool ktls_possible() const { return ktls_mode_ != KtlsMode::kOff && ktls_kernel_reason_.empty(); }

 private:
  struct Cert {
    SslCtxPtr ctx;
    std::vector<std::string> names;  // DNS SANs (or CN), lowercase; may start with "*."
  };
  static int on_client_hello(SSL* ssl, int* alert, void* arg);

  std::vector<Cert> certs_;
  std::string domain_;
  KtlsMode ktls_mode_ = KtlsMode::kAuto;
  std::string ktls_kernel_reason_;
};

// Index for SSL_get_ex_data: the SNI the client sent, as a std::string* owned by the connection.
int sni_ex_index();

// The first OpenSSL error on this thread's queue as text (and clears the queue).
std::string take_ssl_error();

}  // namespace sg

namespace sg {
// Why kTLS cannot be used in this process ("" when the kernel accepts the TLS ULP). Probed once per process
// (the first call) with a loopback connection, because the answer depends on the running kernel, not on
// how we were built.
std::string ktls_unavailable_reason();
}  // namespace sg
