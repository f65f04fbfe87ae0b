// sandgate-proxy: the TLS ingress. Loads the config, binds one SO_REUSEPORT listener per worker thread,
// and runs until SIGINT/SIGTERM. SIGHUP reloads the config file and the certificates as one snapshot.
#include <signal.h>
#include <uv.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "common/log.h"
#include "config/config.h"
#include "proxy/edge_auth.h"
#include "proxy/fd_limits.h"
#include "proxy/worker.h"

namespace {

struct Proxy {
  std::string config_path;
  std::unique_ptr<sg::ProxyShared> shared;
  std::vector<std::unique_ptr<sg::Worker>> workers;
};

void reload(Proxy* p) {
  auto cfg = sg::load_config_file(p->config_path);
  if (!cfg) return spdlog::error("reload failed, keeping the running config:\n{}", cfg.message());
  auto tls = sg::TlsContexts::create(**cfg);
  if (!tls) return spdlog::error("reload failed, keeping the running config: {}", tls.message());
  auto token = sg::read_operator_token((*cfg)->operator_token_file);
  if (!token) return spdlog::error("reload failed, keeping the running config: {}", token.message());
  p->shared->operator_token.store(std::make_shared<const std::string>(std::move(*token)));
  // Listeners, workers and the access log stay as they were; limits, timeouts, routes and certificates
  // apply to connections accepted from now on.
  p->shared->tls.store(*tls);
  p->shared->config.swap(*cfg);
  spdlog::info("config reloaded from {}", p->config_path);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sandgate-proxy: TLS ingress for sandboxes"};
  Proxy proxy;
  bool check_only = false;
  app.add_option("--config", proxy.config_path, "configuration file (TOML)")->required();
  app.add_flag("--check", check_only, "validate the configuration and certificates, then exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  auto cfg = sg::load_config_file(proxy.config_path);
  if (!cfg) {
    fprintf(stderr, "sandgate-proxy: invalid configuration:\n%s\n", cfg.message().c_str());
    return 2;
  }
  sg::init_logging("sandgate-proxy", (*cfg)->log_level);
  auto tls = sg::TlsContexts::create(**cfg);
  if (!tls) {
    spdlog::error("{}", tls.message());
    return 2;
  }
  auto operator_token = sg::read_operator_token((*cfg)->operator_token_file);
  if (!operator_token) {
    spdlog::error("{}", operator_token.message());
    return 2;
  }
  if (check_only) {
    printf("configuration OK\n");
    return 0;
  }
  signal(SIGPIPE, SIG_IGN);

  proxy.shared = std::make_unique<sg::ProxyShared>(*cfg, *tls);
  auto fd_limit = sg::raise_fd_limit();
  if (!fd_limit) {
    spdlog::error("{}", fd_limit.message());
    return 1;
  }
  proxy.shared->fd_max_connections = sg::max_connections_for_fd_limit(fd_limit->soft);
  // max_connections may change on reload; the rlimit does not, so its share is fixed here.
  spdlog::info("RLIMIT_NOFILE {} (hard {}) carries {} connections at {} fds each; effective max_connections {}",
               fd_limit->soft, fd_limit->hard, proxy.shared->fd_max_connections, sg::kFdsPerConnection,
               std::min((*cfg)->proxy.max_connections, proxy.shared->fd_max_connections));
  proxy.shared->operator_token.store(std::make_shared<const std::string>(std::move(*operator_token)));
  auto access_log = sg::AccessLog::open((*cfg)->proxy.access_log);
  if (!access_log) {
    spdlog::error("{}", access_log.message());
    return 1;
  }
  proxy.shared->access_log = std::move(*access_log);

  unsigned n = (*cfg)->proxy.workers ? (*cfg)->proxy.workers : std::max(1u, std::thread::hardware_concurrency());
  // Port 0 (tests) is resolved by the first worker's bind; the others join the same ports via SO_REUSEPORT.
  std::vector<sg::Endpoint> listen = (*cfg)->proxy.listen;
  for (unsigned i = 0; i < n; ++i) {
    auto w = std::make_unique<sg::Worker>(static_cast<int>(i), proxy.shared.get());
    auto st = w->start(listen);
    if (st && i == 0) listen = w->bound();
    if (!st) {
      spdlog::error("cannot start worker {}: {}", i, st.message());
      for (auto& started : proxy.workers) started->stop();
      return 1;
    }
    proxy.workers.push_back(std::move(w));
  }
  std::string listening;
  for (const auto& ep : listen) listening += (listening.empty() ? "" : ", ") + ep.to_string();
  spdlog::info("sandgate-proxy ready on {} ({} workers, domain {})", listening, n, (*cfg)->domain);

  uv_loop_t* loop = uv_default_loop();
  uv_signal_t sigint, sigterm, sighup;
  for (uv_signal_t* s : {&sigint, &sigterm, &sighup}) {
    uv_signal_init(loop, s);
    s->data = &proxy;
  }
  auto on_stop = [](uv_signal_t* s, int signum) {
    spdlog::info("signal {}: closing listeners and connections", signum);
    auto* p = static_cast<Proxy*>(s->data);
    for (auto& w : p->workers) w->stop();
    uv_stop(s->loop);
  };
  uv_signal_start(&sigint, on_stop, SIGINT);
  uv_signal_start(&sigterm, on_stop, SIGTERM);
  uv_signal_start(&sighup, [](uv_signal_t* s, int) { reload(static_cast<Proxy*>(s->data)); }, SIGHUP);
  uv_run(loop, UV_RUN_DEFAULT);
  for (auto& w : proxy.workers) w->join();
  spdlog::info("sandgate-proxy stopped");
  return 0;
}
