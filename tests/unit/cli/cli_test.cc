#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "common/api_client.h"
#include "cli/commands.h"
#include "tests/unit/cli/fake_ingress.h"

namespace sg::cli {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// ---- --api / SANDGATE_API ----

TEST(ApiAddress, Unix) {
  auto a = parse_api_address("unix:/run/sandgate/node.sock");
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->kind, ApiAddress::Kind::kDirect);
  EXPECT_EQ(a->endpoint.kind, Endpoint::Kind::kUnix);
  EXPECT_EQ(a->endpoint.path, "/run/sandgate/node.sock");
  EXPECT_EQ(api_address_string(*a), "unix:/run/sandgate/node.sock");
}

TEST(ApiAddress, Http) {
  for (const char* text : {"http://127.0.0.1:8081", "http://127.0.0.1:8081/"}) {
    auto a = parse_api_address(text);
    ASSERT_TRUE(a) << a.message();
    EXPECT_EQ(a->kind, ApiAddress::Kind::kDirect);
    EXPECT_EQ(a->endpoint.kind, Endpoint::Kind::kTcp);
    EXPECT_EQ(a->endpoint.host, "127.0.0.1");
    EXPECT_EQ(a->endpoint.port, 8081);
    EXPECT_EQ(api_address_string(*a), "http://127.0.0.1:8081");
  }
  auto v6 = parse_api_address("http://[::1]:9000");
  ASSERT_TRUE(v6) << v6.message();
  EXPECT_EQ(v6->endpoint.host, "::1");
  auto local = parse_api_address("http://localhost:9000");
  ASSERT_TRUE(local) << local.message();
  EXPECT_EQ(local->endpoint.host, "127.0.0.1");
}

TEST(ApiAddress, Https) {
  for (const char* text : {"https://api.sandbox.localhost:8443", "https://api.sandbox.localhost:8443/"}) {
    auto a = parse_api_address(text);
    ASSERT_TRUE(a) << a.message();
    EXPECT_EQ(a->kind, ApiAddress::Kind::kHttps);
    EXPECT_EQ(a->server.host, "api.sandbox.localhost");
    EXPECT_EQ(a->server.port, 8443);
    EXPECT_EQ(api_address_string(*a), "https://api.sandbox.localhost:8443");
  }
  auto default_port = parse_api_address("https://api.example.com");
  ASSERT_TRUE(default_port) << default_port.message();
  EXPECT_EQ(default_port->server.port, 443);
  auto v6 = parse_api_address("https://[::1]");
  ASSERT_TRUE(v6) << v6.message();
  EXPECT_EQ(v6->server.host, "::1");
  EXPECT_EQ(api_address_string(*v6), "https://[::1]:443");
}

