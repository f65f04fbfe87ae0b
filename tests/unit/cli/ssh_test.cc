// ssh-config, the token files and ssh-proxy against a real TLS server in the test (the ingress's stand-in).
#include "cli/ssh.h"
#include "tests/unit/temp_dir.h"
#include "tests/unit/cli/fake_ingress.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

namespace sg::cli {
namespace {

using sg::testing::TempDir;

mode_t mode_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? (st.st_mode & 0777) : 0;
}

// ---- names, ingress, domain ----

TEST(SshNames, RefsAreNamesOrIds) {
  for (const char* ok : {"demo", "web-1", "sb-0123456789ab"}) EXPECT_TRUE(validate_ref(ok)) << ok;
  for (const char* bad : {"", "a b", "a\nb", "a%h", "../x", "x/y", "Demo", "-x", "a.b", "api"})
    EXPECT_FALSE(validate_ref(bad)) << bad;
}

TEST(SshNames, Ingress) {
  auto a = parse_ingress("127.0.0.1:8443");
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 8443);
  auto b = parse_ingress("[::1]:443");
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(b->host, "::1");
  EXPECT_TRUE(parse_ingress("edge.example.com:443"));
  for (const char* bad : {"", "host", "host:", ":443", "host:0", "host:65536", "::1:443", "[::1]443", "h st:1",
                          "h:1\nProxyCommand x", "h%h:1", "[zz]:1"})
    EXPECT_FALSE(parse_ingress(bad)) << bad;
}

TEST(SshNames, Hosts) {
  auto bare = parse_ssh_host("demo", "sandbox.localhost");
  ASSERT_TRUE(bare) << bare.message();
  EXPECT_EQ(bare->name, "demo");
  EXPECT_EQ(bare->domain, "sandbox.localhost");
  auto full = parse_ssh_host("demo.example.com", "sandbox.localhost");
  ASSERT_TRUE(full) << full.message();
  EXPECT_EQ(full->name, "demo");
  EXPECT_EQ(full->domain, "example.com");
  for (const char* bad : {"", ".example.com", "demo.", "demo..com", "de mo", "demo.exa mple.com", "-x.com"})
    EXPECT_FALSE(parse_ssh_host(bad, "sandbox.localhost")) << bad;
}

// ---- ssh-config ----

TEST(SshConfig, PrintsTheBlock) {
  SshConfigOptions o;
  o.name = "demo";
  o.exe_path = "/usr/local/bin/sandgate";
  auto block = ssh_config_block(o);
  ASSERT_TRUE(block) << block.message();
  EXPECT_EQ(*block,
            "Host demo\n"
            "  HostName demo.sandbox.localhost\n"
            "  User root\n"
            "  ProxyCommand /usr/local/bin/sandgate ssh-proxy --ingress 127.0.0.1:8443 %h\n"
            "  ServerAliveInterval 30\n"
            "  ServerAliveCountMax 3\n");
}

TEST(SshConfig, QuotesPathsAndEscapesPercent) {
  SshConfigOptions o;
  o.name = "sb-0123456789ab";
  o.user = "dev";
  o.ingress = "edge.example.com:443";
  o.domain = "example.com";
  o.cacert = "/etc/my ca.pem";
  o.exe_path = "/opt/100%/sandgate";
  auto block = ssh_config_block(o);
  ASSERT_TRUE(block) << block.message();
  EXPECT_NE(block->find("  HostName sb-0123456789ab.example.com\n  User dev\n"), std::string::npos) << *block;
  EXPECT_NE(block->find("  ProxyCommand /opt/100%%/sandgate ssh-proxy --ingress edge.example.com:443 --cacert "
                        "'/etc/my ca.pem' %h\n"),
            std::string::npos)
      << *block;
}

TEST(SshConfig, RefusesInjection) {
  auto with = [](const std::function<void(SshConfigOptions&)>& change) {
    SshConfigOptions o;
    o.name = "demo";
    o.exe_path = "/usr/bin/sandgate";
    change(o);
    return ssh_config_block(o);
  };
  for (const char* name : {"demo\n  ProxyCommand evil", "demo evil", "demo%h", "*", "de\tmo", ""}) {
    auto r = with([&](SshConfigOptions& o) { o.name = name; });
    EXPECT_FALSE(r) << name;
    if (!r) {
      EXPECT_EQ(r.error(), Error::kInvalidArgument);
    }
  }
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.user = "root\n  ProxyCommand evil"; }));
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.user = "-oProxyCommand=x"; }));
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.user = "a b"; }));
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.ingress = "h:1 %h"; }));
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.domain = "x\ny"; }));
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.cacert = "/a\nb"; }));
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.exe_path = "relative/sandgate"; }));
  EXPECT_FALSE(with([](SshConfigOptions& o) { o.exe_path = "/x\n/y"; }));
}

