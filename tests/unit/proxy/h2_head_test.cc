#include "proxy/h2_head.h"

#include <gtest/gtest.h>
#include <nghttp2/nghttp2.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <random>

#include "proxy/edge_auth.h"
#include "tests/unit/proxy/nghttp2_test_session.h"

namespace sg {
namespace {

using namespace test_support;  // NOLINT(google-build-using-namespace)

constexpr std::string_view kAuthority = "8080-demo.sandbox.localhost";

std::vector<HttpHeader> get_request(std::string path = "/") {
  return {{":method", "GET"}, {":scheme", "https"}, {":authority", std::string(kAuthority)}, {":path", path}};
}

// A real HTTP/2 client (an nghttp2 client session) produces the bytes the scanner reads and parses the bytes
// the proxy answers with.
const std::vector<nghttp2_settings_entry> kClientSettings = {{NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 100},
                                                             {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20}};

// --- hand-built frames, for what a well-behaved client never sends ---

// HPACK-encodes fields with nghttp2's encoder, which (unlike the scanner) does not judge them.
std::string hpack(const std::vector<HttpHeader>& fields) {
  nghttp2_hd_deflater* deflater = nullptr;
  EXPECT_EQ(nghttp2_hd_deflate_new(&deflater, 4096), 0);
  std::vector<nghttp2_nv> nva = to_nva(fields);
  std::string block(nghttp2_hd_deflate_bound(deflater, nva.data(), nva.size()), '\0');
  ssize_t n = nghttp2_hd_deflate_hd(deflater, bytes_of(block), block.size(), nva.data(), nva.size());
  nghttp2_hd_deflate_del(deflater);
  EXPECT_GE(n, 0);
  block.resize(static_cast<size_t>(std::max<ssize_t>(n, 0)));
  return block;
}

// Preface + SETTINGS + one HEADERS frame carrying `fields`.
std::string request_bytes(const std::vector<HttpHeader>& fields, uint32_t stream_id = 1) {
  return std::string(kPreface) + settings_frame() +
         frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, stream_id, hpack(fields));
}

Result<std::optional<H2Request>> scan_once(std::string_view bytes, H2ScanLimits limits = {}) {
  return H2RequestScanner(limits).scan(bytes);
}

// Scans `bytes` split in two at every position, then one byte at a time, and checks every split gives the
// same answer as one scan of the whole: no prefix may yield a request or an error the whole would not.
Result<std::optional<H2Request>> scan_in_every_split(std::string_view bytes, H2ScanLimits limits = {}) {
  auto whole = scan_once(bytes, limits);
  auto same = [&](const Result<std::optional<H2Request>>& r, const std::string& how) {
    ASSERT_EQ(r.ok(), whole.ok()) << how << ": " << (r.ok() ? "" : r.message());
    if (!r.ok()) {
      EXPECT_EQ(r.error(), whole.error()) << how;
      return;
    }
    ASSERT_EQ(r->has_value(), whole->has_value()) << how;
    if (r->has_value()) {
      EXPECT_EQ((*r)->stream_id, (*whole)->stream_id) << how;
      EXPECT_EQ((*r)->authority, (*whole)->authority) << how;
      EXPECT_EQ((*r)->headers.size(), (*whole)->headers.size()) << how;
    }
  };
  for (size_t split = 0; split < bytes.size(); ++split) {
    H2RequestScanner scanner(limits);
    auto first = scanner.scan(bytes.substr(0, split));
    if (!first.ok()) {
      same(first, "split at " + std::to_string(split));
      continue;
    }
    if (first->has_value()) continue;  // complete before the split: bytes after the request do not matter
    same(scanner.scan(bytes), "split at " + std::to_string(split));
  }
  H2RequestScanner trickle(limits);
  for (size_t n = 1; n <= bytes.size(); ++n) {
    auto r = trickle.scan(bytes.substr(0, n));
    if (!r.ok() || r->has_value() || n == bytes.size()) {
      same(r, "byte by byte, " + std::to_string(n) + " bytes");
      break;
    }
  }
  return whole;
}

TEST(H2Head, FirstRequestOfARealClientInEverySplit) {
  Nghttp2Session client(Nghttp2Session::Role::kClient, kClientSettings);
  nghttp2_submit_window_update(client.get(), NGHTTP2_FLAG_NONE, 0, 1 << 24);
  nghttp2_submit_ping(client.get(), NGHTTP2_FLAG_NONE, nullptr);
  std::vector<HttpHeader> fields = get_request("/files?x=1");
  fields.push_back({"user-agent", "nghttp2-test"});
  fields.push_back({"authorization", "Bearer abc.def"});
  fields.push_back({"cookie", "theme=dark"});
  fields.push_back({"accept", "*/*"});
  fields.push_back({"cookie", "__Host-sandgate_token=tok123"});
  const int32_t stream = client.submit(fields);
  ASSERT_EQ(stream, 1);
  const std::string bytes = client.take_output();

  auto r = scan_in_every_split(bytes);
  ASSERT_TRUE(r.ok()) << r.message();
  ASSERT_TRUE(r->has_value());
  const H2Request& request = **r;
  EXPECT_EQ(request.stream_id, 1u);
  EXPECT_EQ(request.method, "GET");
  EXPECT_EQ(request.scheme, "https");
  EXPECT_EQ(request.authority, kAuthority);
  EXPECT_EQ(request.path, "/files?x=1");
  ASSERT_NE(field(request.headers, "authorization"), nullptr);
  EXPECT_EQ(*field(request.headers, "authorization"), "Bearer abc.def");
  // Crumbs joined into one field where the first crumb was (RFC 9113 §8.2.3).
  ASSERT_EQ(request.headers.size(), 4u);
  EXPECT_EQ(request.headers[2].name, "cookie");
  EXPECT_EQ(request.headers[2].value, "theme=dark; __Host-sandgate_token=tok123");

  // The decoded request feeds edge authentication directly.
  auto credentials = find_credentials(request.path, request.headers);
  ASSERT_EQ(credentials.size(), 2u);
  EXPECT_EQ(credentials[0].source, CredentialSource::kAuthorizationHeader);
  EXPECT_EQ(credentials[1].token, "tok123");
}

TEST(H2Head, BodyAndLaterRequestsAreNotPartOfTheScan) {
  Nghttp2Session client(Nghttp2Session::Role::kClient, kClientSettings);
  BodySource body{"name=value&x=y", {}};
  std::vector<HttpHeader> post = get_request("/submit");
  post[0].value = "POST";
  ASSERT_EQ(client.submit(post, &body), 1);
  std::vector<HttpHeader> other = get_request("/other");
  other[2].value = "8080-other.sandbox.localhost";
  ASSERT_EQ(client.submit(other), 3);
  const std::string bytes = client.take_output();

  auto r = scan_in_every_split(bytes);
  ASSERT_TRUE(r.ok()) << r.message();
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->stream_id, 1u);
  EXPECT_EQ((*r)->method, "POST");
  EXPECT_EQ((*r)->authority, kAuthority);  // the connection is routed by its first request only
}

