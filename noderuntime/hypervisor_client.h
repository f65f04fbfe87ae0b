// What the Firecracker and Cloud Hypervisor drivers share: HTTP/1.1 requests to a VMM's API on its unix
// socket, asynchronous on a libuv loop and parsed with sg::HttpParser; the VMM process itself (spawn,
// pidfd-based exit watch, kill); the hybrid-vsock connect both VMMs implement; and VmmDriver, the part of the
// Driver interface that does not depend on which VMM it is. Both hypervisors serve exactly one VM per process,
// so a driver talks to one socket and one process per sandbox.
//
// One connection per request ("Connection: close"): the APIs are low-rate control planes, and a fresh
// connection means a request that timed out can never leave a late answer in front of the next one.
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "noderuntime/driver.h"

namespace sg {

struct HypervisorResponse {
  int status = 0;
  std::string body;
};

struct HypervisorClientOptions {
  // Bounds one whole exchange: connect, send, and the complete answer.
  uint32_t timeout_ms = 5000;
  // How long a request keeps retrying while the socket does not exist yet or refuses connections, which is
  // normal for a VMM spawned a moment ago. 0: report an absent VMM at once.
  uint32_t connect_wait_ms = 0;
  // Caps an answer (these APIs answer with a few KiB of JSON at most).
  size_t max_response_bytes = 1024 * 1024;
};

class HypervisorClient {
 public:
  using Callback = std::function<void(Result<HypervisorResponse>)>;

  // `peer` names the VMM in error messages ("firecracker", "cloud-hypervisor").
  HypervisorClient(uv_loop_t* loop, std::string socket_path, std::string peer, HypervisorClientOptions options);
  // Cancels the requests in flight: their callbacks never run.
  ~HypervisorClient();
  HypervisorClient(const HypervisorClient&) = delete;
  HypervisorClient& operator=(const HypervisorClient&) = delete;

  // Sends `method path` with `body` (JSON; no body when empty). `done` runs exactly once, on the loop and
  // never before request() returns, with the answer whatever its status (callers map statuses to failures),
  // or with kUnavailable (cannot connect, connection closed before a complete answer, malformed answer),
  // kTimeout, or kIo.
  void request(std::string_view method, std::string_view path, std::string body, Callback done);
  // Delivers `failure` to `done` from the loop, as request() would: for arguments rejected before sending.
  void reject(Failure failure, Callback done);

 private:
  class Request;
  friend class Request;
  void finished(Request* request, Result<HypervisorResponse> result);

  uv_loop_t* loop_;
  std::string socket_path_;
  std::string peer_;
  HypervisorClientOptions options_;
  std::list<std::unique_ptr<Request>> requests_;
};

// Runs `op` on a private loop until it calls its completion, for the synchronous parts of the Driver
// interface (start). The node's loop is blocked meanwhile, for as long as `op` takes (bounded by the
// clients' timeouts), so this is only for operations that take milliseconds on a healthy VMM. `op` returns
// what must stay alive while it runs (its API clients); that is destroyed before the private loop closes.
Status run_on_private_loop(
    const std::function<std::shared_ptr<void>(uv_loop_t*, std::function<void(Status)>)>& op);

// A VMM process: spawned by a driver, or adopted after a node restart by pid plus start time (which tells it
// apart from an unrelated process that reused the pid).
struct VmmProcess {
  int pid = 0;
  uint64_t start_time_ticks = 0;
};

// How a VMM process starts besides its arguments.
struct VmmSpawnOptions {
  std::string cwd;                // empty: the node's
  bool batch_scheduling = false;  // SCHED_BATCH (node.batch_scheduling), for every thread it will have
};

// Starts `binary args...` in its own session, stdout and stderr appended to `log_path`, so the VMM outlives
// a node restart like every other sandbox. kUnsupported "<peer> binary not found at <binary>" when there is
// no executable there.
Result<VmmProcess> spawn_vmm(std::string_view peer, const std::string& binary, const std::vector<std::string>& args,
                             const std::string& log_path, const VmmSpawnOptions& options = {});
// A file's size, or with `allocated` the bytes its blocks take (a memory file is sparse where the guest's RAM
// is zero); 0 when it cannot be read. What a memory checkpoint reports of the files it wrote.
uint64_t file_bytes(const std::string& path, bool allocated);
// True while `process` is alive (not a zombie) and still the same process.
bool vmm_alive(const VmmProcess& process);
// The live process holding a write lock on `pidfile` (QEMU's -pidfile keeps one for as long as it runs), or
// nullopt: no file, no lock, or a holder that is gone. How a VMM the node started but never recorded (the
// node was killed in between) is found again.
std::optional<VmmProcess> pidfile_holder(const std::string& pidfile);
// SIGKILL to `process` if it is still the same process (a pidfd makes this race-free against pid reuse).
Status kill_vmm(const VmmProcess& process);

// Calls `on_exit` once, on the loop, when `process` has exited (or from the loop right away if it already
// had), and reaps it if it is our child. Destroying the watch cancels it.
class VmmExitWatch {
 public:
  static Result<std::unique_ptr<VmmExitWatch>> start(uv_loop_t* loop, const VmmProcess& process,
                                                     std::function<void()> on_exit);
  ~VmmExitWatch();
  VmmExitWatch(const VmmExitWatch&) = delete;
  VmmExitWatch& operator=(const VmmExitWatch&) = delete;

