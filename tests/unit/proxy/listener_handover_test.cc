#include "proxy/listener_handover.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <thread>

namespace sg {
namespace {

class ListenerHandoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sg-handover-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/handover.sock";
    uv_loop_init(&loop_);
  }
  void TearDown() override {
    uv_run(&loop_, UV_RUN_NOWAIT);
    uv_loop_close(&loop_);
    std::filesystem::remove_all(dir_);
  }
  // Runs the loop on a thread until `done`.
  void run_loop_until(const std::atomic<bool>& done) {
    while (!done) uv_run(&loop_, UV_RUN_NOWAIT), ::usleep(1000);
  }

  std::string dir_, path_;
  uv_loop_t loop_{};
};

TEST_F(ListenerHandoverTest, HandsTheListeningSocketsOverAndReportsWhenTheNewProcessServes) {
  auto a = listen_on(*parse_endpoint("127.0.0.1:0"), true);
  auto b = listen_on(*parse_endpoint("127.0.0.1:0"), true);
  ASSERT_TRUE(a && b);
  const uint16_t port_a = *local_port(a->get()), port_b = *local_port(b->get());
  bool handed_over = false;
  auto server = HandoverServer::start(
      &loop_, path_,
      [&] {
        return std::vector<HandoverServer::Listener>{
            {0, {Endpoint::Kind::kTcp, "127.0.0.1", port_a, ""}, a->get()},
            {1, {Endpoint::Kind::kTcp, "127.0.0.1", port_b, ""}, b->get(), ListenerRole::kFleet}};
      },
      [&] { handed_over = true; }, [] { return std::string("0123abcd"); });
  ASSERT_TRUE(server) << server.message();
  struct stat st{};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the socket hands out the ingress";

  std::atomic<bool> client_done{false};
  Status finished;
  std::vector<HandedListener> got;
  std::string ticket_keys;
  std::thread client([&] {
    auto taken = HandoverClient::take_over(path_, 5000);
    if (taken) {
      got = std::move(taken->listeners());
      ticket_keys = taken->ticket_keys();
      finished = taken->finish(5000);
    } else {
      finished = taken.failure();
    }
    client_done = true;
  });
  run_loop_until(client_done);
  client.join();
  ASSERT_TRUE(finished) << finished.message();
  EXPECT_TRUE(handed_over);
  EXPECT_FALSE(std::filesystem::exists(path_)) << "the new process binds its own handover socket there";
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].worker, 0u);
  EXPECT_EQ(got[1].worker, 1u);
  EXPECT_EQ(got[0].endpoint.port, port_a);
  EXPECT_EQ(got[0].role, ListenerRole::kClient);
  EXPECT_EQ(got[1].role, ListenerRole::kFleet) << "a fleet listener is handed over as one";
  EXPECT_EQ(*local_port(got[1].fd.get()), port_b) << "the same socket, not a new one";
  EXPECT_EQ(ticket_keys, "0123abcd") << "the session ticket keys come with the listeners";
  // The received socket accepts what connects to the port, while the old one is closed.
  a->reset();
  auto conn = connect_blocking(*parse_endpoint("127.0.0.1:" + std::to_string(port_a)), 2000);
  ASSERT_TRUE(conn) << conn.message();
  EXPECT_GE(::accept(got[0].fd.get(), nullptr, nullptr), 0);
}

TEST_F(ListenerHandoverTest, ASecondRunningProxyCannotTakeTheSamePath) {
  auto first = HandoverServer::start(&loop_, path_, [] { return std::vector<HandoverServer::Listener>{}; }, [] {});
  ASSERT_TRUE(first);
  auto second = HandoverServer::start(&loop_, path_, [] { return std::vector<HandoverServer::Listener>{}; }, [] {});
  ASSERT_FALSE(second);
  EXPECT_EQ(second.error(), Error::kAlreadyExists);
  EXPECT_NE(second.message().find("--takeover"), std::string::npos) << second.message();
}

