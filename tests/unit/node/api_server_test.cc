#include "noderuntime/api_server.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <linux/nsfs.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cctype>
#include <csignal>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>

#include "common/vouched_netns.h"
#include "noderuntime/image_service.h"
#include "noderuntime/names.h"
#include "tests/unit/snapshot/archive_builder.h"
#include "tests/unit/node/fake_driver.h"

namespace sg {
namespace {

using json = nlohmann::json;
using testing::FakeDriver;
using testing::run_until;
using testing::TempDir;

// "2026-11-29T10:00:00.000Z": digits where digits belong, the separators exactly.
bool is_rfc3339_utc_ms(const std::string& s) {
  const std::string shape = "dddd-dd-ddTdd:dd:dd.dddZ";
  if (s.size() != shape.size()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (shape[i] == 'd' ? !std::isdigit(static_cast<unsigned char>(s[i])) : s[i] != shape[i]) return false;
  }
  return true;
}

struct Reply {
  int status = 0;
  HttpMessage message;
  UniqueFd fd;                  // the first descriptor that came with it
  std::vector<UniqueFd> spares;  // the others (an open's spare sockets, internal/sockets)
  json body() const { return json::parse(message.body, nullptr, false); }
};

// A blocking-style HTTP client driven from the test thread: while it waits it turns the server's loop, so
// server and client share one thread and every test is deterministic.
class Client {
 public:
  Client(uv_loop_t* loop, const Endpoint& ep) : loop_(loop) {
    // The kernel completes the connect from the listen backlog, so blocking here needs no loop turn.
    auto fd = connect_blocking(ep, 1000);
    if (!fd) return;
    fd_ = std::move(*fd);
    ::fcntl(fd_.get(), F_SETFL, ::fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
    connected_ = true;
  }

  bool connected() const { return connected_; }
  int raw_fd() const { return fd_.get(); }
  std::string host = "node";  // the Host header request() sends

  // Raw bytes (a stream that never ends, internal/events): reads until what arrived so far contains
  // `needle`, and returns all of it.
  std::string read_until(const std::string& needle, int timeout_ms = 3000) {
    run_until(
        loop_,
        [&] {
          if (buffer_.find(needle) != std::string::npos) return true;
          char buf[4096];
          ssize_t n = ::recv(fd_.get(), buf, sizeof buf, 0);
          if (n == 0) eof_ = true;
          if (n > 0) buffer_.append(buf, static_cast<size_t>(n));
          return eof_ || buffer_.find(needle) != std::string::npos;
        },
        timeout_ms);
    return buffer_;
  }

  // Sends everything, or stops early when the server closed its end (that is what some tests provoke).
  bool send(std::string_view data) {
    size_t off = 0;
    bool failed = false;
    run_until(loop_, [&] {
      ssize_t n = ::send(fd_.get(), data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n > 0) off += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN) failed = true;
      return failed || off == data.size();
    });
    return !failed && off == data.size();
  }

  std::optional<Reply> read(int timeout_ms = 3000) {
    HttpParser parser(HttpParser::Kind::kResponse, HttpLimits{64 * 1024, 16 * 1024 * 1024, false});
    std::optional<Reply> out;
    auto parse_buffered = [&] {
      if (buffer_.empty()) return false;
      HttpParser::State st = parser.feed(buffer_);
      buffer_.erase(0, parser.consumed());
      if (st == HttpParser::State::kMessageComplete) {
        out.emplace();
        out->status = parser.message().status;
        out->message = parser.message();
        if (!pending_fds_.empty()) {
          out->fd = std::move(pending_fds_.front());
          for (size_t i = 1; i < pending_fds_.size(); ++i) out->spares.push_back(std::move(pending_fds_[i]));
          pending_fds_.clear();
        }
        return true;
      }
      return st == HttpParser::State::kError;
    };
    run_until(
        loop_,
        [&] {
          if (parse_buffered()) return true;
          char buf[64 * 1024];
          bool would_block = false;
          auto n = recv_with_fds(fd_.get(), buf, sizeof buf, &pending_fds_, &would_block);
          if (!n) return true;
          if (would_block) return false;
          if (*n == 0) {
            eof_ = true;
            return true;
          }
          buffer_.append(buf, *n);
          return parse_buffered();
        },
        timeout_ms);
    return out;
  }

  Reply request(const std::string& method, const std::string& path, const std::string& body = "",
                const std::string& headers = "") {
    std::string req = method + " " + path + " HTTP/1.1\r\nHost: " + host + "\r\n" + headers;
    if (!body.empty() || method == "POST")
      req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    req += "\r\n" + body;
    EXPECT_TRUE(send(req));
    auto r = read();
    EXPECT_TRUE(r.has_value()) << method << " " << path << ": no answer";
    return r ? std::move(*r) : Reply{};
  }

  // True once the server has closed the connection.
  bool eof(int timeout_ms = 3000) {
    if (!eof_) read(timeout_ms);
    return eof_;
  }

 private:
  uv_loop_t* loop_;
  UniqueFd fd_;
  bool connected_ = false;
  std::string buffer_;
  std::vector<UniqueFd> pending_fds_;
  bool eof_ = false;
};

class ApiServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    socket_path_ = dir_.path() + "/node.sock";
    auto cfg = load_config_string("node_socket = \"unix:" + socket_path_ + "\"\n[node]\nstate_dir = \"" +
                                      dir_.path() + "\"\n",
                                  "test.toml");
    ASSERT_TRUE(cfg.ok()) << cfg.message();
    config_ = std::make_unique<ConfigHolder>(*cfg);
    auto driver = std::make_unique<FakeDriver>(&loop_);
    driver_ = driver.get();
    auto store = Store::open(dir_.path() + "/node.db");
    ASSERT_TRUE(store.ok());
    std::vector<std::unique_ptr<Driver>> drivers;
    drivers.push_back(std::move(driver));
    node_ = std::make_unique<Node>(&loop_, config_.get(), std::move(drivers), std::move(*store));
    server_ = std::make_unique<ApiServer>(&loop_, node_.get(), config_.get());
    ASSERT_TRUE(server_->listen(*parse_endpoint("unix:" + socket_path_)).ok());
  }

  void TearDown() override {
    bool closed = false;
    server_->close([&] { closed = true; });
    EXPECT_TRUE(run_until(&loop_, [&] { return closed; }));
    server_.reset();
    node_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }

  Client client() { return Client(&loop_, *parse_endpoint("unix:" + socket_path_)); }

  // Port 8080 is public so the wake and plumbing tests need no token; the auth tests use private ports.
  std::string create_demo(Client& c, const std::string& extra = "") {
    Reply r = c.request("POST", "/v1/sandboxes",
                        R"({"name":"demo","command":["sleep","inf"],"ports":[{"port":8080,"public":true}])" + extra +
                            "}");
    EXPECT_EQ(r.status, 201) << r.message.body;
    return r.body().value("id", "");
  }

  static void expect_error(const Reply& r, int status, const std::string& code, const std::string& contains = "") {
    EXPECT_EQ(r.status, status) << r.message.body;
    json body = r.body();
    ASSERT_TRUE(body.is_object()) << r.message.body;
    EXPECT_EQ(body.value("error", ""), code) << r.message.body;
    EXPECT_NE(body.value("message", "").find(contains), std::string::npos) << r.message.body;
  }

  // Listens on a free loopback port; the node gets kOperatorToken. Returns the endpoint.
  static constexpr const char* kOperatorToken = "op-unit-7d1e52a9c0";
  Endpoint listen_tcp() {
    std::string token_path = dir_.path() + "/operator.token";
    {
      std::ofstream out(token_path);
      out << kOperatorToken << "\n";
    }
    EXPECT_EQ(::chmod(token_path.c_str(), 0600), 0);
    auto cfg = load_config_string("operator_token_file = \"" + token_path + "\"\n", "test.toml");
    EXPECT_TRUE(cfg.ok() && node_->load_operator_token(**cfg).ok());
    uint16_t port = 0;
    {
      auto probe = listen_on(*parse_endpoint("127.0.0.1:0"), false);  // find a free port
      EXPECT_TRUE(probe.ok());
      if (probe) port = *local_port(probe->get());
    }
    Endpoint tcp = *parse_endpoint("127.0.0.1:" + std::to_string(port));
    EXPECT_TRUE(server_->listen(tcp).ok());
    return tcp;
  }
  static std::string bearer(const std::string& token) { return "Authorization: Bearer " + token + "\r\n"; }

