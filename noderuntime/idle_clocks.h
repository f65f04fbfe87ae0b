// The idle policy's clocks: at most one per sandbox (running: its idle timeout; suspended in memory: its
// hibernation delay), all on one libuv timer armed for the earliest deadline (IdleTracker keeps them cheap
// at 100k sandboxes). What an expiry means is the node's business: `expired` gets each sandbox whose clock
// ran out, which stops being tracked.
#pragma once

#include <uv.h>

#include <functional>
#include <optional>
#include <string>

#include "noderuntime/idle_tracker.h"

namespace sg {

class IdleClocks {
 public:
  using Clock = IdleTracker::Clock;
  using Expired = std::function<void(const std::string& sandbox_id)>;

  IdleClocks(uv_loop_t* loop, Expired expired);
  ~IdleClocks();  // the loop must run once more to free the timer
  IdleClocks(const IdleClocks&) = delete;
  IdleClocks& operator=(const IdleClocks&) = delete;

  // A fresh clock for the sandbox, running out `timeout` from now (or from `since`, as if the last activity
  // had been then) unless touched; `held`: it does not run until released (connections are open).
  void start(const std::string& sandbox_id, IdleTracker::Duration timeout, bool held = false,
             std::optional<Clock::time_point> since = std::nullopt);
  void remove(const std::string& sandbox_id);
  void touch(const std::string& sandbox_id) { touch(sandbox_id, Clock::now()); }
  // With the caller's `now`: one clock read for a whole activity report.
  void touch(const std::string& sandbox_id, Clock::time_point now);
  void hold(const std::string& sandbox_id);
  // The last hold gone: the clock starts from now.
  void release(const std::string& sandbox_id);
  // When it runs out; nullopt when there is no clock or it is held.
  std::optional<Clock::time_point> deadline(const std::string& sandbox_id) const { return tracker_.deadline(sandbox_id); }
  // No expiry from now on (the node is shutting down).
  void stop();

 private:
  void arm();
  void fire();

  uv_loop_t* loop_;
  Expired expired_;
  IdleTracker tracker_;
  uv_timer_t* timer_;
  std::optional<Clock::time_point> timer_due_;  // when timer_ fires; nullopt when stopped
  bool stopped_ = false;
};

}  // namespace sg
