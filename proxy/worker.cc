#include "proxy/worker.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "proxy/connection.h"
#include "proxy/unix_node_client.h"

namespace sg {
namespace {

// How long the listeners rest after accept ran out of descriptors: long enough that a flood held open
// costs nothing while it lasts, short enough that a client arriving after it ends waits unnoticed.
constexpr uint64_t kAcceptPauseMs = 100;
// The clients' listeners queue as many connections as the kernel allows (listen(2) caps this at
// net.core.somaxconn, 4096 by default): a SYN that meets a full queue is dropped and retried by the client a
// second later, so a flood queued while accepts pause (or a burst) would cost every client behind it that
// second (FdLimits.AcceptBacksOff...: 2,000 queued connections against a queue of 1,024 did, now and then).
constexpr int kClientListenBacklog = 65535;

// The part of format_peer's "address:port" that identifies the client ("127.0.0.1", "[::1]").
std::string client_address(const std::string& peer) { return peer.substr(0, peer.rfind(':')); }

}  // namespace

std::shared_ptr<const ProxySnapshot> make_snapshot(ProxySnapshot s) {
  if (!s.operator_token.empty()) s.operator_token_sha256 = token_sha256(s.operator_token);
  return std::make_shared<const ProxySnapshot>(std::move(s));
}

Worker::Worker(int index, ProxyShared* shared, std::unique_ptr<NodeClient> node)
    : index_(index),
      shared_(shared),
      routes_(kPortPolicyTtlMs, kMaxPortPolicies, shared->spare_sockets_per_worker),
      reporter_id_(std::to_string(::getpid()) + "/" + std::to_string(index)) {
  uv_loop_init(&loop_);
  routes_.share_outage_routes(&shared_->outage_routes);
  node_ = node ? std::move(node) : std::make_unique<UnixNodeClient>(&loop_, &sockets_, shared_);
}

Worker::~Worker() {
  // Bound but never started (the proxy stopped before its workers ran, e.g. it could not drop root): the
  // loop's handles are closed here, on this thread, so the loop can be closed.
  if (loop_ready_ && !thread_.joinable()) {
    stop();
    uv_run(&loop_, UV_RUN_DEFAULT);
  }
  join();
  uv_loop_close(&loop_);
}

Status Worker::bind(const std::vector<Endpoint>& listen, const std::vector<Endpoint>& fleet_listen,
                    Inherited inherited) {
  auto cfg = shared_->snapshot()->config;
  // Every address first: a failure leaves nothing in the loop (the descriptors close with `fds`).
  std::vector<UniqueFd> fds;
  // Binds (or takes over) each of `endpoints`, appending their sockets to `fds`; the addresses as bound.
  auto bind_all = [&](const std::vector<Endpoint>& endpoints, std::vector<std::vector<UniqueFd>>& taken,
                      ListenerRole role) -> Result<std::vector<Endpoint>> {
    std::vector<Endpoint> bound;
    for (size_t i = 0; i < endpoints.size(); ++i) {
      Endpoint ep = endpoints[i];
      std::vector<UniqueFd> mine;
      if (i < taken.size()) mine = std::move(taken[i]);
      if (mine.empty()) {
        auto fd = listen_on(ep, /*reuse_port=*/true, kClientListenBacklog);
        if (!fd) return fd.failure();
        mine.push_back(std::move(*fd));
      }
      if (ep.port == 0) {
        auto port = local_port(mine.front().get());
        if (!port) return port.failure();
        ep.port = *port;
      }
      bound.push_back(ep);
      for (UniqueFd& fd : mine) {
        listener_fds_.push_back({ep, fd.get(), role});
        fds.push_back(std::move(fd));
      }
    }
    return bound;
  };
  auto bound = bind_all(listen, inherited.client, ListenerRole::kClient);
  if (!bound) return bound.failure();
  const size_t fleet_from = fds.size();
  auto fleet_bound = bind_all(fleet_listen, inherited.fleet, ListenerRole::kFleet);
  if (!fleet_bound) return fleet_bound.failure();
  if (!fleet_listen.empty()) fleet_listeners_from_ = fleet_from;
  fleet_bound_ = std::move(*fleet_bound);
  bound_ = std::move(*bound);
  if (Status s = sockets_.open(&loop_); !s) return s;
  for (UniqueFd& fd : fds) {
    auto poll = std::make_unique<uv_poll_t>();
    uv_poll_init(&loop_, poll.get(), fd.get());
    poll->data = this;
    listen_fds_.push_back(std::move(fd));
    listen_polls_.push_back(std::move(poll));
  }
  start_listen_polls();
  uv_timer_init(&loop_, &accept_pause_timer_);
  accept_pause_timer_.data = this;
  uv_idle_init(&loop_, &pump_again_idle_);
  pump_again_idle_.data = this;
  uv_async_init(&loop_, &stop_async_, [](uv_async_t* a) {
    auto* self = static_cast<Worker*>(a->data);
    self->close_listeners();
    uv_close(reinterpret_cast<uv_handle_t*>(&self->drain_async_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&self->drain_timer_), nullptr);
    // Closing removes the connection from the set: iterate over a copy.
    std::vector<Connection*> open(self->connections_.begin(), self->connections_.end());
    for (Connection* c : open) c->close(TerminationCause::kShutdown);
    uv_close(reinterpret_cast<uv_handle_t*>(&self->pump_again_idle_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&self->report_timer_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&self->route_stream_retry_), nullptr);
    self->route_stream_.reset();
    self->refills_.clear();
    self->routes_.stream_down(uv_now(&self->loop_));
    uv_close(reinterpret_cast<uv_handle_t*>(&self->accept_pause_timer_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&self->stop_async_), nullptr);
    self->report_in_flight_.reset();
    self->sockets_.close();  // no event after this; watches still set go with their owners
  });
  stop_async_.data = this;
  uv_async_init(&loop_, &drain_async_, [](uv_async_t* a) { static_cast<Worker*>(a->data)->start_draining(); });
  drain_async_.data = this;
  uv_timer_init(&loop_, &drain_timer_);
  drain_timer_.data = this;
  uv_timer_init(&loop_, &report_timer_);
  report_timer_.data = this;
  uint32_t interval = cfg->proxy.activity_report_interval_ms;
  uv_timer_start(&report_timer_, [](uv_timer_t* t) { static_cast<Worker*>(t->data)->report_activity(); }, interval,
                 interval);
  uv_timer_init(&loop_, &route_stream_retry_);
  route_stream_retry_.data = this;
  if (cfg->proxy.route_cache) watch_routes();
  loop_ready_ = true;
  return {};
}

void Worker::start() { thread_ = std::thread([this] { run(); }); }

void Worker::pump_again(Connection* c) {
  if (pump_again_.empty())
    uv_idle_start(&pump_again_idle_, [](uv_idle_t* h) { static_cast<Worker*>(h->data)->run_pumps_again(); });
  pump_again_.push_back(c);
}

void Worker::cancel_pump_again(Connection* c) {
  std::erase(pump_again_, c);
  if (pump_again_.empty()) uv_idle_stop(&pump_again_idle_);
}

void Worker::run_pumps_again() {
  // A pump may queue its connection again (for the turn after this one); one closed meanwhile is still
  // allocated (connections are freed once their handles closed, after this callback) and pumps nothing.
  pumping_.swap(pump_again_);
  uv_idle_stop(&pump_again_idle_);
  for (Connection* c : pumping_) c->pump_again();
  pumping_.clear();
}

void Worker::run() { uv_run(&loop_, UV_RUN_DEFAULT); }

void Worker::stop() { uv_async_send(&stop_async_); }

void Worker::drain() { uv_async_send(&drain_async_); }

void Worker::close_listeners() {
  // The polls are closed (their memory freed once libuv is done with them); the sockets themselves live on
  // in the process that took them over, so nothing queued in their backlogs is lost.
  for (auto& p : listen_polls_)
    uv_close(reinterpret_cast<uv_handle_t*>(p.release()), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
  listen_polls_.clear();
  listen_fds_.clear();
  listener_fds_.clear();
  uv_timer_stop(&accept_pause_timer_);
}

void Worker::start_draining() {
  if (draining_) return;
  draining_ = true;
  close_listeners();
  auto tick = [](uv_timer_t* t) {
    auto* self = static_cast<Worker*>(t->data);
    // Draining may close connections, which removes them from the set: iterate over a copy.
    std::vector<Connection*> open(self->connections_.begin(), self->connections_.end());
    for (Connection* c : open) c->drain_tick();
  };
  uv_timer_start(&drain_timer_, tick, 0, kDrainTickMs);
}

void Worker::join() {
  if (thread_.joinable()) thread_.join();
}

void Worker::start_listen_polls() {
  for (auto& poll : listen_polls_)
    uv_poll_start(poll.get(), UV_READABLE, [](uv_poll_t* p, int status, int) {
      uv_os_fd_t fd;
      if (status == 0 && uv_fileno(reinterpret_cast<uv_handle_t*>(p), &fd) == 0) static_cast<Worker*>(p->data)->on_accept(fd);
    });
}

void Worker::on_accept(int listen_fd) {
  // Bounded so one busy listener cannot starve this loop's established connections.
  for (int i = 0; i < 64; ++i) {
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      switch (errno) {
        case EAGAIN:
          end_fd_shortage();
          return;
        case EINTR:
        case ECONNABORTED:
        // Errors of the connection being accepted (accept(2) passes them on): it is gone, try the next.
        case EPROTO: case ENETDOWN: case ENOPROTOOPT: case EHOSTDOWN: case ENONET: case EHOSTUNREACH:
        case EOPNOTSUPP: case ENETUNREACH:
          continue;
        default:
          // EMFILE/ENFILE (out of descriptors), ENOBUFS/ENOMEM, or anything unexpected: the connection stays
          // queued and the readiness stays, so retrying now would spin.
          return pause_accepting(errno);
      }
    }
    end_fd_shortage();
    auto cfg = shared_->snapshot()->config;
    uint32_t open = shared_->open_connections.fetch_add(1, std::memory_order_relaxed);
    std::string client = format_peer(reinterpret_cast<sockaddr*>(&peer));
    std::string address = client_address(client);
    // Small writes go out at once: after a TLS 1.3 handshake the session tickets are still unacknowledged
    // when the first response is written, and with Nagle that response waited for the client's delayed ACK
    // (40 ms on Linux) whenever the client had nothing more to send (bench/fleet_hop.py).
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    const bool fleet = is_fleet_listener(listen_fd);
    auto* conn = new Connection(this, UniqueFd(fd), std::move(client), fleet);
    connections_.insert(conn);
    if (open >= std::min(cfg->proxy.max_connections, shared_->fd_max_connections)) {
      conn->close(TerminationCause::kTooManyConnections);
      continue;
    }
    // A hop carries many clients from one proxy's address; each client's own limit was applied where it
    // arrived, and the hop proves with its certificate that it is a fleet member.
    if (fleet) {
      conn->start();
      continue;
    }
    // Refused before the TLS handshake, like the global limit: one address cannot take all of the slots
    // (nor the handshake CPU) by opening connections and sending nothing.
    if (!shared_->client_limits.try_acquire(address, cfg->proxy.max_connections_per_client)) {
      conn->close(TerminationCause::kClientConnLimit);
      continue;
    }
    conn->hold_client_slot(std::move(address));
    conn->start();
  }
}

bool Worker::is_fleet_listener(int fd) const {
  for (size_t i = fleet_listeners_from_; i < listen_fds_.size(); ++i)
    if (listen_fds_[i].get() == fd) return true;
  return false;
}

void Worker::pause_accepting(int err) {
  if (fd_shortage_since_ms_ == 0) {
    fd_shortage_since_ms_ = std::max<uint64_t>(uv_now(&loop_), 1);
    spdlog::warn("worker {}: accept: {}; pausing accepts for {} ms at a time until they succeed "
                 "({} connections open, effective max_connections {})",
                 index_, std::strerror(err), kAcceptPauseMs, shared_->open_connections.load(std::memory_order_relaxed),
                 std::min(shared_->snapshot()->config->proxy.max_connections, shared_->fd_max_connections));
  }
  ++fd_shortage_pauses_;
  for (auto& poll : listen_polls_) uv_poll_stop(poll.get());
  uv_timer_start(&accept_pause_timer_, [](uv_timer_t* t) { static_cast<Worker*>(t->data)->resume_accepting(); },
                 kAcceptPauseMs, 0);
}

void Worker::resume_accepting() { start_listen_polls(); }

void Worker::end_fd_shortage() {
  if (fd_shortage_since_ms_ == 0) return;
  spdlog::info("worker {}: accepting again after {} ms ({} pauses)", index_, uv_now(&loop_) - fd_shortage_since_ms_,
               fd_shortage_pauses_);
  fd_shortage_since_ms_ = 0;
  fd_shortage_pauses_ = 0;
}

void Worker::report_activity() {
  routes_.sweep(uv_now(&loop_));  // each spare holds a sandbox's network namespace; expired ones go now
  const auto dormant = static_cast<int64_t>(routes_.dormant_count());
  shared_->metrics.dormant_routes(dormant - dormant_reported_);
  dormant_reported_ = dormant;
  if (report_in_flight_) return;  // the node is slow; the next report carries the accumulated deltas
  std::string body = traffic_.take_report(reporter_id_);
  WorkerTraffic::Totals reported = traffic_.take_reported_totals();
  shared_->metrics.bytes(reported.bytes_in, reported.bytes_out);
  if (body.empty()) return;
  shared_->metrics.node_call(NodeCallKind::kActivity);
  report_in_flight_ = node_->report_activity(std::move(body), [this](Result<ActivityCuts> r) {
    auto done = std::move(report_in_flight_);  // freed when this callback returns
    if (!r) return spdlog::warn("activity report failed: {}", r.message());
    cut_connections(*r);
  });
}

void Worker::cut_connections(const ActivityCuts& cuts) {
  auto cut = [&](const std::string& id, uint64_t stamp, Connection::Cut why, uint16_t port, const std::string& what) {
    // close() takes the connection out of connections_, so the candidates are copied first.
    std::vector<Connection*> open(connections_.begin(), connections_.end());
    size_t n = 0;
    for (Connection* conn : open) n += conn->cut_if_opened_before(id, stamp, why, port) ? 1 : 0;
    if (n > 0) spdlog::info("sandbox {} {}: closed {} connection(s) opened before", id, what, n);
  };
  for (const ActivityCuts::Cut& c : cuts.asleep) cut(c.id, c.stamp, Connection::Cut::kSuspended, 0, "is suspended");
  for (const ActivityCuts::Cut& c : cuts.revoked) cut(c.id, c.stamp, Connection::Cut::kTokenRevoked, 0, "has a new token");
  for (const ActivityCuts::ClosedPort& c : cuts.closed)
    cut(c.id, c.stamp, Connection::Cut::kPortClosed, c.port, "closed port " + std::to_string(c.port));
}

void Worker::watch_routes() {
  shared_->metrics.node_call(NodeCallKind::kRouteEvents);
  route_stream_ = node_->watch_routes([this](const RouteStreamEvent& e) { on_route_event(e); },
                                      [this](Failure why) { on_route_stream_end(why); });
  // A node client without the stream (a test's fake): the cache never routes, every open asks the node.
}

void Worker::on_route_event(const RouteStreamEvent& e) {
  switch (e.kind) {
    case RouteStreamEvent::Kind::kHello:
      if (route_stream_warned_) spdlog::info("worker {}: route events from sandgate-node again", index_);
      else if (!route_stream_seen_) spdlog::info("worker {}: following sandgate-node's route events", index_);
      route_stream_warned_ = false;
      route_stream_seen_ = true;
      serve_outages();  // a reload may have changed proxy.routes_without_node_secs
      routes_.stream_up(e.stamp);
      return;
    case RouteStreamEvent::Kind::kInvalidate:
      if (e.reason == "ports") routes_.forget(e.id, e.stamp);
      else routes_.invalidate(e.id, e.stamp);
      return;
    case RouteStreamEvent::Kind::kFlush:
      routes_.flush(e.stamp);
      return;
  }
}

void Worker::on_route_stream_end(const Failure& why) {
  // Called from inside the stream's own callback: the call object is released after it returns.
  auto ended = std::move(route_stream_);
  const bool was_gone = routes_.serving_without_node();
  routes_.stream_down(uv_now(&loop_));
  if (!route_stream_warned_)
    spdlog::warn("worker {}: route events from sandgate-node stopped ({}); every connection asks the node until "
                 "they are back", index_, why.message);
  route_stream_warned_ = true;
  // A node that is down changes nothing, so the routes kept may serve until it is back (recheck_node). The
  // stream's end can come before the dying node's listening socket is closed: each retry looks again.
  if (node_->accepting()) {
    routes_.node_answered(uv_now(&loop_));  // alive without its events: what it does now is not seen
  } else {
    node_is_down(was_gone);
  }
  uv_timer_start(&route_stream_retry_, [](uv_timer_t* t) { static_cast<Worker*>(t->data)->watch_routes(); },
                 kRouteStreamRetryMs, 0);
}

void Worker::node_is_down(bool known) {
  serve_outages();
  routes_.node_gone(uv_now(&loop_));
  if (known) return;
  spdlog::warn("worker {}: the node is down: routes cached for running sandboxes serve for up to {} s ({}), "
               "every other connection gets 503, until it is back",
               index_, shared_->snapshot()->config->proxy.routes_without_node_secs,
               socket_maker_ ? "the socket maker makes their sockets" : "with the spare sockets they hold");
}

bool Worker::outage_found() {
  if (routes_.stream_is_up() || routes_.serving_without_node() || !route_stream_warned_ || node_->accepting())
    return false;
  node_is_down(false);
  return routes_.outage_serves();
}

void Worker::use_socket_maker(std::unique_ptr<SocketSource> maker) {
  socket_maker_ = std::move(maker);
  serve_outages();
}

void Worker::serve_outages() {
  routes_.serve_without_node(socket_maker_.get(),
                             uint64_t{shared_->snapshot()->config->proxy.routes_without_node_secs} * 1000);
}

void Worker::recheck_node() {
  if (!routes_.serving_without_node() || !node_->accepting()) return;
  routes_.node_back();
  spdlog::info("worker {}: sandgate-node accepts connections again; routing from the cache waits for its events",
               index_);
  if (route_stream_) return;  // an attempt is under way already
  uv_timer_start(&route_stream_retry_, [](uv_timer_t* t) { static_cast<Worker*>(t->data)->watch_routes(); }, 0, 0);
}

void Worker::refill_route(const std::string& sandbox_ref, const std::string& sandbox_id, uint16_t port,
                          size_t count) {
  std::string key = sandbox_ref + ":" + std::to_string(port);
  if (refills_.contains(key)) return;
  shared_->metrics.node_call(NodeCallKind::kSpareSockets);
  auto call = node_->spare_sockets(sandbox_id, port, count,
                                   [this, key, sandbox_ref, sandbox_id, port](Result<RouteGrant> r) {
                                     auto done = std::move(refills_[key]);  // freed when this returns
                                     refills_.erase(key);
                                     if (!r) return routes_.refill_failed(sandbox_ref, sandbox_id, port);
                                     routes_.refill(sandbox_ref, std::move(*r), uv_now(&loop_));
                                   });
  if (!call) return routes_.refill_failed(sandbox_ref, sandbox_id, port);
  refills_.emplace(std::move(key), std::move(call));
}

}  // namespace sg