// The binary turns a refused name into exit code 2 and prints nothing on stdout.
TEST(SshConfig, BinaryExitsWithUsageError) {
  const std::string bin = SANDGATE_BIN_DIR "/cli/sandgate";
  if (::access(bin.c_str(), X_OK) != 0) GTEST_SKIP() << bin << " is not built";
  std::string cmd = bin + " ssh-config 'demo%h' 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[256];
  size_t n = std::fread(buf, 1, sizeof buf, p);
  int status = ::pclose(p);
  EXPECT_EQ(n, 0u);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  p = ::popen((bin + " ssh-config demo --domain example.com").c_str(), "r");
  ASSERT_NE(p, nullptr);
  n = std::fread(buf, 1, sizeof buf - 1, p);
  buf[n] = '\0';
  EXPECT_EQ(::pclose(p), 0);
  EXPECT_NE(std::string(buf).find("ProxyCommand " + bin + " ssh-proxy --ingress"), std::string::npos) << buf;
}

// ---- token files ----

TEST(TokenFiles, SavedPrivatelyAndLoaded) {
  TempDir dir;
  std::string home = dir.path() + "/config";
  ASSERT_TRUE(save_token(home, "demo", "sgt_first"));
  EXPECT_EQ(mode_of(home + "/sandgate"), 0700u);
  EXPECT_EQ(mode_of(home + "/sandgate/tokens"), 0700u);
  EXPECT_EQ(token_file(home, "demo"), home + "/sandgate/tokens/demo");
  EXPECT_EQ(mode_of(token_file(home, "demo")), 0600u);
  auto t = load_token(home, "demo");
  ASSERT_TRUE(t) << t.message();
  EXPECT_EQ(*t, "sgt_first");
  ASSERT_TRUE(save_token(home, "demo", "sgt_second"));
  EXPECT_EQ(*load_token(home, "demo"), "sgt_second");
  EXPECT_EQ(mode_of(token_file(home, "demo")), 0600u);
  // Looser directories left by something else are tightened.
  ::chmod((home + "/sandgate/tokens").c_str(), 0755);
  ASSERT_TRUE(save_token(home, "sb-0123456789ab", "sgt_id"));
  EXPECT_EQ(mode_of(home + "/sandgate/tokens"), 0700u);
  EXPECT_EQ(*load_token(home, "sb-0123456789ab"), "sgt_id");
}

TEST(TokenFiles, Removed) {
  TempDir dir;
  std::string home = dir.path() + "/config";
  ASSERT_TRUE(save_token(home, "demo", "sgt_a"));
  ASSERT_TRUE(save_token(home, "other", "sgt_b"));
  ASSERT_TRUE(remove_token(home, "demo"));
  EXPECT_FALSE(std::filesystem::exists(token_file(home, "demo")));
  EXPECT_EQ(*load_token(home, "other"), "sgt_b");
  EXPECT_TRUE(remove_token(home, "demo")) << "none saved is not an error";
  EXPECT_FALSE(remove_token(home, "../other"));
  EXPECT_EQ(*load_token(home, "other"), "sgt_b");
}

TEST(TokenFiles, RefusesBadRefsAndBadFiles) {
  TempDir dir;
  std::string home = dir.path();
  EXPECT_FALSE(save_token(home, "../escape", "t"));
  EXPECT_FALSE(save_token(home, "a/b", "t"));
  EXPECT_FALSE(load_token(home, "../escape"));
  EXPECT_EQ(load_token(home, "nothere").error(), Error::kNotFound);
  ASSERT_TRUE(save_token(home, "demo", "sgt_x"));
  std::ofstream(token_file(home, "demo"), std::ios::trunc) << "  \n";
  EXPECT_EQ(load_token(home, "demo").error(), Error::kNotFound);
  std::ofstream(token_file(home, "demo"), std::ios::trunc) << std::string(5000, 'a');
  EXPECT_FALSE(load_token(home, "demo"));
  std::ofstream(token_file(home, "demo"), std::ios::trunc) << "two words\n";
  EXPECT_FALSE(load_token(home, "demo"));
  // A symlink planted where the token goes is not followed.
  std::filesystem::remove(token_file(home, "demo"));
  std::ofstream(home + "/elsewhere") << "sgt_elsewhere";
  std::filesystem::create_symlink(home + "/elsewhere", token_file(home, "demo"));
  EXPECT_FALSE(load_token(home, "demo"));
}

