// The agent served in-process (its own loop on a thread), driven by real clients: curl (HTTP/1.1 and h2c
// with prior knowledge), nghttp, h2load, and raw sockets for what clients do not do on purpose.
#include "agent/server.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>

#include "tests/unit/agent/agent_test_support.h"

namespace sg::agent {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr const char* kH2 = "--http2-prior-knowledge ";

using test_support::Ran;
using test_support::run;
using test_support::ndjson;

std::string stdout_of(const std::vector<json>& events) {
  std::string out;
  for (const json& e : events)
    if (e.value("type", "") == "stdout" && e.contains("data")) out += e["data"].get<std::string>();
  return out;
}

// Gone: reaped, or a zombie waiting for a reaper that is not the agent (an orphaned grandchild).
bool process_gone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

bool eventually(const std::function<bool()>& condition, int timeout_ms = 5000) {
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return condition();
}

void send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return;  // the server may close early on purpose (limits); the tests read what it said
    data.remove_prefix(static_cast<size_t>(n));
  }
}

// Reads until `needle` appears (empty: until EOF) or the timeout; *eof says whether the peer closed.
std::string read_until(int fd, std::string_view needle, int timeout_ms, bool* eof = nullptr) {
  std::string got;
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  if (eof != nullptr) *eof = false;
  while (needle.empty() || got.find(needle) == std::string::npos) {
    int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, left) <= 0) break;
    char buf[65536];
    ssize_t n = ::read(fd, buf, sizeof buf);  // sockets and pipes alike
    if (n <= 0) {
      if (eof != nullptr) *eof = true;
      break;
    }
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

// Every POST in these tests carries JSON: /exec refuses anything else (415).
std::string post(std::string_view path, std::string_view body, std::string_view extra_headers = "") {
  return "POST " + std::string(path) + " HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n" + std::string(extra_headers) + "\r\n" + std::string(body);
}

// curl's -d / --data-binary default to application/x-www-form-urlencoded, which /exec refuses.
const std::string kJson = "-H 'Content-Type: application/json' ";

std::string exec_body(const std::string& script) { return json{{"command", {"sh", "-c", script}}}.dump(); }

class AgentTest : public test_support::InProcessAgentTest {
 protected:
  std::string file_url(const std::string& path) const { return url("/files?path=" + path); }

  UniqueFd connect() {
    auto fd = connect_blocking(*parse_endpoint(server_->address()), 2000);
    EXPECT_TRUE(fd.ok());
    return fd.ok() ? std::move(*fd) : UniqueFd();
  }

  std::string random_file(const std::string& name, size_t bytes) {
    std::string data(bytes, '\0');
    std::mt19937_64 rng(42);
    for (size_t i = 0; i < bytes; i += 8) {
      uint64_t v = rng();
      std::memcpy(data.data() + i, &v, std::min<size_t>(8, bytes - i));
    }
    return write_file(name, data);
  }

  // Runs an exec through curl and returns its events.
  std::vector<json> exec(const json& body, const char* proto = "") {
    std::string body_path = write_file("exec.json", body.dump());
    Ran r = run("curl -sS -N " + kJson + std::string(proto) + "-X POST --data-binary @" + body_path + " " + url("/exec"));
    EXPECT_EQ(r.status, 0) << r.out;
    return ndjson(r.out);
  }

  int http_status(const std::string& curl_args) {
    Ran r = run("curl -sS -o /dev/null -w '%{http_code}' " + curl_args);
    return std::atoi(r.out.c_str());
  }

  // An h2 answer given before the request body was sent (an error) comes with RST_STREAM(NO_ERROR), as
  // RFC 9113 §8.1 allows; curl 7.88 reports that as error 92, so these cases use nghttp2's own client.
  int h2_status(const std::string& method, const std::string& body_path, const std::string& target,
                const std::string& content_type = "application/json") {
    Ran r = run("nghttp -v -H ':method: " + method + "' -H 'content-type: " + content_type + "' -d " + body_path + " '" +
                target + "' 2>&1");
    std::smatch m;
    if (!std::regex_search(r.out, m, std::regex(":status: (\\d+)"))) return 0;
    return std::stoi(m[1]);
  }

  bool healthy() { return run("curl -sS --max-time 3 " + url("/health")).out.find("\"ok\"") != std::string::npos; }

};

// ---- health, routing, errors ----

