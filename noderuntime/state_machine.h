// The sandbox lifecycle as a table of legal transitions. Every state change in the node goes through
// check_transition, so an impossible change (a bug or a race between operations) is refused with a clear
// message instead of silently corrupting the record.
//
//   creating   -> running | failed | terminated
//   running    -> suspending | terminated | failed
//   suspending -> suspended | running (the freeze failed and was rolled back) | terminated | failed
//   suspended  -> resuming | suspending (memory -> disk: hibernation) | terminated | failed
//   resuming   -> running | failed | terminated
//   failed     -> terminated
//   terminated is final.
#pragma once

#include "common/error.h"
#include "noderuntime/sandbox.h"

namespace sg {

// Ok when `from -> to` is legal; otherwise Error::kConflict naming both states.
Status check_transition(SandboxState from, SandboxState to);

}  // namespace sg
