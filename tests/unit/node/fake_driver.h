// Test support for the node's units: a Driver whose asynchronous operations complete on the loop after a
// configurable delay and count their calls, a temporary directory, and a loop runner that stops on a
// condition. Header-only because it is shared by several test files of one binary.
#pragma once

#include <fcntl.h>

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <uv.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "noderuntime/driver.h"
#include "tests/unit/temp_dir.h"

namespace sg::testing {

// Runs `loop` until `done()` holds or `timeout_ms` passes. A ticking timer keeps each turn short even when
// the only other pending timer is far away.
inline bool run_until(uv_loop_t* loop, const std::function<bool()>& done, int timeout_ms = 5000) {
  uv_timer_t tick;
  uv_timer_init(loop, &tick);
  uv_timer_start(&tick, [](uv_timer_t*) {}, 2, 2);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool ok = done();
  while (!ok && std::chrono::steady_clock::now() < deadline) {
    uv_run(loop, UV_RUN_ONCE);
    ok = done();
  }
  uv_close(reinterpret_cast<uv_handle_t*>(&tick), nullptr);
  uv_run(loop, UV_RUN_NOWAIT);  // runs the close callback before `tick` goes out of scope
  return ok;
}

// Runs the loop for `ms` milliseconds of wall time.
inline void run_for(uv_loop_t* loop, int ms) {
  run_until(loop, [] { return false; }, ms);
}

class FakeDriver : public Driver {
 public:
  struct Instance {
    bool alive = true;
    bool paused = false;
    bool hibernated = false;  // saved to "disk": not alive, restorable
    std::optional<RuntimeInfo> found_runtime;  // alive under another runtime than the record's (observe says so)
    std::function<void()> on_exit;
  };

  explicit FakeDriver(uv_loop_t* loop) : loop_(loop) {}
  ~FakeDriver() override {
    // Pending operations are dropped, as a real driver going away would.
    for (Op* op : pending_) uv_close(reinterpret_cast<uv_handle_t*>(&op->timer), [](uv_handle_t* h) {
      delete static_cast<Op*>(h->data);
    });
  }

  std::string_view name() const override { return "fake"; }
  DriverCapabilities capabilities() const override {
    return {can_pause, can_hibernate, limits_disk, can_checkpoint_memory, can_checkpoint_disk};
  }

