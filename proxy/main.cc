// sandgate-proxy: the TLS ingress. Loads the config, binds one SO_REUSEPORT listener per worker thread,
// switches to proxy.user if one is set, and runs until SIGINT/SIGTERM. SIGHUP reloads the config file, the
// certificates and the operator token as one snapshot. `--takeover` starts it on the listening sockets of
// the proxy running now (proxy.handover_socket), which then drains and exits: a binary upgrade.
#include <signal.h>
#include <unistd.h>
#include <uv.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "common/etcd_directory.h"
#include "common/log.h"
#include "common/operator_token.h"
#include "config/config.h"
#include "common/service_notify.h"
#include "common/vouched_netns.h"
#include "proxy/fd_limits.h"
#include "proxy/listener_handover.h"
#include "proxy/metrics_server.h"
#include "proxy/privileges.h"
#include "proxy/socket_maker.h"
#include "proxy/ticket_key_rotation.h"
#include "proxy/ticket_keys.h"
#include "proxy/worker.h"

// jemalloc's tuning, read at its start. Freed pages go back to the kernel within about a second (dirty
// decay), straight to MADV_DONTNEED (no muzzy state: MADV_FREE'd pages count in RSS until the kernel is short
// of memory), and a background thread does the purging: decay otherwise only advances on allocations, so an
// idle proxy would keep the RSS of its last burst of connections (bench/soak.py: 74 MiB of 151 MiB kept).
extern "C" {
extern const char* malloc_conf;
const char* malloc_conf = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0";
}

