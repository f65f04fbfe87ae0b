#include "proxy/access_log.h"

#include <gtest/gtest.h>

#include <chrono>

#include <nlohmann/json.hpp>

namespace sg {
namespace {

TEST(AccessLog, OneJsonObjectWithEveryField) {
  AccessRecord r;
  r.started_at = std::chrono::system_clock::now();
  r.started_steady = std::chrono::steady_clock::now();
  r.client = "127.0.0.1:5555";
  r.sni = "8080-demo.sandbox.localhost";
  r.sandbox_id = "sb-0123456789ab";
  r.sandbox = "demo";
  r.port = 8080;
  r.bytes_in = 100;
  r.bytes_out = 2000;
  r.woke = true;
  r.wake_ms = 1.25;
  r.data_path = "userspace";
  r.tls_version = "TLSv1.3";
  r.tls_resumed = true;
  r.cause = TerminationCause::kUpstreamClosed;
  r.phase = "forward";
  std::string line = AccessLog::format(r);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["client"], "127.0.0.1:5555");
  EXPECT_EQ(j["sni"], "8080-demo.sandbox.localhost");
  EXPECT_EQ(j["sandbox"], "sb-0123456789ab");
  EXPECT_EQ(j["port"], 8080);
  EXPECT_EQ(j["bytes_in"], 100);
  EXPECT_EQ(j["bytes_out"], 2000);
  EXPECT_EQ(j["woke"], true);
  EXPECT_DOUBLE_EQ(j["wake_ms"].get<double>(), 1.25);
  EXPECT_EQ(j["tls"], "TLSv1.3");
  EXPECT_EQ(j["tls_resumed"], true);
  EXPECT_EQ(j["cause"], "upstream_closed");
  EXPECT_EQ(j["phase"], "forward");
  EXPECT_TRUE(j["duration_ms"].is_number());
  EXPECT_TRUE(j["time"].get<std::string>().ends_with("Z"));
}

// The time is UTC with milliseconds; the seconds part is kept between lines, so a line in another second
// (later, or earlier: the wall clock can step back) must not reuse it.
TEST(AccessLog, TheTimeIsUtcWithMillisecondsForEveryLine) {
  using namespace std::chrono;
  const auto time_of = [](sys_time<milliseconds> t) {
    AccessRecord r;
    r.started_at = t;
    r.started_steady = steady_clock::now();
    return nlohmann::json::parse(AccessLog::format(r))["time"].get<std::string>();
  };
  const sys_time<milliseconds> t = sys_days(year(2026) / 12 / 7) + hours(2) + minutes(52) + seconds(1);
  EXPECT_EQ(time_of(t + milliseconds(7)), "2026-12-07T02:52:01.007Z");
  EXPECT_EQ(time_of(t + milliseconds(999)), "2026-12-07T02:52:01.999Z");
  EXPECT_EQ(time_of(t + milliseconds(1000)), "2026-12-07T02:52:02.000Z");
  EXPECT_EQ(time_of(t - hours(3)), "2026-12-06T23:52:01.000Z");
  EXPECT_EQ(time_of(sys_days(year(2028) / 2 / 29) + milliseconds(123)), "2028-02-29T00:00:00.123Z");
}

TEST(AccessLog, WhatAClientSentIsEscapedAndWhatIsNotUtf8Replaced) {
  AccessRecord r;
  r.host = "\xff\xfe bad\"\n";
  r.sni = "8080-x.sandbox.localhost";
  r.detail = "OpenSSL: \"quoted\" \\ and a tab\t";
  r.cause = TerminationCause::kBadRequest;
  std::string line = AccessLog::format(r);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  auto j = nlohmann::json::parse(line);  // throws on invalid JSON or invalid UTF-8
  EXPECT_EQ(j["host"], "\xEF\xBF\xBD\xEF\xBF\xBD bad\"\n");
  EXPECT_EQ(j["detail"], r.detail);
  EXPECT_EQ(j["cause"], "bad_request");
  // What the connection never learned is null, not 0 or "".
  for (const char* k : {"sandbox", "sandbox_ref", "port", "status", "wake_ms", "tls", "path", "phase"})
    EXPECT_TRUE(j[k].is_null()) << k;
  EXPECT_FALSE(j.contains("hop_to"));
  EXPECT_EQ(j["tls_resumed"], false);
}

TEST(AccessLog, EveryCauseHasAName) {
  for (int c = 0; c <= static_cast<int>(TerminationCause::kShutdown); ++c)
    EXPECT_NE(cause_name(static_cast<TerminationCause>(c)), "unknown") << c;
}

}  // namespace
}  // namespace sg