  void start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) override {
    ++starts;
    started_from_memory = spec.memory_snapshot_dir;
    started_on_disk = spec.snapshot_disk;
    Result<RuntimeInfo> result = fail(Error::kIo, "exec failed: no such file");
    if (!fail_start) result = RuntimeInfo{next_pid_++, 4242, sandbox_dir, {{"boot", "1"}}};
    later_with(start_delay_ms, spec.id, [done = std::move(done), result, this, id = spec.id](bool) {
      if (result) instances[id] = Instance{};
      done(result);
    });
  }
  void pause(const SandboxSpec& spec, const RuntimeInfo&, Done done) override {
    ++pauses;
    Status result = fail_pause ? Status(fail(Error::kIo, "freeze failed")) : Status();
    later_with(op_delay_ms, spec.id, [this, done = std::move(done), result, id = spec.id](bool cancelled) {
      if (cancelled) return done(fail(Error::kConflict, "pause cancelled"));
      if (result) instances[id].paused = true;
      done(result);
    });
  }
  void hibernate(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override {
    ++hibernates;
    Result<RuntimeInfo> result = fail(Error::kIo, "disk full");
    if (!fail_hibernate) {
      RuntimeInfo saved = info;
      saved.pid = 0;
      saved.driver_data["state_file"] = info.sandbox_dir + "/state";
      result = saved;
    }
    later_with(hibernate_delay_ms, spec.id, [this, done = std::move(done), result, id = spec.id](bool cancelled) {
      if (cancelled) return done(fail(Error::kConflict, "hibernate cancelled"));
      if (result) {
        Instance& inst = instances[id];
        inst.alive = false;
        inst.paused = false;
        inst.hibernated = true;
        inst.on_exit = nullptr;
      }
      done(result);
    });
  }
  void restore(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override {
    ++restores;
    restored_from = info;
    Result<RuntimeInfo> result = fail(Error::kIo, "state file truncated");
    if (!fail_restore) {
      RuntimeInfo running = info;
      running.pid = next_pid_++;
      result = running;
    }
    later_with(op_delay_ms, spec.id, [this, done = std::move(done), result, id = spec.id](bool) {
      if (result) instances[id] = Instance{};
      done(result);
    });
  }
  bool cancel(const SandboxSpec& spec) override {
    ++cancels;
    if (!can_cancel) return false;
    for (Op* op : pending_) {
      if (op->sandbox_id != spec.id) continue;
      op->cancelled = true;
      uv_timer_start(&op->timer, on_op_timer, 1, 0);  // a cancelled operation ends almost at once
      return true;
    }
    return false;
  }
  void resume(const SandboxSpec& spec, const RuntimeInfo&, Done done) override {
    ++resumes;
    Status result = fail_resume ? Status(fail(Error::kIo, "thaw failed")) : Status();
    later_with(op_delay_ms, spec.id, [this, done = std::move(done), result, id = spec.id](bool) {
      if (result) instances[id].paused = false;
      done(result);
    });
  }
  void terminate(const SandboxSpec& spec, const RuntimeInfo&, Done done) override {
    ++terminates;
    Status result = fail_terminate ? Status(fail(Error::kIo, "kill failed")) : Status();
    later_with(op_delay_ms, spec.id, [this, done = std::move(done), result, id = spec.id](bool) {
      if (result) {
        instances[id].alive = false;
        instances[id].hibernated = false;
      }
      done(result);
    });
  }
  Status watch_exit(const SandboxSpec& spec, const RuntimeInfo&, std::function<void()> on_exit) override {
    ++watches;
    instances[spec.id].on_exit = std::move(on_exit);
    return {};
  }
  void unwatch(const SandboxSpec& spec) override {
    ++unwatches;
    instances[spec.id].on_exit = nullptr;
  }
  ObservedInstance observe(const SandboxSpec& spec, const RuntimeInfo&) override {
    auto it = instances.find(spec.id);
    if (it == instances.end()) return {};
    return {it->second.alive, it->second.paused, it->second.hibernated, it->second.found_runtime};
  }
  Result<GuestSocket> open_socket(const SandboxSpec&, const RuntimeInfo&, uint16_t port) override {
    ++sockets;
    if (fail_open_socket) return fail(Error::kIo, "setns failed");
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return fail_errno("socket", errno);
    return GuestSocket{UniqueFd(fd), false, static_cast<uint16_t>(port + port_offset)};
  }

  // The test process's own network namespace stands for the instance's (the spares above live in it).
  Result<UniqueFd> socket_namespace(const SandboxSpec&, const RuntimeInfo&) override {
    UniqueFd fd(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return fail_errno("open /proc/thread-self/ns/net", errno);
    return fd;
  }

  // A freezer the test holds: freeze() blocks (on the checkpoint's pool thread) until release().
  struct HeldFreezer {
    std::mutex mu;
    std::condition_variable cv;
    bool released = false, frozen = false;
    int freezes = 0;
    void release() {
      std::lock_guard lock(mu);
      released = true;
      cv.notify_all();
    }
  };
  class Freezer final : public snapshot::Freezer {
   public:
    explicit Freezer(std::shared_ptr<HeldFreezer> held) : held_(std::move(held)) {}
    Status freeze() override {
      std::unique_lock lock(held_->mu);
      ++held_->freezes;
      held_->frozen = true;
      held_->cv.wait(lock, [&] { return held_->released; });
      return {};
    }
    Status thaw() override {
      std::lock_guard lock(held_->mu);
      held_->frozen = false;
      return {};
    }

   private:
    std::shared_ptr<HeldFreezer> held_;
  };
  // Filesystem checkpoints read `checkpoint_upper` (none when empty: the default kUnsupported).
  Result<CheckpointSource> checkpoint_source(const SandboxSpec& spec, const RuntimeInfo& info) override {
    if (checkpoint_upper.empty()) return Driver::checkpoint_source(spec, info);
    CheckpointSource source;
    source.upper_dir = checkpoint_upper;
    source.shift = snapshot::IdShift{0, 65536};
    source.freezer = std::make_unique<Freezer>(freezer);
    return source;
  }
  std::string checkpoint_upper;
  std::shared_ptr<HeldFreezer> freezer = std::make_shared<HeldFreezer>();
  // Memory checkpoints (with can_checkpoint_memory): writes a "state" file of `memory_state` into the dir.
  void checkpoint_memory(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                         CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) override {
    if (!can_checkpoint_memory) return Driver::checkpoint_memory(spec, info, files, source, std::move(done));
    const std::string& dir = files.dir;
    ++memory_checkpoints;
    last_memory_checkpoint_source = source;
    later_with(op_delay_ms, spec.id, [this, dir, done = std::move(done)](bool) {
      if (fail_memory_checkpoint) return done(fail(Error::kIo, "migration to the state file failed"));
      std::ofstream(dir + "/" + kMemoryState) << memory_state;
      done(VmCheckpoint{.state_bytes = memory_state.size(), .disk_bytes = 0, .pause_ms = 1.5});
    });
  }
  // Disk checkpoints (with can_checkpoint_disk): writes a kSnapshotDisk file of `disk_content` into the dir.
  void checkpoint_disk(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                       CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) override {
    if (!can_checkpoint_disk) return Driver::checkpoint_disk(spec, info, files, source, std::move(done));
    ++disk_checkpoints;
    last_disk_checkpoint_source = source;
    later_with(op_delay_ms, spec.id, [this, dir = files.dir, done = std::move(done)](bool) {
      std::ofstream(dir + "/" + kSnapshotDisk) << disk_content;
      done(VmCheckpoint{.disk_bytes = disk_content.size(), .pause_ms = 0.5, .parent = disk_delta_parent});
    });
  }
  // Ports exposed after create: counted, and failed with fail_forward.
  void forward_port(const SandboxSpec&, const RuntimeInfo&, uint16_t port, Done done) override {
    forwarded.push_back(port);
    later_with(op_delay_ms, "", [this, done = std::move(done)](bool) {
      done(fail_forward ? Status(fail(Error::kUnavailable, "the fake refuses the forward")) : Status());
    });
  }
  void unforward_port(const SandboxSpec&, const RuntimeInfo&, uint16_t port, Done done) override {
    unforwarded.push_back(port);
    done({});
  }
  std::vector<uint16_t> forwarded, unforwarded;
  bool fail_forward = false;
  bool can_checkpoint_memory = false, fail_memory_checkpoint = false;
  std::string memory_state = "saved guest";
  int memory_checkpoints = 0;
  CheckpointFrom last_memory_checkpoint_source = CheckpointFrom::kRunning;
  std::string started_from_memory;  // the last start's spec.memory_snapshot_dir
  bool can_checkpoint_disk = false;
  std::string disk_content = "guest disk";
  int disk_checkpoints = 0;
  std::string disk_delta_parent;  // what a disk checkpoint says its disk is a delta over
  CheckpointFrom last_disk_checkpoint_source = CheckpointFrom::kRunning;
  std::string started_on_disk;  // the last start's spec.snapshot_disk

  // The instance's process exits by itself.
  void exit(const std::string& id) {
    Instance& inst = instances[id];
    inst.alive = false;
    auto cb = std::move(inst.on_exit);
    inst.on_exit = nullptr;
    if (cb) cb();
  }

  bool can_pause = true, can_hibernate = true, can_cancel = true;
  bool limits_disk = false;
  bool fail_start = false, fail_pause = false, fail_resume = false, fail_terminate = false, fail_open_socket = false;
  bool fail_hibernate = false, fail_restore = false;
  uint64_t op_delay_ms = 5;          // how long pause/resume/restore/terminate take
  uint64_t start_delay_ms = 5;       // how long a start takes
  uint64_t hibernate_delay_ms = 5;   // how long a hibernation takes
  uint16_t port_offset = 0;          // open_socket's connect_port = port + port_offset (a forwarded port)
  int starts = 0, pauses = 0, resumes = 0, terminates = 0, watches = 0, unwatches = 0, sockets = 0;
  int hibernates = 0, restores = 0, cancels = 0;
  RuntimeInfo restored_from;
  std::map<std::string, Instance> instances;

 private:
  // An operation in flight: `finish(cancelled)` runs once from the loop.
  struct Op {
    uv_timer_t timer;
    FakeDriver* driver;
    std::string sandbox_id;
    bool cancelled = false;
    std::function<void(bool)> finish;
  };

  static void on_op_timer(uv_timer_t* t) {
    auto* o = static_cast<Op*>(t->data);
    o->driver->pending_.erase(o);
    auto finish = std::move(o->finish);
    bool cancelled = o->cancelled;
    uv_close(reinterpret_cast<uv_handle_t*>(&o->timer), [](uv_handle_t* h) { delete static_cast<Op*>(h->data); });
    finish(cancelled);
  }

  void later_with(uint64_t delay_ms, const std::string& sandbox_id, std::function<void(bool)> finish) {
    auto* op = new Op{{}, this, sandbox_id, false, std::move(finish)};
    uv_timer_init(loop_, &op->timer);
    op->timer.data = op;
    pending_.insert(op);
    uv_timer_start(&op->timer, on_op_timer, delay_ms, 0);
  }

  uv_loop_t* loop_;
  int next_pid_ = 1000;
  std::set<Op*> pending_;
};

}  // namespace sg::testing