TEST(H2Head, LargeHeaderBlockInContinuationFromARealClient) {
  Nghttp2Session client(Nghttp2Session::Role::kClient, kClientSettings);
  std::vector<HttpHeader> fields = get_request();
  fields.push_back({"x-large", std::string(40000, 'v')});
  ASSERT_EQ(client.submit(fields), 1);
  const std::string bytes = client.take_output();

  H2ScanLimits roomy;
  roomy.max_header_list_bytes = 64 * 1024;
  auto r = scan_once(bytes, roomy);
  ASSERT_TRUE(r.ok()) << r.message();
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ(field((*r)->headers, "x-large")->size(), 40000u);

  // The same request is refused under the default 16 KiB header list limit.
  auto limited = scan_once(bytes);
  ASSERT_FALSE(limited.ok());
  EXPECT_EQ(limited.error(), Error::kLimitExceeded);
}

TEST(H2Head, PaddingPriorityAndContinuationByHand) {
  std::vector<HttpHeader> fields = get_request("/padded");
  fields.push_back({"authorization", "Bearer t0k"});
  const std::string block = hpack(fields);
  ASSERT_GT(block.size(), 10u);
  std::string headers_payload;
  headers_payload.push_back(7);                         // pad length
  headers_payload.append("\x80\x00\x00\x03\x10", 5);    // exclusive dependency on stream 3, weight 17
  headers_payload.append(block.substr(0, 4));
  headers_payload.append(7, '\0');
  const std::string bytes =
      std::string(kPreface) + settings_frame() +
      frame(NGHTTP2_PRIORITY, 0, 3, std::string("\x00\x00\x00\x00\x0f", 5)) +  // a placeholder stream
      frame(0xfa, 0x3, 0, "unknown extension frame") +
      frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_PRIORITY | NGHTTP2_FLAG_END_STREAM, 5,
            headers_payload) +
      frame(NGHTTP2_CONTINUATION, 0, 5, block.substr(4, 3)) + frame(NGHTTP2_CONTINUATION, 0, 5, "") +
      frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 5, block.substr(7));

  auto r = scan_in_every_split(bytes);
  ASSERT_TRUE(r.ok()) << r.message();
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->stream_id, 5u);
  EXPECT_EQ((*r)->path, "/padded");
  EXPECT_EQ(*field((*r)->headers, "authorization"), "Bearer t0k");
}