  uv_loop_t loop_;
  TempDir dir_;
  std::string socket_path_;
  std::unique_ptr<ConfigHolder> config_;
  FakeDriver* driver_ = nullptr;
  std::unique_ptr<Node> node_;
  std::unique_ptr<ApiServer> server_;
};

TEST_F(ApiServerTest, SocketIsGroupOnly) {
  struct stat st{};
  ASSERT_EQ(::stat(socket_path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

TEST_F(ApiServerTest, Health) {
  Client c = client();
  ASSERT_TRUE(c.connected());
  Reply r = c.request("GET", "/v1/health");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body(), json::parse(R"({"status":"ok","sandboxes":0,"driver":"fake","drivers":["fake"]})"));
  ASSERT_NE(r.message.header("Content-Length"), nullptr);
  EXPECT_EQ(*r.message.header("Content-Type"), "application/json");
}

TEST_F(ApiServerTest, SandboxLifecycle) {
  Client c = client();
  Reply created = c.request("POST", "/v1/sandboxes",
                            R"({"name":"demo","command":["python3","-m","http.server","8080"],"env":{"K":"V"},)"
                            R"("cwd":"/","exposed_ports":[8080],"timeout_secs":300,"cpus":1.0,"memory_mb":512,)"
                            R"("ephemeral":false})");
  ASSERT_EQ(created.status, 201) << created.message.body;
  json s = created.body();
  std::string id = s["id"];
  EXPECT_TRUE(looks_like_id(id)) << id;
  EXPECT_EQ(s["name"], "demo");
  EXPECT_EQ(s["state"], "running");
  EXPECT_EQ(s["state_reason"], "started");
  EXPECT_EQ(s["ephemeral"], false);
  EXPECT_EQ(s["driver"], "fake");
  EXPECT_EQ(s["command"], json::parse(R"(["python3","-m","http.server","8080"])"));
  EXPECT_EQ(s["env"], json::parse(R"({"K":"V"})"));
  EXPECT_EQ(s["cwd"], "/");
  EXPECT_EQ(s["exposed_ports"], json::parse("[8080]"));
  EXPECT_EQ(s["timeout_secs"], 300);
  EXPECT_EQ(s["cpus"], 1.0);
  EXPECT_EQ(s["memory_mb"], 512);
  EXPECT_TRUE(s["pid"].is_number_integer());
  EXPECT_TRUE(is_rfc3339_utc_ms(s["created_at"].get<std::string>())) << s["created_at"];
  EXPECT_TRUE(is_rfc3339_utc_ms(s["last_activity_at"].get<std::string>())) << s["last_activity_at"];
  EXPECT_TRUE(is_rfc3339_utc_ms(s["idle_deadline_at"].get<std::string>())) << s["idle_deadline_at"];
  EXPECT_EQ(s["connections"], 0);
  EXPECT_EQ(s["urls"], json::parse(R"({"8080":"https://8080-demo.sandbox.localhost:8443/"})"));
  EXPECT_EQ(s["ports"], json::parse(R"([{"port":8080,"public":false,"protocol":"http1"}])"));
  EXPECT_EQ(s["allow_unauthenticated_access"], false);
  EXPECT_EQ(s["agent_port"], 9501);
  ASSERT_TRUE(s["token"].is_string());
  std::string token = s["token"];
  EXPECT_TRUE(token.starts_with("sgt_")) << token;
  EXPECT_FALSE(c.request("GET", "/v1/sandboxes/demo").body().contains("token")) << "the token is shown once";
  EXPECT_FALSE(c.request("GET", "/v1/sandboxes").body()["sandboxes"][0].contains("token"));

  EXPECT_EQ(c.request("GET", "/v1/sandboxes/demo").body()["id"], id);
  EXPECT_EQ(c.request("GET", "/v1/sandboxes/" + id).body()["name"], "demo");
  Reply list = c.request("GET", "/v1/sandboxes");
  ASSERT_EQ(list.status, 200);
  ASSERT_EQ(list.body()["sandboxes"].size(), 1u);
  EXPECT_EQ(list.body()["sandboxes"][0]["id"], id);
  EXPECT_EQ(c.request("GET", "/v1/health").body()["sandboxes"], 1);

  Reply deleted = c.request("DELETE", "/v1/sandboxes/demo");
  EXPECT_EQ(deleted.status, 200);
  EXPECT_EQ(deleted.body()["state"], "terminated");
  expect_error(c.request("GET", "/v1/sandboxes/demo"), 404, "not_found");
  expect_error(c.request("DELETE", "/v1/sandboxes/demo"), 404, "not_found");
  EXPECT_TRUE(c.request("GET", "/v1/sandboxes").body()["sandboxes"].empty());
}

TEST_F(ApiServerTest, PortsAreExposedAndClosedAfterCreate) {
  Client c = client();
  ASSERT_EQ(c.request("POST", "/v1/sandboxes", R"({"name":"demo","command":["x"],"exposed_ports":[8080]})").status, 201);
  Reply put = c.request("PUT", "/v1/sandboxes/demo/ports/3000", R"({"public":true,"protocol":"h2c"})");
  ASSERT_EQ(put.status, 200) << put.message.body;
  EXPECT_EQ(put.body()["urls"]["3000"], "https://3000-demo.sandbox.localhost:8443/");
  EXPECT_EQ(put.body()["ports"], json::parse(R"([{"port":8080,"public":false,"protocol":"http1"},)"
                                             R"({"port":3000,"public":true,"protocol":"h2c"}])"));
  // No body: a private http1 port, the create's default.
  Reply plain = c.request("PUT", "/v1/sandboxes/demo/ports/3000");
  ASSERT_EQ(plain.status, 200) << plain.message.body;
  EXPECT_EQ(plain.body()["ports"][1], json::parse(R"({"port":3000,"public":false,"protocol":"http1"})"));
  expect_error(c.request("PUT", "/v1/sandboxes/demo/ports/3x"), 400, "invalid_argument", "'3x' is not a port number");
  expect_error(c.request("PUT", "/v1/sandboxes/demo/ports/123456"), 400, "invalid_argument");
  expect_error(c.request("PUT", "/v1/sandboxes/demo/ports/70000"), 400, "invalid_argument", "1-65535");
  expect_error(c.request("PUT", "/v1/sandboxes/demo/ports/3001", R"({"protocol":"quic"})"), 400, "invalid_argument",
               "'quic' is not one of http1, h2c, tcp");
  expect_error(c.request("PUT", "/v1/sandboxes/nope/ports/3001"), 404, "not_found");
  Reply post = c.request("POST", "/v1/sandboxes/demo/ports/3000");
  EXPECT_EQ(post.status, 405);
  Reply closed = c.request("DELETE", "/v1/sandboxes/demo/ports/3000");
  ASSERT_EQ(closed.status, 200) << closed.message.body;
  EXPECT_EQ(closed.body()["exposed_ports"], json::parse("[8080]"));
  expect_error(c.request("DELETE", "/v1/sandboxes/demo/ports/3000"), 404, "not_found", "does not expose port 3000");
}

TEST_F(ApiServerTest, UnnamedSandboxUsesItsIdInUrlsAndNullName) {
  Client c = client();
  Reply r = c.request("POST", "/v1/sandboxes", R"({"command":["x"],"exposed_ports":[3000],"name":null})");
  ASSERT_EQ(r.status, 201) << r.message.body;
  json s = r.body();
  EXPECT_TRUE(s["name"].is_null());
  EXPECT_EQ(s["urls"]["3000"], "https://3000-" + s["id"].get<std::string>() + ".sandbox.localhost:8443/");
}

TEST_F(ApiServerTest, BadJsonIsA400AndTheConnectionKeepsServing) {
  Client c = client();
  expect_error(c.request("POST", "/v1/sandboxes", "{nope"), 400, "invalid_argument", "not valid JSON");
  EXPECT_EQ(c.request("GET", "/v1/health").status, 200);
}

TEST_F(ApiServerTest, MalformedBodiesAreExplained) {
  struct Case {
    std::string body;
    std::string contains;
  };
  const std::string deep = std::string(400'000, '[') + std::string(400'000, ']');
  const Case cases[] = {
      {"", "got nothing"},
      {"null", "JSON object"},
      {"[1,2]", "JSON object"},
      {"\"text\"", "JSON object"},
      {deep, "JSON object"},
      {"{\"command\":[\"caf\xff\"]}", "not valid JSON"},
      {R"({})", "command is required"},
      {R"({"command":"ls"})", "command: must be an array of strings"},
      {R"({"command":[1]})", "command[]: must be a string"},
      {R"({"command":["ls"],"nmae":"x"})", "unknown field 'nmae'"},
      {R"({"command":["ls"],"name":5})", "name: must be a string or null"},
      {R"({"command":["ls"],"env":{"A":1}})", "env.A: must be a string"},
      {R"({"command":["ls"],"env":[]})", "env: must be an object"},
      {R"({"command":["ls"],"cwd":false})", "cwd: must be a string"},
      {R"({"command":["ls"],"exposed_ports":[true]})", "exposed_ports[]: must be an integer"},
      {R"({"command":["ls"],"exposed_ports":[18446744073709551615]})", "1-65535"},
      {R"({"command":["ls"],"ports":8080})", "ports: must be an array of objects"},
      {R"({"command":["ls"],"ports":[8080]})", "ports[]: must be an object"},
      {R"({"command":["ls"],"ports":[{"public":true}]})", "ports[].port is required"},
      {R"({"command":["ls"],"ports":[{"port":"22"}]})", "ports[].port: must be an integer"},
      {R"({"command":["ls"],"ports":[{"port":22,"public":"yes"}]})", "ports[].public: must be true or false"},
      {R"({"command":["ls"],"ports":[{"port":22,"protocol":2}]})", "ports[].protocol: must be a string"},
      {R"({"command":["ls"],"ports":[{"port":22,"protocol":"udp"}]})", "'udp' is not one of http1, h2c, tcp"},
      {R"({"command":["ls"],"ports":[{"port":22,"tls":true}]})", "unknown field 'ports[].tls'"},
      {R"({"command":["ls"],"ports":[{"port":0}]})", "ports: 0 is not a TCP port"},
      {R"({"command":["ls"],"ports":[{"port":22}],"exposed_ports":[22]})", "22 is listed twice"},
      {R"({"command":["ls"],"ports":[{"port":9501}]})", "agent's port"},
      {R"({"command":["ls"],"allow_unauthenticated_access":1})", "allow_unauthenticated_access: must be true or false"},
      {R"({"command":["ls"],"timeout_secs":1.5})", "timeout_secs: must be an integer"},
      {R"({"command":["ls"],"timeout_secs":"300"})", "timeout_secs: must be an integer"},
      {R"({"command":["ls"],"memory_mb":-1})", "memory_mb"},
      {R"({"command":["ls"],"pids_max":"64"})", "pids_max: must be an integer"},
      {R"({"command":["ls"],"image":7})", "image: must be a string"},
      {R"({"command":["ls"],"disk_mb":1.5})", "disk_mb: must be an integer"},
      {R"({"command":["ls"],"cpus":"1"})", "cpus: must be a number"},
      {R"({"command":["ls"],"ephemeral":"yes"})", "ephemeral: must be true or false"},
      {R"({"command":["ls"],"name":"Bad"})", "lowercase"},
      {R"({"command":["ls"],"name":"api"})", "reserved"},
  };
  Client c = client();
  for (const Case& k : cases) {
    SCOPED_TRACE(k.body.substr(0, 80));
    expect_error(c.request("POST", "/v1/sandboxes", k.body), 400, "invalid_argument", k.contains);
  }
  EXPECT_EQ(driver_->starts, 0);
  EXPECT_EQ(c.request("GET", "/v1/health").status, 200);
}

TEST_F(ApiServerTest, NameConflictIs409) {
  Client c = client();
  create_demo(c);
  expect_error(c.request("POST", "/v1/sandboxes", R"({"name":"demo","command":["x"]})"), 409, "already_exists");
}

TEST_F(ApiServerTest, OversizedBodyIs413) {
  Client c = client();
  std::string body(1024 * 1024 + 1, ' ');
  std::string head = "POST /v1/sandboxes HTTP/1.1\r\nHost: n\r\nContent-Length: " + std::to_string(body.size()) +
                     "\r\n\r\n";
  c.send(head + body);  // may be cut short: the server answers and closes as soon as the limit is crossed
  auto r = c.read();
  ASSERT_TRUE(r.has_value());
  expect_error(*r, 413, "limit_exceeded", "body");
  EXPECT_EQ(*r->message.header("Connection"), "close");
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(client().request("GET", "/v1/health").status, 200) << "the server keeps serving others";
}

TEST_F(ApiServerTest, OversizedHeadIs431) {
  Client c = client();
  std::string req = "GET /v1/health HTTP/1.1\r\nX-Big: " + std::string(20 * 1024, 'a') + "\r\n\r\n";
  c.send(req);
  auto r = c.read();
  ASSERT_TRUE(r.has_value());
  expect_error(*r, 431, "limit_exceeded", "head");
  EXPECT_TRUE(c.eof());
}

TEST_F(ApiServerTest, GarbageIs400) {
  Client c = client();
  c.send("THIS IS NOT HTTP\r\n\r\n");
  auto r = c.read();
  ASSERT_TRUE(r.has_value());
  expect_error(*r, 400, "invalid_argument", "malformed HTTP");
  EXPECT_TRUE(c.eof());
}

TEST_F(ApiServerTest, UnknownRoutesAndMethods) {
  Client c = client();
  expect_error(c.request("GET", "/"), 404, "not_found", "no such endpoint");
  expect_error(c.request("GET", "/v2/health"), 404, "not_found");
  expect_error(c.request("GET", "/v1/sandboxes/demo/logs"), 404, "not_found");
  expect_error(c.request("POST", "/v1/sandboxes//suspend"), 404, "not_found");
  Reply wrong = c.request("PUT", "/v1/sandboxes/demo");
  expect_error(wrong, 405, "unsupported");
  EXPECT_EQ(*wrong.message.header("Allow"), "GET, DELETE");
  expect_error(c.request("GET", "/v1/internal/open"), 405, "unsupported");
  EXPECT_EQ(c.request("GET", "/v1/health?verbose=1").status, 200);
}

TEST_F(ApiServerTest, SuspendAndResumeStatusCodes) {
  Client c = client();
  create_demo(c);
  // Each transition lasts longer than a request's round trip, so the calls below see it in progress (with the
  // 5 ms default, a sanitizer build's resume was over before the next request was answered).
  driver_->op_delay_ms = 300;
  c.request("POST", "/v1/sandboxes", R"({"name":"temp","command":["x"],"ephemeral":true})");
  Reply started = c.request("POST", "/v1/sandboxes/demo/suspend");
  EXPECT_EQ(started.status, 202);
  EXPECT_EQ(started.body()["state"], "suspending");
  EXPECT_EQ(c.request("POST", "/v1/sandboxes/demo/suspend").status, 200);
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
  EXPECT_EQ(c.request("POST", "/v1/sandboxes/demo/suspend").status, 200);
  EXPECT_EQ(c.request("POST", "/v1/sandboxes/demo/resume").status, 202);
  expect_error(c.request("POST", "/v1/sandboxes/demo/suspend"), 409, "conflict");
  EXPECT_EQ(c.request("POST", "/v1/sandboxes/demo/resume").status, 200);
  expect_error(c.request("POST", "/v1/sandboxes/temp/suspend"), 400, "invalid_argument", "ephemeral");
  expect_error(c.request("POST", "/v1/sandboxes/temp/resume"), 400, "invalid_argument", "ephemeral");
  expect_error(c.request("POST", "/v1/sandboxes/nope/suspend"), 404, "not_found");
}

TEST_F(ApiServerTest, OpenPassesTheSocket) {
  Client c = client();
  std::string id = create_demo(c);
  Reply r = c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080})");
  ASSERT_EQ(r.status, 200) << r.message.body;
  json body = r.body();
  EXPECT_EQ(body["id"], id);
  EXPECT_EQ(body["name"], "demo");
  EXPECT_EQ(body["port"], 8080);
  EXPECT_EQ(body["woke"], false);
  ASSERT_TRUE(r.fd.valid()) << "the socket must travel with the response";
  struct stat st{};
  ASSERT_EQ(::fstat(r.fd.get(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  int domain = 0;
  socklen_t len = sizeof domain;
  ASSERT_EQ(::getsockopt(r.fd.get(), SOL_SOCKET, SO_DOMAIN, &domain, &len), 0);
  EXPECT_EQ(domain, AF_INET);
  EXPECT_EQ(c.request("GET", "/v1/health").status, 200) << "keep-alive after a passed descriptor";
}

TEST_F(ApiServerTest, OpenHandsOverSparesAndTheVerdictForTheRouteCache) {
  Client c = client();
  std::string id = create_demo(c);
  Reply r = c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080,"spare_sockets":3})");
  ASSERT_EQ(r.status, 200) << r.message.body;
  EXPECT_TRUE(r.fd.valid());
  ASSERT_EQ(r.spares.size(), 4u) << "every spare travels with the answer, and their namespace last";
  EXPECT_EQ(::ioctl(r.spares.back().get(), NS_GET_NSTYPE), CLONE_NEWNET);
  EXPECT_TRUE(check_vouched(socket_path_ + ".netns", r.spares.front().get())) << "vouched for the socket maker";
  json body = r.body();
  EXPECT_EQ(body["spare_sockets"], 3);
  EXPECT_EQ(body["netns"], true);
  // A new token is a route event about the sandbox: the mark goes with it (the next spares bring it back).
  ASSERT_EQ(c.request("POST", "/v1/sandboxes/demo/token").status, 200);
  EXPECT_FALSE(check_vouched(socket_path_ + ".netns", r.spares.front().get())) << "revoked by the rotation";
  ASSERT_EQ(c.request("POST", "/v1/internal/sockets", R"({"sandbox":")" + id + R"(","port":8080,"count":1})").status, 200);
  EXPECT_TRUE(check_vouched(socket_path_ + ".netns", r.spares.front().get())) << "vouched again";
  // default_timeout_secs 300: capped at the most a proxy may cache a route.
  EXPECT_EQ(body["cache_ms"], Node::kMaxRouteCacheMs);
  EXPECT_EQ(body["operator_token_sha256"], "");
  const std::string one_too_many =
      R"({"sandbox":"demo","port":8080,"spare_sockets":)" + std::to_string(Node::kMaxSpareSockets + 1) + "}";
  for (const std::string& bad : {one_too_many, std::string(R"({"sandbox":"demo","port":8080,"spare_sockets":-1})"),
                                 std::string(R"({"sandbox":"demo","port":8080,"spare_sockets":"2"})")})
    expect_error(c.request("POST", "/v1/internal/open", bad), 400, "invalid_argument", "spare_sockets");
  // A short idle timeout leaves no room to cache: the proxy must report a connection before it expires.
  Reply shorter = c.request("POST", "/v1/sandboxes",
                            R"({"name":"brief","command":["sleep","inf"],"timeout_secs":2,"ports":[{"port":8080,"public":true}]})");
  ASSERT_EQ(shorter.status, 201);
  Reply brief = c.request("POST", "/v1/internal/open", R"({"sandbox":"brief","port":8080,"spare_sockets":2})");
  ASSERT_EQ(brief.status, 200);
  EXPECT_EQ(brief.body()["cache_ms"], 0);
}

TEST_F(ApiServerTest, SocketsRefillsARunningSandboxOnlyAndNeverWakesIt) {
  Client c = client();
  std::string id = create_demo(c);
  Reply r = c.request("POST", "/v1/internal/sockets", R"({"sandbox":")" + id + R"(","port":8080,"count":2})");
  ASSERT_EQ(r.status, 200) << r.message.body;
  EXPECT_TRUE(r.fd.valid());
  ASSERT_EQ(r.spares.size(), 2u) << "the second socket and, after the `count`, their namespace";
  EXPECT_EQ(::ioctl(r.spares.back().get(), NS_GET_NSTYPE), CLONE_NEWNET);
  EXPECT_EQ(r.body()["count"], 2);
  EXPECT_EQ(r.body()["netns"], true);
  EXPECT_GT(r.body()["opened_at"].get<uint64_t>(), 0u);
  EXPECT_EQ(r.body()["token_sha256"], node_->get("demo")->spec.token_sha256);
  expect_error(c.request("POST", "/v1/internal/sockets", R"({"sandbox":")" + id + R"(","port":9999,"count":2})"), 403,
               "permission_denied");
  expect_error(c.request("POST", "/v1/internal/sockets", R"({"sandbox":")" + id + R"(","port":8080,"credentials":[]})"),
               400, "invalid_argument");
  EXPECT_TRUE(check_vouched(socket_path_ + ".netns", r.fd.get()));
  c.request("POST", "/v1/sandboxes/demo/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
  EXPECT_FALSE(check_vouched(socket_path_ + ".netns", r.fd.get()))
      << "suspended: the proxy's socket maker may not enter its namespace";
  expect_error(c.request("POST", "/v1/internal/sockets", R"({"sandbox":")" + id + R"(","port":8080,"count":2})"), 503,
               "unavailable");
  EXPECT_EQ(node_->get("demo")->state, SandboxState::kSuspended) << "a refill never wakes";
}

TEST_F(ApiServerTest, RouteEventsAreWrittenBeforeTheCallThatCausedThemIsAnswered) {
  Client c = client();
  std::string id = create_demo(c);
  Client events = client();
  ASSERT_TRUE(events.send("GET /v1/internal/events HTTP/1.1\r\nHost: node\r\n\r\n"));
  std::string got = events.read_until("\"hello\"");
  EXPECT_TRUE(got.starts_with("HTTP/1.1 200 OK\r\n")) << got;
  EXPECT_NE(got.find("application/x-ndjson"), std::string::npos) << got;
  EXPECT_EQ(got.find("Content-Length"), std::string::npos) << "it never ends on its own";

  // The rotation's answer is read first; the event must already be waiting on the stream.
  Reply rotated = c.request("POST", "/v1/sandboxes/demo/token");
  ASSERT_EQ(rotated.status, 200);
  char buf[4096];
  ssize_t n = ::recv(events.raw_fd(), buf, sizeof buf, MSG_DONTWAIT);
  ASSERT_GT(n, 0) << "no event was written before the rotation was answered";
  std::string line(buf, static_cast<size_t>(n));
  EXPECT_NE(line.find(R"("event":"invalidate","id":")" + id + R"(","name":"demo","reason":"token")"), std::string::npos)
      << line;

  c.request("POST", "/v1/sandboxes/demo/suspend");
  got = events.read_until(R"("reason":"suspending")");
  EXPECT_NE(got.find(R"("reason":"suspending")"), std::string::npos) << got;
  EXPECT_EQ(c.request("DELETE", "/v1/sandboxes/demo").status, 200);
  got = events.read_until(R"("reason":"terminating")");
  EXPECT_NE(got.find(R"("reason":"terminating")"), std::string::npos) << got;

  // The operator token changed: every route at once.
  listen_tcp();
  got = events.read_until(R"("event":"flush")");
  EXPECT_NE(got.find(R"("event":"flush","id":"","name":null,"reason":"operator_token")"), std::string::npos) << got;
  EXPECT_EQ(c.request("GET", "/v1/health").status, 200) << "the stream holds nothing up";
}

TEST_F(ApiServerTest, RouteEventsAreOnlyOnTheUnixSocket) {
  Endpoint tcp = listen_tcp();
  Client c(&loop_, tcp);
  c.host = tcp.to_string();
  Reply r = c.request("GET", "/v1/internal/events", "", std::string("Authorization: Bearer ") + kOperatorToken + "\r\n");
  expect_error(r, 400, "invalid_argument", "unix socket");
}

TEST_F(ApiServerTest, OpenWakesASuspendedSandbox) {
  Client c = client();
  create_demo(c);
  c.request("POST", "/v1/sandboxes/demo/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
  Reply r = c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080})");
  ASSERT_EQ(r.status, 200) << r.message.body;
  EXPECT_EQ(r.body()["woke"], true);
  EXPECT_GT(r.body()["wake_ms"].get<double>(), 0);
  EXPECT_TRUE(r.fd.valid());
}

TEST_F(ApiServerTest, ManyClientsOpenASuspendedSandboxAtOnce) {
  Client c = client();
  create_demo(c);
  c.request("POST", "/v1/sandboxes/demo/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
  std::vector<Client> clients;
  for (int i = 0; i < 50; ++i) {
    clients.push_back(client());
    std::string body = R"({"sandbox":"demo","port":8080})";
    ASSERT_TRUE(clients.back().send("POST /v1/internal/open HTTP/1.1\r\nContent-Length: " +
                                    std::to_string(body.size()) + "\r\n\r\n" + body));
  }
  for (Client& each : clients) {
    auto r = each.read();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status, 200);
    EXPECT_TRUE(r->fd.valid());
  }
  EXPECT_EQ(driver_->resumes, 1);
}

TEST_F(ApiServerTest, OpenErrors) {
  Client c = client();
  create_demo(c);
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":9090})"), 403, "permission_denied",
               "port not exposed");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"nope","port":8080})"), 404, "not_found");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo"})"), 400, "invalid_argument", "port");
  expect_error(c.request("POST", "/v1/internal/open", R"({"port":8080})"), 400, "invalid_argument", "sandbox");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":70000})"), 400, "invalid_argument");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":"8080"})"), 400,
               "invalid_argument", "port: must be an integer");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080,"x":1})"), 400,
               "invalid_argument", "unknown field 'x'");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080})",
                         "X-Sandgate-Wake-Timeout-Ms: soon\r\n"),
               400, "invalid_argument", "X-Sandgate-Wake-Timeout-Ms");
  Reply fine = c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080})");
  EXPECT_EQ(fine.status, 200);
  EXPECT_TRUE(fine.fd.valid());
}