// ---- ssh-proxy ----

TEST(SshProxy, ConnectRequest) {
  SshProxyOptions o;
  o.name = "demo";
  o.domain = "sandbox.localhost";
  o.token = "sgt_abc";
  EXPECT_EQ(tunnel_host(o), "22-demo.sandbox.localhost");
  EXPECT_EQ(connect_request(o),
            "CONNECT demo:22 HTTP/1.1\r\nHost: 22-demo.sandbox.localhost\r\nAuthorization: Bearer sgt_abc\r\n\r\n");
}

class SshProxyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    cert_.write_pem(dir_.path() + "/ca.pem");
  }
  SshProxyOptions options(uint16_t port) {
    SshProxyOptions o;
    o.ingress = Ingress{"127.0.0.1", port};
    o.cacert = dir_.path() + "/ca.pem";
    o.token = "sgt_secret";
    o.name = "demo";
    o.domain = "sandbox.localhost";
    o.connect_timeout_ms = 5'000;
    return o;
  }

  TempDir dir_;
  TestCert cert_;
};

// Runs ssh-proxy with `input` on stdin (then EOF) and returns what it wrote to stdout.
std::string run_with(const SshProxyOptions& o, const std::string& input, int* exit_code) {
  int in[2], out[2];
  EXPECT_EQ(::pipe(in), 0);
  EXPECT_EQ(::pipe(out), 0);
  std::thread writer([&] {
    size_t off = 0;
    while (off < input.size()) {
      ssize_t n = ::write(in[1], input.data() + off, input.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(in[1]);
  });
  std::string output;
  std::thread reader([&] {
    char buf[65536];
    ssize_t n;
    while ((n = ::read(out[0], buf, sizeof buf)) > 0) output.append(buf, static_cast<size_t>(n));
  });
  *exit_code = run_ssh_proxy(o, in[0], out[1]);
  ::close(in[0]);
  ::close(out[1]);
  writer.join();
  reader.join();
  ::close(out[0]);
  return output;
}

TEST_F(SshProxyTest, TunnelsBothWaysAndKeepsReadingAfterStdinEnds) {
  FakeIngress ingress(cert_, "HTTP/1.1 200 Connection established\r\n\r\n", "server's last words");
  int code = -1;
  std::string out = run_with(options(ingress.port()), "SSH-2.0-test\r\n", &code);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out, "SSH-2.0-test\r\nserver's last words");
  EXPECT_EQ(ingress.head(),
            "CONNECT demo:22 HTTP/1.1\r\nHost: 22-demo.sandbox.localhost\r\nAuthorization: Bearer sgt_secret\r\n\r\n");
  EXPECT_EQ(ingress.sni(), "22-demo.sandbox.localhost");
  EXPECT_EQ(ingress.alpn_offered(), std::string("\x08http/1.1", 9));
}

TEST_F(SshProxyTest, CarriesALargeTransferIntact) {
  FakeIngress ingress(cert_, "HTTP/1.1 200 OK\r\n\r\n", "END");
  std::string input(3 * 1024 * 1024 + 17, '\0');
  for (size_t i = 0; i < input.size(); ++i) input[i] = static_cast<char>((i * 7919) >> 3);
  int code = -1;
  std::string out = run_with(options(ingress.port()), input, &code);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(ingress.echoed(), input.size());
  ASSERT_EQ(out.size(), input.size() + 3);
  EXPECT_TRUE(out == input + "END") << "the bytes came back altered";
}

TEST_F(SshProxyTest, BytesAfterTheConnectAnswerBelongToTheTunnel) {
  // The server speaks first (as sshd does) in the same record as the answer.
  FakeIngress ingress(cert_, "HTTP/1.1 200 OK\r\n\r\nSSH-2.0-server\r\n", "");
  int code = -1;
  std::string out = run_with(options(ingress.port()), "", &code);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out, "SSH-2.0-server\r\n");
}