TEST(H2Head, TruncatedInputNeedsMoreBytes) {
  const std::string bytes = request_bytes(get_request());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = scan_once(bytes.substr(0, n));
    ASSERT_TRUE(r.ok()) << n << ": " << r.message();
    EXPECT_FALSE(r->has_value()) << n;
  }
}

// A connection error: the scan fails, no stream is named, and the GOAWAY code fits the failure.
void expect_error(std::string_view bytes, Error code, std::string_view message_part,
                  std::optional<H2ErrorCode> goaway = std::nullopt) {
  H2RequestScanner scanner;
  auto r = scanner.scan(bytes);
  ASSERT_FALSE(r.ok()) << "accepted: " << message_part;
  EXPECT_EQ(r.error(), code) << r.message();
  EXPECT_NE(r.message().find(message_part), std::string::npos) << r.message();
  EXPECT_EQ(scanner.malformed_stream(), 0u) << message_part << ": " << r.message();
  const H2ErrorCode expected = goaway ? *goaway
                               : code == Error::kLimitExceeded ? H2ErrorCode::kEnhanceYourCalm
                                                                : H2ErrorCode::kProtocolError;
  EXPECT_EQ(scanner.goaway_code(), expected) << message_part << ": " << r.message();
}

// A malformed request: an error of its stream only, which the scanner names (RFC 9113 §8.1.1).
void expect_malformed(std::string_view bytes, std::string_view message_part, uint32_t stream = 1) {
  H2RequestScanner scanner;
  auto r = scanner.scan(bytes);
  ASSERT_FALSE(r.ok()) << "accepted: " << message_part;
  EXPECT_EQ(r.error(), Error::kInvalidArgument) << r.message();
  EXPECT_NE(r.message().find(message_part), std::string::npos) << r.message();
  EXPECT_EQ(scanner.malformed_stream(), stream) << message_part << ": " << r.message();
}

TEST(H2Head, NotAnHttp2Preface) {
  expect_error("GET / HTTP/1.1\r\nHost: 8080-demo.sandbox.localhost\r\n\r\n", Error::kInvalidArgument, "HTTP/1");
  expect_error("G", Error::kInvalidArgument, "preface");
  expect_error(std::string("\x16\x03\x01\x02\x00", 5), Error::kInvalidArgument, "preface");
  expect_error("PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", Error::kInvalidArgument, "preface");
  auto partial = scan_once("PRI * HTTP/2");
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(partial->has_value());
}

