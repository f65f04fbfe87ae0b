#include "proxy/edge_auth.h"

#include <openssl/crypto.h>

#include <algorithm>
#include <cctype>

#include <optional>

#include "common/token_digest.h"

namespace sg {
namespace {

bool is_alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

bool is_b64token_char(char c) { return is_alnum(c) || std::string_view("-._~+/").find(c) != std::string_view::npos; }

// RFC 9110 tchar.
bool is_token_char(char c) { return is_alnum(c) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos; }

bool is_ows(char c) { return c == ' ' || c == '\t'; }

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && is_ows(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ows(s.back())) s.remove_suffix(1);
  return s;
}

bool equals_ignore_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// RFC 3986 percent-decoding; nullopt for a '%' not followed by two hex digits.
std::optional<std::string> percent_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size()) return std::nullopt;
    const int high = hex_value(s[i + 1]);
    const int low = hex_value(s[i + 2]);
    if (high < 0 || low < 0) return std::nullopt;
    out.push_back(static_cast<char>(high * 16 + low));
    i += 2;
  }
  return out;
}

// The query of a request-target: everything after the first '?' ("" if none).
std::string_view query_of(std::string_view target) {
  const size_t q = target.find('?');
  return q == std::string_view::npos ? std::string_view() : target.substr(q + 1);
}

// Calls fn(parameter) for each '&'-separated parameter of `query`, empty ones included.
template <typename Fn>
void for_each_parameter(std::string_view query, Fn&& fn) {
  for (;;) {
    const size_t amp = query.find('&');
    fn(query.substr(0, amp));
    if (amp == std::string_view::npos) return;
    query.remove_prefix(amp + 1);
  }
}

// Calls fn(pair) for each non-empty ';'-separated pair of a Cookie field's value, blanks trimmed.
template <typename Fn>
void for_each_cookie(std::string_view cookies, Fn&& fn) {
  while (!cookies.empty()) {
    const size_t semicolon = cookies.find(';');
    const std::string_view pair = trim_ows(cookies.substr(0, semicolon));
    cookies = semicolon == std::string_view::npos ? std::string_view() : cookies.substr(semicolon + 1);
    if (!pair.empty()) fn(pair);
  }
}

// A parameter's name is percent-decoded before comparing, so "sandgate%5Ftoken=..." is found (and removed)
// just like "sandgate_token=...": a browser or a script may encode it either way.
bool is_token_parameter(std::string_view parameter) {
  const std::optional<std::string> name = percent_decode(parameter.substr(0, parameter.find('=')));
  return name && *name == kTokenName;
}

void add_if_valid(std::vector<Credential>& out, CredentialSource source, std::string_view token) {
  if (is_valid_token(token)) out.push_back({source, std::string(token)});
}

bool is_safe_header_value(std::string_view value) {
  return value.find_first_of(std::string_view("\0\r\n", 3)) == std::string_view::npos;
}

}  // namespace

bool is_valid_token(std::string_view token) {
  if (token.empty() || token.size() > kMaxTokenLength) return false;
  size_t i = 0;
  while (i < token.size() && is_b64token_char(token[i])) ++i;
  if (i == 0) return false;
  while (i < token.size() && token[i] == '=') ++i;
  return i == token.size();
}