 private:
  VmmExitWatch() = default;
  void fire();

  UniqueFd pidfd_;
  uv_poll_t* poll_ = nullptr;   // heap-allocated, freed in its close callback
  uv_timer_t* gone_ = nullptr;  // the process had exited before the watch began
  std::function<void()> on_exit_;
};

// Connects to guest vsock `port` through a VMM's hybrid-vsock unix socket (Firecracker's protocol, which
// Cloud Hypervisor implements too): "CONNECT <port>\n", answered "OK <host port>\n". Blocks up to `timeout_ms`;
// the returned socket is connected, non-blocking and close-on-exec.
Result<UniqueFd> vsock_connect(const std::string& uds_path, uint16_t port, int timeout_ms);

struct VmmDriverOptions {
  std::string binary;           // the VMM executable
  HypervisorClientOptions api;  // every API request; connect_wait_ms is raised for a freshly spawned VMM
  uint32_t spawn_connect_wait_ms = 3000;  // how long a new VMM may take to create its API socket
  uint32_t exit_wait_ms = 5000;           // how long a killed VMM may take to be gone
  uint32_t vsock_connect_timeout_ms = 1000;
  // node.batch_scheduling: a guest's vCPU, woken by a packet the proxy wrote, does not preempt the proxy.
  bool batch_scheduling = true;
};

// The VMM-independent half of a microVM driver. Subclasses sequence API calls as Steps; an operation owns its
// API client, so destroying the driver cancels every callback. Failure -> sandbox state, as the Driver
// contract wants it (the subclasses' headers list their API calls per step):
//   start fails (spawn, configure, boot)   -> the VMM is killed and reaped; the node marks the sandbox failed
//   pause fails                            -> the VM keeps running (running)
//   resume fails                           -> still paused in memory (suspended, memory tier); VMM dead -> failed
//   hibernate fails or is cancelled before the VMM is killed
//                                          -> still paused in memory; the half-written new state is removed, an
//                                             earlier saved state is untouched (suspended, memory tier)
//   restore fails                          -> the new VMM is killed; the saved state is kept (suspended, disk tier)
//   terminate                              -> always ends with the VMM gone (SIGKILL after the graceful step)
class VmmDriver : public Driver {
 public:
  VmmDriver(uv_loop_t* loop, std::string peer, VmmDriverOptions options);
  ~VmmDriver() override;

