// The agent's SFTP server: against OpenSSH's own sftp and scp (their -D option runs a local server, so no
// SSH is involved), then request by request for what a client could send that those never do.
#include "agent/sftp_server.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "tests/unit/agent/agent_test_support.h"
#include "tests/unit/temp_dir.h"

namespace sg::agent {
namespace {

namespace fs = std::filesystem;

const std::string kAgent = std::string(SANDGATE_BIN_DIR) + "/agent/sandgate-agent";

using test_support::Ran;

// The client's output and errors together, as a user sees them.
Ran run(const std::string& cmd) { return test_support::run(cmd + " 2>&1"); }

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void spit(const fs::path& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out << data;
}

std::string random_bytes(size_t n) {
  std::mt19937_64 rng(42);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

class SftpClients : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    root_ = dir_.path();
    // scp's -D runs a program without arguments.
    spit(root_ / "server", "#!/bin/sh\nexec " + kAgent + " --sftp-server\n");
    fs::permissions(root_ / "server", fs::perms::owner_all);
  }
  Ran sftp(const std::string& batch) {
    spit(root_ / "batch", batch);
    return run("cd " + root_.string() + " && sftp -D '" + kAgent + " --sftp-server' -b batch");
  }
  Ran scp(const std::string& args) { return run("cd " + root_.string() + " && scp -D ./server " + args); }

  sg::testing::TempDir dir_{"sg-sftp"};
  fs::path root_;
};

TEST_F(SftpClients, SftpMakesRenamesListsLinksAndRemoves) {
  std::string data = random_bytes(3 * 1024 * 1024 + 17);
  spit(root_ / "up", data);
  Ran r = sftp("mkdir d\nput up d/a\nrename d/a d/b\nls -l d\nget d/b down\nln -s d/b lnk\nchmod 640 d/b\n"
               "df .\n");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(slurp(root_ / "down"), data);
  EXPECT_FALSE(fs::exists(root_ / "d/a"));
  EXPECT_NE(r.out.find(" 3145745 "), std::string::npos) << r.out;  // ls -l shows the size
  EXPECT_NE(r.out.find("-rw-r--r--"), std::string::npos) << r.out;
  EXPECT_EQ(fs::read_symlink(root_ / "lnk"), "d/b");  // OpenSSH's order: target first, then the link
  EXPECT_EQ(fs::status(root_ / "d/b").permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);

  r = sftp("rm lnk\nrm d/b\nrmdir d\n");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_FALSE(fs::exists(root_ / "d"));
  EXPECT_FALSE(fs::is_symlink(root_ / "lnk"));

  // A failure is the client's error and a non-zero status, not a dead server.
  r = sftp("get missing\n");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("not found"), std::string::npos) << r.out;
}

TEST_F(SftpClients, ScpCopiesBothWaysAndRecursively) {
  std::string data = random_bytes(10 * 1024 * 1024);
  spit(root_ / "big", data);
  fs::create_directories(root_ / "tree/sub");
  spit(root_ / "tree/sub/f", "leaf\n");
  Ran r = scp("big x:copy");
  ASSERT_EQ(r.status, 0) << r.out;
  r = scp("x:copy back");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(slurp(root_ / "back"), data);
  r = scp("-r tree x:tree2");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(slurp(root_ / "tree2/sub/f"), "leaf\n");
  r = scp("big x:no/such/dir/f");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("No such file"), std::string::npos) << r.out;
}

// --- request by request ---

struct Packet {
  std::string b;
  Packet& u8(uint8_t v) {
    b.push_back(static_cast<char>(v));
    return *this;
  }
  Packet& u32(uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<char>((v >> s) & 0xff));
    return *this;
  }
  Packet& u64(uint64_t v) { return u32(static_cast<uint32_t>(v >> 32)).u32(static_cast<uint32_t>(v)); }
  Packet& str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    b.append(s);
    return *this;
  }
};