TEST_F(ApiServerTest, WakeTimeoutIs504AndFailedWakeIs503) {
  Client c = client();
  create_demo(c);
  c.request("POST", "/v1/sandboxes/demo/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
  driver_->op_delay_ms = 300;
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080})",
                         "X-Sandgate-Wake-Timeout-Ms: 20\r\n"),
               504, "timeout");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kRunning; }));
  driver_->op_delay_ms = 5;
  c.request("POST", "/v1/sandboxes/demo/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
  driver_->fail_resume = true;
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080})"), 503, "unavailable");
}

TEST_F(ApiServerTest, PipelinedAnswersKeepRequestOrder) {
  Client c = client();
  create_demo(c);
  c.request("POST", "/v1/sandboxes/demo/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
  driver_->op_delay_ms = 50;
  std::string open_body = R"({"sandbox":"demo","port":8080})";
  // The open waits for a wake; the health checks behind it are ready at once but must wait their turn.
  ASSERT_TRUE(c.send("POST /v1/internal/open HTTP/1.1\r\nContent-Length: " + std::to_string(open_body.size()) +
                     "\r\n\r\n" + open_body + "GET /v1/health HTTP/1.1\r\n\r\nGET /v1/nope HTTP/1.1\r\n\r\n"));
  auto first = c.read();
  auto second = c.read();
  auto third = c.read();
  ASSERT_TRUE(first && second && third);
  EXPECT_EQ(first->status, 200);
  EXPECT_EQ(first->body()["woke"], true);
  EXPECT_TRUE(first->fd.valid());
  EXPECT_EQ(second->status, 200);
  EXPECT_EQ(second->body()["status"], "ok");
  EXPECT_FALSE(second->fd.valid());
  EXPECT_EQ(third->status, 404);
}

TEST_F(ApiServerTest, ManyPipelinedRequestsAreAllAnswered) {
  Client c = client();
  std::string batch;
  for (int i = 0; i < 500; ++i) batch += "GET /v1/health HTTP/1.1\r\n\r\n";
  ASSERT_TRUE(c.send(batch));
  for (int i = 0; i < 500; ++i) {
    auto r = c.read();
    ASSERT_TRUE(r.has_value()) << i;
    ASSERT_EQ(r->status, 200);
  }
}

TEST_F(ApiServerTest, TokenRotation) {
  Client c = client();
  create_demo(c);
  Reply rotated = c.request("POST", "/v1/sandboxes/demo/token");
  ASSERT_EQ(rotated.status, 200) << rotated.message.body;
  EXPECT_TRUE(rotated.body().value("token", "").starts_with("sgt_")) << rotated.message.body;
  EXPECT_EQ(rotated.body()["name"], "demo");
  EXPECT_EQ(c.request("GET", "/v1/sandboxes/demo/token").status, 405);
  expect_error(c.request("POST", "/v1/sandboxes/nope/token"), 404, "not_found");
}

TEST_F(ApiServerTest, Activity) {
  Client c = client();
  std::string id = create_demo(c);
  std::string report = R"({"sandboxes":[{"id":")" + id +
                       R"(","bytes_in":10,"bytes_out":20,"connections":2,"reporter":"w1"},)"
                       R"({"id":"sb-unknown00000"}]})";
  Reply ok = c.request("POST", "/v1/internal/activity", report);
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(ok.body(), nlohmann::json::parse(R"({"asleep":[],"revoked":[],"closed":[]})"));
  EXPECT_EQ(c.request("GET", "/v1/sandboxes/demo").body()["connections"], 2);
  // A port closed since is named with the stamp of its close: the proxy cuts the connections to it.
  ASSERT_EQ(c.request("PUT", "/v1/sandboxes/demo/ports/3000").status, 200);
  ASSERT_EQ(c.request("DELETE", "/v1/sandboxes/demo/ports/3000").status, 200);
  Reply closed = c.request("POST", "/v1/internal/activity", report);
  ASSERT_EQ(closed.body()["closed"].size(), 1u) << closed.message.body;
  EXPECT_EQ(closed.body()["closed"][0]["id"], id);
  EXPECT_EQ(closed.body()["closed"][0]["port"], 3000);
  EXPECT_TRUE(closed.body()["closed"][0]["closed_at"].is_number_unsigned());
  // A suspended sandbox in a report is named with the stamp of its suspend; the bytes do not wake it.
  ASSERT_EQ(c.request("POST", "/v1/sandboxes/demo/suspend").status, 202);
  Reply asleep = c.request("POST", "/v1/internal/activity", report);
  ASSERT_EQ(asleep.status, 200);
  ASSERT_EQ(asleep.body()["asleep"].size(), 1u) << asleep.message.body;
  EXPECT_EQ(asleep.body()["asleep"][0]["id"], id);
  EXPECT_TRUE(asleep.body()["asleep"][0]["suspended_at"].is_number_unsigned());
  expect_error(c.request("POST", "/v1/internal/activity", R"({"sandboxes":[{"bytes_in":1}]})"), 400,
               "invalid_argument", "id is required");
  expect_error(c.request("POST", "/v1/internal/activity", R"({"sandboxes":[{"id":"x","bytes_in":-1}]})"), 400,
               "invalid_argument", "non-negative");
  expect_error(c.request("POST", "/v1/internal/activity", R"({"sandboxes":[{"id":"x","bites_in":1}]})"), 400,
               "invalid_argument", "unknown field");
  expect_error(c.request("POST", "/v1/internal/activity", R"({"sandbox":[]})"), 400, "invalid_argument");
  expect_error(c.request("POST", "/v1/internal/activity", R"({"sandboxes":{}})"), 400, "invalid_argument");
}