  // Every VMM driver saves running guests: QEMU by migration, Firecracker and Cloud Hypervisor by their
  // snapshot APIs (checkpoint_paused).
  DriverCapabilities capabilities() const override {
    return {.pause = true, .hibernate = true, .memory_checkpoint = true};
  }
  bool cancel(const SandboxSpec& spec) override;
  void terminate(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override;
  Status watch_exit(const SandboxSpec& spec, const RuntimeInfo& info, std::function<void()> on_exit) override;
  void unwatch(const SandboxSpec& spec) override;
  ObservedInstance observe(const SandboxSpec& spec, const RuntimeInfo& info) override;
  Result<GuestSocket> open_socket(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port) override;

  // driver_data keys (persisted by the node).
  static constexpr const char* kApiSocket = "api_socket";
  static constexpr const char* kVsockSocket = "vsock_socket";
  static constexpr const char* kStateDir = "state_dir";  // the saved state of the last hibernation

 protected:
  // An operation in flight for one sandbox. Steps run one after another from the loop; each gets the op and
  // a completion. The op owns what its callbacks reach (`api`), so dropping it cancels them.
  struct Op {
    std::string sandbox_id;
    std::string what;  // "starting", "pausing", ... for messages
    bool terminate = false;
    bool superseded = false;        // a terminate() took over: stop at the next step
    bool cancel_requested = false;  // cancel() was called
    bool cancellable = false;       // cancel() may stop it (until the point of no return)
    RuntimeInfo info;               // what start/hibernate/restore hand back; the instance being worked on
    VmmProcess process;             // the VMM this op spawned or works on
    bool spawned = false;           // `process` was spawned by this op (killed again if the op fails)
    std::shared_ptr<void> api;
    std::unique_ptr<VmmExitWatch> exit_wait;
    uv_timer_t* timer = nullptr;    // runs the first step from the loop; bounds waits for an exit
    std::function<void()> timer_fn;
  };
  using StepDone = std::function<void(Status)>;
  using Step = std::function<void(Op*, StepDone)>;

  // Runs `steps`; on the first failure runs `on_failure` (cleanup; its own result is ignored), then `finish`.
  void run(std::unique_ptr<Op> op, std::vector<Step> steps, Step on_failure, std::function<void(Op*, Status)> finish);
  std::unique_ptr<Op> new_op(const SandboxSpec& spec, std::string what, const RuntimeInfo& info);

  // A memory checkpoint through the VMM's API: `pause`, `save`, `resume`, and `resume` again (unchecked) when
  // anything failed, so the guest runs on whatever the outcome. pause_ms is from the pause to the resume's
  // answer; `sizes` gives the byte counts of what `save` wrote. `paused`: the VM is suspended in memory
  // already, so it is only saved, and stays paused.
  // What a memory checkpoint of a hibernated VM is for a driver that does not copy its saved state.
  static Failure hibernated_refusal(const SandboxSpec& spec) {
    return fail(Error::kConflict, "the " + spec.driver + " driver cannot checkpoint sandbox " + spec.id +
                                      " while it is in the disk tier; resume it first");
  }
  void checkpoint_paused(const SandboxSpec& spec, const RuntimeInfo& info, bool paused, Step pause, Step save,
                         Step resume, std::function<VmCheckpoint()> sizes,
                         std::function<void(Result<VmCheckpoint>)> done);
  // Step: spawns the VMM with `args` (the API socket in op->info.driver_data[kApiSocket] is removed first).
  Step spawn_step(std::vector<std::string> args);
  // Step: SIGKILL to op->process and wait (bounded by exit_wait_ms) until it is gone.
  Step kill_step();
  // Options for API clients: connect_wait raised right after a spawn.
  HypervisorClientOptions api_options(bool just_spawned) const;
  // A saved state's directory name inside the sandbox dir; a hibernation writes the ".new" one first.
  static std::string state_dir(const std::string& sandbox_dir) { return sandbox_dir + "/saved-state"; }
  static std::string new_state_dir(const std::string& sandbox_dir) { return sandbox_dir + "/saved-state.new"; }
  // Step: replaces the saved state with the freshly written one (the point after which it counts).
  Step commit_state_step();
  // Step: ends a hibernation that cancel() asked to stop, before the VMM is killed (it stays paused in
  // memory); past it the hibernation can no longer be cancelled.
  static Step cancel_point_step();
  // Ends the exit watch of a sandbox without firing it (an exit the driver causes itself).
  void stop_watch(const std::string& sandbox_id) { watches_.erase(sandbox_id); }
  // Cleanup for a failed hibernation: removes only the half-written new state.
  static void discard_new_state(const std::string& sandbox_dir);

  // The VMM's graceful stop before terminate's SIGKILL (Cloud Hypervisor: vm.shutdown); failures ignored.
  virtual void graceful_stop(Op* op, StepDone done) = 0;
  // Reconcile: asks the live VMM (blocking, bounded by the API timeout) whether its VM is paused.
  virtual Result<bool> query_paused(const RuntimeInfo& info) = 0;

  Op* in_flight(const std::string& sandbox_id);

  uv_loop_t* loop_;
  std::string peer_;
  VmmDriverOptions options_;

 private:
  void next(Op* op);
  void end(Op* op, Status status);
  void start_timer(Op* op, uint64_t ms, std::function<void()> fn);

  struct Run;
  std::map<Op*, std::unique_ptr<Run>> runs_;
  std::map<std::string, std::unique_ptr<VmmExitWatch>> watches_;
};

}  // namespace sg
