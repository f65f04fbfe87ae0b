#include "proxy/http1_filter.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

using State = Http1RequestFilter::State;

// Records every head it is shown; refuses those whose Host is not "a.test" with 421 and drops "secret".
struct Checker {
  std::vector<Http1Request> seen;
  Http1RequestFilter::OnRequest fn() {
    return [this](Http1Request& r) {
      seen.push_back(r);
      const std::string* host = r.header("host");
      if (host && *host != "a.test") return Http1Verdict{421, "Host names another route"};
      std::erase_if(r.headers, [](const HttpHeader& h) { return h.name == "secret"; });
      return Http1Verdict{};
    };
  }
};

TEST(Http1Filter, EveryPipelinedHeadIsCheckedAndRewritten) {
  Checker c;
  Http1RequestFilter f(16 * 1024, c.fn());
  std::string out;
  EXPECT_EQ(f.feed("GET /1 HTTP/1.1\r\nHost: a.test\r\nsecret: x\r\n\r\n"
                   "GET /2 HTTP/1.1\r\nHost: a.test\r\nSecret: y\r\nsecret: z\r\n\r\n",
                   out),
            State::kRequests);
  ASSERT_EQ(c.seen.size(), 2u);
  EXPECT_EQ(c.seen[1].target, "/2");
  EXPECT_EQ(out, "GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\nGET /2 HTTP/1.1\r\nHost: a.test\r\nSecret: y\r\n\r\n");
  EXPECT_EQ(f.forwarded(), 2u);
}

// A quiet connection's filter gives its header list back between requests, never in the middle of a head:
// what was parsed of a head split by the quiet moment is all there when the rest comes.
TEST(Http1Filter, ReleasingIdleMemoryKeepsAHalfReadHeadAndTheNextRequestsWhole) {
  Checker c;
  Http1RequestFilter f(16 * 1024, c.fn());
  std::string out;
  EXPECT_EQ(f.feed("POST /1 HTTP/1.1\r\nHost: a.test\r\nX-One: 1\r\nContent-Length: 4\r\n\r\nbo", out),
            State::kRequests);
  f.release_memory_while_idle();  // in the body: the judged head goes
  EXPECT_EQ(f.feed("dy", out), State::kRequests);
  f.release_memory_while_idle();
  EXPECT_EQ(f.feed("GET /2 HTTP/1.1\r\nHost: a.test\r\nX-Two", out), State::kRequests);
  f.release_memory_while_idle();
  EXPECT_EQ(f.feed(": 2\r\nsecret: s\r\n\r\n", out), State::kRequests);
  ASSERT_EQ(c.seen.size(), 2u);
  ASSERT_EQ(c.seen[1].headers.size(), 3u);
  EXPECT_EQ(c.seen[1].headers[1].name, "X-Two");
  EXPECT_EQ(c.seen[1].headers[1].value, "2");
  EXPECT_EQ(out, "POST /1 HTTP/1.1\r\nHost: a.test\r\nX-One: 1\r\nContent-Length: 4\r\n\r\nbody"
                 "GET /2 HTTP/1.1\r\nHost: a.test\r\nX-Two: 2\r\n\r\n");
}

TEST(Http1Filter, ARefusedHeadStopsTheDirection) {
  Checker c;
  Http1RequestFilter f(16 * 1024, c.fn());
  std::string out;
  EXPECT_EQ(f.feed("GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\n"
                   "GET /victim HTTP/1.1\r\nHost: b.test\r\nCookie: k=v\r\n\r\n"
                   "GET /3 HTTP/1.1\r\nHost: a.test\r\n\r\n",
                   out),
            State::kRefused);
  EXPECT_EQ(out, "GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\n");
  EXPECT_EQ(f.refusal().status, 421);
  EXPECT_EQ(f.refusal().reason, "Host names another route");
  // Nothing after the refusal is forwarded or even looked at.
  EXPECT_EQ(f.feed("GET /4 HTTP/1.1\r\nHost: a.test\r\n\r\n", out), State::kRefused);
  EXPECT_EQ(out, "GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\n");
  EXPECT_EQ(c.seen.size(), 2u);
}

TEST(Http1Filter, BodiesPassUnchangedAndTheNextHeadIsFound) {
  const std::string chunked =
      "POST /c HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n"
      "5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\nTrailer: t\r\n\r\n";
  const std::string sized = "PUT /s HTTP/1.1\r\nHost: a.test\r\nContent-Length: 14\r\n\r\nGET / HTTP/1.1";
  const std::string last = "GET /l HTTP/1.1\r\nHost: b.test\r\n\r\n";
  const std::string input = chunked + sized + last;
  // One feed, and one byte at a time: the same bytes go out and the same heads are judged.
  for (size_t step : {input.size(), size_t{1}, size_t{7}}) {
    Checker c;
    Http1RequestFilter f(16 * 1024, c.fn());
    std::string out;
    for (size_t i = 0; i < input.size(); i += step) f.feed(std::string_view(input).substr(i, step), out);
    EXPECT_EQ(out, chunked + sized) << step;  // the body of /s looks like a head but is not one
    ASSERT_EQ(c.seen.size(), 3u) << step;
    EXPECT_EQ(c.seen[2].target, "/l");
    EXPECT_EQ(f.state(), State::kRefused);
  }
}