TEST_F(ApiServerTest, ConnectionCloseIsHonoured) {
  Client c = client();
  Reply r = c.request("GET", "/v1/health", "", "Connection: close\r\n");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(*r.message.header("Connection"), "close");
  EXPECT_TRUE(c.eof());
}

TEST_F(ApiServerTest, ExpectContinue) {
  Client c = client();
  std::string body = R"({"name":"demo","command":["x"]})";
  ASSERT_TRUE(c.send("POST /v1/sandboxes HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: " +
                     std::to_string(body.size()) + "\r\n\r\n"));
  auto interim = c.read();
  ASSERT_TRUE(interim.has_value());
  EXPECT_EQ(interim->status, 100);
  ASSERT_TRUE(c.send(body));
  auto r = c.read();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, 201);
}

TEST_F(ApiServerTest, ClientVanishingMidWakeIsHarmless) {
  {
    Client c = client();
    create_demo(c);
    c.request("POST", "/v1/sandboxes/demo/suspend");
    ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kSuspended; }));
    driver_->op_delay_ms = 50;
    std::string body = R"({"sandbox":"demo","port":8080})";
    ASSERT_TRUE(c.send("POST /v1/internal/open HTTP/1.1\r\nContent-Length: " + std::to_string(body.size()) +
                       "\r\n\r\n" + body));
    run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kResuming; });
  }  // the client disconnects before the answer exists
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->state == SandboxState::kRunning; }));
  EXPECT_EQ(client().request("GET", "/v1/health").status, 200);
}

