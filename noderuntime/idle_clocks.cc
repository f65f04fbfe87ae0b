#include "noderuntime/idle_clocks.h"

#include "noderuntime/uv_handles.h"

namespace sg {

IdleClocks::IdleClocks(uv_loop_t* loop, Expired expired)
    : loop_(loop), expired_(std::move(expired)), timer_(new uv_timer_t) {
  uv_timer_init(loop_, timer_);
  timer_->data = this;
}

IdleClocks::~IdleClocks() { close_and_free(timer_); }

void IdleClocks::start(const std::string& sandbox_id, IdleTracker::Duration timeout, bool held,
                       std::optional<Clock::time_point> since) {
  tracker_.remove(sandbox_id);  // a fresh entry, so the hold below is its only one
  tracker_.set(sandbox_id, timeout, since.value_or(Clock::now()));
  if (held) tracker_.hold(sandbox_id);
  arm();
}

void IdleClocks::remove(const std::string& sandbox_id) { tracker_.remove(sandbox_id); }

void IdleClocks::touch(const std::string& sandbox_id, Clock::time_point now) { tracker_.touch(sandbox_id, now); }

void IdleClocks::hold(const std::string& sandbox_id) { tracker_.hold(sandbox_id); }

void IdleClocks::release(const std::string& sandbox_id) {
  tracker_.release(sandbox_id, Clock::now());
  arm();
}

void IdleClocks::stop() {
  stopped_ = true;
  uv_timer_stop(timer_);
  timer_due_.reset();
}

void IdleClocks::arm() {
  if (stopped_) return;
  auto next = tracker_.next_deadline();
  if (!next) {
    uv_timer_stop(timer_);
    timer_due_.reset();
    return;
  }
  if (timer_due_ && *timer_due_ <= *next) return;  // already fires early enough
  auto now = Clock::now();
  uint64_t delay_ms = 0;
  if (*next > now) delay_ms = static_cast<uint64_t>(std::chrono::ceil<std::chrono::milliseconds>(*next - now).count());
  uv_update_time(loop_);  // libuv schedules from its cached loop time, which lags behind `now`
  uv_timer_start(timer_, [](uv_timer_t* t) { static_cast<IdleClocks*>(t->data)->fire(); }, delay_ms, 0);
  timer_due_ = *next;
}

void IdleClocks::fire() {
  timer_due_.reset();
  // An expiry may start clocks again (a driver that cannot suspend keeps the sandbox running).
  for (const std::string& id : tracker_.pop_expired(Clock::now())) expired_(id);
  arm();
}

}  // namespace sg