namespace {

struct Proxy {
  std::string config_path;
  std::unique_ptr<sg::ProxyShared> shared;
  std::vector<std::unique_ptr<sg::Worker>> workers;
  std::unique_ptr<sg::MetricsServer> metrics;  // proxy.metrics_listen (read at start, like listen)
  // proxy.user and proxy.group as applied at start ("" = none): a reload cannot change them.
  std::string user;
  std::string group;
  std::string ready_status;  // the STATUS= systemd shows while the proxy serves
  std::unique_ptr<sg::HandoverServer> handover;  // proxy.handover_socket, once this process serves
  // [fleet]: the etcd view of which node owns which sandbox, kept across reloads (a reload that changed
  // [fleet] needs a restart).
  std::shared_ptr<sg::fleet::EtcdDirectory> fleet_view;
  // The session ticket keys of every TLS context this process makes, reloads included; rotated on a timer
  // and handed to a successor (proxy/ticket_keys.h).
  std::shared_ptr<sg::TicketKeys> ticket_keys;
  std::unique_ptr<sg::TicketKeyRotation> ticket_key_rotation;
  uv_timer_t drain_timer{};
  uint64_t drain_deadline_ms = 0;
};

void stop_all(Proxy* p, uv_loop_t* loop) {
  for (auto& w : p->workers) w->stop();
  if (p->metrics) p->metrics->close();
  if (p->handover) p->handover->close();
  uv_stop(loop);
}

// A new process took the listeners: the workers stop accepting and finish their connections; the process
// exits when none is left, or at proxy.drain_timeout_secs with what remains closed.
void start_draining(Proxy* p, uv_loop_t* loop) {
  const uint32_t timeout_s = p->shared->snapshot()->config->proxy.drain_timeout_secs;
  spdlog::info("handed the listeners over: draining {} connections (at most {} s)",
               p->shared->open_connections.load(std::memory_order_relaxed), timeout_s);
  sg::notify_stopping("handed over: draining");
  for (auto& w : p->workers) w->drain();
  if (p->metrics) p->metrics->close();
  p->drain_deadline_ms = uv_now(loop) + uint64_t{timeout_s} * 1000;
  uv_timer_init(loop, &p->drain_timer);
  p->drain_timer.data = p;
  uv_timer_start(&p->drain_timer, [](uv_timer_t* t) {
    auto* self = static_cast<Proxy*>(t->data);
    const uint32_t open = self->shared->open_connections.load(std::memory_order_relaxed);
    if (open != 0 && uv_now(t->loop) < self->drain_deadline_ms) return;
    if (open != 0) spdlog::warn("drain deadline: closing the {} connections left", open);
    else spdlog::info("drained: every connection finished");
    uv_timer_stop(t);
    stop_all(self, t->loop);
  }, 100, 100);
}

// The listeners handed over by the previous process, per worker, per config endpoint (listen[i] for client
// listeners, fleet_listen[i] for fleet ones): its worker w's sockets go to worker w % workers here, so each
// keeps being polled; one for an address no longer in the config is closed (with whatever waits in its
// queue, as the config says).
std::vector<sg::Worker::Inherited> assign_inherited(std::vector<sg::HandedListener> handed, const sg::ProxyConfig& proxy,
                                                    unsigned workers) {
  std::vector<sg::Worker::Inherited> out(workers);
  for (auto& per_worker : out) {
    per_worker.client.resize(proxy.listen.size());
    per_worker.fleet.resize(proxy.fleet_listen.size());
  }
  for (sg::HandedListener& h : handed) {
    const bool fleet = h.role == sg::ListenerRole::kFleet;
    const std::vector<sg::Endpoint>& listen = fleet ? proxy.fleet_listen : proxy.listen;
    bool placed = false;
    for (size_t i = 0; i < listen.size() && !placed; ++i) {
      const sg::Endpoint& want = listen[i];
      // Port 0 (tests) means "whatever the previous process had" on that address.
      if (want.kind != h.endpoint.kind || want.host != h.endpoint.host || (want.port != 0 && want.port != h.endpoint.port))
        continue;
      (fleet ? out[h.worker % workers].fleet : out[h.worker % workers].client)[i].push_back(std::move(h.fd));
      placed = true;
    }
    if (!placed)
      spdlog::warn("takeover: {} is not in proxy.{} any more: closing it", h.endpoint.to_string(),
                   fleet ? "fleet_listen" : "listen");
  }
  return out;
}

// Appended to a failure to read a file after the switch to proxy.user: the file is most likely fine but
// readable by root only.
std::string as_user_hint(const Proxy* p) {
  if (p->user.empty()) return "";
  return " (sandgate-proxy runs as user " + p->user + ", which must be able to read the config file, the "
         "certificates and keys, the operator token file and the ticket key file; docs/security.md#least-privilege)";
}

void apply_reload(Proxy* p) {
  const std::string hint = as_user_hint(p);
  auto cfg = sg::load_config_file(p->config_path);
  if (!cfg) return spdlog::error("reload failed, keeping the running config:\n{}{}", cfg.message(), hint);
  std::vector<sg::TicketKeys::Key> file_keys;
  struct Wiper {
    std::vector<sg::TicketKeys::Key>& keys;
    ~Wiper() { sg::TicketKeys::wipe(keys); }  // a reload that fails further on leaves no copy behind
  } wiper{file_keys};
  auto keys = sg::TicketKeys::read_key_file((*cfg)->proxy.tls_ticket_key_file);
  if (!keys) return spdlog::error("reload failed, keeping the running config: {}{}", keys.message(), hint);
  file_keys = std::move(*keys);
  auto tls = sg::TlsContexts::create(**cfg, p->ticket_keys);
  if (!tls) return spdlog::error("reload failed, keeping the running config: {}{}", tls.message(), hint);
  auto token = sg::read_operator_token((*cfg)->operator_token_file);
  if (!token) return spdlog::error("reload failed, keeping the running config: {}{}", token.message(), hint);
  auto fleet = sg::FleetContext::create(**cfg, p->fleet_view);
  if (!fleet) return spdlog::error("reload failed, keeping the running config: {}{}", fleet.message(), hint);
  // Listeners, workers, the access log and the user the proxy runs as stay as they were; limits, timeouts,
  // routes, certificates and the operator token apply together to connections accepted from now on.
  if ((*cfg)->proxy.user != p->user || (*cfg)->proxy.group != p->group)
    spdlog::warn("proxy.user and proxy.group changes take effect only after a restart");
  if (!file_keys.empty()) {
    p->ticket_keys->use_file_keys(std::move(file_keys));
  } else if (p->ticket_keys->from_file()) {
    if (sg::Status own = p->ticket_keys->use_own_keys(); !own)
      spdlog::warn("session ticket keys: {} (the key file's keys stay)", own.message());
  }
  p->shared->replace(
      sg::make_snapshot(sg::ProxySnapshot{*cfg, *tls, std::move(*token), std::move(*fleet)}));
  spdlog::info("config reloaded from {}", p->config_path);
}

// systemd hears RELOADING=1 first and READY=1 again whatever the outcome (a failed reload keeps serving).
void reload(Proxy* p) {
  sg::notify_reloading();
  apply_reload(p);
  sg::notify_ready(p->ready_status);
}

// Once the proxy runs as proxy.user: what every reload re-reads (config, certificates and keys, operator
// token) and what every connection opens (the node socket), tried as that user. A file only root can read
// was fine a moment ago, since it was read before the switch, but would make every SIGHUP fail; a socket the
// user may not connect to fails every request. The operator hears of both now rather than at the first
// reload or request. Not fatal: the node may be about to come back with the socket's group fixed.
void check_access_as_user(const Proxy& p, const sg::Config& running) {
  auto cfg = sg::load_config_file(p.config_path);
  if (!cfg) {
    spdlog::warn("a reload will fail: {}{}", cfg.message(), as_user_hint(&p));
  } else {
    if (auto tls = sg::TlsContexts::create(**cfg); !tls)
      spdlog::warn("a reload will fail: {}{}", tls.message(), as_user_hint(&p));
    if (auto token = sg::read_operator_token((*cfg)->operator_token_file); !token)
      spdlog::warn("a reload will fail: {}{}", token.message(), as_user_hint(&p));
    if (auto keys = sg::TicketKeys::read_key_file((*cfg)->proxy.tls_ticket_key_file); !keys)
      spdlog::warn("a reload will fail: {}{}", keys.message(), as_user_hint(&p));
    else
      sg::TicketKeys::wipe(*keys);
    if (auto fleet = sg::FleetContext::create(**cfg); !fleet)
      spdlog::warn("a reload will fail: {}{}", fleet.message(), as_user_hint(&p));
  }
  // Connecting to a unix socket needs write permission on it (and search permission on its directories).
  // A socket that is not there yet (the node is still starting) says nothing either way.
  const std::string& socket = running.node_socket.path;
  if (::access(socket.c_str(), W_OK) != 0 && errno != ENOENT)
    spdlog::error("user {} cannot connect to the node socket {}: {}; every request will fail until the node "
                  "serves it with node.socket_group set to a group of {}",
                  p.user, socket, std::strerror(errno), p.user);
}

}  // namespace

