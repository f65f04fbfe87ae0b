// The agent's identity listener: lines over real TCP on loopback, the system calls stood in by a recorder
// (the test runs without the right to set the clock or the hostname).
#include "agent/identity_listener.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <uv.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/base64.h"
#include "common/net.h"
#include "tests/unit/temp_dir.h"

namespace sg::agent {
namespace {

struct RecordingSystem : IdentitySystem {
  Status set_clock(int64_t epoch) override {
    calls.push_back("clock " + std::to_string(epoch));
    return {};
  }
  Status set_hostname(const std::string& name) override {
    calls.push_back("hostname " + name);
    return fail_hostname ? Status(fail(Error::kPermissionDenied, "sethostname: Operation not permitted")) : Status();
  }
  Status reseed(const std::string& seed_hex) override {
    calls.push_back("reseed " + seed_hex);
    return {};
  }
  Status sync_filesystems() override {
    calls.push_back("sync");
    return fail_sync ? Status(fail(Error::kIo, "sync: Input/output error")) : Status();
  }
  std::vector<std::string> calls;
  bool fail_hostname = false;
  bool fail_sync = false;
};

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const std::string kSecret(64, 'a');
const std::string kSeed = "00112233445566778899aabbccddeeff";

class IdentityListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    uv_loop_init(&loop_);
    std::ofstream(dir_.path() + "/secret") << kSecret << "\n";
    paths_.secret_file = dir_.path() + "/secret";
    paths_.id_file = dir_.path() + "/id";
    paths_.ssh_host_key = dir_.path() + "/host_key";
    paths_.ssh_authorized_keys = dir_.path() + "/authorized_keys";
    listener_ = std::make_unique<IdentityListener>(&loop_, paths_, &system_);
    ASSERT_TRUE(listener_->listen(*parse_endpoint("127.0.0.1:0")));
  }
  void TearDown() override {
    listener_->close();
    uv_run(&loop_, UV_RUN_DEFAULT);
    uv_loop_close(&loop_);
  }

  static std::string line(const std::string& host_key, const std::string& keys, uint64_t sequence,
                          const std::string& secret = kSecret) {
    auto field = [](const std::string& bytes) { return bytes.empty() ? std::string("-") : base64_encode(bytes); };
    return "1796480000 sb-one one " + kSeed + " " + field(host_key) + " " + field(keys) + " " +
           std::to_string(sequence) + " " + secret + "\n";
  }

  // Sends `text` over a connection of its own, runs the loop until the listener closed it (with a
  // deadline), and returns what it answered ("" when it closed without a word).
  std::string send(const std::string& text) {
    auto fd = connect_blocking(*parse_endpoint("127.0.0.1:" + std::to_string(listener_->port())), 2000);
    EXPECT_TRUE(fd) << fd.message();
    if (!fd) return "";
    std::string answer;
    std::atomic<bool> closed{false};
    std::thread client([&] {
      (void)!::send(fd->get(), text.data(), text.size(), MSG_NOSIGNAL);
      if (text.find('\n') == std::string::npos) ::shutdown(fd->get(), SHUT_WR);  // no line: the end instead
      char buf[256];
      for (ssize_t n; (n = ::recv(fd->get(), buf, sizeof buf, 0)) > 0;) answer.append(buf, static_cast<size_t>(n));
      closed = true;
    });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!closed && std::chrono::steady_clock::now() < deadline) {
      uv_run(&loop_, UV_RUN_NOWAIT);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_TRUE(closed) << "the listener neither answered nor closed the connection";
    ::shutdown(fd->get(), SHUT_RDWR);
    client.join();
    return answer;
  }

  uv_loop_t loop_{};
  sg::testing::TempDir dir_{"identity-listener"};
  IdentityPaths paths_;
  RecordingSystem system_;
  std::unique_ptr<IdentityListener> listener_;
};

