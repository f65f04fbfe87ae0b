#include "noderuntime/cloud_hypervisor_driver.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/http.h"

namespace sg {
namespace {

using json = nlohmann::json;

constexpr const char* kBase = "/api/v1/";  // the spec's servers[0].url path
constexpr const char* kSocketName = "cloud-hypervisor.sock";
constexpr const char* kVsockName = "vsock.sock";
constexpr const char* kSerialName = "serial.log";
constexpr const char* kMemoryRanges = "memory-ranges";  // where vm.snapshot writes the guest's RAM

std::string file_url(const std::string& path) { return "file://" + path; }

}  // namespace

Failure cloud_hypervisor_failure(std::string_view request, const HypervisorResponse& response) {
  std::string detail = response.body.empty() ? std::string(http_reason(response.status)) : response.body;
  while (!detail.empty() && (detail.back() == '\n' || detail.back() == '\r')) detail.pop_back();
  Error code = Error::kInternal;
  if (response.status == 400) code = Error::kInvalidArgument;
  if (response.status == 404 || response.status == 405) code = Error::kConflict;
  return fail(code, "cloud-hypervisor: " + std::string(request) + " failed (" + std::to_string(response.status) +
                        " " + std::string(http_reason(response.status)) + "): " + detail);
}

CloudHypervisorApi::CloudHypervisorApi(uv_loop_t* loop, std::string socket_path, HypervisorClientOptions options)
    : client_(loop, std::move(socket_path), "cloud-hypervisor", options) {}

void CloudHypervisorApi::send(std::string op, std::string body, Done done) {
  std::string path = kBase + op;
  std::string what = "PUT " + path;
  client_.request("PUT", path, std::move(body), [what, done = std::move(done)](Result<HypervisorResponse> r) {
    if (!r) return done(r.failure());
    if (r->status / 100 != 2) return done(cloud_hypervisor_failure(what, *r));
    done({});
  });
}

void CloudHypervisorApi::create(const ChVmConfig& c, Done done) {
  json payload = {{"kernel", c.kernel}};
  if (!c.cmdline.empty()) payload["cmdline"] = c.cmdline;
  if (!c.initramfs.empty()) payload["initramfs"] = c.initramfs;
  json b = {{"cpus", {{"boot_vcpus", c.vcpus}, {"max_vcpus", c.vcpus}}},
            {"memory", {{"size", c.memory_bytes}}},
            {"payload", payload},
            {"console", {{"mode", "Off"}}}};
  b["serial"] = c.serial_file.empty() ? json{{"mode", "Null"}} : json{{"mode", "File"}, {"file", c.serial_file}};
  if (!c.rootfs.empty()) b["disks"] = json::array({{{"path", c.rootfs}, {"readonly", false}, {"id", "rootfs"}}});
  if (!c.tap.empty()) b["net"] = json::array({{{"tap", c.tap}, {"id", "eth0"}}});
  if (!c.vsock_socket.empty()) b["vsock"] = {{"cid", c.vsock_cid}, {"socket", c.vsock_socket}};
  send("vm.create", b.dump(), std::move(done));
}

void CloudHypervisorApi::boot(Done done) { send("vm.boot", {}, std::move(done)); }
void CloudHypervisorApi::pause(Done done) { send("vm.pause", {}, std::move(done)); }
void CloudHypervisorApi::resume(Done done) { send("vm.resume", {}, std::move(done)); }
void CloudHypervisorApi::shutdown(Done done) { send("vm.shutdown", {}, std::move(done)); }

void CloudHypervisorApi::snapshot(const std::string& destination_url, Done done) {
  send("vm.snapshot", json{{"destination_url", destination_url}}.dump(), std::move(done));
}

void CloudHypervisorApi::restore(const std::string& source_url, bool prefault, Done done) {
  send("vm.restore", json{{"source_url", source_url}, {"prefault", prefault}}.dump(), std::move(done));
}

void CloudHypervisorApi::state(std::function<void(Result<std::string>)> done) {
  std::string path = std::string(kBase) + "vm.info";
  client_.request("GET", path, {}, [path, done = std::move(done)](Result<HypervisorResponse> r) {
    if (!r) return done(r.failure());
    if (r->status != 200) return done(cloud_hypervisor_failure("GET " + path, *r));
    json b = json::parse(r->body, nullptr, false);
    if (!b.is_object() || !b.contains("state") || !b["state"].is_string())
      return done(fail(Error::kUnavailable, "cloud-hypervisor: GET " + path + " answered without a state"));
    done(b["state"].get<std::string>());
  });
}

namespace {

class CloudHypervisorDriver final : public VmmDriver {
 public:
  CloudHypervisorDriver(uv_loop_t* loop, CloudHypervisorConfig config)
      : VmmDriver(loop, "cloud-hypervisor",
                  VmmDriverOptions{.binary = config.binary,
                                   .api = config.api,
                                   .spawn_connect_wait_ms = config.spawn_connect_wait_ms,
                                   .exit_wait_ms = config.exit_wait_ms,
                                   .batch_scheduling = config.batch_scheduling}),
        config_(std::move(config)) {}

