#include "proxy/access_log.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>

#include "common/json_text.h"

namespace sg {

std::string_view cause_name(TerminationCause c) {
  switch (c) {
    case TerminationCause::kClientClosed: return "client_closed";
    case TerminationCause::kUpstreamClosed: return "upstream_closed";
    case TerminationCause::kClientReset: return "client_reset";
    case TerminationCause::kUpstreamReset: return "upstream_reset";
    case TerminationCause::kHandshakeFailed: return "handshake_failed";
    case TerminationCause::kHandshakeTimeout: return "handshake_timeout";
    case TerminationCause::kUnknownSni: return "unknown_sni";
    case TerminationCause::kHeadTimeout: return "head_timeout";
    case TerminationCause::kHeadTooLarge: return "head_too_large";
    case TerminationCause::kBadRequest: return "bad_request";
    case TerminationCause::kMisdirected: return "misdirected";
    case TerminationCause::kUnknownSandbox: return "unknown_sandbox";
    case TerminationCause::kPortNotExposed: return "port_not_exposed";
    case TerminationCause::kNotServed: return "route_not_served";
    case TerminationCause::kUnauthorized: return "unauthorized";
    case TerminationCause::kCrossOrigin: return "cross_origin";
    case TerminationCause::kAuthRedirect: return "auth_redirect";
    case TerminationCause::kSandboxConnLimit: return "sandbox_connection_limit";
    case TerminationCause::kClientConnLimit: return "client_connection_limit";
    case TerminationCause::kTooManyConnections: return "too_many_connections";
    case TerminationCause::kWakeFailed: return "wake_failed";
    case TerminationCause::kWakeTimeout: return "wake_timeout";
    case TerminationCause::kNodeUnavailable: return "node_unavailable";
    case TerminationCause::kUpstreamConnectFailed: return "upstream_connect_failed";
    case TerminationCause::kUpstreamConnectTimeout: return "upstream_connect_timeout";
    case TerminationCause::kIdleTimeout: return "idle_timeout";
    case TerminationCause::kSandboxSuspended: return "sandbox_suspended";
    case TerminationCause::kTokenRevoked: return "token_revoked";
    case TerminationCause::kPortClosed: return "port_closed";
    case TerminationCause::kKtlsRequired: return "ktls_required";
    case TerminationCause::kKtlsKeyUpdate: return "ktls_key_update";
    case TerminationCause::kDrained: return "drained";
    case TerminationCause::kFleetOwnerGone: return "fleet_owner_gone";
    case TerminationCause::kFleetHopFailed: return "fleet_hop_failed";
    case TerminationCause::kFleetRedirect: return "fleet_redirect";
    case TerminationCause::kSocketWatchFailed: return "socket_watch_failed";
    case TerminationCause::kShutdown: return "shutdown";
  }
  return "unknown";
}

Result<std::unique_ptr<AccessLog>> AccessLog::open(const std::string& target) {
  auto log = std::make_unique<AccessLog>();
  if (target == "-") {
    log->out_ = stdout;
  } else if (!target.empty()) {
    log->out_ = std::fopen(target.c_str(), "ae");
    if (!log->out_) return fail_errno("open access log " + target, errno);
    log->owned_ = true;
  }
  return log;
}

AccessLog::~AccessLog() {
  if (owned_ && out_) std::fclose(out_);
}

namespace {

// "2026-12-07T02:52:01.123Z". The part up to the seconds is made once a second per thread (a line per
// connection would otherwise run gmtime and a chrono format each time).
void append_utc_time(std::string& out, std::chrono::sys_time<std::chrono::milliseconds> t) {
  using namespace std::chrono;
  thread_local int64_t cached_second = INT64_MIN;
  thread_local char cached[19];  // "YYYY-MM-DDTHH:MM:SS"
  const int64_t since_epoch_ms = t.time_since_epoch().count();
  const int64_t second = since_epoch_ms >= 0 ? since_epoch_ms / 1000 : (since_epoch_ms - 999) / 1000;
  if (second != cached_second) {
    const auto day = floor<days>(sys_seconds(seconds(second)));
    const year_month_day date(day);
    const hh_mm_ss clock(sys_seconds(seconds(second)) - day);
    const auto two = [](char* p, unsigned v) {
      p[0] = static_cast<char>('0' + v / 10 % 10);
      p[1] = static_cast<char>('0' + v % 10);
    };
    const int y = static_cast<int>(date.year());
    const unsigned year = static_cast<unsigned>(y < 0 ? 0 : y > 9999 ? 9999 : y);
    two(cached, year / 100);
    two(cached + 2, year % 100);
    cached[4] = '-';
    two(cached + 5, static_cast<unsigned>(date.month()));
    cached[7] = '-';
    two(cached + 8, static_cast<unsigned>(date.day()));
    cached[10] = 'T';
    two(cached + 11, static_cast<unsigned>(clock.hours().count()));
    cached[13] = ':';
    two(cached + 14, static_cast<unsigned>(clock.minutes().count()));
    cached[16] = ':';
    two(cached + 17, static_cast<unsigned>(clock.seconds().count()));
    cached_second = second;
  }
  const unsigned millis = static_cast<unsigned>(since_epoch_ms - second * 1000);
  out.append(cached, 19);
  out += '.';
  out += static_cast<char>('0' + millis / 100);
  out += static_cast<char>('0' + millis / 10 % 10);
  out += static_cast<char>('0' + millis % 10);
  out += 'Z';
}

}  // namespace

// Written field by field, not through an nlohmann tree: one line per connection, and the tree cost ~10 µs of
// its ~900 (BM_AccessLogFormat, bench/RESULTS.md).
std::string AccessLog::format(const AccessRecord& r) {
  using namespace std::chrono;
  const double duration_ms = duration<double, std::milli>(steady_clock::now() - r.started_steady).count();
  const auto ms = time_point_cast<milliseconds>(r.started_at);
  std::string out;
  out.reserve(512);
  const auto key = [&](std::string_view k) {
    out += out.empty() ? "{\"" : ",\"";
    out += k;
    out += "\":";
  };
  // Untrusted strings (SNI, Host) may hold anything: append_json_string escapes them and replaces what is
  // not UTF-8.
  const auto text = [&](std::string_view k, std::string_view v) {
    key(k);
    append_json_string(out, v);
  };
  const auto null = [&](std::string_view k) {
    key(k);
    out += "null";
  };
  const auto text_or_null = [&](std::string_view k, std::string_view v) {
    if (v.empty()) null(k);
    else text(k, v);
  };
  const auto number = [&](std::string_view k, uint64_t v) {
    key(k);
    append_json_number(out, v);
  };
  const auto decimal = [&](std::string_view k, double v) {
    key(k);
    append_json_double(out, v);
  };
  const auto flag = [&](std::string_view k, bool v) {
    key(k);
    out += v ? "true" : "false";
  };
  key("time");
  out += '"';
  append_utc_time(out, ms);
  out += '"';
  text("client", r.client);
  text_or_null("sni", r.sni);
  text_or_null("host", r.host);
  text_or_null("sandbox", r.sandbox_id);
  text_or_null("sandbox_ref", r.sandbox);
  if (r.port == 0) null("port");
  else number("port", uint64_t{r.port});
  if (r.status <= 0) null("status");
  else number("status", static_cast<uint64_t>(r.status));
  number("bytes_in", r.bytes_in);
  number("bytes_out", r.bytes_out);
  decimal("duration_ms", std::round(duration_ms * 1000) / 1000);
  flag("woke", r.woke);
  flag("route_cached", r.route_cached);
  flag("prewake", r.prewake);
  if (r.woke) decimal("wake_ms", std::round(r.wake_ms * 1000) / 1000);
  else null("wake_ms");
  text_or_null("tls", r.tls_version);
  flag("tls_resumed", r.tls_resumed);
  text_or_null("path", r.data_path);
  text("cause", cause_name(r.cause));
  text_or_null("phase", r.phase);
  if (!r.detail.empty()) text("detail", r.detail);
  if (!r.hop_to.empty()) text("hop_to", r.hop_to);
  if (!r.hop_from.empty()) text("hop_from", r.hop_from);
  out += '}';
  return out;
}

void AccessLog::write(const AccessRecord& r) {
  if (!out_) return;
  std::string line = format(r);
  line += '\n';
  std::lock_guard lock(mu_);
  std::fwrite(line.data(), 1, line.size(), out_);
  std::fflush(out_);
}

}  // namespace sg
