// A binary upgrade (or a restart with a new config) without refusing a connection: the running proxy hands
// its listening sockets to the new process over a unix socket (SCM_RIGHTS), as HAProxy's `-x` and Envoy's hot
// restart do. The sockets stay open throughout, so no connection waiting in an accept queue is lost and the
// port is never unbound; the old process then stops accepting and finishes the connections it has
// (proxy.drain_timeout_secs at most) while the new one accepts everything new.
//
// The exchange, on a SOCK_SEQPACKET socket (one message each, descriptors attached to theirs):
//   new -> old   "takeover"
//   old -> new   one {"worker":W,"endpoint":"ADDR:PORT","role":"client"|"fleet"} per listening socket, its
//                descriptor attached, then {"listeners":N,"ticket_keys":"HEX"} (the session ticket keys,
//                proxy/ticket_keys.h, so that clients resume on the new process; absent from older ones)
//   new -> old   "ready"      (the new process serves on them)
//   old -> new   "done"       (the old one stopped accepting and removed the socket's path)
// Only a process of the same user, or root, may ask (SO_PEERCRED): the sockets are the ingress.
#pragma once

#include <uv.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "common/net.h"

namespace sg {

// What a listening socket is for: proxy.listen (clients) or proxy.fleet_listen (other nodes' proxies, mutual
// TLS). A message without a role is a client listener (from a process older than fleet listeners' handover).
enum class ListenerRole { kClient, kFleet };

struct HandedListener {
  unsigned worker = 0;  // the old process's worker that polled it
  Endpoint endpoint;    // as bound (port resolved)
  UniqueFd fd;
  ListenerRole role = ListenerRole::kClient;
};

inline constexpr size_t kMaxHandedListeners = 4096;
inline constexpr size_t kMaxHandoverMessageBytes = 4096;
inline constexpr int kHandoverTimeoutMs = 10'000;

// The new process's side, before it binds a listener.
class HandoverClient {
 public:
  // Connects to the running proxy's handover socket at `path` and receives its listening sockets.
  static Result<HandoverClient> take_over(const std::string& path, int timeout_ms = kHandoverTimeoutMs);
  std::vector<HandedListener>& listeners() { return listeners_; }
  // The old process's session ticket keys (TicketKeys::serialize), "" when it sent none.
  const std::string& ticket_keys() const { return ticket_keys_; }
  // Tells the old process that this one serves, and waits until it stopped accepting and gave up the
  // socket's path (so this process can bind its own handover socket there).
  Status finish(int timeout_ms = kHandoverTimeoutMs);

 private:
  UniqueFd sock_;
  std::vector<HandedListener> listeners_;
  std::string ticket_keys_;
};

// The running process's side: listens at `path` (mode 0600, replacing a stale socket) on `loop`.
class HandoverServer {
 public:
  struct Listener {
    unsigned worker;
    Endpoint endpoint;
    int fd;  // still owned by the worker; sent as a duplicate
    ListenerRole role = ListenerRole::kClient;
  };
  // What to hand over, asked when a new process connects.
  using ListListeners = std::function<std::vector<Listener>()>;
  // The new process serves: stop accepting, start draining. Called once; the server has closed and unlinked
  // its socket before it is called.
  using HandedOver = std::function<void()>;
  // The session ticket keys to hand over with the listeners (TicketKeys::serialize), asked at the same time.
  using TicketKeysText = std::function<std::string()>;

  static Result<std::unique_ptr<HandoverServer>> start(uv_loop_t* loop, const std::string& path,
                                                       ListListeners list, HandedOver handed_over,
                                                       TicketKeysText ticket_keys = nullptr);
  ~HandoverServer();
  HandoverServer(const HandoverServer&) = delete;
  HandoverServer& operator=(const HandoverServer&) = delete;
  // Stops listening and removes the socket's path.
  void close();

 private:
  HandoverServer() = default;
  void on_listen_readable();
  void on_peer_readable();
  void drop_peer(std::string why);

  uv_loop_t* loop_ = nullptr;
  std::string path_;
  ListListeners list_;
  HandedOver handed_over_;
  TicketKeysText ticket_keys_;
  UniqueFd listen_fd_;
  uv_poll_t* listen_poll_ = nullptr;  // freed in its close callback
  UniqueFd peer_fd_;
  uv_poll_t* peer_poll_ = nullptr;
  enum class Stage { kIdle, kAwaitingRequest, kAwaitingReady, kDone } stage_ = Stage::kIdle;
  uv_timer_t* peer_timer_ = nullptr;
};

}  // namespace sg
