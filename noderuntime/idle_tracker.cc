#include "noderuntime/idle_tracker.h"

#include <algorithm>

namespace sg {
namespace {

// std::*_heap build max-heaps; ordering by "later deadline is smaller" makes the front the earliest.
struct LaterDeadline {
  template <typename Item>
  bool operator()(const Item& a, const Item& b) const {
    return a.deadline > b.deadline;
  }
};

}  // namespace

void IdleTracker::push(const std::string& key, Entry& e, TimePoint deadline) {
  heap_.push_back(HeapItem{deadline, e.generation, key});
  std::push_heap(heap_.begin(), heap_.end(), LaterDeadline{});
  e.in_heap = true;
}

// Stale items (from remove() or set() on a tracked key) are only dropped when they surface. Churn with
// long timeouts could let them pile up, so rebuild once they outnumber the live entries.
void IdleTracker::compact_if_bloated() {
  if (heap_.size() <= 2 * entries_.size() + 64) return;
  heap_.clear();
  for (auto& [key, e] : entries_) {
    if (!e.in_heap) continue;
    heap_.push_back(HeapItem{e.last_activity + e.timeout, e.generation, key});
  }
  std::make_heap(heap_.begin(), heap_.end(), LaterDeadline{});
}

void IdleTracker::set(const std::string& key, Duration timeout, TimePoint now) {
  Entry& e = entries_[key];
  e.timeout = timeout;
  e.last_activity = now;
  e.generation = ++next_generation_;
  e.in_heap = false;
  if (e.holds == 0) push(key, e, now + timeout);
  compact_if_bloated();
}

bool IdleTracker::touch(const std::string& key, TimePoint now) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return false;
  it->second.last_activity = std::max(it->second.last_activity, now);
  return true;
}

void IdleTracker::remove(const std::string& key) {
  if (entries_.erase(key) != 0) compact_if_bloated();
}

bool IdleTracker::hold(const std::string& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return false;
  ++it->second.holds;
  return true;
}

void IdleTracker::release(const std::string& key, TimePoint now) {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.holds == 0) return;
  Entry& e = it->second;
  if (--e.holds != 0) return;
  e.last_activity = std::max(e.last_activity, now);
  // A held entry loses its heap item when that item surfaces; it needs a new one to expire again.
  if (!e.in_heap) push(key, e, e.last_activity + e.timeout);
}

std::optional<IdleTracker::TimePoint> IdleTracker::next_deadline() const {
  if (heap_.empty()) return std::nullopt;
  return heap_.front().deadline;
}

std::vector<std::string> IdleTracker::pop_expired(TimePoint now) {
  std::vector<std::string> expired;
  while (!heap_.empty() && heap_.front().deadline <= now) {
    std::pop_heap(heap_.begin(), heap_.end(), LaterDeadline{});
    HeapItem item = std::move(heap_.back());
    heap_.pop_back();
    auto it = entries_.find(item.key);
    if (it == entries_.end() || it->second.generation != item.generation) continue;  // stale
    Entry& e = it->second;
    if (e.holds > 0) {
      e.in_heap = false;  // release() pushes it again
      continue;
    }
    TimePoint real = e.last_activity + e.timeout;
    if (real > now) {
      push(item.key, e, real);  // touched since this item was pushed
      continue;
    }
    expired.push_back(std::move(item.key));
    entries_.erase(it);
  }
  return expired;
}

std::optional<IdleTracker::TimePoint> IdleTracker::deadline(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.holds > 0) return std::nullopt;
  return it->second.last_activity + it->second.timeout;
}

}  // namespace sg
