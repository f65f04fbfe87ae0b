#include "proxy/fleet_context.h"

#include <openssl/err.h>
#include <openssl/x509v3.h>

#include "proxy/fleet_hop.h"
#include "proxy/fleet_static_directory.h"
#include "proxy/ktls.h"

namespace sg {
namespace {

std::string certificate_node_name(X509* cert) {
  if (!cert) return {};
  std::string name;
  auto* sans = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  if (sans) {
    for (int i = 0; i < sk_GENERAL_NAME_num(sans) && name.empty(); ++i) {
      const GENERAL_NAME* gn = sk_GENERAL_NAME_value(sans, i);
      if (gn->type != GEN_DNS) continue;
      name.assign(reinterpret_cast<const char*>(ASN1_STRING_get0_data(gn->d.dNSName)),
                  static_cast<size_t>(ASN1_STRING_length(gn->d.dNSName)));
    }
    GENERAL_NAMES_free(sans);
  }
  if (name.empty()) {
    char cn[256] = {0};
    if (X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn, sizeof cn) > 0) name = cn;
  }
  return name;
}

Result<SslCtxPtr> make_ctx(const ProxyConfig& pc, bool server) {
  SslCtxPtr ctx(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()));
  if (!ctx) return fail(Error::kInternal, "SSL_CTX_new: " + take_ssl_error());
  // Only sandgate proxies are at either end: no reason to speak anything older.
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION);
  // As on the client-facing contexts (tls.cc): a peer that closes without close_notify is an ordinary EOF.
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION | SSL_OP_IGNORE_UNEXPECTED_EOF);
  // The listener's end runs the ordinary connection path, kTLS included: the hop's bytes can then splice to
  // the sandbox as a client's do, and ktls = on means the same there.
  if (server && pc.ktls != KtlsMode::kOff) {
    SSL_CTX_set_options(ctx.get(), SSL_OP_ENABLE_KTLS);
    if (ktls_unavailable_reason().empty()) enable_tls13_secret_tracking(ctx.get());
  }
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), pc.fleet_cert.c_str()) != 1)
    return fail(Error::kInvalidArgument, "proxy.fleet_cert " + pc.fleet_cert + ": " + take_ssl_error());
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), pc.fleet_key.c_str(), SSL_FILETYPE_PEM) != 1)
    return fail(Error::kInvalidArgument, "proxy.fleet_key " + pc.fleet_key + ": " + take_ssl_error());
  if (SSL_CTX_check_private_key(ctx.get()) != 1)
    return fail(Error::kInvalidArgument, "proxy.fleet_key does not match proxy.fleet_cert");
  if (SSL_CTX_load_verify_locations(ctx.get(), pc.fleet_ca.c_str(), nullptr) != 1)
    return fail(Error::kInvalidArgument, "proxy.fleet_ca " + pc.fleet_ca + ": " + take_ssl_error());
  // Both ends prove they belong to the fleet: a hop carries clients' credentials and client addresses the
  // owning proxy takes as given, so only a peer with a fleet certificate may open one.
  SSL_CTX_set_verify(ctx.get(), server ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_PEER, nullptr);
  // Resumption: a session is only resumed where it was verified (a server that verifies its peers must
  // name the context its sessions belong to, or OpenSSL refuses to resume them).
  static constexpr unsigned char kSessionContext[] = "sandgate-fleet-hop";
  if (server) SSL_CTX_set_session_id_context(ctx.get(), kSessionContext, sizeof kSessionContext - 1);
  return ctx;
}

// A client session arrived (TLS 1.3: a ticket after the handshake): kept for the next hop to that node.
int on_new_hop_session(SSL* ssl, SSL_SESSION* session) {
  auto* sessions = static_cast<HopSessions*>(SSL_CTX_get_app_data(SSL_get_SSL_CTX(ssl)));
  const char* node = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name);
  if (!sessions || !node) return 0;
  sessions->put(node, session);
  return 1;  // the reference is ours now
}

}  // namespace

HopSessions::~HopSessions() {
  for (auto& [_, s] : sessions_) SSL_SESSION_free(s);
}

void HopSessions::put(const std::string& node, SSL_SESSION* s) {
  std::lock_guard lock(mu_);
  auto [it, added] = sessions_.try_emplace(node, s);
  if (!added) {
    SSL_SESSION_free(it->second);
    it->second = s;
  }
}

SSL_SESSION* HopSessions::get(const std::string& node) const {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(node);
  if (it == sessions_.end() || SSL_SESSION_up_ref(it->second) != 1) return nullptr;
  return it->second;
}

std::string peer_node_name(SSL* ssl) {
  if (SSL_get_verify_result(ssl) != X509_V_OK) return {};
  return certificate_node_name(SSL_get0_peer_certificate(ssl));
}

Result<std::shared_ptr<const FleetContext>> FleetContext::create(const Config& cfg,
                                                                 std::shared_ptr<const fleet::Directory> directory) {
  const ProxyConfig& pc = cfg.proxy;
  if (pc.fleet_cert.empty()) return std::shared_ptr<const FleetContext>();
  auto fleet = std::make_shared<FleetContext>();
  auto server = make_ctx(pc, true);
  if (!server) return server.failure();
  auto client = make_ctx(pc, false);
  if (!client) return client.failure();
  fleet->server = std::move(*server);
  fleet->client = std::move(*client);
  SSL_CTX_set_session_cache_mode(fleet->client.get(), SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
  SSL_CTX_set_app_data(fleet->client.get(), fleet->sessions.get());
  SSL_CTX_sess_set_new_cb(fleet->client.get(), on_new_hop_session);
  fleet->self = certificate_node_name(SSL_CTX_get0_certificate(fleet->server.get()));
  if (!fleet::valid_node_name(fleet->self))
    return fail(Error::kInvalidArgument, "proxy.fleet_cert " + pc.fleet_cert + " names \"" + fleet->self +
                                             "\", not a node name (lowercase letters, digits and '-', at most 63)");
  if (directory) {
    fleet->directory = std::move(directory);
  } else if (!pc.fleet_static_directory_file.empty()) {
    auto d = fleet::StaticDirectory::load_file(pc.fleet_static_directory_file);
    if (!d) return d.failure();
    fleet->directory = std::move(*d);
  }
  return std::shared_ptr<const FleetContext>(std::move(fleet));
}

}  // namespace sg
