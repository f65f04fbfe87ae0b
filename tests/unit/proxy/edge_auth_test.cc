#include "proxy/edge_auth.h"

#include <gtest/gtest.h>

#include "common/token_digest.h"

namespace sg {
namespace {

using namespace std::string_view_literals;

std::vector<std::string> tokens(const std::vector<Credential>& credentials) {
  std::vector<std::string> out;
  for (const Credential& c : credentials) out.push_back(c.token);
  return out;
}

using Tokens = std::vector<std::string>;

TEST(EdgeAuth, ValidTokens) {
  for (std::string_view t : {"a", "abc123", "A-b.c_d~e+f/g", "dG9rZW4=", "dG9r=="})
    EXPECT_TRUE(is_valid_token(t)) << t;
  EXPECT_TRUE(is_valid_token(std::string(kMaxTokenLength, 'a')));
  EXPECT_FALSE(is_valid_token(std::string(kMaxTokenLength + 1, 'a')));
  for (std::string_view t : std::initializer_list<std::string_view>{"", "=", "==abc", "ab=c", "a b", "a\tb", "a\r\nb", "a;b", "a,b", "a\"b", "a\\b",
                             "a%20b", "tök", "a\0b"sv, "a\x7f"})
    EXPECT_FALSE(is_valid_token(t)) << t;
}

TEST(EdgeAuth, BearerHeader) {
  for (std::string_view value : {"Bearer tok", "bearer tok", "BEARER tok", "  Bearer   tok  ", "Bearer\ttok"}) {
    const HttpHeader headers[] = {{"Authorization", std::string(value)}};
    auto found = find_credentials("/", headers);
    ASSERT_EQ(found.size(), 1u) << value;
    EXPECT_EQ(found[0].source, CredentialSource::kAuthorizationHeader);
    EXPECT_EQ(found[0].token, "tok");
  }
  // Other schemes belong to the application behind the edge; a malformed Bearer value is no credential.
  for (std::string_view value : {"Basic dXNlcjpwYXNz", "Bearer", "Bearer ", "Bearertok", "Bearer a b",
                                 "Bearer tok\r\nX-Evil: 1", "Token tok"}) {
    const HttpHeader headers[] = {{"authorization", std::string(value)}};
    EXPECT_TRUE(find_credentials("/", headers).empty()) << value;
  }
}

TEST(EdgeAuth, Cookies) {
  const HttpHeader one[] = {{"Cookie", "__Host-sandgate_token=tok"}};
  auto found = find_credentials("/", one);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].source, CredentialSource::kCookie);
  EXPECT_EQ(found[0].token, "tok");

  const HttpHeader many[] = {{"cookie", "theme=dark; __Host-sandgate_token=t1;lang=en"},
                             {"X-Other", "sandgate_token=nope"},
                             {"COOKIE", "  __Host-sandgate_token=\"t2\" ; a=b"}};
  EXPECT_EQ(tokens(find_credentials("/", many)), (Tokens{"t1", "t2"}));

  // h2 crumbs joined by the scanner, or passed one per field.
  const HttpHeader crumbs[] = {{"cookie", "a=1"}, {"cookie", "__Host-sandgate_token=t3"}, {"cookie", "b=2"}};
  EXPECT_EQ(tokens(find_credentials("/", crumbs)), (Tokens{"t3"}));

  // Names are case-sensitive and must match exactly; values must be tokens.
  const HttpHeader wrong[] = {{"cookie", "__host-sandgate_token=x; __Host-sandgate_tokens=y; x__Host-sandgate_token=z; __Host-sandgate_token"},
                              {"cookie", "sandgate_token=legacy-name; Sandgate_token=x"},
                              {"cookie", "__Host-sandgate_token=; __Host-sandgate_token=a b; __Host-sandgate_token=\"q; __Host-sandgate_token=%41"},
                              {"cookie", ""},
                              {"cookie", ";;; ; ="}};
  EXPECT_TRUE(find_credentials("/", wrong).empty());
}

TEST(EdgeAuth, QueryParameter) {
  auto found = find_credentials("/path?sandgate_token=tok", {});
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].source, CredentialSource::kQueryParameter);
  EXPECT_EQ(found[0].token, "tok");

  EXPECT_EQ(tokens(find_credentials("/p?a=1&sandgate_token=dG9r%2Bx%2F%3D%3D&b=2", {})), (Tokens{"dG9r+x/=="}));
  EXPECT_EQ(tokens(find_credentials("/p?sandgate%5Ftoken=enc&sandgate_token=plain", {})), (Tokens{"enc", "plain"}));
  EXPECT_EQ(tokens(find_credentials("/p?sandgate_token=a+b", {})), (Tokens{"a+b"}));  // '+' is not a space here
  for (std::string_view target :
       {"/p", "/p?", "/p?sandgate_token", "/p?sandgate_token=", "/p?sandgate_token=%", "/p?sandgate_token=%4",
        "/p?sandgate_token=%zz", "/p?sandgate_token=a%0D%0ASet-Cookie:%20x", "/p?sandgate_token=a%00",
        "/p?sandgate_token=a%20b", "/p?Sandgate_token=x", "/p?xsandgate_token=x", "/sandgate_token=x",
        "/p?a=sandgate_token=x"})
    EXPECT_TRUE(find_credentials(target, {}).empty()) << target;
}

