#include "noderuntime/state_machine.h"

#include <initializer_list>
#include <string>

namespace sg {
namespace {

bool allowed(SandboxState from, SandboxState to) {
  using S = SandboxState;
  auto one_of = [to](std::initializer_list<S> targets) {
    for (S t : targets)
      if (t == to) return true;
    return false;
  };
  switch (from) {
    case S::kCreating: return one_of({S::kRunning, S::kFailed, S::kTerminated});
    case S::kRunning: return one_of({S::kSuspending, S::kTerminated, S::kFailed});
    case S::kSuspending: return one_of({S::kSuspended, S::kRunning, S::kTerminated, S::kFailed});
    case S::kSuspended: return one_of({S::kResuming, S::kSuspending, S::kTerminated, S::kFailed});
    case S::kResuming: return one_of({S::kRunning, S::kFailed, S::kTerminated});
    case S::kFailed: return to == S::kTerminated;
    case S::kTerminated: return false;
  }
  return false;
}

}  // namespace

Status check_transition(SandboxState from, SandboxState to) {
  if (allowed(from, to)) return {};
  std::string msg = "illegal state transition ";
  msg += state_name(from);
  msg += " -> ";
  msg += state_name(to);
  if (from == SandboxState::kTerminated) msg += " (terminated is final)";
  return fail(Error::kConflict, std::move(msg));
}

}  // namespace sg
