#include "common/metrics.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

TEST(MetricsText, FamiliesSamplesAndEscapedLabels) {
  MetricsText m;
  m.family("x_total", "counter", "Things\\done\nhere.");
  m.sample("x_total", {{"cause", "a\"b\\c\nd"}}, uint64_t{3});
  m.sample("x_total", {}, 0.5);
  EXPECT_EQ(m.text(),
            "# HELP x_total Things\\\\done\\nhere.\n"
            "# TYPE x_total counter\n"
            "x_total{cause=\"a\\\"b\\\\c\\nd\"} 3\n"
            "x_total 0.5\n");
}

TEST(Histogram, BucketsAreCumulativeWithSumAndCount) {
  Histogram h({0.01, 0.1, 1});
  h.observe(0.005);
  h.observe(0.01);  // on a bound: that bucket (le is "less or equal")
  h.observe(0.5);
  h.observe(7);
  h.observe(-1);  // a clock step: counted in the first bucket, adds nothing to the sum
  EXPECT_EQ(h.cumulative(0), 3u);
  EXPECT_EQ(h.cumulative(1), 3u);
  EXPECT_EQ(h.cumulative(2), 4u);
  EXPECT_EQ(h.cumulative(3), 5u);
  EXPECT_EQ(h.count(), 5u);
  EXPECT_NEAR(h.sum_seconds(), 7.515, 1e-9);
  MetricsText m;
  m.histogram("d_seconds", "Durations.", h);
  EXPECT_EQ(m.text(),
            "# HELP d_seconds Durations.\n# TYPE d_seconds histogram\n"
            "d_seconds_bucket{le=\"0.01\"} 3\n"
            "d_seconds_bucket{le=\"0.1\"} 3\n"
            "d_seconds_bucket{le=\"1\"} 4\n"
            "d_seconds_bucket{le=\"+Inf\"} 5\n"
            "d_seconds_sum 7.515\n"
            "d_seconds_count 5\n");
}

}  // namespace
}  // namespace sg
