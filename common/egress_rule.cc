#include "common/egress_rule.h"

#include <arpa/inet.h>

#include <charconv>

namespace sg {
std::string ipv4_text(uint32_t host_order) {
  in_addr a{htonl(host_order)};
  char buf[INET_ADDRSTRLEN];
  ::inet_ntop(AF_INET, &a, buf, sizeof buf);
  return buf;
}

namespace {

uint32_t mask_of(uint8_t prefix) { return prefix == 0 ? 0 : ~uint32_t{0} << (32 - prefix); }

}  // namespace

std::string EgressRule::to_string() const {
  std::string out = ipv4_text(network);
  if (prefix != 32) out += "/" + std::to_string(prefix);
  if (port != 0) out += ":" + std::to_string(port);
  return out;
}

Result<EgressRule> parse_egress_rule(std::string_view text) {
  auto bad = [&](std::string_view why) {
    return fail(Error::kInvalidArgument, "egress rule \"" + std::string(text.substr(0, 64)) + "\": " + std::string(why));
  };
  EgressRule rule;
  std::string_view rest = text;
  if (size_t colon = rest.find(':'); colon != std::string_view::npos) {
    std::string_view port = rest.substr(colon + 1);
    unsigned value = 0;
    auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (ec != std::errc() || end != port.data() + port.size() || value == 0 || value > 65535)
      return bad("the port must be 1-65535");
    rule.port = static_cast<uint16_t>(value);
    rest = rest.substr(0, colon);
  }
  if (size_t slash = rest.find('/'); slash != std::string_view::npos) {
    std::string_view prefix = rest.substr(slash + 1);
    unsigned value = 0;
    auto [end, ec] = std::from_chars(prefix.data(), prefix.data() + prefix.size(), value);
    if (ec != std::errc() || end != prefix.data() + prefix.size() || value > 32) return bad("the prefix must be 0-32");
    rule.prefix = static_cast<uint8_t>(value);
    rest = rest.substr(0, slash);
  }
  in_addr a{};
  if (rest.size() > 15 || ::inet_pton(AF_INET, std::string(rest).c_str(), &a) != 1)
    return bad("expected an IPv4 address, A.B.C.D[/PREFIX][:PORT]");
  rule.network = ntohl(a.s_addr);
  if ((rule.network & ~mask_of(rule.prefix)) != 0) return bad("host bits are set for that prefix");
  return rule;
}

}  // namespace sg
