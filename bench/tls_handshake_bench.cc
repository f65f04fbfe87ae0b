// The proxy's side of one TLS 1.3 handshake, made on the proxy's own TlsContexts as a connection makes it (the
// ClientHello callback with the port's policy), against a client with OpenSSL's defaults (an X25519 key
// share, as wrk and Python's ssl send). Both ends run in this thread over a socketpair; only the proxy's steps
// are timed (manual time, the thread's CPU time), so the client's work does not dilute a change on the proxy's
// side.
//
// BM_ProxyHandshake/<variant>, bench/RESULTS.md:
//   0  full handshake, the contexts as the proxy makes them
//   1  full, with OpenSSL's chain building back on (SSL_MODE_NO_AUTO_CHAIN cleared)
//   2  full, with OpenSSL's own ticket keys instead of the process's ring (proxy/ticket_keys.h)
//   3  resumed with a ticket, the contexts as the proxy makes them
//   4  resumed, with OpenSSL's own ticket keys
#include <benchmark/benchmark.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "common/fd.h"
#include "config/config.h"
#include "proxy/tls.h"
#include "tests/unit/test_cert.h"
#include "tests/unit/tls_handshake.h"

namespace sg {
namespace {

Result<std::shared_ptr<TlsContexts>> bench_contexts() {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/sandgate-tls-bench-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) return fail(Error::kIo, "mkdtemp " + dir);
  // The leaf alone in the file, as deploy/gen-cert.sh writes it: the case where OpenSSL would build a chain.
  test_support::TestCert root("sandgate bench root", nullptr, true);
  test_support::TestCert leaf("*.sandbox.localhost", &root, false);
  leaf.write_pem(dir + "/cert.pem");
  leaf.write_key_pem(dir + "/key.pem");
  auto cfg = load_config_string("domain = \"sandbox.localhost\"\n[proxy]\nktls = \"off\"\n[[proxy.certificates]]\n"
                                "cert = \"" + dir + "/cert.pem\"\nkey = \"" + dir + "/key.pem\"\n",
                                "bench.toml");
  auto tls = cfg ? TlsContexts::create(**cfg) : Result<std::shared_ptr<TlsContexts>>(cfg.failure());
  std::filesystem::remove_all(dir);
  return tls;
}

// This thread's CPU time: what the proxy's steps cost, without the time another process or the hypervisor
// took the core meanwhile (wall time varied by 10% between repetitions on the benchmark VM).
std::chrono::nanoseconds thread_cpu_time() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

// One connection: the handshake (offering `offer` when set) and the client's read of the session ticket,
// which it keeps in `*ticket` (the caller frees it). Returns the proxy's CPU time, or nullopt if it failed.
std::optional<std::chrono::nanoseconds> connect_once(SSL_CTX* server_ctx, SSL_CTX* client_ctx, SSL_SESSION* offer,
                                                     SSL_SESSION** ticket) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) return std::nullopt;
  UniqueFd server_fd(sv[0]), client_fd(sv[1]);
  std::chrono::nanoseconds server_time{};
  auto timed = [&](auto&& step) {
    const auto t0 = thread_cpu_time();
    auto r = step();
    server_time += thread_cpu_time() - t0;
    return r;
  };
  HelloState hello;
  SSL* server = timed([&] { return SSL_new(server_ctx); });
  SSL_set_ex_data(server, hello_ex_index(), &hello);
  SSL_set_fd(server, server_fd.get());
  SSL_set_accept_state(server);
  SSL* client = SSL_new(client_ctx);
  SSL_set_fd(client, client_fd.get());
  SSL_set_tlsext_host_name(client, "8080-bench.sandbox.localhost");
  if (offer != nullptr) SSL_set_session(client, offer);
  SSL_set_connect_state(client);
  const bool done = test_support::handshake_in_turn(client, server, hello, timed);
  const bool resumed = done && SSL_session_reused(server) == 1;
  // The ticket came after the server's Finished: the client takes it in with a read that finds no data.
  char byte;
  if (done) (void)SSL_read(client, &byte, 1);
  if (ticket != nullptr) *ticket = SSL_get1_session(client);
  SSL_shutdown(client);  // else SSL_free marks the session not resumable
  timed([&] {
    SSL_free(server);
    return 0;
  });
  SSL_free(client);
  if (!done || resumed != (offer != nullptr)) return std::nullopt;
  return server_time;
}

void BM_ProxyHandshake(benchmark::State& state) {
  auto made = bench_contexts();
  if (!made) return state.SkipWithError(("the proxy's TLS contexts: " + made.message()).c_str());
  SSL_CTX* server_ctx = (*made)->default_ctx();
  const int64_t variant = state.range(0);
  if (variant == 1) SSL_CTX_clear_mode(server_ctx, SSL_MODE_NO_AUTO_CHAIN);
  if (variant == 2 || variant == 4) SSL_CTX_set_tlsext_ticket_key_evp_cb(server_ctx, nullptr);
  const bool resume = variant >= 3;
  SSL_CTX* client_ctx = SSL_CTX_new(TLS_client_method());
  SSL_CTX_set_alpn_protos(client_ctx, reinterpret_cast<const unsigned char*>("\x08http/1.1"), 9);
  SSL_CTX_set_session_cache_mode(client_ctx, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
  for (auto _ : state) {
    SSL_SESSION* ticket = nullptr;
    if (resume && !connect_once(server_ctx, client_ctx, nullptr, &ticket)) {
      if (ticket) SSL_SESSION_free(ticket);
      return state.SkipWithError("the full handshake for a ticket failed");
    }
    auto took = connect_once(server_ctx, client_ctx, ticket, nullptr);
    if (ticket) SSL_SESSION_free(ticket);
    if (!took) return state.SkipWithError(resume ? "the handshake failed or did not resume" : "the handshake failed");
    state.SetIterationTime(std::chrono::duration<double>(*took).count());
  }
  SSL_CTX_free(client_ctx);
}
BENCHMARK(BM_ProxyHandshake)->DenseRange(0, 4)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace sg