TEST(ApiAddress, RequestCarriesTheTokenAndTheUrlsHost) {
  auto a = parse_api_address("https://api.sandbox.localhost:8443");
  ASSERT_TRUE(a) << a.message();
  auto req = build_request("GET", "/v1/sandboxes", *a, "op-secret", nullptr);
  ASSERT_TRUE(req) << req.message();
  EXPECT_EQ(*req,
            "GET /v1/sandboxes HTTP/1.1\r\nHost: api.sandbox.localhost:8443\r\nAuthorization: Bearer op-secret\r\n"
            "User-Agent: sandgate-cli\r\nAccept: application/json\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
}

TEST(ApiAddress, Rejects) {
  for (const char* text : {"", "unix:", "unix:relative.sock", "https://", "https://api.x:0", "https://api.x/v1",
                           "https://a b:1", "127.0.0.1:8081",
                           "http://127.0.0.1", "http://127.0.0.1:0", "http://127.0.0.1:99999",
                           "http://example.com:80", "http://127.0.0.1:8081/v1", "/run/sandgate/node.sock"}) {
    auto ep = parse_api_address(text);
    EXPECT_FALSE(ep) << text;
    if (!ep) {
      EXPECT_EQ(ep.error(), Error::kInvalidArgument);
      EXPECT_NE(ep.message().find(text), std::string::npos) << ep.message();
    }
  }
  EXPECT_NE(parse_api_address("http://example.com:80").message().find("https://"), std::string::npos);
}

// ---- create flags -> body ----

TEST(CreateBody, OnlyCommand) {
  CreateOptions o;
  o.command = {"sleep", "1"};
  auto body = create_request_body(o);
  ASSERT_TRUE(body) << body.message();
  // Everything unset is left out so the node's defaults apply.
  EXPECT_EQ(*body, json::parse(R"({"command": ["sleep", "1"]})"));
}

TEST(CreateBody, AllFlags) {
  CreateOptions o;
  o.name = "demo";
  o.ephemeral = true;
  o.timeout_secs = 60;
  o.expose = {"8080", "3000"};
  o.cpus = 0.5;
  o.memory_mb = 512;
  o.env = {"A=1", "B=x=y", "EMPTY=", "A=2"};
  o.cwd = "/srv";
  o.hibernate_after_secs = 600;
  o.driver = "qemu";
  o.command = {"python3", "-m", "http.server", "8080"};
  auto body = create_request_body(o);
  ASSERT_TRUE(body) << body.message();
  EXPECT_EQ(*body, json::parse(R"({"name": "demo", "command": ["python3", "-m", "http.server", "8080"],
                                   "env": {"A": "2", "B": "x=y", "EMPTY": ""}, "cwd": "/srv",
                                   "exposed_ports": [8080, 3000], "timeout_secs": 60, "cpus": 0.5,
                                   "memory_mb": 512, "ephemeral": true, "hibernate_after_secs": 600,
                                   "driver": "qemu"})"));
}

TEST(CreateBody, UsageErrors) {
  CreateOptions none;
  EXPECT_FALSE(create_request_body(none));

  CreateOptions bad_env;
  bad_env.command = {"true"};
  bad_env.env = {"NOEQUALS"};
  auto r = create_request_body(bad_env);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kInvalidArgument);
  EXPECT_NE(r.message().find("NOEQUALS"), std::string::npos);
  bad_env.env = {"=value"};
  EXPECT_FALSE(create_request_body(bad_env));

  for (const char* port : {"0", "-1", "65536", "", "80x", "80/", "80/udp", "/tcp", "80/tcp/tcp", " 80"}) {
    CreateOptions o;
    o.command = {"true"};
    o.expose = {"8080", port};
    auto p = create_request_body(o);
    ASSERT_FALSE(p) << port;
    EXPECT_NE(p.message().find(std::string("--expose ") + port + ":"), std::string::npos) << p.message();
  }
  CreateOptions twice;
  twice.command = {"true"};
  twice.expose = {"22/tcp"};
  twice.publish = {"22"};
  auto t = create_request_body(twice);
  ASSERT_FALSE(t);
  EXPECT_NE(t.message().find("--public 22: port 22 is given twice"), std::string::npos) << t.message();
  CreateOptions edge;
  edge.command = {"true"};
  edge.expose = {"1", "65535"};
  EXPECT_TRUE(create_request_body(edge));
  CreateOptions bad_driver;
  bad_driver.command = {"true"};
  bad_driver.driver = "docker";
  auto d = create_request_body(bad_driver);
  ASSERT_FALSE(d);
  EXPECT_NE(d.message().find("--driver docker"), std::string::npos);
}

TEST(CreateBody, PortPolicies) {
  CreateOptions o;
  o.command = {"sshd", "-D"};
  o.expose = {"8080", "3000/http1", "50051/h2c", "2222/tcp"};
  o.publish = {"22/tcp", "80"};
  auto body = create_request_body(o);
  ASSERT_TRUE(body) << body.message();
  EXPECT_EQ(*body, json::parse(R"({"command": ["sshd", "-D"], "exposed_ports": [8080, 3000],
                                   "ports": [{"port": 50051, "public": false, "protocol": "h2c"},
                                             {"port": 2222, "public": false, "protocol": "tcp"},
                                             {"port": 22, "public": true, "protocol": "tcp"},
                                             {"port": 80, "public": true, "protocol": "http1"}]})"));
}

TEST(SandboxPath, EncodesRef) {
  EXPECT_EQ(sandbox_path("demo"), "/v1/sandboxes/demo");
  EXPECT_EQ(sandbox_path("sb-0123456789ab", "suspend"), "/v1/sandboxes/sb-0123456789ab/suspend");
  EXPECT_EQ(sandbox_path("a b/../c?x"), "/v1/sandboxes/a%20b%2F..%2Fc%3Fx");
}

// ---- answers -> text ----

constexpr const char* kWhere = "unix:/run/sandgate/node.sock";

TEST(ErrorMessage, PrefersNodeMessage) {
  EXPECT_EQ(error_message(409, R"({"error":"conflict","message":"sandbox sb-1 is creating"})",
                          {"suspend", "x", kWhere}),
            "sandbox sb-1 is creating");
  EXPECT_EQ(error_message(404, R"({"error":"not_found"})", {"ls", "", kWhere}),
            "sandgate-node answered HTTP 404 Not Found (not_found)");
  EXPECT_EQ(error_message(400, R"({"error":"invalid_argument","message": 7})", {"ls", "", kWhere}),
            "sandgate-node answered HTTP 400 Bad Request (invalid_argument)");
}