std::vector<Credential> find_credentials(std::string_view target, std::span<const HttpHeader> headers) {
  std::vector<Credential> found;
  for (const HttpHeader& h : headers) {
    if (!equals_ignore_case(h.name, "authorization")) continue;
    const std::string_view value = trim_ows(h.value);
    const size_t space = value.find_first_of(" \t");
    if (space == std::string_view::npos || !equals_ignore_case(value.substr(0, space), "bearer")) continue;
    add_if_valid(found, CredentialSource::kAuthorizationHeader, trim_ows(value.substr(space)));
  }
  for (const HttpHeader& h : headers) {
    if (!equals_ignore_case(h.name, "cookie")) continue;
    for_each_cookie(h.value, [&](std::string_view pair) {
      const size_t equals = pair.find('=');
      // Cookie names are case-sensitive (RFC 6265 §5.4 compares them byte for byte).
      if (equals == std::string_view::npos || pair.substr(0, equals) != kTokenCookieName) return;
      std::string_view value = pair.substr(equals + 1);
      if (value.size() >= 2 && value.front() == '"' && value.back() == '"') value = value.substr(1, value.size() - 2);
      add_if_valid(found, CredentialSource::kCookie, value);
    });
  }
  for_each_parameter(query_of(target), [&](std::string_view parameter) {
    if (!is_token_parameter(parameter)) return;
    const size_t equals = parameter.find('=');
    if (equals == std::string_view::npos) return;
    const std::optional<std::string> value = percent_decode(parameter.substr(equals + 1));
    if (value) add_if_valid(found, CredentialSource::kQueryParameter, *value);
  });
  return found;
}

void ConsumedCredentials::add_token(std::string_view token) {
  if (token.empty()) return;
  if (auto d = token_sha256(token)) digests_.push_back(*d);
}

void ConsumedCredentials::add_token_digest_hex(std::string_view hex) {
  if (auto d = parse_token_digest(hex)) digests_.push_back(*d);
}

bool ConsumedCredentials::matches(std::string_view token) const {
  if (digests_.empty()) return false;
  if (!last_match_.empty() && last_match_.size() == token.size() &&
      CRYPTO_memcmp(last_match_.data(), token.data(), token.size()) == 0)
    return true;
  auto presented = token_sha256(token);
  if (!presented) return false;
  bool found = false;
  for (const TokenDigest& d : digests_) found |= CRYPTO_memcmp(presented->data(), d.data(), d.size()) == 0;
  if (found) last_match_.assign(token);
  return found;
}

size_t strip_credentials(std::string& target, std::vector<HttpHeader>& headers, const ConsumedCredentials& consumed) {
  size_t removed = 0;
  // Compacted in place: the list keeps its capacity for the connection's next request, and a request with
  // nothing to take out allocates nothing.
  size_t kept = 0;
  for (HttpHeader& h : headers) {
    if (equals_ignore_case(h.name, "authorization")) {
      const std::string_view value = trim_ows(h.value);
      const size_t space = value.find_first_of(" \t");
      if (space != std::string_view::npos && equals_ignore_case(value.substr(0, space), "bearer") &&
          consumed.matches(trim_ows(value.substr(space)))) {
        ++removed;
        continue;
      }
    } else if (equals_ignore_case(h.name, "cookie")) {
      // Any value, well-formed or not: the name is the edge's, never the application's.
      const auto is_ours = [](std::string_view pair) { return pair.substr(0, pair.find('=')) == kTokenCookieName; };
      size_t taken = 0;
      for_each_cookie(h.value, [&](std::string_view pair) { taken += is_ours(pair); });
      if (taken > 0) {
        std::string rebuilt;
        for_each_cookie(h.value, [&](std::string_view pair) {
          if (is_ours(pair)) return;
          if (!rebuilt.empty()) rebuilt += "; ";
          rebuilt += pair;
        });
        removed += taken;
        if (rebuilt.empty()) continue;
        h.value = std::move(rebuilt);
      }
    }
    if (&headers[kept] != &h) headers[kept] = std::move(h);
    ++kept;
  }
  headers.erase(headers.begin() + static_cast<std::ptrdiff_t>(kept), headers.end());
  size_t parameters = 0;
  for_each_parameter(query_of(target), [&](std::string_view parameter) { parameters += is_token_parameter(parameter); });
  if (parameters > 0) {
    target = target_without_token(target);
    removed += parameters;
  }
  return removed;
}

std::string target_without_token(std::string_view target) {
  const size_t q = target.find('?');
  if (q == std::string_view::npos) return std::string(target);
  std::string kept;
  bool removed = false;
  bool first = true;
  for_each_parameter(target.substr(q + 1), [&](std::string_view parameter) {
    if (is_token_parameter(parameter)) {
      removed = true;
      return;
    }
    if (!first) kept.push_back('&');
    kept.append(parameter);
    first = false;
  });
  if (!removed) return std::string(target);
  std::string out(target.substr(0, q));
  if (!kept.empty()) out.append("?").append(kept);
  return out;
}

