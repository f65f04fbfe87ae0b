// A connection's phases against a fake node: a real Worker (its own loop thread, a listener on 127.0.0.1),
// a real TLS client, and a FakeNode that answers lookups and opens as each test scripts them. An open that
// succeeds hands over one end of a socketpair ("connected"), whose other end is the test's sandbox: it
// reads what the edge forwarded and writes the answers.
#include "proxy/connection.h"

#include <gtest/gtest.h>
#include <openssl/err.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "proxy/worker.h"
#include "tests/unit/test_cert.h"

namespace sg {
namespace {

struct OpenRequest {
  std::string sandbox;
  uint16_t port = 0;
  std::vector<std::string> credentials;
};

// Answers on the worker's loop (never inside the call, as the real client promises), from the script the
// test set. Calls are counted; the lists are read by the test thread under the mutex.
class FakeNode : public NodeClient {
 public:
  // What an open is answered with; nullopt: never answered (the connection's deadline must end it).
  std::function<std::optional<Result<OpenAnswer>>(const OpenRequest&)> on_open;
  PortPolicy policy{"sb-demo", "http1", false};
  std::string prewake_answer = "refused";  // what a lookup that asks for an early wake hears

  void attach(uv_loop_t* loop) { loop_ = loop; }

  std::unique_ptr<NodeCall> lookup(const std::string& sandbox, uint16_t port, const ClientHint& client, uint32_t,
                                   std::function<void(Result<LookupAnswer>)> done) override {
    {
      std::lock_guard lock(mu);
      ++lookups;
      calls.push_back("lookup " + sandbox + ":" + std::to_string(port) + " client=" + client.address +
                      (client.prewake ? " prewake" : ""));
    }
    (void)sandbox;
    LookupAnswer a{200, "", port, policy, client.prewake ? prewake_answer : ""};
    return later([done = std::move(done), a]() mutable { done(std::move(a)); });
  }

  std::unique_ptr<NodeCall> open(const std::string& sandbox, uint16_t port, std::span<const std::string> credentials,
                                 const ClientHint& client, uint32_t,
                                 std::function<void(Result<OpenAnswer>)> done) override {
    OpenRequest req{sandbox, port, {credentials.begin(), credentials.end()}};
    {
      std::lock_guard lock(mu);
      opens.push_back(req);
      calls.push_back("open " + sandbox + ":" + std::to_string(port) + " client=" + client.address);
    }
    auto answer = on_open(req);
    if (!answer) return std::make_unique<Pending>(loop_, nullptr);
    // std::function needs a copyable callable; the answer holds a socket.
    auto held = std::make_shared<Result<OpenAnswer>>(std::move(*answer));
    return later([done = std::move(done), held] { done(std::move(*held)); });
  }

  // With `route_events`: one event stream, up at once (stamp 1); the worker's later attempts get none.
  bool accepting() override { return accepting_; }
  std::unique_ptr<NodeCall> watch_routes(std::function<void(const RouteStreamEvent&)> on_event,
                                         std::function<void(Failure)> ended) override {
    if (!route_events || route_stream_started_) return nullptr;
    route_stream_started_ = true;
    route_stream_ended_ = std::move(ended);
    return later([on_event = std::move(on_event)] { on_event(RouteStreamEvent{RouteStreamEvent::Kind::kHello, "", "", 1}); });
  }

  std::unique_ptr<NodeCall> report_activity(std::string, std::function<void(Result<ActivityCuts>)> done) override {
    const bool crash = crash_at_next_report.exchange(false);
    return later([this, done = std::move(done), crash] {
      if (crash) {
        // A kill -9 as the proxy may see it: the event stream ends while the dying node still accepts
        // connections, and a moment later its socket refuses them.
        accepting_ = true;
        if (auto ended = std::move(route_stream_ended_)) ended(fail(Error::kUnavailable, "the node's stream ended"));
        accepting_ = false;
        crashed = true;
      }
      done(ActivityCuts{});
    });
  }

  std::mutex mu;
  int lookups = 0;
  std::vector<OpenRequest> opens;
  std::vector<std::string> calls;  // lookups and opens in order, with what the hint said
  bool route_events = false;                      // set before start()
  std::atomic<bool> crash_at_next_report = false;  // the first activity report (traffic) ends the node
  std::atomic<bool> crashed = false;