TEST(H2Head, FramingErrors) {
  const std::string preface(kPreface);
  const std::string block = hpack(get_request());
  const auto headers = [&](uint8_t flags, uint32_t stream) { return frame(NGHTTP2_HEADERS, flags, stream, block); };

  expect_error(preface + frame(NGHTTP2_PING, 0, 0, "12345678"), Error::kInvalidArgument, "not SETTINGS");
  expect_error(preface + headers(NGHTTP2_FLAG_END_HEADERS, 1), Error::kInvalidArgument, "not SETTINGS");
  expect_error(preface + frame(NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, ""), Error::kInvalidArgument, "not SETTINGS");
  expect_error(preface + frame(NGHTTP2_SETTINGS, 0, 0, "12345"), Error::kInvalidArgument, "multiple of 6");
  expect_error(preface + frame(NGHTTP2_SETTINGS, 0, 1, ""), Error::kInvalidArgument, "SETTINGS on a stream");
  // Oversized frames are refused from their header alone, before their payload arrives.
  expect_error(preface + std::string("\x00\x40\x01\x04\x00\x00\x00\x00\x00", 9), Error::kInvalidArgument,
               "maximum frame size");
  const std::string s = preface + settings_frame();
  expect_error(s + headers(NGHTTP2_FLAG_END_HEADERS, 0), Error::kInvalidArgument, "stream 0");
  expect_error(s + headers(NGHTTP2_FLAG_END_HEADERS, 2), Error::kInvalidArgument, "stream 2");
  expect_error(s + headers(0, 1) + frame(NGHTTP2_PING, 0, 0, "12345678"), Error::kInvalidArgument,
               "inside the header block");
  expect_error(s + headers(0, 1) + frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 3, ""),
               Error::kInvalidArgument, "inside the header block");
  expect_error(s + headers(0, 1) + headers(NGHTTP2_FLAG_END_HEADERS, 3), Error::kInvalidArgument,
               "inside the header block");
  expect_error(s + frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, block), Error::kInvalidArgument,
               "CONTINUATION without");
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_END_HEADERS, 1, "\xc8" + block),
               Error::kInvalidArgument, "padding");
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_END_HEADERS, 1, ""),
               Error::kInvalidArgument, "pad length");
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PRIORITY | NGHTTP2_FLAG_END_HEADERS, 1, "\x01\x02"),
               Error::kInvalidArgument, "priority");
  expect_error(s + frame(NGHTTP2_DATA, 0, 1, "body"), Error::kInvalidArgument, "DATA frame before");
  expect_error(s + frame(NGHTTP2_RST_STREAM, 0, 1, "\0\0\0\0"), Error::kInvalidArgument, "RST_STREAM");
  expect_error(s + frame(NGHTTP2_GOAWAY, 0, 0, std::string(8, '\0')), Error::kInvalidArgument, "GOAWAY");
  expect_error(s + frame(NGHTTP2_PUSH_PROMISE, 0, 1, std::string(4, '\0')), Error::kInvalidArgument, "PUSH_PROMISE");
  expect_error(s + frame(NGHTTP2_PING, 0, 0, "1234"), Error::kInvalidArgument, "PING");
  expect_error(s + frame(NGHTTP2_WINDOW_UPDATE, 0, 0, "12"), Error::kInvalidArgument, "WINDOW_UPDATE");
  expect_error(s + frame(NGHTTP2_PRIORITY, 0, 0, "12345"), Error::kInvalidArgument, "PRIORITY");
  // HPACK failures are COMPRESSION_ERROR (RFC 9113 §4.3), even after a field that already made the request
  // malformed: the block cannot be trusted, so neither can anything the stream's 400 would be based on.
  constexpr H2ErrorCode kHpack = H2ErrorCode::kCompressionError;
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, "\x80"), Error::kInvalidArgument, "HPACK", kHpack);
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, "\xff\xff\xff\xff\xff\xff"),
               Error::kInvalidArgument, "HPACK", kHpack);
  const std::string literal = hpack({{"x-literal", "abcdefgh"}});
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, block + literal.substr(0, literal.size() - 3)),
               Error::kInvalidArgument, "HPACK", kHpack);
  const std::string uppercase = hpack({{"X-Upper", "1"}});
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, uppercase + block + "\x80"),
               Error::kInvalidArgument, "HPACK", kHpack);
}

