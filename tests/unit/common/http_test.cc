#include "common/http.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

TEST(HttpParser, RequestHeadStopsBeforeBody) {
  HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 0, true});
  std::string req = "POST /x HTTP/1.1\r\nHost: a.b\r\nContent-Length: 5\r\n\r\nhello";
  EXPECT_EQ(p.feed(req), HttpParser::State::kHeadComplete);
  EXPECT_EQ(p.consumed(), req.size() - 5);
  EXPECT_EQ(p.message().method, "POST");
  EXPECT_EQ(p.message().target, "/x");
  ASSERT_NE(p.message().header("HOST"), nullptr);
  EXPECT_EQ(*p.message().header("host"), "a.b");
}

TEST(HttpParser, HeadArrivingByteByByte) {
  HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 0, true});
  std::string req = "GET / HTTP/1.1\r\nHost: x\r\nX-Long: abcdef\r\n\r\n";
  HttpParser::State st = HttpParser::State::kNeedMore;
  for (size_t i = 0; i < req.size(); ++i) {
    st = p.feed(req.data() + i, 1);
    if (i + 1 < req.size()) {
      ASSERT_EQ(st, HttpParser::State::kNeedMore) << i;
    }
  }
  EXPECT_NE(st, HttpParser::State::kNeedMore);
  EXPECT_EQ(*p.message().header("x-long"), "abcdef");
}

TEST(HttpParser, HeadLimitIsEnforcedEvenInOneChunk) {
  HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 0, true});
  std::string req = "GET / HTTP/1.1\r\nHost: x\r\nX: " + std::string(2000, 'a') + "\r\n\r\n";
  EXPECT_EQ(p.feed(req), HttpParser::State::kError);
  EXPECT_EQ(p.failure().code, Error::kLimitExceeded);
}

TEST(HttpParser, HeadLimitAcrossChunks) {
  HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 0, true});
  EXPECT_EQ(p.feed("GET / HTTP/1.1\r\nX: "), HttpParser::State::kNeedMore);
  HttpParser::State st = HttpParser::State::kNeedMore;
  for (int i = 0; i < 100 && st == HttpParser::State::kNeedMore; ++i) st = p.feed(std::string(100, 'a'));
  EXPECT_EQ(st, HttpParser::State::kError);
  EXPECT_EQ(p.failure().code, Error::kLimitExceeded);
}

// A head of exactly max_head_bytes passes and one byte more is refused, in one chunk or byte by byte.
TEST(HttpParser, HeadLimitIsExact) {
  const std::string head = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  for (bool split : {false, true}) {
    HttpParser fits(HttpParser::Kind::kRequest, HttpLimits{head.size(), 0, true});
    HttpParser over(HttpParser::Kind::kRequest, HttpLimits{head.size() - 1, 0, true});
    HttpParser::State a = HttpParser::State::kNeedMore, b = HttpParser::State::kNeedMore;
    for (size_t i = 0; i < head.size(); i += split ? 1 : head.size()) {
      std::string_view part = std::string_view(head).substr(i, split ? 1 : head.size());
      a = fits.feed(part);
      b = over.feed(part);
    }
    EXPECT_EQ(a, HttpParser::State::kHeadComplete) << split;
    EXPECT_EQ(b, HttpParser::State::kError) << split;
    EXPECT_EQ(over.failure().code, Error::kLimitExceeded);
  }
}

// The head bound applies to the head only: a body in the same chunk, longer than the head limit, is parsed.
TEST(HttpParser, BodyInTheHeadsChunkIsParsedPastTheHeadLimit) {
  HttpParser p(HttpParser::Kind::kResponse, HttpLimits{64, 4096, false});
  const std::string body(3000, 'b');
  EXPECT_EQ(p.feed("HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n" + body), HttpParser::State::kMessageComplete);
  EXPECT_EQ(p.message().body, body);
}

TEST(HttpParser, GarbageIsMalformed) {
  for (std::string bad : {std::string("\x16\x03\x01\x02\x00", 5), std::string("HELLO WORLD\r\n\r\n"),
                          std::string("GET / HTTP/1.1\r\nBad Header\r\n\r\n"), std::string("GET / HTTP/9.9\r\n\r\n")}) {
    HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 0, true});
    EXPECT_EQ(p.feed(bad), HttpParser::State::kError) << bad;
    EXPECT_EQ(p.failure().code, Error::kInvalidArgument);
  }
}

TEST(HttpParser, FullRequestsWithBodiesAndPipelining) {
  HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 100, false});
  std::string two = "POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /b HTTP/1.1\r\n\r\n";
  EXPECT_EQ(p.feed(two), HttpParser::State::kMessageComplete);
  EXPECT_EQ(p.message().body, "abc");
  size_t used = p.consumed();
  p.reset();
  EXPECT_EQ(p.feed(two.data() + used, two.size() - used), HttpParser::State::kMessageComplete);
  EXPECT_EQ(p.message().target, "/b");
}

TEST(HttpParser, BodyLimit) {
  HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 10, false});
  EXPECT_EQ(p.feed("POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n0123456789a"), HttpParser::State::kError);
  EXPECT_EQ(p.failure().code, Error::kLimitExceeded);
}

TEST(HttpParser, ChunkedBody) {
  HttpParser p(HttpParser::Kind::kRequest, HttpLimits{1024, 100, false});
  EXPECT_EQ(p.feed("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"),
            HttpParser::State::kMessageComplete);
  EXPECT_EQ(p.message().body, "abc");
}

TEST(HttpParser, ResponseDelimitedByEof) {
  HttpParser p(HttpParser::Kind::kResponse, HttpLimits{1024, 100, false});
  EXPECT_EQ(p.feed("HTTP/1.0 200 OK\r\n\r\npartial"), HttpParser::State::kNeedMore);
  EXPECT_EQ(p.finish(), HttpParser::State::kMessageComplete);
  EXPECT_EQ(p.message().status, 200);
  EXPECT_EQ(p.message().body, "partial");
}

TEST(HttpParser, TruncatedResponseIsAnError) {
  HttpParser p(HttpParser::Kind::kResponse, HttpLimits{1024, 100, false});
  EXPECT_EQ(p.feed("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"), HttpParser::State::kNeedMore);
  EXPECT_EQ(p.finish(), HttpParser::State::kError);
}

}  // namespace
}  // namespace sg
