// Readiness of the sockets a worker's connections forward between, from one epoll set of the worker's own.
//
// Why not uv_poll_t for them: a connection changes what it waits for (readable, writable, both, nothing)
// several times per handshake, and uv_poll_start answers every change by deleting the descriptor from
// libuv's epoll set at once and adding it back at the next loop turn: two or three epoll_ctl calls per
// change, 18 per new TLS connection (bench/RESULTS.md, "Where a new connection's time goes now"). Here a
// socket is added once, a change of interest is one EPOLL_CTL_MOD, no change is no call, and stopping is one
// EPOLL_CTL_DEL. The set is a single descriptor in the worker's libuv loop (a uv_poll_t on the epoll fd),
// so timers and every other handle stay libuv's.
//
// Watching nothing is applied late: the kernel's mask is cleared just before the loop next waits (a
// uv_prepare_t), not at once, since a connection often watches nothing only for the rest of a callback (its
// head read, its sandbox being opened) or until it stops the watch right after. Watching the same again, or
// stopping, before then costs no call: a new TLS connection makes 6 epoll_ctl calls instead of 8.
//
// The semantics are uv_poll's, so the connection's logic does not change: level-triggered; the callback
// gets (status, events) with events the watched ones among UV_READABLE and UV_WRITABLE that are ready (a
// hang-up counts as both); a socket error (EPOLLERR) is reported once as status UV_EBADF with no events, and
// the watch then watches nothing until set() again. A watch of nothing reports nothing, a hang-up included.
#pragma once

#include <sys/epoll.h>
#include <uv.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/error.h"
#include "common/fd.h"

namespace sg {

class SocketWatch;

class SocketWatchSet {
 public:
  // Events taken from the kernel per loop turn; more ready sockets wait for the next turn (the set's
  // descriptor stays readable), so one turn's work is bounded.
  static constexpr int kBatch = 64;

  SocketWatchSet() = default;
  ~SocketWatchSet();
  SocketWatchSet(const SocketWatchSet&) = delete;
  SocketWatchSet& operator=(const SocketWatchSet&) = delete;

  // Creates the epoll set and polls it from `loop`.
  Status open(uv_loop_t* loop);
  // Stops polling, so the loop may end: no callback after this. Watches still set may be stopped or
  // destroyed afterwards, but not the set before them. Also done by the destructor.
  void close();
  bool is_open() const { return poll_ != nullptr; }
  // The epoll descriptor (its /proc/self/fdinfo lists what is registered: tests read it).
  int descriptor() const { return epoll_fd_.get(); }
  // epoll_ctl calls made so far (tests count them).
  uint64_t control_calls() const { return control_calls_; }

 private:
  friend class SocketWatch;
  void on_ready();
  // A watch stopped during on_ready(): its events later in the batch are dropped (it may be gone).
  void forget(const SocketWatch* w);
  // Watching nothing, applied before the loop next waits unless the watch changes or stops first.
  void defer_disarm(SocketWatch* w);
  void cancel_disarm(SocketWatch* w);
  void disarm_deferred();

  UniqueFd epoll_fd_;
  uv_poll_t* poll_ = nullptr;  // freed in its close callback
  uv_prepare_t* before_wait_ = nullptr;  // runs disarm_deferred(); freed in its close callback
  std::vector<SocketWatch*> to_disarm_;
  uint64_t control_calls_ = 0;
  epoll_event* batch_ = nullptr;  // the events on_ready() is delivering, else null
  int batch_size_ = 0;
};

class SocketWatch {
 public:
  using Callback = void (*)(void* data, int status, int events);

  SocketWatch() = default;
  ~SocketWatch() { stop(); }
  SocketWatch(const SocketWatch&) = delete;
  SocketWatch& operator=(const SocketWatch&) = delete;

  // Watches `fd` in `set`, for nothing yet. A watch already in use is stopped first.
  void init(SocketWatchSet* set, int fd, Callback cb, void* data);
  bool initialized() const { return set_ != nullptr; }
  // UV_READABLE and/or UV_WRITABLE; 0 for nothing. At most one epoll_ctl, none when nothing changes.
  Status set(int events);
  int events() const { return events_; }
  // Before the descriptor closes: no callback comes after this, not even for an event already taken from
  // the kernel in the same loop turn.
  void stop();

 private:
  friend class SocketWatchSet;
  void deliver(uint32_t epoll_events);
  Status control(int op, uint32_t epoll_events);

  SocketWatchSet* set_ = nullptr;
  int fd_ = -1;
  Callback cb_ = nullptr;
  void* data_ = nullptr;
  int events_ = 0;           // what the owner asked for
  uint32_t armed_ = 0;       // the epoll mask the kernel holds: events_'s, or older while a disarm waits
  bool registered_ = false;  // in the epoll set (possibly with no events, see deliver())
  bool disarm_deferred_ = false;
};

}  // namespace sg
