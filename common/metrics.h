// Prometheus text exposition (format 0.0.4) for both daemons' /metrics, and the lock-free counters and
// histograms they are made from. Counters are updated from any thread with relaxed atomics (a scrape reads
// a consistent-enough snapshot; Prometheus only needs each series monotonic) and formatted on scrape.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sg {

class Counter {
 public:
  void add(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

// A histogram of durations with fixed upper bounds (seconds, ascending). observe() is three relaxed adds.
class Histogram {
 public:
  explicit Histogram(std::initializer_list<double> upper_bounds_s);
  void observe(double seconds);
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative count of observations <= bounds()[i]; i == bounds().size() is +Inf (the total).
  uint64_t cumulative(size_t i) const;
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum_seconds() const { return static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9; }

 private:
  std::vector<double> bounds_;
  std::vector<std::atomic<uint64_t>> buckets_;  // per bucket, not cumulative; the last is +Inf
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_ns_{0};
};

// Latency buckets: a TLS handshake (ms) and a wake (ms to tens of seconds: QEMU restores from disk).
Histogram make_handshake_histogram();
Histogram make_wake_histogram();

using Labels = std::vector<std::pair<std::string_view, std::string_view>>;

// Builds one exposition. Each family is declared once (HELP, TYPE), then its samples follow.
class MetricsText {
 public:
  void family(std::string_view name, std::string_view type, std::string_view help);
  void sample(std::string_view name, const Labels& labels, double value);
  void sample(std::string_view name, const Labels& labels, uint64_t value);
  // A whole histogram family: _bucket{le=...} cumulative, _sum, _count.
  void histogram(std::string_view name, std::string_view help, const Histogram& h);
  const std::string& text() const { return out_; }

 private:
  void series(std::string_view name, const Labels& labels, std::string_view extra_key, std::string_view extra_value);
  std::string out_;
};

// "text/plain; version=0.0.4; charset=utf-8": what Prometheus expects from /metrics.
inline constexpr std::string_view kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace sg
