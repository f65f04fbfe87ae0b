#include "proxy/h2_filter.h"

#include <gtest/gtest.h>
#include <nghttp2/nghttp2.h>

#include <algorithm>
#include <functional>
#include <map>
#include <random>

#include "tests/unit/proxy/nghttp2_test_session.h"

namespace sg {
namespace {

using namespace test_support;  // NOLINT(google-build-using-namespace)
using Session = Nghttp2Session;

constexpr std::string_view kDemo = "8080-demo.sandbox.localhost";
constexpr std::string_view kOther = "8080-other.sandbox.localhost";

std::vector<HttpHeader> request_fields(std::string_view authority, std::string path = "/", std::string method = "GET") {
  return {{":method", std::move(method)},
          {":scheme", "https"},
          {":authority", std::string(authority)},
          {":path", std::move(path)}};
}

// What a browser repeats on every request: long values the client's encoder keeps in its dynamic table.
std::vector<HttpHeader> browser_request(std::string_view authority, std::string path = "/") {
  std::vector<HttpHeader> fields = request_fields(authority, std::move(path));
  fields.push_back({"user-agent", "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/126"});
  fields.push_back({"accept-language", "en-GB,en;q=0.9,de;q=0.8,fr;q=0.7"});
  fields.push_back({"x-client-trace", "trace-0123456789abcdef0123456789abcdef"});
  fields.push_back({"cookie", "theme=dark"});
  fields.push_back({"cookie", "__Host-sandgate_token=tok-secret-0123456789"});
  fields.push_back({"authorization", "Bearer tok-secret-0123456789"});
  return fields;
}

// Client <-> H2ClientFilter / H2ServerFrames <-> server, all in memory.
class Link {
 public:
  explicit Link(H2FilterLimits limits = {}, std::vector<nghttp2_settings_entry> server_settings = {})
      : server(Session::Role::kServer, std::move(server_settings)),
        filter(limits, [this](H2Request& r) {
          requests.push_back(r);
          return policy(r);
        }) {}

  // Moves bytes both ways until nothing moves any more.
  void pump() {
    for (int round = 0; round < 200; ++round) {
      const std::string from_client = client.take_output();
      std::string to_sandbox, to_client;
      if (!from_client.empty()) {
        Status s = filter.feed(from_client, to_sandbox, to_client);
        ASSERT_TRUE(s.ok()) << s.message();
        ASSERT_TRUE(frames.inject(to_client).ok());
        sent_to_sandbox += to_sandbox;
      }
      if (!to_sandbox.empty()) {
        ASSERT_EQ(server.receive(to_sandbox), static_cast<ssize_t>(to_sandbox.size()));
      }
      const std::string from_server = server.take_output();
      std::string out;
      auto announced = frames.feed(from_server, out);
      ASSERT_TRUE(announced.ok()) << announced.message();
      if (*announced) filter.set_sandbox_header_table_size(**announced);
      if (auto enabled = frames.extended_connect()) filter.set_sandbox_extended_connect(*enabled);
      if (!out.empty()) {
        ASSERT_EQ(client.receive(out), static_cast<ssize_t>(out.size()));
      }
      if (from_client.empty() && from_server.empty() && out.empty()) return;
    }
    FAIL() << "the link never went quiet";
  }

  Session client{Session::Role::kClient};
  Session server;
  std::vector<H2Request> requests;  // as the callback received them
  std::function<H2Verdict(H2Request&)> policy = [](H2Request&) { return H2Verdict{}; };
  H2ClientFilter filter;
  H2ServerFrames frames;
  std::string sent_to_sandbox;
};

// Refuses every request that does not name the demo sandbox, as the connection does for coalesced hosts.
H2Verdict demo_only(H2Request& r) { return H2Verdict{r.authority == kDemo ? 0 : 421}; }

void expect_served(Session& client, int32_t stream, std::string_view path) {
  const Session::Stream& s = client.streams[stream];
  // Every field exactly as the server sent it: a proxy frame that touched the client's HPACK table would show
  // here as a wrong field (the server's later responses refer to its dynamic table).
  ASSERT_EQ(s.headers.size(), kResponseFields.size()) << "stream " << stream;
  for (size_t i = 0; i < kResponseFields.size(); ++i) {
    EXPECT_EQ(s.headers[i].name, kResponseFields[i].name) << "stream " << stream;
    EXPECT_EQ(s.headers[i].value, kResponseFields[i].value) << "stream " << stream;
  }
  EXPECT_EQ(s.data, "served " + std::string(path));
  EXPECT_TRUE(s.closed);
  EXPECT_EQ(s.close_error, 0u);
}

void expect_refused(Session& client, int32_t stream, std::string_view status) {
  const Session::Stream& s = client.streams[stream];
  ASSERT_EQ(s.headers.size(), 3u) << "stream " << stream;
  EXPECT_EQ(s.headers[0].name, ":status");
  EXPECT_EQ(s.headers[0].value, status);
  EXPECT_EQ(*field(s.headers, "content-length"), "0");
  EXPECT_EQ(*field(s.headers, "server"), "sandgate");
  EXPECT_TRUE(s.data.empty());
  EXPECT_TRUE(s.end_stream);
  EXPECT_TRUE(s.closed);
  EXPECT_EQ(s.close_error, 0u);
}

// --- hand-built input ---

std::string u32(uint32_t v) {
  std::string out;
  for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>(v >> shift));
  return out;
}
std::string setting(uint16_t id, uint32_t value) {
  return std::string{static_cast<char>(id >> 8), static_cast<char>(id)} + u32(value);
}

// A client-side HPACK encoder whose dynamic table persists across blocks, like a real client's.
class Hpack {
 public:
  explicit Hpack(size_t max_table = 4096) { nghttp2_hd_deflate_new(&deflater_, max_table); }
  ~Hpack() { nghttp2_hd_deflate_del(deflater_); }
  Hpack(const Hpack&) = delete;
  Hpack& operator=(const Hpack&) = delete;
  nghttp2_hd_deflater* get() { return deflater_; }
  std::string encode(const std::vector<HttpHeader>& fields) {
    std::vector<nghttp2_nv> nva = to_nva(fields);
    std::string block(nghttp2_hd_deflate_bound(deflater_, nva.data(), nva.size()), '\0');
    const ssize_t n = nghttp2_hd_deflate_hd(deflater_, bytes_of(block), block.size(), nva.data(), nva.size());
    EXPECT_GE(n, 0);
    block.resize(static_cast<size_t>(std::max<ssize_t>(n, 0)));
    return block;
  }