TEST(EdgeAuth, PrecedenceIsHeaderThenCookieThenQuery) {
  const HttpHeader headers[] = {{"cookie", "__Host-sandgate_token=from-cookie"},
                                {"authorization", "Bearer from-header"},
                                {"cookie", "__Host-sandgate_token=second-cookie"}};
  auto found = find_credentials("/?sandgate_token=from-query", headers);
  ASSERT_EQ(found.size(), 4u);
  EXPECT_EQ(found[0].source, CredentialSource::kAuthorizationHeader);
  EXPECT_EQ(found[0].token, "from-header");
  EXPECT_EQ(found[1].source, CredentialSource::kCookie);
  EXPECT_EQ(found[1].token, "from-cookie");
  EXPECT_EQ(found[2].token, "second-cookie");
  EXPECT_EQ(found[3].source, CredentialSource::kQueryParameter);

  // A malformed candidate does not hide a good one behind it.
  const HttpHeader bad_header[] = {{"authorization", "Bearer bad\x01token"}, {"cookie", "__Host-sandgate_token=good"}};
  EXPECT_EQ(tokens(find_credentials("/", bad_header)), (Tokens{"good"}));
}

TEST(EdgeAuth, EveryCandidateIsCountedSoTheCapCanApply) {
  // The proxy refuses a request with more than kMaxCredentialCandidates; find_credentials must therefore
  // report all of them, not stop early at a number that would pass.
  std::string value;
  for (int i = 0; i < 100; ++i) value += (i ? "; " : "") + std::string("__Host-sandgate_token=t") + std::to_string(i);
  const std::vector<HttpHeader> headers = {{"Cookie", value}, {"Authorization", "Bearer b"}};
  auto found = find_credentials("/?sandgate_token=q", headers);
  ASSERT_EQ(found.size(), 102u);
  EXPECT_GT(found.size(), kMaxCredentialCandidates);
  EXPECT_EQ(found.front().source, CredentialSource::kAuthorizationHeader);
  EXPECT_EQ(found.back().source, CredentialSource::kQueryParameter);
}

TEST(EdgeAuth, VeryLongInputs) {
  const std::string long_token(kMaxTokenLength + 1, 'a');
  const HttpHeader headers[] = {{"authorization", "Bearer " + long_token},
                                {"cookie", std::string(100000, ';') + "__Host-sandgate_token=" + long_token},
                                {"cookie", std::string(50000, 'x') + "=y; __Host-sandgate_token=ok"}};
  EXPECT_EQ(tokens(find_credentials("/?" + std::string(100000, '&') + "sandgate_token=" + long_token, headers)),
            (Tokens{"ok"}));
  const std::string max_token(kMaxTokenLength, 'b');
  EXPECT_EQ(tokens(find_credentials("/?sandgate_token=" + max_token, {})), (Tokens{max_token}));
}

TEST(EdgeAuth, TargetWithoutToken) {
  const std::pair<std::string_view, std::string_view> cases[] = {
      {"/", "/"},
      {"/path", "/path"},
      {"/path?", "/path?"},  // nothing removed: left exactly as sent
      {"/path?a=1&b=2", "/path?a=1&b=2"},
      {"/path?sandgate_token=abc", "/path"},
      {"/path?sandgate_token", "/path"},
      {"/path?sandgate_token=abc&a=1", "/path?a=1"},
      {"/path?a=1&sandgate_token=abc", "/path?a=1"},
      {"/path?a=1&sandgate_token=abc&b=%20x&c", "/path?a=1&b=%20x&c"},
      {"/path?sandgate_token=1&sandgate%5Ftoken=2&z=9&sandgate_token=3", "/path?z=9"},
      {"/path?a=1&&sandgate_token=x&b=2", "/path?a=1&&b=2"},
      {"/path?&sandgate_token=x", "/path"},
      {"/path?xsandgate_token=1&sandgate_tokenx=2", "/path?xsandgate_token=1&sandgate_tokenx=2"},
      {"/sandgate_token=1?q", "/sandgate_token=1?q"},
      {"/p?a=b?sandgate_token=x", "/p?a=b?sandgate_token=x"},  // one parameter "a=b?sandgate_token=x"
  };
  for (auto [in, out] : cases) EXPECT_EQ(target_without_token(in), out) << in;
}