TEST(ErrorMessage, NameTakenSaysHowToFreeIt) {
  EXPECT_EQ(error_message(409, R"({"error":"already_exists","message":"name 'demo' is already used by sb-1"})",
                          {"create", "demo", kWhere}),
            "name 'demo' is already used by sb-1: choose another --name, or remove the existing sandbox first with "
            "`sandgate rm demo`");
}

TEST(ErrorMessage, UnknownSandboxPointsAtLs) {
  EXPECT_EQ(error_message(404, R"({"error":"not_found","message":"no sandbox 'demo'"})", {"get", "demo", kWhere}),
            "no sandbox 'demo': `sandgate ls` lists the sandboxes on unix:/run/sandgate/node.sock (is that the node "
            "you meant?)");
}

TEST(ErrorMessage, CreateThatCouldNotStartSaysItWasNotCreated) {
  EXPECT_EQ(error_message(500, R"({"error":"io","message":"cannot start sandbox: mkdir: No space left on device"})",
                          {"create", "web", kWhere}),
            "cannot start sandbox: mkdir: No space left on device. The sandbox was not created: fix the cause "
            "(sandgate-node's log has the details), then run the same create again");
  // The same status from another command is only the node's message.
  EXPECT_EQ(error_message(500, R"({"error":"io","message":"disk"})", {"rm", "web", kWhere}), "disk");
}

TEST(ErrorMessage, AnswerThatIsNotTheNodesPointsAtTheApiAddress) {
  const std::string hint = "; " + std::string(kCheckApiHint);
  EXPECT_EQ(error_message(502, "upstream down\n", {"ls", "", "http://127.0.0.1:8000"}),
            "the server at http://127.0.0.1:8000 answered HTTP 502 Bad Gateway: upstream down" + hint);
  EXPECT_EQ(error_message(500, "", {"ls", "", kWhere}),
            "the server at unix:/run/sandgate/node.sock answered HTTP 500 Internal Server Error" + hint);
  EXPECT_NE(kCheckApiHint.find("SANDGATE_API"), std::string::npos);
}

TEST(ErrorMessage, FailedSandboxSaysWhyAndWhatToDo) {
  json failed = json::parse(R"({"id":"sb-1","name":"bad","state":"failed",
                                "state_reason":"the sandbox's process exited on its own"})");
  EXPECT_EQ(failed_message(failed, "resumed"),
            "sandbox bad has failed (the sandbox's process exited on its own), so it cannot be resumed. A failed "
            "sandbox does not run again: remove it with `sandgate rm bad` and create it anew (`sandgate get bad` "
            "shows its command, which must keep running inside the sandbox)");
  auto at_create = failed_message(failed, "");
  ASSERT_TRUE(at_create);
  EXPECT_TRUE(at_create->starts_with("sandbox bad failed as it started (the sandbox's process exited on its own). "))
      << *at_create;
  EXPECT_FALSE(failed_message(json::parse(R"({"id":"sb-1","name":"ok","state":"running"})"), "resumed"));
  EXPECT_EQ(sandbox_label(json::parse(R"({"id":"sb-1","name":null})")), "sb-1");
}

TEST(ParseObject, RejectsNonObjectsNamingTheAddress) {
  EXPECT_TRUE(parse_object(R"({"a":1})", kWhere));
  EXPECT_FALSE(parse_object("[1]", kWhere));
  EXPECT_FALSE(parse_object("", kWhere));
  auto r = parse_object("not json", kWhere);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.message(), "the server at unix:/run/sandgate/node.sock answered something that is not a JSON object "
                         "(not json): " + std::string(kCheckApiHint));
}

TEST(Timestamp, Parses) {
  auto t = parse_timestamp("2026-11-29T10:00:00.250Z");
  ASSERT_TRUE(t);
  auto base = parse_timestamp("2026-11-29T10:00:00Z");
  ASSERT_TRUE(base);
  EXPECT_EQ(*t - *base, 250ms);
  EXPECT_EQ(std::chrono::duration_cast<std::chrono::seconds>(base->time_since_epoch()).count(), 1795946400);
  EXPECT_EQ(*parse_timestamp("2026-11-29T10:00:00.5Z") - *base, 500ms);
  for (const char* bad : {"", "2026-11-29", "2026-11-29T10:00:00", "2026-13-01T00:00:00Z", "2026-02-30T00:00:00Z",
                          "2026-11-29T25:00:00Z", "2026-11-29T10:00:00.Z", "2026-11-29T10:00:00.abcZ",
                          "20x6-11-29T10:00:00Z"})
    EXPECT_FALSE(parse_timestamp(bad)) << bad;
}