 private:
  nghttp2_hd_deflater* deflater_ = nullptr;
};

struct Fed {
  Status status;
  std::string to_sandbox;
  std::string to_client;
};

Fed feed_once(H2ClientFilter& filter, std::string_view bytes) {
  Fed fed;
  fed.status = filter.feed(bytes, fed.to_sandbox, fed.to_client);
  return fed;
}

Fed feed_bytewise(H2ClientFilter& filter, std::string_view bytes) {
  Fed fed;
  for (char c : bytes) {
    fed.status = filter.feed(std::string_view(&c, 1), fed.to_sandbox, fed.to_client);
    if (!fed.status) break;
  }
  return fed;
}

H2ClientFilter forward_all(H2FilterLimits limits = {}) {
  return H2ClientFilter(limits, [](H2Request&) { return H2Verdict{}; });
}

struct Frame {
  nghttp2_frame_hd hd{};
  std::string payload;
};

// Splits well-formed frame bytes (after an optional preface) into frames.
std::vector<Frame> parse_frames(std::string_view bytes) {
  if (bytes.substr(0, kPreface.size()) == kPreface) bytes.remove_prefix(kPreface.size());
  std::vector<Frame> frames;
  while (bytes.size() >= 9) {
    Frame f;
    f.hd.length = (size_t{static_cast<uint8_t>(bytes[0])} << 16) | (size_t{static_cast<uint8_t>(bytes[1])} << 8) |
                  static_cast<uint8_t>(bytes[2]);
    f.hd.type = static_cast<uint8_t>(bytes[3]);
    f.hd.flags = static_cast<uint8_t>(bytes[4]);
    f.hd.stream_id = static_cast<int32_t>(
        ((uint32_t{static_cast<uint8_t>(bytes[5])} << 24) | (uint32_t{static_cast<uint8_t>(bytes[6])} << 16) |
         (uint32_t{static_cast<uint8_t>(bytes[7])} << 8) | static_cast<uint8_t>(bytes[8])) & 0x7fffffff);
    EXPECT_GE(bytes.size(), 9 + f.hd.length);
    f.payload = std::string(bytes.substr(9, f.hd.length));
    bytes.remove_prefix(std::min(bytes.size(), 9 + f.hd.length));
    frames.push_back(std::move(f));
  }
  EXPECT_TRUE(bytes.empty());
  return frames;
}

// ============================ H2ClientFilter through real sessions ============================

TEST(H2Filter, TwoRequestsForTheSameSandboxAreBothForwarded) {
  Link link;
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/one")), 1);
  link.pump();
  // The same long fields again: the client's encoder now sends them as dynamic table references.
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/two")), 3);
  BodySource body{"name=value&x=y", {}};
  std::vector<HttpHeader> post = browser_request(kDemo, "/three");
  post[0].value = "POST";
  ASSERT_EQ(link.client.submit(post, &body), 5);
  link.pump();

  ASSERT_EQ(link.requests.size(), 3u);
  for (int32_t stream : {1, 3, 5}) {
    const Session::Stream& seen = link.server.streams[stream];
    const std::vector<HttpHeader> sent = stream == 5 ? post : browser_request(kDemo, stream == 1 ? "/one" : "/two");
    ASSERT_EQ(seen.headers.size(), 9u) << stream;
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(seen.headers[i].value, sent[i].value) << stream << " " << sent[i].name;
    EXPECT_EQ(*field(seen.headers, "user-agent"), sent[4].value);
    EXPECT_EQ(*field(seen.headers, "x-client-trace"), sent[6].value);
    // Crumbs arrive joined into one field (RFC 9113 §8.2.3 allows either).
    EXPECT_EQ(*field(seen.headers, "cookie"), "theme=dark; __Host-sandgate_token=tok-secret-0123456789");
    EXPECT_TRUE(seen.end_stream);
  }
  EXPECT_EQ(link.server.streams[5].data, "name=value&x=y");
  expect_served(link.client, 1, "/one");
  expect_served(link.client, 3, "/two");
  expect_served(link.client, 5, "/three");
  EXPECT_FALSE(link.client.goaway);
  EXPECT_FALSE(link.server.goaway);
  EXPECT_EQ(nghttp2_session_get_hd_inflate_dynamic_table_size(link.server.get()), 0u);
}

TEST(H2Filter, ForwardedBlocksNeverUseTheSandboxTable) {
  // A sandbox that allows no HPACK table at all: the proxy's encoder (table size 0) never needed one.
  Link link({}, {{NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 0}});
  for (int32_t stream : {1, 3, 5}) {
    ASSERT_EQ(link.client.submit(browser_request(kDemo, "/r" + std::to_string(stream))), stream);
    link.pump();
    expect_served(link.client, stream, "/r" + std::to_string(stream));
    EXPECT_EQ(nghttp2_session_get_hd_inflate_dynamic_table_size(link.server.get()), 0u);
  }
  EXPECT_FALSE(link.server.goaway);
  EXPECT_FALSE(link.client.goaway);
}

TEST(H2Filter, RequestForAnotherSandboxIsRefusedWithoutReachingTheSandbox) {
  Link link;
  link.policy = demo_only;
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/first")), 1);
  link.pump();
  ASSERT_EQ(link.client.submit(browser_request(kOther, "/elsewhere")), 3);
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/after")), 5);
  link.pump();
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/later")), 7);
  link.pump();

  EXPECT_EQ(link.server.streams.count(3), 0u);
  for (int32_t stream : {1, 5, 7}) EXPECT_EQ(link.server.streams.count(stream), 1u) << stream;
  expect_refused(link.client, 3, "421");
  // The server's later responses still decode: the refusal left the client's HPACK table alone.
  expect_served(link.client, 1, "/first");
  expect_served(link.client, 5, "/after");
  expect_served(link.client, 7, "/later");
  EXPECT_FALSE(link.client.goaway);
  EXPECT_FALSE(link.server.goaway);
  EXPECT_EQ(link.sent_to_sandbox.find("8080-other"), std::string::npos);
}

TEST(H2Filter, RefusedFirstRequestWaitsForTheServerPreface) {
  Link link;
  link.policy = [](H2Request&) { return H2Verdict{404}; };
  ASSERT_EQ(link.client.submit(request_fields(kOther)), 1);
  link.pump();
  expect_refused(link.client, 1, "404");  // an indexed :status this time
  EXPECT_EQ(link.server.streams.count(1), 0u);
  EXPECT_FALSE(link.client.goaway);
}

TEST(H2Filter, CallbackRemovesCredentialsBeforeTheSandboxSeesThem) {
  Link link;
  link.policy = [](H2Request& r) {
    std::erase_if(r.headers, [](const HttpHeader& f) { return f.name == "authorization"; });
    for (HttpHeader& f : r.headers)
      if (f.name == "cookie") f.value = "theme=dark";  // the token crumb removed
    if (r.path.starts_with("/login")) r.path = "/";
    return H2Verdict{};
  };
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/login?sandgate_token=x")), 1);
  link.pump();
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/again")), 3);  // same fields, now table references
  link.pump();

  ASSERT_EQ(link.requests.size(), 2u);
  for (const H2Request& r : link.requests) ASSERT_NE(field(r.headers, "authorization"), nullptr);
  for (int32_t stream : {1, 3}) {
    const Session::Stream& seen = link.server.streams[stream];
    EXPECT_EQ(field(seen.headers, "authorization"), nullptr) << stream;
    ASSERT_NE(field(seen.headers, "cookie"), nullptr);
    EXPECT_EQ(*field(seen.headers, "cookie"), "theme=dark");
    for (const HttpHeader& h : seen.headers) EXPECT_EQ(h.value.find("tok-secret"), std::string::npos) << h.name;
  }
  EXPECT_EQ(*field(link.server.streams[1].headers, ":path"), "/");
  expect_served(link.client, 1, "/");
  expect_served(link.client, 3, "/again");
}

std::vector<HttpHeader> websocket_request(std::string_view authority, std::string path) {
  std::vector<HttpHeader> fields = request_fields(authority, std::move(path), "CONNECT");
  fields.insert(fields.begin() + 1, {":protocol", "websocket"});
  fields.push_back({"sec-websocket-version", "13"});
  fields.push_back({"authorization", "Bearer tok-secret-0123456789"});
  return fields;
}

// Extended CONNECT (RFC 8441, WebSockets over HTTP/2) to a sandbox that enables it: checked by the callback
// like any request (credential removed) and re-encoded with its :protocol, first request or later.
TEST(H2Filter, ExtendedConnectIsForwardedWithItsProtocol) {
  for (bool first : {true, false}) {
    Link link({}, {{NGHTTP2_SETTINGS_ENABLE_CONNECT_PROTOCOL, 1}});
    link.policy = [](H2Request& r) {
      std::erase_if(r.headers, [](const HttpHeader& f) { return f.name == "authorization"; });
      return demo_only(r);
    };
    int32_t stream = 1;
    if (!first) {
      ASSERT_EQ(link.client.submit(browser_request(kDemo, "/page")), 1);
      link.pump();  // the client has the sandbox's SETTINGS now, as RFC 8441 §3 wants before a CONNECT
      stream = 3;
    }
    ASSERT_EQ(link.client.submit(websocket_request(kDemo, "/chat?room=1")), stream) << first;
    link.pump();

    ASSERT_EQ(link.requests.size(), first ? 1u : 2u);
    EXPECT_EQ(link.requests.back().method, "CONNECT");
    EXPECT_EQ(link.requests.back().protocol, "websocket");
    const Session::Stream& seen = link.server.streams[stream];
    ASSERT_GE(seen.headers.size(), 5u) << first;
    EXPECT_EQ(*field(seen.headers, ":method"), "CONNECT");
    ASSERT_NE(field(seen.headers, ":protocol"), nullptr) << first;
    EXPECT_EQ(*field(seen.headers, ":protocol"), "websocket");
    EXPECT_EQ(*field(seen.headers, ":authority"), kDemo);
    EXPECT_EQ(*field(seen.headers, ":path"), "/chat?room=1");
    EXPECT_EQ(*field(seen.headers, "sec-websocket-version"), "13");
    EXPECT_EQ(field(seen.headers, "authorization"), nullptr);
    expect_served(link.client, stream, "/chat?room=1");
    EXPECT_FALSE(link.server.goaway);
    EXPECT_FALSE(link.client.goaway);
  }

  // For another sandbox it is refused like any request.
  Link link({}, {{NGHTTP2_SETTINGS_ENABLE_CONNECT_PROTOCOL, 1}});
  link.policy = demo_only;
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/page")), 1);
  link.pump();
  ASSERT_EQ(link.client.submit(websocket_request(kOther, "/chat")), 3);
  link.pump();
  expect_refused(link.client, 3, "421");
  EXPECT_EQ(link.server.streams.count(3), 0u);
}

// A sandbox whose SETTINGS did not enable extended CONNECT never gets one: once those SETTINGS passed, the
// edge answers the stream 400 as malformed (RFC 8441 §3), and the connection goes on.
TEST(H2Filter, ExtendedConnectToASandboxThatDidNotEnableItIsMalformed) {
  Link link;
  link.policy = demo_only;
  std::vector<std::string> malformed;
  link.filter.set_on_malformed([&](uint32_t stream, std::string_view why) {
    malformed.push_back(std::to_string(stream) + ": " + std::string(why));
  });
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/page")), 1);
  link.pump();
  ASSERT_EQ(link.frames.extended_connect(), std::optional<bool>(false));
  ASSERT_EQ(link.client.submit(websocket_request(kDemo, "/chat")), 3);
  link.pump();
  expect_refused(link.client, 3, "400");
  EXPECT_EQ(link.server.streams.count(3), 0u) << "the sandbox never saw the CONNECT";
  ASSERT_EQ(malformed.size(), 1u);
  EXPECT_NE(malformed[0].find("3: HTTP/2: extended CONNECT (:protocol websocket)"), std::string::npos) << malformed[0];
  ASSERT_EQ(link.client.submit(browser_request(kDemo, "/after")), 5);
  link.pump();
  expect_served(link.client, 5, "/after");
}

TEST(H2Filter, TrailersAreReencodedWithoutTheCallback) {
  Link link;
  BodySource body{std::string_view("chunk-of-body"), {{"x-checksum", "abc123"}, {"x-more", "trailing"}}};
  std::vector<HttpHeader> post = request_fields(kDemo, "/upload", "POST");
  post.push_back({"te", "trailers"});
  ASSERT_EQ(link.client.submit(post, &body), 1);
  link.pump();
  EXPECT_EQ(link.requests.size(), 1u);
  const Session::Stream& seen = link.server.streams[1];
  EXPECT_EQ(seen.data, "chunk-of-body");
  ASSERT_EQ(seen.trailers.size(), 2u);
  EXPECT_EQ(seen.trailers[0].name, "x-checksum");
  EXPECT_EQ(seen.trailers[0].value, "abc123");
  EXPECT_TRUE(seen.end_stream);
  expect_served(link.client, 1, "/upload");
}

TEST(H2Filter, BodyOfARefusedRequestGivesTheConnectionWindowBack) {
  Link link;
  link.policy = [](H2Request& r) { return H2Verdict{r.path == "/upload" ? 403 : 0}; };
  const std::string big(40000, 'b');
  BodySource body{big, {}};
  ASSERT_EQ(link.client.submit(request_fields(kDemo, "/upload", "POST"), &body), 1);
  link.pump();
  const Session::Stream& s = link.client.streams[1];
  ASSERT_FALSE(s.headers.empty());
  EXPECT_EQ(s.headers[0].value, "403");
  EXPECT_TRUE(s.closed);
  EXPECT_EQ(link.server.streams.count(1), 0u);
  // Every byte the client sent on the refused stream was given back by the proxy's WINDOW_UPDATEs.
  EXPECT_EQ(nghttp2_session_get_remote_window_size(link.client.get()), 65535);
  // And the connection still works.
  ASSERT_EQ(link.client.submit(request_fields(kDemo, "/next")), 3);
  link.pump();
  expect_served(link.client, 3, "/next");
}

TEST(H2Filter, SandboxHeaderTableSizeIsFollowedUpToTheCap) {
  // A server that lets clients use a 64 KiB table; the proxy follows it, so a client using it decodes fine.
  const std::vector<nghttp2_settings_entry> roomy = {{NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 65536}};
  Link link({}, roomy);
  ASSERT_EQ(link.client.submit(request_fields(kDemo, "/a")), 1);
  link.pump();
  expect_served(link.client, 1, "/a");

  // Hand-built: the client's encoder announces a table size above the default and fills it with more than
  // 4096 bytes of fields.
  Hpack client(1 << 20);
  ASSERT_EQ(nghttp2_hd_deflate_change_table_size(client.get(), 32768), 0);
  std::vector<HttpHeader> fields = request_fields(kDemo);
  fields.push_back({"x-filler-1", std::string(3000, 'f')});
  fields.push_back({"x-filler-2", std::string(3000, 'g')});
  const std::string bytes = std::string(kPreface) + settings_frame() +
                            frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1,
                                  client.encode(fields));
  const std::string again =
      frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 3, client.encode(fields));
  ASSERT_LT(again.size(), 100u) << "the second block refers to the client's table";
  {
    H2ClientFilter filter = forward_all();
    Fed fed = feed_once(filter, bytes);
    EXPECT_EQ(fed.status.error(), Error::kInvalidArgument) << "32768 was never allowed";
  }
  {
    H2ClientFilter filter = forward_all();
    filter.set_sandbox_header_table_size(32768);
    Fed fed = feed_once(filter, bytes);
    ASSERT_TRUE(fed.status.ok()) << fed.status.message();
    // A smaller value later is not enforced (see the header): the client's next block, still encoded for
    // 32768 and without a size update, decodes with both 3000-byte entries still in the table.
    filter.set_sandbox_header_table_size(0);
    Fed second = feed_once(filter, again);
    ASSERT_TRUE(second.status.ok()) << second.status.message();
    Session server(Session::Role::kServer);
    const std::string to_sandbox = fed.to_sandbox + second.to_sandbox;
    ASSERT_EQ(server.receive(to_sandbox), static_cast<ssize_t>(to_sandbox.size()));
    EXPECT_EQ(field(server.streams[3].headers, "x-filler-2")->size(), 3000u);
  }
  {
    H2FilterLimits capped;
    capped.max_hpack_table_bytes = 16384;
    H2ClientFilter filter = forward_all(capped);
    filter.set_sandbox_header_table_size(1 << 20);
    Fed fed = feed_once(filter, bytes);
    EXPECT_EQ(fed.status.error(), Error::kInvalidArgument) << "beyond the cap";
  }
}