Result<std::string> token_redirect_location(std::string_view authority, std::string_view target) {
  if (target.empty() || target.front() != '/')
    return fail(Error::kInvalidArgument, "request-target is not a path; cannot redirect");
  if (authority.empty()) return fail(Error::kInvalidArgument, "empty authority");
  for (char c : authority)
    if (!is_alnum(c) && c != '.' && c != '-' && c != ':')
      return fail(Error::kInvalidArgument, "authority has a character a host name cannot have");
  return "https://" + std::string(authority) + target_without_token(target);
}

bool is_cross_origin_request(std::string_view authority, std::span<const HttpHeader> headers) {
  for (const HttpHeader& h : headers) {
    if (equals_ignore_case(h.name, "origin")) {
      const std::string_view origin = trim_ows(h.value);
      // Scheme and host compare case-insensitively; the ingress only speaks https.
      const std::string_view scheme = "https://";
      if (origin.size() != scheme.size() + authority.size() || !equals_ignore_case(origin.substr(0, scheme.size()), scheme) ||
          !equals_ignore_case(origin.substr(scheme.size()), authority))
        return true;
    } else if (equals_ignore_case(h.name, "sec-fetch-site")) {
      const std::string_view site = trim_ows(h.value);
      if (equals_ignore_case(site, "same-site") || equals_ignore_case(site, "cross-site")) return true;
    }
  }
  return false;
}

std::string token_cookie(std::string_view token, uint32_t max_age_secs) {
  // No Domain attribute: the cookie is then host-only, so a token given to 8080-a.<domain> is never sent to
  // 8080-b.<domain> or any other sandbox, whose application would otherwise receive it. Secure: TLS only.
  // HttpOnly: scripts of the sandbox's pages cannot read it. SameSite=Lax: still sent when the user follows a
  // link to the sandbox, but not on cross-site subrequests (CSRF against the sandbox's application).
  return std::string(kTokenCookieName) + "=" + std::string(token) + "; Path=/; Max-Age=" + std::to_string(max_age_secs) +
         "; HttpOnly; Secure; SameSite=Lax";
}

Result<std::string> http1_refusal(int status, std::string_view content_type, std::string_view body,
                                  std::span<const HttpHeader> extra_headers) {
  if (status < 100 || status > 599)
    return fail(Error::kInvalidArgument, "status " + std::to_string(status) + " is out of range");
  if (!is_safe_header_value(content_type))
    return fail(Error::kInvalidArgument, "Content-Type contains CR, LF or NUL");
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + std::string(http_reason(status)) +
                    "\r\nServer: sandgate\r\nContent-Type: " + std::string(content_type) +
                    "\r\nContent-Length: " + std::to_string(body.size()) +
                    // An answer from the edge (a 401, a redirect that sets the token cookie) must never be
                    // replayed from a cache.
                    "\r\nCache-Control: no-store\r\nStrict-Transport-Security: " + std::string(kHstsValue) +
                    "\r\nConnection: close\r\n";
  for (const HttpHeader& h : extra_headers) {
    if (h.name.empty())
      return fail(Error::kInvalidArgument, "empty header name");
    for (char c : h.name)
      if (!is_token_char(c)) return fail(Error::kInvalidArgument, "header name '" + h.name + "' is not a token");
    if (!is_safe_header_value(h.value))
      return fail(Error::kInvalidArgument, "value of header '" + h.name + "' contains CR, LF or NUL");
    out.append(h.name).append(": ").append(h.value).append("\r\n");
  }
  out.append("\r\n").append(body);
  return out;
}

bool token_matches(std::string_view presented, std::string_view expected) {
  auto a = token_sha256(presented), b = token_sha256(expected);
  return a && b && CRYPTO_memcmp(a->data(), b->data(), a->size()) == 0;
}

}  // namespace sg
