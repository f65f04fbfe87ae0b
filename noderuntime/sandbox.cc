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

}  // namespace sg