// ============================ H2ClientFilter on hand-built input ============================

TEST(H2Filter, RefusalFramesAndDroppedFramesOfARefusedStream) {
  Hpack hpack;
  const std::string start = std::string(kPreface) + settings_frame();
  std::string bytes = start;
  bytes += frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hpack.encode(request_fields(kOther, "/", "POST")));
  // Padded DATA: pad length byte + "abc" + 10 bytes of padding = 14 bytes of window.
  bytes += frame(NGHTTP2_DATA, NGHTTP2_FLAG_PADDED, 1, std::string("\x0a", 1) + "abc" + std::string(10, '\0'));
  bytes += frame(NGHTTP2_DATA, 0, 1, "");  // zero length: nothing to give back
  bytes += frame(NGHTTP2_WINDOW_UPDATE, 0, 1, u32(1000));
  bytes += frame(NGHTTP2_PRIORITY, 0, 1, std::string("\x00\x00\x00\x00\x10", 5));
  bytes += frame(NGHTTP2_DATA, 0, 1, std::string(300, 'x'));
  bytes += frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1,
                 hpack.encode({{"x-trailer", "t"}}));
  bytes += frame(NGHTTP2_RST_STREAM, 0, 1, u32(0));
  const std::string ping = frame(NGHTTP2_PING, 0, 0, "12345678");
  bytes += ping;

  H2ClientFilter filter(H2FilterLimits{}, demo_only);
  Fed fed = feed_once(filter, bytes);
  ASSERT_TRUE(fed.status.ok()) << fed.status.message();
  EXPECT_EQ(fed.to_sandbox, start + ping);

  const std::vector<Frame> frames = parse_frames(fed.to_client);
  ASSERT_EQ(frames.size(), 4u);
  EXPECT_EQ(frames[0].hd.type, NGHTTP2_HEADERS);
  EXPECT_EQ(frames[0].hd.flags, NGHTTP2_FLAG_END_STREAM | NGHTTP2_FLAG_END_HEADERS);
  EXPECT_EQ(frames[0].hd.stream_id, 1);
  EXPECT_EQ(frames[1].hd.type, NGHTTP2_RST_STREAM);  // the request had no END_STREAM
  EXPECT_EQ(frames[1].payload, u32(NGHTTP2_NO_ERROR));
  EXPECT_EQ(frames[2].hd.type, NGHTTP2_WINDOW_UPDATE);
  EXPECT_EQ(frames[2].hd.stream_id, 0);
  EXPECT_EQ(frames[2].payload, u32(14));
  EXPECT_EQ(frames[3].hd.type, NGHTTP2_WINDOW_UPDATE);
  EXPECT_EQ(frames[3].payload, u32(300));

  // The refusal's block decodes and leaves a decoder's dynamic table empty.
  nghttp2_hd_inflater* inflater = nullptr;
  ASSERT_EQ(nghttp2_hd_inflate_new(&inflater), 0);
  std::vector<HttpHeader> decoded;
  const auto* in = reinterpret_cast<const uint8_t*>(frames[0].payload.data());
  size_t left = frames[0].payload.size();
  for (;;) {
    nghttp2_nv nv{};
    int flags = 0;
    const ssize_t used = nghttp2_hd_inflate_hd2(inflater, &nv, &flags, in, left, 1);
    ASSERT_GE(used, 0);
    in += used;
    left -= static_cast<size_t>(used);
    if (flags & NGHTTP2_HD_INFLATE_EMIT)
      decoded.push_back({std::string(reinterpret_cast<const char*>(nv.name), nv.namelen),
                         std::string(reinterpret_cast<const char*>(nv.value), nv.valuelen)});
    if (flags & NGHTTP2_HD_INFLATE_FINAL) break;
  }
  EXPECT_EQ(nghttp2_hd_inflate_get_dynamic_table_size(inflater), 0u);
  EXPECT_EQ(nghttp2_hd_inflate_get_max_dynamic_table_size(inflater), 4096u);  // no size update either
  nghttp2_hd_inflate_del(inflater);
  ASSERT_EQ(decoded.size(), 3u);
  EXPECT_EQ(decoded[0].name, ":status");
  EXPECT_EQ(decoded[0].value, "421");
  EXPECT_EQ(decoded[1].name, "content-length");
  EXPECT_EQ(decoded[1].value, "0");
  EXPECT_EQ(decoded[2].name, "server");
  EXPECT_EQ(decoded[2].value, "sandgate");
}

