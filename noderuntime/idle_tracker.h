// Idle deadlines for every running sandbox, built to stay cheap at 100k+ sandboxes: activity is reported
// constantly (every proxied byte batch), expiries are rare. So touch() is O(1) and does no heap work;
// the heap holds at most one live entry per key and is corrected lazily: when an entry reaches the top
// and its key saw activity since, it is pushed back with the real deadline instead of expiring.
//
// Time is passed in (a steady-clock value), never read here, so tests and benchmarks need no sleeping.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace sg {

class IdleTracker {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;
  using Duration = Clock::duration;

  // Starts (or restarts) tracking `key`: it expires `timeout` after `now` unless touched. Holds survive.
  void set(const std::string& key, Duration timeout, TimePoint now);
  // Activity: the deadline becomes now + timeout. O(1). False if the key is not tracked.
  bool touch(const std::string& key, TimePoint now);
  // Stops tracking; a no-op for unknown keys. O(1) (the heap entry is dropped when it surfaces).
  void remove(const std::string& key);
  // A long-lived connection keeps the key awake: it never expires while at least one hold is active.
  bool hold(const std::string& key);
  // Drops one hold; releasing the last one starts the idle clock at `now`.
  void release(const std::string& key, TimePoint now);

  // Earliest time pop_expired() may have work: a lower bound (lazily invalidated entries may surface first
  // and be pushed back), so a timer armed at it never fires late.
  std::optional<TimePoint> next_deadline() const;
  // Keys whose deadline is <= now, which stop being tracked. O(k log n) for k surfaced entries.
  std::vector<std::string> pop_expired(TimePoint now);

  // The key's current deadline; nullopt when untracked or held.
  std::optional<TimePoint> deadline(const std::string& key) const;
  bool contains(const std::string& key) const { return entries_.count(key) != 0; }
  size_t size() const { return entries_.size(); }
  size_t heap_size() const { return heap_.size(); }

 private:
  struct Entry {
    Duration timeout{};
    TimePoint last_activity{};
    uint64_t generation = 0;  // matches the heap item that speaks for this entry; older items are stale
    uint32_t holds = 0;
    bool in_heap = false;
  };
  struct HeapItem {
    TimePoint deadline;
    uint64_t generation;
    std::string key;
  };

  void push(const std::string& key, Entry& e, TimePoint deadline);
  void compact_if_bloated();

  std::unordered_map<std::string, Entry> entries_;
  std::vector<HeapItem> heap_;  // min-heap on deadline
  uint64_t next_generation_ = 0;
};

}  // namespace sg
