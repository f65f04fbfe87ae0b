// Checkpoints of a running sandbox: the gate (state, one at a time, the idle policy held back meanwhile)
// and the hand-off to the snapshot service (filesystem) or the driver (memory). The work itself runs in
// snapshot/checkpointer.h and the drivers.
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <chrono>

#include "common/failpoint.h"
#include "noderuntime/node.h"
#include "noderuntime/snapshot_defaults.h"

namespace sg {
namespace {

using S = SandboxState;

// A suspended sandbox's checkpoint: the freeze is the driver's (a no-op on what is frozen already, and it
// waits until it is), but the thaw is not, since the sandbox stays suspended.
class KeepFrozen final : public snapshot::Freezer {
 public:
  explicit KeepFrozen(std::unique_ptr<snapshot::Freezer> inner) : inner_(std::move(inner)) {}
  Status freeze() override { return inner_->freeze(); }
  Status thaw() override { return {}; }

 private:
  std::unique_ptr<snapshot::Freezer> inner_;
};

int64_t wall_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void Node::checkpoint(std::string_view ref, std::string_view type, CheckpointCallback done) {
  auto found = registry_.find_usable(ref);
  if (!found) return done(found.failure());
  Sandbox& sb = **found;
  const SandboxSpec& spec = sb.rec.spec;
  if (type == "memory" && !driver(sb).capabilities().memory_checkpoint)
    return done(fail(Error::kUnsupported, "memory checkpoints are not supported by the " + spec.driver +
                                              " driver (it cannot save running processes); use --type filesystem"));
  if (type != "filesystem" && type != "memory")
    return done(fail(Error::kInvalidArgument, "type: '" + std::string(type) + "' is not one of filesystem, memory"));
  if (snapshots_ == nullptr) return done(fail(Error::kUnavailable, "this node has no snapshot store"));
  // A VM booted on a disk: a filesystem checkpoint is a copy of that disk (its root filesystem), not layers.
  const bool vm_disk = type == "filesystem" && driver(sb).capabilities().disk_checkpoint;
  // A suspended sandbox is checkpointed as it stands (its frozen upper dir, its stopped VM, or a hibernated
  // VM's saved files) and stays suspended; a wake asked for meanwhile follows the checkpoint. A filesystem
  // checkpoint of a process sandbox in the disk tier needs it running.
  const bool suspended_in_memory = sb.rec.state == S::kSuspended && sb.rec.tier == SuspendTier::kMemory;
  const bool hibernated = sb.rec.state == S::kSuspended && sb.rec.tier == SuspendTier::kDisk;
  if (sb.rec.state != S::kRunning && !suspended_in_memory && !(hibernated && (type == "memory" || vm_disk)))
    return done(fail(Error::kConflict,
                     "sandbox " + sb.id() + " is " + std::string(state_name(sb.rec.state)) +
                         (sb.rec.state == S::kSuspended ? " (in the disk tier; resume it first: sandgate resume " +
                                                              std::string(ref) + ")"
                                                        : "; only a running or suspended sandbox can be checkpointed")));
  if (sb.checkpointing) return done(fail(Error::kConflict, "a checkpoint of sandbox " + sb.id() + " is in progress"));
  if (type == "memory" || vm_disk) return checkpoint_vm(sb, type, std::move(done));
  checkpoint_filesystem(sb, std::move(done));
}

void Node::checkpoint_filesystem(Sandbox& sb, CheckpointCallback done) {
  const SandboxSpec& spec = sb.rec.spec;
  auto source = driver(sb).checkpoint_source(spec, sb.rec.runtime);
  if (!source) return done(source.failure());
  snapshot::CheckpointJob job;
  job.upper_dir = source->upper_dir;
  job.shift = source->shift;
  job.index_path = sb.rec.runtime.sandbox_dir + "/checkpoint.index";
  job.base_layers = std::move(source->base_layers);
  job.record = snapshot_record(spec);
  job.max_layers_above_image = config_->get()->node.checkpoint_flatten_layers;
  if (sb.rec.state == S::kSuspended) source->freezer = std::make_unique<KeepFrozen>(std::move(source->freezer));
  sb.checkpointing = true;
  spdlog::info("sandbox {}: checkpoint (filesystem) started", sb.id());
  snapshots_->checkpoint(std::move(job), std::move(source->freezer),
                         [this, alive = std::weak_ptr<bool>(alive_), id = sb.id(), hold = std::move(source->hold),
                          done = std::move(done)](Result<snapshot::CheckpointResult> r) {
                           if (alive.expired()) return;
                           if (r) {
                             spdlog::info("sandbox {}: checkpoint {}: {} entries, {} bytes, frozen {:.1f} ms{}", id,
                                          r->snapshot.id, r->entries, r->snapshot.layer_bytes, r->pause_ms,
                                          r->flattened == 0 ? std::string()
                                                            : fmt::format(" (on a chain flattened from {} layers)",
                                                                          r->flattened));
                           } else {
                             spdlog::warn("sandbox {}: checkpoint failed: {}", id, r.message());
                           }
                           on_checkpoint_done(id);
                           done(std::move(r));
                         });
}

void Node::checkpoint_vm(Sandbox& sb, std::string_view type, CheckpointCallback done) {
  const bool memory = type == "memory";
  snapshot::Snapshot record = snapshot_record(sb.rec.spec);
  record.type = std::string(type);
  record.id = snapshot::generate_snapshot_id();
  if (memory) {
    record.memory_mb = sb.rec.spec.memory_mb;
    record.cpus = sb.rec.spec.cpus;
  }
  // No layers: the guest's root is its disk (copied into the snapshot) or the initramfs. A disk that is an
  // overlay of a snapshot's disk keeps reading it: that snapshot is this one's parent.
  if (!sb.rec.spec.snapshot_disk.empty() ||
      (!sb.rec.spec.memory_snapshot_dir.empty() &&
       ::access((sb.rec.spec.memory_snapshot_dir + "/" + kSnapshotDisk).c_str(), F_OK) == 0))
    record.parent = sb.rec.spec.snapshot;
  auto dir = snapshots_->begin_files(record.id);
  if (!dir) return done(dir.failure());
  sb.checkpointing = true;
  const CheckpointFrom source = sb.rec.state != S::kSuspended     ? CheckpointFrom::kRunning
                                       : sb.rec.tier == SuspendTier::kDisk ? CheckpointFrom::kHibernated
                                                                           : CheckpointFrom::kPaused;
  spdlog::info("sandbox {}: checkpoint ({}) {} started{}", sb.id(), memory ? "memory" : "filesystem, the VM's disk",
               record.id, source == CheckpointFrom::kRunning ? "" : " (suspended)");
  const std::string id_of_record = record.id;
  auto saved_done = [this, alive = std::weak_ptr<bool>(alive_), id = sb.id(), record = std::move(record),
                     done = std::move(done)](Result<VmCheckpoint> saved) mutable {
        if (alive.expired()) return;
        auto finish = [this, id, type = record.type, done = std::move(done)](Result<snapshot::CheckpointResult> r) {
          if (r)
            spdlog::info("sandbox {}: checkpoint {}: state {} bytes, RAM {} bytes, disk {} bytes, paused {:.1f} ms",
                         id, r->snapshot.id, r->snapshot.state_bytes, r->snapshot.ram_bytes, r->snapshot.disk_bytes,
                         r->pause_ms);
          else
            spdlog::warn("sandbox {}: {} checkpoint failed: {}", id, type, r.message());
          on_checkpoint_done(id);
          done(std::move(r));
        };
        if (!saved) {
          snapshots_->discard_files(record.id);
          return finish(saved.failure());
        }
        // A disk that holds only what changed since an earlier checkpoint reads that one's under it.
        if (!saved->parent.empty()) record.parent = saved->parent;
        record.state_bytes = saved->state_bytes;
        record.ram_bytes = saved->ram_bytes;
        record.disk_bytes = saved->disk_bytes;
        record.created_at_ms = wall_now_ms();
        failpoint("memory-checkpoint:saved");  // the files in their .d.tmp, no record yet
        snapshots_->commit_files(std::move(record), [alive, pause_ms = saved->pause_ms,
                                                      finish = std::move(finish)](Result<snapshot::Snapshot> r) {
          if (alive.expired()) return;
          if (!r) return finish(r.failure());
          finish(snapshot::CheckpointResult{.snapshot = std::move(*r), .pause_ms = pause_ms, .entries = 0});
        });
      };
  const CheckpointFiles files{.id = id_of_record,
                              .dir = *dir,
                              .final_dir = snapshots_->files_dir(id_of_record),
                              .max_chain = config_->get()->node.checkpoint_flatten_layers};
  if (memory) driver(sb).checkpoint_memory(sb.rec.spec, sb.rec.runtime, files, source, std::move(saved_done));
  else driver(sb).checkpoint_disk(sb.rec.spec, sb.rec.runtime, files, source, std::move(saved_done));
}

void Node::on_checkpoint_done(const std::string& id) {
  Sandbox* sb = registry_.by_id(id);
  if (sb == nullptr) return;
  sb->checkpointing = false;
  // A wake asked for while a suspended sandbox's checkpoint read it (begin_resume held it back).
  if (sb->rec.state == S::kSuspended && sb->pending_wake && !sb->terminating) {
    sb->idle_after_checkpoint = false;  // a hibernation it held back is moot: the sandbox wakes
    // Admitted when it was asked for; the node may have been fenced since.
    if (fleet_ != nullptr)
      if (Status s = fleet_->admit(FleetAdmission::kWake); !s) {
        sb->pending_wake.reset();
        return fail_waiters(*sb, s.failure());
      }
    return begin_resume(*sb, *sb->pending_wake);
  }
  if (!sb->idle_after_checkpoint) return;
  sb->idle_after_checkpoint = false;
  if (sb->terminating) return;
  if (sb->rec.state == S::kRunning) begin_suspend(*sb, "idle (held back while a checkpoint ran)");
  else if (sb->rec.state == S::kSuspended && sb->rec.tier == SuspendTier::kMemory)
    begin_hibernate(*sb, "suspended in memory (hibernation held back while a checkpoint ran)");
}

}  // namespace sg