TEST(H2Filter, RefusedStreamsAreRememberedUpToTheLimit) {
  H2FilterLimits limits;
  limits.max_refused_streams = 2;
  H2ClientFilter filter(limits, demo_only);
  Hpack hpack;
  std::string bytes = std::string(kPreface) + settings_frame();
  for (uint32_t stream : {1u, 3u, 5u})
    bytes += frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, stream, hpack.encode(request_fields(kOther)));
  Fed fed = feed_once(filter, bytes);
  ASSERT_TRUE(fed.status.ok()) << fed.status.message();
  // Stream 1 was forgotten (oldest first): its DATA is forwarded now; 3 and 5 are still dropped.
  const std::string data1 = frame(NGHTTP2_DATA, 0, 1, "one");
  Fed later = feed_once(filter, data1 + frame(NGHTTP2_DATA, 0, 3, "three") + frame(NGHTTP2_DATA, 0, 5, "five"));
  ASSERT_TRUE(later.status.ok());
  EXPECT_EQ(later.to_sandbox, data1);
  EXPECT_EQ(later.to_client, frame(NGHTTP2_WINDOW_UPDATE, 0, 0, u32(5)) + frame(NGHTTP2_WINDOW_UPDATE, 0, 0, u32(4)));
}

TEST(H2Filter, ContinuationBlocksArriveAsOneRequest) {
  Hpack hpack;
  std::vector<HttpHeader> fields = request_fields(kDemo, "/padded");
  fields.push_back({"x-a", "1"});
  const std::string block = hpack.encode(fields);
  ASSERT_GT(block.size(), 10u);
  std::string headers_payload;
  headers_payload.push_back(7);                       // pad length
  headers_payload.append("\x80\x00\x00\x03\x10", 5);  // priority: dropped
  headers_payload.append(block.substr(0, 4));
  headers_payload.append(7, '\0');
  const std::string bytes =
      std::string(kPreface) + settings_frame() +
      frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_PRIORITY | NGHTTP2_FLAG_END_STREAM, 5, headers_payload) +
      frame(NGHTTP2_CONTINUATION, 0, 5, block.substr(4, 3)) + frame(NGHTTP2_CONTINUATION, 0, 5, "") +
      frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 5, block.substr(7));
  H2ClientFilter filter = forward_all();
  Fed fed = feed_once(filter, bytes);
  ASSERT_TRUE(fed.status.ok()) << fed.status.message();
  const std::vector<Frame> frames = parse_frames(fed.to_sandbox);
  ASSERT_EQ(frames.size(), 2u);  // SETTINGS, then one HEADERS without padding or priority
  EXPECT_EQ(frames[1].hd.type, NGHTTP2_HEADERS);
  EXPECT_EQ(frames[1].hd.flags, NGHTTP2_FLAG_END_STREAM | NGHTTP2_FLAG_END_HEADERS);

  Session server(Session::Role::kServer);
  ASSERT_EQ(server.receive(fed.to_sandbox), static_cast<ssize_t>(fed.to_sandbox.size()));
  EXPECT_EQ(*field(server.streams[5].headers, ":path"), "/padded");
  EXPECT_EQ(*field(server.streams[5].headers, "x-a"), "1");
  EXPECT_TRUE(server.streams[5].end_stream);
}

