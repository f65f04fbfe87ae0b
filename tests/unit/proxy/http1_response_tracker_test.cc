#include "proxy/http1_response_tracker.h"

#include <gtest/gtest.h>

#include <string>

namespace sg {
namespace {

using State = Http1ResponseTracker::State;

// Feeds `bytes` one byte at a time, and in one piece to a second tracker, expecting the same ends.
void feed_both_ways(Http1ResponseTracker& whole, Http1ResponseTracker& bytewise, const std::string& bytes) {
  whole.observe(bytes);
  for (char c : bytes) bytewise.observe(std::string_view(&c, 1));
}

TEST(Http1ResponseTracker, CountsAnswersWithLengthChunkedAndNoBody) {
  Http1ResponseTracker a, b;
  for (auto* t : {&a, &b}) {
    t->expect("GET", false);
    t->expect("HEAD", false);
    t->expect("GET", false);
    t->expect("POST", false);
  }
  const std::string bytes =
      "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nHTTP/1.1 2x"  // the body looks like a head: it is counted
      "HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n"              // HEAD: no body whatever the length says
      "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n"
      "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n";
  feed_both_ways(a, b, bytes);
  for (auto* t : {&a, &b}) {
    EXPECT_EQ(t->answered(), 4u);
    EXPECT_TRUE(t->idle());
    EXPECT_EQ(t->state(), State::kHead);
  }
}

// On a kTLS connection response bodies are spliced past the tracker: it says how many bytes it needs not
// see, and follows the stream as well when they are skipped as when they are shown.
TEST(Http1ResponseTracker, BodiesAndChunkDataMayPassUnseen) {
  Http1ResponseTracker t;
  t.expect("GET", false);
  t.expect("GET", false);
  t.expect("GET", false);
  EXPECT_EQ(t.unseen_allowed(), 0u) << "a head comes first";
  t.observe("HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n0123456789");
  EXPECT_EQ(t.unseen_allowed(), 99990u);
  t.skip(50000);
  EXPECT_EQ(t.unseen_allowed(), 49990u);
  t.skip(49990);
  EXPECT_EQ(t.answered(), 1u);
  EXPECT_EQ(t.unseen_allowed(), 0u) << "the next head must be read";

  t.observe("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n186a0\r\nabcde");  // 100000 bytes
  EXPECT_EQ(t.unseen_allowed(), 99995u);
  t.skip(99995);
  EXPECT_EQ(t.unseen_allowed(), 0u) << "the chunk's end and the next size line are read";
  t.observe("\r\n3\r\nxyz\r\n0\r\n\r\n");
  EXPECT_EQ(t.answered(), 2u);
  EXPECT_FALSE(t.idle()) << "a third request is still unanswered";

  t.observe("HTTP/1.1 200 OK\r\n\r\nbody until the close");
  EXPECT_EQ(t.state(), State::kUntilClose);
  EXPECT_EQ(t.unseen_allowed(), UINT64_MAX) << "nothing more is followed";
}

TEST(Http1ResponseTracker, IsNotIdleInsideAResponse) {
  Http1ResponseTracker t;
  t.expect("GET", false);
  t.expect("GET", false);
  t.observe("HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab");
  EXPECT_EQ(t.answered(), 0u);
  EXPECT_EQ(t.state(), State::kFixedBody);
  t.observe("cd");
  EXPECT_EQ(t.answered(), 1u);
  EXPECT_FALSE(t.idle()) << "one request still waits for its answer";
  t.observe("HTTP/1.1 404 Not Found\r\nContent-");
  EXPECT_FALSE(t.idle());
  t.observe("Length: 0\r\n\r\n");
  EXPECT_TRUE(t.idle());
  EXPECT_EQ(t.answered(), 2u);
}

TEST(Http1ResponseTracker, ABodyUntilCloseIsNotFollowed) {
  Http1ResponseTracker t;
  t.expect("GET", false);
  t.observe("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nHTTP/1.1 200 OK\r\n\r\n");
  EXPECT_EQ(t.state(), State::kUntilClose);
  EXPECT_EQ(t.answered(), 0u);
  EXPECT_FALSE(t.idle());
}

TEST(Http1ResponseTracker, AnAcceptedUpgradeSwitches) {
  Http1ResponseTracker t;
  t.expect("GET", true);
  t.observe("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x02hi");
  EXPECT_EQ(t.take_upgrade_outcome(), std::optional<bool>(true));
  EXPECT_EQ(t.take_upgrade_outcome(), std::nullopt) << "handed out once";
  EXPECT_EQ(t.state(), State::kSwitched);
  EXPECT_EQ(t.answered(), 1u);
}

TEST(Http1ResponseTracker, ARefusedUpgradeIsAnOrdinaryAnswer) {
  Http1ResponseTracker t;
  t.expect("GET", true);
  t.expect("GET", false);
  t.observe("HTTP/1.1 426 Upgrade Required\r\nContent-Length: 3\r\n\r\nno\n");
  EXPECT_EQ(t.take_upgrade_outcome(), std::optional<bool>(false));
  EXPECT_EQ(t.state(), State::kHead);
  EXPECT_EQ(t.answered(), 1u);
  t.observe("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
  EXPECT_TRUE(t.idle());
}

TEST(Http1ResponseTracker, ConnectSwitchesOn2xxOnly) {
  Http1ResponseTracker ok, refused;
  ok.expect("CONNECT", false);
  ok.observe("HTTP/1.1 200 Connection Established\r\n\r\nraw bytes");
  EXPECT_EQ(ok.take_upgrade_outcome(), std::optional<bool>(true));
  EXPECT_EQ(ok.state(), State::kSwitched);
  refused.expect("CONNECT", false);
  refused.observe("HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(refused.take_upgrade_outcome(), std::optional<bool>(false));
  EXPECT_TRUE(refused.idle());
}

TEST(Http1ResponseTracker, WhatIsNotHttpOrNotAskedForIsLost) {
  Http1ResponseTracker garbage, unasked;
  garbage.expect("GET", false);
  garbage.observe("SSH-2.0-OpenSSH_9.2\r\n");
  EXPECT_EQ(garbage.state(), State::kLost);
  EXPECT_FALSE(garbage.idle());
  unasked.observe("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(unasked.state(), State::kLost);
  EXPECT_FALSE(unasked.idle());
}

}  // namespace
}  // namespace sg
