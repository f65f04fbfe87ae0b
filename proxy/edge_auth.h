// The "auth" step of a connection's path (route -> *auth* -> wake -> forward), transport-independent: where a
// request carries its sandgate token, how to take the token out of a URL, the cookie that replaces it, and
// the HTTP/1.1 answers the edge sends itself. The HTTP/2 twin of http1_refusal is h2_refusal (h2_head.h).
// Pure functions over the first request head (HttpMessage for HTTP/1.1, H2Request for h2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/http.h"
#include "common/token_digest.h"

namespace sg {

// The query parameter that carries a token (a browser's first visit: ?sandgate_token=...).
inline constexpr std::string_view kTokenName = "sandgate_token";
// The cookie the edge sets in exchange. The __Host- prefix makes a browser refuse the cookie unless it is
// Secure, host-only and Path=/, so a page of one sandbox (all share the parent domain) can neither plant one
// for another sandbox nor widen it with a Domain attribute. Only this name is accepted.
inline constexpr std::string_view kTokenCookieName = "__Host-sandgate_token";
inline constexpr size_t kMaxTokenLength = 512;
// Most credential candidates (find_credentials) one request may carry; more is a 400 (bad_request). Each
// candidate costs a digest check in the node (all go in one open), and a 16 KiB head holds ~900 token cookies. Four covers a Bearer header of
// the application's own, a sandgate cookie, a stale cookie on another path and a query parameter.
inline constexpr size_t kMaxCredentialCandidates = 4;
// WWW-Authenticate value of a 401 from the edge.
inline constexpr std::string_view kBearerChallenge = "Bearer realm=\"sandgate\"";

enum class CredentialSource {
  kAuthorizationHeader,  // Authorization: Bearer <token>
  kCookie,               // Cookie: sandgate_token=<token>
  kQueryParameter,       // ?sandgate_token=<token>: answer with a redirect to the URL without it + Set-Cookie
};

struct Credential {
  CredentialSource source;
  std::string token;
};

// A token is 1..kMaxTokenLength characters of RFC 6750's b64token alphabet (ALPHA DIGIT - . _ ~ + / and
// trailing =). That is the only shape a Bearer token may have, and every one of those characters is also a
// valid cookie-octet and survives a URL, so the same token works in all three places without escaping.
bool is_valid_token(std::string_view token);

// Every well-formed token the request carries, in precedence order: Authorization: Bearer headers (scheme
// case-insensitive, whitespace around the token ignored), then sandgate_token cookies (any number of Cookie
// headers and cookies per header; h2 crumbs joined or not), then sandgate_token query parameters of
// `target` (percent-decoded; '+' stays '+', since it is a b64token character and a space never is).
// Several candidates, not one, because the Authorization header (and even a cookie) may belong to the
// application behind the edge: a request is authorized if ANY candidate verifies, and the source of the one
// that did tells the proxy whether to forward (header, cookie) or redirect (query parameter).
// Malformed candidates (bad length, characters outside b64token such as CR/LF, bad percent-encoding) are
// left out, so an empty result means "no credential": answer 401.
std::vector<Credential> find_credentials(std::string_view target, std::span<const HttpHeader> headers);

// The credentials the edge consumed on a connection, recognised in each request it forwards: kept as SHA-256
// digests, so a request's token is hashed once and compared with each in constant time.
class ConsumedCredentials {
 public:
  // The credential the node accepted, the operator token; "" is ignored.
  void add_token(std::string_view token);
  // The sandbox's own token as the node's internal/open answer gives it (64 hex digits); "" (unknown) or
  // anything malformed is ignored.
  void add_token_digest_hex(std::string_view hex);
  // A token hashed already (the route cache's check, the snapshot's operator token).
  void add_digest(const TokenDigest& digest) { digests_.push_back(digest); }
  bool matches(std::string_view token) const;

 private:
  std::vector<TokenDigest> digests_;
  // The last token that matched: a keep-alive client presents the same one with every request, and it is
  // this connection's own, so it is compared as it is (in constant time) instead of hashed again.
  mutable std::string last_match_;
};

// Takes the edge's credentials out of a request before it is forwarded, so sandbox code never sees one (its
// own sandbox's token included): every __Host-sandgate_token cookie (a Cookie field left empty goes), every
// sandgate_token query parameter of `target`, and every Authorization: Bearer field whose token `consumed`
// matches. An Authorization of the application's own (another scheme, another token) stays. Returns how
// many credentials were removed.
size_t strip_credentials(std::string& target, std::vector<HttpHeader>& headers, const ConsumedCredentials& consumed);

// `target` without its sandgate_token parameters (matched after percent-decoding the name, as
// find_credentials does). Other parameters keep their order and their encoding; no '?' is left behind if
// nothing remains. A target without such a parameter is returned as is.
std::string target_without_token(std::string_view target);

// The Location for the redirect that follows a query-parameter token: "https://<authority><target without
// the token>". Absolute on purpose: a relative "//evil.example/x" target would make a browser leave the
// sandbox's host (an open redirect), whereas "https://<authority>//evil.example/x" stays on it.
// `authority` is the request's Host / :authority (host[:port], already accepted by parse_route).
// kInvalidArgument if `target` is not origin-form ("/...") or `authority` has characters a host cannot have.
Result<std::string> token_redirect_location(std::string_view authority, std::string_view target);

// Set-Cookie value carrying `token` (which must satisfy is_valid_token):
// "__Host-sandgate_token=<token>; Path=/; Max-Age=<max_age_secs>; HttpOnly; Secure; SameSite=Lax".
std::string token_cookie(std::string_view token, uint32_t max_age_secs);
// How long a browser keeps the token cookie (a week: long enough for a working session, short enough that a
// forgotten laptop does not stay signed in to a sandbox for good).
inline constexpr uint32_t kTokenCookieMaxAgeSecs = 7 * 24 * 3600;

// Every sandbox is a subdomain of one domain, so to a browser they are one site, and SameSite=Lax does not
// stop a page on 8080-evil.<domain> from POSTing to 8080-victim.<domain> with the victim's cookie. True when
// the request says it comes from elsewhere: an Origin that is not https://<authority> (incl. "null"), or
// Sec-Fetch-Site: same-site / cross-site. `authority` is the request's Host / :authority.
bool is_cross_origin_request(std::string_view authority, std::span<const HttpHeader> headers);

// Constant-time comparison of a presented token with an expected one: both are hashed first, so neither
// the contents nor the length of the secret leak through timing.
bool token_matches(std::string_view presented, std::string_view expected);

// What the edge's own answers (HTTP/1.1 and h2) send as Strict-Transport-Security: a browser that reached
// a host of the domain once over TLS never tries it in clear text for a year (a sandbox's own responses are
// forwarded unchanged). Host-only, no includeSubDomains: the edge does not speak for names it does not serve.
inline constexpr std::string_view kHstsValue = "max-age=31536000";

// A complete HTTP/1.1 response from the edge itself: status line, Server, Content-Type, Content-Length,
// Cache-Control: no-store, Strict-Transport-Security, Connection: close, then `extra_headers` in order (e.g. WWW-Authenticate with
// kBearerChallenge, Location, Set-Cookie, Retry-After), then `body`.
// kInvalidArgument for a status outside 100..599, or a header name that is not a token or a value with
// CR, LF or NUL: response splitting must be impossible whatever reaches a Location or a Set-Cookie.
Result<std::string> http1_refusal(int status, std::string_view content_type, std::string_view body,
                                  std::span<const HttpHeader> extra_headers);

}  // namespace sg
