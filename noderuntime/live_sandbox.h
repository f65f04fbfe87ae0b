// A sandbox as the node holds it while it lives: the persisted record plus what only this node process
// knows (operations in flight, stamps the proxies are told). Owned by the SandboxRegistry; read and changed
// on the loop thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "noderuntime/idle_tracker.h"
#include "noderuntime/store.h"

namespace sg {

struct LiveSandbox {
  StoredSandbox rec;      // the persisted part
  std::string new_token;  // the token in clear between create() and its answer, then wiped
  uint64_t resumes = 0;   // resumes started since this node process adopted or created the sandbox
  std::chrono::steady_clock::time_point wake_started{};  // the resume or restore in flight began (metrics)
  uint64_t suspended_at = 0;      // RouteEvents stamp of the latest suspend that began
  uint64_t token_rotated_at = 0;  // stamp of the latest token rotation (0: none since this node started)
  IdleTracker::TimePoint token_rotated_clock{};  // when, to stop announcing it after the report TTL
  struct Closed {
    uint16_t port = 0;
    uint64_t stamp = 0;              // stamp of the close
    IdleTracker::TimePoint clock{};  // when, to stop announcing it after the report TTL
  };
  std::vector<Closed> closed_ports;  // closed since this node started, pruned once announced long enough
  // Set while suspending when something asked for the sandbox (an open, traffic, the API): unless the
  // driver cancels the suspension, it finishes and is then followed by exactly one resume, for this reason.
  std::optional<std::string> pending_wake;
  bool cancel_requested = false;          // the driver agreed to cancel the suspension in flight
  // When a ClientHello woke it (Node::prewake), until an open came: the next open within the grace reports
  // that it woke the sandbox, as it would have without the early start.
  std::optional<std::chrono::steady_clock::time_point> woken_early_at;
  bool starting = false;                  // the driver's start() has not answered yet
  bool watched = false;                   // the driver watches the instance for an exit of its own
  bool terminating = false;               // a removal is in flight
  bool checkpointing = false;             // a checkpoint of it is on the thread pool (it may be frozen)
  bool idle_after_checkpoint = false;  // the idle policy's next step (suspend, hibernate) waited for it
  bool reserves = false;                  // its memory_mb and cpus count in the registry's Reservations
  std::string terminate_reason;

  const std::string& id() const { return rec.spec.id; }
  const std::string& name() const { return rec.spec.name; }
};

}  // namespace sg
