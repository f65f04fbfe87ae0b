#include "proxy/listener_handover.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/log.h"

namespace sg {
namespace {

constexpr std::string_view kTakeover = "takeover";
constexpr std::string_view kReady = "ready";
constexpr std::string_view kDone = "done";

Result<sockaddr_un> unix_address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path)
    return fail(Error::kInvalidArgument, "handover socket path '" + path + "' is empty or too long");
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

void set_timeouts(int fd, int timeout_ms) {
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

Status send_message(int fd, std::string_view text, std::span<const int> fds = {}) {
  auto sent = send_with_fds(fd, text.data(), text.size(), fds);
  if (!sent) return sent.failure();
  if (*sent != text.size()) return fail(Error::kIo, "handover: short message");
  return {};
}

// One message (a blocking socket with SO_RCVTIMEO); EOF and a timeout are errors.
Result<std::string> receive_message(int fd, std::vector<UniqueFd>* fds, std::string_view waiting_for) {
  std::string buf(kMaxHandoverMessageBytes, '\0');
  bool would_block = false;
  auto n = recv_with_fds(fd, buf.data(), buf.size(), fds, &would_block);
  if (!n) return n.failure();
  if (would_block) return fail(Error::kTimeout, "handover: no " + std::string(waiting_for) + " in time");
  if (*n == 0) return fail(Error::kUnavailable, "handover: the other process closed before " + std::string(waiting_for));
  buf.resize(*n);
  return buf;
}

void close_poll(uv_poll_t*& poll) {
  if (poll == nullptr) return;
  uv_close(reinterpret_cast<uv_handle_t*>(poll), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
  poll = nullptr;
}

}  // namespace

Result<HandoverClient> HandoverClient::take_over(const std::string& path, int timeout_ms) {
  auto addr = unix_address(path);
  if (!addr) return addr.failure();
  HandoverClient client;
  client.sock_ = UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!client.sock_.valid()) return fail_errno("socket", errno);
  set_timeouts(client.sock_.get(), timeout_ms);
  if (::connect(client.sock_.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) != 0)
    return fail(Error::kUnavailable, "no proxy to take over at " + path + ": " + std::strerror(errno));
  if (Status s = send_message(client.sock_.get(), kTakeover); !s) return s.failure();
  while (true) {
    std::vector<UniqueFd> fds;
    auto msg = receive_message(client.sock_.get(), &fds, "listening socket");
    if (!msg) return msg.failure();
    auto j = nlohmann::json::parse(*msg, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return fail(Error::kInvalidArgument, "handover: not a JSON object: " + msg->substr(0, 200));
    if (auto end = j.find("listeners"); end != j.end()) {
      if (!end->is_number_unsigned() || end->get<uint64_t>() != client.listeners_.size() || !fds.empty())
        return fail(Error::kInvalidArgument, "handover: the end message does not match the " +
                                                 std::to_string(client.listeners_.size()) + " sockets received");
      if (auto keys = j.find("ticket_keys"); keys != j.end()) {
        if (!keys->is_string()) return fail(Error::kInvalidArgument, "handover: ticket_keys is not a string");
        client.ticket_keys_ = keys->get<std::string>();
      }
      return client;
    }
    if (client.listeners_.size() == kMaxHandedListeners)
      return fail(Error::kLimitExceeded, "handover: more than " + std::to_string(kMaxHandedListeners) + " listening sockets");
    auto worker = j.find("worker");
    auto endpoint = j.find("endpoint");
    auto role = j.find("role");
    if (worker == j.end() || !worker->is_number_unsigned() || endpoint == j.end() || !endpoint->is_string() ||
        fds.size() != 1)
      return fail(Error::kInvalidArgument, "handover: a listener message needs worker, endpoint and one socket: " +
                                               msg->substr(0, 200));
    ListenerRole listener_role = ListenerRole::kClient;
    if (role != j.end()) {
      if (*role == "fleet") listener_role = ListenerRole::kFleet;
      else if (*role != "client")
        return fail(Error::kInvalidArgument, "handover: a listener's role is client or fleet: " + msg->substr(0, 200));
    }
    auto ep = parse_endpoint(endpoint->get<std::string>());
    if (!ep) return fail(Error::kInvalidArgument, "handover: " + ep.message());
    int type = 0;
    socklen_t len = sizeof type;
    int listening = 0;
    socklen_t llen = sizeof listening;
    if (::getsockopt(fds[0].get(), SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM ||
        ::getsockopt(fds[0].get(), SOL_SOCKET, SO_ACCEPTCONN, &listening, &llen) != 0 || !listening)
      return fail(Error::kInvalidArgument, "handover: the socket for " + ep->to_string() + " is not a listening TCP socket");
    client.listeners_.push_back(HandedListener{worker->get<unsigned>(), *ep, std::move(fds[0]), listener_role});
  }
}

Status HandoverClient::finish(int timeout_ms) {
  set_timeouts(sock_.get(), timeout_ms);
  if (Status s = send_message(sock_.get(), kReady); !s) return s;
  std::vector<UniqueFd> fds;
  auto msg = receive_message(sock_.get(), &fds, "done");
  if (!msg) return msg.failure();
  if (*msg != kDone) return fail(Error::kInvalidArgument, "handover: expected done, got " + msg->substr(0, 200));
  sock_.reset();
  return {};
}

Result<std::unique_ptr<HandoverServer>> HandoverServer::start(uv_loop_t* loop, const std::string& path,
                                                              ListListeners list, HandedOver handed_over,
                                                              TicketKeysText ticket_keys) {
  auto addr = unix_address(path);
  if (!addr) return addr.failure();
  std::unique_ptr<HandoverServer> s(new HandoverServer());
  s->loop_ = loop;
  s->path_ = path;
  s->list_ = std::move(list);
  s->handed_over_ = std::move(handed_over);
  s->ticket_keys_ = std::move(ticket_keys);
  s->listen_fd_ = UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s->listen_fd_.valid()) return fail_errno("socket", errno);
  // A proxy still answering there is not stale: two proxies, one path, would hand over each other's ingress.
  {
    UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (probe.valid() && ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr) == 0)
      return fail(Error::kAlreadyExists, "a running proxy holds the handover socket " + path +
                                             "; start the new one with --takeover " + path);
  }
  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      return fail(Error::kAlreadyExists, "handover socket path " + path + " exists and is not a socket");
    ::unlink(path.c_str());
  }
  // 0600 from the start: the socket hands out the ingress's listeners.
  const mode_t old_umask = ::umask(0177);
  const int bound = ::bind(s->listen_fd_.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof *addr);
  const int bind_errno = errno;
  ::umask(old_umask);
  if (bound != 0) return fail_errno("bind " + path, bind_errno);
  if (::listen(s->listen_fd_.get(), 4) != 0) return fail_errno("listen " + path, errno);
  s->listen_poll_ = new uv_poll_t;
  uv_poll_init(loop, s->listen_poll_, s->listen_fd_.get());
  s->listen_poll_->data = s.get();
  uv_poll_start(s->listen_poll_, UV_READABLE, [](uv_poll_t* p, int status, int) {
    if (status == 0) static_cast<HandoverServer*>(p->data)->on_listen_readable();
  });
  return s;
}