TEST(Duration, LargestUnit) {
  EXPECT_EQ(format_duration(0s), "0s");
  EXPECT_EQ(format_duration(59s), "59s");
  EXPECT_EQ(format_duration(60s), "1m");
  EXPECT_EQ(format_duration(3599s), "59m");
  EXPECT_EQ(format_duration(7200s), "2h");
  EXPECT_EQ(format_duration(3 * 86400s + 5s), "3d");
  EXPECT_EQ(format_duration(-5s), "0s");
}

TEST(ShellJoin, QuotesOnlyWhenNeeded) {
  EXPECT_EQ(shell_join({"python3", "-m", "http.server", "8080"}), "python3 -m http.server 8080");
  EXPECT_EQ(shell_join({"sh", "-c", "echo hi; it's"}), "sh -c 'echo hi; it'\\''s'");
  EXPECT_EQ(shell_join({""}), "''");
}

const char* kSandbox = R"({
  "id": "sb-0123456789ab", "name": "demo", "state": "running", "state_reason": "", "ephemeral": false,
  "driver": "process", "command": ["python3", "-m", "http.server", "8080"], "env": {"K": "V W"}, "cwd": "/",
  "exposed_ports": [8080, 10000], "timeout_secs": 300, "cpus": 1.0, "memory_mb": 512, "pid": 1234,
  "created_at": "2026-11-29T10:00:00.000Z", "last_activity_at": "2026-11-29T10:04:00.000Z",
  "idle_deadline_at": "2026-11-29T10:09:00.000Z", "connections": 0, "tier": null, "hibernate_after_secs": 0,
  "next_transition": "suspend", "next_transition_at": "2026-11-29T10:09:00.000Z",
  "urls": {"8080": "https://8080-demo.sandbox.localhost:8443/", "10000": "https://10000-demo.sandbox.localhost:8443/"},
  "snapshot": {"bytes": 5}})";

TimePoint at(const char* ts) { return *parse_timestamp(ts); }

TEST(Format, Created) {
  EXPECT_EQ(format_created(json::parse(kSandbox)),
            "id:    sb-0123456789ab\n"
            "name:  demo\n"
            "state: running\n"
            "url:   https://8080-demo.sandbox.localhost:8443/\n"
            "url:   https://10000-demo.sandbox.localhost:8443/\n");
  EXPECT_EQ(format_created(json::parse(
                R"({"id":"sb-x","name":null,"state":"failed","state_reason":"exec: not found","urls":{}})")),
            "id:     sb-x\n"
            "name:   -\n"
            "state:  failed\n"
            "reason: exec: not found\n");
}

TEST(Format, FleetListHasANodeColumnAndNodesListsTheFleet) {
  json answer = json::parse(R"({"sandboxes": [{"id": "sb-a", "name": "web", "state": "running", "driver": "process",
                                               "node": "n2", "exposed_ports": []}]})");
  EXPECT_EQ(format_list(answer, at("2026-11-29T10:05:00Z")),
            "ID    NAME  NODE  DRIVER   STATE    TIER  PORTS  IDLE-IN  NEXT  AGE\n"
            "sb-a  web   n2    process  running  -     -      -        -     -\n");
  json nodes = json::parse(R"({"node": "n1", "nodes": [
      {"name": "n1", "state": "ready", "sandboxes": 3, "capacity_sandboxes": 100, "images": ["base", "python"],
       "capacity_memory_mb": 1048576, "reserved_memory_mb": 1536, "capacity_millicpus": 4000,
       "reserved_millicpus": 2500, "api": "https://10.0.0.1:9444"},
      {"name": "n2", "state": "draining", "sandboxes": 0, "capacity_sandboxes": 50, "images": null,
       "api": "https://10.0.0.2:9444"}]})");
  EXPECT_EQ(format_nodes(nodes),
            "NAME  STATE     SANDBOXES  CAPACITY  MEMORY-MB     CPUS   IMAGES  API\n"
            "n1 *  ready     3          100       1536/1048576  2.5/4  2       https://10.0.0.1:9444\n"
            "n2    draining  0          50        0/-           0/-    -       https://10.0.0.2:9444\n");
  EXPECT_EQ(format_drained(json::parse(R"({"node": "n2", "draining": true, "sandboxes": [
      {"name": "job-1", "state": "suspended"}, {"name": "web", "state": "running"}]})")),
            "node n2 is draining: no new sandbox is placed there\n"
            "2 sandboxes stay on it (they keep answering and waking there; none is moved):\n"
            "NAME   STATE\n"
            "job-1  suspended\n"
            "web    running\n");
  EXPECT_EQ(format_drained(json::parse(R"({"node": "n2", "draining": true, "sandboxes": []})")),
            "node n2 is draining: no new sandbox is placed there\nno sandbox stays on it\n");
  EXPECT_TRUE(check_node_name("n-1"));
  EXPECT_FALSE(check_node_name("../x"));
  EXPECT_FALSE(check_node_name(""));
}