TEST_F(IdentityListenerTest, ALineIsAppliedInOrderAndAnsweredOk) {
  EXPECT_EQ(send(line("HOSTKEY", "ssh-ed25519 AAAA user\n", 10)), "ok\n");
  EXPECT_EQ(system_.calls, (std::vector<std::string>{"clock 1796480000", "hostname one", "reseed " + kSeed}));
  EXPECT_EQ(read_all(paths_.ssh_host_key), "HOSTKEY");
  EXPECT_EQ(read_all(paths_.ssh_authorized_keys), "ssh-ed25519 AAAA user\n");
  EXPECT_EQ(read_all(paths_.id_file), "sb-one\n");
  struct stat st {};
  ASSERT_EQ(::stat(paths_.ssh_host_key.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(IdentityListenerTest, OnlyANewerLineReplacesTheSshFilesAndEveryLineSetsTheClock) {
  ASSERT_EQ(send(line("NEW", "new keys\n", 20)), "ok\n");
  // An older line (it overtook nothing: it came late) sets the clock but leaves the newer keys.
  ASSERT_EQ(send(line("OLD", "old keys\n", 19)), "ok\n");
  EXPECT_EQ(read_all(paths_.ssh_host_key), "NEW");
  EXPECT_EQ(read_all(paths_.ssh_authorized_keys), "new keys\n");
  EXPECT_EQ(std::count(system_.calls.begin(), system_.calls.end(), "clock 1796480000"), 2);
  // No keys registered: an empty authorized_keys, the host key kept.
  ASSERT_EQ(send(line("", "", 21)), "ok\n");
  EXPECT_EQ(read_all(paths_.ssh_authorized_keys), "");
  EXPECT_EQ(read_all(paths_.ssh_host_key), "NEW");
}

TEST_F(IdentityListenerTest, ALineWithoutTheSecretOrMalformedIsDroppedUnanswered) {
  EXPECT_EQ(send(line("K", "keys\n", 5, std::string(64, 'b'))), "");
  EXPECT_EQ(send("1796480000 sb-one one - - -\n"), "");                                // 6 fields
  EXPECT_EQ(send("x sb-one one - - - 1 " + kSecret + "\n"), "");                       // not a time
  EXPECT_EQ(send("1 sb/../x one - - - 1 " + kSecret + "\n"), "");                      // not an id
  EXPECT_EQ(send("1 sb-one one - not*base64 - 1 " + kSecret + "\n"), "");              // a bad key field
  EXPECT_EQ(send("1 sb-one one zz - - 1 " + kSecret + "\n"), "");                      // not a seed
  EXPECT_EQ(send(std::string(1000, 'x')), "");                                         // no newline, then EOF
  EXPECT_TRUE(system_.calls.empty()) << "a dropped line changed something";
  EXPECT_FALSE(std::filesystem::exists(paths_.id_file));
}

TEST_F(IdentityListenerTest, AFailedStepIsNamedAndTheOthersStillRun) {
  system_.fail_hostname = true;
  EXPECT_EQ(send(line("K", "keys\n", 7)), "failed hostname\n");
  EXPECT_EQ(system_.calls.front(), "clock 1796480000");
  EXPECT_EQ(read_all(paths_.id_file), "sb-one\n");
}

TEST_F(IdentityListenerTest, ASyncLineWithTheSecretWritesOutTheFilesAndChangesNothingElse) {
  EXPECT_EQ(send("sync " + kSecret + "\n"), "ok\n");
  EXPECT_EQ(system_.calls, std::vector<std::string>{"sync"});
  EXPECT_FALSE(std::filesystem::exists(paths_.id_file));
  // Without this boot's secret, or with more after it: dropped, unanswered, nothing done.
  EXPECT_EQ(send("sync " + std::string(64, 'b') + "\n"), "");
  EXPECT_EQ(send("sync " + kSecret + " x\n"), "");
  EXPECT_EQ(send("sync\n"), "");
  EXPECT_EQ(system_.calls.size(), 1u);
  system_.fail_sync = true;
  EXPECT_EQ(send("sync " + kSecret + "\n"), "failed sync\n");
}

TEST_F(IdentityListenerTest, AGuestWithoutSshIgnoresTheKeyFields) {
  paths_.ssh_host_key.clear();
  paths_.ssh_authorized_keys.clear();
  IdentityListener no_ssh(&loop_, paths_, &system_);
  EXPECT_EQ(no_ssh.apply(line("K", "keys\n", 3).substr(0, line("K", "keys\n", 3).size() - 1)), "ok\n");
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/host_key"));
}

TEST(IdentityLine, ParsesTheEightFieldsAndLimitsEach) {
  auto ok = parse_identity_line("12 sb-x host.name - - - 3 s");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok->epoch, 12);
  EXPECT_EQ(ok->hostname, "host.name");
  EXPECT_TRUE(ok->seed_hex.empty());
  EXPECT_FALSE(ok->has_host_key);
  EXPECT_EQ(ok->sequence, 3u);
  EXPECT_FALSE(parse_identity_line("0 sb-x h - - - 3 s"));                          // time 0
  EXPECT_FALSE(parse_identity_line("12 " + std::string(65, 'a') + " h - - - 3 s"));  // id too long
  EXPECT_FALSE(parse_identity_line("12 sb-x h;rm - - - 3 s"));                       // not a host name
  EXPECT_FALSE(parse_identity_line("12 sb-x h - - - -3 s"));                         // a negative sequence
}

}  // namespace
}  // namespace sg::agent
