#include "proxy/tls.h"

#include "proxy/ktls.h"

#include <openssl/err.h>
#include <openssl/x509v3.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <mutex>

namespace sg {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

bool name_matches(std::string_view pattern, std::string_view host) {
  if (pattern.starts_with("*.")) {
    // A wildcard covers exactly one label, as browsers and curl check it.
    auto dot = host.find('.');
    return dot != std::string_view::npos && dot > 0 && host.substr(dot + 1) == pattern.substr(2);
  }
  return pattern == host;
}

std::vector<std::string> certificate_names(X509* cert) {
  std::vector<std::string> names;
  auto* sans = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  if (sans) {
    for (int i = 0; i < sk_GENERAL_NAME_num(sans); ++i) {
      const GENERAL_NAME* gn = sk_GENERAL_NAME_value(sans, i);
      if (gn->type != GEN_DNS) continue;
      const unsigned char* data = ASN1_STRING_get0_data(gn->d.dNSName);
      names.push_back(lower(std::string_view(reinterpret_cast<const char*>(data), ASN1_STRING_length(gn->d.dNSName))));
    }
    GENERAL_NAMES_free(sans);
  }
  if (names.empty()) {
    char cn[256] = {0};
    if (X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn, sizeof cn) > 0)
      names.push_back(lower(cn));
  }
  return names;
}

// The server_name extension, parsed by hand because SSL_get_servername is not set yet when the
// ClientHello callback runs. Malformed input yields "" and the handshake proceeds as without SNI.
std::string extract_sni(SSL* ssl) {
  const unsigned char* p = nullptr;
  size_t len = 0;
  if (!SSL_client_hello_get0_ext(ssl, TLSEXT_TYPE_server_name, &p, &len) || len < 5) return {};
  size_t list_len = (size_t(p[0]) << 8) | p[1];
  if (list_len + 2 != len || p[2] != TLSEXT_NAMETYPE_host_name) return {};
  size_t name_len = (size_t(p[3]) << 8) | p[4];
  if (name_len == 0 || name_len + 5 > len || name_len > 255) return {};
  return lower(std::string_view(reinterpret_cast<const char*>(p + 5), name_len));
}

// Whether the ClientHello's ALPN list offers `proto`. No ALPN extension at all counts as "maybe": such a
// client (openssl s_client, ssh ProxyCommands) may be headed for a raw TCP port.
bool alpn_offers(SSL* ssl, std::string_view proto, bool* has_alpn) {
  const unsigned char* p = nullptr;
  size_t len = 0;
  *has_alpn = SSL_client_hello_get0_ext(ssl, TLSEXT_TYPE_application_layer_protocol_negotiation, &p, &len) == 1;
  if (!*has_alpn || len < 2) return false;
  size_t list_len = (size_t(p[0]) << 8) | p[1];
  if (list_len + 2 != len) return false;
  for (size_t i = 2; i < len;) {
    size_t n = p[i];
    if (i + 1 + n > len) return false;
    if (std::string_view(reinterpret_cast<const char*>(p + i + 1), n) == proto) return true;
    i += 1 + n;
  }
  return false;
}

}  // namespace