TEST(Format, CreatedShowsTheToken) {
  EXPECT_EQ(format_created(json::parse(R"({"id":"sb-x","name":"a","state":"running","urls":{},"token":"sgt_abc"})")),
            "id:    sb-x\n"
            "name:  a\n"
            "state: running\n"
            "token: sgt_abc\n");
}

TEST(Format, List) {
  json answer = json::parse(R"({"sandboxes": [)" + std::string(kSandbox) +
                            R"(, {"id": "sb-zzzzzzzzzzzz", "name": null, "state": "suspended", "exposed_ports": [],
                                  "driver": "qemu", "tier": "memory", "next_transition": "hibernate",
                                  "next_transition_at": "2026-11-29T11:05:00.000Z",
                                  "created_at": "2026-11-27T10:05:00.000Z", "idle_deadline_at": null}]})");
  EXPECT_EQ(format_list(answer, at("2026-11-29T10:05:00Z")),
            "ID               NAME  DRIVER   STATE      TIER    PORTS       IDLE-IN  NEXT             AGE\n"
            "sb-0123456789ab  demo  process  running    -       8080,10000  240      suspend in 4m    5m\n"
            "sb-zzzzzzzzzzzz  -     qemu     suspended  memory  -           -        hibernate in 1h  2d\n");
  // A deadline already passed (the node has not acted yet) reads 0, never negative.
  EXPECT_NE(format_list(answer, at("2026-11-29T11:00:00Z")).find("  0  "), std::string::npos);
  EXPECT_EQ(format_list(json::parse(R"({"sandboxes": []})"), at("2026-11-29T10:05:00Z")),
            "ID  NAME  DRIVER  STATE  TIER  PORTS  IDLE-IN  NEXT  AGE\n");
  // Garbage in, still a table out.
  EXPECT_EQ(format_list(json::parse(R"({"sandboxes": [7]})"), at("2026-11-29T10:05:00Z")),
            "ID  NAME  DRIVER  STATE  TIER  PORTS  IDLE-IN  NEXT  AGE\n"
            "-   -     -       -      -     -      -        -     -\n");
}

TEST(Format, Sandbox) {
  EXPECT_EQ(format_sandbox(json::parse(kSandbox), at("2026-11-29T10:05:00Z")),
            "id:                   sb-0123456789ab\n"
            "name:                 demo\n"
            "state:                running\n"
            "state_reason:         -\n"
            "tier:                 -\n"
            "ephemeral:            false\n"
            "driver:               process\n"
            "command:              python3 -m http.server 8080\n"
            "cwd:                  /\n"
            "env:                  'K=V W'\n"
            "exposed_ports:        8080, 10000\n"
            "timeout_secs:         300\n"
            "hibernate_after_secs: 0\n"
            "cpus:                 1.0\n"
            "memory_mb:            512\n"
            "pid:                  1234\n"
            "created_at:           2026-11-29T10:00:00.000Z (5m ago)\n"
            "last_activity_at:     2026-11-29T10:04:00.000Z (1m ago)\n"
            "idle_deadline_at:     2026-11-29T10:09:00.000Z (in 4m)\n"
            "next_transition:      suspend\n"
            "next_transition_at:   2026-11-29T10:09:00.000Z (in 4m)\n"
            "connections:          0\n"
            "url:                  https://8080-demo.sandbox.localhost:8443/\n"
            "url:                  https://10000-demo.sandbox.localhost:8443/\n"
            "snapshot:             {\"bytes\":5}\n");
}

TEST(Format, StateChange) {
  EXPECT_EQ(format_state_change(json::parse(R"({"id":"sb-1","name":"demo","state":"suspending"})")),
            "demo: suspending\n");
  EXPECT_EQ(format_state_change(json::parse(R"({"id":"sb-1","name":null,"state":"terminated"})")),
            "sb-1: terminated\n");
}

