// Step 2 of a connection's path (accept -> *ClientHello* -> route -> ...): the server-side TLS contexts.
// One SSL_CTX per configured certificate; the ClientHello callback picks one by SNI before the handshake
// proceeds, and refuses names this ingress does not serve (alert unrecognized_name).
#pragma once

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/net.h"
#include "config/config.h"
#include "proxy/route.h"
#include "proxy/ticket_keys.h"

namespace sg {

struct SslCtxDeleter {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxDeleter>;

class TlsContexts {
 public:
  // Loads every certificate; an unreadable file or a key that does not match its cert is an error. Session
  // tickets are issued and read with `ticket_keys`, which a reload passes on so that tickets issued before
  // it still resume (proxy/ticket_keys.h); none: a ring of its own.
  static Result<std::shared_ptr<TlsContexts>> create(const Config& cfg,
                                                     std::shared_ptr<TicketKeys> ticket_keys = nullptr);

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
  // Whether a connection's TLS 1.3 records may move to the proxy's own record layer (proxy.tls_own_record_layer).
  bool own_record_layer() const { return own_record_layer_; }
  // Whether the contexts capture TLS 1.3 secrets (for kTLS receive or for the own record layer).
  bool tracks_tls13_secrets() const { return ktls_possible() || own_record_layer_; }

 private:
  struct Cert {
    SslCtxPtr ctx;
    std::vector<std::string> names;  // DNS SANs (or CN), lowercase; may start with "*."
  };
  static int on_client_hello(SSL* ssl, int* alert, void* arg);
  static int select_alpn(SSL* ssl, const unsigned char** out, unsigned char* outlen, const unsigned char* in,
                         unsigned inlen, void* arg);

  std::shared_ptr<TicketKeys> ticket_keys_;  // before certs_: the contexts point to it until they are freed
  std::vector<Cert> certs_;
  std::string domain_;
  KtlsMode ktls_mode_ = KtlsMode::kAuto;
  std::string ktls_kernel_reason_;
  bool own_record_layer_ = true;
};

// What the handshake learns about a connection before it completes, owned by the connection and reached
// from OpenSSL's callbacks through SSL_get_ex_data(ssl, hello_ex_index()).
struct HelloState {
  std::string sni;
  // The ClientHello callback pauses the handshake (SSL_ERROR_WANT_CLIENT_HELLO_CB) when choosing the ALPN
  // protocol or the connection's mode needs the routed port's policy; the connection asks the node
  // (internal/lookup), fills `policy`, sets policy_known and resumes the handshake.
  bool wants_policy = false;
  bool policy_known = false;
  bool port_public = false;
  std::string port_protocol;  // "http1", "h2c" or "tcp" once known
};
int hello_ex_index();

// The first OpenSSL error on this thread's queue as text (and clears the queue).
std::string take_ssl_error();
// Before an SSL_* call whose failure SSL_get_error will explain: the thread's error queue must not hold older
// errors. It is cleared only when it holds some, since OpenSSL 3.0's ERR_clear_error frees every slot's
// strings even when the queue is empty (32 free() calls, at each SSL_read and SSL_write of a request).
inline void clear_stale_ssl_errors() {
  if (ERR_peek_error() != 0) ERR_clear_error();
}

}  // namespace sg

namespace sg {
// Why kTLS cannot be used in this process ("" when the kernel accepts the TLS ULP). Probed once per process
// (the first call) with a loopback connection, because the answer depends on the running kernel, not on
// how we were built.
std::string ktls_unavailable_reason();
}  // namespace sg