namespace {

// While sandgate-node is down, a cached route out of spare sockets gets new ones from the socket maker
// (proxy/socket_maker.h), which only root can start. Without it an outage is served with the spares held.
void start_socket_maker(Proxy& proxy, const sg::Config& cfg) {
  const char* without = "while sandgate-node is down, cached routes serve with the spare sockets they hold only";
  if (::geteuid() != 0) return spdlog::info("no socket maker (not root): {}", without);
  uid_t uid = ::getuid();
  gid_t gid = ::getgid();
  if (!cfg.proxy.user.empty()) {
    auto who = sg::resolve_proxy_user(cfg.proxy.user, cfg.proxy.group);
    if (!who) return;  // the switch to proxy.user below fails with this reason
    uid = who->uid;
    gid = who->gid;
  }
  const std::string vouched = sg::vouched_netns_dir(cfg.node_socket);
  if (vouched.empty()) return spdlog::info("no socket maker (node_socket is not a unix socket): {}", without);
  auto maker = sg::start_socket_maker(proxy.workers.size(), uid, gid, vouched);
  if (!maker) return spdlog::warn("{}: {}", maker.message(), without);
  for (size_t i = 0; i < proxy.workers.size(); ++i) proxy.workers[i]->use_socket_maker(std::move(maker->clients[i]));
  spdlog::info("socket maker pid {} (uid {}, CAP_SYS_ADMIN alone): makes sockets for cached routes while "
               "sandgate-node is down", maker->pid, uid);
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything else: the maker is this binary run again, and reads no configuration.
  if (argc > 1 && std::strcmp(argv[1], sg::kSocketMakerFlag) == 0) return sg::socket_maker_main(argc, argv);
  CLI::App app{"sandgate-proxy: TLS ingress for sandboxes"};
  Proxy proxy;
  bool check_only = false;
  bool takeover = false;
  app.add_option("--config", proxy.config_path, "configuration file (TOML)")->required();
  app.add_flag("--check", check_only, "validate the configuration and certificates, then exit");
  app.add_flag("--takeover", takeover,
               "take the listening sockets of the proxy running now (proxy.handover_socket), which then drains "
               "its connections and exits");
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
  auto ticket_keys = sg::TicketKeys::generate();
  if (!ticket_keys) {
    spdlog::error("{}", ticket_keys.message());
    return 1;
  }
  proxy.ticket_keys = std::move(*ticket_keys);
  auto file_keys = sg::TicketKeys::read_key_file((*cfg)->proxy.tls_ticket_key_file);
  if (!file_keys) {
    spdlog::error("{}", file_keys.message());
    return 1;
  }
  if (!file_keys->empty()) proxy.ticket_keys->use_file_keys(std::move(*file_keys));
  auto tls = sg::TlsContexts::create(**cfg, proxy.ticket_keys);
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
    if (auto fleet = sg::FleetContext::create(**cfg); !fleet) {
      spdlog::error("{}", fleet.message());
      return 2;
    }
    printf("configuration OK\n");
    return 0;
  }
  signal(SIGPIPE, SIG_IGN);  // before any thread starts (the fleet view's)
  if ((*cfg)->fleet.enabled) {
    const sg::FleetConfig& f = (*cfg)->fleet;
    proxy.fleet_view = std::make_shared<sg::fleet::EtcdDirectory>(sg::etcd::client_options(
        f.etcd_endpoints, f.etcd_timeout_ms, {f.etcd_cacert, f.etcd_cert, f.etcd_key, f.etcd_server_name}));
    proxy.fleet_view->start();
  }
  auto fleet = sg::FleetContext::create(**cfg, proxy.fleet_view);
  if (!fleet) {
    spdlog::error("{}", fleet.message());
    return 2;
  }