// ---- the client against a scripted server on a unix socket ----

class FakeNode : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sg-cli-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    address_ = *parse_api_address("unix:" + dir_ + "/node.sock");
  }
  void TearDown() override {
    if (server_.joinable()) server_.join();
    std::filesystem::remove_all(dir_);
  }

  // Accepts one connection, reads the request head (and body if `read_body`), writes `answer`, closes
  // unless `hang`, in which case it holds the connection until the client is gone.
  void serve(std::string answer, bool hang = false) {
    auto listener = listen_on(address_.endpoint, false);
    ASSERT_TRUE(listener) << listener.message();
    server_ = std::thread([this, fd = std::move(*listener), answer = std::move(answer), hang]() mutable {
      pollfd p{fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) return;
      UniqueFd conn(::accept4(fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
      char buf[4096];
      while (received_.find("\r\n\r\n") == std::string::npos ||
             received_.size() < received_.find("\r\n\r\n") + 4 + content_length()) {
        ssize_t n = ::recv(conn.get(), buf, sizeof buf, 0);
        if (n <= 0) return;
        received_.append(buf, static_cast<size_t>(n));
      }
      ::send(conn.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
      if (hang) while (::recv(conn.get(), buf, sizeof buf, 0) > 0) {}
    });
  }

  size_t content_length() const {
    auto pos = received_.find("Content-Length: ");
    return pos == std::string::npos ? 0 : std::strtoul(received_.c_str() + pos + 16, nullptr, 10);
  }

  std::string dir_;
  ApiAddress address_;
  std::thread server_;
  std::string received_;
};

TEST_F(FakeNode, PostsJsonAndReadsAnswer) {
  serve("HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{\"id\":1}\n");
  ApiClient client(address_, 5000);
  auto res = client.request("POST", "/v1/sandboxes", json{{"command", {"true"}}});
  ASSERT_TRUE(res) << res.message();
  EXPECT_EQ(res->status, 201);
  EXPECT_EQ(res->body, "{\"id\":1}\n");
  server_.join();
  EXPECT_EQ(received_,
            "POST /v1/sandboxes HTTP/1.1\r\nHost: localhost\r\nUser-Agent: sandgate-cli\r\n"
            "Accept: application/json\r\nConnection: close\r\nContent-Type: application/json\r\n"
            "Content-Length: 20\r\n\r\n{\"command\":[\"true\"]}");
}

TEST_F(FakeNode, ChunkedAnswerWithoutBodyRequest) {
  serve("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n");
  auto res = ApiClient(address_, 5000).request("GET", "/v1/sandboxes");
  ASSERT_TRUE(res) << res.message();
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "{\"a\":1}");
  server_.join();
  EXPECT_NE(received_.find("Content-Length: 0\r\n"), std::string::npos);
  EXPECT_EQ(received_.find("Content-Type"), std::string::npos);
}

TEST_F(FakeNode, AnswerDelimitedByClose) {
  serve("HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\n{\"message\":\"no such sandbox\"}");
  auto res = ApiClient(address_, 5000).request("GET", "/v1/sandboxes/x");
  ASSERT_TRUE(res) << res.message();
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(error_message(res->status, res->body, {"get", "", "unix:/x.sock"}), "no such sandbox");
}

// The node is not running: no socket at all, or one left behind that nobody accepts on. The message names
// the address, the cause, and both ways out (start the node, or point SANDGATE_API elsewhere).
void expect_node_down(const Result<ApiResponse>& res, const std::string& address, const std::string& cause) {
  ASSERT_FALSE(res);
  EXPECT_EQ(res.error(), Error::kUnavailable);
  EXPECT_EQ(res.message(),
            "cannot reach sandgate-node at " + address + ": " + cause + ". " + std::string(kNodeDownHint));
  EXPECT_NE(res.message().find("Is sandgate-node running?"), std::string::npos);
  EXPECT_NE(res.message().find("deploy/quickstart.sh"), std::string::npos);
  EXPECT_NE(res.message().find("SANDGATE_API"), std::string::npos);
}

TEST_F(FakeNode, NoSocketSaysStartTheNodeOrSetTheApi) {
  expect_node_down(ApiClient(address_, 5000).request("GET", "/v1/health"), "unix:" + dir_ + "/node.sock",
                   "No such file or directory");
}

TEST_F(FakeNode, StaleSocketSaysStartTheNodeOrSetTheApi) {
  // Bound but never listened on: what a node that died leaves behind.
  UniqueFd stale(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un sun{};
  sun.sun_family = AF_UNIX;
  std::string path = dir_ + "/node.sock";
  std::memcpy(sun.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(stale.get(), reinterpret_cast<sockaddr*>(&sun), sizeof sun), 0);
  expect_node_down(ApiClient(address_, 5000).request("GET", "/v1/health"), "unix:" + path, "Connection refused");
}

TEST_F(FakeNode, ClosedWithoutAnswerAsksWhetherThisIsTheNode) {
  serve("");
  auto res = ApiClient(address_, 5000).request("GET", "/v1/health");
  ASSERT_FALSE(res);
  EXPECT_EQ(res.error(), Error::kUnavailable);
  EXPECT_NE(res.message().find("closed the connection"), std::string::npos) << res.message();
  EXPECT_NE(res.message().find("is that sandgate-node's API? Check --api / SANDGATE_API"), std::string::npos)
      << res.message();
}

TEST_F(FakeNode, TruncatedAnswer) {
  serve("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"a\"");
  auto res = ApiClient(address_, 5000).request("GET", "/v1/health");
  ASSERT_FALSE(res);
  EXPECT_EQ(res.error(), Error::kIo);
  EXPECT_NE(res.message().find("SANDGATE_API"), std::string::npos) << res.message();
}

// SANDGATE_API names some other HTTP server: its answer is not the node's, and the message says to check it.
TEST_F(FakeNode, AnotherServerAtTheApiAddressIsNamedAsSuch) {
  serve("HTTP/1.1 404 Not Found\r\nContent-Type: text/html\r\nContent-Length: 22\r\n\r\n<h1>404 not found</h1>");
  auto res = ApiClient(address_, 5000).request("GET", "/v1/sandboxes");
  ASSERT_TRUE(res) << res.message();
  std::string where = api_address_string(address_);
  EXPECT_EQ(error_message(res->status, res->body, {"ls", "", where}),
            "the server at " + where + " answered HTTP 404 Not Found: <h1>404 not found</h1>; " +
                std::string(kCheckApiHint));
}

TEST_F(FakeNode, Timeout) {
  serve("HTTP/1.1 200 OK\r\n", /*hang=*/true);
  auto start = std::chrono::steady_clock::now();
  auto res = ApiClient(address_, 300).request("GET", "/v1/health");
  ASSERT_FALSE(res);
  EXPECT_EQ(res.error(), Error::kTimeout);
  EXPECT_NE(res.message().find("did not answer within 300 ms"), std::string::npos) << res.message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}


// ---- the client through a TLS server standing in for the ingress ----

class HttpsApi : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sg-cli-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    cert_.write_pem(dir_ + "/ca.pem");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  ApiClient client(const std::string& url, IngressAccess access) {
    auto a = parse_api_address(url);
    EXPECT_TRUE(a) << a.message();
    return ApiClient(a ? *a : ApiAddress{}, 5000, std::move(access));
  }
  IngressAccess access(std::string token = "op-secret") { return {std::move(token), dir_ + "/ca.pem", {}, {}}; }

  std::string dir_;
  TestCert cert_;
};

constexpr const char* kListAnswer = "HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n{\"sandboxes\":[]}";

TEST_F(HttpsApi, SendsTheBearerTokenAndVerifiesTheUrlsHost) {
  FakeIngress ingress(cert_, kListAnswer, "");
  // *.localhost dials loopback by itself: glibc would not resolve the name.
  auto res = client("https://api.sandbox.localhost:" + std::to_string(ingress.port()), access())
                 .request("GET", "/v1/sandboxes");
  ASSERT_TRUE(res) << res.message();
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "{\"sandboxes\":[]}");
  EXPECT_EQ(ingress.sni(), "api.sandbox.localhost");
  EXPECT_EQ(ingress.alpn_offered(), std::string("\x08http/1.1"));
  EXPECT_NE(ingress.head().find("\r\nAuthorization: Bearer op-secret\r\n"), std::string::npos) << ingress.head();
}