TEST(EdgeAuth, RedirectLocationStaysOnTheHost) {
  auto plain = token_redirect_location("8080-demo.sandbox.localhost:8443", "/app?sandgate_token=t&x=1");
  ASSERT_TRUE(plain.ok()) << plain.message();
  EXPECT_EQ(*plain, "https://8080-demo.sandbox.localhost:8443/app?x=1");
  // A protocol-relative target would be an open redirect as a relative Location.
  auto evil = token_redirect_location("8080-demo.sandbox.localhost", "//evil.example/x?sandgate_token=t");
  ASSERT_TRUE(evil.ok());
  EXPECT_EQ(*evil, "https://8080-demo.sandbox.localhost//evil.example/x");
  for (auto [authority, target] : std::initializer_list<std::pair<std::string_view, std::string_view>>{
           {"h", "http://other/x"}, {"h", "*"}, {"h", ""}, {"", "/"}, {"evil.example/", "/"},
           {"a@evil.example", "/"}, {"h\r\nx: y", "/"}, {"h", "x"}})
    EXPECT_FALSE(token_redirect_location(authority, target).ok()) << authority << " " << target;
}

TEST(EdgeAuth, TokenCookieIsHostScoped) {
  EXPECT_EQ(token_cookie("dG9r", 3600), "__Host-sandgate_token=dG9r; Path=/; Max-Age=3600; HttpOnly; Secure; SameSite=Lax");
  EXPECT_EQ(token_cookie("t", 0).find("Domain"), std::string::npos);
  // What it sets is what find_credentials reads back.
  const HttpHeader headers[] = {{"cookie", "__Host-sandgate_token=dG9r"}};
  EXPECT_EQ(tokens(find_credentials("/", headers)), (Tokens{"dG9r"}));
}

TEST(EdgeAuth, CrossOriginRequests) {
  const std::string host = "8080-a.sandbox.localhost:8443";
  auto cross = [&](std::vector<HttpHeader> h) { return is_cross_origin_request(host, h); };
  EXPECT_FALSE(cross({}));  // curl, an SDK: no Origin, no Sec-Fetch-Site
  EXPECT_FALSE(cross({{"Origin", "https://8080-a.sandbox.localhost:8443"}}));
  EXPECT_FALSE(cross({{"origin", "HTTPS://8080-A.sandbox.localhost:8443"}}));
  EXPECT_FALSE(cross({{"Sec-Fetch-Site", "same-origin"}}));
  EXPECT_FALSE(cross({{"Sec-Fetch-Site", "none"}}));  // typed into the address bar
  EXPECT_TRUE(cross({{"Origin", "https://8080-b.sandbox.localhost:8443"}}));
  EXPECT_TRUE(cross({{"Origin", "https://8080-a.sandbox.localhost"}}));  // another port is another origin
  EXPECT_TRUE(cross({{"Origin", "http://8080-a.sandbox.localhost:8443"}}));
  EXPECT_TRUE(cross({{"Origin", "null"}}));
  EXPECT_TRUE(cross({{"Sec-Fetch-Site", "same-site"}}));
  EXPECT_TRUE(cross({{"sec-fetch-site", "Cross-Site"}}));
}

TEST(EdgeAuth, Http1Refusal) {
  const HttpHeader challenge[] = {{"WWW-Authenticate", std::string(kBearerChallenge)}};
  auto unauthorized = http1_refusal(401, "text/plain; charset=utf-8", "token required\n", challenge);
  ASSERT_TRUE(unauthorized.ok()) << unauthorized.message();
  EXPECT_EQ(*unauthorized,
            "HTTP/1.1 401 Unauthorized\r\nServer: sandgate\r\nContent-Type: text/plain; charset=utf-8\r\n"
            "Content-Length: 15\r\nCache-Control: no-store\r\nStrict-Transport-Security: max-age=31536000\r\n"
            "Connection: close\r\n"
            "WWW-Authenticate: Bearer realm=\"sandgate\"\r\n\r\ntoken required\n");

  const HttpHeader redirect_headers[] = {{"Location", "https://8080-demo.sandbox.localhost/app"},
                                         {"Set-Cookie", token_cookie("tok", 60)}};
  auto redirect = http1_refusal(302, "text/plain", "", redirect_headers);
  ASSERT_TRUE(redirect.ok());
  // It parses as one complete response with every header where it belongs.
  HttpParser parser(HttpParser::Kind::kResponse, {});
  ASSERT_EQ(parser.feed(*redirect), HttpParser::State::kMessageComplete);
  EXPECT_EQ(parser.consumed(), redirect->size());
  EXPECT_EQ(parser.message().status, 302);
  EXPECT_EQ(*parser.message().header("location"), "https://8080-demo.sandbox.localhost/app");
  EXPECT_EQ(*parser.message().header("set-cookie"), token_cookie("tok", 60));
  EXPECT_EQ(*parser.message().header("cache-control"), "no-store");
  EXPECT_EQ(*parser.message().header("content-length"), "0");
}

