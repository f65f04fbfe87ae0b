// The Firecracker driver: a typed client for Firecracker's API (../shared/specs/firecracker.yaml, Swagger
// 2.0) and the Driver that sequences it. Verified against that specification by a fake that serves it
// (tests/unit/node/fake_hypervisor.*), not against a running Firecracker: the binary is not installable here.
//
// Sequences (every call a request on the VMM's --api-sock):
//   start     = spawn `firecracker --api-sock <dir>/firecracker.sock`, PUT /machine-config, PUT /boot-source,
//               PUT /drives/rootfs (when a rootfs is configured), PUT /network-interfaces/eth0 (when a tap is
//               configured), PUT /vsock, PUT /actions {InstanceStart}
//   pause     = PATCH /vm {Paused};   resume = PATCH /vm {Resumed}
//   hibernate = PATCH /vm {Paused}, PUT /snapshot/create {Full} into <dir>/saved-state.new, commit, SIGKILL
//   restore   = spawn, PUT /snapshot/load {mem_backend File, resume_vm true}
//   terminate = SIGKILL (Firecracker has no shutdown call; SendCtrlAltDel needs guest cooperation)
//   observe   = GET / (InstanceInfo.state)
// The guest's memory file stays in <dir>/saved-state after a restore: a File backend maps it privately.
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

// Firecracker answers errors with {"fault_message": "..."} (definitions/Error). 400 (bad input or an
// operation the VM's state does not allow) -> kInvalidArgument; anything else ("default", 500) -> kInternal.
// The message names the request and carries fault_message verbatim.
Failure firecracker_failure(std::string_view request, const HypervisorResponse& response);

struct FcMachineConfig {
  int vcpu_count = 1;  // 1..32
  int mem_size_mib = 128;
  bool smt = false;
  bool track_dirty_pages = false;  // needed for Diff snapshots
};
struct FcBootSource {
  std::string kernel_image_path;
  std::string boot_args;    // omitted when empty
  std::string initrd_path;  // omitted when empty
};
struct FcDrive {
  std::string drive_id;  // also the path parameter: [A-Za-z0-9_]+
  std::string path_on_host;
  bool is_root_device = false;
  bool is_read_only = false;
};
struct FcNetworkInterface {
  std::string iface_id;  // also the path parameter: [A-Za-z0-9_]+
  std::string host_dev_name;
  std::string guest_mac;  // omitted when empty
};
struct FcVsock {
  uint32_t guest_cid = 3;  // >= 3
  std::string uds_path;
};
enum class FcSnapshotType { kFull, kDiff };
struct FcSnapshotCreate {
  std::string snapshot_path;
  std::string mem_file_path;
  FcSnapshotType type = FcSnapshotType::kFull;
};
enum class FcMemBackend { kFile, kUffd };
struct FcSnapshotLoad {
  std::string snapshot_path;
  FcMemBackend backend = FcMemBackend::kFile;
  std::string backend_path;  // the memory file (File) or the page-fault handler's socket (Uffd)
  bool resume_vm = true;
  bool enable_diff_snapshots = false;
};

// One method per operation. `done` runs once from the loop (never before the call returns); destroying the
// object cancels what is in flight.
class FirecrackerApi {
 public:
  using Done = std::function<void(Status)>;
  FirecrackerApi(uv_loop_t* loop, std::string socket_path, HypervisorClientOptions options);

  void put_machine_config(const FcMachineConfig& c, Done done);
  void put_boot_source(const FcBootSource& b, Done done);
  void put_drive(const FcDrive& d, Done done);
  void put_network_interface(const FcNetworkInterface& n, Done done);
  void put_vsock(const FcVsock& v, Done done);
  void instance_start(Done done);
  void pause(Done done);
  void resume(Done done);
  void create_snapshot(const FcSnapshotCreate& s, Done done);
  void load_snapshot(const FcSnapshotLoad& l, Done done);
  // GET /: InstanceInfo.state ("Not started", "Running", "Paused").
  void instance_state(std::function<void(Result<std::string>)> done);

 private:
  void send(std::string_view method, std::string path, std::string body, Done done);
  HypervisorClient client_;
};

struct FirecrackerConfig {
  std::string binary = "/usr/local/bin/firecracker";
  std::string kernel_image_path;
  std::string initrd_path;  // optional
  std::string rootfs_path;  // optional: the root block device
  std::string boot_args = "console=ttyS0 reboot=k panic=1 pci=off";
  std::string tap_device;  // optional: a host tap for eth0
  HypervisorClientOptions api;
  uint32_t spawn_connect_wait_ms = 3000;
  uint32_t exit_wait_ms = 5000;
  bool batch_scheduling = true;  // node.batch_scheduling (VmmDriverOptions)
};

std::unique_ptr<Driver> make_firecracker_driver(uv_loop_t* loop, FirecrackerConfig config);

}  // namespace sg
