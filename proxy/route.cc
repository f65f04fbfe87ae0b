#include "proxy/route.h"

#include <charconv>

namespace sg {
namespace {

constexpr size_t kMaxHostLength = 253;
constexpr size_t kMaxLabel = 63;

bool is_label_char(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'; }

// A sandbox reference (name or id) follows DNS label rules; names.cc holds the stricter rules for creating.
bool valid_reference(std::string_view s) {
  if (s.empty() || s.size() > kMaxLabel || s.front() == '-' || s.back() == '-') return false;
  for (char c : s)
    if (!is_label_char(c)) return false;
  return true;
}

}  // namespace

std::string normalize_host(std::string_view host) {
  if (host.empty() || host.size() > kMaxHostLength + 7) return {};
  if (host.front() == '[') return {};  // IP literal: never a sandbox route
  if (auto colon = host.rfind(':'); colon != std::string_view::npos) {
    std::string_view port = host.substr(colon + 1);
    unsigned value = 0;
    auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (port.empty() || ec != std::errc() || p != port.data() + port.size() || value > 65535) return {};
    host = host.substr(0, colon);
  }
  if (!host.empty() && host.back() == '.') host.remove_suffix(1);
  if (host.empty() || host.size() > kMaxHostLength || host.front() == '.' ||
      host.find("..") != std::string_view::npos)
    return {};  // empty labels
  std::string out(host);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    else if (!is_label_char(c) && c != '.') return {};
  }
  return out;
}

Result<Route> parse_route(std::string_view raw_host, std::string_view domain) {
  std::string host = normalize_host(raw_host);
  if (host.empty()) return fail(Error::kInvalidArgument, "malformed host name");
  if (host.size() <= domain.size() + 1 || !std::string_view(host).ends_with(domain) ||
      host[host.size() - domain.size() - 1] != '.') {
    if (host == domain) return fail(Error::kNotFound, "no sandbox named in host (use <port>-<name>." + std::string(domain) + ")");
    return fail(Error::kNotFound, "host is not under " + std::string(domain));
  }
  std::string_view label = std::string_view(host).substr(0, host.size() - domain.size() - 1);
  if (label.find('.') != std::string_view::npos)
    return fail(Error::kInvalidArgument, "expected one label before ." + std::string(domain));
  if (label == "api") return Route{RouteKind::kApi, 0, {}};

  // "<port>-<ref>": digits then a hyphen. A reference may itself contain hyphens; the first one splits.
  size_t digits = 0;
  while (digits < label.size() && label[digits] >= '0' && label[digits] <= '9') ++digits;
  if (digits > 0 && digits < label.size() && label[digits] == '-') {
    std::string_view port_text = label.substr(0, digits);
    std::string_view ref = label.substr(digits + 1);
    unsigned port = 0;
    std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (port_text.size() > 5 || port == 0 || port > 65535 || (port_text.size() > 1 && port_text[0] == '0'))
      return fail(Error::kInvalidArgument, "invalid port '" + std::string(port_text) + "' in host");
    if (!valid_reference(ref)) return fail(Error::kInvalidArgument, "invalid sandbox name in host");
    return Route{RouteKind::kPort, static_cast<uint16_t>(port), std::string(ref)};
  }
  if (!valid_reference(label)) return fail(Error::kInvalidArgument, "invalid sandbox name in host");
  return Route{RouteKind::kSdk, 0, std::string(label)};
}

}  // namespace sg
