// Step 3 of a connection's path (accept -> ClientHello -> *route* -> auth -> wake -> forward): turn the
// requested host name into a destination. Pure functions; the hot path allocates only the target string.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/error.h"

namespace sg {

enum class RouteKind {
  kPort,  // <port>-<name|id>.<domain>: a port the sandbox exposes
  kSdk,   // <name|id>.<domain>: the in-sandbox agent
  kApi,   // api.<domain>: the node API
};

struct Route {
  RouteKind kind = RouteKind::kPort;
  uint16_t port = 0;   // kPort only
  std::string target;  // sandbox name or id
};

// `host` as it arrives in a Host header or SNI: case-insensitive, may carry ":port" and a trailing dot.
// Errors: kInvalidArgument for a malformed name (answered 400), kNotFound for a well-formed name outside
// `domain` (answered 421: this ingress does not serve it).
Result<Route> parse_route(std::string_view host, std::string_view domain);

// Lower-cases and strips ":port" and one trailing dot; "" if the host is syntactically hopeless.
std::string normalize_host(std::string_view host);

}  // namespace sg
