#include "proxy/access_log.h"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <cmath>

#include <memory>
#include <nlohmann/json.hpp>

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

std::string AccessLog::format(const AccessRecord& r) {
  using namespace std::chrono;
  double duration_ms = duration<double, std::milli>(steady_clock::now() - r.started_steady).count();
  auto ms = time_point_cast<milliseconds>(r.started_at);
  nlohmann::json j = {
      {"time", fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:03d}Z", ms, ms.time_since_epoch().count() % 1000)},
      {"client", r.client},
      {"sni", r.sni.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.sni)},
      {"host", r.host.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.host)},
      {"sandbox", r.sandbox_id.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.sandbox_id)},
      {"sandbox_ref", r.sandbox.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.sandbox)},
      {"port", r.port == 0 ? nlohmann::json(nullptr) : nlohmann::json(r.port)},
      {"status", r.status == 0 ? nlohmann::json(nullptr) : nlohmann::json(r.status)},
      {"bytes_in", r.bytes_in},
      {"bytes_out", r.bytes_out},
      {"duration_ms", std::round(duration_ms * 1000) / 1000},
      {"woke", r.woke},
      {"route_cached", r.route_cached},
      {"prewake", r.prewake},
      {"wake_ms", r.woke ? nlohmann::json(std::round(r.wake_ms * 1000) / 1000) : nlohmann::json(nullptr)},
      {"tls", r.tls_version.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.tls_version)},
      {"path", r.data_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.data_path)},
      {"cause", cause_name(r.cause)},
      {"phase", r.phase.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.phase)},
  };
  if (!r.detail.empty()) j["detail"] = r.detail;
  if (!r.hop_to.empty()) j["hop_to"] = r.hop_to;
  if (!r.hop_from.empty()) j["hop_from"] = r.hop_from;
  // Untrusted strings (SNI, Host) may hold invalid UTF-8: replace instead of throwing.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
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