int hello_ex_index() {
  static int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

std::string take_ssl_error() {
  unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no OpenSSL error";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  return buf;
}

SSL_CTX* TlsContexts::select(std::string_view sni) const {
  if (sni.empty()) return default_ctx();
  for (const auto& c : certs_)
    for (const auto& n : c.names)
      if (name_matches(n, sni)) return c.ctx.get();
  // Names under our domain that no certificate covers (e.g. two labels deep) still get the default
  // certificate so the client sees a clear HTTP error instead of an opaque alert.
  if (sni.size() > domain_.size() && sni.ends_with(domain_) && sni[sni.size() - domain_.size() - 1] == '.')
    return default_ctx();
  return nullptr;
}

int TlsContexts::on_client_hello(SSL* ssl, int* alert, void* arg) {
  auto* self = static_cast<TlsContexts*>(arg);
  std::string sni = extract_sni(ssl);
  SSL_CTX* ctx = self->select(sni);
  auto* hello = static_cast<HelloState*>(SSL_get_ex_data(ssl, hello_ex_index()));
  if (hello) hello->sni = sni;
  if (ctx == nullptr) {
    *alert = SSL_AD_UNRECOGNIZED_NAME;
    return SSL_CLIENT_HELLO_ERROR;
  }
  if (ctx != SSL_get_SSL_CTX(ssl)) SSL_set_SSL_CTX(ssl, ctx);
  // A sandbox port's policy decides whether h2 is offered (only to h2c backends) and whether a port is raw
  // TCP (no request head: sshd speaks first). Only clients that may need it pay for the node round trip:
  // an ALPN list without h2 means HTTP/1.1, whose head carries everything else.
  if (hello && !hello->policy_known) {
    bool has_alpn = false;
    bool offers_h2 = alpn_offers(ssl, "h2", &has_alpn);
    auto route = parse_route(sni, self->domain_);
    if (route && route->kind != RouteKind::kApi && (offers_h2 || !has_alpn)) {
      hello->wants_policy = true;
      return SSL_CLIENT_HELLO_RETRY;
    }
  }
  return SSL_CLIENT_HELLO_SUCCESS;
}

int TlsContexts::select_alpn(SSL* ssl, const unsigned char** out, unsigned char* outlen, const unsigned char* in,
                             unsigned inlen, void*) {
  // h2 only where the backend speaks it (h2c port, or the agent): the first HEADERS frame is authenticated
  // and the rest forwarded as bytes, so the backend itself must speak HTTP/2. Everyone else gets HTTP/1.1.
  static const unsigned char kH2AndHttp11[] = {2, 'h', '2', 8, 'h', 't', 't', 'p', '/', '1', '.', '1'};
  static const unsigned char kHttp11[] = {8, 'h', 't', 't', 'p', '/', '1', '.', '1'};
  auto* hello = static_cast<HelloState*>(SSL_get_ex_data(ssl, hello_ex_index()));
  bool h2 = hello && hello->policy_known && hello->port_protocol == "h2c";
  const unsigned char* ours = h2 ? kH2AndHttp11 : kHttp11;
  unsigned ours_len = h2 ? sizeof kH2AndHttp11 : sizeof kHttp11;
  unsigned char* selected = nullptr;
  if (SSL_select_next_proto(&selected, outlen, ours, ours_len, in, inlen) == OPENSSL_NPN_NEGOTIATED) {
    *out = selected;
    return SSL_TLSEXT_ERR_OK;
  }
  return SSL_TLSEXT_ERR_NOACK;
}

constexpr const char* kTls12Ciphers = "ECDHE+AESGCM:ECDHE+CHACHA20";

Result<std::shared_ptr<TlsContexts>> TlsContexts::create(const Config& cfg, std::shared_ptr<TicketKeys> ticket_keys) {
  if (cfg.proxy.certificates.empty())
    return fail(Error::kInvalidArgument, "proxy.certificates: at least one certificate is needed");
  auto self = std::make_shared<TlsContexts>();
  if (!ticket_keys) {
    auto own = TicketKeys::generate();
    if (!own) return own.failure();
    ticket_keys = std::move(*own);
  }
  self->ticket_keys_ = std::move(ticket_keys);
  self->domain_ = cfg.domain;
  self->ktls_mode_ = cfg.proxy.ktls;
  if (self->ktls_mode_ != KtlsMode::kOff) self->ktls_kernel_reason_ = ktls_unavailable_reason();
  self->own_record_layer_ = cfg.proxy.tls_own_record_layer;
  for (const auto& cc : cfg.proxy.certificates) {
    SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()));
    if (!ctx) return fail(Error::kInternal, "SSL_CTX_new: " + take_ssl_error());
    SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
    SSL_CTX_set_options(ctx.get(), SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE |
                                      // A peer that closes without close_notify is an ordinary EOF.
                                      SSL_OP_IGNORE_UNEXPECTED_EOF);
    if (self->ktls_mode_ != KtlsMode::kOff) SSL_CTX_set_options(ctx.get(), SSL_OP_ENABLE_KTLS);
    // TLS 1.2 gets ECDHE with AEAD ciphers only (TLS 1.3's suites are all AEAD): CBC suites with HMAC are
    // the ones padding-oracle attacks (Lucky13) aim at, and every client that speaks TLS 1.2 has an AEAD one.
    if (SSL_CTX_set_cipher_list(ctx.get(), kTls12Ciphers) != 1)
      return fail(Error::kInternal, "SSL_CTX_set_cipher_list: " + take_ssl_error());
    // With kTLS, receive for TLS 1.3 is handed to the kernel by the connection (proxy/ktls.h), which needs
    // the client traffic secret and a count of the records OpenSSL read. read_ahead stays off (the default)
    // so OpenSSL never reads past a record boundary. TLS 1.3 session tickets are kept: OpenSSL sends them
    // inside SSL_do_handshake, after the client's Finished and before the handshake reports success, so
    // they are on the wire before any byte is spliced, and a server sends no other post-handshake message
    // unless the client asks for one (KeyUpdate, handled as a termination cause).
    if (!self->ktls_possible()) {
      // Userspace TLS for every connection: read-ahead lets one read() bring in several records (64 KiB)
      // instead of two reads per record (header, then body), halving syscalls on uploads. The switch to the
      // proxy's own record layer waits until OpenSSL's buffer is empty.
      SSL_CTX_set_read_ahead(ctx.get(), 1);
      SSL_CTX_set_default_read_buffer_len(ctx.get(), 64 * 1024);
    }
    // Partial writes let the forwarder drain a buffer across several socket-writable events. No
    // SSL_MODE_RELEASE_BUFFERS: it frees a record buffer whenever it is empty, that is after every burst, and
    // the 64 KiB read-ahead buffer is past the allocator's per-thread cache. A connection quiet for a while
    // frees both with SSL_free_buffers instead (TlsTransport::release_memory_while_idle), so an idle
    // connection still holds neither.
    // NO_AUTO_CHAIN: the chain sent is the certificate file's (leaf, then intermediates). Without it, OpenSSL
    // tries to build one from the context's trust store at every handshake where the file holds the leaf
    // alone, and that store is empty here: a verification context made and failed per connection for nothing.
    // The TLS 1.3 secrets and record counts, for kTLS receive and for the proxy's own record layer.
    if (self->tracks_tls13_secrets()) enable_tls13_secret_tracking(ctx.get());
    SSL_CTX_set_mode(ctx.get(),
                     SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_NO_AUTO_CHAIN);
    SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_SERVER);
    // OpenSSL sends two after a full handshake by default (one after a resumed one); each is a session copy,
    // its encoding and encryption (bench/RESULTS.md).
    SSL_CTX_set_num_tickets(ctx.get(), cfg.proxy.tls13_session_tickets);
    self->ticket_keys_->install(ctx.get());
    if (SSL_CTX_use_certificate_chain_file(ctx.get(), cc.cert_file.c_str()) != 1)
      return fail(Error::kInvalidArgument, "certificate " + cc.cert_file + ": " + take_ssl_error());
    if (SSL_CTX_use_PrivateKey_file(ctx.get(), cc.key_file.c_str(), SSL_FILETYPE_PEM) != 1)
      return fail(Error::kInvalidArgument, "private key " + cc.key_file + ": " + take_ssl_error());
    if (SSL_CTX_check_private_key(ctx.get()) != 1)
      return fail(Error::kInvalidArgument, "private key " + cc.key_file + " does not match " + cc.cert_file);
    SSL_CTX_set_alpn_select_cb(ctx.get(), &TlsContexts::select_alpn, nullptr);
    SSL_CTX_set_client_hello_cb(ctx.get(), on_client_hello, self.get());
    Cert cert;
    cert.names = certificate_names(SSL_CTX_get0_certificate(ctx.get()));
    cert.ctx = std::move(ctx);
    self->certs_.push_back(std::move(cert));
  }
  return self;
}

}  // namespace sg

namespace sg {

namespace {
std::string probe_ktls() {
  auto listener = listen_on(*parse_endpoint("127.0.0.1:0"), false, 1);
  if (!listener) return "probe failed: " + listener.message();
  auto port = local_port(listener->get());
  if (!port) return "probe failed: " + port.message();
  auto client = connect_blocking(*parse_endpoint("127.0.0.1:" + std::to_string(*port)), 1000);
  if (!client) return "probe failed: " + client.message();
  if (::setsockopt(client->get(), SOL_TCP, TCP_ULP, "tls", sizeof "tls") != 0) {
    if (errno == ENOENT) return "the kernel has no TLS ULP (CONFIG_TLS / tls.ko missing)";
    return std::string("setsockopt(TCP_ULP, tls): ") + std::strerror(errno);
  }
  return {};
}
}  // namespace

std::string ktls_unavailable_reason() {
  static const std::string reason = probe_ktls();
  return reason;
}

}  // namespace sg