  proxy.shared = std::make_unique<sg::ProxyShared>(
      sg::make_snapshot(sg::ProxySnapshot{*cfg, *tls, std::move(*operator_token), *fleet}));
  auto fd_limit = sg::raise_fd_limit();
  if (!fd_limit) {
    spdlog::error("{}", fd_limit.message());
    return 1;
  }
  const unsigned workers =
      (*cfg)->proxy.workers ? (*cfg)->proxy.workers : std::max(1u, std::thread::hardware_concurrency());
  proxy.shared->spare_sockets_per_worker =
      (*cfg)->proxy.route_cache ? sg::spare_sockets_for_fd_limit(fd_limit->soft, workers) : 0;
  const uint64_t spares = uint64_t{proxy.shared->spare_sockets_per_worker} * workers;
  const bool splice_pipes = (*tls)->ktls_possible();
  proxy.shared->fd_max_connections =
      sg::max_connections_for_fd_limit(fd_limit->soft > spares ? fd_limit->soft - spares : 0, splice_pipes);
  // max_connections may change on reload; the rlimit does not, so its share is fixed here.
  spdlog::info("RLIMIT_NOFILE {} (hard {}) carries {} connections at {} fds each and {} spare sockets per "
               "worker's route cache; effective max_connections {}",
               fd_limit->soft, fd_limit->hard, proxy.shared->fd_max_connections,
               sg::fds_per_connection(splice_pipes),
               proxy.shared->spare_sockets_per_worker,
               std::min((*cfg)->proxy.max_connections, proxy.shared->fd_max_connections));
  auto access_log = sg::AccessLog::open((*cfg)->proxy.access_log);
  if (!access_log) {
    spdlog::error("{}", access_log.message());
    return 1;
  }
  proxy.shared->access_log = std::move(*access_log);