uint32_t be32(std::string_view s, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
  return v;
}

// A reply's status code (type 101: type, id, code, ...), or -1 when it is no STATUS.
int status_code(const std::string& reply) {
  if (reply.size() < 9 || static_cast<uint8_t>(reply[0]) != 101) return -1;
  return static_cast<int>(be32(reply, 5));
}

std::string handle_of(const std::string& reply) {
  EXPECT_EQ(static_cast<uint8_t>(reply[0]), 102) << "not a HANDLE";
  return reply.substr(9, be32(reply, 5));
}

class SftpRequests : public ::testing::Test {
 protected:
  SftpRequests() : session_(limits()) {}
  static SftpLimits limits() {
    SftpLimits l;
    l.max_handles = 3;
    l.max_read = 1000;
    return l;
  }
  void SetUp() override {
    Result<std::string> version = session_.handle(Packet().u8(1).u32(3).b);
    ASSERT_TRUE(version.ok());
    ASSERT_EQ(static_cast<uint8_t>((*version)[0]), 2);
    EXPECT_EQ(be32(*version, 1), 3u);
    EXPECT_NE(version->find("limits@openssh.com"), std::string::npos);
  }
  std::string ask(const Packet& p) {
    Result<std::string> r = session_.handle(p.b);
    EXPECT_TRUE(r.ok()) << r.message();
    return r.ok() ? *r : std::string();
  }
  std::string path(const std::string& name) { return (fs::path(dir_.path()) / name).string(); }
  std::string open(const std::string& name, uint32_t pflags) {
    return ask(Packet().u8(3).u32(7).str(path(name)).u32(pflags).u32(0));
  }

  sg::testing::TempDir dir_{"sg-sftp"};
  SftpSession session_;
};

TEST(SftpSessionStart, NothingBeforeInitAndOnlyOneInit) {
  SftpSession s;
  EXPECT_FALSE(s.handle(Packet().u8(17).u32(1).str("/").b).ok());
  EXPECT_FALSE(s.handle("").ok());
  EXPECT_FALSE(s.handle(Packet().u8(1).b).ok());  // INIT without its version
  EXPECT_TRUE(s.handle(Packet().u8(1).u32(6).b).ok());
  EXPECT_FALSE(s.handle(Packet().u8(1).u32(3).b).ok());
}

TEST_F(SftpRequests, MalformedRequestsGetBadMessageAndTheSessionGoesOn) {
  EXPECT_FALSE(session_.handle(Packet().u8(17).b).ok());  // no id to answer to: the session ends
  // A string whose length runs past the packet.
  EXPECT_EQ(status_code(ask(Packet().u8(17).u32(1).u32(1000))), 5);
  // A NUL inside a path would cut what the system call sees.
  EXPECT_EQ(status_code(ask(Packet().u8(17).u32(2).str(std::string("/etc\0passwd", 11)))), 5);
  // Attributes announcing more extension pairs than the packet holds.
  EXPECT_EQ(status_code(ask(Packet().u8(14).u32(3).str(path("d")).u32(0x80000000).u32(0xffffffff))), 5);
  EXPECT_FALSE(fs::exists(path("d")));
  // Unknown types and extensions are unsupported, by id.
  EXPECT_EQ(status_code(ask(Packet().u8(99).u32(4))), 8);
  EXPECT_EQ(status_code(ask(Packet().u8(200).u32(5).str("copy-data"))), 8);
  // Still answering.
  std::string attrs = ask(Packet().u8(17).u32(6).str(dir_.path()));
  EXPECT_EQ(static_cast<uint8_t>(attrs[0]), 105);
  EXPECT_EQ(be32(attrs, 1), 6u);
}