HandoverServer::~HandoverServer() {
  close();
  drop_peer("");
}

void HandoverServer::close() {
  if (!listen_fd_.valid()) return;
  close_poll(listen_poll_);
  listen_fd_.reset();
  ::unlink(path_.c_str());
}

void HandoverServer::on_listen_readable() {
  UniqueFd peer(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!peer.valid()) return;
  if (peer_fd_.valid()) return;  // one takeover at a time: a second asker is closed
  ucred cred{};
  socklen_t len = sizeof cred;
  // Root may ask too: a proxy that dropped to proxy.user is taken over by its successor started as root.
  if (::getsockopt(peer.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || (cred.uid != ::geteuid() && cred.uid != 0)) {
    spdlog::warn("handover: refused a takeover from uid {} (this proxy runs as uid {})", cred.uid, ::geteuid());
    return;
  }
  // Blocking with timeouts: the messages are few and small, and a peer that stalls is dropped.
  set_timeouts(peer.get(), kHandoverTimeoutMs);
  peer_fd_ = std::move(peer);
  stage_ = Stage::kAwaitingRequest;
  peer_poll_ = new uv_poll_t;
  uv_poll_init(loop_, peer_poll_, peer_fd_.get());
  peer_poll_->data = this;
  uv_poll_start(peer_poll_, UV_READABLE | UV_DISCONNECT, [](uv_poll_t* p, int, int) {
    static_cast<HandoverServer*>(p->data)->on_peer_readable();
  });
  peer_timer_ = new uv_timer_t;
  uv_timer_init(loop_, peer_timer_);
  peer_timer_->data = this;
  uv_timer_start(peer_timer_, [](uv_timer_t* t) {
    static_cast<HandoverServer*>(t->data)->drop_peer("the new process did not finish the takeover in time");
  }, kHandoverTimeoutMs, 0);
}

void HandoverServer::on_peer_readable() {
  std::vector<UniqueFd> fds;  // a peer's descriptors are not wanted: closed with this vector
  std::string buf(kMaxHandoverMessageBytes, '\0');
  bool would_block = false;
  auto n = recv_with_fds(peer_fd_.get(), buf.data(), buf.size(), &fds, &would_block);
  if (n && would_block) return;
  if (!n || *n == 0) return drop_peer(n ? "the new process closed the takeover" : n.message());
  buf.resize(*n);
  if (stage_ == Stage::kAwaitingRequest && buf == kTakeover) {
    std::vector<Listener> listeners = list_();
    if (listeners.size() > kMaxHandedListeners)
      return drop_peer("more than " + std::to_string(kMaxHandedListeners) + " listening sockets to hand over");
    for (const Listener& l : listeners) {
      const std::string msg = nlohmann::json{{"worker", l.worker},
                                             {"endpoint", l.endpoint.to_string()},
                                             {"role", l.role == ListenerRole::kFleet ? "fleet" : "client"}}
                                  .dump();
      const int fd = l.fd;
      if (Status s = send_message(peer_fd_.get(), msg, std::span<const int>(&fd, 1)); !s) return drop_peer(s.message());
    }
    nlohmann::json end{{"listeners", listeners.size()}};
    if (ticket_keys_) end["ticket_keys"] = ticket_keys_();
    if (Status s = send_message(peer_fd_.get(), end.dump()); !s) return drop_peer(s.message());
    spdlog::info("handover: sent {} listening sockets to the new process", listeners.size());
    stage_ = Stage::kAwaitingReady;
    return;
  }
  if (stage_ == Stage::kAwaitingReady && buf == kReady) {
    stage_ = Stage::kDone;
    close();
    handed_over_();
    if (Status s = send_message(peer_fd_.get(), kDone); !s) spdlog::warn("handover: {}", s.message());
    return drop_peer("");
  }
  drop_peer("unexpected message in the takeover: " + buf.substr(0, 100));
}

void HandoverServer::drop_peer(std::string why) {
  if (!why.empty()) spdlog::warn("handover: {}", why);
  close_poll(peer_poll_);
  if (peer_timer_ != nullptr) {
    uv_close(reinterpret_cast<uv_handle_t*>(peer_timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
    peer_timer_ = nullptr;
  }
  peer_fd_.reset();
  if (stage_ != Stage::kDone) stage_ = Stage::kIdle;
}

}  // namespace sg
