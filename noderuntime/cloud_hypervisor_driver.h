// The Cloud Hypervisor driver: a typed client for its REST API (../shared/specs/cloud-hypervisor.yaml,
// OpenAPI 3.0, served under /api/v1) and the Driver that sequences it. Verified against that specification
// by a fake that serves it (tests/unit/node/fake_hypervisor.*), not against a running Cloud Hypervisor: the
// binary is not installable here.
//
// Sequences (every call a request on the VMM's --api-socket):
//   start     = spawn `cloud-hypervisor --api-socket <dir>/cloud-hypervisor.sock`, PUT vm.create (VmConfig),
//               PUT vm.boot
//   pause     = PUT vm.pause;   resume = PUT vm.resume
//   hibernate = PUT vm.pause, PUT vm.snapshot {destination_url file://<dir>/saved-state.new}, commit, SIGKILL
//   restore   = spawn, PUT vm.restore {source_url file://<dir>/saved-state}, PUT vm.resume (a restored VM
//               comes up paused)
//   terminate = PUT vm.shutdown (best effort, so the guest's devices are flushed), SIGKILL
//   observe   = GET vm.info (VmInfo.state)
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/error.h"
#include "noderuntime/driver.h"
#include "noderuntime/hypervisor_client.h"

namespace sg {

// The spec defines no error body for Cloud Hypervisor (its responses have descriptions only); the server
// sends the error chain as text, which becomes the message verbatim. 400 (a body it cannot use) ->
// kInvalidArgument; 404 (no VM created) and 405 (the VM is in the wrong state) -> kConflict; 5xx and anything
// else -> kInternal.
Failure cloud_hypervisor_failure(std::string_view request, const HypervisorResponse& response);

struct ChVmConfig {
  uint32_t vcpus = 1;
  uint64_t memory_bytes = 512ull << 20;
  std::string kernel;
  std::string cmdline;    // omitted when empty
  std::string initramfs;  // omitted when empty
  std::string rootfs;     // a disk "rootfs" when set
  std::string tap;        // a net device "eth0" when set
  uint64_t vsock_cid = 3;
  std::string vsock_socket;  // a vsock device when set
  std::string serial_file;   // serial console to this file when set (otherwise "Null")
};

// One method per operation. `done` runs once from the loop (never before the call returns); destroying the
// object cancels what is in flight.
class CloudHypervisorApi {
 public:
  using Done = std::function<void(Status)>;
  CloudHypervisorApi(uv_loop_t* loop, std::string socket_path, HypervisorClientOptions options);

  void create(const ChVmConfig& c, Done done);
  void boot(Done done);
  void pause(Done done);
  void resume(Done done);
  void snapshot(const std::string& destination_url, Done done);
  void restore(const std::string& source_url, bool prefault, Done done);
  void shutdown(Done done);
  // GET vm.info: VmInfo.state ("Created", "Running", "Shutdown", "Paused").
  void state(std::function<void(Result<std::string>)> done);

 private:
  void send(std::string op, std::string body, Done done);
  HypervisorClient client_;
};

struct CloudHypervisorConfig {
  std::string binary = "/usr/local/bin/cloud-hypervisor";
  std::string kernel;
  std::string cmdline = "console=ttyS0 reboot=k panic=1";
  std::string initramfs;  // optional
  std::string rootfs;     // optional
  std::string tap;        // optional
  HypervisorClientOptions api;
  uint32_t spawn_connect_wait_ms = 3000;
  uint32_t exit_wait_ms = 5000;
  bool batch_scheduling = true;  // node.batch_scheduling (VmmDriverOptions)
};

std::unique_ptr<Driver> make_cloud_hypervisor_driver(uv_loop_t* loop, CloudHypervisorConfig config);

}  // namespace sg