  const unsigned n = workers;
  std::optional<sg::HandoverClient> predecessor;
  if (takeover) {
    if ((*cfg)->proxy.handover_socket.empty()) {
      spdlog::error("--takeover needs proxy.handover_socket: the socket the running proxy hands its listeners on");
      return 2;
    }
    auto taken = sg::HandoverClient::take_over((*cfg)->proxy.handover_socket);
    if (!taken) {
      spdlog::error("takeover: {}", taken.message());
      return 1;
    }
    spdlog::info("takeover: received {} listening sockets from the running proxy", taken->listeners().size());
    if (proxy.ticket_keys->from_file()) {
      spdlog::info("takeover: session ticket keys from proxy.tls_ticket_key_file (the running proxy's tickets resume here if it read the same file)");
    } else if (taken->ticket_keys().empty()) {
      spdlog::info("takeover: the running proxy sent no session ticket keys: its clients' tickets will not resume here");
    } else if (auto kept = proxy.ticket_keys->replace_with(taken->ticket_keys()); !kept) {
      spdlog::warn("takeover: {}: its clients' tickets will not resume here", kept.message());
    }
    predecessor = std::move(*taken);
  }
  auto inherited = predecessor ? assign_inherited(std::move(predecessor->listeners()), (*cfg)->proxy, n)
                               : std::vector<sg::Worker::Inherited>(n);
  // Port 0 (tests) is resolved by the first worker's bind; the others join the same ports via SO_REUSEPORT.
  std::vector<sg::Endpoint> listen = (*cfg)->proxy.listen;
  std::vector<sg::Endpoint> fleet_listen = (*cfg)->proxy.fleet_listen;
  for (unsigned i = 0; i < n; ++i) {
    auto w = std::make_unique<sg::Worker>(static_cast<int>(i), proxy.shared.get());
    auto st = w->bind(listen, fleet_listen, std::move(inherited[i]));
    if (st && i == 0) {
      listen = w->bound();
      fleet_listen = w->fleet_bound();
    }
    if (!st) {
      spdlog::error("cannot start worker {}: {}", i, st.message());
      return 1;
    }
    proxy.workers.push_back(std::move(w));
  }

  // On the main thread's loop, bound before root goes (a metrics port below 1024 is the operator's choice).
  if (!(*cfg)->proxy.metrics_listen.empty()) {
    auto metrics = sg::MetricsServer::start(uv_default_loop(), (*cfg)->proxy.metrics_listen, [shared = proxy.shared.get()] {
      const uint32_t max = std::min(shared->snapshot()->config->proxy.max_connections, shared->fd_max_connections);
      return shared->metrics.render(shared->open_connections.load(std::memory_order_relaxed), max);
    });
    if (!metrics) {
      spdlog::error("{}", metrics.message());
      return 1;
    }
    proxy.metrics = std::move(*metrics);
    std::string where;
    for (const auto& ep : proxy.metrics->bound()) where += (where.empty() ? "" : ", ") + ep.to_string();
    spdlog::info("metrics on http://{}/metrics", where);
  }

  if ((*cfg)->proxy.route_cache) start_socket_maker(proxy, **cfg);

