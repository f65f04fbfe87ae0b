// IdleTracker at node scale: 100k running sandboxes. Activity reports touch sandboxes constantly, so touch()
// must stay O(1); expiry must cost O(log n) per expired sandbox, never a scan.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "noderuntime/idle_tracker.h"

namespace {

using namespace std::chrono_literals;
using sg::IdleTracker;

const IdleTracker::TimePoint kT0 = IdleTracker::TimePoint() + 1000h;

std::vector<std::string> make_keys(size_t n) {
  std::vector<std::string> keys;
  keys.reserve(n);
  for (size_t i = 0; i < n; ++i) keys.push_back("sb-" + std::to_string(100000000000 + i));
  return keys;
}

// Spread timeouts so the heap is not trivially ordered by insertion.
IdleTracker::Duration timeout_for(size_t i) { return std::chrono::seconds(60 + (i * 7919) % 3600); }

void BM_Insert(benchmark::State& state) {
  auto keys = make_keys(static_cast<size_t>(state.range(0)));
  for (auto _ : state) {
    IdleTracker t;
    for (size_t i = 0; i < keys.size(); ++i) t.set(keys[i], timeout_for(i), kT0);
    benchmark::DoNotOptimize(t.next_deadline());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Insert)->Arg(100'000)->Unit(benchmark::kMillisecond);

void BM_Touch(benchmark::State& state) {
  auto keys = make_keys(static_cast<size_t>(state.range(0)));
  IdleTracker t;
  for (size_t i = 0; i < keys.size(); ++i) t.set(keys[i], timeout_for(i), kT0);
  size_t i = 0;
  auto now = kT0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(t.touch(keys[i], now));
    if (++i == keys.size()) i = 0;
    now += 1us;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Touch)->Arg(100'000);

// Every sandbox was touched after its first deadline was pushed, so each expires only after being pushed
// back once: the worst case of the lazy heap.
void BM_ExpireAllAfterTouches(benchmark::State& state) {
  auto keys = make_keys(static_cast<size_t>(state.range(0)));
  for (auto _ : state) {
    state.PauseTiming();
    IdleTracker t;
    for (size_t i = 0; i < keys.size(); ++i) t.set(keys[i], timeout_for(i), kT0);
    for (const auto& k : keys) t.touch(k, kT0 + 30s);
    state.ResumeTiming();
    size_t expired = 0;
    for (auto now = kT0; expired < keys.size(); now += 60s) expired += t.pop_expired(now).size();
    benchmark::DoNotOptimize(expired);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_ExpireAllAfterTouches)->Arg(100'000)->Unit(benchmark::kMillisecond);

// The steady state of a timer tick: a few sandboxes due among 100k, most of the heap untouched.
void BM_TickWithFewDue(benchmark::State& state) {
  auto keys = make_keys(static_cast<size_t>(state.range(0)));
  IdleTracker t;
  for (size_t i = 0; i < keys.size(); ++i) t.set(keys[i], timeout_for(i), kT0);
  auto now = kT0;
  size_t next = 0;
  for (auto _ : state) {
    now += 10ms;
    for (const std::string& key : t.pop_expired(now)) {
      t.set(key, timeout_for(next++), now);  // woken again later: back into the tracker
    }
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_TickWithFewDue)->Arg(100'000);

}  // namespace
