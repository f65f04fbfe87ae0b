#include "proxy/socket_watch.h"

#include <cerrno>

namespace sg {

SocketWatchSet::~SocketWatchSet() { close(); }

Status SocketWatchSet::open(uv_loop_t* loop) {
  if (poll_) return fail(Error::kConflict, "socket watch set already open");
  UniqueFd fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!fd.valid()) return fail_errno("epoll_create1", errno);
  auto* poll = new uv_poll_t;
  if (int r = uv_poll_init(loop, poll, fd.get()); r < 0) {
    delete poll;
    return fail(Error::kIo, std::string("uv_poll_init: ") + uv_strerror(r));
  }
  poll->data = this;
  if (int r = uv_poll_start(poll, UV_READABLE, [](uv_poll_t* p, int, int) {
        static_cast<SocketWatchSet*>(p->data)->on_ready();
      });
      r < 0) {
    uv_close(reinterpret_cast<uv_handle_t*>(poll), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
    return fail(Error::kIo, std::string("uv_poll_start: ") + uv_strerror(r));
  }
  auto* prepare = new uv_prepare_t;
  uv_prepare_init(loop, prepare);  // cannot fail
  prepare->data = this;
  epoll_fd_ = std::move(fd);
  poll_ = poll;
  before_wait_ = prepare;
  return {};
}

void SocketWatchSet::close() {
  if (!poll_) return;
  // uv_close stops watching the descriptor at once; only the handle's memory waits for the callback.
  uv_close(reinterpret_cast<uv_handle_t*>(poll_), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
  uv_close(reinterpret_cast<uv_handle_t*>(before_wait_),
           [](uv_handle_t* h) { delete reinterpret_cast<uv_prepare_t*>(h); });
  poll_ = nullptr;
  before_wait_ = nullptr;
  for (SocketWatch* w : to_disarm_) w->disarm_deferred_ = false;
  to_disarm_.clear();
  epoll_fd_.reset();
}

void SocketWatchSet::defer_disarm(SocketWatch* w) {
  if (w->disarm_deferred_) return;
  w->disarm_deferred_ = true;
  to_disarm_.push_back(w);
  if (before_wait_) {
    uv_prepare_start(before_wait_, [](uv_prepare_t* p) { static_cast<SocketWatchSet*>(p->data)->disarm_deferred(); });
  }
}

void SocketWatchSet::cancel_disarm(SocketWatch* w) {
  if (!w->disarm_deferred_) return;
  w->disarm_deferred_ = false;
  for (auto& x : to_disarm_) {
    if (x == w) {
      x = to_disarm_.back();
      to_disarm_.pop_back();
      break;
    }
  }
}

void SocketWatchSet::disarm_deferred() {
  for (SocketWatch* w : to_disarm_) {
    w->disarm_deferred_ = false;
    // Fails only for a descriptor closed while watched, which the kernel dropped already.
    if (w->control(EPOLL_CTL_MOD, 0)) w->armed_ = 0;
  }
  to_disarm_.clear();
  uv_prepare_stop(before_wait_);
}

void SocketWatchSet::on_ready() {
  epoll_event events[kBatch];
  int n = ::epoll_wait(epoll_fd_.get(), events, kBatch, 0);
  if (n <= 0) return;  // nothing (another watch's stop took it) or EINTR: the next turn asks again
  batch_ = events;
  batch_size_ = n;
  for (int i = 0; i < n; ++i) {
    auto* w = static_cast<SocketWatch*>(events[i].data.ptr);
    if (w) w->deliver(events[i].events);
  }
  batch_ = nullptr;
  batch_size_ = 0;
}

void SocketWatchSet::forget(const SocketWatch* w) {
  for (int i = 0; i < batch_size_; ++i) {
    if (batch_[i].data.ptr == w) batch_[i].data.ptr = nullptr;
  }
}

void SocketWatch::init(SocketWatchSet* set, int fd, Callback cb, void* data) {
  stop();
  set_ = set;
  fd_ = fd;
  cb_ = cb;
  data_ = data;
}

Status SocketWatch::control(int op, uint32_t epoll_events) {
  ++set_->control_calls_;
  epoll_event ev{};
  ev.events = epoll_events;
  ev.data.ptr = this;
  if (::epoll_ctl(set_->epoll_fd_.get(), op, fd_, &ev) != 0) return fail_errno("epoll_ctl", errno);
  return {};
}

Status SocketWatch::set(int events) {
  if (!set_) return fail(Error::kInternal, "socket watch used before init");
  const uint32_t ev = ((events & UV_READABLE) ? EPOLLIN : 0u) | ((events & UV_WRITABLE) ? EPOLLOUT : 0u);
  if (!registered_ && events == 0) {
    events_ = 0;
    return {};
  }
  if (registered_ && ev == armed_) {  // what the kernel holds already, a disarm not yet made included
    set_->cancel_disarm(this);
    events_ = events;
    return {};
  }
  if (events == 0) {
    // Watching nothing stays registered (with no events), so that watching again is one MOD, not an ADD;
    // until the disarm is made, deliver() drops what the kernel still reports.
    events_ = 0;
    set_->defer_disarm(this);
    return {};
  }
  Status s = control(registered_ ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, ev);
  if (!s) return s;
  set_->cancel_disarm(this);
  registered_ = true;
  armed_ = ev;
  events_ = events;
  return {};
}

void SocketWatch::stop() {
  if (!set_) return;
  if (registered_ && set_->epoll_fd_.valid()) {
    // Fails only if the descriptor was closed first (then the kernel already dropped it); nothing to do.
    (void)control(EPOLL_CTL_DEL, 0);
  }
  set_->cancel_disarm(this);
  set_->forget(this);
  set_ = nullptr;
  registered_ = false;
  armed_ = 0;
  events_ = 0;
}

void SocketWatch::deliver(uint32_t epoll_events) {
  if (events_ == 0) {
    // Registered with no events (or a disarm not made yet), epoll still reports a hang-up or an error (or
    // what the old mask asked for), and would again every turn: leave the set until the owner watches
    // something again.
    (void)control(EPOLL_CTL_DEL, 0);
    set_->cancel_disarm(this);
    registered_ = false;
    armed_ = 0;
    return;
  }
  if (epoll_events & EPOLLERR) {
    (void)control(EPOLL_CTL_DEL, 0);
    registered_ = false;
    armed_ = 0;
    events_ = 0;
    return cb_(data_, UV_EBADF, 0);
  }
  int ready = 0;
  if (epoll_events & (EPOLLIN | EPOLLHUP)) ready |= events_ & UV_READABLE;
  if (epoll_events & (EPOLLOUT | EPOLLHUP)) ready |= events_ & UV_WRITABLE;
  // The callback may stop or free this watch: nothing here touches it afterwards.
  if (ready) cb_(data_, 0, ready);
}

}  // namespace sg
