#include "proxy/unix_node_client.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

namespace sg {
namespace {

UniqueFd one_fd() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ::close(sv[1]);
  return UniqueFd(sv[0]);
}

std::vector<UniqueFd> fds(size_t n) {
  std::vector<UniqueFd> out;
  for (size_t i = 0; i < n; ++i) out.push_back(one_fd());
  return out;
}

std::vector<UniqueFd> some_fd() { return fds(1); }

TEST(UnixNodeClient, ParsesAnOpenAnswer) {
  auto a = parse_open_answer(200,
                             R"({"id":"sb-1","name":"demo","port":8080,"protocol":"h2c","public":true,"woke":true,)"
                             R"("wake_ms":1.5,"connect_port":18080,"connected":false,"opened_at":42,)"
                             R"("token_sha256":"abc","credential":1})",
                             some_fd());
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->status, 200);
  const OpenedSocket& o = a->opened;
  EXPECT_EQ(o.id, "sb-1");
  EXPECT_EQ(o.port, 8080);
  EXPECT_EQ(o.policy.protocol, "h2c");
  EXPECT_TRUE(o.policy.is_public);
  EXPECT_TRUE(o.woke);
  EXPECT_EQ(o.wake_ms, 1.5);
  EXPECT_EQ(o.connect_port, 18080);
  EXPECT_FALSE(o.connected);
  EXPECT_EQ(o.opened_at, 42u);
  EXPECT_EQ(o.token_sha256, "abc");
  EXPECT_EQ(o.credential, std::optional<size_t>(1));
  EXPECT_TRUE(o.socket.valid());
  // Without connect_port, the routed port; credential null on a public port.
  auto old = parse_open_answer(200, R"({"id":"sb-1","port":8080,"protocol":"http1","credential":null})", some_fd());
  ASSERT_TRUE(old);
  EXPECT_EQ(old->opened.connect_port, 8080);
  EXPECT_FALSE(old->opened.credential);
}

TEST(UnixNodeClient, RefusalsCarryTheNodesMessage) {
  auto a = parse_open_answer(401, R"({"error":"unauthorized","message":"invalid token"})", std::vector<UniqueFd>());
  ASSERT_TRUE(a);
  EXPECT_EQ(a->status, 401);
  EXPECT_EQ(a->message, "invalid token");
  auto garbage = parse_open_answer(503, "not json", std::vector<UniqueFd>());
  ASSERT_TRUE(garbage);
  EXPECT_EQ(garbage->status, 503);
  EXPECT_EQ(garbage->message, "");
}

TEST(UnixNodeClient, GarbageFromTheNodeIsAnErrorNotACrash) {
  for (std::string_view body : {"", "null", "[]", R"({"id":5,"port":8080,"protocol":"http1"})",
                                R"({"id":"sb","port":70000,"protocol":"http1"})", R"({"id":"sb","port":8080})"}) {
    EXPECT_FALSE(parse_open_answer(200, body, some_fd())) << body;
    EXPECT_FALSE(parse_lookup_answer(200, body)) << body;
  }
  // A 200 without the socket is no open.
  EXPECT_FALSE(parse_open_answer(200, R"({"id":"sb","port":8080,"protocol":"http1"})", std::vector<UniqueFd>()));
  EXPECT_FALSE(parse_activity_answer(200, "nope"));
  EXPECT_FALSE(parse_activity_answer(400, "{}"));
}

TEST(UnixNodeClient, AnOpenAnswerCarriesSparesForTheRouteCache) {
  constexpr std::string_view kBody =
      R"({"id":"sb-1","port":8080,"protocol":"http1","connect_port":8080,"opened_at":42,"token_sha256":"abc",)"
      R"("spare_sockets":3,"cache_ms":99999,"operator_token_sha256":"def"})";
  auto a = parse_open_answer(200, kBody, fds(4));
  ASSERT_TRUE(a) << a.message();
  EXPECT_TRUE(a->opened.socket.valid());
  EXPECT_EQ(a->opened.spares.size(), 3u);
  EXPECT_EQ(a->opened.cache_ms, RouteCache::kMaxRouteMs) << "bounded by the proxy too";
  EXPECT_EQ(a->opened.operator_token_sha256, "def");
  // Descriptors the answer does not account for are no spares (they are closed).
  auto mismatch = parse_open_answer(200, kBody, fds(2));
  ASSERT_TRUE(mismatch);
  EXPECT_TRUE(mismatch->opened.spares.empty());
  EXPECT_EQ(mismatch->opened.cache_ms, 0u);
}

