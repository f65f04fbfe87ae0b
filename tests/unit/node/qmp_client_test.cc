// QmpClient against a scripted fake QMP server on a unix socket (a thread with blocking I/O): the
// handshake, replies matched by id, error replies, events, and a peer that dies or talks garbage.
#include "noderuntime/qmp_client.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include "tests/unit/node/fake_hypervisor.h"

namespace sg {
namespace {

using json = nlohmann::json;
using testing::TempDir;
using testing::TestLoop;

// Serves one connection with `script`, which gets helpers to read a line and send a line.
class FakeQmpServer {
 public:
  struct Conn {
    int fd;
    std::string buf;
    std::string read_line() {
      while (buf.find('\n') == std::string::npos) {
        char tmp[4096];
        ssize_t n = ::recv(fd, tmp, sizeof tmp, 0);
        if (n <= 0) return "";
        buf.append(tmp, static_cast<size_t>(n));
      }
      size_t nl = buf.find('\n');
      std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      return line;
    }
    json read_command() { return json::parse(read_line(), nullptr, false); }
    void send(const std::string& s) { (void)::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }
    // Greeting plus the answer to qmp_capabilities.
    void handshake() {
      send(R"({"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}}, "capabilities": []}})" "\n");
      json caps = read_command();
      send(json({{"return", json::object()}, {"id", caps["id"]}}).dump() + "\n");
    }
  };

  FakeQmpServer(const std::string& path, std::function<void(Conn&)> script) : path_(path) {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(listen_fd_, 1), 0);
    thread_ = std::thread([this, script = std::move(script)] {
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      Conn c{fd, {}};
      script(c);
      ::close(fd);
    });
  }
  ~FakeQmpServer() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    thread_.join();
    ::close(listen_fd_);
  }

 private:
  std::string path_;
  int listen_fd_ = -1;
  std::thread thread_;
};

class Qmp : public ::testing::Test {
 protected:
  std::string sock() const { return dir_.path() + "/qmp.sock"; }
  Status connect(QmpClient& c) {
    std::optional<Status> r;
    c.connect([&](Status s) { r = std::move(s); });
    EXPECT_TRUE(loop_.run_until([&] { return r.has_value(); }));
    return r ? *r : fail(Error::kInternal, "no answer");
  }
  Result<json> execute(QmpClient& c, const std::string& cmd, json args = nullptr) {
    std::optional<Result<json>> r;
    c.execute(cmd, std::move(args), [&](Result<json> x) { r = std::move(x); });
    EXPECT_FALSE(r.has_value()) << "callback ran before execute() returned";
    EXPECT_TRUE(loop_.run_until([&] { return r.has_value(); }));
    return r ? *r : Result<json>(fail(Error::kInternal, "no answer"));
  }
  TempDir dir_;
  TestLoop loop_;
};

