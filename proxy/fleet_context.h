// The proxy's side of a fleet (docs/fleet.md#cross-node-routing): the mutual-TLS contexts of the hop between
// proxies (both ends verify the other's certificate against the fleet CA, made by deploy/gen-fleet-ca.sh) and
// the directory that says which node owns a sandbox. Part of a reload's snapshot: absent when proxy.fleet_cert
// is not set, and then routing is exactly the single-node path.
#pragma once

#include <openssl/ssl.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/error.h"
#include "common/fleet_directory.h"
#include "config/config.h"
#include "proxy/tls.h"

namespace sg {

// TLS sessions of hops by node name, so a hop resumes (no certificate signatures or verification) instead
// of a full handshake each time. Shared by the workers.
class HopSessions {
 public:
  HopSessions() = default;
  ~HopSessions();
  HopSessions(const HopSessions&) = delete;
  HopSessions& operator=(const HopSessions&) = delete;
  // Takes the reference `s` holds.
  void put(const std::string& node, SSL_SESSION* s);
  // A new reference (the caller frees it), or nullptr.
  SSL_SESSION* get(const std::string& node) const;

 private:
  // One per node, at most one per fleet member: bounded by the fleet's size, which the CA decides.
  mutable std::mutex mu_;
  std::map<std::string, SSL_SESSION*, std::less<>> sessions_;
};

struct FleetContext {
  std::string self;  // this node's name: the name its fleet certificate carries
  SslCtxPtr server;  // the fleet ingress listener: a client certificate from the fleet CA is required
  SslCtxPtr client;  // hops to other nodes' listeners, which must prove the node name they are reached for
  std::shared_ptr<const fleet::Directory> directory;  // null: no view yet; every sandbox routes locally
  std::unique_ptr<HopSessions> sessions = std::make_unique<HopSessions>();  // for `client`

  // nullptr when proxy.fleet_cert is not set. `directory` is the etcd view when there is one (it outlives
  // reloads); otherwise proxy.fleet_static_directory_file (tests only) is read.
  static Result<std::shared_ptr<const FleetContext>> create(const Config& cfg,
                                                            std::shared_ptr<const fleet::Directory> directory = nullptr);
};

// The node name of a verified peer certificate (its first DNS name, or its CN); "" when there is none.
std::string peer_node_name(SSL* ssl);

}  // namespace sg
