// How much heap OpenSSL itself keeps for each idle TLS connection the proxy holds: the part of the proxy's
// RSS per connection (bench/soak.py) that no code of ours can give back while the connection stays in
// userspace TLS. The server side of each connection is made as Connection::start makes it (the proxy's own
// TlsContexts, SSL_new on the default context, SSL_set_fd on a socket, the ClientHello callback with the
// port's policy), a client like wrk or Python's ssl (OpenSSL's defaults: TLS 1.3, an X25519 key share)
// makes one request over it, and the proxy's idle release (SSL_free_buffers) runs. Every allocation OpenSSL
// makes while the server's calls run is counted (CRYPTO_set_mem_functions), the client's are not.
//
//   sandgate_tls_memory [N]      N connections held at once (default 1000)
//
// Prints the live bytes per connection after each step, as asked for and as the allocator rounds them up
// (malloc_usable_size), where in OpenSSL the idle connection's bytes were allocated, and what is left once
// every server SSL was freed (shared caches).
#include <malloc.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/fd.h"
#include "config/config.h"
#include "proxy/tls.h"
#include "tests/unit/test_cert.h"
#include "tests/unit/tls_handshake.h"

namespace {

// OpenSSL's allocations made while `counting` is set, by address. The map lives outside OpenSSL's heap
// functions (operator new), so counting never recurses.
struct Live {
  bool counting = false;
  size_t requested = 0;
  size_t usable = 0;
  struct Block {
    size_t requested, usable;
    const char* file;  // where in OpenSSL (OPENSSL_FILE, OPENSSL_LINE)
    int line;
  };
  std::unordered_map<void*, Block> blocks;
};
Live live;

void remember(void* p, size_t n, const char* file, int line) {
  if (p == nullptr || !live.counting) return;
  const size_t usable = malloc_usable_size(p);
  live.blocks[p] = {n, usable, file, line};
  live.requested += n;
  live.usable += usable;
}

void forget(void* p) {
  if (p == nullptr) return;
  auto it = live.blocks.find(p);
  if (it == live.blocks.end()) return;  // not counted: the client's, or made before counting
  live.requested -= it->second.requested;
  live.usable -= it->second.usable;
  live.blocks.erase(it);
}

void* counted_malloc(size_t n, const char* file, int line) {
  void* p = std::malloc(n);
  remember(p, n, file, line);
  return p;
}

void* counted_realloc(void* old, size_t n, const char* file, int line) {
  forget(old);  // a block the server's call grows is the server's from now on
  void* p = std::realloc(old, n);
  remember(p, n, file, line);
  return p;
}

void counted_free(void* p, const char*, int) {
  forget(p);
  std::free(p);
}

// Runs `f` with OpenSSL's allocations counted as the server's.
template <class F>
auto as_server(F&& f) {
  live.counting = true;
  auto r = f();
  live.counting = false;
  return r;
}

struct Held {
  sg::UniqueFd server_fd, client_fd;
  SSL* server = nullptr;
  SSL* client = nullptr;
  sg::HelloState hello;
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "sandgate_tls_memory: %s\n", what.c_str());
  ERR_print_errors_fp(stderr);
  std::exit(1);
}

void handshake(Held& h) {
  if (!sg::test_support::handshake_in_turn(h.client, h.server, h.hello, [](auto step) { return as_server(step); }))
    die("the handshake failed or did not finish");
}

// The client's request and the server's answer; the client reads the answer (and the session tickets).
void exchange(Held& h) {
  static const std::string request = "GET / HTTP/1.1\r\nHost: 8080-bench.sandbox.localhost\r\n\r\n";
  static const std::string answer(100, 'a');
  if (SSL_write(h.client, request.data(), static_cast<int>(request.size())) <= 0) die("client write");
  char buf[4096];
  int n = as_server([&] { return SSL_read(h.server, buf, sizeof buf); });
  if (n != static_cast<int>(request.size())) die("server read");
  if (as_server([&] { return SSL_write(h.server, answer.data(), static_cast<int>(answer.size())); }) <= 0)
    die("server write");
  size_t got = 0;
  for (int round = 0; round < 10 && got < answer.size(); ++round) {
    n = SSL_read(h.client, buf, sizeof buf);
    if (n > 0) got += static_cast<size_t>(n);
  }
  if (got != answer.size()) die("client read");
}