TEST(UnixNodeClient, TheSparesNamespaceComesLastWhenTheAnswerSaysSo) {
  constexpr std::string_view kOpen =
      R"({"id":"sb-1","port":8080,"protocol":"http1","connect_port":8080,"opened_at":42,"token_sha256":"abc",)"
      R"("spare_sockets":2,"cache_ms":1000,"operator_token_sha256":"","netns":true})";
  std::vector<UniqueFd> passed = fds(4);
  const int last = passed.back().get();
  auto a = parse_open_answer(200, kOpen, std::move(passed));
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->opened.spares.size(), 2u);
  EXPECT_EQ(a->opened.netns.get(), last);
  auto unaccounted = parse_open_answer(200, kOpen, fds(3));
  ASSERT_TRUE(unaccounted);
  EXPECT_TRUE(unaccounted->opened.spares.empty()) << "one descriptor short: neither spares nor namespace";
  EXPECT_FALSE(unaccounted->opened.netns.valid());

  constexpr std::string_view kSockets =
      R"({"id":"sb-1","port":8080,"count":2,"connect_port":8080,"opened_at":7,"cache_ms":1000,"netns":true})";
  passed = fds(3);
  const int namespace_fd = passed.back().get();
  auto g = parse_sockets_answer(200, kSockets, std::move(passed));
  ASSERT_TRUE(g) << g.message();
  EXPECT_EQ(g->spares.size(), 2u);
  EXPECT_EQ(g->netns.get(), namespace_fd);
  EXPECT_FALSE(parse_sockets_answer(200, kSockets, fds(2))) << "count + the namespace must match the descriptors";
  // A count that wraps around with the namespace's one: refused, not read past the descriptors.
  EXPECT_FALSE(parse_sockets_answer(
      200, R"({"id":"sb-1","port":8080,"count":18446744073709551615,"connect_port":8080,"opened_at":7,"netns":true})",
      {}));
  auto wrapped = parse_open_answer(
      200,
      R"({"id":"sb-1","port":8080,"protocol":"http1","connect_port":8080,"spare_sockets":18446744073709551615,)"
      R"("cache_ms":1000,"netns":true})",
      fds(1));
  ASSERT_TRUE(wrapped);
  EXPECT_TRUE(wrapped->opened.spares.empty());
  EXPECT_FALSE(wrapped->opened.netns.valid());
}

TEST(UnixNodeClient, ParsesSocketsAnswersAndRouteEvents) {
  auto g = parse_sockets_answer(200,
                                R"({"id":"sb-1","port":8080,"count":2,"connect_port":8080,"opened_at":7,)"
                                R"("cache_ms":1000,"token_sha256":"abc","operator_token_sha256":""})",
                                fds(2));
  ASSERT_TRUE(g) << g.message();
  EXPECT_EQ(g->sandbox_id, "sb-1");
  EXPECT_EQ(g->spares.size(), 2u);
  EXPECT_EQ(g->opened_at, 7u);
  EXPECT_EQ(g->token_sha256, "abc");
  EXPECT_FALSE(parse_sockets_answer(200, R"({"id":"sb-1","port":8080,"count":3,"connect_port":8080,"opened_at":7})",
                                    fds(2)))
      << "count must match the descriptors";
  EXPECT_FALSE(parse_sockets_answer(409, R"({"message":"sandbox sb-1 is suspended"})", {}));

  auto hello = parse_route_event(R"({"event":"hello","stamp":5})");
  ASSERT_TRUE(hello);
  EXPECT_EQ(hello->kind, RouteStreamEvent::Kind::kHello);
  EXPECT_EQ(hello->stamp, 5u);
  auto inv = parse_route_event(R"({"event":"invalidate","id":"sb-1","name":"demo","reason":"token","stamp":6})");
  ASSERT_TRUE(inv);
  EXPECT_EQ(inv->kind, RouteStreamEvent::Kind::kInvalidate);
  EXPECT_EQ(inv->id, "sb-1");
  EXPECT_EQ(inv->reason, "token");
  auto flush = parse_route_event(R"({"event":"flush","id":"","reason":"operator_token","stamp":7})");
  ASSERT_TRUE(flush);
  EXPECT_EQ(flush->kind, RouteStreamEvent::Kind::kFlush);
  for (std::string_view bad : {"", "{}", R"({"event":"invalidate","stamp":1})", R"({"event":"nope","stamp":1})",
                               R"({"event":"hello"})", "[1]"})
    EXPECT_FALSE(parse_route_event(bad)) << bad;
}

TEST(UnixNodeClient, ActivityAnswerListsTheCuts) {
  auto a = parse_activity_answer(
      200, R"({"asleep":[{"id":"sb-1","suspended_at":7},{"id":5},{"id":"sb-x"}],"revoked":[{"id":"sb-2","rotated_at":9}]})");
  ASSERT_TRUE(a) << a.message();
  ASSERT_EQ(a->asleep.size(), 1u) << "malformed entries are skipped";
  EXPECT_EQ(a->asleep[0].id, "sb-1");
  EXPECT_EQ(a->asleep[0].stamp, 7u);
  ASSERT_EQ(a->revoked.size(), 1u);
  EXPECT_EQ(a->revoked[0].stamp, 9u);
  EXPECT_TRUE(a->closed.empty()) << "an older node sends no closed ports";

  auto closed = parse_activity_answer(
      200, R"({"asleep":[],"revoked":[],"closed":[{"id":"sb-3","port":3000,"closed_at":11},)"
           R"({"id":"sb-3","port":0,"closed_at":1},{"id":"sb-3","port":70000,"closed_at":1},{"id":"sb-3","port":80}]})");
  ASSERT_TRUE(closed) << closed.message();
  ASSERT_EQ(closed->closed.size(), 1u) << "malformed entries are skipped";
  EXPECT_EQ(closed->closed[0].id, "sb-3");
  EXPECT_EQ(closed->closed[0].port, 3000);
  EXPECT_EQ(closed->closed[0].stamp, 11u);
}

}  // namespace
}  // namespace sg