TEST_F(ApiServerTest, TcpListenerServesButCannotPassDescriptors) {
  Endpoint tcp = listen_tcp();
  Client c(&loop_, tcp);
  ASSERT_TRUE(c.connected());
  c.host = tcp.to_string();
  const std::string auth = bearer(kOperatorToken);
  EXPECT_EQ(c.request("GET", "/v1/health", "", auth).status, 200);
  Reply created = c.request("POST", "/v1/sandboxes", R"({"name":"demo","command":["x"],"exposed_ports":[8080]})", auth);
  ASSERT_EQ(created.status, 201) << created.message.body;
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080})", auth), 400,
               "invalid_argument", "unix socket");
  expect_error(c.request("POST", "/v1/internal/lookup", R"({"sandbox":"demo","port":8080})", auth), 400,
               "invalid_argument", "unix socket");
  EXPECT_EQ(c.request("GET", "/v1/sandboxes/demo", "", auth).status, 200);
}

TEST_F(ApiServerTest, TcpListenerNeedsTheOperatorTokenItsOwnHostAndNoOrigin) {
  Endpoint tcp = listen_tcp();
  Client c(&loop_, tcp);
  ASSERT_TRUE(c.connected());
  c.host = tcp.to_string();
  Reply none = c.request("GET", "/v1/health");
  expect_error(none, 401, "unauthorized", "operator token");
  ASSERT_NE(none.message.header("WWW-Authenticate"), nullptr);
  EXPECT_EQ(none.message.header("WWW-Authenticate")->rfind("Bearer", 0), 0u);
  expect_error(c.request("GET", "/v1/health", "", bearer("op-wrong")), 401, "unauthorized", "invalid");
  expect_error(c.request("GET", "/v1/health", "", "Authorization: Basic b3A6dW5pdA==\r\n"), 401, "unauthorized");
  // A sandbox's token opens its ports through the proxy, never the API.
  Reply created = client().request("POST", "/v1/sandboxes", R"({"name":"s","command":["x"]})");
  ASSERT_EQ(created.status, 201);
  expect_error(c.request("GET", "/v1/health", "", bearer(created.body()["token"])), 401, "unauthorized");
  // A refused create leaves nothing behind.
  expect_error(c.request("POST", "/v1/sandboxes", R"({"name":"sneaky","command":["x"]})"), 401, "unauthorized");
  EXPECT_EQ(node_->get("sneaky").error(), Error::kNotFound);
  // The scheme is case-insensitive; "localhost:<port>" is this address too.
  EXPECT_EQ(c.request("GET", "/v1/health", "", std::string("Authorization: bearer ") + kOperatorToken + "\r\n").status,
            200);
  c.host = "localhost:" + std::to_string(tcp.port);
  EXPECT_EQ(c.request("GET", "/v1/health", "", bearer(kOperatorToken)).status, 200);

  // DNS rebinding: a name that resolves here but is not this API's address, with or without the token.
  for (std::string host : {std::string("evil.example:") + std::to_string(tcp.port), std::string("127.0.0.1"),
                           std::string("127.0.0.1:1")}) {
    c.host = host;
    expect_error(c.request("GET", "/v1/health", "", bearer(kOperatorToken)), 421, "misdirected_request", host);
  }
  c.host = tcp.to_string();
  // Anything from a web page, even with the token (a page cannot know it, but it must not matter).
  for (std::string origin : {std::string("http://evil.example"), std::string("null"), "http://" + tcp.to_string()})
    expect_error(c.request("GET", "/v1/health", "", bearer(kOperatorToken) + "Origin: " + origin + "\r\n"), 403,
                 "permission_denied", "Origin");
  EXPECT_EQ(c.request("GET", "/v1/health", "", bearer(kOperatorToken)).status, 200);

  // No Host at all (HTTP/1.0 allows it) is not this address either.
  Client bare(&loop_, tcp);
  ASSERT_TRUE(bare.send("GET /v1/health HTTP/1.0\r\n" + bearer(kOperatorToken) + "\r\n"));
  auto no_host = bare.read();
  ASSERT_TRUE(no_host.has_value());
  expect_error(*no_host, 400, "invalid_argument", "Host header");

  // The unix socket stays as it is: its file mode is the access control.
  Client u = client();
  u.host = "evil.example";
  EXPECT_EQ(u.request("GET", "/v1/health").status, 200);
}

