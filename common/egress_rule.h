// One entry of a sandbox's egress lists (`allow_out`, `deny_out`; noderuntime/egress.h), shared by the
// config (node-wide lists, checked at load with file and line), the node API and the CLI.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/error.h"

namespace sg {

// "A.B.C.D[/PREFIX][:PORT]": an IPv4 network, optionally one TCP/UDP port of it (0 = every port).
struct EgressRule {
  uint32_t network = 0;  // host byte order, host bits zero
  uint8_t prefix = 32;
  uint16_t port = 0;
  std::string to_string() const;
};
// Refuses (kInvalidArgument, naming the input) anything else: names, IPv6, host bits set, ports out of range.
Result<EgressRule> parse_egress_rule(std::string_view text);
// "A.B.C.D" of an address in host byte order.
std::string ipv4_text(uint32_t host_order);

}  // namespace sg