TEST(H2Filter, LargeBlockIsForwardedInFramesOfAtMost16KiB) {
  Session client(Session::Role::kClient);
  std::vector<HttpHeader> fields = request_fields(kDemo, "/big");
  fields.push_back({"x-large", std::string(40000, 'v')});
  ASSERT_EQ(client.submit(fields), 1);
  const std::string bytes = client.take_output();
  H2FilterLimits roomy;
  roomy.max_header_list_bytes = 64 * 1024;
  H2ClientFilter filter = forward_all(roomy);
  Fed fed = feed_once(filter, bytes);
  ASSERT_TRUE(fed.status.ok()) << fed.status.message();
  size_t continuations = 0;
  for (const Frame& f : parse_frames(fed.to_sandbox)) {
    EXPECT_LE(f.hd.length, 16384u);
    if (f.hd.type == NGHTTP2_CONTINUATION) ++continuations;
  }
  EXPECT_GE(continuations, 2u);
  Session server(Session::Role::kServer);
  ASSERT_EQ(server.receive(fed.to_sandbox), static_cast<ssize_t>(fed.to_sandbox.size()));
  EXPECT_EQ(field(server.streams[1].headers, "x-large")->size(), 40000u);

  // The same request under the default 16 KiB list limit.
  H2ClientFilter limited = forward_all();
  EXPECT_EQ(feed_once(limited, bytes).status.error(), Error::kLimitExceeded);
}

// A connection's worth of client bytes: requests forwarded and refused, bodies, trailers, CONTINUATION.
std::string busy_client_bytes() {
  Session client(Session::Role::kClient);
  BodySource post_body{"posted-body", {{"x-sum", "1"}}};
  BodySource refused_body{"refused-body-bytes", {}};
  client.submit(browser_request(kDemo, "/1"));
  std::vector<HttpHeader> post = browser_request(kDemo, "/2");
  post[0].value = "POST";
  client.submit(post, &post_body);
  std::vector<HttpHeader> refused = browser_request(kOther, "/3");
  refused[0].value = "PUT";
  client.submit(refused, &refused_body);
  std::vector<HttpHeader> big = browser_request(kDemo, "/4");
  big.push_back({"x-large", std::string(12000, 'L')});
  client.submit(big);
  client.submit(browser_request(kOther, "/5"));
  client.submit(browser_request(kDemo, "/6"));
  nghttp2_submit_ping(client.get(), NGHTTP2_FLAG_NONE, nullptr);
  return client.take_output();
}

TEST(H2Filter, ByteAtATimeGivesTheSameOutputAsOneShot) {
  const std::string bytes = busy_client_bytes();
  std::vector<std::string> calls_once, calls_bytewise;
  auto policy = [](std::vector<std::string>& calls) {
    return [&calls](H2Request& r) {
      calls.push_back(std::to_string(r.stream_id) + " " + r.authority + r.path);
      return demo_only(r);
    };
  };
  H2ClientFilter once(H2FilterLimits{}, policy(calls_once));
  H2ClientFilter bytewise(H2FilterLimits{}, policy(calls_bytewise));
  const Fed a = feed_once(once, bytes);
  const Fed b = feed_bytewise(bytewise, bytes);
  ASSERT_TRUE(a.status.ok()) << a.status.message();
  ASSERT_TRUE(b.status.ok()) << b.status.message();
  EXPECT_EQ(a.to_sandbox, b.to_sandbox);
  EXPECT_EQ(a.to_client, b.to_client);
  EXPECT_EQ(calls_once, calls_bytewise);
  ASSERT_EQ(calls_once.size(), 6u);

  // What went to the sandbox is what a real server accepts: the demo requests, none of the others.
  Session server(Session::Role::kServer);
  ASSERT_EQ(server.receive(a.to_sandbox), static_cast<ssize_t>(a.to_sandbox.size()));
  EXPECT_EQ(server.streams.count(5), 0u);
  EXPECT_EQ(server.streams.count(9), 0u);
  EXPECT_EQ(server.streams[3].data, "posted-body");
  EXPECT_EQ(*field(server.streams[3].trailers, "x-sum"), "1");
  EXPECT_EQ(field(server.streams[7].headers, "x-large")->size(), 12000u);
  EXPECT_TRUE(server.streams[11].end_stream);
  EXPECT_FALSE(server.goaway);
}

// --- errors ---

void expect_error(std::string_view bytes, Error code, std::string_view message_part, H2FilterLimits limits = {}) {
  for (bool bytewise : {false, true}) {
    H2ClientFilter filter = forward_all(limits);
    Fed fed = bytewise ? feed_bytewise(filter, bytes) : feed_once(filter, bytes);
    ASSERT_FALSE(fed.status.ok()) << "accepted: " << message_part;
    EXPECT_EQ(fed.status.error(), code) << fed.status.message();
    EXPECT_NE(fed.status.message().find(message_part), std::string::npos) << fed.status.message();
    // Sticky: the connection is over.
    std::string a, b;
    EXPECT_FALSE(filter.feed(settings_frame(), a, b).ok());
  }
}

