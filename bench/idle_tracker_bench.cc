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

// The goal of issue 12: one second of a node at 100k sandboxes receiving 1M activity events, under one
// core. An iteration is that second: 1M touches of sandboxes in a pseudo-random order (no two neighbours
// share a cache line, unlike BM_Touch's sequential walk), with the timer's tick every 10 ms in between, each
// expiry set again as if the sandbox woke. Timeouts of 1-60 s, so every second a share of the heap surfaces
// and is pushed back (the lazy heap's work); the events go to 90% of the sandboxes, and the other 10% expire
// at their deadlines. Its time is the CPU that second costs; under 1 s meets the goal.
void BM_OneSecondOfActivity(benchmark::State& state) {
  const size_t sandboxes = static_cast<size_t>(state.range(0));
  constexpr size_t kEventsPerSecond = 1'000'000;
  constexpr size_t kTicksPerSecond = 100;
  auto keys = make_keys(sandboxes);
  IdleTracker t;
  auto short_timeout = [](size_t i) { return std::chrono::seconds(1 + (i * 7919) % 60); };
  for (size_t i = 0; i < keys.size(); ++i) t.set(keys[i], short_timeout(i), kT0);
  std::vector<uint32_t> order(kEventsPerSecond);
  uint64_t x = 88172645463325252ull;  // xorshift64: the same order in every run
  for (auto& o : order) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    o = static_cast<uint32_t>(x % (sandboxes - sandboxes / 10));
  }
  auto now = kT0;
  size_t expired = 0, next = 0;
  for (auto _ : state) {
    for (size_t tick = 0; tick < kTicksPerSecond; ++tick) {
      const size_t from = tick * kEventsPerSecond / kTicksPerSecond;
      const size_t to = (tick + 1) * kEventsPerSecond / kTicksPerSecond;
      for (size_t e = from; e < to; ++e) {
        benchmark::DoNotOptimize(t.touch(keys[order[e]], now));
        now += 1us;
      }
      for (const std::string& key : t.pop_expired(now)) {
        ++expired;
        t.set(key, short_timeout(next++), now);
      }
    }
  }
  state.counters["events_per_s"] = benchmark::Counter(static_cast<double>(state.iterations() * kEventsPerSecond),
                                                      benchmark::Counter::kIsRate);
  state.counters["expired_per_s"] =
      benchmark::Counter(static_cast<double>(expired), benchmark::Counter::kAvgIterations);
}
BENCHMARK(BM_OneSecondOfActivity)->Arg(100'000)->Unit(benchmark::kMillisecond)->MinTime(5);

}  // namespace