TEST(H2Head, MalformedRequests) {
  auto without = [](std::string_view name) {
    std::vector<HttpHeader> fields = get_request();
    std::erase_if(fields, [&](const HttpHeader& f) { return f.name == name; });
    return fields;
  };
  auto with = [](std::vector<HttpHeader> extra) {
    std::vector<HttpHeader> fields = get_request();
    fields.insert(fields.end(), extra.begin(), extra.end());
    return fields;
  };
  expect_malformed(request_bytes(without(":method")), "no :method");
  expect_malformed(request_bytes(without(":path")), "no :path");
  expect_malformed(request_bytes(without(":scheme")), "no :scheme");
  expect_malformed(request_bytes(without(":authority")), "no :authority");
  std::vector<HttpHeader> host_instead = without(":authority");
  host_instead.push_back({"host", std::string(kAuthority)});
  expect_malformed(request_bytes(host_instead), "Host, not :authority");
  expect_malformed(request_bytes(with({{"host", "8080-other.sandbox.localhost"}})), "Host differs");
  expect_malformed(request_bytes(with({{"X-Token", "a"}})), "uppercase");
  expect_malformed(request_bytes(with({{"x token", "a"}})), "forbids");
  expect_malformed(request_bytes(with({{"x-a", "a\r\nx-b: b"}})), "CR or LF");
  expect_malformed(request_bytes(with({{"x-a", std::string("a\0b", 3)}})), "NUL");
  expect_malformed(request_bytes(with({{"authorization", "Bearer t "}})), "whitespace");
  expect_malformed(request_bytes(with({{"connection", "keep-alive"}})), "connection-specific");
  expect_malformed(request_bytes(with({{"transfer-encoding", "chunked"}})), "connection-specific");
  expect_malformed(request_bytes(with({{"te", "gzip"}})), "te may only");
  expect_malformed(request_bytes(with({{"accept", "*/*"}, {":path", "/again"}})), "after a regular");
  std::vector<HttpHeader> duplicate = get_request();
  duplicate.insert(duplicate.begin(), {":authority", "8080-other.sandbox.localhost"});
  expect_malformed(request_bytes(duplicate), "duplicate :authority");
  std::vector<HttpHeader> status = get_request();
  status.insert(status.begin(), {":status", "200"});
  expect_malformed(request_bytes(status), ":status is not allowed");
  std::vector<HttpHeader> protocol = get_request();
  protocol.insert(protocol.begin(), {":protocol", "websocket"});
  expect_malformed(request_bytes(protocol), ":protocol is only allowed in an extended CONNECT");
  // A plain CONNECT (a tunnel to :authority) is still not served, now on its stream.
  expect_malformed(request_bytes({{":method", "CONNECT"}, {":authority", std::string(kAuthority)}}),
                   "CONNECT requests are not served");
  expect_malformed(request_bytes(get_request("relative")), "must start with '/'");
  expect_malformed(request_bytes(get_request("")), ":path is empty");
  std::vector<HttpHeader> bad_method = get_request();
  bad_method[0].value = "GE T";
  expect_malformed(request_bytes(bad_method), ":method");

  // What is allowed: a Host naming the same host (any case), te: trailers, OPTIONS *.
  auto ok = scan_once(request_bytes(with({{"host", "8080-DEMO.sandbox.localhost"}, {"te", "trailers"}})));
  ASSERT_TRUE(ok.ok()) << ok.message();
  EXPECT_TRUE(ok->has_value());
  std::vector<HttpHeader> options = get_request("*");
  options[0].value = "OPTIONS";
  auto star = scan_once(request_bytes(options));
  ASSERT_TRUE(star.ok()) << star.message();
  EXPECT_TRUE(star->has_value());
}

std::vector<HttpHeader> extended_connect(std::string path = "/chat") {
  return {{":method", "CONNECT"},
          {":protocol", "websocket"},
          {":scheme", "https"},
          {":authority", std::string(kAuthority)},
          {":path", std::move(path)},
          {"sec-websocket-version", "13"},
          {"authorization", "Bearer abc.def"}};
}

// RFC 8441: a CONNECT with :protocol (WebSockets over HTTP/2) is a request like any other: routed on
// :authority, its credential found like any request's. Whether the sandbox offers it is the sandbox's call.
TEST(H2Head, ExtendedConnectIsARequest) {
  auto r = scan_in_every_split(request_bytes(extended_connect()));
  ASSERT_TRUE(r.ok()) << r.message();
  ASSERT_TRUE(r->has_value());
  const H2Request& request = **r;
  EXPECT_EQ(request.method, "CONNECT");
  EXPECT_EQ(request.protocol, "websocket");
  EXPECT_EQ(request.scheme, "https");
  EXPECT_EQ(request.authority, kAuthority);
  EXPECT_EQ(request.path, "/chat");
  ASSERT_EQ(request.headers.size(), 2u);
  auto credentials = find_credentials(request.path, request.headers);
  ASSERT_EQ(credentials.size(), 1u);
  EXPECT_EQ(credentials[0].token, "abc.def");

  // Every other request has no :protocol.
  auto plain = scan_once(request_bytes(get_request()));
  ASSERT_TRUE(plain.ok()) << plain.message();
  ASSERT_TRUE(plain->has_value());
  EXPECT_EQ((*plain)->protocol, "");
}