TEST_F(AgentTest, HealthOnBothProtocols) {
  for (const char* proto : {"", kH2}) {
    Ran r = run("curl -sS -i " + std::string(proto) + url("/health"));
    ASSERT_EQ(r.status, 0);
    EXPECT_NE(r.out.find(proto[0] ? "HTTP/2 200" : "HTTP/1.1 200"), std::string::npos) << r.out;
    json body = json::parse(r.out.substr(r.out.find("\r\n\r\n") + 4), nullptr, false);
    EXPECT_EQ(body["status"], "ok");
    EXPECT_EQ(body["version"], std::string(kAgentVersion));
  }
}

TEST_F(AgentTest, UnknownPathWrongMethodAndBadJson) {
  for (const char* proto : {"", kH2}) {
    Ran r = run("curl -sS " + std::string(proto) + url("/nope"));
    EXPECT_EQ(json::parse(r.out, nullptr, false)["error"], "not_found") << r.out;
    r = run("curl -sS -i -X DELETE " + std::string(proto) + file_url("/tmp/x"));
    EXPECT_NE(r.out.find(" 405"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(proto[0] ? "allow: GET, PUT" : "Allow: GET, PUT"), std::string::npos) << r.out;
    r = run("curl -sS -i " + std::string(proto) + url("/exec"));
    EXPECT_NE(r.out.find("llow: POST"), std::string::npos) << r.out;
    r = run("curl -sS -w ' %{http_code}' " + kJson + "-X POST -d '{\"command\": [' " + std::string(proto) + url("/exec"));
    EXPECT_NE(r.out.find("\"error\":\"invalid_argument\""), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("not valid JSON"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(" 400"), std::string::npos) << r.out;
  }
}

// ---- exec ----

TEST_F(AgentTest, ExecStreamsOutputWhileTheCommandRuns) {
  std::string body_path = write_file("slow.json", exec_body("echo first; sleep 2; echo second"));
  for (const char* proto : {"", kH2}) {
    auto t0 = Clock::now();
    FILE* f = ::popen(("curl -sS -N " + kJson + std::string(proto) + "--data-binary @" + body_path + " " + url("/exec")).c_str(),
                      "r");
    ASSERT_NE(f, nullptr);
    double first_at = -1, exit_at = -1;
    std::vector<json> events;
    char line[4096];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      double at = std::chrono::duration<double>(Clock::now() - t0).count();
      events.push_back(json::parse(line, nullptr, false));
      if (events.back()["type"] == "stdout" && first_at < 0) first_at = at;
      if (events.back()["type"] == "exit") exit_at = at;
    }
    ::pclose(f);
    ASSERT_GE(events.size(), 4u) << proto;
    EXPECT_EQ(events.front()["type"], "start");
    EXPECT_GT(events.front()["pid"].get<int>(), 0);
    EXPECT_EQ(stdout_of(events), "first\nsecond\n");
    EXPECT_EQ(events.back(), json({{"type", "exit"}, {"code", 0}}));
    EXPECT_GE(first_at, 0) << proto;
    EXPECT_LT(first_at, 1.0) << "first output was held back until " << first_at << " s (" << proto << ")";
    EXPECT_GE(exit_at, 1.9) << proto;
  }
}

TEST_F(AgentTest, ExecEnvCwdStdinExitCodesAndSignals) {
  auto events = exec({{"command", {"sh", "-c", "echo $GREETING; pwd; cat; echo oops >&2; exit 7"}},
                      {"env", {{"GREETING", "hello"}}},
                      {"cwd", dir_},
                      {"stdin", "from stdin\n"}});
  EXPECT_EQ(stdout_of(events), "hello\n" + dir_ + "\nfrom stdin\n");
  bool saw_stderr = false;
  for (const json& e : events) saw_stderr = saw_stderr || (e["type"] == "stderr" && e["data"] == "oops\n");
  EXPECT_TRUE(saw_stderr);
  EXPECT_EQ(events.back(), json({{"type", "exit"}, {"code", 7}}));
  // The agent's own environment is inherited under the request's.
  ::setenv("SANDGATE_AGENT_TEST_INHERITED", "yes", 1);
  events = exec({{"command", {"sh", "-c", "echo $SANDGATE_AGENT_TEST_INHERITED"}}}, kH2);
  EXPECT_EQ(stdout_of(events), "yes\n");
  events = exec({{"command", {"sh", "-c", "kill -9 $$"}}});
  EXPECT_EQ(events.back(), json({{"type", "exit"}, {"signal", 9}}));
}

TEST_F(AgentTest, ExecOutputIsAlwaysValidJson) {
  // Invalid UTF-8 arrives byte-exact in data_b64; a character split across two writes stays text.
  auto events = exec({{"command", {"sh", "-c", "printf 'ok\\377\\376'; sleep 0.3; printf '\\303'; sleep 0.3; printf '\\251\\n'"}}});
  std::vector<json> out;
  for (const json& e : events) {
    ASSERT_FALSE(e.is_discarded());
    if (e["type"] == "stdout") out.push_back(e);
  }
  ASSERT_EQ(out.size(), 2u) << json(events).dump();
  EXPECT_EQ(out[0]["data_b64"], "b2v//g==");
  EXPECT_EQ(out[1]["data"], "\xc3\xa9\n");
}

TEST_F(AgentTest, ExecTimeoutKillsTheGroup) {
  auto t0 = Clock::now();
  auto events = exec({{"command", {"sh", "-c", "sleep 30"}}, {"timeout_secs", 1}});
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(events.back(), json({{"type", "exit"}, {"signal", 9}, {"timed_out", true}}));
}

// A page on another sandbox (the same site) can POST text/plain or a form without a CORS preflight, but not
// application/json: requiring it keeps such a page from running commands with the browser's cookie.
TEST_F(AgentTest, ExecNeedsAJsonContentType) {
  const std::string body = "-d '{\"command\":[\"true\"]}' ";
  Ran r = run("curl -sS -w ' %{http_code}' -H 'Content-Type: text/plain' " + body + url("/exec"));
  EXPECT_NE(r.out.find(" 415"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("application/json"), std::string::npos) << r.out;
  EXPECT_EQ(http_status(body + url("/exec")), 415) << "a form post";
  EXPECT_EQ(http_status("-H 'Content-Type: Application/JSON; charset=utf-8' " + body + url("/exec")), 200);
  const std::string path = write_file("true.json", R"({"command":["true"]})");
  EXPECT_EQ(h2_status("POST", path, url("/exec"), "text/plain"), 415);
  // curl 7.88 over h2: the 415 may leave before the body does; a small body is read, not reset, so curl
  // gets its answer every time (a RST_STREAM would make it fail with error 92 whenever it loses the race).
  for (int i = 0; i < 20; ++i) {
    Ran h2 = run("curl -sS --http2-prior-knowledge -o /dev/null -w '%{http_code}' -H 'Content-Type: text/plain' " +
                 body + url("/exec") + " 2>&1");
    ASSERT_EQ(h2.out, "415") << "attempt " << i;
  }
  EXPECT_EQ(h2_status("POST", path, url("/exec")), 200);
}

TEST_F(AgentTest, ExecSpawnFailuresAreAnsweredBeforeStreaming) {
  for (const char* proto : {"", kH2}) {
    Ran r = run("curl -sS -w ' %{http_code}' " + kJson + std::string(proto) + "-d '{\"command\":[\"/no/such/program\"]}' " +
                url("/exec"));
    EXPECT_NE(r.out.find("\"error\":\"not_found\""), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(" 400"), std::string::npos) << r.out;
    r = run("curl -sS -w ' %{http_code}' " + kJson + std::string(proto) +
            "-d '{\"command\":[\"true\"],\"cwd\":\"/no/such/dir\"}' " + url("/exec"));
    EXPECT_NE(r.out.find(" 400"), std::string::npos) << r.out;
  }
}

TEST_F(AgentTest, ExecBodyOverTheLimitIs413) {
  std::string big = json{{"command", {"echo", std::string(2 * 1024 * 1024, 'x')}}}.dump();
  std::string path = write_file("big.json", big);
  EXPECT_EQ(http_status(kJson + "--data-binary @" + path + " " + url("/exec")), 413);
  EXPECT_EQ(http_status(kJson + "-H 'Transfer-Encoding: chunked' --data-binary @" + path + " " + url("/exec")), 413);
  EXPECT_EQ(h2_status("POST", path, url("/exec")), 413);
  EXPECT_TRUE(healthy());
}

// The client goes away mid-command: the whole process group dies, a background child included.
TEST_F(AgentTest, DisconnectKillsTheProcessGroup) {
  UniqueFd fd = connect();
  send_all(fd.get(), post("/exec", exec_body("sleep 30 & echo $!; wait")));
  std::string got = read_until(fd.get(), "\\n\"}", 5000);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(got, m, std::regex("\"pid\":(\\d+)"))) << got;
  int leader = std::stoi(m[1]);
  ASSERT_TRUE(std::regex_search(got, m, std::regex("\"data\":\"(\\d+)\\\\n\""))) << got;
  int background = std::stoi(m[1]);
  EXPECT_FALSE(process_gone(leader));
  EXPECT_FALSE(process_gone(background));
  fd.reset();
  EXPECT_TRUE(eventually([&] { return process_gone(leader) && process_gone(background); }));

  // h2: curl gives up and closes the connection.
  std::string body_path = write_file("bg.json", exec_body("sleep 30 & echo $!; wait"));
  Ran r = run("curl -sS -N --max-time 1 " + kJson + std::string(kH2) + "--data-binary @" + body_path + " " + url("/exec"));
  auto events = ndjson(r.out);
  ASSERT_GE(events.size(), 2u) << r.out;
  leader = events[0]["pid"];
  background = std::stoi(events[1]["data"].get<std::string>());
  EXPECT_TRUE(eventually([&] { return process_gone(leader) && process_gone(background); }));
}

TEST_F(AgentTest, ServerCloseKillsRunningCommands) {
  UniqueFd fd = connect();
  send_all(fd.get(), post("/exec", exec_body("exec sleep 30")));
  std::string got = read_until(fd.get(), "\"start\"", 5000);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(got, m, std::regex("\"pid\":(\\d+)"))) << got;
  uv_async_send(&stop_);
  thread_.join();  // returns only once the command was reaped
  EXPECT_TRUE(process_gone(std::stoi(m[1])));
}