TEST_F(SshProxyTest, RefusalPrintsStatusAndBody) {
  FakeIngress ingress(cert_,
                      "HTTP/1.1 401 Unauthorized\r\nContent-Length: 46\r\n\r\n"
                      "{\"error\":\"unauthorized\",\"message\":\"bad token\"}",
                      "");
  int code = -1;
  ::testing::internal::CaptureStderr();
  std::string out = run_with(options(ingress.port()), "data", &code);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 1);
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find("HTTP/1.1 401 Unauthorized"), std::string::npos) << err;
  EXPECT_NE(err.find("\"message\":\"bad token\""), std::string::npos) << err;
  EXPECT_NE(err.find("sandgate ssh-proxy: pass demo's own token with --token or SANDGATE_TOKEN"), std::string::npos)
      << err;
}

TEST(SshProxy, EachRefusalSaysWhatToDo) {
  SshProxyOptions o;
  o.name = "box";
  o.domain = "sandbox.localhost";
  o.port = 2222;
  EXPECT_NE(connect_refusal_hint(401, o).find("box's own token with --token or SANDGATE_TOKEN"), std::string::npos);
  EXPECT_EQ(connect_refusal_hint(403, o),
            "port 2222 is not open to tunnels: connect to a port box exposes (--port; `sandgate get box` lists "
            "them), or create it with --expose 2222/tcp");
  EXPECT_EQ(connect_refusal_hint(404, o),
            "`sandgate ls` lists the sandboxes; is sandbox.localhost (--domain) served by this ingress?");
  EXPECT_NE(connect_refusal_hint(502, o).find("is its sshd (or whatever should listen there) running?"),
            std::string::npos);
  EXPECT_NE(connect_refusal_hint(503, o).find("a failed sandbox must be removed (`sandgate rm box`)"),
            std::string::npos);
  EXPECT_EQ(connect_refusal_hint(500, o), "");
}

TEST_F(SshProxyTest, UntrustedCertificateIsRefused) {
  TestCert other;
  other.write_pem(dir_.path() + "/other.pem");
  FakeIngress ingress(cert_, "HTTP/1.1 200 OK\r\n\r\n", "");
  SshProxyOptions o = options(ingress.port());
  o.cacert = dir_.path() + "/other.pem";
  int code = -1;
  ::testing::internal::CaptureStderr();
  std::string out = run_with(o, "x", &code);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 1);
  EXPECT_NE(err.find("not trusted"), std::string::npos) << err;
  EXPECT_NE(err.find("--cacert or SANDGATE_CACERT"), std::string::npos) << err;
  EXPECT_EQ(ingress.head(), "") << "nothing, least of all the token, goes to an unverified server";
}

TEST_F(SshProxyTest, NameOutsideTheCertificateIsRefused) {
  FakeIngress ingress(cert_, "HTTP/1.1 200 OK\r\n\r\n", "");
  SshProxyOptions o = options(ingress.port());
  o.domain = "elsewhere.test";
  int code = -1;
  ::testing::internal::CaptureStderr();
  run_with(o, "x", &code);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 1);
  EXPECT_EQ(ingress.head(), "");
}

// A port nothing listens on: bound once, then released.
uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

TEST_F(SshProxyTest, NoIngressSaysStartItOrPointElsewhere) {
  for (const char* from : {"", "/srv/.state/ingress"}) {
    SshProxyOptions o = options(free_port());
    o.ingress_from = from;
    int code = -1;
    ::testing::internal::CaptureStderr();
    run_with(o, "", &code);
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(code, 1);
    EXPECT_NE(err.find("cannot reach sandgate-proxy (connect to 127.0.0.1:" + std::to_string(o.ingress.port) +
                       ": Connection refused). Is it running and listening there? If it listens elsewhere, pass "
                       "--ingress HOST:PORT or set SANDGATE_INGRESS (this address came from " +
                       (*from ? std::string(from) : "the built-in default") + ")"),
              std::string::npos)
        << err;
  }
}

TEST_F(SshProxyTest, ATokenThatCouldForgeHeadersIsRefused) {
  for (const char* token : {"", "two words", "sgt_x\r\nX-Evil: 1"}) {
    SshProxyOptions o = options(free_port());
    o.token = token;
    int code = -1;
    ::testing::internal::CaptureStderr();
    run_with(o, "", &code);
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(code, 1);
    EXPECT_NE(err.find("token"), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace sg::cli
