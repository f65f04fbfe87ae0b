#include "noderuntime/wake_waiters.h"

#include <algorithm>

namespace sg {

// Self-owned once added: freed in its timer's close callback.
struct WakeWaiters::Waiter {
  uv_timer_t timer;
  WakeWaiters* owner = nullptr;
  std::string sandbox_id;
  uint32_t timeout_ms = 0;
  Done done;
};

WakeWaiters::~WakeWaiters() {
  for (auto& [id, waiters] : by_sandbox_) {
    for (Waiter* w : waiters) {
      uv_timer_stop(&w->timer);
      uv_close(reinterpret_cast<uv_handle_t*>(&w->timer), [](uv_handle_t* h) { delete static_cast<Waiter*>(h->data); });
    }
  }
}

void WakeWaiters::add(const std::string& sandbox_id, uint32_t timeout_ms, Done done) {
  auto* w = new Waiter;
  w->owner = this;
  w->sandbox_id = sandbox_id;
  w->timeout_ms = timeout_ms;
  w->done = std::move(done);
  uv_timer_init(loop_, &w->timer);
  w->timer.data = w;
  uv_timer_start(&w->timer, [](uv_timer_t* t) {
    auto* waiter = static_cast<Waiter*>(t->data);
    waiter->owner->on_timeout(waiter);
  }, timeout_ms, 0);
  by_sandbox_[sandbox_id].push_back(w);
}

bool WakeWaiters::any(const std::string& sandbox_id) const { return count(sandbox_id) != 0; }

size_t WakeWaiters::count(const std::string& sandbox_id) const {
  auto it = by_sandbox_.find(sandbox_id);
  return it == by_sandbox_.end() ? 0 : it->second.size();
}

void WakeWaiters::settle(const std::string& sandbox_id, const Status& result) {
  auto it = by_sandbox_.find(sandbox_id);
  if (it == by_sandbox_.end()) return;
  std::vector<Waiter*> waiters = std::move(it->second);
  by_sandbox_.erase(it);
  for (Waiter* w : waiters) finish(w, result);
}

void WakeWaiters::settle_all(const Status& result) {
  std::vector<std::string> ids;
  ids.reserve(by_sandbox_.size());
  for (const auto& [id, waiters] : by_sandbox_) ids.push_back(id);
  for (const std::string& id : ids) settle(id, result);
}

void WakeWaiters::on_timeout(Waiter* w) {
  if (auto it = by_sandbox_.find(w->sandbox_id); it != by_sandbox_.end()) {
    std::erase(it->second, w);
    if (it->second.empty()) by_sandbox_.erase(it);
  }
  // The wake itself goes on: the next open will find the sandbox running.
  finish(w, fail(Error::kTimeout, "sandbox " + w->sandbox_id + " did not wake within " +
                                      std::to_string(w->timeout_ms) + " ms"));
}

void WakeWaiters::finish(Waiter* w, Status result) {
  uv_timer_stop(&w->timer);
  Done done = std::move(w->done);
  uv_close(reinterpret_cast<uv_handle_t*>(&w->timer), [](uv_handle_t* h) { delete static_cast<Waiter*>(h->data); });
  done(std::move(result));
}

}  // namespace sg