TEST_F(ApiServerTest, PortPoliciesAreValidatedAndShown) {
  Client c = client();
  Reply r = c.request("POST", "/v1/sandboxes",
                      R"({"name":"web","command":["x"],"exposed_ports":[8080],"ports":[{"port":22,"public":true,)"
                      R"("protocol":"tcp"},{"port":50051,"protocol":"h2c"}]})");
  ASSERT_EQ(r.status, 201) << r.message.body;
  EXPECT_EQ(r.body()["exposed_ports"], json::parse("[8080, 22, 50051]"));
  EXPECT_EQ(r.body()["ports"], json::parse(R"([{"port":8080,"public":false,"protocol":"http1"},)"
                                           R"({"port":22,"public":true,"protocol":"tcp"},)"
                                           R"({"port":50051,"public":false,"protocol":"h2c"}])"));
  EXPECT_EQ(c.request("GET", "/v1/sandboxes/web").body()["ports"], r.body()["ports"]);
  // The count limit covers both lists together.
  std::string many = R"({"command":["x"],"exposed_ports":[)";
  for (int p = 1; p <= 40; ++p) many += (p > 1 ? "," : "") + std::to_string(p);
  many += R"(],"ports":[)";
  for (int p = 41; p <= 65; ++p) many += (p > 41 ? "," : "") + std::string(R"({"port":)") + std::to_string(p) + "}";
  many += "]}";
  expect_error(c.request("POST", "/v1/sandboxes", many), 400, "invalid_argument", "at most 64 ports");
}

