#include "noderuntime/connection_reports.h"

#include <spdlog/spdlog.h>

#include <vector>

#include "noderuntime/uv_handles.h"

namespace sg {

ConnectionReports::ConnectionReports(uv_loop_t* loop, std::function<Clock::duration()> ttl, Changed changed)
    : loop_(loop), ttl_(std::move(ttl)), changed_(std::move(changed)), timer_(new uv_timer_t) {
  uv_timer_init(loop_, timer_);
  timer_->data = this;
}

ConnectionReports::~ConnectionReports() { close_and_free(timer_); }

void ConnectionReports::report(const std::string& sandbox_id, const std::string& reporter, uint64_t count,
                               Clock::time_point now) {
  auto it = by_sandbox_.find(sandbox_id);
  if (count == 0) {
    if (it == by_sandbox_.end() || it->second.by_reporter.erase(reporter) == 0) return;
  } else {
    if (it == by_sandbox_.end()) it = by_sandbox_.emplace(sandbox_id, Counts{}).first;
    Clock::time_point expires = now + ttl_();
    it->second.by_reporter[reporter] = Reported{count, expires};
    arm(expires);
  }
  recount(sandbox_id, it->second);  // may erase `it`
}

uint64_t ConnectionReports::total(const std::string& sandbox_id) const {
  auto it = by_sandbox_.find(sandbox_id);
  return it == by_sandbox_.end() ? 0 : it->second.total;
}

void ConnectionReports::forget(const std::string& sandbox_id) { by_sandbox_.erase(sandbox_id); }

void ConnectionReports::stop() {
  stopped_ = true;
  uv_timer_stop(timer_);
  timer_due_.reset();
}

void ConnectionReports::recount(const std::string& sandbox_id, Counts& counts) {
  const uint64_t before = counts.total;
  counts.total = 0;
  for (const auto& [reporter, reported] : counts.by_reporter) counts.total += reported.connections;
  const uint64_t total = counts.total;
  if (counts.by_reporter.empty()) by_sandbox_.erase(sandbox_id);  // `counts` is gone from here on
  if ((before == 0) != (total == 0)) changed_(sandbox_id, before, total);
}

void ConnectionReports::arm(Clock::time_point due) {
  if (stopped_ || (timer_due_ && *timer_due_ <= due)) return;
  auto now = Clock::now();
  uint64_t delay_ms =
      due > now ? static_cast<uint64_t>(std::chrono::ceil<std::chrono::milliseconds>(due - now).count()) : 0;
  uv_update_time(loop_);  // libuv schedules from its cached loop time, which lags behind `now`
  uv_timer_start(timer_, [](uv_timer_t* t) { static_cast<ConnectionReports*>(t->data)->expire(); }, delay_ms, 0);
  timer_due_ = due;
}

// Scans only the sandboxes that have counts, and re-arms for the earliest count still alive.
void ConnectionReports::expire() {
  timer_due_.reset();
  const Clock::time_point now = Clock::now();
  std::optional<Clock::time_point> next;
  std::vector<std::string> ids;
  ids.reserve(by_sandbox_.size());
  for (const auto& [id, counts] : by_sandbox_) ids.push_back(id);
  for (const std::string& id : ids) {
    auto it = by_sandbox_.find(id);
    if (it == by_sandbox_.end()) continue;  // a Changed callback forgot it
    Counts& counts = it->second;
    bool expired = false;
    for (auto r = counts.by_reporter.begin(); r != counts.by_reporter.end();) {
      if (r->second.expires <= now) {
        spdlog::warn("sandbox {}: {} connection(s) reported by '{}' expired: no report for {} ms", id,
                     r->second.connections, r->first,
                     std::chrono::duration_cast<std::chrono::milliseconds>(ttl_()).count());
        r = counts.by_reporter.erase(r);
        expired = true;
        continue;
      }
      if (!next || r->second.expires < *next) next = r->second.expires;
      ++r;
    }
    if (expired) recount(id, counts);
  }
  if (next) arm(*next);
}

}  // namespace sg
