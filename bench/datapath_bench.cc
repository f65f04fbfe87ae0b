// The proxy's two ways of moving a sandbox's bytes, per 64 KiB over loopback TCP (source -> proxy ->
// sink): the userspace loop (recv into a fixed buffer, send it on; what the userspace TLS path does around
// SSL_write/SSL_read) and the splice loop (socket -> pipe -> socket, what the kTLS path does). Writing the
// source and reading the sink are the same in both, so the difference is the forwarding cost.
#include <benchmark/benchmark.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <vector>

#include "common/net.h"
#include "proxy/splice_pipe.h"

namespace sg {
namespace {

constexpr size_t kChunk = 64 * 1024;

struct TcpPair {
  UniqueFd writer;
  UniqueFd reader;
};

TcpPair tcp_pair() {
  auto listener = listen_on(*parse_endpoint("127.0.0.1:0"), false, 1);
  auto port = local_port(listener->get());
  auto writer = connect_blocking(*parse_endpoint("127.0.0.1:" + std::to_string(*port)), 1000);
  UniqueFd reader(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
  return {std::move(*writer), std::move(reader)};
}

void send_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, 0);
    if (w <= 0) return;
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void recv_all(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r <= 0) return;
    n -= static_cast<size_t>(r);
  }
}

void BM_ForwardUserspaceCopy(benchmark::State& state) {
  TcpPair in = tcp_pair();
  TcpPair out = tcp_pair();
  std::vector<char> payload(kChunk, 'x'), sink(kChunk), buffer(32 * 1024);  // the proxy's buffer size
  for (auto _ : state) {
    send_all(in.writer.get(), payload.data(), kChunk);
    size_t moved = 0;
    while (moved < kChunk) {
      ssize_t r = ::recv(in.reader.get(), buffer.data(), buffer.size(), 0);
      if (r <= 0) return state.SkipWithError("recv failed");
      send_all(out.writer.get(), buffer.data(), static_cast<size_t>(r));
      moved += static_cast<size_t>(r);
    }
    recv_all(out.reader.get(), sink.data(), kChunk);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kChunk);
}
BENCHMARK(BM_ForwardUserspaceCopy);

void BM_ForwardSplice(benchmark::State& state) {
  TcpPair in = tcp_pair();
  TcpPair out = tcp_pair();
  auto pipe = SplicePipe::create(128 * 1024);  // the proxy's pipe size
  if (!pipe) return state.SkipWithError(pipe.message().c_str());
  std::vector<char> payload(kChunk, 'x'), sink(kChunk);
  for (auto _ : state) {
    send_all(in.writer.get(), payload.data(), kChunk);
    size_t moved = 0;
    while (moved < kChunk) {
      ssize_t n = (*pipe)->fill(in.reader.get());
      if (n > 0) moved += static_cast<size_t>(n);
      else if (n == 0 || errno != EAGAIN) return state.SkipWithError("splice from the socket failed");
      while ((*pipe)->buffered() > 0)
        if ((*pipe)->drain(out.writer.get()) < 0 && errno != EAGAIN) return state.SkipWithError("splice failed");
    }
    recv_all(out.reader.get(), sink.data(), kChunk);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kChunk);
}
BENCHMARK(BM_ForwardSplice);

}  // namespace
}  // namespace sg