TEST(Http1Filter, AwaitingTheSandboxsAnswerToAnUpgradeHoldsWhatFollows) {
  const std::string head = "GET /ws HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
  const std::string next = "GET / HTTP/1.1\r\nHost: b.test\r\n\r\n";
  {  // accepted: the held bytes go out as they are
    Checker c;
    Http1RequestFilter f(16 * 1024, c.fn());
    std::string out;
    EXPECT_EQ(f.feed(head + "\x81\x05hello", out), State::kAwaitingSwitch);
    EXPECT_EQ(out, head);
    ASSERT_EQ(c.seen.size(), 1u);
    EXPECT_TRUE(c.seen[0].upgrade);
    f.resolve_upgrade(true);
    EXPECT_TRUE(f.has_released());
    EXPECT_EQ(f.feed(next, out), State::kTunnel);
    EXPECT_EQ(out, head + "\x81\x05hello" + next);
    EXPECT_EQ(c.seen.size(), 1u) << "a tunnel is not parsed";
  }
  {  // refused: the held bytes are requests again, each checked
    Checker c;
    Http1RequestFilter f(16 * 1024, c.fn());
    std::string out;
    EXPECT_EQ(f.feed(head + next, out), State::kAwaitingSwitch);
    f.resolve_upgrade(false);
    EXPECT_EQ(f.feed("", out), State::kRefused) << "b.test is refused by the checker";
    EXPECT_EQ(out, head);
    EXPECT_EQ(c.seen.size(), 2u);
  }
  {  // bounded
    Checker c;
    Http1RequestFilter f(16 * 1024, c.fn());
    std::string out;
    f.feed(head, out);
    EXPECT_EQ(f.feed(std::string(Http1RequestFilter::kMaxHeldBytes + 1, 'x'), out), State::kRefused);
    EXPECT_EQ(f.refusal().status, 400);
  }
}

TEST(Http1Filter, BadHeadsAreRefusedWithTheirStatus) {
  struct Case {
    std::string input;
    int status;
  };
  for (const Case& k : std::vector<Case>{
           {"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", 400},
           {"GET / HTTP/1.1\r\nX: y\r\n\r\n", 400},
           {"GET / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
           {"GET / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400},
           {"NOT HTTP\r\n\r\n", 400},
           {"GET / HTTP/1.1\r\nHost: a.test\r\nX: " + std::string(300, 'x') + "\r\n\r\n", 431},
       }) {
    Checker c;
    Http1RequestFilter f(256, c.fn());
    std::string out;
    EXPECT_EQ(f.feed(k.input, out), State::kRefused) << k.input;
    EXPECT_EQ(f.refusal().status, k.status) << k.input << ": " << f.refusal().reason;
    EXPECT_TRUE(out.empty()) << k.input;
    EXPECT_TRUE(c.seen.empty()) << k.input;
  }
}

// llhttp unfolds obsolete line folding (RFC 9112 §5.2 allows replacing it with a space): the value checked is
// the value forwarded, on one line.
TEST(Http1Filter, FoldedLinesAreForwardedUnfolded) {
  Checker c;
  Http1RequestFilter f(16 * 1024, c.fn());
  std::string out;
  f.feed("GET / HTTP/1.1\r\nHost: a.test\r\nX: one\r\n two\r\n\r\n", out);
  EXPECT_EQ(out, "GET / HTTP/1.1\r\nHost: a.test\r\nX: one two\r\n\r\n");
  EXPECT_EQ(f.feed("GET / HTTP/1.1\r\nHost: a.test\r\n b.test\r\n\r\n", out), State::kRefused);
  EXPECT_EQ(f.refusal().status, 421);
}

TEST(Http1Filter, Http10NeedsNoHost) {
  Checker c;
  Http1RequestFilter f(16 * 1024, c.fn());
  std::string out;
  EXPECT_EQ(f.feed("GET / HTTP/1.0\r\n\r\n", out), State::kRequests);
  EXPECT_EQ(out, "GET / HTTP/1.0\r\n\r\n");
}

TEST(Http1Filter, AnEndlessHeadIsCutAtTheLimitWithoutBuffering) {
  Checker c;
  Http1RequestFilter f(1024, c.fn());
  std::string out;
  f.feed("GET / HTTP/1.1\r\nHost: a.test\r\nX: ", out);
  State s = State::kRequests;
  for (int i = 0; i < 100 && s == State::kRequests; ++i) s = f.feed(std::string(100, 'x'), out);
  EXPECT_EQ(s, State::kRefused);
  EXPECT_EQ(f.refusal().status, 431);
}

TEST(Http1Filter, BetweenRequestsOnlyWhenNoPartOfARequestWasRead) {
  Checker c;
  Http1RequestFilter f(16 * 1024, c.fn());
  std::string out;
  EXPECT_TRUE(f.between_requests());
  f.feed("POST /u HTTP/1.1\r\nHost: a.test\r\nContent-Length: 4\r\n\r\nab", out);
  EXPECT_FALSE(f.between_requests()) << "inside a body";
  f.feed("cd", out);
  EXPECT_TRUE(f.between_requests());
  f.feed("GET / HT", out);
  EXPECT_FALSE(f.between_requests()) << "inside a head";
}

TEST(Http1Filter, AskToCloseReplacesKeepAliveAndKeepsTheOtherOptions) {
  std::vector<HttpHeader> none = {{"Host", "a.test"}};
  ask_to_close(none);
  EXPECT_EQ(serialize_request_head({"GET", "/", 1, 1, none, false}), "GET / HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n");

  std::vector<HttpHeader> several = {{"connection", "Keep-Alive, TE"}, {"TE", "trailers"}, {"Connection", " close ,x-opt"}};
  ask_to_close(several);
  ASSERT_EQ(several.size(), 2u);
  EXPECT_EQ(several[0].name, "TE");
  EXPECT_EQ(several[1].name, "Connection");
  EXPECT_EQ(several[1].value, "close, TE, x-opt");
}

}  // namespace
}  // namespace sg