TEST(EdgeAuth, Http1RefusalRejectsInjection) {
  for (std::string_view value : {"/a\r\nSet-Cookie: x=y"sv, "/a\nx"sv, "/a\rx"sv, "/a\0x"sv}) {
    const HttpHeader headers[] = {{"Location", std::string(value)}};
    auto r = http1_refusal(302, "text/plain", "", headers);
    ASSERT_FALSE(r.ok()) << value;
    EXPECT_EQ(r.error(), Error::kInvalidArgument);
  }
  for (std::string_view name : {"", "X Y", "X:Y", "X\r\nY", "Ö"}) {
    const HttpHeader headers[] = {{std::string(name), "v"}};
    EXPECT_FALSE(http1_refusal(400, "text/plain", "", headers).ok()) << name;
  }
  EXPECT_FALSE(http1_refusal(400, "text/plain\r\nX: y", "", {}).ok());
  EXPECT_FALSE(http1_refusal(99, "text/plain", "", {}).ok());
  EXPECT_FALSE(http1_refusal(600, "text/plain", "", {}).ok());
}

// The token found last is remembered, so a keep-alive client's next request is not hashed again: what it
// matches must stay exactly what the digests match.
TEST(EdgeAuth, ConsumedCredentialsMatchTheSameTokensWhenOneIsRemembered) {
  ConsumedCredentials consumed;
  consumed.add_token("verified-one");
  consumed.add_token("operator-token");
  EXPECT_FALSE(consumed.matches("verified-two"));
  EXPECT_TRUE(consumed.matches("verified-one"));
  EXPECT_TRUE(consumed.matches("verified-one"));
  for (const char* other : {"verified-onf", "verified-on", "verified-one ", "", "Verified-one"})
    EXPECT_FALSE(consumed.matches(other)) << other;
  EXPECT_TRUE(consumed.matches("operator-token"));
  EXPECT_TRUE(consumed.matches("verified-one"));
  EXPECT_FALSE(ConsumedCredentials{}.matches("verified-one"));
}

TEST(EdgeAuth, StripCredentialsTakesOutWhatTheEdgeConsumed) {
  const std::string sandbox_token = "sgt_sandbox";
  ConsumedCredentials consumed;
  consumed.add_token("verified-one");
  consumed.add_token("operator-token");
  consumed.add_token("");  // no operator token: matches nothing, not an empty bearer token
  consumed.add_token_digest_hex(token_digest(sandbox_token));
  std::string target = "/p?a=1&sandgate_token=verified-one&sandgate%5Ftoken=x&b=2";
  std::vector<HttpHeader> headers = {
      {"Host", "8080-a.example"},
      {"Authorization", "Bearer verified-one"},
      {"authorization", "bearer   operator-token "},
      {"Authorization", "Bearer sgt_sandbox"},
      {"Authorization", "Bearer the-apps-own"},
      {"Authorization", "Basic dXNlcjpwYXNz"},
      {"Cookie", "a=1; __Host-sandgate_token=anything; b=2"},
      {"Cookie", "__Host-sandgate_token=x;__Host-sandgate_token"},
      {"Cookie", "sandgate_token=not-ours-by-name"},
  };
  EXPECT_EQ(strip_credentials(target, headers, consumed), 8u);
  EXPECT_EQ(target, "/p?a=1&b=2");
  std::vector<std::pair<std::string, std::string>> left;
  for (const HttpHeader& h : headers) left.emplace_back(h.name, h.value);
  EXPECT_EQ(left, (std::vector<std::pair<std::string, std::string>>{
                      {"Host", "8080-a.example"},
                      {"Authorization", "Bearer the-apps-own"},
                      {"Authorization", "Basic dXNlcjpwYXNz"},
                      {"Cookie", "a=1; b=2"},
                      {"Cookie", "sandgate_token=not-ours-by-name"},
                  }));
  // Nothing to take out: the request is left exactly as it was.
  std::string plain = "/x?y=1";
  std::vector<HttpHeader> none = {{"Cookie", "a=1;b=2"}};
  EXPECT_EQ(strip_credentials(plain, none, ConsumedCredentials{}), 0u);
  EXPECT_EQ(plain, "/x?y=1");
  EXPECT_EQ(none[0].value, "a=1;b=2");
}

}  // namespace
}  // namespace sg
