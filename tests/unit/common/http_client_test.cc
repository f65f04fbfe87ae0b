#include "common/http_client.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/net.h"

namespace sg {
namespace {

using namespace std::chrono_literals;
using State = HttpResponseReader::State;

HttpDeadline in(std::chrono::milliseconds ms) { return std::chrono::steady_clock::now() + ms; }

// ---- build_http_request ----

TEST(HttpRequestBuilder, ExactBytesInOrder) {
  HttpRequest r{.method = "PUT", .target = "/machine-config?x=1", .host = "localhost",
                .headers = {{"Connection", "close"}, {"Accept", "application/json"}}, .body = "{\"a\":1}"};
  auto out = build_http_request(r);
  ASSERT_TRUE(out) << out.message();
  EXPECT_EQ(*out,
            "PUT /machine-config?x=1 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAccept: application/json\r\n"
            "Content-Length: 7\r\n\r\n{\"a\":1}");
}

TEST(HttpRequestBuilder, ContentLengthForAnEmptyBodyOnlyWhenAsked) {
  HttpRequest r{.method = "GET", .target = "/", .host = "h"};
  EXPECT_EQ(build_http_request(r).value(), "GET / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n");
  r.content_length_when_empty = false;
  EXPECT_EQ(build_http_request(r).value(), "GET / HTTP/1.1\r\nHost: h\r\n\r\n");
}

void expect_refused(const HttpRequest& r, Error code, const std::string& why, const HttpRequestLimits& limits = {}) {
  auto out = build_http_request(r, limits);
  ASSERT_FALSE(out) << why << ": built " << out.value();
  EXPECT_EQ(out.error(), code) << why << ": " << out.message();
}

TEST(HttpRequestBuilder, RefusesLineBreaksAndControlBytesEverywhere) {
  const HttpRequest ok{.method = "GET", .target = "/", .host = "h", .headers = {{"A", "b"}}};
  ASSERT_TRUE(build_http_request(ok));
  for (const std::string& bad : std::vector<std::string>{"\r", "\n", "\r\n", std::string(1, '\0'), "\x7f", "\x01"}) {
    HttpRequest r = ok;
    std::string target = "/a" + bad + "X-Evil: 1";
    r.target = target;
    expect_refused(r, Error::kInvalidArgument, "target");
    r = ok;
    std::string host = "h" + bad + "X-Evil: 1";
    r.host = host;
    expect_refused(r, Error::kInvalidArgument, "host");
    r = ok;
    r.headers = {{"A" + bad + "B", "v"}};
    expect_refused(r, Error::kInvalidArgument, "header name");
    r = ok;
    r.headers = {{"A", "v" + bad + "X-Evil: 1"}};
    expect_refused(r, Error::kInvalidArgument, "header value");
    r = ok;
    std::string method = "GET" + bad;
    r.method = method;
    expect_refused(r, Error::kInvalidArgument, "method");
  }
  HttpRequest r = ok;
  r.target = "/a HTTP/1.1";  // a space would end the target and let the rest pose as the version
  expect_refused(r, Error::kInvalidArgument, "space in target");
  r = ok;
  r.target = "";
  expect_refused(r, Error::kInvalidArgument, "empty target");
  r = ok;
  r.method = "";
  expect_refused(r, Error::kInvalidArgument, "empty method");
  r = ok;
  r.host = "";
  expect_refused(r, Error::kInvalidArgument, "empty host");
  r = ok;
  r.headers = {{"", "v"}};
  expect_refused(r, Error::kInvalidArgument, "empty header name");
  r = ok;
  r.headers = {{"A:B", "v"}};
  expect_refused(r, Error::kInvalidArgument, "colon in header name");
  // A tab inside a value is legal HTTP.
  r = ok;
  r.headers = {{"A", "b\tc"}};
  EXPECT_TRUE(build_http_request(r));
}

TEST(HttpRequestBuilder, RefusesTheFramingHeadersItOwns) {
  for (const char* name : {"Host", "content-length", "Transfer-Encoding"}) {
    HttpRequest r{.method = "POST", .target = "/", .host = "h", .headers = {{name, "1"}}};
    expect_refused(r, Error::kInvalidArgument, name);
  }
}

TEST(HttpRequestBuilder, LimitsAreExactBoundaries) {
  // "GET /123456789 HTTP/1.1\r\nHost: h\r\n\r\n" is 36 bytes.
  const HttpRequestLimits limits{.max_head_bytes = 36, .max_target_bytes = 10, .max_body_bytes = 5};
  HttpRequest r{.method = "GET", .target = "/123456789", .host = "h", .content_length_when_empty = false};
  auto at_limit = build_http_request(r, limits);
  ASSERT_TRUE(at_limit) << at_limit.message();
  EXPECT_EQ(at_limit->size(), 36u);

  std::string target11 = "/1234567890";
  r.target = target11;
  expect_refused(r, Error::kLimitExceeded, "target over", limits);

  r.target = "/12345678";
  std::string host = "hh";  // the same target length budget, one more byte of head
  r.host = host;
  r.target = "/123456789";
  expect_refused(r, Error::kLimitExceeded, "head over", HttpRequestLimits{.max_head_bytes = 36,
                                                                          .max_target_bytes = 10,
                                                                          .max_body_bytes = 5});

  HttpRequest b{.method = "POST", .target = "/", .host = "h", .body = "12345"};
  EXPECT_TRUE(build_http_request(b, {.max_head_bytes = 1024, .max_target_bytes = 10, .max_body_bytes = 5}));
  b.body = "123456";
  expect_refused(b, Error::kLimitExceeded, "body over", {.max_head_bytes = 1024, .max_target_bytes = 10,
                                                         .max_body_bytes = 5});
  // The body does not count against the head limit.
  std::string big(4096, 'x');
  b.body = big;
  EXPECT_TRUE(build_http_request(b, {.max_head_bytes = 64, .max_target_bytes = 10, .max_body_bytes = 4096}));
}

// ---- HttpResponseReader ----

constexpr std::string_view kAnswer = "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 8\r\n"
                                     "\r\n{\"id\":1}";

TEST(HttpResponseReader, ByteByByte) {
  HttpResponseReader reader;
  EXPECT_FALSE(reader.started());
  for (size_t i = 0; i + 1 < kAnswer.size(); ++i) ASSERT_EQ(reader.feed(kAnswer.substr(i, 1)), State::kNeedMore) << i;
  EXPECT_TRUE(reader.started());
  ASSERT_EQ(reader.feed(kAnswer.substr(kAnswer.size() - 1)), State::kComplete);
  EXPECT_EQ(reader.message().status, 201);
  EXPECT_EQ(reader.message().body, "{\"id\":1}");
  ASSERT_NE(reader.message().header("content-type"), nullptr);
  EXPECT_EQ(*reader.message().header("content-type"), "application/json");
  // What follows the answer is not read: one answer per connection.
  EXPECT_EQ(reader.feed("HTTP/1.1 500 X\r\n\r\n"), State::kComplete);
  EXPECT_EQ(reader.message().status, 201);
}

TEST(HttpResponseReader, ChunkedBodyByteByByte) {
  const std::string_view answer = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n";
  HttpResponseReader reader;
  State st = State::kNeedMore;
  for (char c : answer) st = reader.feed(&c, 1);
  ASSERT_EQ(st, State::kComplete);
  EXPECT_EQ(reader.message().body, "{\"a\":1}");
}

TEST(HttpResponseReader, BodyDelimitedByCloseCompletesAtFinish) {
  HttpResponseReader reader;
  ASSERT_EQ(reader.feed("HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\nno such"), State::kNeedMore);
  ASSERT_EQ(reader.feed(" sandbox"), State::kNeedMore);
  ASSERT_EQ(reader.finish(), State::kComplete);
  EXPECT_EQ(reader.message().status, 404);
  EXPECT_EQ(reader.message().body, "no such sandbox");
}

TEST(HttpResponseReader, SkipsInterimAnswers) {
  HttpResponseReader reader;
  ASSERT_EQ(reader.feed("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 20"),
            State::kNeedMore);
  ASSERT_EQ(reader.feed("4 No Content\r\n\r\n"), State::kComplete);
  EXPECT_EQ(reader.message().status, 204);
  EXPECT_EQ(reader.message().header("Link"), nullptr);
}

TEST(HttpResponseReader, InterimAnswersAreBoundedTogether) {
  HttpResponseReader reader({.max_head_bytes = 100, .max_body_bytes = 10});
  const std::string interim = "HTTP/1.1 100 Continue\r\n\r\n";  // 25 bytes each
  State st = State::kNeedMore;
  for (int i = 0; i < 5 && st == State::kNeedMore; ++i) st = reader.feed(interim);
  ASSERT_EQ(st, State::kError);
  EXPECT_EQ(reader.error(), HttpResponseError::kHeadTooLarge);
  EXPECT_EQ(reader.failure().code, Error::kLimitExceeded);
}

TEST(HttpResponseReader, HeadLimitIsExact) {
  const std::string head = "HTTP/1.1 200 OK\r\nX: " + std::string(20, 'a') + "\r\nContent-Length: 0\r\n\r\n";
  HttpResponseReader fits({.max_head_bytes = head.size(), .max_body_bytes = 0});
  EXPECT_EQ(fits.feed(head), State::kComplete);
  HttpResponseReader over({.max_head_bytes = head.size() - 1, .max_body_bytes = 0});
  State st = State::kNeedMore;
  for (char c : head) st = over.feed(&c, 1);  // split, so the limit cannot be checked per chunk only
  ASSERT_EQ(st, State::kError);
  EXPECT_EQ(over.error(), HttpResponseError::kHeadTooLarge);
  EXPECT_EQ(over.failure().code, Error::kLimitExceeded);
  EXPECT_NE(over.failure().message.find("head exceeds " + std::to_string(head.size() - 1)), std::string::npos)
      << over.failure().message;
}

TEST(HttpResponseReader, BodyLimitIsExactForEveryFraming) {
  for (const char* framing : {"Content-Length: 6\r\n\r\n123456", "Transfer-Encoding: chunked\r\n\r\n6\r\n123456\r\n0\r\n\r\n"}) {
    const std::string answer = std::string("HTTP/1.1 200 OK\r\n") + framing;
    HttpResponseReader fits({.max_head_bytes = 1024, .max_body_bytes = 6});
    EXPECT_EQ(fits.feed(answer), State::kComplete) << framing;
    HttpResponseReader over({.max_head_bytes = 1024, .max_body_bytes = 5});
    ASSERT_EQ(over.feed(answer), State::kError) << framing;
    EXPECT_EQ(over.error(), HttpResponseError::kBodyTooLarge);
    EXPECT_EQ(over.failure().code, Error::kLimitExceeded);
  }
  HttpResponseReader by_close({.max_head_bytes = 1024, .max_body_bytes = 5});
  ASSERT_EQ(by_close.feed("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n12345"), State::kNeedMore);
  EXPECT_EQ(by_close.feed("6"), State::kError);
  EXPECT_EQ(by_close.error(), HttpResponseError::kBodyTooLarge);
}

TEST(HttpResponseReader, Malformed) {
  for (const char* bad : {"SSH-2.0-OpenSSH_9.2\r\n", "HTTP/1.1 abc OK\r\n\r\n",
                          "HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
                          "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"}) {
    HttpResponseReader reader;
    ASSERT_EQ(reader.feed(bad), State::kError) << bad;
    EXPECT_EQ(reader.error(), HttpResponseError::kMalformed) << bad;
    EXPECT_EQ(reader.failure().code, Error::kInvalidArgument);
    EXPECT_NE(reader.failure().message.find("malformed"), std::string::npos);
  }
}

TEST(HttpResponseReader, ClosedEarly) {
  HttpResponseReader none;
  ASSERT_EQ(none.finish(), State::kError);
  EXPECT_EQ(none.error(), HttpResponseError::kClosedBeforeResponse);
  EXPECT_EQ(none.failure().code, Error::kUnavailable);

  for (const char* part : {"HTTP/1.1 200", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345",
                           "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n12"}) {
    HttpResponseReader mid;
    ASSERT_EQ(mid.feed(part), State::kNeedMore) << part;
    ASSERT_EQ(mid.finish(), State::kError) << part;
    EXPECT_EQ(mid.error(), HttpResponseError::kClosedMidResponse) << part;
    EXPECT_EQ(mid.failure().code, Error::kUnavailable);
  }
}

// ---- http_exchange over real sockets ----

struct Pair {
  UniqueFd client, server;
};
Pair socket_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// Reads a request head (and a Content-Length body) from `fd`.
std::string read_request(int fd) {
  std::string got;
  char buf[65536];
  for (;;) {
    size_t end = got.find("\r\n\r\n");
    if (end != std::string::npos) {
      size_t cl = 0;
      if (auto pos = got.find("Content-Length: "); pos != std::string::npos)
        cl = std::strtoul(got.c_str() + pos + 16, nullptr, 10);
      if (got.size() >= end + 4 + cl) return got;
    }
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return got;
    got.append(buf, static_cast<size_t>(n));
  }
}

TEST(HttpExchange, AnswerSentByteByByteWithALargeRequest) {
  Pair p = socket_pair();
  // Larger than a unix socket's buffer: the send has to wait for the peer to read, more than once.
  const std::string body(900 * 1024, 'b');
  auto req = build_http_request({.method = "POST", .target = "/x", .host = "h", .body = body});
  ASSERT_TRUE(req) << req.message();
  std::string received;
  std::thread server([&] {
    received = read_request(p.server.get());
    for (char c : kAnswer) {
      ::send(p.server.get(), &c, 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(100us);
    }
  });
  HttpResponseReader reader;
  Status s = http_exchange(p.client.get(), *req, reader, in(5000ms));
  server.join();
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(received, *req);
  EXPECT_EQ(reader.message().status, 201);
  EXPECT_EQ(reader.message().body, "{\"id\":1}");
}

TEST(HttpExchange, OverTcpWithChunkedAnswer) {
  auto listener = listen_on(*parse_endpoint("127.0.0.1:0"), false);
  ASSERT_TRUE(listener) << listener.message();
  uint16_t port = *local_port(listener->get());
  std::thread server([&] {
    pollfd pfd{listener->get(), POLLIN, 0};
    if (::poll(&pfd, 1, 5000) != 1) return;
    UniqueFd conn(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
    read_request(conn.get());
    const std::string_view answer = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
    ::send(conn.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
  });
  auto fd = connect_blocking(*parse_endpoint("127.0.0.1:" + std::to_string(port)), 5000);
  ASSERT_TRUE(fd) << fd.message();
  HttpResponseReader reader;
  Status s = http_exchange(fd->get(), "GET / HTTP/1.1\r\nHost: h\r\n\r\n", reader, in(5000ms));
  server.join();
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(reader.message().body, "ok");
}

TEST(HttpExchange, Timeout) {
  Pair p = socket_pair();
  ASSERT_EQ(::send(p.server.get(), "HTTP/1.1 200 OK\r\n", 17, 0), 17);  // a head that never ends
  HttpResponseReader reader;
  auto start = std::chrono::steady_clock::now();
  Status s = http_exchange(p.client.get(), "GET / HTTP/1.1\r\nHost: h\r\n\r\n", reader, in(200ms));
  auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), Error::kTimeout);
  EXPECT_EQ(reader.error(), HttpResponseError::kTimeout);
  EXPECT_GE(took, 190ms);
  EXPECT_LT(took, 2s);
}

TEST(HttpExchange, TimeoutWhileSending) {
  Pair p = socket_pair();  // the peer never reads, so a large request fills the socket and stalls
  HttpResponseReader reader;
  Status s = http_exchange(p.client.get(), std::string(4 * 1024 * 1024, 'x'), reader, in(200ms));
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), Error::kTimeout);
  EXPECT_NE(s.message().find("sending"), std::string::npos) << s.message();
}

// A GET against a server thread that reads the request, sends `answer` (nothing if empty) and closes.
Status exchange_with(std::string answer, HttpResponseReader& reader) {
  Pair p = socket_pair();
  std::thread server([&p, answer = std::move(answer)] {
    read_request(p.server.get());
    if (!answer.empty()) ::send(p.server.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
    p.server.reset();
  });
  Status s = http_exchange(p.client.get(), "GET / HTTP/1.1\r\nHost: h\r\n\r\n", reader, in(5000ms));
  server.join();
  return s;
}

TEST(HttpExchange, ClosedEarly) {
  const std::pair<std::string, HttpResponseError> cases[] = {
      {"", HttpResponseError::kClosedBeforeResponse},
      {"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{\"a\"", HttpResponseError::kClosedMidResponse}};
  for (const auto& [answer, error] : cases) {
    HttpResponseReader reader;
    Status s = exchange_with(answer, reader);
    ASSERT_FALSE(s) << answer;
    EXPECT_EQ(s.error(), Error::kUnavailable) << answer;
    EXPECT_EQ(reader.error(), error) << answer;
  }
}

TEST(HttpExchange, AnswerOfAPeerThatClosedBeforeReadingTheRequestIsRead) {
  Pair p = socket_pair();
  const std::string_view refusal = "HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\n\r\n";
  ASSERT_EQ(::send(p.server.get(), refusal.data(), refusal.size(), 0), static_cast<ssize_t>(refusal.size()));
  p.server.reset();  // our send now fails with EPIPE
  HttpResponseReader reader;
  Status s = http_exchange(p.client.get(), "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nx", reader, in(5000ms));
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(reader.message().status, 413);

  Pair q = socket_pair();
  q.server.reset();  // closed, nothing said
  HttpResponseReader none;
  Status n = http_exchange(q.client.get(), "GET / HTTP/1.1\r\nHost: h\r\n\r\n", none, in(5000ms));
  ASSERT_FALSE(n);
  EXPECT_EQ(none.error(), HttpResponseError::kClosedBeforeResponse);
  EXPECT_NE(n.message().find("before the request was sent"), std::string::npos) << n.message();
}

TEST(HttpExchange, OversizedAnswers) {
  HttpResponseReader head({.max_head_bytes = 1024, .max_body_bytes = 1024});
  Status s = exchange_with("HTTP/1.1 200 OK\r\nX: " + std::string(2048, 'h') + "\r\n\r\n", head);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), Error::kLimitExceeded);
  EXPECT_EQ(head.error(), HttpResponseError::kHeadTooLarge);

  HttpResponseReader body({.max_head_bytes = 1024, .max_body_bytes = 1024});
  Status b = exchange_with("HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n" + std::string(4096, 'b'), body);
  ASSERT_FALSE(b);
  EXPECT_EQ(b.error(), Error::kLimitExceeded);
  EXPECT_EQ(body.error(), HttpResponseError::kBodyTooLarge);
}

TEST(HttpExchange, StreamFailuresAreRecordedInTheReader) {
  HttpByteStream broken{.write_all = [](std::string_view) -> Status { return fail_errno("send", EIO); },
                        .read_some = [](char*, size_t) -> Result<size_t> { return size_t{0}; }};
  HttpResponseReader reader;
  Status s = http_exchange(broken, "GET / HTTP/1.1\r\nHost: h\r\n\r\n", reader);
  ASSERT_FALSE(s);
  EXPECT_EQ(reader.error(), HttpResponseError::kIo);
  EXPECT_EQ(s.error(), Error::kIo);
}

}  // namespace
}  // namespace sg