TEST(H2Filter, ProtocolErrors) {
  Hpack hpack;
  const std::string block = hpack.encode(request_fields(kDemo));
  const std::string s = std::string(kPreface) + settings_frame();
  const auto headers = [&](uint8_t flags, uint32_t stream) { return frame(NGHTTP2_HEADERS, flags, stream, block); };

  expect_error("GET / HTTP/1.1\r\nHost: x\r\n\r\n", Error::kInvalidArgument, "HTTP/1");
  expect_error("PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", Error::kInvalidArgument, "preface");
  expect_error(std::string(kPreface) + frame(NGHTTP2_PING, 0, 0, "12345678"), Error::kInvalidArgument, "not SETTINGS");
  expect_error(std::string(kPreface) + frame(NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, ""), Error::kInvalidArgument,
               "not SETTINGS");
  expect_error(s + frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, block), Error::kInvalidArgument,
               "CONTINUATION without");
  expect_error(s + frame(NGHTTP2_PUSH_PROMISE, NGHTTP2_FLAG_END_HEADERS, 1, u32(2) + block), Error::kInvalidArgument,
               "PUSH_PROMISE");
  expect_error(s + headers(NGHTTP2_FLAG_END_HEADERS, 0), Error::kInvalidArgument, "stream 0");
  expect_error(s + headers(NGHTTP2_FLAG_END_HEADERS, 2), Error::kInvalidArgument, "stream 2");
  expect_error(s + headers(0, 1) + frame(NGHTTP2_PING, 0, 0, "12345678"), Error::kInvalidArgument,
               "inside the header block");
  expect_error(s + headers(0, 1) + frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 3, ""),
               Error::kInvalidArgument, "inside the header block");
  expect_error(s + headers(0, 1) + frame(NGHTTP2_DATA, 0, 1, "x"), Error::kInvalidArgument, "inside the header block");
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_END_HEADERS, 1, "\xc8" + block),
               Error::kInvalidArgument, "padding");
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_END_HEADERS, 1, ""),
               Error::kInvalidArgument, "pad length");
  // HPACK garbage: an index beyond both tables, an integer overflow, a literal cut short.
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, "\xff\x7f"), Error::kInvalidArgument, "HPACK");
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, "\xff\xff\xff\xff\xff\xff\xff"),
               Error::kInvalidArgument, "HPACK");
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, block + "\x40\x05x-lit\x05" "ab"),
               Error::kInvalidArgument, "HPACK");
  // A table size update beyond what the sandbox allows.
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, std::string("\x3f\xe1\x3f", 3) + block),
               Error::kInvalidArgument, "HPACK");
}

// A malformed request (the first-request scanner's rules, shared) is an error of its stream only: 400 on it,
// the sandbox never sees it, and the next request on the connection is served, its HPACK references intact.
TEST(H2Filter, MalformedRequestIs400OnItsStreamAndTheConnectionGoesOn) {
  std::vector<HttpHeader> no_path = request_fields(kDemo);
  no_path.pop_back();
  std::vector<HttpHeader> two_hosts = request_fields(kDemo);
  two_hosts.push_back({"host", std::string(kOther)});
  std::vector<HttpHeader> protocol_on_get = request_fields(kDemo);
  protocol_on_get.push_back({":protocol", "websocket"});
  const std::vector<HttpHeader> plain_connect = {{":method", "CONNECT"}, {":authority", std::string(kDemo)}};
  for (const auto& [fields, why] :
       {std::pair{no_path, "no :path"}, std::pair{two_hosts, "Host differs"},
        std::pair{protocol_on_get, ":protocol is only allowed in an extended CONNECT"},
        std::pair{plain_connect, "CONNECT requests are not served"}}) {
    Hpack hpack;
    std::vector<std::pair<uint32_t, std::string>> malformed;
    H2ClientFilter filter({}, [](H2Request&) { return H2Verdict{}; });
    filter.set_on_malformed([&](uint32_t stream, std::string_view message) { malformed.emplace_back(stream, message); });
    const std::string bad = frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1, hpack.encode(fields));
    const std::string good =
        frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 3, hpack.encode(request_fields(kDemo)));
    Fed fed = feed_once(filter, std::string(kPreface) + settings_frame() + bad + good);
    ASSERT_TRUE(fed.status.ok()) << why << ": " << fed.status.message();
    ASSERT_EQ(malformed.size(), 1u) << why;
    EXPECT_EQ(malformed[0].first, 1u);
    EXPECT_NE(malformed[0].second.find(why), std::string::npos) << malformed[0].second;
    // To the client: a response HEADERS on stream 1 (`:status: 400` is static-table entry 12: 0x8c).
    ASSERT_GE(fed.to_client.size(), 10u) << why;
    EXPECT_EQ(static_cast<uint8_t>(fed.to_client[3]), NGHTTP2_HEADERS);
    EXPECT_EQ(fed.to_client.substr(5, 4), std::string("\0\0\0\1", 4));
    EXPECT_EQ(static_cast<uint8_t>(fed.to_client[9]), 0x8c);
    // To the sandbox: the preface and SETTINGS, then stream 3 only.
    Session server(Session::Role::kServer);
    ASSERT_GE(server.receive(fed.to_sandbox), 0) << why;
    EXPECT_EQ(server.streams.count(1), 0u) << why;
    EXPECT_EQ(server.streams.count(3), 1u) << why;
  }
}

TEST(H2Filter, TrailerErrors) {
  Hpack hpack;
  const std::string s = std::string(kPreface) + settings_frame() +
                        frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hpack.encode(request_fields(kDemo)));
  Hpack copy;  // the same encoder state, for each case separately
  copy.encode(request_fields(kDemo));
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, copy.encode({{"x-t", "1"}})),
               Error::kInvalidArgument, "without END_STREAM");
  Hpack copy2;
  copy2.encode(request_fields(kDemo));
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1,
                         copy2.encode({{":path", "/again"}})),
               Error::kInvalidArgument, "in trailers");
  Hpack copy3;
  copy3.encode(request_fields(kDemo));
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1,
                         copy3.encode({{"X-Upper", "1"}})),
               Error::kInvalidArgument, "uppercase");
}

TEST(H2Filter, LimitsAreEnforced) {
  const std::string s = std::string(kPreface) + settings_frame();
  // One 4000-byte field in the dynamic table, then 3000 one-byte references to it: 4 KiB that decode to 12 MB.
  std::string bomb;
  bomb.push_back('\x40');
  bomb.push_back('\x01');
  bomb.push_back('x');
  bomb.append("\x7f\xa1\x1e");  // value length 127 + 3873 = 4000
  bomb.append(4000, 'v');
  bomb.append(3000, '\xbe');
  Hpack hpack;
  expect_error(s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hpack.encode(request_fields(kDemo)) + bomb),
               Error::kLimitExceeded, "header list exceeds");

  H2FilterLimits small;
  small.max_header_block_bytes = 100;
  // A HEADERS frame over the block limit is refused from its header alone, before the payload arrives.
  const std::string oversize_header = frame(NGHTTP2_HEADERS, 0, 1, std::string(101, '\x80')).substr(0, 9);
  expect_error(s + oversize_header, Error::kLimitExceeded, "header block of stream 1 exceeds 100", small);
  // So is the CONTINUATION that takes the block over it.
  Hpack hpack2;
  expect_error(s + frame(NGHTTP2_HEADERS, 0, 1, hpack2.encode(request_fields(kDemo))) +
                   frame(NGHTTP2_CONTINUATION, 0, 1, std::string(90, '\x80')).substr(0, 9),
               Error::kLimitExceeded, "exceeds 100", small);
  // Exactly at the limit is fine.
  Hpack hpack3;
  std::vector<HttpHeader> exact = request_fields(kDemo);
  std::string block = hpack3.encode(exact);
  H2FilterLimits at;
  at.max_header_block_bytes = block.size();
  H2ClientFilter filter = forward_all(at);
  EXPECT_TRUE(feed_once(filter, s + frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, block)).status.ok());
  // A 16 MiB - 1 DATA frame streams through (the sandbox's SETTINGS_MAX_FRAME_SIZE is its business).
  std::string data_header = frame(NGHTTP2_DATA, 0, 1, "").substr(0, 9);
  data_header[0] = data_header[1] = data_header[2] = '\xff';
  std::string to_sandbox, to_client;
  ASSERT_TRUE(filter.feed(data_header, to_sandbox, to_client).ok());
  EXPECT_EQ(to_sandbox, data_header);
  const std::string chunk(1 << 20, 'd');
  for (int i = 0; i < 15; ++i) {
    to_sandbox.clear();
    ASSERT_TRUE(filter.feed(chunk, to_sandbox, to_client).ok());
    EXPECT_EQ(to_sandbox.size(), chunk.size());
  }
  to_sandbox.clear();
  ASSERT_TRUE(filter.feed(std::string((1 << 20) - 1, 'd') + settings_frame(), to_sandbox, to_client).ok());
  EXPECT_EQ(to_sandbox.size(), (1u << 20) - 1 + 9);
  EXPECT_TRUE(to_client.empty());
}