TEST(H2Head, MalformedExtendedConnect) {
  auto without = [](std::string_view name) {
    std::vector<HttpHeader> fields = extended_connect();
    std::erase_if(fields, [&](const HttpHeader& f) { return f.name == name; });
    return fields;
  };
  // RFC 8441 §4: :scheme and :path are required; :authority as for every request here.
  expect_malformed(request_bytes(without(":path")), "no :path");
  expect_malformed(request_bytes(without(":scheme")), "no :scheme");
  expect_malformed(request_bytes(without(":authority")), "no :authority");
  expect_malformed(request_bytes(extended_connect("chat")), "must start with '/'");
  std::vector<HttpHeader> twice = extended_connect();
  twice.insert(twice.begin() + 1, {":protocol", "h2c"});
  expect_malformed(request_bytes(twice), "duplicate :protocol");
  std::vector<HttpHeader> not_a_token = extended_connect();
  not_a_token[1].value = "web socket";
  expect_malformed(request_bytes(not_a_token), ":protocol is not a token");
  std::vector<HttpHeader> empty = extended_connect();
  empty[1].value = "";
  expect_malformed(request_bytes(empty), ":protocol is empty");
  std::vector<HttpHeader> post = extended_connect();
  post[0].value = "POST";
  expect_malformed(request_bytes(post), ":protocol is only allowed in an extended CONNECT");
  std::vector<HttpHeader> late = without(":protocol");
  late.push_back({":protocol", "websocket"});
  expect_malformed(request_bytes(late), "after a regular");
}

// The first request of a connection malformed (a trailing space in Authorization, RFC 9113 §8.2.1): the
// scanner names its stream, and the proxy's 400 on it is a response a real client reads, followed by a
// graceful GOAWAY, instead of a connection error.
// Lets `client` parse `answer` (an h2_refusal): a complete response with `status` and `body` on `stream`, then
// a graceful GOAWAY naming that stream, and nothing the client would complain about.
void expect_complete_answer(Nghttp2Session& client, int32_t stream, const std::string& answer, int status,
                            std::string_view body) {
  // nghttp2 accepts every byte: a protocol error would make it return a negative value.
  ASSERT_EQ(client.receive(answer), static_cast<ssize_t>(answer.size()));
  const Nghttp2Session::Stream& response = client.streams[stream];
  ASSERT_NE(field(response.headers, ":status"), nullptr);
  EXPECT_EQ(*field(response.headers, ":status"), std::to_string(status));
  EXPECT_EQ(*field(response.headers, "content-length"), std::to_string(body.size()));
  EXPECT_EQ(response.data, body);
  EXPECT_TRUE(response.closed);
  EXPECT_EQ(response.close_error, 0u);
  EXPECT_TRUE(client.goaway);
  EXPECT_EQ(client.goaway_last_stream, stream);
  EXPECT_EQ(client.goaway_error, static_cast<uint32_t>(NGHTTP2_NO_ERROR));
  // No RST_STREAM, no GOAWAY from the client: at most it acknowledges SETTINGS.
  const std::string reply = client.take_output();
  EXPECT_TRUE(reply.empty() || reply == frame(NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, "")) << reply.size();
}

TEST(H2Head, MalformedFirstRequestGetsA400ARealClientReads) {
  Nghttp2Session client(Nghttp2Session::Role::kClient, kClientSettings);
  std::vector<HttpHeader> fields = get_request("/private");
  fields.push_back({"authorization", "Bearer "});
  const int32_t stream = client.submit(fields);
  ASSERT_EQ(stream, 1);

  H2RequestScanner scanner;
  auto r = scanner.scan(client.take_output());
  ASSERT_FALSE(r.ok());
  ASSERT_EQ(scanner.malformed_stream(), 1u) << r.message();
  EXPECT_NE(r.message().find("'authorization' starts or ends with whitespace"), std::string::npos) << r.message();

  const std::string body = r.message() + "\n";
  auto answer = h2_refusal(scanner.malformed_stream(), 400, "text/plain; charset=utf-8", body, {});
  ASSERT_TRUE(answer.ok()) << answer.message();
  expect_complete_answer(client, stream, *answer, 400, body);
}

