// The cross-node hop (docs/fleet.md#cross-node-routing): a connection for a sandbox that another node owns
// is carried by this proxy to that node's fleet ingress listener over mutual TLS. This unit is the hop's
// pure part, so it is tested without sockets: the routing decision from a fleet::Directory, the preamble the
// first proxy sends (and the owning proxy parses, bounded: it is a peer's input), the owning proxy's answer,
// and when a redirect may be followed.
//
// On the wire, after the mTLS handshake (first proxy -> owning proxy):
//   SANDGATE-HOP/1 <host> <h1|h2|tcp> <client address>\r\n
// then, once answered "ok", the client's bytes exactly as they arrived (request head with its credentials
// included): the owning proxy runs the connection from its request head on as if the client were its own.
// `tcp` is a public raw-TCP port (the server may speak first, so there is no head): the owning proxy opens
// the port at once, and its node decides whether it may.
// The owning proxy's answer, alone on the stream until the first proxy sends more:
//   SANDGATE-HOP/1 ok\r\n | SANDGATE-HOP/1 redirect <node>\r\n | SANDGATE-HOP/1 gone <node>\r\n
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/fleet_directory.h"

namespace sg::fleet {

// Bounds of what a peer sends before the client's bytes: a host name is at most 253 bytes, an address 47.
inline constexpr size_t kMaxPreambleBytes = 512;
inline constexpr size_t kMaxAnswerBytes = 256;
inline constexpr size_t kMaxNodeNameBytes = 63;  // a DNS label: node names are also their certificate's name
// A hop follows at most this many redirects (the owner's view corrects a stale one; two in a row means the
// views disagree and the client should retry later rather than bounce between nodes).
inline constexpr int kMaxRedirects = 1;

// What the bytes after the preamble are.
enum class HopProtocol {
  kHttp1,  // "h1": HTTP/1.1, from the request head on
  kHttp2,  // "h2": the client's ALPN was h2, from the connection preface on
  kTcp,    // "tcp": raw bytes of a public tcp port, whoever speaks first
};

struct Preamble {
  std::string host;  // the client's SNI / Host: what the owning proxy routes by
  HopProtocol protocol = HopProtocol::kHttp1;
  std::string client;  // the client's address as the first proxy saw it (host:port), for the access log
};

std::string encode_preamble(const Preamble& p);
// nullopt: no complete line yet (`buffered` is what arrived so far). On success `*consumed` is the line's
// length; bytes after it are the client's. Errors (kInvalidArgument, kLimitExceeded) mean the peer is not
// speaking the protocol: the hop is closed.
Result<std::optional<Preamble>> parse_preamble(std::string_view buffered, size_t* consumed);

struct Answer {
  enum class Kind {
    kOk,        // the owning proxy serves the connection: send the client's bytes
    kRedirect,  // its view names another owner: `node`
    kGone,      // its view names an owner whose node is gone: `node`
  };
  Kind kind = Kind::kOk;
  std::string node;
};
std::string encode_answer(const Answer& a);
Result<std::optional<Answer>> parse_answer(std::string_view buffered, size_t* consumed);

// Node names are DNS labels (lowercase letters, digits, '-'), so they name certificates too.
bool valid_node_name(std::string_view name);

// Where a connection for `sandbox` goes, as this proxy's directory sees it.
struct Decision {
  enum class Kind {
    kLocal,      // fleet off, this node owns it, or the fleet does not know it: the local node answers (404)
    kRemote,     // another node owns it and is registered: hop to `node`
    kOwnerGone,  // another node owns it but its registration expired: 503 + Retry-After, not 404
  };
  Kind kind = Kind::kLocal;
  std::string owner;              // the owning node's name (kRemote, kOwnerGone)
  std::optional<NodeInfo> node;   // kRemote
  std::shared_ptr<const std::vector<PortRoute>> ports;  // kRemote: as its owner published them (or none)
};
// `directory` null: fleet routing is off (the single-node default).
Decision decide(const Directory* directory, std::string_view self, std::string_view sandbox);

// What the first proxy does with a redirect to `to` (the owner as the owning proxy's view names it).
enum class RedirectAction {
  kRetryRemote,  // hop to `to` instead
  kRetryLocal,   // `to` is this node: its own node answers
  kRefuse,       // no more retries: answer 502 (views disagree) rather than bounce or guess
};
// `redirects_followed`: redirects already followed by this connection; `sent_upstream`: client bytes given
// to any hop so far. A retry only ever happens while nothing was sent: after that the request may have been
// acted on and must not be repeated somewhere else.
RedirectAction on_redirect(int redirects_followed, bool sent_upstream, std::string_view to, std::string_view self);

}  // namespace sg::fleet