TEST(H2Filter, RefusalWithAnInvalidStatusIsAnInternalError) {
  Hpack hpack;
  H2ClientFilter filter(H2FilterLimits{}, [](H2Request&) { return H2Verdict{42}; });
  Fed fed = feed_once(filter, std::string(kPreface) + settings_frame() +
                                  frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, hpack.encode(request_fields(kDemo))));
  ASSERT_FALSE(fed.status.ok());
  EXPECT_EQ(fed.status.error(), Error::kInternal);
}

// ============================ H2ServerFrames ============================

std::string server_settings() {
  return frame(NGHTTP2_SETTINGS, 0, 0, setting(NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 100));
}

TEST(H2ServerFrames, InjectsOnlyAtFrameBoundariesOutsideHeaderBlocks) {
  const std::string settings = server_settings();
  const std::string headers = frame(NGHTTP2_HEADERS, 0, 1, "abcdef");
  const std::string cont1 = frame(NGHTTP2_CONTINUATION, 0, 1, "ghi");
  const std::string cont2 = frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, "jk");
  const std::string data = frame(NGHTTP2_DATA, NGHTTP2_FLAG_END_STREAM, 1, "body-bytes");
  const std::string promise = frame(NGHTTP2_PUSH_PROMISE, 0, 1, u32(2) + "pp");
  const std::string promise_end = frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, "qq");
  const std::string ping = frame(NGHTTP2_PING, 0, 0, "12345678");
  const std::string bytes = settings + headers + cont1 + cont2 + data + promise + promise_end + ping;
  // Where the proxy's frames may go: after each frame that is not inside a header block.
  const std::vector<size_t> allowed = {
      settings.size(),
      settings.size() + headers.size() + cont1.size() + cont2.size(),
      settings.size() + headers.size() + cont1.size() + cont2.size() + data.size(),
      bytes.size() - ping.size(),
      bytes.size(),
  };
  const std::string injected = frame(NGHTTP2_RST_STREAM, 0, 3, u32(0));
  for (size_t split = 0; split <= bytes.size(); ++split) {
    H2ServerFrames frames;
    std::string out;
    ASSERT_TRUE(frames.feed(std::string_view(bytes).substr(0, split), out).ok());
    ASSERT_TRUE(frames.inject(injected).ok());
    ASSERT_TRUE(frames.feed("", out).ok());
    ASSERT_TRUE(frames.feed(std::string_view(bytes).substr(split), out).ok());
    EXPECT_FALSE(frames.has_queued());
    const size_t at = *std::lower_bound(allowed.begin(), allowed.end(), split);
    EXPECT_EQ(out, bytes.substr(0, at) + injected + bytes.substr(at)) << "split " << split;
  }
}

TEST(H2ServerFrames, HoldsFramesUntilTheServerPrefaceAndFlushesWhenIdle) {
  H2ServerFrames frames;
  std::string out;
  ASSERT_TRUE(frames.inject("XX").ok());
  ASSERT_TRUE(frames.feed("", out).ok());
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(frames.has_queued());
  const std::string settings = server_settings();
  ASSERT_TRUE(frames.feed(settings.substr(0, 12), out).ok());
  EXPECT_EQ(out, settings.substr(0, 12));
  ASSERT_TRUE(frames.feed(settings.substr(12), out).ok());
  EXPECT_EQ(out, settings + "XX");
  EXPECT_FALSE(frames.has_queued());
  // Idle at a boundary: an empty feed delivers what was injected since.
  ASSERT_TRUE(frames.inject("YY").ok());
  ASSERT_TRUE(frames.feed("", out).ok());
  EXPECT_EQ(out, settings + "XXYY");
  // Mid-frame it does not.
  const std::string data = frame(NGHTTP2_DATA, 0, 1, "0123456789");
  ASSERT_TRUE(frames.feed(data.substr(0, 4), out).ok());
  ASSERT_TRUE(frames.inject("ZZ").ok());
  ASSERT_TRUE(frames.feed("", out).ok());
  ASSERT_TRUE(frames.feed(data.substr(4, 8), out).ok());
  EXPECT_EQ(out, settings + "XXYY" + data.substr(0, 12));
  ASSERT_TRUE(frames.feed(data.substr(12), out).ok());
  EXPECT_EQ(out, settings + "XXYY" + data + "ZZ");
}

TEST(H2ServerFrames, QueueIsBounded) {
  H2ServerFrames frames(10);
  EXPECT_TRUE(frames.inject("0123456789").ok());
  Status over = frames.inject("x");
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.error(), Error::kLimitExceeded);
  std::string out;
  ASSERT_TRUE(frames.feed(server_settings(), out).ok());
  EXPECT_EQ(out, server_settings() + "0123456789");
  EXPECT_TRUE(frames.inject("0123456789").ok());  // room again once flushed
}

TEST(H2ServerFrames, ReportsHeaderTableSizeFromASplitSettingsFrame) {
  const std::string settings =
      frame(NGHTTP2_SETTINGS, 0, 0,
            setting(NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 100) + setting(NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 8192) +
                setting(NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20));
  for (size_t split = 0; split <= settings.size(); ++split) {
    H2ServerFrames frames;
    std::string out;
    auto first = frames.feed(std::string_view(settings).substr(0, split), out);
    auto second = frames.feed(std::string_view(settings).substr(split), out);
    ASSERT_TRUE(first.ok() && second.ok());
    EXPECT_EQ(out, settings);
    // Reported once, by the call that completes the frame.
    if (split == settings.size()) {
      EXPECT_EQ(*first, std::optional<uint32_t>(8192)) << split;
      EXPECT_FALSE(second->has_value());
    } else {
      EXPECT_FALSE(first->has_value()) << split;
      EXPECT_EQ(*second, std::optional<uint32_t>(8192)) << split;
    }
  }
  // Byte by byte, with an ACK and a later SETTINGS without the field in between.
  const std::string more = frame(NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, "") + server_settings() +
                           frame(NGHTTP2_SETTINGS, 0, 0, setting(NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 65536));
  H2ServerFrames frames;
  std::string out;
  std::vector<uint32_t> reported;
  for (char c : settings + more) {
    auto r = frames.feed(std::string_view(&c, 1), out);
    ASSERT_TRUE(r.ok());
    if (*r) reported.push_back(**r);
  }
  EXPECT_EQ(reported, (std::vector<uint32_t>{8192, 65536}));
  // Two in one call: the larger counts (the filter only ever raises its limit).
  H2ServerFrames both;
  auto r = both.feed(frame(NGHTTP2_SETTINGS, 0, 0, setting(NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 65536)) +
                         frame(NGHTTP2_SETTINGS, 0, 0, setting(NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 1024)),
                     out);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, std::optional<uint32_t>(65536));
}

