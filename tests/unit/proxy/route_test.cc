#include "proxy/route.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

constexpr std::string_view kDomain = "sandbox.localhost";

TEST(Route, PortRoute) {
  auto r = parse_route("8080-demo.sandbox.localhost", kDomain);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r->kind, RouteKind::kPort);
  EXPECT_EQ(r->port, 8080);
  EXPECT_EQ(r->target, "demo");
}

TEST(Route, NameWithHyphensSplitsAtFirstHyphen) {
  auto r = parse_route("3000-my-cool-box.sandbox.localhost", kDomain);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->port, 3000);
  EXPECT_EQ(r->target, "my-cool-box");
}

TEST(Route, IdTarget) {
  auto r = parse_route("22-sb-0123456789ab.sandbox.localhost", kDomain);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->port, 22);
  EXPECT_EQ(r->target, "sb-0123456789ab");
}

TEST(Route, HostIsCaseInsensitiveAndMayCarryPortAndTrailingDot) {
  for (const char* host : {"8080-Demo.Sandbox.LOCALHOST", "8080-demo.sandbox.localhost:8443",
                           "8080-demo.sandbox.localhost.", "8080-demo.sandbox.localhost.:443"}) {
    auto r = parse_route(host, kDomain);
    ASSERT_TRUE(r.ok()) << host << ": " << r.message();
    EXPECT_EQ(r->target, "demo") << host;
    EXPECT_EQ(r->port, 8080) << host;
  }
}

TEST(Route, SdkAndApiRoutes) {
  auto sdk = parse_route("demo.sandbox.localhost", kDomain);
  ASSERT_TRUE(sdk.ok());
  EXPECT_EQ(sdk->kind, RouteKind::kSdk);
  EXPECT_EQ(sdk->target, "demo");
  auto api = parse_route("api.sandbox.localhost", kDomain);
  ASSERT_TRUE(api.ok());
  EXPECT_EQ(api->kind, RouteKind::kApi);
  // A name that merely starts with digits is an SDK route, not a port route.
  auto digits = parse_route("8080demo.sandbox.localhost", kDomain);
  ASSERT_TRUE(digits.ok());
  EXPECT_EQ(digits->kind, RouteKind::kSdk);
}

TEST(Route, MalformedHostsAre400) {
  const char* bad[] = {
      "",
      ":8443",
      ".sandbox.localhost",
      "-demo.sandbox.localhost",
      "8080-.sandbox.localhost",
      "8080--demo.sandbox.localhost",    // name starting with a hyphen
      "8080-demo-.sandbox.localhost",    // name ending with a hyphen
      "0-demo.sandbox.localhost",        // port 0
      "65536-demo.sandbox.localhost",    // port out of range
      "08080-demo.sandbox.localhost",    // leading zero
      "999999-demo.sandbox.localhost",
      "8080-de_mo.sandbox.localhost",    // underscore
      "8080-de mo.sandbox.localhost",    // space
      "8080-démo.sandbox.localhost",     // non-ASCII
      "a.b.sandbox.localhost",           // two labels
      "8080-demo..sandbox.localhost",
      "8080-demo.sandbox.localhost:",    // empty port
      "8080-demo.sandbox.localhost:99999",
      "8080-demo.sandbox.localhost:12ab",
      "[::1]:8443",
      "8080-demo.sandbox.localhost\r\nX: y",
      "8080-demo/../x.sandbox.localhost",
  };
  for (const char* host : bad) {
    auto r = parse_route(host, kDomain);
    ASSERT_FALSE(r.ok()) << "accepted: " << host;
    EXPECT_EQ(r.error(), Error::kInvalidArgument) << host << ": " << r.message();
  }
}

TEST(Route, LabelLongerThan63IsRejected) {
  std::string name(64, 'a');
  EXPECT_FALSE(parse_route(name + ".sandbox.localhost", kDomain).ok());
  EXPECT_FALSE(parse_route("80-" + name + ".sandbox.localhost", kDomain).ok());
  // A 63-character name is valid, and so is its port route (the label then exceeds 63 by the port prefix).
  std::string ok_name(63, 'a');
  EXPECT_TRUE(parse_route(ok_name + ".sandbox.localhost", kDomain).ok());
  EXPECT_TRUE(parse_route("80-" + ok_name + ".sandbox.localhost", kDomain).ok());
}

TEST(Route, HugeHostIsRejectedWithoutWork) {
  std::string host(100000, 'a');
  EXPECT_EQ(parse_route(host, kDomain).error(), Error::kInvalidArgument);
}

TEST(Route, ForeignDomainsAreNotFound) {
  for (const char* host : {"example.com", "8080-demo.example.com", "sandbox.localhost", "xsandbox.localhost",
                           "8080-demo.notsandbox.localhost", "localhost"}) {
    auto r = parse_route(host, kDomain);
    ASSERT_FALSE(r.ok()) << host;
    EXPECT_EQ(r.error(), Error::kNotFound) << host << ": " << r.message();
  }
}

TEST(Route, NormalizeHost) {
  EXPECT_EQ(normalize_host("A.B:1"), "a.b");
  EXPECT_EQ(normalize_host("a.b."), "a.b");
  EXPECT_EQ(normalize_host("a_b"), "");
  EXPECT_EQ(normalize_host("[::1]"), "");
}

}  // namespace
}  // namespace sg