TEST_F(ApiServerTest, OpenOfAPrivatePortNeedsTheToken) {
  Client c = client();
  Reply created = c.request("POST", "/v1/sandboxes", R"({"name":"priv","command":["x"],"exposed_ports":[8080]})");
  ASSERT_EQ(created.status, 201);
  std::string token = created.body()["token"];
  c.request("POST", "/v1/sandboxes/priv/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("priv")->state == SandboxState::kSuspended; }));
  int64_t activity = node_->get("priv")->last_activity_at_ms;

  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":8080})"), 401, "unauthorized",
               "missing token");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":8080,"credentials":[""]})"), 401,
               "unauthorized", "missing token");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":8080,"credentials":["sgt_nope"]})"),
               401, "unauthorized", "invalid token");
  // Another sandbox's token opens nothing here.
  Reply other = c.request("POST", "/v1/sandboxes", R"({"name":"other","command":["x"]})");
  expect_error(c.request("POST", "/v1/internal/open",
                         R"({"sandbox":"priv","port":8080,"credentials":[")" + other.body()["token"].get<std::string>() + R"("]})"),
               401, "unauthorized", "invalid token");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":8080,"credentials":[5]})"), 400,
               "invalid_argument", "credentials[]: must be a string");
  expect_error(c.request("POST", "/v1/internal/open",
                         R"({"sandbox":"priv","port":8080,"credentials":["a","b","c","d","e"]})"),
               400, "invalid_argument", "at most 4 candidates");
  // The order: an unknown sandbox or port is told before the credential is looked at.
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"nope","port":8080})"), 404, "not_found");
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":9090})"), 403, "permission_denied",
               "port not exposed");
  run_until(&loop_, [] { return false; }, 30);
  EXPECT_EQ(node_->get("priv")->state, SandboxState::kSuspended) << "a refused open must not wake the sandbox";
  EXPECT_EQ(driver_->resumes, 0);
  EXPECT_EQ(node_->get("priv")->last_activity_at_ms, activity) << "nor count as activity";

  Reply ok = c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":8080,"credentials":[")" + token + R"("]})");
  ASSERT_EQ(ok.status, 200) << ok.message.body;
  EXPECT_EQ(ok.body()["woke"], true);
  EXPECT_EQ(ok.body()["protocol"], "http1");
  EXPECT_EQ(ok.body()["public"], false);
  EXPECT_EQ(ok.body()["credential"], 0);
  EXPECT_TRUE(ok.fd.valid());
  // Every candidate in one open: the one that verifies is named.
  Reply second = c.request("POST", "/v1/internal/open",
                           R"({"sandbox":"priv","port":8080,"credentials":["sgt_apps_own",")" + token + R"("]})");
  ASSERT_EQ(second.status, 200) << second.message.body;
  EXPECT_EQ(second.body()["credential"], 1);
  // The agent port: always reachable with the token, never without.
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":9501})"), 401, "unauthorized");
  Reply agent = c.request("POST", "/v1/internal/open", R"({"sandbox":"priv","port":9501,"credentials":[")" + token + R"("]})");
  ASSERT_EQ(agent.status, 200) << agent.message.body;
  EXPECT_EQ(agent.body()["protocol"], "h2c");
  EXPECT_EQ(agent.body()["public"], false);
}

TEST_F(ApiServerTest, OpenOfAPublicPortNeedsNoToken) {
  Client c = client();
  create_demo(c);
  Reply r = c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":8080,"credentials":["whatever"]})");
  ASSERT_EQ(r.status, 200) << r.message.body;
  EXPECT_EQ(r.body()["public"], true);
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"demo","port":9501})"), 401, "unauthorized");

  Reply open_all = c.request("POST", "/v1/sandboxes",
                             R"({"name":"open","command":["x"],"exposed_ports":[3000],)"
                             R"("allow_unauthenticated_access":true})");
  ASSERT_EQ(open_all.status, 201);
  EXPECT_EQ(open_all.body()["ports"], json::parse(R"([{"port":3000,"public":true,"protocol":"http1"}])"));
  Reply o = c.request("POST", "/v1/internal/open", R"({"sandbox":"open","port":3000})");
  EXPECT_EQ(o.status, 200) << o.message.body;
  EXPECT_EQ(o.body()["public"], true);
  // Never the agent port: allow_unauthenticated_access publishes exposed ports only.
  Reply lookup = c.request("POST", "/v1/internal/lookup", R"({"sandbox":"open","port":9501})");
  EXPECT_EQ(lookup.body()["public"], false) << lookup.message.body;
  expect_error(c.request("POST", "/v1/internal/open", R"({"sandbox":"open","port":9501})"), 401, "unauthorized",
               "missing token");
  Reply agent = c.request("POST", "/v1/internal/open",
                          R"({"sandbox":"open","port":9501,"credentials":[")" + open_all.body()["token"].get<std::string>() + R"("]})");
  EXPECT_EQ(agent.status, 200) << agent.message.body;
  EXPECT_EQ(agent.body()["public"], false);
}

TEST_F(ApiServerTest, LookupAnswersWithoutWakingOrTouching) {
  Client c = client();
  Reply created = c.request("POST", "/v1/sandboxes",
                            R"({"name":"ssh","command":["x"],"ports":[{"port":22,"public":true,"protocol":"tcp"},)"
                            R"({"port":2222,"protocol":"tcp"}]})");
  ASSERT_EQ(created.status, 201);
  std::string id = created.body()["id"];
  c.request("POST", "/v1/sandboxes/ssh/suspend");
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("ssh")->state == SandboxState::kSuspended; }));
  int64_t activity = node_->get("ssh")->last_activity_at_ms;

  Reply r = c.request("POST", "/v1/internal/lookup", R"({"sandbox":"ssh","port":22})");
  ASSERT_EQ(r.status, 200) << r.message.body;
  EXPECT_EQ(r.body(), json::parse(R"({"id":")" + id + R"(","name":"ssh","port":22,"protocol":"tcp","public":true})"));
  EXPECT_FALSE(r.fd.valid());
  Reply priv = c.request("POST", "/v1/internal/lookup", R"({"sandbox":")" + id + R"(","port":2222})");
  EXPECT_EQ(priv.body()["public"], false);
  EXPECT_EQ(priv.body()["protocol"], "tcp");
  Reply agent = c.request("POST", "/v1/internal/lookup", R"({"sandbox":"ssh","port":9501})");
  EXPECT_EQ(agent.body()["protocol"], "h2c");
  EXPECT_EQ(agent.body()["public"], false);
  expect_error(c.request("POST", "/v1/internal/lookup", R"({"sandbox":"ssh","port":80})"), 403, "permission_denied",
               "port not exposed");
  expect_error(c.request("POST", "/v1/internal/lookup", R"({"sandbox":"nope","port":22})"), 404, "not_found");
  expect_error(c.request("POST", "/v1/internal/lookup", R"({"sandbox":"ssh","port":22,"credential":"x"})"), 400,
               "invalid_argument", "unknown field 'credential'");
  expect_error(c.request("POST", "/v1/internal/lookup", R"({"sandbox":"ssh"})"), 400, "invalid_argument", "port");
  expect_error(c.request("GET", "/v1/internal/lookup"), 405, "unsupported");
  run_until(&loop_, [] { return false; }, 30);
  EXPECT_EQ(node_->get("ssh")->state, SandboxState::kSuspended);
  EXPECT_EQ(driver_->resumes, 0);
  EXPECT_EQ(node_->get("ssh")->last_activity_at_ms, activity);
}

// A one-layer `docker save` archive at `path`; `corrupt`: the layer no longer matches its diff_id.
void write_docker_save(const std::string& dir, const std::string& path, bool corrupt) {
  namespace st = snapshot::testing;
  std::string layer = dir + "/layer.tar";
  ASSERT_TRUE(st::write_tar(layer, {st::file("etc/motd", "hi\n")}));
  std::string diff_id = st::digest_of(layer);
  std::string data = st::read_file(layer);
  if (corrupt) data[700] ^= 1;
  json config = {{"config", {{"Cmd", {"/bin/sh"}}}}, {"rootfs", {{"type", "layers"}, {"diff_ids", {diff_id}}}}};
  json manifest = json::array({{{"Config", "config.json"}, {"Layers", {"l/layer.tar"}}}});
  ASSERT_TRUE(st::write_tar(path, {st::file("l/layer.tar", data), st::file("config.json", config.dump()),
                                   st::file("manifest.json", manifest.dump())}));
}

TEST_F(ApiServerTest, ImagesWithoutAStoreAre503) {
  Client c = client();
  expect_error(c.request("GET", "/v1/images"), 503, "unavailable", "no image store");
  expect_error(c.request("DELETE", "/v1/images/x"), 503, "unavailable");
}