TEST_F(SftpRequests, HandlesAreCheckedAndLimited) {
  // A handle that was never given, one of the wrong kind and a closed one are all "no such handle".
  EXPECT_EQ(status_code(ask(Packet().u8(5).u32(1).str("\0\0\0\7").u64(0).u32(10))), 4);
  std::string dir = handle_of(ask(Packet().u8(11).u32(2).str(dir_.path())));
  EXPECT_EQ(status_code(ask(Packet().u8(5).u32(3).str(dir).u64(0).u32(10))), 4);
  std::string f1 = handle_of(open("a", 0x2 | 0x8));
  std::string f2 = handle_of(open("b", 0x2 | 0x8));
  EXPECT_EQ(status_code(open("c", 0x2 | 0x8)), 4);  // max_handles is 3
  EXPECT_FALSE(fs::exists(path("c")));              // refused before the file was made
  EXPECT_EQ(status_code(ask(Packet().u8(4).u32(4).str(f1))), 0);
  EXPECT_EQ(status_code(ask(Packet().u8(4).u32(5).str(f1))), 4);  // closed already
  std::string f3 = handle_of(open("c", 0x2 | 0x8));              // the slot is free again
  EXPECT_EQ(f3, f1);
  EXPECT_EQ(status_code(ask(Packet().u8(4).u32(6).str(f2))), 0);
}

TEST_F(SftpRequests, ReadsAreCutToTheLimitAndEndWithEof) {
  spit(path("f"), std::string(2500, 'x'));
  std::string h = handle_of(open("f", 0x1));
  std::string data = ask(Packet().u8(5).u32(1).str(h).u64(0).u32(100000));
  ASSERT_EQ(static_cast<uint8_t>(data[0]), 103);
  EXPECT_EQ(be32(data, 5), 1000u);  // max_read
  data = ask(Packet().u8(5).u32(2).str(h).u64(2000).u32(1000));
  EXPECT_EQ(be32(data, 5), 500u);
  EXPECT_EQ(status_code(ask(Packet().u8(5).u32(3).str(h).u64(2500).u32(1000))), 1);
  EXPECT_EQ(status_code(ask(Packet().u8(5).u32(4).str(h).u64(~0ull).u32(1000))), 1);
  // Writing through a read-only handle fails with the system's word for it.
  EXPECT_EQ(status_code(ask(Packet().u8(6).u32(5).str(h).u64(0).str("y"))), 2);  // EBADF
}

TEST_F(SftpRequests, RenameKeepsAnExistingTargetPosixRenameReplacesIt) {
  spit(path("a"), "A");
  spit(path("b"), "B");
  EXPECT_EQ(status_code(ask(Packet().u8(18).u32(1).str(path("a")).str(path("b")))), 4);
  EXPECT_EQ(slurp(path("b")), "B");
  EXPECT_EQ(status_code(ask(Packet().u8(200).u32(2).str("posix-rename@openssh.com").str(path("a")).str(path("b")))),
            0);
  EXPECT_EQ(slurp(path("b")), "A");
  EXPECT_FALSE(fs::exists(path("a")));
  EXPECT_EQ(status_code(ask(Packet().u8(18).u32(3).str(path("b")).str(path("c")))), 0);
  EXPECT_EQ(slurp(path("c")), "A");
}

TEST_F(SftpRequests, RealpathAnswersForAMissingLastComponentOnly) {
  fs::create_directory(path("sub"));
  std::string reply = ask(Packet().u8(16).u32(1).str(path("sub/../new")));
  ASSERT_EQ(static_cast<uint8_t>(reply[0]), 104) << "no NAME: the parent exists, the file need not";
  std::string resolved = reply.substr(13, be32(reply, 9));
  EXPECT_EQ(resolved, fs::canonical(dir_.path()).string() + "/new");
  EXPECT_EQ(status_code(ask(Packet().u8(16).u32(2).str(path("no/such/new")))), 2);
  // expand-path: "~" is where the session started (the SSH server starts it in root's home), "~name" that
  // user's home from /etc/passwd.
  auto expanded = [&](uint32_t id, const std::string& path) {
    std::string r = ask(Packet().u8(200).u32(id).str("expand-path@openssh.com").str(path));
    return static_cast<uint8_t>(r[0]) == 104 ? r.substr(13, be32(r, 9)) : "status " + std::to_string(status_code(r));
  };
  EXPECT_EQ(expanded(3, "~"), fs::current_path().string());
  EXPECT_EQ(expanded(4, "~root"), fs::canonical("/root").string());
  EXPECT_EQ(expanded(5, "~root/.."), "/");
  EXPECT_EQ(expanded(6, "~no-such-user-here/x"), "status 2");
}

