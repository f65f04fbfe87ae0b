// The interface every sandbox driver implements (process today; QEMU, Firecracker, Cloud Hypervisor later).
// The node's state machine and idle policy only talk to this interface. All calls run on the node's libuv
// loop thread. Asynchronous operations complete by invoking their callback later from that loop (never
// before the call returns), so callers may update their own state after starting an operation.
#pragma once

#include <uv.h>

#include <functional>
#include <string>

#include "common/error.h"
#include "common/fd.h"
#include "noderuntime/sandbox.h"

namespace sg {

struct DriverCapabilities {
  bool pause = false;      // suspend with memory kept resident (fast tier)
  bool hibernate = false;  // suspend to disk (slow tier); none yet
};

// What a driver sees when it looks at an instance (used to reconcile after a node restart).
struct ObservedInstance {
  bool alive = false;   // the instance (process tree / VM) exists and is the one we started
  bool paused = false;  // frozen / paused right now
};

class Driver {
 public:
  using Done = std::function<void(Status)>;
  virtual ~Driver() = default;

  virtual std::string_view name() const = 0;
  virtual DriverCapabilities capabilities() const = 0;

  // Starts the sandbox's command. On success the instance is running and its RuntimeInfo is returned.
  // Synchronous: starting a process tree takes milliseconds.
  virtual Result<RuntimeInfo> start(const SandboxSpec& spec, const std::string& sandbox_dir) = 0;
  // Freeze / thaw. `done` gets ok once the instance is fully paused / running again.
  virtual void pause(const SandboxSpec& spec, const RuntimeInfo& info, Done done) = 0;
  virtual void resume(const SandboxSpec& spec, const RuntimeInfo& info, Done done) = 0;
  // Kills the whole instance and releases its resources (cgroups, namespaces). `done` after it is gone.
  virtual void terminate(const SandboxSpec& spec, const RuntimeInfo& info, Done done) = 0;
  // Calls `on_exit` once when the instance exits by itself (crash, command finished). Must also work for
  // instances adopted after a node restart (not children of this process).
  virtual Status watch_exit(const SandboxSpec& spec, const RuntimeInfo& info, std::function<void()> on_exit) = 0;
  virtual void unwatch(const SandboxSpec& spec) = 0;
  virtual ObservedInstance observe(const SandboxSpec& spec, const RuntimeInfo& info) = 0;
  // A TCP socket (non-blocking, close-on-exec, not yet connected) that lives in the sandbox's network
  // namespace: connecting it to 127.0.0.1:<port> reaches the sandbox's own loopback.
  virtual Result<UniqueFd> open_socket(const SandboxSpec& spec, const RuntimeInfo& info) = 0;
};

}  // namespace sg
