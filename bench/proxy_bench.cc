// Micro-benchmarks for the per-connection and per-read work of the ingress.
#include <benchmark/benchmark.h>

#include "common/http.h"
#include "noderuntime/api_request.h"
#include "proxy/access_log.h"
#include "proxy/route.h"
#include "proxy/traffic.h"

namespace sg {
namespace {

void BM_ParseRoute(benchmark::State& state) {
  const std::string host = "8080-my-sandbox-name.sandbox.localhost:8443";
  for (auto _ : state) {
    auto r = parse_route(host, "sandbox.localhost");
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_ParseRoute);

void BM_ParseRouteMalformed(benchmark::State& state) {
  const std::string host = "8080-bad_name.sandbox.localhost";
  for (auto _ : state) {
    auto r = parse_route(host, "sandbox.localhost");
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_ParseRouteMalformed);

// What a connection does per read: add to its sandbox's worker-local counters through a held pointer.
void BM_AccountPerRead(benchmark::State& state) {
  WorkerTraffic traffic;
  SandboxTraffic* t = traffic.open_connection("sb-0123456789ab");
  for (auto _ : state) {
    t->bytes_in += 16384;
    benchmark::DoNotOptimize(t->bytes_in);
  }
}
BENCHMARK(BM_AccountPerRead);

// Once a second per worker: turn the counters of N active sandboxes into a report.
void BM_TakeReport(benchmark::State& state) {
  WorkerTraffic traffic;
  std::vector<SandboxTraffic*> all;
  for (int i = 0; i < state.range(0); ++i) all.push_back(traffic.open_connection("sb-" + std::to_string(i)));
  for (auto _ : state) {
    for (auto* t : all) t->bytes_out += 1;
    auto body = traffic.take_report("w0");
    benchmark::DoNotOptimize(body);
  }
}
BENCHMARK(BM_TakeReport)->Arg(100)->Arg(10000);

// The node's side of the same report: the body parsed and checked into ActivityReports.
void BM_ParseActivityReport(benchmark::State& state) {
  WorkerTraffic traffic;
  std::vector<SandboxTraffic*> all;
  for (int i = 0; i < state.range(0); ++i) all.push_back(traffic.open_connection("sb-" + std::to_string(i)));
  for (auto* t : all) t->bytes_out += 1;
  const std::string body = traffic.take_report("w0");
  for (auto _ : state) {
    auto reports = parse_activity(body);
    if (!reports || reports->size() != all.size()) state.SkipWithError("report did not parse whole");
    benchmark::DoNotOptimize(reports);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * body.size()));
}
BENCHMARK(BM_ParseActivityReport)->Arg(100)->Arg(10000);

void BM_ParseRequestHead(benchmark::State& state) {
  const std::string head =
      "GET /api/v1/items?id=42 HTTP/1.1\r\nHost: 8080-demo.sandbox.localhost:8443\r\nUser-Agent: curl/7.88.1\r\n"
      "Accept: */*\r\nAccept-Encoding: gzip\r\nConnection: keep-alive\r\n\r\n";
  for (auto _ : state) {
    HttpParser p(HttpParser::Kind::kRequest, HttpLimits{16384, 0, true});
    benchmark::DoNotOptimize(p.feed(head));
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(head.size()));
}
BENCHMARK(BM_ParseRequestHead);

// The access-log line every connection ends with, for a forwarded request as the benchmarks make them.
void BM_AccessLogFormat(benchmark::State& state) {
  AccessRecord r;
  r.started_at = std::chrono::system_clock::now();
  r.started_steady = std::chrono::steady_clock::now();
  r.client = "127.0.4.17:53124";
  r.sni = "9000-bench.sandbox.localhost";
  r.host = "9000-bench.sandbox.localhost";
  r.sandbox_id = "sb-5f0c1e2d3a4b";
  r.sandbox = "bench";
  r.port = 9000;
  r.bytes_in = 112;
  r.bytes_out = 180;
  r.route_cached = true;
  r.tls_version = "TLSv1.3";
  r.data_path = "userspace";
  r.cause = TerminationCause::kClientClosed;
  r.phase = "forward";
  for (auto _ : state) {
    std::string line = AccessLog::format(r);
    benchmark::DoNotOptimize(line);
  }
}
BENCHMARK(BM_AccessLogFormat);

}  // namespace
}  // namespace sg