TEST_F(SftpRequests, StatvfsFstatvfsAndFsyncAnswerEachItsOwnWay) {
  auto type_and_size = [](const std::string& r) { return std::make_pair(static_cast<int>(r[0] & 0xff), r.size()); };
  // EXTENDED_REPLY: type, id and 11 uint64 fields.
  EXPECT_EQ(type_and_size(ask(Packet().u8(200).u32(1).str("statvfs@openssh.com").str(dir_.path()))),
            std::make_pair(201, size_t{5 + 88}));
  std::string h = handle_of(open("f", 0x2 | 0x8));
  EXPECT_EQ(type_and_size(ask(Packet().u8(200).u32(2).str("fstatvfs@openssh.com").str(h))),
            std::make_pair(201, size_t{5 + 88}));
  EXPECT_EQ(status_code(ask(Packet().u8(200).u32(3).str("fsync@openssh.com").str(h))), 0);
  EXPECT_EQ(status_code(ask(Packet().u8(200).u32(4).str("fsync@openssh.com").str(std::string("\0\0\0\x09", 4)))), 4);
}

// A FIFO opened without a partner must not block the session: the open answers, and reading it fails.
TEST_F(SftpRequests, AFifoDoesNotHangTheSession) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  EXPECT_EQ(status_code(open("fifo", 0x2)), 4);  // ENXIO: no reader
  std::string h = handle_of(open("fifo", 0x1));
  EXPECT_EQ(status_code(ask(Packet().u8(5).u32(2).str(h).u64(0).u32(10))), 4);  // ESPIPE
}

// The process around the session: framing, the packet limit and the ends of the stream.
int serve(const std::string& input) {
  int in[2], out[2];
  EXPECT_EQ(::pipe(in), 0);
  EXPECT_EQ(::pipe(out), 0);
  std::thread writer([&] {
    (void)!::write(in[1], input.data(), input.size());
    ::close(in[1]);
  });
  std::thread drain([&] {
    char buf[4096];
    while (::read(out[0], buf, sizeof buf) > 0) {
    }
  });
  int code = serve_sftp(in[0], out[1]);
  ::close(out[1]);
  writer.join();
  drain.join();
  ::close(in[0]);
  ::close(out[0]);
  return code;
}

std::string framed(const std::string& body) { return Packet().u32(static_cast<uint32_t>(body.size())).b + body; }

TEST(SftpStream, EndsCleanlyAtEofAndRefusesWhatBreaksTheFraming) {
  std::string init = framed(Packet().u8(1).u32(3).b);
  EXPECT_EQ(serve(init), 0);
  EXPECT_EQ(serve(init + framed(Packet().u8(17).u32(1).str("/").b)), 0);
  EXPECT_EQ(serve(init + Packet().u32(256 * 1024 + 1).b), 1);  // over the packet limit
  EXPECT_EQ(serve(init + Packet().u32(0).b), 1);
  EXPECT_EQ(serve(init + std::string("\0\0", 2)), 1);            // cut inside a length
  EXPECT_EQ(serve(init + Packet().u32(100).b + "short"), 1);     // cut inside a packet
  EXPECT_EQ(serve(framed(Packet().u8(17).u32(1).str("/").b)), 1);  // before INIT
}

}  // namespace
}  // namespace sg::agent