 private:
  // A timer 0 on the loop runs the answer; destroying the call first cancels it.
  class Pending : public NodeCall {
   public:
    Pending(uv_loop_t* loop, std::function<void()> fire) : fire_(std::move(fire)) {
      if (!fire_) return;
      timer_ = new uv_timer_t;
      uv_timer_init(loop, timer_);
      timer_->data = this;
      uv_timer_start(timer_, [](uv_timer_t* t) {
        auto* self = static_cast<Pending*>(t->data);
        auto fire = std::move(self->fire_);
        fire();  // may destroy self
      }, 0, 0);
    }
    ~Pending() override {
      if (timer_) uv_close(reinterpret_cast<uv_handle_t*>(timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
    }

   private:
    std::function<void()> fire_;
    uv_timer_t* timer_ = nullptr;
  };
  std::unique_ptr<NodeCall> later(std::function<void()> fire) { return std::make_unique<Pending>(loop_, std::move(fire)); }

  uv_loop_t* loop_ = nullptr;
  bool accepting_ = true;
  bool route_stream_started_ = false;
  std::function<void(Failure)> route_stream_ended_;
};

// Opened, with the connection's socket end; `sandbox` keeps the other end.
Result<OpenAnswer> opened(UniqueFd* sandbox, std::optional<size_t> credential, bool is_public = false) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0)
    return fail(Error::kIo, "socketpair");
  *sandbox = UniqueFd(sv[1]);
  OpenAnswer a;
  a.status = 200;
  a.opened.id = "sb-demo";
  a.opened.port = 8080;
  a.opened.policy = PortPolicy{"sb-demo", "http1", is_public};
  a.opened.connected = true;
  a.opened.opened_at = 1;
  a.opened.credential = credential;
  a.opened.socket = UniqueFd(sv[0]);
  return a;
}

// The test's end of an opened socketpair, handed from the worker's thread (the fake's open) to the test's.
class SandboxEnd {
 public:
  void put(UniqueFd fd) {
    std::lock_guard lock(mu_);
    fd_ = std::move(fd);
    cv_.notify_all();
  }
  // Waits (up to 5 s) for the open to have handed it over.
  UniqueFd take() {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return fd_.valid(); });
    return std::move(fd_);
  }
  // For the fake's open: a socket whose other end goes to put().
  Result<OpenAnswer> open(std::optional<size_t> credential, bool is_public = false) {
    UniqueFd end;
    Result<OpenAnswer> a = opened(&end, credential, is_public);
    put(std::move(end));
    return a;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  UniqueFd fd_;
};

// Reads what the edge forwarded to the sandbox until `until` appears (or EOF, or 5 s).
std::string sandbox_reads(int fd, std::string_view until) {
  std::string got;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (got.find(until) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) <= 0) break;
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n > 0) got.append(buf, static_cast<size_t>(n));
    else if (n == 0 || (errno != EAGAIN && errno != EINTR)) break;
  }
  return got;
}

class ConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("sg-conn-" + std::to_string(::getpid()) + "-" +
                                                      ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    cert_.write_pem(dir_ / "cert.pem");
    cert_.write_key_pem(dir_ / "key.pem");
  }
  void TearDown() override {
    if (worker_) {
      worker_->stop();
      worker_->join();
      worker_.reset();
    }
    std::filesystem::remove_all(dir_);
  }

  void start(std::string extra_proxy = "") {
    std::string toml = "domain = \"sandbox.localhost\"\n[proxy]\nlisten = \"127.0.0.1:0\"\nworkers = 1\nktls = \"off\"\n"
                       "access_log = \"" + (dir_ / "access.log").string() + "\"\n" + extra_proxy +
                       "\n[[proxy.certificates]]\ncert = \"" + (dir_ / "cert.pem").string() + "\"\nkey = \"" +
                       (dir_ / "key.pem").string() + "\"\n";
    auto cfg = load_config_string(toml, "test.toml");
    ASSERT_TRUE(cfg) << cfg.message();
    auto tls = TlsContexts::create(**cfg);
    ASSERT_TRUE(tls) << tls.message();
    shared_ = std::make_unique<ProxyShared>(make_snapshot(ProxySnapshot{*cfg, *tls, "", nullptr}));
    auto log = AccessLog::open((*cfg)->proxy.access_log);
    ASSERT_TRUE(log) << log.message();
    shared_->access_log = std::move(*log);
    auto fake = std::make_unique<FakeNode>();
    fake->route_events = route_events_;
    node_ = fake.get();
    worker_ = std::make_unique<Worker>(0, shared_.get(), std::move(fake));
    node_->attach(worker_->loop());
    ASSERT_TRUE(worker_->bind((*cfg)->proxy.listen));
    worker_->start();
  }

  // One TLS connection to the worker: sends `request`, reads until the edge closes (or 5 s).
  // `offer_alpn` false: no ALPN, which makes the edge ask for the port's policy at the ClientHello.
  std::string exchange(const std::string& sni, const std::string& request, bool offer_alpn = true,
                       std::string_view alpn = "\x08http/1.1") {
    SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
    if (offer_alpn)
      SSL_CTX_set_alpn_protos(ctx, reinterpret_cast<const unsigned char*>(alpn.data()), static_cast<unsigned>(alpn.size()));
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(worker_->bound()[0].port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::string out;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      SSL* ssl = SSL_new(ctx);
      SSL_set_fd(ssl, fd);
      SSL_set_tlsext_host_name(ssl, sni.c_str());
      if (SSL_connect(ssl) == 1) {
        SSL_write(ssl, request.data(), static_cast<int>(request.size()));
        if (on_sent) on_sent();
        char buf[4096];
        for (;;) {
          int n = SSL_read(ssl, buf, sizeof buf);
          if (n <= 0) break;
          out.append(buf, static_cast<size_t>(n));
        }
      } else {
        out = "[handshake failed]";
      }
      SSL_free(ssl);
    }
    ::close(fd);
    SSL_CTX_free(ctx);
    return out;
  }

  // A TLS connection to the worker that stays open for the test to drive (exchange() reads to the end).
  struct Client {
    SSL_CTX* ctx = nullptr;
    SSL* ssl = nullptr;
    int fd = -1;
    ~Client() {
      if (ssl) SSL_free(ssl);
      if (fd >= 0) ::close(fd);
      if (ctx) SSL_CTX_free(ctx);
    }
  };
  std::unique_ptr<Client> connect_tls(const std::string& sni) {
    auto c = std::make_unique<Client>();
    c->ctx = SSL_CTX_new(TLS_client_method());
    c->fd = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{5, 0};
    ::setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(worker_->bound()[0].port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(c->fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return nullptr;
    c->ssl = SSL_new(c->ctx);
    SSL_set_fd(c->ssl, c->fd);
    SSL_set_tlsext_host_name(c->ssl, sni.c_str());
    if (SSL_connect(c->ssl) != 1) return nullptr;
    return c;
  }

  // The edge's answer up to its close_notify.
  static std::string read_answer(SSL* ssl) {
    std::string out;
    char buf[4096];
    for (;;) {
      int n = SSL_read(ssl, buf, sizeof buf);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

  // The access log's lines so far (each connection writes one when it ends, on the worker's thread).
  std::string access_log_when(std::string_view needle) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::string text;
    while (std::chrono::steady_clock::now() < deadline) {
      std::ifstream in(dir_ / "access.log");
      std::stringstream ss;
      ss << in.rdbuf();
      text = ss.str();
      if (text.find(needle) != std::string::npos) break;
      ::usleep(5000);
    }
    return text;
  }

  // Waits (up to 5 s) until the access log has `count` lines with `needle`; returns how many it has.
  size_t access_log_count(std::string_view needle, size_t count) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    size_t lines = 0;
    do {
      std::ifstream in(dir_ / "access.log");
      std::string line;
      lines = 0;
      while (std::getline(in, line)) lines += line.find(needle) != std::string::npos;
      if (lines >= count) break;
      ::usleep(5000);
    } while (std::chrono::steady_clock::now() < deadline);
    return lines;
  }

  std::function<void()> on_sent;
  bool route_events_ = false;  // the fake node's event stream (route cache), for start()
  std::filesystem::path dir_;
  test_support::TestCert cert_;
  std::unique_ptr<ProxyShared> shared_;
  std::unique_ptr<Worker> worker_;
  FakeNode* node_ = nullptr;
};

const std::string kHost = "8080-demo.sandbox.localhost";

TEST_F(ConnectionTest, RefusedCredentialsAre401AndAllCandidatesGoInOneOpen) {
  start();
  node_->on_open = [](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return Result<OpenAnswer>(OpenAnswer{401, "invalid token", {}});
  };
  std::string r = exchange(kHost, "GET / HTTP/1.1\r\nHost: " + kHost +
                                      "\r\nAuthorization: Bearer apps-own\r\nCookie: __Host-sandgate_token=tok\r\n\r\n");
  EXPECT_NE(r.find("HTTP/1.1 401"), std::string::npos) << r;
  EXPECT_NE(r.find("WWW-Authenticate: Bearer realm=\"sandgate\""), std::string::npos) << r;
  std::lock_guard lock(node_->mu);
  ASSERT_EQ(node_->opens.size(), 1u);
  EXPECT_EQ(node_->opens[0].credentials, (std::vector<std::string>{"apps-own", "tok"}));
  EXPECT_EQ(node_->opens[0].sandbox, "demo");
  EXPECT_EQ(node_->opens[0].port, 8080);
}

TEST_F(ConnectionTest, TheEdgesOwnAnswerToHeadHasNoContent) {
  start();
  node_->on_open = [](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return Result<OpenAnswer>(OpenAnswer{401, "invalid token", {}});
  };
  std::string r = exchange(kHost, "HEAD / HTTP/1.1\r\nHost: " + kHost + "\r\nAuthorization: Bearer nope\r\n\r\n");
  ASSERT_EQ(r.rfind("HTTP/1.1 401", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Length: 0\r\n"), std::string::npos) << r;
  EXPECT_EQ(r.substr(r.size() - 4), "\r\n\r\n") << "nothing after the head: " << r;
}

TEST_F(ConnectionTest, NodeFailuresAreAnsweredWithTheirStatus) {
  start("wake_timeout_ms = 300\nhandshake_timeout_ms = 2000\n");
  struct Case {
    int status;                  // the node's answer, or 0 for `failure`
    std::optional<Error> failure;  // the node not answering properly; neither: never answered at all
    std::string status_line;
    std::string cause;
  };
  const std::vector<Case> cases = {
      {404, {}, "HTTP/1.1 404", "unknown_sandbox"},
      {403, {}, "HTTP/1.1 403", "port_not_exposed"},
      {504, {}, "HTTP/1.1 503", "wake_timeout"},
      {0, Error::kUnavailable, "HTTP/1.1 503", "node_unavailable"},
      {0, Error::kInternal, "HTTP/1.1 502", "node_unavailable"},
      {0, {}, "HTTP/1.1 503", "wake_timeout"},  // never answered: the connection's deadline
  };
  for (const Case& c : cases) {
    node_->on_open = [c](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
      if (c.status != 0) return Result<OpenAnswer>(OpenAnswer{c.status, "from the fake", {}});
      if (c.failure) return Result<OpenAnswer>(fail(*c.failure, "from the fake"));
      return std::nullopt;
    };
    std::string r = exchange(kHost, "GET / HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n");
    EXPECT_EQ(r.rfind(c.status_line, 0), 0u) << c.cause << ": " << r;
    std::string log = access_log_when("\"" + c.cause + "\"");
    size_t at = log.find("\"" + c.cause + "\"");
    ASSERT_NE(at, std::string::npos) << c.cause;
    size_t begin = log.rfind('\n', at), end = log.find('\n', at);
    std::string line = log.substr(begin == std::string::npos ? 0 : begin + 1, end == std::string::npos ? end : end - begin - 1);
    EXPECT_NE(line.find("\"phase\":\"open\""), std::string::npos) << "decided while opening: " << line;
  }
}

// A public raw-TCP port is opened right after the handshake, with no head for a filter to read, so the open's
// answer must still call it public tcp: a port whose policy changed since the ClientHello's lookup (or since
// another node's view of it, on a hop) is not handed unfiltered bytes.
TEST_F(ConnectionTest, AHeadlessTcpConnectionNeedsAPortThatIsStillPublicTcp) {
  start("wake_at_client_hello = false\n");
  node_->policy = PortPolicy{"sb-demo", "tcp", true};
  for (const char* now : {"tcp", "http1"}) {
    node_->on_open = [now](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
      UniqueFd end;
      Result<OpenAnswer> a = opened(&end, std::nullopt, /*is_public=*/true);
      a->opened.policy.protocol = now;
      // The server speaks first, then closes: its bytes wait in the socket for the connection to carry.
      EXPECT_EQ(::write(end.get(), "banner\n", 7), 7);
      return a;
    };
    std::string r = exchange(kHost, "", /*offer_alpn=*/false);
    if (std::string_view(now) == "tcp") {
      EXPECT_EQ(r, "banner\n");
    } else {
      EXPECT_EQ(r, "") << "nothing of the sandbox's, and no HTTP answer to a raw client";
      EXPECT_NE(access_log_when("no longer a public tcp port").find("\"unauthorized\""), std::string::npos);
    }
  }
}

TEST_F(ConnectionTest, ForwardsWithoutTheCredentialAndRefusesAnotherHostOnTheConnection) {
  start();
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> { return end.open(0); };
  std::string seen;
  on_sent = [&] {
    // The sandbox answers the first request; the edge then gives it a FIN for the refused second one.
    UniqueFd sandbox = end.take();
    seen = sandbox_reads(sandbox.get(), "\r\n\r\n");
    const std::string answer = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    ::send(sandbox.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
    seen += sandbox_reads(sandbox.get(), "never");  // until the edge's FIN
    sandbox.reset();
  };
  std::string r = exchange(kHost, "GET /one HTTP/1.1\r\nHost: " + kHost + "\r\nAuthorization: Bearer tok\r\n\r\n" +
                                      "GET /two HTTP/1.1\r\nHost: 8080-other.sandbox.localhost\r\n\r\n");
  EXPECT_EQ(seen, "GET /one HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n");
  const size_t ok = r.find("HTTP/1.1 200 OK");
  const size_t misdirected = r.find("HTTP/1.1 421");
  EXPECT_NE(ok, std::string::npos) << r;
  EXPECT_NE(misdirected, std::string::npos) << r;
  EXPECT_LT(ok, misdirected) << r;
  EXPECT_NE(access_log_when("misdirected").find("\"misdirected\""), std::string::npos);
}

// One h2 frame: 24-bit length, type, flags, stream id (RFC 9113 §4.1).
std::string h2_frame(uint8_t type, uint8_t flags, uint32_t stream, std::string_view payload) {
  std::string f;
  f.push_back(static_cast<char>(payload.size() >> 16));
  f.push_back(static_cast<char>(payload.size() >> 8));
  f.push_back(static_cast<char>(payload.size()));
  f.push_back(static_cast<char>(type));
  f.push_back(static_cast<char>(flags));
  for (int shift : {24, 16, 8, 0}) f.push_back(static_cast<char>(stream >> shift));
  f.append(payload);
  return f;
}

TEST_F(ConnectionTest, AnH2ConnectionErrorInALaterRequestIsAnsweredWithGoaway) {
  start();
  node_->policy = PortPolicy{"sb-demo", "h2c", true};  // the ClientHello's lookup: h2 is offered
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    auto a = end.open(std::nullopt, /*is_public=*/true);
    if (a) a->opened.policy.protocol = "h2c";
    return a;
  };
  constexpr uint8_t kHeaders = 1, kSettings = 4, kGoaway = 7, kEndStream = 1, kEndHeaders = 4;
  std::string seen;
  on_sent = [&] {
    UniqueFd sandbox = end.take();
    const std::string server_preface = h2_frame(kSettings, 0, 0, "");
    ::send(sandbox.get(), server_preface.data(), server_preface.size(), MSG_NOSIGNAL);
    seen = sandbox_reads(sandbox.get(), "never");  // until the edge's FIN
  };
  // :method GET, :scheme https, :path / (static table), :authority literal.
  const std::string block = std::string("\x82\x87\x84\x41") + static_cast<char>(kHost.size()) + kHost;
  const std::string request = std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + h2_frame(kSettings, 0, 0, "") +
                              h2_frame(kHeaders, kEndStream | kEndHeaders, 1, block) +
                              // Indexed field 0 does not exist (RFC 7541 §6.1): the client's HPACK is broken.
                              h2_frame(kHeaders, kEndStream | kEndHeaders, 3, "\x80");
  std::string r = exchange(kHost, request, true, "\x02h2");
  // The client got the sandbox's preface, then GOAWAY(last stream 1, COMPRESSION_ERROR), then the end.
  // Type, flags 0, stream 0; then the payload: last stream id, error code.
  const size_t at = r.find(std::string(1, static_cast<char>(kGoaway)) + std::string(5, '\0'));
  ASSERT_NE(at, std::string::npos) << "no GOAWAY in " << r.size() << " bytes";
  EXPECT_EQ(r.substr(at + 6, 8), std::string("\0\0\0\1\0\0\0\x09", 8));
  // Stream 1 reached the sandbox, stream 3 did not: the HEADERS frames after the preface, by stream.
  std::vector<uint32_t> header_streams;
  for (size_t pos = 24; pos + 9 <= seen.size();) {
    const size_t len = (size_t{uint8_t(seen[pos])} << 16) | (size_t{uint8_t(seen[pos + 1])} << 8) | uint8_t(seen[pos + 2]);
    uint32_t stream = 0;
    for (int i = 5; i < 9; ++i) stream = (stream << 8) | uint8_t(seen[pos + i]);
    if (uint8_t(seen[pos + 3]) == kHeaders) header_streams.push_back(stream & 0x7fffffff);
    pos += 9 + len;
  }
  EXPECT_EQ(header_streams, std::vector<uint32_t>{1});
  EXPECT_NE(access_log_when("bad_request").find("HPACK"), std::string::npos);
}

// Right after a crash the worker may not know the node is gone: its event stream ended while the dying node
// still accepted (its listener closes a moment after the stream), so the outage would begin at the stream's
// next attempt, a second later. Until then the cache routes nothing; a connection whose open the node then
// refuses starts the outage itself and is served from the cached route, not answered 503.
TEST_F(ConnectionTest, AnOpenTheCrashedNodeRefusesIsServedFromTheCacheBeforeTheStreamNoticesTheOutage) {
  route_events_ = true;
  start("activity_report_interval_ms = 50\n");
  node_->policy.is_public = true;
  node_->crash_at_next_report = true;
  // The sandbox's port for the cached route's spares.
  UniqueFd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener.get(), 8), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const uint16_t port = ntohs(addr.sin_port);

  SandboxEnd end;
  std::atomic<int> opens{0};
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    if (opens++ > 0) return Result<OpenAnswer>(fail(Error::kUnavailable, "connect: Connection refused"));
    Result<OpenAnswer> a = end.open(std::nullopt, true);
    for (int i = 0; i < 4; ++i) a->opened.spares.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    a->opened.cache_ms = 60'000;
    a->opened.connect_port = port;
    return a;
  };
  on_sent = [&] {
    UniqueFd sandbox = end.take();
    sandbox_reads(sandbox.get(), "\r\n\r\n");
    const std::string answer = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nfirst";
    ::send(sandbox.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
  };
  const std::string request = "GET / HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n";
  ASSERT_NE(exchange(kHost, request).find("first"), std::string::npos);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!node_->crashed && std::chrono::steady_clock::now() < deadline) ::usleep(5000);
  ASSERT_TRUE(node_->crashed) << "the activity report that ends the node's stream never came";

  on_sent = [&] {
    pollfd p{listener.get(), POLLIN, 0};
    if (::poll(&p, 1, 5000) != 1) return;
    UniqueFd sandbox(::accept(listener.get(), nullptr, nullptr));
    sandbox_reads(sandbox.get(), "\r\n\r\n");
    const std::string answer = "HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\ncached";
    ::send(sandbox.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
  };
  const std::string second = exchange(kHost, request);
  EXPECT_NE(second.find("cached"), std::string::npos) << second;
  EXPECT_EQ(opens, 2) << "the node was asked, refused, and the cache answered";
}

TEST_F(ConnectionTest, ARefusedPipelinedRequestIsAnsweredWhenTheSandboxHasAnsweredTheOnesBefore) {
  start();
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> { return end.open(0); };
  UniqueFd sandbox;
  on_sent = [&] {
    // The sandbox answers both requests it got and keeps the connection open (it never closes it).
    sandbox = end.take();
    sandbox_reads(sandbox.get(), "GET /two");
    sandbox_reads(sandbox.get(), "\r\n\r\n");
    const std::string answers = "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none"
                                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\n";
    ::send(sandbox.get(), answers.data(), answers.size(), MSG_NOSIGNAL);
  };
  const auto started = std::chrono::steady_clock::now();
  std::string r = exchange(kHost, "GET /one HTTP/1.1\r\nHost: " + kHost + "\r\n\r\nGET /two HTTP/1.1\r\nHost: " +
                                      kHost + "\r\n\r\nGET /three HTTP/1.1\r\nHost: 8080-other.sandbox.localhost\r\n\r\n");
  // Both answers, then the 421, and the connection ended by the edge (not the 5 s read timeout).
  const size_t two = r.find("3\r\ntwo\r\n0\r\n\r\n");
  const size_t misdirected = r.find("HTTP/1.1 421");
  ASSERT_NE(two, std::string::npos) << r;
  ASSERT_NE(misdirected, std::string::npos) << r;
  EXPECT_LT(two, misdirected);
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(4));
}

TEST_F(ConnectionTest, AnUpgradeTheSandboxRefusesLeavesTheNextRequestsChecked) {
  start();
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> { return end.open(0); };
  std::string seen;
  on_sent = [&] {
    UniqueFd sandbox = end.take();
    seen = sandbox_reads(sandbox.get(), "\r\n\r\n");
    const std::string refusal = "HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n\r\n";
    ::send(sandbox.get(), refusal.data(), refusal.size(), MSG_NOSIGNAL);
    seen += sandbox_reads(sandbox.get(), "never");  // until the edge ends it
  };
  std::string r = exchange(kHost, "GET /ws HTTP/1.1\r\nHost: " + kHost +
                                      "\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
                                      "GET /other HTTP/1.1\r\nHost: 8080-other.sandbox.localhost\r\n"
                                      "Cookie: __Host-sandgate_token=victims\r\n\r\n");
  EXPECT_NE(r.find("HTTP/1.1 426"), std::string::npos) << r;
  EXPECT_NE(r.find("HTTP/1.1 421"), std::string::npos) << r;
  EXPECT_EQ(seen.find("/other"), std::string::npos) << seen;
  EXPECT_EQ(seen.find("victims"), std::string::npos) << seen;
}

TEST_F(ConnectionTest, AnUpgradeTheSandboxAcceptsPassesWhatFollowsAsIs) {
  start();
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> { return end.open(0); };
  std::string seen;
  on_sent = [&] {
    UniqueFd sandbox = end.take();
    seen = sandbox_reads(sandbox.get(), "\r\n\r\n");
    const std::string accepted = "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\n";
    ::send(sandbox.get(), accepted.data(), accepted.size(), MSG_NOSIGNAL);
    seen += sandbox_reads(sandbox.get(), "not http");
    ::send(sandbox.get(), "bye", 3, MSG_NOSIGNAL);
  };
  std::string r = exchange(kHost, "GET /x HTTP/1.1\r\nHost: " + kHost +
                                      "\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\nGET not http\r\n\r\n");
  EXPECT_NE(seen.find("GET not http\r\n\r\n"), std::string::npos) << seen;
  EXPECT_NE(r.find("HTTP/1.1 101"), std::string::npos) << r;
}

TEST_F(ConnectionTest, AKnownPortSkipsTheLookupAndA404ForgetsIt) {
  start("wake_at_client_hello = false\n");  // its own lookup otherwise (the next test)
  node_->on_open = [](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return Result<OpenAnswer>(OpenAnswer{401, "missing token", {}});
  };
  const std::string request = "GET / HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n";
  exchange(kHost, request, /*offer_alpn=*/false);
  exchange(kHost, request, /*offer_alpn=*/false);
  {
    std::lock_guard lock(node_->mu);
    EXPECT_EQ(node_->lookups, 1) << "the second ClientHello found the policy in the cache";
  }
  node_->on_open = [](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return Result<OpenAnswer>(OpenAnswer{404, "no such sandbox", {}});
  };
  exchange(kHost, request, /*offer_alpn=*/false);
  exchange(kHost, request, /*offer_alpn=*/false);
  std::lock_guard lock(node_->mu);
  EXPECT_EQ(node_->lookups, 2) << "after a 404 the next connection asks again";
}

// proxy.wake_at_client_hello: a ClientHello for a sandbox that no cached route says is running asks the node
// to start waking it, before the request head (and its credential) arrived: in the policy lookup when there is
// one, else in a lookup of its own, once per connection; the open then tells the node the client's address,
// which is how the node decides whom such a wake is for (noderuntime/prewake_gate.h).
TEST_F(ConnectionTest, AClientHelloAsksTheNodeToStartWakingItsSandbox) {
  start("wake_at_client_hello = true\n");
  SandboxEnd sandbox;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> { return sandbox.open(0); };
  const std::string request = "GET / HTTP/1.1\r\nHost: " + kHost + "\r\nAuthorization: Bearer tok\r\n\r\n";
  // HTTP/1.1 only: no policy lookup is needed, so the wake is asked for by a lookup of its own.
  on_sent = [&] {
    UniqueFd end = sandbox.take();
    sandbox_reads(end.get(), "\r\n\r\n");
    const char answer[] = "HTTP/1.1 204 No Content\r\n\r\n";
    (void)::send(end.get(), answer, sizeof answer - 1, MSG_NOSIGNAL);
  };
  std::string r = exchange(kHost, request);
  EXPECT_EQ(r.rfind("HTTP/1.1 204", 0), 0u) << r;
  {
    std::lock_guard lock(node_->mu);
    EXPECT_EQ(node_->calls, (std::vector<std::string>{"lookup demo:8080 client=127.0.0.1 prewake",
                                                      "open demo:8080 client=127.0.0.1"}));
    node_->calls.clear();
  }
  EXPECT_EQ(access_log_count("\"prewake\":true", 1), 1u);
  // The open found it running: the next ClientHello asks nothing (the policy and that mark are cached).
  exchange(kHost, request);
  {
    std::lock_guard lock(node_->mu);
    EXPECT_EQ(node_->calls, (std::vector<std::string>{"open demo:8080 client=127.0.0.1"}));
    node_->calls.clear();
  }
  // No ALPN, another sandbox: the policy lookup the handshake waits for carries the wake; no second call.
  const std::string other = "8080-other.sandbox.localhost";
  exchange(other, "GET / HTTP/1.1\r\nHost: " + other + "\r\nAuthorization: Bearer tok\r\n\r\n", /*offer_alpn=*/false);
  {
    std::lock_guard lock(node_->mu);
    EXPECT_EQ(node_->calls, (std::vector<std::string>{"lookup other:8080 client=127.0.0.1 prewake",
                                                      "open other:8080 client=127.0.0.1"}));
    node_->calls.clear();
  }
  // A lookup that heard "running or waking already" is remembered like a successful open, even when the
  // request is then refused; "unavailable" (fenced, not exposed...) is not.
  on_sent = nullptr;
  node_->on_open = [](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return Result<OpenAnswer>(OpenAnswer{401, "missing token", {}});
  };
  for (const std::string answer : {"not_asleep", "unavailable"}) {
    node_->prewake_answer = answer;
    const std::string name = answer == "not_asleep" ? "third" : "fourth";
    const std::string host = "8080-" + name + ".sandbox.localhost";
    for (int i = 0; i < 2; ++i) exchange(host, "GET / HTTP/1.1\r\nHost: " + host + "\r\n\r\n");
    std::lock_guard lock(node_->mu);
    const std::string lookup = "lookup " + name + ":8080 client=127.0.0.1 prewake", open = "open " + name + ":8080 client=127.0.0.1";
    const std::vector<std::string> want = answer == "not_asleep" ? std::vector<std::string>{lookup, open, open}
                                                                 : std::vector<std::string>{lookup, open, lookup, open};
    EXPECT_EQ(node_->calls, want) << answer;
    node_->calls.clear();
  }
}

TEST_F(ConnectionTest, WithWakeAtClientHelloOffTheHandshakeAsksNothing) {
  start("wake_at_client_hello = false\n");
  node_->on_open = [](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return Result<OpenAnswer>(OpenAnswer{401, "missing token", {}});
  };
  exchange(kHost, "GET / HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n");
  std::lock_guard lock(node_->mu);
  EXPECT_EQ(node_->calls, (std::vector<std::string>{"open demo:8080 client=127.0.0.1"}));
}

TEST_F(ConnectionTest, HandshakePhase) {
  start("handshake_timeout_ms = 300\n");
  // An SNI outside the domain and every certificate: refused in the handshake, before any node call.
  EXPECT_EQ(exchange("x.example.com", "GET / HTTP/1.1\r\n\r\n"), "[handshake failed]");
  EXPECT_NE(access_log_when("unknown_sni").find("\"unknown_sni\""), std::string::npos);
  // A client that connects and says nothing: the handshake deadline ends it.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(worker_->bound()[0].port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_NE(access_log_when("handshake_timeout").find("\"handshake_timeout\""), std::string::npos);
  ::close(fd);
  std::lock_guard lock(node_->mu);
  EXPECT_TRUE(node_->opens.empty());
}

TEST_F(ConnectionTest, HeadPhase) {
  start("request_head_timeout_ms = 300\nmax_request_head_bytes = 1024\n");
  std::string slow = exchange(kHost, "GET / HTTP/1.1\r\nHost: " + kHost + "\r\n");  // never finished
  EXPECT_EQ(slow.rfind("HTTP/1.1 408", 0), 0u) << slow;
  std::string large = exchange(kHost, "GET / HTTP/1.1\r\nHost: " + kHost + "\r\nX: " + std::string(2000, 'x') + "\r\n\r\n");
  EXPECT_EQ(large.rfind("HTTP/1.1 431", 0), 0u) << large;
  std::string other = exchange(kHost, "GET / HTTP/1.1\r\nHost: 8080-other.sandbox.localhost\r\n\r\n");
  EXPECT_EQ(other.rfind("HTTP/1.1 421", 0), 0u) << "Host must match the SNI: " << other;
  std::lock_guard lock(node_->mu);
  EXPECT_TRUE(node_->opens.empty()) << "nothing was asked of the node";
}

TEST_F(ConnectionTest, ConnectPhaseRefusedPortIs502) {
  start();
  // A port nobody listens on: bound, then closed.
  int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t len = sizeof addr;
  ::getsockname(probe, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(probe);
  const uint16_t closed_port = ntohs(addr.sin_port);
  node_->on_open = [closed_port](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    UniqueFd unused;
    Result<OpenAnswer> a = opened(&unused, std::nullopt, /*is_public=*/true);
    a->opened.connected = false;
    a->opened.connect_port = closed_port;
    a->opened.socket = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    return a;
  };
  std::string r = exchange(kHost, "GET / HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 502", 0), 0u) << r;
  EXPECT_NE(access_log_when("upstream_connect_failed").find("\"upstream_connect_failed\""), std::string::npos);
}

TEST_F(ConnectionTest, ForwardPhaseEndsWhenTheSandboxCloses) {
  start();
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return end.open(std::nullopt, /*is_public=*/true);
  };
  on_sent = [&] {
    UniqueFd sandbox = end.take();
    sandbox_reads(sandbox.get(), "\r\n\r\n");
    const std::string answer = "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it";
    ::send(sandbox.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
    sandbox.reset();  // EOF after the body: the edge sends close_notify and the connection ends
  };
  std::string r = exchange(kHost, "GET / HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n");
  EXPECT_EQ(r, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it");
  EXPECT_NE(access_log_when("upstream_closed").find("\"upstream_closed\""), std::string::npos);
}

// Issue 12: a keep-alive connection keeps its forwarding memory (buffers, TLS records) between requests, and
// gives it back once quiet for Connection::kReleaseIdleMemoryAfterMs (1 s), staying open; the next request
// takes it again.
TEST_F(ConnectionTest, AQuietKeepAliveConnectionGivesItsBuffersBackAndServesTheNextRequest) {
  start();
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return end.open(std::nullopt, /*is_public=*/true);
  };
  const ProxyMetrics& metrics = shared_->metrics;
  auto c = connect_tls(kHost);
  ASSERT_TRUE(c);
  UniqueFd sandbox;
  auto request = [&](const std::string& path) {
    const std::string req = "GET " + path + " HTTP/1.1\r\nHost: " + kHost + "\r\n\r\n";
    if (SSL_write(c->ssl, req.data(), static_cast<int>(req.size())) <= 0) return std::string("[write failed]");
    if (!sandbox.valid()) sandbox = end.take();
    if (sandbox_reads(sandbox.get(), "\r\n\r\n").find(path) == std::string::npos) return std::string("[not forwarded]");
    const std::string answer = "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(path.size()) + "\r\n\r\n" + path;
    ::send(sandbox.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
    std::string got;
    char buf[4096];
    while (got.size() < answer.size()) {
      int n = SSL_read(c->ssl, buf, sizeof buf);
      if (n <= 0) break;
      got.append(buf, static_cast<size_t>(n));
    }
    return got;
  };
  auto holding_becomes = [&](int64_t want, std::chrono::milliseconds within) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (metrics.connections_holding_buffers() != want && std::chrono::steady_clock::now() < deadline) ::usleep(5000);
    return metrics.connections_holding_buffers() == want;
  };

  EXPECT_EQ(request("/one").rfind("HTTP/1.1 200 OK", 0), 0u);
  // The worker counts it once its turn ends, which may be after the client has the answer.
  EXPECT_TRUE(holding_becomes(1, std::chrono::seconds(5))) << "kept for the next request";
  const auto quiet_from = std::chrono::steady_clock::now();
  ASSERT_TRUE(holding_becomes(0, std::chrono::seconds(5)));
  EXPECT_GE(std::chrono::steady_clock::now() - quiet_from, std::chrono::milliseconds(900)) << "given back too soon";
  EXPECT_EQ(request("/two").rfind("HTTP/1.1 200 OK", 0), 0u) << "the connection is still open";
  EXPECT_TRUE(holding_becomes(1, std::chrono::seconds(5)));
  ASSERT_TRUE(holding_becomes(0, std::chrono::seconds(5)));
  c.reset();
  sandbox.reset();
  EXPECT_EQ(access_log_count("\"cause\"", 1), 1u) << "the connection ended";
  EXPECT_TRUE(holding_becomes(0, std::chrono::seconds(5))) << "an ended connection holds nothing";
}

// A pump moves bytes for at most kPumpRounds rounds, then lets the worker's other connections in. When its
// budget runs out with the rest of an upload already read from the socket into OpenSSL (read-ahead brings
// in 64 KiB at a time), no socket event will come for it: the pump must go on at the next loop turn
// (Worker::pump_again). Where the budget ends relative to OpenSSL's reads depends on the size, so a range
// of sizes is sent, each as one burst the client does not follow with anything (it waits for the answer).
TEST_F(ConnectionTest, AnUploadLeftInsideOpenSslWhenThePumpsBudgetEndsIsStillForwarded) {
  start();
  SandboxEnd end;
  node_->on_open = [&](const OpenRequest&) -> std::optional<Result<OpenAnswer>> {
    return end.open(std::nullopt, /*is_public=*/true);
  };
  for (size_t size = 256 * 1024; size <= 384 * 1024; size += 1024 + 37) {
    SCOPED_TRACE("body of " + std::to_string(size) + " bytes");
    auto c = connect_tls(kHost);
    ASSERT_TRUE(c);
    const std::string head = "POST /upload HTTP/1.1\r\nHost: " + kHost + "\r\nContent-Length: " +
                             std::to_string(size) + "\r\n\r\n";
    const std::string request = head + std::string(size, 'u');
    std::atomic<bool> written{false};
    std::thread writer([&] {
      size_t sent = 0;
      while (sent < request.size()) {
        int n = SSL_write(c->ssl, request.data() + sent, static_cast<int>(request.size() - sent));
        if (n <= 0) return;
        sent += static_cast<size_t>(n);
      }
      written = true;
    });
    UniqueFd sandbox = end.take();
    size_t got = 0;
    if (sandbox.valid()) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      char buf[65536];
      while (got < request.size() && std::chrono::steady_clock::now() < deadline) {
        pollfd p{sandbox.get(), POLLIN, 0};
        if (::poll(&p, 1, 100) <= 0) continue;
        ssize_t n = ::recv(sandbox.get(), buf, sizeof buf, 0);
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
    }
    writer.join();
    EXPECT_TRUE(written) << "the client could not send it all";
    ASSERT_EQ(got, request.size()) << "the sandbox got part of the upload only";
  }
}

TEST_F(ConnectionTest, LingerPhase) {
  start();
  const std::string refused = "GET / HTTP/1.1\r\nHost: 8080-other.sandbox.localhost\r\n\r\n";
  const std::string chunk(64 * 1024, 'x');
  // After its answer the edge drains what the client still sends (no reset that would destroy the answer
  // before it is read), and the connection ends, for the answer's cause, when the client is done.
  {
    auto c = connect_tls(kHost);
    ASSERT_TRUE(c);
    SSL_write(c->ssl, refused.data(), static_cast<int>(refused.size()));
    std::string r = read_answer(c->ssl);
    EXPECT_EQ(r.rfind("HTTP/1.1 421", 0), 0u) << r;
    // Still lingering: the line is written when the connection ends.
    EXPECT_EQ(access_log_count("\"misdirected\"", 0), 0u);
    // Unread input while lingering is taken and dropped, up to the bound: these sends all go through.
    for (int i = 0; i < 16; ++i)
      ASSERT_EQ(::send(c->fd, chunk.data(), chunk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(chunk.size())) << i;
    ::shutdown(c->fd, SHUT_WR);
    EXPECT_EQ(access_log_count("\"misdirected\"", 1), 1u) << "ended at the client's EOF";
  }
  // A client that keeps sending is cut at the bound (4 MiB).
  {
    auto c = connect_tls(kHost);
    ASSERT_TRUE(c);
    SSL_write(c->ssl, refused.data(), static_cast<int>(refused.size()));
    EXPECT_EQ(read_answer(c->ssl).rfind("HTTP/1.1 421", 0), 0u);
    size_t sent = 0;
    while (sent < 64u * 1024 * 1024) {
      ssize_t n = ::send(c->fd, chunk.data(), chunk.size(), MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    EXPECT_GT(sent, 4u * 1024 * 1024);
    EXPECT_LT(sent, 64u * 1024 * 1024) << "the edge stopped draining";
    EXPECT_EQ(access_log_count("\"misdirected\"", 2), 2u);
  }
  // A client that neither sends nor closes is let go at the linger deadline, with the answer's cause.
  {
    auto c = connect_tls(kHost);
    ASSERT_TRUE(c);
    SSL_write(c->ssl, refused.data(), static_cast<int>(refused.size()));
    const auto answered = std::chrono::steady_clock::now();
    EXPECT_EQ(read_answer(c->ssl).rfind("HTTP/1.1 421", 0), 0u);
    EXPECT_EQ(access_log_count("\"misdirected\"", 3), 3u);
    // The linger deadline is 2 s: the connection was kept that long, not closed at once.
    EXPECT_GE(std::chrono::steady_clock::now() - answered, std::chrono::milliseconds(1500));
  }
}

}  // namespace
}  // namespace sg