TEST_F(ListenerHandoverTest, AStaleSocketIsReplacedAndANonSocketIsNot) {
  {
    auto stale = HandoverServer::start(&loop_, path_, [] { return std::vector<HandoverServer::Listener>{}; }, [] {});
    ASSERT_TRUE(stale);
    // A crash leaves the path behind: simulated by not unlinking it.
  }
  // The destructor unlinked it; put a dead socket there as a crash would leave it.
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path_.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ::close(fd);
  auto again = HandoverServer::start(&loop_, path_, [] { return std::vector<HandoverServer::Listener>{}; }, [] {});
  ASSERT_TRUE(again) << again.message();
  again->reset();
  ::close(::open(path_.c_str(), O_CREAT | O_WRONLY, 0600));
  auto file = HandoverServer::start(&loop_, path_, [] { return std::vector<HandoverServer::Listener>{}; }, [] {});
  ASSERT_FALSE(file);
  EXPECT_NE(file.message().find("not a socket"), std::string::npos) << file.message();
}

// The old side is untrusted input to the new one: whatever it sends is checked.
TEST_F(ListenerHandoverTest, TheNewProcessRefusesMalformedHandovers) {
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path_.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  auto fake_old = [&](std::vector<std::pair<std::string, int>> messages) {
    std::thread t([&, messages] {
      int peer = ::accept(fd, nullptr, nullptr);
      char buf[64];
      (void)::recv(peer, buf, sizeof buf, 0);
      for (const auto& [text, attached] : messages) {
        std::vector<int> fds;
        if (attached >= 0) fds.push_back(attached);
        (void)send_with_fds(peer, text.data(), text.size(), fds);
      }
      ::close(peer);
    });
    auto r = HandoverClient::take_over(path_, 2000);
    t.join();
    return r;
  };
  auto l = listen_on(*parse_endpoint("127.0.0.1:0"), true);
  ASSERT_TRUE(l);
  int not_listening = ::socket(AF_INET, SOCK_STREAM, 0);

  auto no_fd = fake_old({{R"({"worker":0,"endpoint":"127.0.0.1:1"})", -1}});
  ASSERT_FALSE(no_fd);
  EXPECT_NE(no_fd.message().find("one socket"), std::string::npos) << no_fd.message();

  auto not_json = fake_old({{"hello", -1}});
  ASSERT_FALSE(not_json);
  EXPECT_NE(not_json.message().find("not a JSON object"), std::string::npos) << not_json.message();

  auto wrong_count = fake_old({{R"({"worker":0,"endpoint":"127.0.0.1:1"})", l->get()}, {R"({"listeners":2})", -1}});
  ASSERT_FALSE(wrong_count);
  EXPECT_NE(wrong_count.message().find("does not match"), std::string::npos) << wrong_count.message();

  auto not_a_listener = fake_old({{R"({"worker":0,"endpoint":"127.0.0.1:1"})", not_listening}});
  ASSERT_FALSE(not_a_listener);
  EXPECT_NE(not_a_listener.message().find("not a listening TCP socket"), std::string::npos) << not_a_listener.message();

  auto closed_early = fake_old({});
  ASSERT_FALSE(closed_early);
  EXPECT_EQ(closed_early.error(), Error::kUnavailable) << closed_early.message();

  auto bad_role = fake_old({{R"({"worker":0,"endpoint":"127.0.0.1:1","role":"admin"})", l->get()}});
  ASSERT_FALSE(bad_role);
  EXPECT_NE(bad_role.message().find("role is client or fleet"), std::string::npos) << bad_role.message();

  auto bad_keys = fake_old({{R"({"listeners":0,"ticket_keys":7})", -1}});
  ASSERT_FALSE(bad_keys);
  EXPECT_NE(bad_keys.message().find("ticket_keys"), std::string::npos) << bad_keys.message();

  // Without a role (a process from before fleet listeners were handed over): a client listener. Without
  // ticket keys (from before they were handed over): none.
  auto ok = fake_old({{R"({"worker":3,"endpoint":"127.0.0.1:1"})", l->get()}, {R"({"listeners":1})", -1}});
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->listeners().at(0).worker, 3u);
  EXPECT_EQ(ok->listeners().at(0).role, ListenerRole::kClient);
  EXPECT_EQ(ok->ticket_keys(), "");
  ::close(not_listening);
  ::close(fd);
}

TEST_F(ListenerHandoverTest, NoRunningProxyIsAClearError) {
  auto r = HandoverClient::take_over(path_, 1000);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("no proxy to take over at " + path_), std::string::npos) << r.message();
}

}  // namespace
}  // namespace sg