TEST(H2Head, HeaderListBombIsStoppedWhileDecoding) {
  // One 4000-byte field added to the dynamic table, then ~3000 one-byte references to it: a 4 KiB block
  // that decodes to 12 MB.
  std::string block;
  block.push_back('\x40');  // literal with incremental indexing, new name
  block.push_back('\x01');
  block.push_back('x');
  block.append("\x7f\xa1\x1e");  // value length 127 + 3873 = 4000
  block.append(4000, 'v');
  block.append(3000, '\xbe');  // indexed field 62: the newest dynamic entry
  ASSERT_LE(block.size(), 16384u);
  const std::string bytes = std::string(kPreface) + settings_frame() +
                            frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hpack(get_request()) + block);
  expect_error(bytes, Error::kLimitExceeded, "header list exceeds");
}

TEST(H2Head, ByteBudgetBeforeTheRequest) {
  std::string bytes = std::string(kPreface) + settings_frame();
  while (bytes.size() < 70 * 1024) bytes += frame(NGHTTP2_PING, 0, 0, "12345678");
  expect_error(bytes, Error::kLimitExceeded, "no complete request within");

  // A header block that cannot end within the budget is refused before its last frame arrives.
  H2ScanLimits small;
  small.max_bytes_before_request = 1000;
  std::string big = std::string(kPreface) + settings_frame() +
                    frame(NGHTTP2_HEADERS, 0, 1, hpack(get_request())) +
                    frame(NGHTTP2_CONTINUATION, 0, 1, std::string(990, '\x80'));
  auto r = scan_once(big.substr(0, 150), small);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kLimitExceeded);

  // A request that completes within the budget is fine even if more bytes follow it.
  std::string followed = request_bytes(get_request());
  while (followed.size() < 70 * 1024) followed += frame(NGHTTP2_PING, 0, 0, "12345678");
  auto fine = scan_once(followed);
  ASSERT_TRUE(fine.ok()) << fine.message();
  EXPECT_TRUE(fine->has_value());
}

TEST(H2Head, ReceivedBytesMustOnlyGrow) {
  H2RequestScanner scanner;
  const std::string bytes = request_bytes(get_request());
  auto first = scanner.scan(bytes.substr(0, 40));
  ASSERT_TRUE(first.ok());
  auto shrunk = scanner.scan(bytes.substr(0, 10));
  ASSERT_FALSE(shrunk.ok());
  EXPECT_EQ(shrunk.error(), Error::kInternal);
}

// Scans the client's bytes, answers with h2_refusal, and lets the client parse the answer.
void refuse_and_check(int status, std::string_view body, const std::vector<HttpHeader>& extra) {
  Nghttp2Session client(Nghttp2Session::Role::kClient, kClientSettings);
  std::vector<HttpHeader> fields = get_request("/private?sandgate_token=abc");
  const int32_t stream = client.submit(fields);
  auto scan = scan_once(client.take_output());
  ASSERT_TRUE(scan.ok()) << scan.message();
  ASSERT_TRUE(scan->has_value());
  ASSERT_EQ((*scan)->stream_id, static_cast<uint32_t>(stream));

  auto refusal = h2_refusal((*scan)->stream_id, status, "text/plain; charset=utf-8", body, extra);
  ASSERT_TRUE(refusal.ok()) << refusal.message();
  expect_complete_answer(client, stream, *refusal, status, body);
  const Nghttp2Session::Stream& response = client.streams[stream];
  EXPECT_EQ(*field(response.headers, "cache-control"), "no-store");
  EXPECT_EQ(*field(response.headers, "strict-transport-security"), "max-age=31536000");
  for (const HttpHeader& h : extra) {
    std::string name = h.name;
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    ASSERT_NE(field(response.headers, name), nullptr) << name;
    EXPECT_EQ(*field(response.headers, name), h.value);
  }
}

TEST(H2Head, RefusalIsUnderstoodByARealClient) {
  refuse_and_check(401, "missing or invalid sandgate token\n", {{"WWW-Authenticate", std::string(kBearerChallenge)}});
}

TEST(H2Head, RedirectWithCookieAndNoBody) {
  refuse_and_check(302, "",
                   {{"location", "https://8080-demo.sandbox.localhost/private"},
                    {"set-cookie", token_cookie("abc", 86400)}});
}

TEST(H2Head, LargeRefusalIsSplitIntoFrames) {
  refuse_and_check(403, std::string(40000, 'b'), {{"x-filler", std::string(20000, 'h')}});
}

