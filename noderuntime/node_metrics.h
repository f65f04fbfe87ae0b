// What the node counts for /metrics on its API (docs/observability.md): sandboxes by state and tier (a
// gauge read from the registry at scrape time), creates, suspends and wakes by tier, and wake latency from
// the start of a resume or restore to running again. Updated on the node's loop; relaxed atomics all the same,
// so a scrape on any thread reads them safely.
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "noderuntime/sandbox.h"

namespace sg {

class NodeMetrics {
 public:
  void created(bool ok) { (ok ? creates_ok_ : creates_failed_).add(); }
  void suspended(SuspendTier tier) { suspends_[tier_index(tier)].add(); }
  void woke(SuspendTier from, double seconds) {
    wakes_[tier_index(from)].add();
    wake_.observe(seconds);
  }
  void wake_failed(SuspendTier from) { wake_failures_[tier_index(from)].add(); }
  // A ClientHello asked to wake a sleeping sandbox: started, or refused by the gate (noderuntime/prewake_gate.h).
  void prewake(bool woke) { (woke ? prewakes_ : prewakes_refused_).add(); }

  // `sandboxes`: the state and tier of every sandbox the node has now.
  std::string render(const std::vector<std::pair<SandboxState, SuspendTier>>& sandboxes) const;

 private:
  static size_t tier_index(SuspendTier t) { return t == SuspendTier::kDisk ? 1 : 0; }  // kNone counts as memory
  Counter creates_ok_, creates_failed_, prewakes_, prewakes_refused_;
  std::array<Counter, 2> suspends_, wakes_, wake_failures_;  // memory, disk
  Histogram wake_ = make_wake_histogram();
};

}  // namespace sg
