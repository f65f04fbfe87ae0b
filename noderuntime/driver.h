// The interface every sandbox driver implements: process (embedded), QEMU, Firecracker, Cloud Hypervisor.
// The node's state machine and idle policy only talk to this interface; which of the two suspend tiers a
// sandbox can reach depends on capabilities().
//
// Threading and callbacks: every call runs on the node's libuv loop thread. Asynchronous operations complete
// by invoking their callback later from that loop, never before the call that started them returns, so the
// caller may update its own state after starting an operation. A driver destroyed with operations in flight
// drops their callbacks (their owners are being torn down too). At most one of start / pause / resume /
// hibernate / restore is in flight per sandbox at a time (the node serialises them); terminate may overtake
// any of them except start (the node waits for a start to settle before terminating).
//
// Tiers: `pause` keeps the instance's memory resident (wakes in milliseconds); `hibernate` writes the paused
// instance's state to a file under RuntimeInfo::sandbox_dir and ends the instance so its memory is freed
// (wakes in ~100s of ms through `restore`). A hibernated sandbox has no live instance: its RuntimeInfo (pid 0,
// driver_data naming the state file) is all that is left, and it is persisted by the node.
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "noderuntime/sandbox.h"
#include "snapshot/checkpointer.h"
#include "snapshot/snapshot_store.h"

namespace sg {

struct DriverCapabilities {
  bool pause = false;      // pause()/resume(): memory tier
  bool hibernate = false;  // hibernate()/restore(): disk tier (requires pause)
  bool disk_limit = false; // enforces spec.disk_mb (so the node's default_disk_mb applies to its sandboxes)
  bool memory_checkpoint = false;  // checkpoint_memory(), and start() from a memory snapshot's files
  // checkpoint_disk(), and start() on a filesystem snapshot's disk: the filesystem checkpoints of a VM whose
  // root is a disk (the others take theirs from checkpoint_source()).
  bool disk_checkpoint = false;
};

// What a driver sees when it looks at an instance (used to reconcile after a node restart).
struct ObservedInstance {
  bool alive = false;       // the instance (process tree / VM) exists and is the one we started
  bool paused = false;      // alive and paused right now
  bool hibernated = false;  // not alive, but a complete saved state exists that restore() can start from
  // Alive, but not as the recorded runtime says: a restore the node was killed in, after its instance ran.
  // The record takes this runtime before the instance is adopted.
  std::optional<RuntimeInfo> runtime;
};

// How the proxy reaches a guest port through the socket open_socket() returns.
struct GuestSocket {
  UniqueFd fd;  // non-blocking, close-on-exec
  // true: already connected to the guest port (e.g. a vsock stream through a hypervisor's unix socket); the
  // proxy uses it as it is. false: an unconnected TCP socket the proxy connects to 127.0.0.1:connect_port.
  bool connected = false;
  // The port to connect to. Equal to the guest port when the socket lives in the sandbox's own network
  // namespace (process driver); a host port forwarded to the guest port otherwise (QEMU user networking).
  uint16_t connect_port = 0;
};

// What a filesystem checkpoint (snapshot/checkpointer.h) reads of a running instance: its writable layer,
// the layers under it, and how to hold it still. The freezer may be used from another thread.
struct CheckpointSource {
  std::string upper_dir;
  snapshot::IdShift shift;
  std::vector<std::string> base_layers;
  std::unique_ptr<snapshot::Freezer> freezer;
  // What upper_dir needs until the checkpoint ends (a disk_mb sandbox's: the mount it lies in).
  std::shared_ptr<void> hold;
};

// What a VM's checkpoint wrote into its directory: a memory checkpoint kMemoryState (and kMemoryRam), and
// kSnapshotDisk when the VM has a disk; a disk checkpoint kSnapshotDisk alone.
struct VmCheckpoint {
  uint64_t state_bytes = 0;  // device state only when the RAM is saved apart (ram_bytes > 0)
  uint64_t ram_bytes = 0;    // the RAM file's allocated bytes (0: the RAM pages are in the state)
  uint64_t disk_bytes = 0;
  double pause_ms = 0;  // how long the guest stood still
  // A disk checkpoint that holds only what changed since an earlier snapshot: that snapshot's id, whose disk
  // this one's disk is an overlay of ("" when it is the sandbox's whole overlay).
  std::string parent{};
};
// Where a disk checkpoint writes: `dir` (empty, made by the caller), which becomes `final_dir` once the
// snapshot `id` is recorded. A later checkpoint's disk may name its disk there as its backing file.
struct CheckpointFiles {
  std::string id;
  std::string dir;
  std::string final_dir;
  // How many of a sandbox's own checkpoint disks a chain of deltas may hold before a checkpoint copies its
  // whole overlay again (node.checkpoint_flatten_layers). A sandbox made from a snapshot starts its chain on
  // top of that snapshot's.
  uint32_t max_chain = 32;
};
inline constexpr const char* kMemoryState = "state";
// Where the instance a VM checkpoint saves stands: running (stood still only meanwhile), paused in memory
// (saved as it stands, left paused), or hibernated to disk (its saved files copied; nothing runs).
enum class CheckpointFrom { kRunning, kPaused, kHibernated };
inline constexpr const char* kSnapshotDisk = snapshot::kDiskFile;
inline constexpr const char* kMemoryRam = "ram";  // the guest's RAM as a file, when saved apart from the state

class Driver {
 public:
  using Done = std::function<void(Status)>;
  // start/hibernate/restore hand back the RuntimeInfo to persist from then on.
  using RuntimeDone = std::function<void(Result<RuntimeInfo>)>;
  virtual ~Driver() = default;