TEST(H2Head, RefusalRejectsWhatHttp2CannotCarry) {
  const HttpHeader injected[] = {{"location", "/a\r\nset-cookie: x=y"}};
  EXPECT_FALSE(h2_refusal(1, 302, "text/plain", "", injected).ok());
  const HttpHeader connection[] = {{"Connection", "close"}};
  EXPECT_FALSE(h2_refusal(1, 400, "text/plain", "", connection).ok());
  const HttpHeader bad_name[] = {{"x y", "1"}};
  EXPECT_FALSE(h2_refusal(1, 400, "text/plain", "", bad_name).ok());
  EXPECT_FALSE(h2_refusal(1, 400, "text/plain\r\nx: y", "", {}).ok());
  EXPECT_FALSE(h2_refusal(2, 400, "text/plain", "", {}).ok());
  EXPECT_FALSE(h2_refusal(0, 400, "text/plain", "", {}).ok());
  EXPECT_FALSE(h2_refusal(1, 99, "text/plain", "", {}).ok());
  EXPECT_FALSE(h2_refusal(1, 600, "text/plain", "", {}).ok());
}

TEST(H2Head, GoawayForAnUnscannableConnection) {
  Nghttp2Session client(Nghttp2Session::Role::kClient, kClientSettings);
  client.take_output();
  const std::string goaway = h2_goaway(H2ErrorCode::kProtocolError, "HTTP/2: not an HTTP/2 connection preface");
  ASSERT_EQ(client.receive(goaway), static_cast<ssize_t>(goaway.size()));
  EXPECT_TRUE(client.goaway);
  EXPECT_EQ(client.goaway_last_stream, 0);
  EXPECT_EQ(client.goaway_error, static_cast<uint32_t>(NGHTTP2_PROTOCOL_ERROR));
  EXPECT_EQ(client.goaway_debug, "HTTP/2: not an HTTP/2 connection preface");

  Nghttp2Session calm(Nghttp2Session::Role::kClient, kClientSettings);
  calm.take_output();
  const std::string long_debug = h2_goaway(H2ErrorCode::kEnhanceYourCalm, std::string(5000, 'd'));
  ASSERT_EQ(calm.receive(long_debug), static_cast<ssize_t>(long_debug.size()));
  EXPECT_EQ(calm.goaway_error, static_cast<uint32_t>(NGHTTP2_ENHANCE_YOUR_CALM));
  EXPECT_EQ(calm.goaway_debug.size(), 1024u);
}

TEST(H2Head, FuzzedInputNeverCrashes) {
  // Seeds: a real client's bytes and the hand-built padded/CONTINUATION request.
  Nghttp2Session client(Nghttp2Session::Role::kClient, kClientSettings);
  std::vector<HttpHeader> fields = get_request("/fuzz?sandgate_token=abc");
  fields.push_back({"cookie", "a=b"});
  fields.push_back({"cookie", "__Host-sandgate_token=xyz"});
  client.submit(fields);
  const std::string block = hpack(get_request());
  const std::vector<std::string> seeds = {
      client.take_output(),
      std::string(kPreface) + settings_frame() +
          frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_PRIORITY, 1,
                std::string("\x02\x00\x00\x00\x00\x10", 6) + block.substr(0, 5) + "\0\0") +
          frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, block.substr(5)),
  };
  std::mt19937 rng(20240605);
  auto pick = [&](size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  size_t requests = 0, errors = 0;
  for (int iteration = 0; iteration < 20000; ++iteration) {
    std::string input = mutate(rng, seeds[pick(seeds.size())], /*duplicate_slices=*/false);
    // Sometimes keep the preface intact so the mutations reach the frames and HPACK.
    if (pick(2) == 0 && input.size() >= kPreface.size()) input.replace(0, kPreface.size(), kPreface);
    H2RequestScanner scanner;
    const size_t split = pick(input.size() + 1);
    auto r = scanner.scan(std::string_view(input).substr(0, split));
    if (r.ok() && !r->has_value()) r = scanner.scan(input);
    if (!r.ok()) ++errors;
    else if (r->has_value()) ++requests;
  }
  // The loop exercised both outcomes, not just the preface check.
  EXPECT_GT(requests, 0u);
  EXPECT_GT(errors, 0u);
}

}  // namespace
}  // namespace sg
