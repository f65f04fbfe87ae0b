#include "noderuntime/sandbox.h"

namespace sg {

std::string_view state_name(SandboxState s) {
  switch (s) {
    case SandboxState::kCreating: return "creating";
    case SandboxState::kRunning: return "running";
    case SandboxState::kSuspending: return "suspending";
    case SandboxState::kSuspended: return "suspended";
    case SandboxState::kResuming: return "resuming";
    case SandboxState::kTerminated: return "terminated";
    case SandboxState::kFailed: return "failed";
  }
  return "unknown";
}

std::optional<SandboxState> parse_state(std::string_view s) {
  for (auto st : {SandboxState::kCreating, SandboxState::kRunning, SandboxState::kSuspending, SandboxState::kSuspended,
                  SandboxState::kResuming, SandboxState::kTerminated, SandboxState::kFailed})
    if (state_name(st) == s) return st;
  return std::nullopt;
}

std::string_view tier_name(SuspendTier t) {
  switch (t) {
    case SuspendTier::kNone: return "";
    case SuspendTier::kMemory: return "memory";
    case SuspendTier::kDisk: return "disk";
  }
  return "";
}

std::optional<SuspendTier> parse_tier(std::string_view s) {
  for (auto t : {SuspendTier::kNone, SuspendTier::kMemory, SuspendTier::kDisk})
    if (tier_name(t) == s) return t;
  return std::nullopt;
}

}  // namespace sg
