#include "noderuntime/node_metrics.h"

#include <map>

namespace sg {

std::string NodeMetrics::render(const std::vector<std::pair<SandboxState, SuspendTier>>& sandboxes) const {
  constexpr SandboxState kStates[] = {SandboxState::kCreating,  SandboxState::kRunning,    SandboxState::kSuspending,
                                      SandboxState::kSuspended, SandboxState::kResuming,   SandboxState::kFailed};
  std::map<std::pair<SandboxState, std::string_view>, uint64_t> by;
  for (SandboxState s : kStates) by[{s, s == SandboxState::kSuspended ? "memory" : ""}] = 0;
  by[{SandboxState::kSuspended, "disk"}] = 0;
  for (const auto& [state, tier] : sandboxes) {
    if (state == SandboxState::kTerminated) continue;
    // Only a suspended sandbox sits in a tier; a suspending or resuming one is on its way.
    std::string_view t = state == SandboxState::kSuspended ? (tier == SuspendTier::kDisk ? "disk" : "memory") : "";
    ++by[{state, t}];
  }
  MetricsText m;
  m.family("sandgate_node_sandboxes", "gauge",
           "Sandboxes on this node by state; suspended ones by tier (memory: paused, disk: hibernated).");
  for (const auto& [key, n] : by) {
    Labels labels = {{"state", state_name(key.first)}};
    if (!key.second.empty()) labels.push_back({"tier", key.second});
    m.sample("sandgate_node_sandboxes", labels, n);
  }
  m.family("sandgate_node_creates_total", "counter", "Creates that reached the driver, by outcome.");
  m.sample("sandgate_node_creates_total", {{"result", "ok"}}, creates_ok_.value());
  m.sample("sandgate_node_creates_total", {{"result", "failed"}}, creates_failed_.value());
  m.family("sandgate_node_suspends_total", "counter", "Suspensions that finished, by the tier they reached.");
  m.sample("sandgate_node_suspends_total", {{"tier", "memory"}}, suspends_[0].value());
  m.sample("sandgate_node_suspends_total", {{"tier", "disk"}}, suspends_[1].value());
  m.family("sandgate_node_wakes_total", "counter", "Wakes (resume from memory, restore from disk) that finished, by tier.");
  m.sample("sandgate_node_wakes_total", {{"tier", "memory"}}, wakes_[0].value());
  m.sample("sandgate_node_wakes_total", {{"tier", "disk"}}, wakes_[1].value());
  m.family("sandgate_node_wake_failures_total", "counter", "Wakes that failed (the sandbox is then failed), by tier.");
  m.sample("sandgate_node_wake_failures_total", {{"tier", "memory"}}, wake_failures_[0].value());
  m.sample("sandgate_node_wake_failures_total", {{"tier", "disk"}}, wake_failures_[1].value());
  m.family("sandgate_node_prewakes_total", "counter",
           "ClientHellos that named a sleeping sandbox: its wake started then (woke), or the client had not "
           "opened it with a valid token recently (refused; its request wakes it once the token verified).");
  m.sample("sandgate_node_prewakes_total", {{"result", "woke"}}, prewakes_.value());
  m.sample("sandgate_node_prewakes_total", {{"result", "refused"}}, prewakes_refused_.value());
  m.histogram("sandgate_node_wake_duration_seconds", "From the start of a resume or restore to running again.", wake_);
  return m.text();
}

}  // namespace sg
