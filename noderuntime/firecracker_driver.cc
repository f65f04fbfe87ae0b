#include "noderuntime/firecracker_driver.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/http.h"

namespace sg {
namespace {

using json = nlohmann::json;

// Firecracker's own rule for resource ids in paths (drive_id, iface_id): alphanumeric and '_'. Checked here
// so a bad id is a clear error instead of a request to a path the API does not have.
bool valid_id(std::string_view id) {
  return !id.empty() && id.size() <= 64 &&
         std::all_of(id.begin(), id.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

constexpr const char* kSocketName = "firecracker.sock";
constexpr const char* kVsockName = "vsock.sock";
constexpr const char* kSnapshotFile = "vmstate";
constexpr const char* kMemoryFile = "memory";

}  // namespace

Failure firecracker_failure(std::string_view request, const HypervisorResponse& response) {
  json body = json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  std::string detail;
  if (body.is_object() && body.contains("fault_message") && body["fault_message"].is_string())
    detail = body["fault_message"].get<std::string>();
  else
    detail = response.body.empty() ? "(no fault_message)" : response.body;
  std::string msg = "firecracker: " + std::string(request) + " failed (" + std::to_string(response.status) + " " +
                    std::string(http_reason(response.status)) + "): " + detail;
  return fail(response.status == 400 ? Error::kInvalidArgument : Error::kInternal, std::move(msg));
}

FirecrackerApi::FirecrackerApi(uv_loop_t* loop, std::string socket_path, HypervisorClientOptions options)
    : client_(loop, std::move(socket_path), "firecracker", options) {}

void FirecrackerApi::send(std::string_view method, std::string path, std::string body, Done done) {
  std::string what = std::string(method) + " " + path;
  client_.request(method, path, std::move(body), [what, done = std::move(done)](Result<HypervisorResponse> r) {
    if (!r) return done(r.failure());
    // Every operation the driver uses answers 204 on success (the spec defines no other 2xx for them).
    if (r->status / 100 != 2) return done(firecracker_failure(what, *r));
    done({});
  });
}

void FirecrackerApi::put_machine_config(const FcMachineConfig& c, Done done) {
  json b = {{"vcpu_count", c.vcpu_count},
            {"mem_size_mib", c.mem_size_mib},
            {"smt", c.smt},
            {"track_dirty_pages", c.track_dirty_pages}};
  send("PUT", "/machine-config", b.dump(), std::move(done));
}

void FirecrackerApi::put_boot_source(const FcBootSource& s, Done done) {
  json b = {{"kernel_image_path", s.kernel_image_path}};
  if (!s.boot_args.empty()) b["boot_args"] = s.boot_args;
  if (!s.initrd_path.empty()) b["initrd_path"] = s.initrd_path;
  send("PUT", "/boot-source", b.dump(), std::move(done));
}

void FirecrackerApi::put_drive(const FcDrive& d, Done done) {
  if (!valid_id(d.drive_id)) {
    return client_.reject(fail(Error::kInvalidArgument, "firecracker: bad drive_id '" + d.drive_id + "'"),
                          [done = std::move(done)](Result<HypervisorResponse> r) { done(r.failure()); });
  }
  json b = {{"drive_id", d.drive_id},
            {"path_on_host", d.path_on_host},
            {"is_root_device", d.is_root_device},
            {"is_read_only", d.is_read_only}};
  send("PUT", "/drives/" + d.drive_id, b.dump(), std::move(done));
}

void FirecrackerApi::put_network_interface(const FcNetworkInterface& n, Done done) {
  if (!valid_id(n.iface_id)) {
    return client_.reject(fail(Error::kInvalidArgument, "firecracker: bad iface_id '" + n.iface_id + "'"),
                          [done = std::move(done)](Result<HypervisorResponse> r) { done(r.failure()); });
  }
  json b = {{"iface_id", n.iface_id}, {"host_dev_name", n.host_dev_name}};
  if (!n.guest_mac.empty()) b["guest_mac"] = n.guest_mac;
  send("PUT", "/network-interfaces/" + n.iface_id, b.dump(), std::move(done));
}

void FirecrackerApi::put_vsock(const FcVsock& v, Done done) {
  // vsock_id is deprecated in the spec, so it is never sent.
  json b = {{"guest_cid", v.guest_cid}, {"uds_path", v.uds_path}};
  send("PUT", "/vsock", b.dump(), std::move(done));
}

void FirecrackerApi::instance_start(Done done) {
  send("PUT", "/actions", json{{"action_type", "InstanceStart"}}.dump(), std::move(done));
}

void FirecrackerApi::pause(Done done) { send("PATCH", "/vm", json{{"state", "Paused"}}.dump(), std::move(done)); }

void FirecrackerApi::resume(Done done) { send("PATCH", "/vm", json{{"state", "Resumed"}}.dump(), std::move(done)); }

void FirecrackerApi::create_snapshot(const FcSnapshotCreate& s, Done done) {
  json b = {{"snapshot_path", s.snapshot_path},
            {"mem_file_path", s.mem_file_path},
            {"snapshot_type", s.type == FcSnapshotType::kFull ? "Full" : "Diff"}};
  send("PUT", "/snapshot/create", b.dump(), std::move(done));
}

void FirecrackerApi::load_snapshot(const FcSnapshotLoad& l, Done done) {
  // mem_backend, never the deprecated mem_file_path: the spec allows exactly one of the two.
  json b = {{"snapshot_path", l.snapshot_path},
            {"mem_backend",
             {{"backend_type", l.backend == FcMemBackend::kFile ? "File" : "Uffd"}, {"backend_path", l.backend_path}}},
            {"enable_diff_snapshots", l.enable_diff_snapshots},
            {"resume_vm", l.resume_vm}};
  send("PUT", "/snapshot/load", b.dump(), std::move(done));
}

void FirecrackerApi::instance_state(std::function<void(Result<std::string>)> done) {
  client_.request("GET", "/", {}, [done = std::move(done)](Result<HypervisorResponse> r) {
    if (!r) return done(r.failure());
    if (r->status != 200) return done(firecracker_failure("GET /", *r));
    json b = json::parse(r->body, nullptr, false);
    if (!b.is_object() || !b.contains("state") || !b["state"].is_string())
      return done(fail(Error::kUnavailable, "firecracker: GET / answered without a state: " + r->body.substr(0, 200)));
    done(b["state"].get<std::string>());
  });
}

namespace {

class FirecrackerDriver final : public VmmDriver {
 public:
  FirecrackerDriver(uv_loop_t* loop, FirecrackerConfig config)
      : VmmDriver(loop, "firecracker",
                  VmmDriverOptions{.binary = config.binary,
                                   .api = config.api,
                                   .spawn_connect_wait_ms = config.spawn_connect_wait_ms,
                                   .exit_wait_ms = config.exit_wait_ms,
                                   .batch_scheduling = config.batch_scheduling}),
        config_(std::move(config)) {}

  std::string_view name() const override { return "firecracker"; }

  // Paused only for Firecracker's own full snapshot: the device state (`vmstate`) and the guest memory
  // (`memory`) into `dir`, then resumed, whatever the outcome (a VM suspended in memory stays paused).
  void checkpoint_memory(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                         CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) override {
    if (source == CheckpointFrom::kHibernated) return done(hibernated_refusal(spec));
    const std::string& dir = files.dir;
    checkpoint_paused(
        spec, info, source == CheckpointFrom::kPaused, [this](Op* o, StepDone d) { api(o)->pause(std::move(d)); },
        [this, dir](Op* o, StepDone d) {
          api(o)->create_snapshot({.snapshot_path = dir + "/" + kSnapshotFile,
                                   .mem_file_path = dir + "/" + kMemoryFile,
                                   .type = FcSnapshotType::kFull},
                                  std::move(d));
        },
        [this](Op* o, StepDone d) { api(o)->resume(std::move(d)); },
        [dir] {
          return VmCheckpoint{.state_bytes = file_bytes(dir + "/" + kSnapshotFile, false),
                                  .ram_bytes = file_bytes(dir + "/" + kMemoryFile, true)};
        },
        std::move(done));
  }

  void start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) override {
    RuntimeInfo info;
    info.sandbox_dir = sandbox_dir;
    info.driver_data[kApiSocket] = sandbox_dir + "/" + kSocketName;
    info.driver_data[kVsockSocket] = sandbox_dir + "/" + kVsockName;
    if (!spec.memory_snapshot_dir.empty()) return start_from_memory(spec, std::move(info), std::move(done));
    auto op = new_op(spec, "starting", info);
    std::vector<Step> steps;
    steps.push_back([](Op* o, StepDone d) {
      std::error_code ec;
      std::filesystem::create_directories(o->info.sandbox_dir, ec);
      if (ec) return d(fail(Error::kIo, "cannot create " + o->info.sandbox_dir + ": " + ec.message()));
      std::filesystem::remove(o->info.driver_data[kVsockSocket], ec);  // Firecracker binds it itself
      d({});
    });
    steps.push_back(spawn_step({"--api-sock", info.driver_data[kApiSocket]}));
    FcMachineConfig machine{.vcpu_count = std::clamp(static_cast<int>(std::ceil(spec.cpus)), 1, 32),
                            .mem_size_mib = static_cast<int>(spec.memory_mb),
                            .smt = false,
                            .track_dirty_pages = false};
    steps.push_back([this, machine](Op* o, StepDone d) { api(o, true)->put_machine_config(machine, d); });
    steps.push_back([this](Op* o, StepDone d) {
      api(o)->put_boot_source({config_.kernel_image_path, config_.boot_args, config_.initrd_path}, d);
    });
    if (!config_.rootfs_path.empty()) {
      steps.push_back([this](Op* o, StepDone d) {
        api(o)->put_drive({.drive_id = "rootfs", .path_on_host = config_.rootfs_path, .is_root_device = true,
                           .is_read_only = false}, d);
      });
    }
    if (!config_.tap_device.empty()) {
      steps.push_back([this](Op* o, StepDone d) {
        api(o)->put_network_interface({.iface_id = "eth0", .host_dev_name = config_.tap_device, .guest_mac = {}}, d);
      });
    }
    // Relative to the VMM's directory (the sandbox's): a snapshot records the path, and a sandbox started from
    // it must bind a socket of its own.
    steps.push_back([this](Op* o, StepDone d) { api(o)->put_vsock({.guest_cid = 3, .uds_path = kVsockName}, d); });
    steps.push_back([this](Op* o, StepDone d) { api(o)->instance_start(d); });
    run(std::move(op), std::move(steps), kill_step(), [done = std::move(done)](Op* o, Status s) {
      if (!s) return done(s.failure());
      done(o->info);
    });
  }

  // A memory snapshot's guest continues here: its memory file mapped privately by Firecracker (the File
  // backend), so the sandboxes from one snapshot share the pages none of them wrote.
  void start_from_memory(const SandboxSpec& spec, RuntimeInfo info, RuntimeDone done) {
    auto op = new_op(spec, "starting from " + spec.memory_snapshot_dir, info);
    std::vector<Step> steps;
    steps.push_back([snap = spec.memory_snapshot_dir](Op* o, StepDone d) {
      std::error_code ec;
      if (!std::filesystem::exists(snap + "/" + kSnapshotFile, ec) || !std::filesystem::exists(snap + "/" + kMemoryFile, ec))
        return d(fail(Error::kNotFound, "memory snapshot " + snap + " has no " + kSnapshotFile + " and " + kMemoryFile));
      std::filesystem::create_directories(o->info.sandbox_dir, ec);
      if (ec) return d(fail(Error::kIo, "cannot create " + o->info.sandbox_dir + ": " + ec.message()));
      std::filesystem::remove(o->info.driver_data[kVsockSocket], ec);  // Firecracker binds it itself
      d({});
    });
    steps.push_back(spawn_step({"--api-sock", info.driver_data[kApiSocket]}));
    steps.push_back([this, snap = spec.memory_snapshot_dir](Op* o, StepDone d) { load_and_resume(o, snap, d); });
    run(std::move(op), std::move(steps), kill_step(), [done = std::move(done)](Op* o, Status s) {
      if (!s) return done(s.failure());
      done(o->info);
    });
  }

  void pause(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override {
    simple(spec, info, "pausing", [](FirecrackerApi* a, StepDone d) { a->pause(std::move(d)); }, std::move(done));
  }

  void resume(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override {
    simple(spec, info, "resuming", [](FirecrackerApi* a, StepDone d) { a->resume(std::move(d)); }, std::move(done));
  }

  void hibernate(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override {
    auto op = new_op(spec, "hibernating", info);
    op->cancellable = true;
    std::vector<Step> steps;
    steps.push_back([this](Op* o, StepDone d) { api(o)->pause(d); });
    steps.push_back([this](Op* o, StepDone d) {
      const std::string dir = new_state_dir(o->info.sandbox_dir);
      discard_new_state(o->info.sandbox_dir);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) return d(fail(Error::kIo, "cannot create " + dir + ": " + ec.message()));
      api(o)->create_snapshot({.snapshot_path = dir + "/" + kSnapshotFile, .mem_file_path = dir + "/" + kMemoryFile,
                               .type = FcSnapshotType::kFull}, d);
    });
    steps.push_back(cancel_point_step());
    steps.push_back(commit_state_step());
    steps.push_back([this](Op* o, StepDone d) {
      stop_watch(o->sandbox_id);  // the exit we cause now is not one the watcher should hear of
      d({});
    });
    steps.push_back(kill_step());
    Step cleanup = [](Op* o, StepDone d) {
      discard_new_state(o->info.sandbox_dir);
      d({});
    };
    run(std::move(op), std::move(steps), std::move(cleanup), [done = std::move(done)](Op* o, Status s) {
      if (!s) return done(s.failure());
      RuntimeInfo saved = o->info;
      saved.pid = 0;
      saved.start_time_ticks = 0;
      done(std::move(saved));
    });
  }

  void restore(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override {
    auto op = new_op(spec, "restoring", info);
    op->process = {};
    std::vector<Step> steps;
    steps.push_back([](Op* o, StepDone d) {
      auto it = o->info.driver_data.find(kStateDir);
      std::error_code ec;
      if (it == o->info.driver_data.end() || !std::filesystem::exists(it->second + "/" + kSnapshotFile, ec))
        return d(fail(Error::kNotFound, "sandbox " + o->sandbox_id + ": no saved state to restore from"));
      // The snapshot names the vsock socket; a leftover file would make Firecracker fail to bind it again.
      std::filesystem::remove(o->info.driver_data[kVsockSocket], ec);
      d({});
    });
    steps.push_back(spawn_step({"--api-sock", info.driver_data.count(kApiSocket)
                                                  ? info.driver_data.at(kApiSocket)
                                                  : info.sandbox_dir + "/" + kSocketName}));
    steps.push_back([this](Op* o, StepDone d) { load_and_resume(o, o->info.driver_data[kStateDir], d); });
    run(std::move(op), std::move(steps), kill_step(), [done = std::move(done)](Op* o, Status s) {
      if (!s) return done(s.failure());
      done(o->info);
    });
  }

 protected:
  void graceful_stop(Op*, StepDone done) override { done({}); }

  Result<bool> query_paused(const RuntimeInfo& info) override {
    Result<bool> paused = fail(Error::kInternal, "not asked");
    Status s = run_on_private_loop([&](uv_loop_t* loop, std::function<void(Status)> finished) {
      auto a = std::make_shared<FirecrackerApi>(loop, info.driver_data.count(kApiSocket) ? info.driver_data.at(kApiSocket) : "",
                                                config_.api);
      a->instance_state([&paused, finished](Result<std::string> st) {
        if (!st) {
          paused = st.failure();
          return finished(st.failure());
        }
        paused = *st == "Paused";
        finished({});
      });
      return std::static_pointer_cast<void>(a);
    });
    if (!s) return s.failure();
    return paused;
  }

 private:
  // The API client of the op's VMM, created on first use (after a spawn with a longer connect wait).
  FirecrackerApi* api(Op* o, bool just_spawned = false) {
    if (!o->api) {
      auto it = o->info.driver_data.find(kApiSocket);
      std::string sock = it != o->info.driver_data.end() ? it->second : o->info.sandbox_dir + "/" + kSocketName;
      o->api = std::make_shared<FirecrackerApi>(loop_, std::move(sock), api_options(just_spawned));
    }
    return static_cast<FirecrackerApi*>(o->api.get());
  }

  // The freshly spawned VMM loads the full snapshot in `dir` (vmstate + memory, the File backend) and runs it.
  void load_and_resume(Op* o, const std::string& dir, StepDone d) {
    api(o, true)->load_snapshot({.snapshot_path = dir + "/" + kSnapshotFile, .backend = FcMemBackend::kFile,
                                 .backend_path = dir + "/" + kMemoryFile, .resume_vm = true,
                                 .enable_diff_snapshots = false},
                                std::move(d));
  }

  void simple(const SandboxSpec& spec, const RuntimeInfo& info, std::string what,
              std::function<void(FirecrackerApi*, StepDone)> call, Done done) {
    auto op = new_op(spec, std::move(what), info);
    run(std::move(op), {[this, call = std::move(call)](Op* o, StepDone d) { call(api(o), std::move(d)); }}, nullptr,
        [done = std::move(done)](Op*, Status s) { done(std::move(s)); });
  }

  FirecrackerConfig config_;
};

}  // namespace

std::unique_ptr<Driver> make_firecracker_driver(uv_loop_t* loop, FirecrackerConfig config) {
  return std::make_unique<FirecrackerDriver>(loop, std::move(config));
}

}  // namespace sg
