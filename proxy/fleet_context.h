// The proxy's side of a fleet (docs/fleet.md#cross-node-routing): the mutual-TLS contexts of the hop between
// proxies (both ends verify the other's certificate against the fleet CA, made by deploy/gen-fleet-ca.sh) and
// the directory that says which node owns a sandbox. Part of a reload's snapshot: absent when proxy.fleet_cert
// is not set, and then routing is exactly the single-node path.
#pragma once

#include <openssl/ssl.h>

#include <memory>
#include <string>

#include "common/error.h"
#include "common/fleet_directory.h"
#include "config/config.h"
#include "proxy/tls.h"

namespace sg {

struct FleetContext {
  std::string self;  // this node's name: the name its fleet certificate carries
  SslCtxPtr server;  // the fleet ingress listener: a client certificate from the fleet CA is required
  SslCtxPtr client;  // hops to other nodes' listeners, which must prove the node name they are reached for
  std::shared_ptr<const fleet::Directory> directory;  // null: no view yet; every sandbox routes locally

  // nullptr when proxy.fleet_cert is not set. `directory` is the etcd view when there is one (it outlives
  // reloads); otherwise proxy.fleet_static_directory_file (tests only) is read.
  static Result<std::shared_ptr<const FleetContext>> create(const Config& cfg,
                                                            std::shared_ptr<const fleet::Directory> directory = nullptr);
};

// The node name of a verified peer certificate (its first DNS name, or its CN); "" when there is none.
std::string peer_node_name(SSL* ssl);

}  // namespace sg