TEST(H2ServerFrames, MalformedSandboxFrames) {
  auto expect_bad = [](std::string_view bytes, std::string_view message_part) {
    H2ServerFrames frames;
    std::string out;
    auto r = frames.feed(bytes, out);
    ASSERT_FALSE(r.ok()) << message_part;
    EXPECT_EQ(r.error(), Error::kInvalidArgument);
    EXPECT_NE(r.message().find(message_part), std::string::npos) << r.message();
    EXPECT_FALSE(frames.feed("", out).ok());  // sticky
  };
  const std::string s = server_settings();
  expect_bad(frame(NGHTTP2_PING, 0, 0, "12345678"), "not SETTINGS");
  expect_bad(frame(NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, ""), "not SETTINGS");
  expect_bad(frame(NGHTTP2_SETTINGS, 0, 0, "12345"), "multiple of 6");
  expect_bad(frame(NGHTTP2_SETTINGS, 0, 1, ""), "SETTINGS on a stream");
  expect_bad(s + frame(NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, "123456"), "ACK with a payload");
  expect_bad(s + frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, "x"), "CONTINUATION without");
  expect_bad(s + frame(NGHTTP2_HEADERS, 0, 1, "x") + frame(NGHTTP2_DATA, 0, 1, "x"), "inside the header block");
  expect_bad(s + frame(NGHTTP2_HEADERS, 0, 1, "x") + frame(NGHTTP2_CONTINUATION, 0, 3, "x"), "inside the header block");
  // The largest length the field can carry is just a long frame.
  H2ServerFrames frames;
  std::string out;
  EXPECT_TRUE(frames.feed(s + "\xff\xff\xff\x00\x00\x00\x00\x00\x01", out).ok());
}

// ============================ robustness ============================

TEST(H2Filter, FuzzedInputNeverCrashes) {
  const std::string busy = busy_client_bytes();
  Hpack hpack;
  const std::string block = hpack.encode(request_fields(kDemo));
  const std::vector<std::string> client_seeds = {
      busy,
      std::string(kPreface) + settings_frame() +
          frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_PADDED | NGHTTP2_FLAG_PRIORITY, 1,
                std::string("\x02\x00\x00\x00\x00\x10", 6) + block.substr(0, 5) + std::string(2, '\0')) +
          frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, block.substr(5)) +
          frame(NGHTTP2_DATA, NGHTTP2_FLAG_PADDED, 1, std::string("\x01xy\0", 4)),
  };
  const std::string server_seed =
      server_settings() + frame(NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, "") +
      frame(NGHTTP2_HEADERS, 0, 1, "abc") + frame(NGHTTP2_CONTINUATION, NGHTTP2_FLAG_END_HEADERS, 1, "d") +
      frame(NGHTTP2_DATA, 0, 1, "body") + frame(NGHTTP2_SETTINGS, 0, 0, setting(1, 8192));

  std::mt19937 rng(20240611);
  auto pick = [&](size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  size_t ok = 0, errors = 0, requests = 0;
  for (int iteration = 0; iteration < 4000; ++iteration) {
    std::string input = mutate(rng, client_seeds[pick(client_seeds.size())], /*duplicate_slices=*/true);
    if (pick(2) == 0 && input.size() >= kPreface.size()) input.replace(0, kPreface.size(), kPreface);
    H2FilterLimits limits;
    if (pick(4) == 0) {
      limits.max_header_list_bytes = pick(2000);
      limits.max_header_block_bytes = pick(2000);
      limits.max_refused_streams = pick(3);
    }
    auto policy = [&](H2Request& r) {
      ++requests;
      if (pick(3) == 0 && !r.headers.empty()) r.headers.erase(r.headers.begin());
      return H2Verdict{pick(3) == 0 ? 421 : 0};
    };
    // Random splits must give what one shot gives.
    std::mt19937 policy_rng_copy = rng;
    H2ClientFilter whole(limits, policy);
    Fed a = feed_once(whole, input);
    std::mt19937 after_whole = rng;
    rng = policy_rng_copy;  // the split run makes the same policy choices
    H2ClientFilter split(limits, policy);
    Fed b;
    std::string_view rest = input;
    std::mt19937 split_rng(static_cast<uint32_t>(iteration));
    while (!rest.empty()) {
      const size_t n = 1 + std::uniform_int_distribution<size_t>(0, std::min<size_t>(rest.size(), 300) - 1)(split_rng);
      b.status = split.feed(rest.substr(0, n), b.to_sandbox, b.to_client);
      rest.remove_prefix(n);
      if (!b.status) break;
    }
    rng = after_whole;
    ASSERT_EQ(a.status.ok(), b.status.ok()) << iteration << ": " << a.status.message() << " / " << b.status.message();
    if (!a.status.ok()) {
      EXPECT_EQ(a.status.error(), b.status.error()) << iteration;
    }
    EXPECT_EQ(a.to_sandbox, b.to_sandbox) << iteration;
    EXPECT_EQ(a.to_client, b.to_client) << iteration;
    if (a.status.ok()) ++ok;
    else ++errors;

    // The sandbox side: mutated frames, random splits, random injections.
    std::string sandbox = mutate(rng, server_seed, /*duplicate_slices=*/true);
    H2ServerFrames frames(pick(2) ? 64 : 1 << 16);
    std::string out;
    std::string_view srest = sandbox;
    while (!srest.empty()) {
      const size_t n = 1 + pick(std::min<size_t>(srest.size(), 40));
      (void)frames.inject(a.to_client.substr(0, pick(a.to_client.size() + 1)));
      auto r = frames.feed(srest.substr(0, n), out);
      srest.remove_prefix(n);
      if (!r.ok()) break;
    }
  }
  EXPECT_GT(ok, 0u);
  EXPECT_GT(errors, 0u);
  EXPECT_GT(requests, 0u);
}

}  // namespace
}  // namespace sg

namespace sg {
namespace {

TEST(H2Filter, AnHpackFailureInALaterRequestNamesCompressionErrorAndTheLastForwardedStream) {
  H2ClientFilter filter = forward_all();
  Hpack hpack;
  const std::string bytes = std::string(kPreface) + settings_frame() +
                            frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1,
                                  hpack.encode(request_fields(kDemo))) +
                            // Indexed field 0 does not exist (RFC 7541 §6.1): a decoding error.
                            frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 3, "\x80");
  Fed fed = feed_once(filter, bytes);
  ASSERT_FALSE(fed.status.ok());
  EXPECT_EQ(filter.goaway_code(), H2ErrorCode::kCompressionError);
  EXPECT_EQ(filter.last_forwarded_stream(), 1u);
}

TEST(H2Filter, AnOversizedBlockIsEnhanceYourCalm) {
  H2FilterLimits limits;
  limits.max_header_block_bytes = 64;
  H2ClientFilter filter(limits, demo_only);
  const std::string bytes = std::string(kPreface) + settings_frame() +
                            frame(NGHTTP2_HEADERS, NGHTTP2_FLAG_END_HEADERS, 1, std::string(100, 'x'));
  Fed fed = feed_once(filter, bytes);
  ASSERT_FALSE(fed.status.ok());
  EXPECT_EQ(fed.status.error(), Error::kLimitExceeded);
  EXPECT_EQ(filter.goaway_code(), H2ErrorCode::kEnhanceYourCalm);
  EXPECT_EQ(filter.last_forwarded_stream(), 0u);
}

}  // namespace
}  // namespace sg