TEST_F(HttpsApi, ConnectToDialsElsewhereButChecksTheUrlsHost) {
  FakeIngress ingress(cert_, kListAnswer, "");
  IngressAccess a = access();
  a.connect_to = Ingress{"127.0.0.1", ingress.port()};
  auto res = client("https://api.sandbox.example:1", a).request("GET", "/v1/sandboxes");
  ASSERT_FALSE(res);  // the certificate names *.sandbox.localhost only
  EXPECT_EQ(res.error(), Error::kUnavailable);
  // The CA is right; the name is what to fix.
  EXPECT_NE(res.message().find("not valid for api.sandbox.example (hostname mismatch)"), std::string::npos)
      << res.message();
  EXPECT_NE(res.message().find("--domain / SANDGATE_DOMAIN, or the host in --api"), std::string::npos)
      << res.message();

  FakeIngress ingress2(cert_, kListAnswer, "");
  a.connect_to = Ingress{"127.0.0.1", ingress2.port()};
  auto ok = client("https://api.sandbox.localhost:1", a).request("GET", "/v1/sandboxes");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->status, 200);
  EXPECT_NE(ingress2.head().find("\r\nHost: api.sandbox.localhost:1\r\n"), std::string::npos) << ingress2.head();
}

TEST_F(HttpsApi, UntrustedCertificateIsRefused) {
  FakeIngress ingress(cert_, kListAnswer, "");
  IngressAccess a = access();
  a.cacert.clear();  // the system's store does not know the test CA
  auto res = client("https://api.sandbox.localhost:" + std::to_string(ingress.port()), a).request("GET", "/v1/sandboxes");
  ASSERT_FALSE(res);
  EXPECT_EQ(res.error(), Error::kUnavailable);
  EXPECT_NE(res.message().find("certificate for api.sandbox.localhost is not trusted (self-signed certificate): "
                               "pass the CA that signed it with --cacert or SANDGATE_CACERT"),
            std::string::npos)
      << res.message();
  EXPECT_NE(res.message().find("tls/ca.pem"), std::string::npos) << res.message();
}

