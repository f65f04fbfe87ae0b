#include "proxy/metrics_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "common/http.h"
#include "common/metrics.h"

namespace sg {

// One scrape: its socket (blocking writes are fine: the answer is small and the peer is local), its poll, a
// deadline timer and the head read so far.
struct MetricsServer::Client {
  MetricsServer* server = nullptr;
  UniqueFd fd;
  uv_poll_t* poll = nullptr;
  uv_timer_t* timer = nullptr;
  std::string head;
  bool head_only = false;  // a HEAD request: the answer's head without its body
};

namespace {
void close_and_delete(uv_handle_t* h) {
  uv_close(h, [](uv_handle_t* handle) {
    if (handle->type == UV_POLL) delete reinterpret_cast<uv_poll_t*>(handle);
    else delete reinterpret_cast<uv_timer_t*>(handle);
  });
}
}  // namespace

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(uv_loop_t* loop, const std::vector<Endpoint>& listen,
                                                             Render render) {
  std::unique_ptr<MetricsServer> s(new MetricsServer(loop, std::move(render)));
  for (const Endpoint& ep : listen) {
    // SO_REUSEPORT: during a takeover (proxy/listener_handover.h) the new process binds the metrics port
    // while the old one still holds it; only a process of the same user can join the port.
    auto fd = listen_on(ep, /*reuse_port=*/true, 64);
    if (!fd) return fail(fd.error(), "proxy.metrics_listen " + ep.to_string() + ": " + fd.message());
    Endpoint got = ep;
    if (ep.kind == Endpoint::Kind::kTcp) {
      auto port = local_port(fd->get());
      if (!port) return port.failure();
      got.port = *port;
    }
    auto* poll = new uv_poll_t;
    uv_poll_init(loop, poll, fd->get());
    poll->data = s.get();
    uv_poll_start(poll, UV_READABLE, [](uv_poll_t* p, int status, int) {
      if (status == 0) static_cast<MetricsServer*>(p->data)->on_accept(p);
    });
    s->polls_.push_back(poll);
    s->fds_.push_back(std::move(*fd));
    s->bound_.push_back(std::move(got));
  }
  return s;
}

MetricsServer::~MetricsServer() { close(); }

void MetricsServer::close() {
  while (!clients_.empty()) drop(clients_.back());
  for (uv_poll_t* p : polls_) close_and_delete(reinterpret_cast<uv_handle_t*>(p));
  polls_.clear();
  fds_.clear();  // after uv_close: libuv stops polling before the descriptor goes
}

void MetricsServer::on_accept(uv_poll_t* listener) {
  uv_os_fd_t lfd;
  if (uv_fileno(reinterpret_cast<uv_handle_t*>(listener), &lfd) != 0) return;
  int fd = ::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) return;  // EAGAIN, or a transient error: the next readiness tries again
  UniqueFd owned(fd);
  if (clients_.size() >= kMaxClients) return;  // closed at once: a scraper retries, a flood costs nothing
  auto* c = new Client;
  c->server = this;
  c->fd = std::move(owned);
  c->poll = new uv_poll_t;
  uv_poll_init(loop_, c->poll, c->fd.get());
  c->poll->data = c;
  c->timer = new uv_timer_t;
  uv_timer_init(loop_, c->timer);
  c->timer->data = c;
  clients_.push_back(c);
  uv_timer_start(c->timer, [](uv_timer_t* t) {
    auto* client = static_cast<Client*>(t->data);
    client->server->drop(client);
  }, kTimeoutMs, 0);
  uv_poll_start(c->poll, UV_READABLE, [](uv_poll_t* p, int, int) {
    auto* client = static_cast<Client*>(p->data);
    client->server->on_readable(client);
  });
}

void MetricsServer::on_readable(Client* c) {
  char buf[2048];
  ssize_t n = ::recv(c->fd.get(), buf, sizeof buf, 0);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) return drop(c);
  c->head.append(buf, static_cast<size_t>(n));
  size_t end = c->head.find("\r\n\r\n");
  if (end == std::string::npos) {
    if (c->head.size() > kMaxRequestBytes) return answer(c, 431, "request head too large\n");
    return;
  }
  // Only the request line matters: "GET /metrics HTTP/1.1" (a query string is ignored, as Prometheus may add one).
  std::string_view line(c->head.data(), c->head.find("\r\n"));
  size_t sp1 = line.find(' ');
  size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) return answer(c, 400, "malformed request line\n");
  std::string_view method = line.substr(0, sp1);
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));
  if (target != "/metrics") return answer(c, 404, "only /metrics is served here\n");
  if (method != "GET" && method != "HEAD") return answer(c, 405, "GET /metrics\n");
  c->head_only = method == "HEAD";
  answer(c, 200, render_());
}

void MetricsServer::answer(Client* c, int status, std::string_view body) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + std::string(http_reason(status)) + "\r\n";
  out += status == 200 ? "Content-Type: " + std::string(kMetricsContentType) + "\r\n" : "Content-Type: text/plain\r\n";
  out += "Content-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n";
  if (!c->head_only) out.append(body);
  // The socket is non-blocking; a local scraper reads as fast as we write, and one that does not gets what fit.
  size_t off = 0;
  int stalls = 0;
  while (off < out.size() && stalls < 100) {
    ssize_t n = ::send(c->fd.get(), out.data() + off, out.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
    } else if (n < 0 && errno == EAGAIN) {
      ++stalls;
      ::usleep(1000);
    } else if (!(n < 0 && errno == EINTR)) {
      break;
    }
  }
  ::shutdown(c->fd.get(), SHUT_WR);
  drop(c);
}

void MetricsServer::drop(Client* c) {
  clients_.erase(std::remove(clients_.begin(), clients_.end(), c), clients_.end());
  close_and_delete(reinterpret_cast<uv_handle_t*>(c->poll));
  close_and_delete(reinterpret_cast<uv_handle_t*>(c->timer));
  // The descriptor closes with the client, after uv_close has stopped its poll (in this loop iteration).
  delete c;
}

}  // namespace sg
