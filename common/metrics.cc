#include "common/metrics.h"

#include <charconv>
#include <cmath>

namespace sg {

Histogram::Histogram(std::initializer_list<double> upper_bounds_s)
    : bounds_(upper_bounds_s), buckets_(bounds_.size() + 1) {}

void Histogram::observe(double seconds) {
  if (!(seconds >= 0)) seconds = 0;  // NaN or a clock step: counted, in the first bucket
  size_t i = 0;
  while (i < bounds_.size() && seconds > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<uint64_t>(std::llround(seconds * 1e9)), std::memory_order_relaxed);
}

uint64_t Histogram::cumulative(size_t i) const {
  uint64_t n = 0;
  for (size_t b = 0; b <= i && b < buckets_.size(); ++b) n += buckets_[b].load(std::memory_order_relaxed);
  return n;
}

Histogram make_handshake_histogram() { return Histogram({0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}); }
Histogram make_wake_histogram() { return Histogram({0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}); }

namespace {

// Prometheus label values escape backslash, double quote and newline; nothing else.
void append_escaped(std::string& out, std::string_view v) {
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
}

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);  // the shortest text that reads back as v
  return ec == std::errc() ? std::string(buf, end) : "NaN";
}

}  // namespace

void MetricsText::family(std::string_view name, std::string_view type, std::string_view help) {
  out_ += "# HELP ";
  out_ += name;
  out_ += ' ';
  for (char c : help) {  // HELP escapes backslash and newline
    if (c == '\\') out_ += "\\\\";
    else if (c == '\n') out_ += "\\n";
    else out_ += c;
  }
  out_ += "\n# TYPE ";
  out_ += name;
  out_ += ' ';
  out_ += type;
  out_ += '\n';
}

void MetricsText::series(std::string_view name, const Labels& labels, std::string_view extra_key,
                         std::string_view extra_value) {
  out_ += name;
  if (!labels.empty() || !extra_key.empty()) {
    out_ += '{';
    bool first = true;
    auto one = [&](std::string_view k, std::string_view v) {
      if (!first) out_ += ',';
      first = false;
      out_ += k;
      out_ += "=\"";
      append_escaped(out_, v);
      out_ += '"';
    };
    for (const auto& [k, v] : labels) one(k, v);
    if (!extra_key.empty()) one(extra_key, extra_value);
    out_ += '}';
  }
  out_ += ' ';
}

void MetricsText::sample(std::string_view name, const Labels& labels, double value) {
  series(name, labels, {}, {});
  out_ += number(value);
  out_ += '\n';
}

void MetricsText::sample(std::string_view name, const Labels& labels, uint64_t value) {
  series(name, labels, {}, {});
  out_ += std::to_string(value);
  out_ += '\n';
}

void MetricsText::histogram(std::string_view name, std::string_view help, const Histogram& h) {
  family(name, "histogram", help);
  const std::string bucket = std::string(name) + "_bucket";
  for (size_t i = 0; i <= h.bounds().size(); ++i) {
    const std::string le = i < h.bounds().size() ? number(h.bounds()[i]) : "+Inf";
    series(bucket, {}, "le", le);
    out_ += std::to_string(h.cumulative(i));
    out_ += '\n';
  }
  sample(std::string(name) + "_sum", {}, h.sum_seconds());
  sample(std::string(name) + "_count", {}, h.count());
}

}  // namespace sg