TEST_F(HttpsApi, NoIngressListeningSaysStartItOrDialElsewhere) {
  uint16_t port = 0;
  {
    FakeIngress gone(cert_, kListAnswer, "");  // its port, then nothing listens there
    port = gone.port();
    auto ok = client("https://api.sandbox.localhost:" + std::to_string(port), access()).request("GET", "/v1/sandboxes");
    ASSERT_TRUE(ok) << ok.message();
  }
  auto res = client("https://api.sandbox.localhost:" + std::to_string(port), access()).request("GET", "/v1/sandboxes");
  ASSERT_FALSE(res);
  EXPECT_EQ(res.error(), Error::kUnavailable);
  EXPECT_NE(res.message().find("Connection refused). Is it running and listening there?"), std::string::npos)
      << res.message();
  EXPECT_NE(res.message().find("--connect-to / SANDGATE_INGRESS"), std::string::npos) << res.message();
}

TEST_F(HttpsApi, WrongOperatorTokenSaysWhichTokenToPass) {
  FakeIngress ingress(cert_, "HTTP/1.1 401 Unauthorized\r\nContent-Length: 5\r\n\r\nnope\n", "");
  std::string url = "https://api.sandbox.localhost:" + std::to_string(ingress.port());
  auto res = client(url, access("wrong")).request("GET", "/v1/sandboxes");
  ASSERT_TRUE(res) << res.message();
  EXPECT_EQ(res->status, 401);
  std::string msg = error_message(res->status, res->body, {"ls", "", url, true});
  EXPECT_NE(msg.find("refused the operator token"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--token or SANDGATE_TOKEN"), std::string::npos) << msg;
  EXPECT_NE(msg.find("operator.token"), std::string::npos) << msg;
}

TEST_F(HttpsApi, MissingOperatorTokenSaysSo) {
  FakeIngress ingress(cert_, "HTTP/1.1 401 Unauthorized\r\nContent-Length: 5\r\n\r\nnope\n", "");
  std::string url = "https://api.sandbox.localhost:" + std::to_string(ingress.port());
  auto res = client(url, access("")).request("GET", "/v1/sandboxes");
  ASSERT_TRUE(res) << res.message();
  EXPECT_EQ(res->status, 401);
  EXPECT_EQ(ingress.head().find("Authorization"), std::string::npos) << ingress.head();
  std::string msg = error_message(res->status, res->body, {"ls", "", url, false});
  EXPECT_NE(msg.find("wants the operator token (HTTP 401 Unauthorized) and none was given: pass it with --token or "
                     "SANDGATE_TOKEN"),
            std::string::npos)
      << msg;
}

TEST_F(HttpsApi, ATokenThatCouldForgeHeadersIsRefused) {
  auto res = client("https://api.sandbox.localhost:1", access("op\r\nX-Evil: 1")).request("GET", "/v1/sandboxes");
  ASSERT_FALSE(res);
  EXPECT_EQ(res.error(), Error::kInvalidArgument);
}

}  // namespace
}  // namespace sg::cli
