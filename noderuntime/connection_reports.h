// The proxies' counts of open connections per sandbox (activity reports). Each proxy worker's latest count
// for a sandbox replaces its previous one; a count lives `ttl` past its report, so a proxy that died
// cannot pin a sandbox awake (live workers re-report every non-zero count at least that often). The node
// learns when a sandbox's total goes from zero to more or back to zero: a sandbox with open connections
// never goes idle, and its idle clock starts when the last one closes.
#pragma once

#include <uv.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>

namespace sg {

class ConnectionReports {
 public:
  using Clock = std::chrono::steady_clock;
  // A sandbox's total went from `before` to `total` (one of them zero), by a report or an expiry.
  using Changed = std::function<void(const std::string& sandbox_id, uint64_t before, uint64_t total)>;

  // `ttl` is read at each report, so a reload's report interval applies at once.
  ConnectionReports(uv_loop_t* loop, std::function<Clock::duration()> ttl, Changed changed);
  ~ConnectionReports();  // the loop must run once more to free the timer
  ConnectionReports(const ConnectionReports&) = delete;
  ConnectionReports& operator=(const ConnectionReports&) = delete;

  // `reporter`'s count for the sandbox is now `count` (0 drops it).
  void report(const std::string& sandbox_id, const std::string& reporter, uint64_t count, Clock::time_point now);
  uint64_t total(const std::string& sandbox_id) const;
  // The sandbox is gone: its counts with it, and no Changed for it.
  void forget(const std::string& sandbox_id);
  // No more expiries (the node is shutting down); counts stay readable.
  void stop();

 private:
  struct Reported {
    uint64_t connections = 0;
    Clock::time_point expires;
  };
  struct Counts {
    std::map<std::string, Reported> by_reporter;  // only non-zero counts
    uint64_t total = 0;
  };
  void recount(const std::string& sandbox_id, Counts& counts);
  void arm(Clock::time_point due);
  void expire();

  uv_loop_t* loop_;
  std::function<Clock::duration()> ttl_;
  Changed changed_;
  uv_timer_t* timer_;
  std::optional<Clock::time_point> timer_due_;
  bool stopped_ = false;
  std::unordered_map<std::string, Counts> by_sandbox_;  // only sandboxes with at least one count
};

}  // namespace sg