void report(const char* step, size_t n) {
  std::printf("| %s | %.2f | %.2f |\n", step, static_cast<double>(live.requested) / n / 1024,
              static_cast<double>(live.usable) / n / 1024);
}

// Where in OpenSSL the live bytes were allocated, per connection, largest first.
void report_sites(size_t n) {
  std::map<std::string, std::pair<size_t, size_t>> sites;  // file:line -> bytes, blocks
  for (const auto& [p, b] : live.blocks) {
    auto& s = sites[std::string(b.file != nullptr ? b.file : "?") + ":" + std::to_string(b.line)];
    s.first += b.requested;
    ++s.second;
  }
  std::vector<std::pair<size_t, std::string>> order;
  for (const auto& [site, s] : sites)
    order.emplace_back(s.first, fmt::format("| `{}` | {} | {:.0f} |", site, s.second / n, static_cast<double>(s.first) / n));
  std::sort(order.rbegin(), order.rend());
  std::printf("\n| allocated at | blocks per connection | bytes per connection |\n|---|--:|--:|\n");
  for (const auto& [bytes, row] : order)
    if (bytes >= n * 16) std::printf("%s\n", row.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  // Before OpenSSL allocates anything.
  if (CRYPTO_set_mem_functions(counted_malloc, counted_realloc, counted_free) != 1)
    die("CRYPTO_set_mem_functions: OpenSSL allocated before main");
  const size_t n = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1000;
  if (n == 0) die("usage: sandgate_tls_memory [N]");

  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/sandgate-tls-memory-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) die("mkdtemp");
  sg::test_support::TestCert cert;
  cert.write_pem(dir + "/cert.pem");
  cert.write_key_pem(dir + "/key.pem");
  auto cfg = sg::load_config_string("domain = \"sandbox.localhost\"\n[proxy]\nlisten = \"127.0.0.1:0\"\nktls = \"off\"\n"
                                    "[[proxy.certificates]]\ncert = \"" + dir + "/cert.pem\"\nkey = \"" + dir +
                                        "/key.pem\"\n",
                                    "tls_memory.toml");
  if (!cfg) die(cfg.message());
  auto tls = sg::TlsContexts::create(**cfg);
  std::filesystem::remove_all(dir);
  if (!tls) die(tls.message());

  SSL_CTX* client_ctx = SSL_CTX_new(TLS_client_method());
  SSL_CTX_set_alpn_protos(client_ctx, reinterpret_cast<const unsigned char*>("\x08http/1.1"), 9);

  std::vector<Held> held(n);
  std::printf("OpenSSL's heap per connection, %zu connections held (KiB)\n\n", n);
  std::printf("| after | requested | allocated (size classes) |\n|---|--:|--:|\n");
  for (auto& h : held) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) die("socketpair");
    h.server_fd = sg::UniqueFd(sv[0]);
    h.client_fd = sg::UniqueFd(sv[1]);
    h.server = as_server([&] { return SSL_new((*tls)->default_ctx()); });
    as_server([&] {
      SSL_set_fd(h.server, h.server_fd.get());
      SSL_set_accept_state(h.server);
      return SSL_set_ex_data(h.server, sg::hello_ex_index(), &h.hello);
    });
    h.client = SSL_new(client_ctx);
    SSL_set_fd(h.client, h.client_fd.get());
    SSL_set_tlsext_host_name(h.client, "8080-bench.sandbox.localhost");
    SSL_set_connect_state(h.client);
  }
  report("SSL_new + SSL_set_fd", n);
  for (auto& h : held) handshake(h);
  report("the TLS 1.3 handshake", n);
  for (auto& h : held) exchange(h);
  report("one request and its answer", n);
  for (auto& h : held) as_server([&] { return SSL_free_buffers(h.server); });
  report("SSL_free_buffers (idle: what the proxy holds)", n);
  report_sites(n);
  std::printf("\nnegotiated: %s, %s\n", SSL_get_version(held[0].server), SSL_get_cipher_name(held[0].server));
  for (auto& h : held) {
    as_server([&] {
      SSL_free(h.server);
      return 0;
    });
    SSL_free(h.client);
  }
  report("every server SSL freed (left in shared caches)", n);
  SSL_CTX_free(client_ctx);
  return 0;
}
