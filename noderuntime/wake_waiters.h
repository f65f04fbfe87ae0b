// Opens waiting for their sandbox to run again (Node::open of a sandbox that is starting, suspending,
// suspended or resuming). One wake serves them all (single flight, started by the node); each waits with a
// deadline of its own and fails with kTimeout at it, while the wake goes on. Everything runs on the loop.
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/error.h"

namespace sg {

class WakeWaiters {
 public:
  // Ok once the sandbox runs (the caller then opens its socket), or why it will not.
  using Done = std::function<void(Status)>;

  explicit WakeWaiters(uv_loop_t* loop) : loop_(loop) {}
  // Closes the timers (the loop must run once more to free them); callbacks still waiting are dropped.
  ~WakeWaiters();
  WakeWaiters(const WakeWaiters&) = delete;
  WakeWaiters& operator=(const WakeWaiters&) = delete;

  // `done` runs exactly once: from settle(), or with kTimeout after `timeout_ms`.
  void add(const std::string& sandbox_id, uint32_t timeout_ms, Done done);
  bool any(const std::string& sandbox_id) const;
  size_t count(const std::string& sandbox_id) const;
  // Answers every waiter of the sandbox with `result` (ok: it runs), in the order they came. Waiters a
  // callback adds meanwhile wait for the next settle.
  void settle(const std::string& sandbox_id, const Status& result);
  // settle() for every sandbox (the node is shutting down).
  void settle_all(const Status& result);

 private:
  struct Waiter;
  void on_timeout(Waiter* w);
  static void finish(Waiter* w, Status result);

  uv_loop_t* loop_;
  std::unordered_map<std::string, std::vector<Waiter*>> by_sandbox_;
};

}  // namespace sg
