// Bytes through the ingress arrive intact in both directions, half-close is carried across (the sandbox
// sees EOF while the client can still read the answer), and a slow reader does not make the proxy buffer.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <thread>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

std::string expected_blob_sha(size_t size) {
  auto r = run("python3 -c 'import sys; sys.path.insert(0, \"" + source("tests/e2e/tools") +
               "\"); import hashlib, testserver; print(hashlib.sha256(testserver.blob(" + std::to_string(size) +
               ")).hexdigest())'");
  std::string s = r.out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

TEST(Data, LargeDownloadAndUploadAreIntact) {
  Cluster c;
  c.create_http_sandbox("bulk", 8080);
  c.wait_until_serving("bulk", 8080);
  const size_t size = 48 * 1024 * 1024 + 7;  // not a multiple of any buffer size
  std::string file = c.dir() + "/down.bin";
  auto down = c.curl("8080-bulk.sandbox.localhost", "/blob?size=" + std::to_string(size), "-o " + file);
  ASSERT_EQ(Cluster::http_code(down), 200) << down.err;
  EXPECT_EQ(sha256_file(file), expected_blob_sha(size));

  auto up = c.curl("8080-bulk.sandbox.localhost", "/hash", "-T " + file);
  ASSERT_EQ(Cluster::http_code(up), 200) << up.err;
  EXPECT_EQ(Cluster::body(up), sha256_file(file));

  auto e = c.wait_access_entry([&](const nlohmann::json& j) { return j["bytes_in"].get<uint64_t>() > size; });
  ASSERT_TRUE(e.is_object()) << "upload bytes not counted";
  auto d = c.wait_access_entry([&](const nlohmann::json& j) { return j["bytes_out"].get<uint64_t>() > size; });
  ASSERT_TRUE(d.is_object()) << "download bytes not counted";
}

TEST(Data, SlowReaderDoesNotMakeTheProxyBuffer) {
  Cluster c;
  c.create_http_sandbox("bulk", 8080);
  c.wait_until_serving("bulk", 8080);
  const size_t size = 64 * 1024 * 1024;
  auto rss_kb = [&] {
    std::string status = read_file("/proc/" + std::to_string(c.proxy().pid()) + "/status");
    auto pos = status.find("VmRSS:");
    return pos == std::string::npos ? 0L : std::atol(status.c_str() + pos + 6);
  };
  long before = rss_kb();
  // 1 MB/s reader for 3 s while the sandbox could send 64 MiB at once.
  auto r = c.curl("8080-bulk.sandbox.localhost", "/blob?size=" + std::to_string(size),
                  "--limit-rate 1M --max-time 3 -o /dev/null", 30);
  long after = rss_kb();
  EXPECT_LT(after - before, 16 * 1024) << "proxy RSS grew by " << (after - before) << " KiB under a slow reader";
  // The proxy keeps serving afterwards.
  EXPECT_EQ(Cluster::http_code(c.curl("8080-bulk.sandbox.localhost")), 200);
}

// A real TLS client that half-closes: sends its data, then close_notify, and keeps reading the answer.
struct HalfCloseResult {
  bool ok = false;
  std::string answer;
  std::string sent;
  std::string error;
};

HalfCloseResult tls_send_then_half_close(const Cluster& c, const std::string& host, const std::string& payload) {
  HalfCloseResult res;
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL_CTX_load_verify_locations(ctx, c.ca().c_str(), nullptr);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(c.port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  SSL* ssl = nullptr;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    res.error = "connect";
  } else {
    ssl = SSL_new(ctx);
    SSL_set_fd(ssl, fd);
    SSL_set_tlsext_host_name(ssl, host.c_str());
    SSL_set1_host(ssl, host.c_str());
    if (SSL_connect(ssl) != 1) {
      res.error = "handshake";
    } else {
      // A public tcp port is routed by the SNI alone: every byte is the backend's.
      std::string all = payload;
      size_t off = 0;
      while (off < all.size()) {
        int n = SSL_write(ssl, all.data() + off, static_cast<int>(std::min<size_t>(all.size() - off, 1 << 20)));
        if (n <= 0) break;
        off += static_cast<size_t>(n);
      }
      SSL_shutdown(ssl);  // close_notify: "I am done sending"
      char buf[4096];
      for (;;) {
        int n = SSL_read(ssl, buf, sizeof buf);
        if (n <= 0) break;
        res.answer.append(buf, static_cast<size_t>(n));
      }
      res.ok = off == all.size();
      res.answer = res.answer.substr(0, res.answer.find('\n'));
      res.sent = std::move(all);
    }
  }
  if (ssl) SSL_free(ssl);
  ::close(fd);
  SSL_CTX_free(ctx);
  return res;
}

TEST(Data, HalfCloseIsCarriedToTheSandbox) {
  Cluster c;
  auto r = c.cli("create --json --name tcp --public 5000/tcp -- /usr/bin/python3 " + tool("testserver.py") +
                 " tcp 5000");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::string payload;
  for (int i = 0; i < 3 * 1024 * 1024; ++i) payload.push_back(static_cast<char>('a' + i % 26));
  HalfCloseResult res;
  ASSERT_TRUE(eventually(
      [&] {
        res = tls_send_then_half_close(c, "5000-tcp.sandbox.localhost", payload);
        return res.ok && !res.answer.empty() && !res.answer.starts_with("HTTP/");
      },
      std::chrono::seconds(15)));
  // The backend answered after seeing EOF, with the hash of every byte the client sent.
  const std::string& sent = res.sent;
  write_file(c.dir() + "/sent.bin", sent);
  EXPECT_EQ(res.answer, sha256_file(c.dir() + "/sent.bin") + " " + std::to_string(sent.size()));
}

}  // namespace
}  // namespace sg::e2e