TEST_F(Qmp, HandshakeCommandsErrorsAndEvents) {
  FakeQmpServer server(sock(), [](FakeQmpServer::Conn& c) {
    c.handshake();
    json stop = c.read_command();
    EXPECT_EQ(stop["execute"], "stop");
    // An event arrives before the answer; the answer still finds its command.
    c.send(R"({"event": "STOP", "data": {}, "timestamp": {"seconds": 1, "microseconds": 2}})" "\n");
    c.send(json({{"return", json::object()}, {"id", stop["id"]}}).dump() + "\n");
    json migrate = c.read_command();
    EXPECT_EQ(migrate["arguments"]["uri"], "exec:cat > /x");
    c.send(json({{"error", {{"class", "GenericError"}, {"desc", "There's a migration process in progress"}}},
                 {"id", migrate["id"]}})
               .dump() +
           "\n");
    json q = c.read_command();
    // Split across writes: the client reassembles lines.
    std::string answer = json({{"return", {{"status", "completed"}}}, {"id", q["id"]}}).dump() + "\n";
    c.send(answer.substr(0, 5));
    ::usleep(20'000);
    c.send(answer.substr(5));
    c.read_line();  // until the client closes
  });
  QmpClient client(loop_.get(), sock(), "qemu", QmpOptions{});
  std::vector<std::string> events;
  client.on_event([&](const std::string& e, const json&) { events.push_back(e); });
  ASSERT_TRUE(connect(client).ok());
  EXPECT_TRUE(execute(client, "stop").ok());
  EXPECT_EQ(events, std::vector<std::string>{"STOP"});
  auto err = execute(client, "migrate", {{"uri", "exec:cat > /x"}});
  ASSERT_FALSE(err.ok());
  EXPECT_EQ(err.error(), Error::kInvalidArgument);
  EXPECT_NE(err.message().find("There's a migration process in progress"), std::string::npos) << err.message();
  auto q = execute(client, "query-migrate");
  ASSERT_TRUE(q.ok()) << q.message();
  EXPECT_EQ((*q)["status"], "completed");
}

TEST_F(Qmp, PeerDeathFailsEveryPendingCommand) {
  FakeQmpServer server(sock(), [](FakeQmpServer::Conn& c) {
    c.handshake();
    c.read_command();
    c.read_command();
    // Dies with two commands unanswered.
  });
  QmpClient client(loop_.get(), sock(), "qemu", QmpOptions{});
  ASSERT_TRUE(connect(client).ok());
  std::optional<Result<json>> a, b;
  client.execute("migrate", json{{"uri", "exec:cat"}}, [&](Result<json> r) { a = std::move(r); });
  client.execute("query-migrate", nullptr, [&](Result<json> r) { b = std::move(r); });
  ASSERT_TRUE(loop_.run_until([&] { return a && b; }));
  EXPECT_EQ(a->error(), Error::kUnavailable);
  EXPECT_EQ(b->error(), Error::kUnavailable);
  // Later commands fail too, from the loop.
  EXPECT_EQ(execute(client, "cont").error(), Error::kUnavailable);
}

TEST_F(Qmp, GarbageClosesTheConnection) {
  for (std::string garbage : {std::string("this is not json\n"), std::string("[1,2,3]\n"),
                              std::string(R"({"return": {}, "id": 999})" "\n"), std::string("{\"return\":\n")}) {
    std::error_code ec;
    std::filesystem::remove(sock(), ec);
    FakeQmpServer server(sock(), [garbage](FakeQmpServer::Conn& c) {
      c.handshake();
      c.read_command();
      c.send(garbage);
      ::shutdown(c.fd, SHUT_WR);
      c.read_line();
    });
    QmpClient client(loop_.get(), sock(), "qemu", QmpOptions{});
    ASSERT_TRUE(connect(client).ok());
    auto r = execute(client, "query-status");
    EXPECT_FALSE(r.ok()) << garbage;
    EXPECT_EQ(r.error(), Error::kUnavailable) << garbage;
  }
}

TEST_F(Qmp, OversizedMessageIsRefused) {
  FakeQmpServer server(sock(), [](FakeQmpServer::Conn& c) {
    c.handshake();
    c.read_command();
    c.send(std::string(64 * 1024, 'x'));  // no newline, over the limit
    c.read_line();
  });
  QmpOptions o;
  o.max_message_bytes = 16 * 1024;
  QmpClient client(loop_.get(), sock(), "qemu", o);
  ASSERT_TRUE(connect(client).ok());
  auto r = execute(client, "query-status");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("over"), std::string::npos) << r.message();
}

TEST_F(Qmp, NoGreetingAndNoSocket) {
  QmpClient absent(loop_.get(), sock(), "qemu", QmpOptions{});
  EXPECT_EQ(connect(absent).error(), Error::kUnavailable);

  FakeQmpServer server(sock(), [](FakeQmpServer::Conn& c) { c.read_line(); });  // never greets
  QmpOptions o;
  o.timeout_ms = 200;
  QmpClient silent(loop_.get(), sock(), "qemu", o);
  EXPECT_EQ(connect(silent).error(), Error::kTimeout);
}

TEST_F(Qmp, CommandTimeout) {
  FakeQmpServer server(sock(), [](FakeQmpServer::Conn& c) {
    c.handshake();
    c.read_command();
    c.read_line();  // never answers
  });
  QmpOptions o;
  o.timeout_ms = 200;
  QmpClient client(loop_.get(), sock(), "qemu", o);
  ASSERT_TRUE(connect(client).ok());
  EXPECT_EQ(execute(client, "query-status").error(), Error::kTimeout);
}

}  // namespace
}  // namespace sg