  std::string_view name() const override { return "cloud-hypervisor"; }

  // Paused only for Cloud Hypervisor's snapshot into `dir` (config.json, state.json, memory-ranges), then
  // resumed, whatever the outcome (a VM suspended in memory stays paused).
  void checkpoint_memory(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                         CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) override {
    if (source == CheckpointFrom::kHibernated) return done(hibernated_refusal(spec));
    const std::string& dir = files.dir;
    checkpoint_paused(
        spec, info, source == CheckpointFrom::kPaused, [this](Op* o, StepDone d) { api(o)->pause(std::move(d)); },
        [this, dir](Op* o, StepDone d) { api(o)->snapshot(file_url(dir), std::move(d)); },
        [this](Op* o, StepDone d) { api(o)->resume(std::move(d)); },
        [dir] {
          return VmCheckpoint{
              .state_bytes = file_bytes(dir + "/config.json", false) + file_bytes(dir + "/state.json", false),
              .ram_bytes = file_bytes(dir + "/" + kMemoryRanges, true)};
        },
        std::move(done));
  }

  void start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) override {
    RuntimeInfo info;
    info.sandbox_dir = sandbox_dir;
    info.driver_data[kApiSocket] = sandbox_dir + "/" + kSocketName;
    info.driver_data[kVsockSocket] = sandbox_dir + "/" + kVsockName;
    if (!spec.memory_snapshot_dir.empty()) return start_from_memory(spec, std::move(info), std::move(done));
    ChVmConfig vm{.vcpus = static_cast<uint32_t>(std::clamp(static_cast<int>(std::ceil(spec.cpus)), 1, 254)),
                  .memory_bytes = static_cast<uint64_t>(spec.memory_mb) << 20,
                  .kernel = config_.kernel,
                  .cmdline = config_.cmdline,
                  .initramfs = config_.initramfs,
                  .rootfs = config_.rootfs,
                  .tap = config_.tap,
                  .vsock_cid = 3,
                  // Relative to the VMM's directory (the sandbox's): a snapshot records these paths, and a
                  // sandbox restored from another's memory snapshot must use files of its own.
                  .vsock_socket = kVsockName,
                  .serial_file = kSerialName};
    auto op = new_op(spec, "starting", info);
    std::vector<Step> steps;
    steps.push_back([](Op* o, StepDone d) {
      std::error_code ec;
      std::filesystem::create_directories(o->info.sandbox_dir, ec);
      if (ec) return d(fail(Error::kIo, "cannot create " + o->info.sandbox_dir + ": " + ec.message()));
      std::filesystem::remove(o->info.driver_data[kVsockSocket], ec);  // the VMM binds it itself
      d({});
    });
    steps.push_back(spawn_step({"--api-socket", info.driver_data[kApiSocket]}));
    steps.push_back([this, vm](Op* o, StepDone d) { api(o, true)->create(vm, d); });
    steps.push_back([this](Op* o, StepDone d) { api(o)->boot(d); });
    run(std::move(op), std::move(steps), kill_step(), [done = std::move(done)](Op* o, Status s) {
      if (!s) return done(s.failure());
      done(o->info);
    });
  }

  // A memory snapshot's guest continues here: vm.restore (which leaves it paused), then vm.resume. Cloud
  // Hypervisor copies the memory in, so nothing is shared between the sandboxes from one snapshot.
  void start_from_memory(const SandboxSpec& spec, RuntimeInfo info, RuntimeDone done) {
    auto op = new_op(spec, "starting from " + spec.memory_snapshot_dir, info);
    std::vector<Step> steps;
    steps.push_back([snap = spec.memory_snapshot_dir](Op* o, StepDone d) {
      std::error_code ec;
      if (!std::filesystem::exists(snap + "/config.json", ec))
        return d(fail(Error::kNotFound, "memory snapshot " + snap + " has no config.json"));
      std::filesystem::create_directories(o->info.sandbox_dir, ec);
      if (ec) return d(fail(Error::kIo, "cannot create " + o->info.sandbox_dir + ": " + ec.message()));
      std::filesystem::remove(o->info.driver_data[kVsockSocket], ec);  // the restored VM binds it
      d({});
    });
    steps.push_back(spawn_step({"--api-socket", info.driver_data[kApiSocket]}));
    steps.push_back([this, snap = spec.memory_snapshot_dir](Op* o, StepDone d) {
      api(o, true)->restore(file_url(snap), false, d);
    });
    steps.push_back([this](Op* o, StepDone d) { api(o)->resume(d); });
    run(std::move(op), std::move(steps), kill_step(), [done = std::move(done)](Op* o, Status s) {
      if (!s) return done(s.failure());
      done(o->info);
    });
  }