TEST_F(AgentTest, PipelinedRequestsWaitBehindAStreamedResponse) {
  UniqueFd fd = connect();
  send_all(fd.get(), post("/exec", exec_body("echo one; sleep 0.5; echo two")) +
                         "GET /health HTTP/1.1\r\nHost: a\r\n\r\nGET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  bool eof = false;
  std::string got = read_until(fd.get(), "", 5000, &eof);
  EXPECT_TRUE(eof);
  size_t exit_at = got.find("\"type\":\"exit\"");
  size_t end_of_chunks = got.find("\r\n0\r\n\r\n");
  size_t first_health = got.find("HTTP/1.1 200 OK\r\nContent-Type: application/json");
  ASSERT_NE(exit_at, std::string::npos) << got;
  EXPECT_NE(got.find("Transfer-Encoding: chunked"), std::string::npos);
  EXPECT_LT(exit_at, end_of_chunks);
  EXPECT_LT(end_of_chunks, first_health);
  EXPECT_NE(got.find("\"ok\"", got.find("\"ok\"") + 1), std::string::npos) << "two health answers expected";
}

class ExecLimitTest : public AgentTest {
  AgentLimits limits() const override {
    AgentLimits l;
    l.max_execs = 2;
    return l;
  }
};

TEST_F(ExecLimitTest, CommandsBeyondTheLimitGet429) {
  std::vector<UniqueFd> running;
  for (int i = 0; i < 2; ++i) {
    running.push_back(connect());
    send_all(running.back().get(), post("/exec", exec_body("exec sleep 30")));
    EXPECT_NE(read_until(running.back().get(), "\"start\"", 5000).find("\"start\""), std::string::npos);
  }
  std::string body_path = write_file("true.json", json{{"command", {"true"}}}.dump());
  EXPECT_EQ(http_status(kJson + "--data-binary @" + body_path + " " + url("/exec")), 429);
  EXPECT_EQ(http_status(kJson + std::string(kH2) + "--data-binary @" + body_path + " " + url("/exec")), 429);
  running.clear();  // disconnecting kills them, which frees their slots
  EXPECT_TRUE(eventually([&] { return http_status(kJson + "--data-binary @" + body_path + " " + url("/exec")) == 200; }));
}

// ---- h2 ----

TEST_F(AgentTest, H2ConcurrentExecStreamsOnOneConnection) {
  std::string body_path = write_file("sleep.json", exec_body("sleep 1; echo done"));
  auto t0 = Clock::now();
  Ran r = run("nghttp -m 5 -H 'content-type: application/json' -d " + body_path + " " + url("/exec"));
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_EQ(r.status, 0) << r.out;
  size_t exits = 0;
  for (size_t pos = 0; (pos = r.out.find("\"type\":\"exit\",\"code\":0", pos)) != std::string::npos; ++pos) ++exits;
  EXPECT_EQ(exits, 5u) << r.out;
  EXPECT_LT(took, 3.5) << "the five commands ran one after another";
}

TEST_F(AgentTest, H2ManyStreamsAreBoundedBySettings) {
  // h2load opens 10,000 streams on one connection; the agent's SETTINGS cap how many run at once.
  Ran r = run("h2load -n 10000 -c 1 -m 10000 " + url("/health") + " 2>&1");
  EXPECT_NE(r.out.find("10000 succeeded, 0 failed, 0 errored"), std::string::npos) << r.out;
  EXPECT_TRUE(healthy());
}

TEST_F(AgentTest, H2GarbageAfterThePrefaceGetsGoaway) {
  UniqueFd fd = connect();
  send_all(fd.get(), std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string(200, '\x7f'));
  bool eof = false;
  std::string got = read_until(fd.get(), "", 5000, &eof);
  EXPECT_TRUE(eof);
  // A GOAWAY frame (type 7) follows the server's SETTINGS.
  bool goaway = false;
  for (size_t pos = 0; pos + 9 <= got.size();) {
    size_t len = (static_cast<uint8_t>(got[pos]) << 16) | (static_cast<uint8_t>(got[pos + 1]) << 8) |
                 static_cast<uint8_t>(got[pos + 2]);
    goaway = goaway || got[pos + 3] == 7;
    pos += 9 + len;
  }
  EXPECT_TRUE(goaway);
  // Almost the preface: taken as HTTP/1.1, which it is not.
  fd = connect();
  send_all(fd.get(), "PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n");
  read_until(fd.get(), "", 5000, &eof);
  EXPECT_TRUE(eof);
  EXPECT_TRUE(healthy());
}

TEST_F(AgentTest, H2HeaderListOverTheLimitIs431) {
  std::string big(20 * 1024, 'a');
  EXPECT_EQ(http_status(std::string(kH2) + "-H 'X-Big: " + big + "' " + url("/health")), 431);
  EXPECT_TRUE(run("curl -sS " + std::string(kH2) + url("/health")).out.find("ok") != std::string::npos);
}

// ---- HTTP/1.1 limits ----

TEST_F(AgentTest, HeaderFloodIs431AndTheAgentKeepsServing) {
  UniqueFd fd = connect();
  send_all(fd.get(), "GET /health HTTP/1.1\r\nHost: a\r\nX-Flood: " + std::string(64 * 1024, 'a') + "\r\n\r\n");
  bool eof = false;
  std::string got = read_until(fd.get(), "", 5000, &eof);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 431")) << got.substr(0, 200);
  EXPECT_TRUE(eof);
  fd = connect();
  send_all(fd.get(), "NOT HTTP AT ALL\r\n\r\n");
  got = read_until(fd.get(), "", 5000, &eof);
  EXPECT_TRUE(got.starts_with("HTTP/1.1 400")) << got;
  EXPECT_TRUE(eof);
  EXPECT_TRUE(healthy());
}

class ConnectionLimitTest : public AgentTest {
  AgentLimits limits() const override {
    AgentLimits l;
    l.max_connections = 3;
    return l;
  }
};

TEST_F(ConnectionLimitTest, ConnectionsBeyondTheLimitAreClosed) {
  std::vector<UniqueFd> open;
  for (int i = 0; i < 3; ++i) {
    open.push_back(connect());
    send_all(open.back().get(), "GET /health HTTP/1.1\r\nHost: a\r\n\r\n");
    EXPECT_NE(read_until(open.back().get(), "\"ok\"", 3000).find("\"ok\""), std::string::npos);
  }
  UniqueFd extra = connect();
  bool eof = false;
  EXPECT_EQ(read_until(extra.get(), "", 3000, &eof), "");
  EXPECT_TRUE(eof);
  open.pop_back();
  EXPECT_TRUE(eventually([&] { return healthy(); }));
}

// ---- files ----

TEST_F(AgentTest, FilesBigDownloadAndUploadAreByteExact) {
  std::string src = random_file("big.bin", 20 * 1024 * 1024 + 123);
  for (const char* proto : {"", kH2}) {
    std::string got = dir_ + "/got.bin";
    Ran r = run("curl -sS -D - -o " + got + " " + proto + file_url(src));
    EXPECT_NE(r.out.find("ength: 20971643\r\n"), std::string::npos) << r.out;
    EXPECT_EQ(run("cmp " + src + " " + got).status, 0) << proto;
    for (const char* extra : {"", "-H 'Transfer-Encoding: chunked' "}) {
      if (proto[0] && extra[0]) continue;  // h2 has no chunked coding
      std::string dst = dir_ + "/up.bin";
      fs::remove(dst);
      EXPECT_EQ(http_status(std::string(proto) + extra + "-T " + src + " " + file_url(dst)), 201) << proto << extra;
      EXPECT_EQ(run("cmp " + src + " " + dst).status, 0) << proto << extra;
      EXPECT_EQ(http_status(std::string(proto) + extra + "-T " + src + " " + file_url(dst)), 204) << proto << extra;
    }
  }
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_EQ(entry.path().filename().string().find(".sandgate-upload"), std::string::npos);
}

TEST_F(AgentTest, FilesStatusCodes) {
  fs::create_directory(dir_ + "/sub");
  std::string small = write_file("small.txt", "hi");
  for (const char* proto : {"", kH2}) {
    std::string p = proto;
    EXPECT_EQ(http_status(p + file_url(dir_ + "/missing")), 404);
    EXPECT_EQ(http_status(p + url("/files?path=relative/path")), 400);
    EXPECT_EQ(http_status(p + url("/files")), 400);
    EXPECT_EQ(http_status(p + url("/files?path=%zz")), 400);
    EXPECT_EQ(http_status(p + file_url(dir_ + "/sub")), 409);
  }
  EXPECT_EQ(http_status("-T " + small + " " + file_url(dir_ + "/no/such/dir/f")), 404);
  EXPECT_EQ(http_status("-T " + small + " " + file_url(dir_ + "/sub")), 409);
  EXPECT_EQ(http_status("-T " + small + " " + file_url(dir_ + "/sub/")), 400);
  EXPECT_EQ(h2_status("PUT", small, file_url(dir_ + "/no/such/dir/f")), 404);
  EXPECT_EQ(h2_status("PUT", small, file_url(dir_ + "/sub")), 409);
  EXPECT_EQ(h2_status("PUT", small, file_url(dir_ + "/sub/")), 400);
  // Percent-decoding: a space and a literal plus in the name.
  EXPECT_EQ(http_status("-T " + small + " " + url("/files?path=" + dir_ + "%2Fsub%2Fa%20b%2Bc")), 201);
  EXPECT_TRUE(fs::exists(dir_ + "/sub/a b+c"));
  Ran r = run("curl -sS " + url("/files?path=" + dir_ + "/sub/a+b%2Bc"));
  EXPECT_EQ(r.out, "hi");
}

class UploadLimitTest : public AgentTest {
  AgentLimits limits() const override {
    AgentLimits l;
    l.max_upload_bytes = 1024 * 1024;
    return l;
  }
};

TEST_F(UploadLimitTest, UploadsOverTheLimitAre413AndLeaveNothing) {
  std::string src = random_file("two-mib.bin", 2 * 1024 * 1024);
  fs::create_directory(dir_ + "/dst");
  std::string dst = dir_ + "/dst/f";
  EXPECT_EQ(http_status("-T " + src + " " + file_url(dst)), 413);
  EXPECT_EQ(http_status("-H 'Transfer-Encoding: chunked' -T " + src + " " + file_url(dst)), 413);
  EXPECT_EQ(h2_status("PUT", src, file_url(dst)), 413);
  EXPECT_TRUE(fs::is_empty(dir_ + "/dst"));
  EXPECT_TRUE(healthy());
}

// ---- the binary ----

TEST(AgentBinary, PrintsReadyAndStopsOnSigterm) {
  std::string bin = std::string(SANDGATE_BIN_DIR) + "/agent/sandgate-agent";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " is not built";
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::execl(bin.c_str(), bin.c_str(), "--listen", "127.0.0.1:0", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  UniqueFd reader(out[0]);
  std::string line = read_until(reader.get(), "\n", 5000);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(line, m, std::regex("^sandgate-agent ready on (127\\.0\\.0\\.1:\\d+)\n"))) << line;
  auto fd = connect_blocking(*parse_endpoint(m[1].str()), 2000);
  ASSERT_TRUE(fd.ok());
  send_all(fd->get(), post("/exec", exec_body("exec sleep 30")));
  std::string got = read_until(fd->get(), "\"start\"", 5000);
  std::smatch pm;
  ASSERT_TRUE(std::regex_search(got, pm, std::regex("\"pid\":(\\d+)"))) << got;
  int child = std::stoi(pm[1]);
  ::kill(pid, SIGTERM);
  int status = 0;
  EXPECT_TRUE(eventually([&] { return ::waitpid(pid, &status, WNOHANG) == pid; }));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(process_gone(child));
}

}  // namespace
}  // namespace sg::agent