  // Least privilege: everything only root can get (privileged ports, root-only keys and token, the access
  // log) is held now, so root goes, before any worker thread runs: no connection is ever handled as root, and
  // the switch has one thread to apply to (glibc's set*id would reach every thread anyway, via nptl's setxid).
  if (const sg::ProxyConfig& pc = (*cfg)->proxy; !pc.user.empty()) {
    auto dropped = sg::drop_privileges(pc.user, pc.group);
    if (!dropped) {
      spdlog::error("cannot switch to proxy.user {}: {}", pc.user, dropped.message());
      return 1;
    }
    if (dropped->switched)
      spdlog::info("dropped root: running as {}, with no capabilities and no way back", sg::describe(*dropped));
    else
      spdlog::info("already running as proxy.user: {}", sg::describe(*dropped));
    proxy.user = pc.user;
    proxy.group = pc.group;
    check_access_as_user(proxy, **cfg);
  }
  // Signals are caught before anything says "ready": a SIGHUP sent the moment the log line or READY=1 appears
  // (systemd's ExecReload, a test) would otherwise meet the default action and end the process.
  uv_loop_t* loop = uv_default_loop();
  uv_signal_t sigint, sigterm, sighup;
  for (uv_signal_t* s : {&sigint, &sigterm, &sighup}) {
    uv_signal_init(loop, s);
    s->data = &proxy;
  }
  auto on_stop = [](uv_signal_t* s, int signum) {
    spdlog::info("signal {}: closing listeners and connections", signum);
    sg::notify_stopping("stopping: closing listeners and connections");
    stop_all(static_cast<Proxy*>(s->data), s->loop);
  };
  uv_signal_start(&sigint, on_stop, SIGINT);
  uv_signal_start(&sigterm, on_stop, SIGTERM);
  uv_signal_start(&sighup, [](uv_signal_t* s, int) { reload(static_cast<Proxy*>(s->data)); }, SIGHUP);
  proxy.ticket_key_rotation = std::make_unique<sg::TicketKeyRotation>(loop, proxy.ticket_keys, [shared = proxy.shared.get()] {
    return uint64_t{shared->snapshot()->config->proxy.tls_ticket_key_rotation_secs} * 1000;
  });
  proxy.ticket_key_rotation->start();
  for (auto& w : proxy.workers) w->start();
  std::string listening;
  for (const auto& ep : listen) listening += (listening.empty() ? "" : ", ") + ep.to_string();
  if (*fleet) {
    std::string fleet_where;
    for (const auto& ep : fleet_listen) fleet_where += (fleet_where.empty() ? "" : ", ") + ep.to_string();
    spdlog::info("fleet node {}: fleet ingress on {}", (*fleet)->self, fleet_where.empty() ? "(none)" : fleet_where);
  }
  spdlog::info("sandgate-proxy ready on {} ({} workers, domain {})", listening, n, (*cfg)->domain);
  proxy.ready_status = "serving on " + listening + " (" + std::to_string(n) + " workers)";
  if (predecessor) {
    // The previous process stops accepting only now that this one serves, so no moment is without a poller.
    if (auto done = predecessor->finish(); !done)
      spdlog::warn("takeover: {} (serving anyway; the previous process may still accept too)", done.message());
    else
      spdlog::info("takeover: the previous process stopped accepting and drains its connections");
    predecessor.reset();
  }
  if (const std::string& path = (*cfg)->proxy.handover_socket; !path.empty()) {
    auto server = sg::HandoverServer::start(
        loop, path,
        [&proxy] {
          std::vector<sg::HandoverServer::Listener> all;
          for (size_t i = 0; i < proxy.workers.size(); ++i)
            for (const sg::Worker::ListeningSocket& l : proxy.workers[i]->listeners())
              all.push_back({static_cast<unsigned>(i), l.endpoint, l.fd, l.role});
          return all;
        },
        [&proxy, loop] { start_draining(&proxy, loop); }, [&proxy] { return proxy.ticket_keys->serialize(); });
    if (!server) {
      spdlog::error("proxy.handover_socket: {}", server.message());
      return 1;
    }
    proxy.handover = std::move(*server);
    spdlog::info("handover socket {}: `sandgate-proxy --takeover` replaces this process without refusing a "
                 "connection", path);
  }
  sg::notify_ready(proxy.ready_status);

  uv_run(loop, UV_RUN_DEFAULT);
  for (auto& w : proxy.workers) w->join();
  if (proxy.fleet_view) proxy.fleet_view->stop();
  spdlog::info("sandgate-proxy stopped");
  return 0;
}
