// What a restarted node settles: every record the store kept, checked against what its driver finds.
#include <spdlog/spdlog.h>

#include <initializer_list>

#include "noderuntime/node.h"

namespace sg {
namespace {

using S = SandboxState;

}  // namespace

Status Node::reconcile() {
  // What an earlier node vouched for is not this one's word: each route's next spares vouch again.
  if (Status s = vouchers_.reset(); !s)
    spdlog::error("{}: the proxy's socket maker will refuse every namespace until this is fixed", s.message());
  auto rows = store_->load_live();
  if (!rows) return rows.failure();
  size_t adopted = 0, failed = 0;
  for (StoredSandbox& row : *rows) {
    auto owned = std::make_unique<Sandbox>();
    owned->rec = std::move(row);
    Sandbox& sb = registry_.add(std::move(owned));
    const std::string id = sb.id();
    // Before the API listens, so no remove can have claimed the image; a refusal would be a bug worth a line.
    if (Status s = image_users_->add(sb.rec.spec.image, image_user_label(sb.rec.spec)); !s)
      spdlog::error("sandbox {}: {}", id, s.message());
    if (snapshots_ != nullptr && !sb.rec.spec.snapshot.empty())
      if (auto s = snapshots_->add_user(sb.rec.spec.snapshot, image_user_label(sb.rec.spec)); !s)
        spdlog::warn("sandbox {}: its snapshot {}: {}", id, sb.rec.spec.snapshot, s.message());
    // A removal the node died in (before or after the driver stopped the sandbox): finished now, whatever is
    // left of the sandbox (the driver's terminate finds its processes by their cgroup, or none).
    if (sb.rec.terminating) {
      ++failed;
      begin_terminate(sb, "its removal did not finish before the node restarted");
      continue;
    }
    if (sb.rec.state == S::kFailed) {
      ++failed;
      continue;
    }
    if (find_driver(sb.rec.spec.driver) == nullptr) {
      ++failed;
      if (!transition(sb, S::kFailed, "its driver '" + sb.rec.spec.driver + "' is not enabled on this node"))
        spdlog::error("sandbox {}: its driver is gone and it cannot be marked failed", id);
      continue;
    }
    // Creating with pid 0: the node stopped between persisting `creating` and the start answering. The
    // driver may have started the sandbox, but no process was recorded to adopt, and its caller never got an
    // answer. What it started is killed (the driver's terminate reaches it through the sandbox's cgroup) and
    // the record and the name go, as after a failed start.
    if (sb.rec.state == S::kCreating && sb.rec.runtime.pid == 0) {
      ++failed;
      begin_terminate(sb, "its create did not finish before the node restarted");
      continue;
    }
    ObservedInstance seen;
    if (sb.rec.state != S::kCreating) seen = driver(sb).observe(sb.rec.spec, sb.rec.runtime);
    if (!seen.alive && seen.hibernated && sb.rec.state != S::kCreating) {
      adopt_hibernated(sb);
      ++adopted;
      continue;
    }
    if (!seen.alive) {
      ++failed;
      if (sb.rec.spec.ephemeral) {
        begin_terminate(sb, "not running after node restart");
      } else if (!transition(sb, S::kFailed, "not running after node restart")) {
        spdlog::error("sandbox {}: gone, and it cannot be marked failed", id);
      }
      continue;
    }
    if (seen.runtime) {
      // The instance the driver found in place of the recorded one: recorded first, so a node killed again
      // finds it by the record.
      sb.rec.runtime = std::move(*seen.runtime);
      persist(sb);
    }
    adopt(sb, seen.paused);
    watch(sb);
    ++adopted;
  }
  spdlog::info("reconciled {} sandboxes from the store: {} adopted, {} failed or gone", rows->size(), adopted, failed);
  return {};
}

// Settles a live instance's recorded state with what the driver sees, finishing half-done transitions
// through the legal intermediate states so the state machine stays the single source of rules. A step
// the state machine refuses leaves the sandbox failed (transition_or_fail), and the steps after it are
// not taken.
void Node::adopt(Sandbox& sb, bool paused) {
  auto through = [&](std::initializer_list<S> states, const std::string& reason) {
    for (S to : states)
      if (!transition_or_fail(sb, to, reason)) return;
  };
  // A live instance's memory is resident whatever the record said (e.g. a hibernation that never finished).
  sb.rec.tier = paused ? SuspendTier::kMemory : SuspendTier::kNone;
  switch (sb.rec.state) {
    case S::kCreating:
      if (!transition_or_fail(sb, S::kRunning, "started (adopted after node restart)")) break;
      if (paused) {
        sb.rec.tier = SuspendTier::kMemory;  // the transition to running cleared it
        through({S::kSuspending, S::kSuspended}, "found paused after node restart");
      }
      break;
    case S::kRunning:
      if (paused) {
        // Running on record but paused: a suspend records `suspending` before it pauses, so only a
        // checkpoint's or a fork's freeze leaves this behind, and their source must run on. Resumed
        // through the legal states (each logged), as a wake would.
        const std::string reason = "paused by a checkpoint when the node stopped; resumed";
        for (S to : {S::kSuspending, S::kSuspended, S::kResuming})
          if (!transition_or_fail(sb, to, reason)) return;
        driver(sb).resume(sb.rec.spec, sb.rec.runtime,
                          [this, id = sb.id()](Status s) { on_resume_done(id, std::move(s)); });
      } else {
        start_idle_clock(sb);
      }
      break;
    case S::kSuspending:
      if (paused) {
        through({S::kSuspended}, "suspend completed before node restart");
      } else {
        through({S::kRunning}, "suspend did not complete before node restart");
      }
      break;
    case S::kSuspended:
      if (!paused) {
        through({S::kResuming, S::kRunning}, "found running after node restart");
      } else {
        persist(sb);
        start_hibernate_clock(sb);
      }
      break;
    case S::kResuming:
      if (paused) {
        // The resume was asked for before the restart; finish it.
        driver(sb).resume(sb.rec.spec, sb.rec.runtime,
                          [this, id = sb.id()](Status s) { on_resume_done(id, std::move(s)); });
      } else {
        through({S::kRunning}, "resume completed before node restart");
      }
      break;
    case S::kFailed:
    case S::kTerminated:
      break;
  }
}

// The instance is gone but its saved state is complete: whatever was in flight, the sandbox is hibernated.
void Node::adopt_hibernated(Sandbox& sb) {
  sb.rec.tier = SuspendTier::kDisk;
  const std::string reason = "found hibernated after node restart";
  switch (sb.rec.state) {
    case S::kRunning:
      if (transition_or_fail(sb, S::kSuspending, reason)) transition_or_fail(sb, S::kSuspended, reason);
      break;
    case S::kSuspending:
      transition_or_fail(sb, S::kSuspended, reason);
      break;
    case S::kSuspended:
      persist(sb);
      break;
    case S::kResuming:
      // The restore was asked for before the restart; start it again from the saved state.
      driver(sb).restore(sb.rec.spec, sb.rec.runtime,
                         [this, id = sb.id()](Result<RuntimeInfo> r) { on_restore_done(id, std::move(r)); });
      break;
    case S::kCreating:
    case S::kFailed:
    case S::kTerminated:
      break;
  }
}

}  // namespace sg