  void pause(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override {
    simple(spec, info, "pausing", [](CloudHypervisorApi* a, StepDone d) { a->pause(std::move(d)); }, std::move(done));
  }

  void resume(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override {
    simple(spec, info, "resuming", [](CloudHypervisorApi* a, StepDone d) { a->resume(std::move(d)); },
           std::move(done));
  }

  void hibernate(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override {
    auto op = new_op(spec, "hibernating", info);
    op->cancellable = true;
    std::vector<Step> steps;
    // The node calls hibernate on a paused VM; pausing again is cheap and makes the snapshot's precondition
    // (a paused VM) hold whatever happened in between. A "405 already paused" is not a failure here.
    steps.push_back([this](Op* o, StepDone d) {
      api(o)->pause([d](Status s) { d(s.ok() || s.error() == Error::kConflict ? Status{} : s); });
    });
    steps.push_back([this](Op* o, StepDone d) {
      const std::string dir = new_state_dir(o->info.sandbox_dir);
      discard_new_state(o->info.sandbox_dir);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) return d(fail(Error::kIo, "cannot create " + dir + ": " + ec.message()));
      api(o)->snapshot(file_url(dir), d);
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
      if (it == o->info.driver_data.end() || !std::filesystem::is_directory(it->second, ec) ||
          std::filesystem::is_empty(it->second, ec))
        return d(fail(Error::kNotFound, "sandbox " + o->sandbox_id + ": no saved state to restore from"));
      std::filesystem::remove(o->info.driver_data[kVsockSocket], ec);  // the restored VM binds it again
      d({});
    });
    steps.push_back(spawn_step({"--api-socket", info.driver_data.count(kApiSocket)
                                                    ? info.driver_data.at(kApiSocket)
                                                    : info.sandbox_dir + "/" + kSocketName}));
    steps.push_back([this](Op* o, StepDone d) {
      api(o, true)->restore(file_url(o->info.driver_data[kStateDir]), false, d);
    });
    steps.push_back([this](Op* o, StepDone d) { api(o)->resume(d); });
    run(std::move(op), std::move(steps), kill_step(), [done = std::move(done)](Op* o, Status s) {
      if (!s) return done(s.failure());
      done(o->info);
    });
  }

 protected:
  void graceful_stop(Op* o, StepDone done) override { api(o)->shutdown(std::move(done)); }

  Result<bool> query_paused(const RuntimeInfo& info) override {
    Result<bool> paused = fail(Error::kInternal, "not asked");
    Status s = run_on_private_loop([&](uv_loop_t* loop, std::function<void(Status)> finished) {
      auto it = info.driver_data.find(kApiSocket);
      auto a = std::make_shared<CloudHypervisorApi>(loop, it != info.driver_data.end() ? it->second : "", config_.api);
      a->state([&paused, finished](Result<std::string> st) {
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
  CloudHypervisorApi* api(Op* o, bool just_spawned = false) {
    if (!o->api) {
      auto it = o->info.driver_data.find(kApiSocket);
      std::string sock = it != o->info.driver_data.end() ? it->second : o->info.sandbox_dir + "/" + kSocketName;
      o->api = std::make_shared<CloudHypervisorApi>(loop_, std::move(sock), api_options(just_spawned));
    }
    return static_cast<CloudHypervisorApi*>(o->api.get());
  }

  void simple(const SandboxSpec& spec, const RuntimeInfo& info, std::string what,
              std::function<void(CloudHypervisorApi*, StepDone)> call, Done done) {
    auto op = new_op(spec, std::move(what), info);
    run(std::move(op), {[this, call = std::move(call)](Op* o, StepDone d) { call(api(o), std::move(d)); }}, nullptr,
        [done = std::move(done)](Op*, Status s) { done(std::move(s)); });
  }

  CloudHypervisorConfig config_;
};

}  // namespace

std::unique_ptr<Driver> make_cloud_hypervisor_driver(uv_loop_t* loop, CloudHypervisorConfig config) {
  return std::make_unique<CloudHypervisorDriver>(loop, std::move(config));
}

}  // namespace sg