  // "process", "qemu", "firecracker", "cloud-hypervisor": what `--driver` names and the API reports.
  virtual std::string_view name() const = 0;
  virtual DriverCapabilities capabilities() const = 0;

  // Starts the sandbox's command. `done` gets the running instance's RuntimeInfo (sandbox_dir included) once
  // it is ready to serve its ports' connections at the transport level (a VM has booted its kernel and init),
  // or a failure after which nothing of the instance is left running. A driver may retry internally (a VM
  // whose boot stalls), within its own bounded deadline.
  virtual void start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) = 0;
  // Memory tier. `done` gets ok once the instance is fully paused / running again. A failed pause leaves the
  // instance running.
  virtual void pause(const SandboxSpec& spec, const RuntimeInfo& info, Done done) = 0;
  virtual void resume(const SandboxSpec& spec, const RuntimeInfo& info, Done done) = 0;
  // Disk tier (only with capabilities().hibernate). Called on a paused instance. On success the instance is
  // gone, its memory is freed, its exit watch (watch_exit) has ended without firing, and `done` gets the
  // RuntimeInfo describing the saved state. On failure the instance is still alive and paused in memory and
  // no saved state of an earlier hibernation is deleted.
  virtual void hibernate(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) = 0;
  // Starts an instance from the saved state `info` describes and leaves it running; `done` gets the new
  // instance's RuntimeInfo (the node then calls watch_exit again). On failure nothing is left running and the
  // saved state is kept, untouched, for a later attempt or for inspection.
  virtual void restore(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) = 0;
  // Asks the pause() or hibernate() in flight for this sandbox to stop early because the sandbox is wanted
  // again. Returns true if the operation will end with a failure that leaves the instance where it was before
  // it began (running for a pause, paused in memory for a hibernate). Even after true, the operation may still
  // complete successfully if it was past the point of no return. Returns false when nothing is in flight or
  // the driver cannot interrupt it; the operation then finishes normally.
  virtual bool cancel(const SandboxSpec& spec) = 0;
  // Kills the whole instance and releases its resources (cgroups, namespaces, VM process, sockets) but keeps
  // the sandbox_dir (the node removes it). Works on hibernated sandboxes too. `done` after it is gone.
  virtual void terminate(const SandboxSpec& spec, const RuntimeInfo& info, Done done) = 0;
  // Calls `on_exit` once when the instance exits by itself (crash, command finished, VM died). Must also work
  // for instances adopted after a node restart (not children of this process).
  virtual Status watch_exit(const SandboxSpec& spec, const RuntimeInfo& info, std::function<void()> on_exit) = 0;
  virtual void unwatch(const SandboxSpec& spec) = 0;
  // Reconcile only (once per sandbox at node start): may block briefly to ask the instance.
  virtual ObservedInstance observe(const SandboxSpec& spec, const RuntimeInfo& info) = 0;
  // A socket through which the proxy reaches `port` of the running instance (see GuestSocket).
  virtual Result<GuestSocket> open_socket(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port) = 0;
  // `count` of them at once (a proxy's spare sockets). A driver that makes them inside a namespace enters it
  // once for all; the default asks open_socket() `count` times.
  virtual Result<std::vector<GuestSocket>> open_sockets(const SandboxSpec& spec, const RuntimeInfo& info,
                                                        uint16_t port, size_t count) {
    std::vector<GuestSocket> sockets;
    sockets.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      auto socket = open_socket(spec, info, port);
      if (!socket) return socket.failure();
      sockets.push_back(std::move(*socket));
    }
    return sockets;
  }
  // The network namespace open_sockets() makes its sockets in (a descriptor of its own), handed to the proxy
  // with its spares so that its socket maker can make more while the node is down (proxy/socket_maker.h).
  // kUnsupported (the default): the driver's sockets live in no namespace of the instance's own.
  virtual Result<UniqueFd> socket_namespace(const SandboxSpec& spec, const RuntimeInfo&) {
    return fail(Error::kUnsupported, "the " + spec.driver + " driver has no network namespace of the instance's");
  }
  // Filesystem checkpoints of a running instance; kUnsupported (the default) for a driver that has none.
  virtual Result<CheckpointSource> checkpoint_source(const SandboxSpec& spec, const RuntimeInfo&) {
    return fail(Error::kUnsupported, "the " + spec.driver + " driver cannot take filesystem checkpoints yet");
  }
  // Memory checkpoints (capabilities().memory_checkpoint): saves the instance's devices, RAM and disk into
  // `dir` (empty, made by the caller). A running instance stands still only meanwhile and runs again
  // afterwards, whatever the outcome; a paused one (the memory tier) is saved as it stands and stays paused;
  // a hibernated one's saved state is copied (a driver that cannot: kConflict, resume it first). Serialised
  // with the other operations like them (the node holds suspends and wakes back).
  // start() with spec.memory_snapshot_dir set starts an instance from such a directory instead of booting:
  // its processes continue where they were, under the new spec's identity.
  virtual void checkpoint_memory(const SandboxSpec& spec, const RuntimeInfo&, const CheckpointFiles&, CheckpointFrom,
                                 std::function<void(Result<VmCheckpoint>)> done) {
    done(fail(Error::kUnsupported, "the " + spec.driver + " driver cannot save running processes"));
  }
  // Filesystem checkpoints of a VM booted on a disk (capabilities().disk_checkpoint): writes its disk as it
  // stands into files.dir (kSnapshotDisk), with the guest's writes flushed first where the guest can be asked
  // to: what changed since the sandbox's last disk checkpoint as an overlay of that one's disk where the
  // driver can (VmCheckpoint::parent), its whole overlay otherwise. Where the instance stands as for
  // checkpoint_memory(); a VM with no disk: kUnsupported. start() with spec.snapshot_disk set then boots a
  // new VM on an overlay of it.
  virtual void checkpoint_disk(const SandboxSpec& spec, const RuntimeInfo&, const CheckpointFiles&, CheckpointFrom,
                               std::function<void(Result<VmCheckpoint>)> done) {
    done(fail(Error::kUnsupported, "the " + spec.driver + " driver cannot checkpoint a VM's disk"));
  }
  // A port exposed after start (not in `spec.exposed_ports` yet): makes open_socket() reach it in the live
  // instance, running or paused; a later start or restore forwards it from the spec. Drivers whose sockets
  // reach any guest port (a network namespace, vsock) need nothing: the default. `done` may run before this
  // returns.
  virtual void forward_port(const SandboxSpec& /*spec*/, const RuntimeInfo&, uint16_t /*port*/, Done done) {
    done({});
  }
  // The node's registered SSH keys changed (docs/ssh.md): a driver whose guests cannot read the node's
  // key file themselves tells the live instance. Best effort; a later start, resume or restore tells it
  // again. Drivers whose sandboxes see the file (a bind mount) need nothing: the default.
  virtual void ssh_keys_changed(const SandboxSpec& /*spec*/, const RuntimeInfo& /*info*/) {}
  // The reverse, best effort, after the port left the spec (the node refuses it from then on either way).
  virtual void unforward_port(const SandboxSpec& /*spec*/, const RuntimeInfo&, uint16_t /*port*/, Done done) {
    done({});
  }
};

}  // namespace sg