TEST_F(ApiServerTest, ImageImportListGetRemove) {
  auto opened = snapshot::ImageStore::open(dir_.path() + "/images-state");
  ASSERT_TRUE(opened) << opened.message();
  snapshot::ImageStore* store = opened->get();
  ImageService images(&loop_, std::move(*opened));
  server_->set_images(&images);
  write_docker_save(dir_.path(), dir_.path() + "/good.tar", false);
  write_docker_save(dir_.path(), dir_.path() + "/bad.tar", true);
  Client c = client();

  Reply created = c.request("POST", "/v1/images", R"({"name":"web","archive":")" + dir_.path() + R"(/good.tar"})");
  ASSERT_EQ(created.status, 201) << created.message.body;
  json image = created.body();
  EXPECT_EQ(image["name"], "web");
  EXPECT_EQ(image["format"], "docker-save");
  EXPECT_EQ(image["config"]["cmd"], json({"/bin/sh"}));
  EXPECT_EQ(image["layers"].size(), 1u);
  EXPECT_TRUE(is_rfc3339_utc_ms(image["created_at"])) << image;

  Reply list = c.request("GET", "/v1/images");
  ASSERT_EQ(list.status, 200);
  ASSERT_EQ(list.body()["images"].size(), 1u);
  EXPECT_EQ(list.body()["images"][0], image);
  EXPECT_EQ(c.request("GET", "/v1/images/web").body(), image);

  expect_error(c.request("POST", "/v1/images", R"({"name":"web","archive":")" + dir_.path() + R"(/good.tar"})"), 409,
               "already_exists", "image web already exists");
  expect_error(c.request("POST", "/v1/images", R"({"name":"b","archive":")" + dir_.path() + R"(/bad.tar"})"), 400,
               "invalid_argument", "bad.tar: layer 1 (l/layer.tar): digest mismatch");
  expect_error(c.request("POST", "/v1/images", R"({"name":"b","archive":"bad.tar"})"), 400, "invalid_argument",
               "absolute path");
  expect_error(c.request("POST", "/v1/images", R"({"name":"b","archive":"/x","from":1})"), 400, "invalid_argument",
               "unknown field 'from'");
  expect_error(c.request("POST", "/v1/images", R"({"name":7,"archive":"/x"})"), 400, "invalid_argument", "name");
  expect_error(c.request("POST", "/v1/images", R"({"name":"../b","archive":"/x"})"), 400, "invalid_argument",
               "invalid image name");
  expect_error(c.request("PUT", "/v1/images"), 405, "unsupported");
  expect_error(c.request("GET", "/v1/images/nope"), 404, "not_found");

  store->set_users([](const std::string&) { return std::optional<std::string>("sandbox demo"); }, nullptr);
  expect_error(c.request("DELETE", "/v1/images/web"), 409, "conflict", "in use by sandbox demo");
  store->set_users(nullptr, nullptr);
  Reply removed = c.request("DELETE", "/v1/images/web");
  EXPECT_EQ(removed.status, 200) << removed.message.body;
  EXPECT_EQ(removed.body()["name"], "web");
  EXPECT_EQ(c.request("GET", "/v1/images").body(), json::parse(R"({"images":[]})"));
  expect_error(c.request("DELETE", "/v1/images/web"), 404, "not_found");
  server_->set_images(nullptr);
}

// A build is checked before any work (plain error answers), then streamed as NDJSON. A --copy step needs no
// build sandbox, so the stream is seen here end to end; the sandboxed steps are the e2e tests'.
TEST_F(ApiServerTest, ImageBuildIsCheckedThenStreamed) {
  auto opened = snapshot::ImageStore::open(dir_.path() + "/images-state");
  ASSERT_TRUE(opened) << opened.message();
  ImageService images(&loop_, std::move(*opened));
  server_->set_images(&images);
  write_docker_save(dir_.path(), dir_.path() + "/good.tar", false);
  snapshot::testing::write_file(dir_.path() + "/conf", "copied\n");
  Client c = client();
  ASSERT_EQ(c.request("POST", "/v1/images", R"({"name":"web","archive":")" + dir_.path() + R"(/good.tar"})").status, 201);

  expect_error(c.request("POST", "/v1/images/build", R"({"from":"web"})"), 400, "invalid_argument", "name is required");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","script":"y"})"), 400, "invalid_argument",
               "unknown field 'script'");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","run":["make"]})"), 400, "invalid_argument",
               "unknown field 'run'");
  for (const char* bad : {R"("make")", R"([{"run":"a","copy":{"source":"/a","dest":"/b"}}])", R"([{"run":1}])",
                          R"([{"copy":{"source":"/a"}}])", R"([{"shell":"x"}])"})
    expect_error(c.request("POST", "/v1/images/build", std::string(R"({"name":"x","steps":)") + bad + "}"), 400,
                 "invalid_argument", "steps");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","packages":["a b"]})"), 400, "invalid_argument",
               "not a Debian package name");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","env":["=1"]})"), 400, "invalid_argument",
               "KEY=VALUE");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","workdir":"/a/../b"})"), 400, "invalid_argument",
               "workdir");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","timeout_secs":0})"), 400, "invalid_argument",
               "timeout_secs");
  std::string many = "[";
  for (int i = 0; i < 64; ++i) many += std::string(i ? "," : "") + R"({"run":"true"})";
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","from":"web","steps":)" + many + "]}"), 429,
               "limit_exceeded", "65 build steps, over the limit of 64");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"web","steps":[{"run":"true"}]})"), 409, "already_exists");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","from":"nope","steps":[{"run":"true"}]})"), 404, "not_found",
               "no image named nope");
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","from":"web","steps":[{"copy":{"source":"/nonexistent","dest":"/a"}}]})"),
               404, "not_found", "copy source /nonexistent does not exist on the node");

  // A close-delimited body: read until the final event arrives, then the server closes.
  Client stream = client();
  std::string body = R"({"name":"x","from":"web","steps":[{"copy":{"source":")" + dir_.path() + R"(/conf","dest":"/etc/"}}]})";
  ASSERT_TRUE(stream.send("POST /v1/images/build HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body));
  std::string raw = stream.read_until("\"event\":\"image\"", 10000);
  size_t head_end = raw.find("\r\n\r\n");
  ASSERT_NE(head_end, std::string::npos) << raw;
  EXPECT_EQ(raw.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << raw;
  EXPECT_NE(raw.find("Content-Type: application/x-ndjson\r\n"), std::string::npos) << raw;
  EXPECT_TRUE(stream.eof()) << "the stream ends with the build";
  std::vector<json> events;
  std::istringstream lines(raw.substr(head_end + 4));
  for (std::string line; std::getline(lines, line);) events.push_back(json::parse(line, nullptr, false));
  ASSERT_EQ(events.size(), 3u) << raw;
  EXPECT_EQ(events[0], json::parse(R"({"event":"step","step":1,"steps":1,"what":"copy )" + dir_.path() + R"(/conf /etc/"})"));
  EXPECT_EQ(events[1]["event"], "layer");
  EXPECT_EQ(events[2]["event"], "image");
  EXPECT_EQ(events[2]["image"]["parent"], "web");
  EXPECT_EQ(events[2]["image"]["layers"].size(), 2u);
  EXPECT_EQ(events[2]["image"]["layers"][1], events[1]["digest"]);
  expect_error(c.request("DELETE", "/v1/images/web"), 409, "conflict", "parent of image x");
  server_->set_images(nullptr);
}

TEST_F(ApiServerTest, ImageBuildIsOnlyOnTheUnixSocket) {
  auto opened = snapshot::ImageStore::open(dir_.path() + "/images-state");
  ASSERT_TRUE(opened) << opened.message();
  ImageService images(&loop_, std::move(*opened));
  server_->set_images(&images);
  Endpoint tcp = listen_tcp();
  Client c(&loop_, tcp);
  c.host = tcp.to_string();
  expect_error(c.request("POST", "/v1/images/build", R"({"name":"x","steps":[{"run":"id"}]})", bearer(kOperatorToken)), 400,
               "invalid_argument", "unix socket only");
  server_->set_images(nullptr);
}

TEST_F(ApiServerTest, ImageImportIsOnlyOnTheUnixSocket) {
  auto opened = snapshot::ImageStore::open(dir_.path() + "/images-state");
  ASSERT_TRUE(opened) << opened.message();
  ImageService images(&loop_, std::move(*opened));
  server_->set_images(&images);
  Endpoint tcp = listen_tcp();
  Client c(&loop_, tcp);
  c.host = tcp.to_string();
  expect_error(c.request("POST", "/v1/images", R"({"name":"x","archive":"/etc/passwd"})", bearer(kOperatorToken)), 400,
               "invalid_argument", "unix socket only");
  EXPECT_EQ(c.request("GET", "/v1/images", "", bearer(kOperatorToken)).status, 200);
  server_->set_images(nullptr);
}

}  // namespace
}  // namespace sg
