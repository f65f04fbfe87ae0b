#include "noderuntime/qemu_driver.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <x86intrin.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <string_view>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "common/base64.h"
#include "common/failpoint.h"
#include "common/hex.h"
#include "common/log.h"
#include "noderuntime/disk_delta.h"
#include "noderuntime/guest_disk.h"
#include "noderuntime/guest_image.h"
#include "noderuntime/hypervisor_client.h"
#include "noderuntime/netns.h"
#include "noderuntime/qmp_client.h"
#include "noderuntime/sandbox_egress.h"
#include "noderuntime/ssh_keys.h"
#include "noderuntime/uv_handles.h"

namespace sg {
namespace {

// driver_data keys besides VmmDriver::kApiSocket (the QMP socket).
constexpr const char* kStateFile = "state_file";  // set only while hibernated
// In the sandbox dir: QEMU's -pidfile, locked by the QEMU running for the sandbox. A QEMU the record does not
// name (spawned by a restore or a create the node was killed in) is found by it.
constexpr const char* kPidFile = "qemu.pid";
// QEMU takes its -pidfile lock before it creates its QMP socket, so a stray found by the lock may not answer
// yet: a restore the node was killed in right after the spawn, found by a node restarted within milliseconds
// (a loaded machine stretches that window). It is asked until then; one that never answers is hung.
constexpr uint32_t kStrayQmpWaitMs = 10000;
constexpr uint32_t kStrayQmpRoundMs = 250;
// How long a start, resume or restore waits for the guest's answer to its identity line (a few process
// starts in the guest: tens of ms under TCG, 100-300 ms with SSH files to write).
constexpr uint64_t kIdentityAckMs = 5000;
// How long a disk checkpoint waits for the guest to write out its files before it copies the disk anyway.
// Writing out a page cache full of a big build's output takes a while; the guest keeps running meanwhile.
constexpr uint64_t kGuestSyncMs = 30000;
// How long a disk checkpoint's backup job may run (it copies what the guest wrote, at the disk's speed); a
// stuck one would hold the sandbox's suspends back.
constexpr uint64_t kBackupJobTimeoutMs = 30 * 60 * 1000;
// In driver_data, "1" when the guest answers its identity lines (it printed kGuestIdentityMarker at boot);
// next to a memory snapshot's state, a file that says its guest does.
constexpr const char* kIdentityAnswers = "identity_answers";
constexpr const char* kClockPort = "clock_port";
constexpr const char* kPortPrefix = "port:";      // "port:<guest port>" -> host port
// What the guest said of its agent at boot ("listening", "none", "failed"); absent for images older than
// the SANDGATE-GUEST-AGENT line, which are trusted to have one.
constexpr const char* kAgentState = "agent";
constexpr const char* kDisk = "disk";  // the sandbox's qcow2 overlay, when it boots an image
// The memory snapshot's RAM file this guest maps privately (copy on write), while it does: from its start
// from that snapshot until it is hibernated (its saved state then holds all of its RAM).
constexpr const char* kRamFile = "ram_file";
// Guest RAM is a memory backend with microvm's own name for its RAM block, so that the states saved by
// QEMUs started with a plain -m (before the backend) load into ours and back.
constexpr const char* kRamBackendId = "microvm.ram";
// QEMU names a memory-backend-memfd's memfd after the backend's type, not its id.
constexpr std::string_view kRamMemfdLink = "/memfd:memory-backend-memfd";
constexpr uint64_t kPollMs = 20;                  // console / query-migrate polling

std::string sh_quote(std::string_view s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The script the guest's init runs as the sandbox's command.
std::string command_script(const SandboxSpec& spec) {
  std::string s;
  for (const auto& [k, v] : spec.env) s += "export " + k + "=" + sh_quote(v) + "\n";
  s += "cd " + sh_quote(spec.cwd.empty() ? "/" : spec.cwd) + " || exit 126\nexec";
  for (const std::string& a : spec.command) s += " " + sh_quote(a);
  return s + "\n";
}

// TCG guests read the host's TSC; microvm has no PIT or HPET to calibrate it against, so the kernel is told.
uint64_t measure_tsc_khz() {
  auto t0 = std::chrono::steady_clock::now();
  uint64_t c0 = __rdtsc();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  uint64_t c1 = __rdtsc();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return static_cast<uint64_t>(static_cast<double>(c1 - c0) / secs / 1000.0);
}

std::string command_path(const std::string& sandbox_dir) { return sandbox_dir + "/guest-command.sh"; }

// A value inside a QEMU option list, where a comma must be doubled.
std::string qemu_opt_value(std::string_view v) {
  std::string out;
  for (char c : v) out += c == ',' ? std::string(",,") : std::string(1, c);
  return out;
}

// The guest's RAM as QEMU `pid` holds it (a path under /proc that opens the memfd), or "" for a QEMU whose
// RAM is not a memfd: one started before the memory backend, or a guest on a snapshot's RAM file.
std::string ram_memfd_path(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    std::error_code link_ec;
    auto target = std::filesystem::read_symlink(it->path(), link_ec);
    if (!link_ec && target.string().rfind(kRamMemfdLink, 0) == 0) return it->path().string();
  }
  return "";
}

// QEMU user networking (guest 10.0.2.15). A sandbox without internet access gets restrict=on: slirp then
// forwards nothing the guest sends, not even to 10.0.2.2; only the hostfwd rules, node -> guest, work. With
// internet access slirp opens the guest's connections as QEMU's own sockets, in the VM's namespace, whose
// only way out is the egress veth (attached before QEMU starts): the sandbox's chain filters them as it
// does a process sandbox's. 10.0.2.2 is then that namespace's loopback, where only this VM's own forwards
// listen.
std::string user_netdev(bool internet) { return internet ? "user,id=net0" : "user,id=net0,restrict=on"; }

// The command script goes to the guest as a fw_cfg file; the guest's init copies it to a tmpfs.
// 0600 from the first byte (and again for a file left by an earlier start): what QEMU hands the guest by
// fw_cfg may be secret (the env, the identity secret).
Status write_private_file(const std::string& path, const std::string& content) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) return fail_errno("open " + path, errno);
  if (::fchmod(fd.get(), 0600) != 0) return fail_errno("chmod " + path, errno);
  if (::write(fd.get(), content.data(), content.size()) != static_cast<ssize_t>(content.size()))
    return fail_errno("write " + path, errno);
  return {};
}

Status write_command_file(const std::string& path, const std::string& script) {
  if (script.size() > kMaxGuestCommandBytes)
    return fail(Error::kLimitExceeded, "the command and environment take " + std::to_string(script.size()) +
                                           " bytes; a QEMU sandbox takes at most " +
                                           std::to_string(kMaxGuestCommandBytes));
  return write_private_file(path, script);
}

// In the sandbox dir: the secret a boot's identity lines must carry (see the header), 64 hex digits.
constexpr const char* kIdentitySecretFile = "identity.secret";
constexpr size_t kIdentitySecretHex = 64;

// The boot's identity secret (kIdentitySecretFile), "" when there is none (a guest booted before them).
std::string read_identity_secret(const std::string& sandbox_dir) {
  std::ifstream file(sandbox_dir + "/" + kIdentitySecretFile);
  std::string secret;
  return file >> secret && secret.size() == kIdentitySecretHex ? secret : std::string();
}

std::string random_hex(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  if (::getrandom(raw.data(), raw.size(), 0) != static_cast<ssize_t>(raw.size())) return {};
  return hex_encode(raw);
}

// driver_data comes back from the store; a value that is not a port is treated as absent.
std::optional<uint16_t> parse_port(const std::string& s) {
  unsigned v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v == 0 || v > 65535) return std::nullopt;
  return static_cast<uint16_t>(v);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail_of(const std::string& path, size_t max) {
  std::string s = read_file(path);
  if (s.size() > max) s = s.substr(s.size() - max);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// What the guest answered to an identity line: "ok" (all of it applied), "failed <step>" (that step failed,
// the others ran), an end without a word (it did not take the line: a wrong secret, a malformed line), or
// nothing within kIdentityAckMs.
enum class IdentityAnswer { kApplied, kFailed, kClosed, kNone };

// The word after "SANDGATE-GUEST-AGENT " on the console, or "" when the guest printed no such line.
std::string guest_agent_state(const std::string& console) {
  size_t at = console.find(kGuestAgentMarker);
  if (at == std::string::npos) return {};
  at += std::string_view(kGuestAgentMarker).size();
  while (at < console.size() && console[at] == ' ') ++at;
  size_t end = console.find_first_of("\r\n ", at);
  return console.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

Status fsync_path(const std::string& path, int flags) {
  UniqueFd fd(::open(path.c_str(), flags | O_CLOEXEC));
  if (!fd.valid() || ::fsync(fd.get()) != 0) return fail_errno("fsync " + path, errno);
  return {};
}

VmmDriverOptions vmm_options(std::string binary, bool batch_scheduling) {
  VmmDriverOptions o;
  o.binary = std::move(binary);
  o.batch_scheduling = batch_scheduling;
  return o;
}

class QemuDriver final : public VmmDriver {
 public:
  QemuDriver(uv_loop_t* loop, const NodeConfig& cfg, uint16_t agent_port, std::string binary,
             ImageLayers image_layers, SandboxEgress* egress)
      : VmmDriver(loop, "qemu", vmm_options(std::move(binary), cfg.batch_scheduling)),
        image_layers_(std::move(image_layers)),
        egress_(egress),
        disks_(loop, guest_disks_dir(cfg.state_dir)),
        kvm_(cfg.qemu_accel == "kvm"),
        kernel_(cfg.guest_kernel_file()),
        initrd_(cfg.guest_initrd_file()),
        image_(loop, guest_image_options(cfg)),
        boot_timeout_ms_(cfg.qemu_boot_timeout_ms),
        boot_attempts_(std::max<uint32_t>(cfg.qemu_boot_attempts, 1)),
        agent_port_(agent_port),
        ssh_keys_dir_(ssh_keys_dir(cfg.state_dir)),
        tsc_khz_(kvm_ ? 0 : measure_tsc_khz()) {
    auto home = current_netns();
    if (home) host_netns_ = std::move(*home);
    else host_netns_error_ = home.message();
  }

  std::string_view name() const override { return "qemu"; }
  DriverCapabilities capabilities() const override {
    DriverCapabilities c = VmmDriver::capabilities();
    c.disk_checkpoint = true;
    return c;
  }
  void checkpoint_disk(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                       CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) override;
  void checkpoint_memory(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                         CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) override;
  void forward_port(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port, Done done) override;
  // Not awaited: a running guest applies the line within moments (the node's API does not wait for every
  // VM); a wake that follows waits for the keys it acknowledges (clock_step).
  void ssh_keys_changed(const SandboxSpec& spec, const RuntimeInfo& info) override { (void)send_identity(spec, info); }
  void unforward_port(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port, Done done) override;
  void start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) override;
  void pause(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override;
  void resume(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override;
  void hibernate(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override;
  void restore(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) override;
  ObservedInstance observe(const SandboxSpec& spec, const RuntimeInfo& info) override;
  Result<GuestSocket> open_socket(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port) override;
  Result<UniqueFd> socket_namespace(const SandboxSpec& spec, const RuntimeInfo& info) override;
  void terminate(const SandboxSpec& spec, const RuntimeInfo& info, Done done) override {
    // A QEMU the record does not name (a create or a restore the node was killed in) goes too.
    if (Status s = stop_unrecorded_qemu(spec, info, false); !s) spdlog::warn("sandbox {}: {}", spec.id, s.message());
    netns_.erase(spec.id);  // QEMU's namespace goes with it
    acknowledged_keys_.erase(spec.id);
    // Its veth goes with the namespace, its chain (kept while hibernated, for the restore) here.
    if (egress_ != nullptr) egress_->detach(spec);
    VmmDriver::terminate(spec, info, std::move(done));
  }
  // A QEMU that exits by itself leaves an empty namespace that only our fd keeps alive.
  Status watch_exit(const SandboxSpec& spec, const RuntimeInfo& info, std::function<void()> on_exit) override {
    return VmmDriver::watch_exit(spec, info, [this, id = spec.id, on_exit = std::move(on_exit)] {
      netns_.erase(id);
      on_exit();
    });
  }

 protected:
  // Terminate removes the sandbox, its disk overlay included: nothing to flush.
  void graceful_stop(Op*, StepDone done) override { done({}); }
  Result<bool> query_paused(const RuntimeInfo& info) override { return query_paused(info, 0); }

 private:
  // query-status; `connect_wait_ms` as QmpOptions::connect_wait_ms.
  static Result<bool> query_paused(const RuntimeInfo& info, uint32_t connect_wait_ms);
  // What one operation's steps share; lives in Op::api, so dropping the op closes everything.
  struct State {
    uv_timer_t* timer = nullptr;
    std::function<void()> timer_fn;
    std::unique_ptr<QmpClient> qmp;
    std::unique_ptr<VmmExitWatch> exit;
    bool migrate_cancel_sent = false;
    // The identity line's connection while the guest's acknowledgement is awaited (await_identity_ack).
    UniqueFd ack_fd;
    uv_poll_t* ack_poll = nullptr;
    std::function<void(IdentityAnswer, std::string_view)> ack_done;
    ~State() {
      close_and_free(ack_poll);
      close_and_free(timer);
    }
  };
  State& state(Op* op) {
    if (!op->api) {
      auto st = std::make_shared<State>();
      st->timer = new uv_timer_t;
      uv_timer_init(loop_, st->timer);
      st->timer->data = st.get();
      op->api = st;
    }
    return *static_cast<State*>(op->api.get());
  }
  void after(Op* op, uint64_t ms, std::function<void()> fn) {
    State& st = state(op);
    st.timer_fn = std::move(fn);
    uv_timer_start(st.timer, [](uv_timer_t* t) {
      auto* s = static_cast<State*>(t->data);
      auto fn = std::move(s->timer_fn);
      s->timer_fn = nullptr;
      fn();
    }, ms, 0);
  }

  std::vector<std::string> qemu_args(const SandboxSpec& spec, const RuntimeInfo& info) const;
  // Spawns QEMU with `args` in a network namespace of its own, created for it (kept in netns_) and, with
  // internet access, attached to the node's egress before QEMU runs.
  // The QEMU holding the sandbox's -pidfile when it is not the one `info` records, if there is one.
  static std::optional<VmmProcess> unrecorded_qemu(const RuntimeInfo& info);
  // Kills that QEMU; with `wait`, also waits (5 s at most, blocking: for observe() at a node's start) until it
  // is gone.
  static Status stop_unrecorded_qemu(const SandboxSpec& spec, const RuntimeInfo& info, bool wait = true);
  // `done` once no unrecorded QEMU holds the op's pidfile, polled on the op's timer (`tries` x 10 ms at most).
  void wait_for_unrecorded_exit(Op* op, int tries, std::function<void(Status)> done);
  Result<VmmProcess> spawn_qemu(const SandboxSpec& spec, const std::vector<std::string>& args,
                                const std::string& log);
  // The network namespace of the running QEMU `info` describes: the one it was spawned in, or (adopted after
  // a node restart) the one /proc/<pid>/ns/net shows while that pid is still this QEMU.
  Result<int> netns_of(const std::string& sandbox_id, const RuntimeInfo& info);
  // A non-blocking TCP socket created inside `netns`.
  Result<UniqueFd> socket_in(int netns, const std::string& sandbox_id);
  Result<RuntimeInfo> prepare(const SandboxSpec& spec, const std::string& sandbox_dir) const;
  // One start's boot attempts: a stalled boot (no ready marker by the deadline) is killed and retried.
  struct Boot {
    SandboxSpec spec;
    std::vector<std::string> args;
    std::string console;
    std::string log;
    uint32_t attempt = 1;
    uint64_t deadline_ms = 0;
    bool timed_out = false;
    StepDone done;
  };
  void boot_attempt(Op* op, std::shared_ptr<Boot> boot);
  void poll_boot(Op* op, std::shared_ptr<Boot> boot);
  Step connect_step(bool just_spawned);
  Step command_step(std::string command, nlohmann::json args = nullptr);
  Step hmp_step(std::string command_line, std::optional<std::string> expect);
  static bool manages_live_rule(const RuntimeInfo& info, uint16_t port);
  Step ignore_shared_step(bool ignore_shared);
  // Saves the guest's state to `tmp`; `ignore_shared`: without its shared RAM (the memfd), devices only.
  Step migrate_step(const std::string& tmp, bool cancellable, bool ignore_shared);
  // Loads the saved state at `path` into the QEMU just spawned with -incoming defer; `ignore_shared`: a
  // state without RAM, whose RAM the QEMU maps from the snapshot's file.
  Step incoming_step(std::string path, bool ignore_shared);
  // Copies the file `from` to `to` (GuestDisks::copy: sparse, on the pool).
  Step copy_step(std::string from, std::string to);
  // `cont` after a checkpoint's `stop` at *stopped_at: records in result->pause_ms how long the guest stood.
  Step cont_after_checkpoint_step(std::shared_ptr<std::chrono::steady_clock::time_point> stopped_at,
                                  std::shared_ptr<VmCheckpoint> result);
  // A disk checkpoint of a guest whose QEMU runs (the guest running, or paused in memory): a backup job
  // (noderuntime/disk_delta.h) of what changed since the last one, or of the whole overlay.
  void checkpoint_live_disk(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                            bool running, std::function<void(Result<VmCheckpoint>)> done);
  // The steps of a backup job of the guest's disk (`overlay`) into files.dir: planned, run, and its node
  // taken away. `on_transaction` gets how long the transaction took. undo_disk_backup() is what a failure
  // after them needs; disk_backup_noted_steps(), once the rest of the checkpoint went well, make it the
  // sandbox's last checkpoint and remove the bitmaps nothing will start from.
  std::vector<Step> disk_backup_steps(const CheckpointFiles& files, const std::string& overlay,
                                      const std::string& sandbox_dir, std::shared_ptr<DiskDeltaPlan> plan,
                                      std::function<void(double)> on_transaction);
  std::vector<Step> disk_backup_noted_steps(const CheckpointFiles& files, const std::string& sandbox_dir,
                                            std::shared_ptr<DiskDeltaPlan> plan);
  void undo_disk_backup(Op* op, const std::string& id, StepDone done);
  // Removes the guest disk's bitmaps `names`, one after the other; best effort (`done` gets success).
  void remove_bitmaps(Op* op, std::vector<std::string> names, StepDone done);
  // Waits for the backup job to conclude (polled), then dismisses it; a failed job is a failure.
  void await_backup_job(Op* op, uint64_t started_ms, StepDone done);
  // Takes away what an interrupted disk checkpoint left in QEMU (its job, cancelled first; its node). Best
  // effort: `done` always gets success.
  void drop_checkpoint_node(Op* op, StepDone done, int rounds = 0);
  // A memory checkpoint of a hibernated guest: its saved state (RAM included) and disk overlay copied; no
  // QEMU runs.
  void checkpoint_hibernated(const SandboxSpec& spec, const RuntimeInfo& info, const std::string& dir,
                             std::function<void(Result<VmCheckpoint>)> done);
  // Sets the guest clock and tells the guest who it is (id, hostname, a fresh RNG seed): after every resume
  // and restore, and after a start, where a memory snapshot's guest still believes it is its source.
  Step clock_step(const SandboxSpec& spec);
  // The identity line itself (see the header), best effort: a guest whose clock listener is gone still runs.
  // The line's connection comes back, for await_identity_ack, when the guest answers lines (kIdentityAnswers)
  // or it carried SSH keys the guest has not acknowledged yet (`digest` set); else an invalid fd.
  struct SentIdentity {
    UniqueFd fd;
    std::optional<size_t> digest;
  };
  SentIdentity send_identity(const SandboxSpec& spec, const RuntimeInfo& info);
  // Sends `line` to the guest's identity port; the connection, on which its answer comes, or a failure.
  Result<UniqueFd> send_guest_line(const SandboxSpec& spec, const RuntimeInfo& info, const std::string& line);
  // Waits, at most `limit_ms`, for the guest's answer on `fd`; `done` gets what it said, or kNone/kClosed.
  void await_guest_answer(Op* op, UniqueFd fd, uint64_t limit_ms,
                          std::function<void(IdentityAnswer, std::string_view)> done);
  // Asks a guest whose agent applies identity lines to write out what its filesystems hold in memory
  // ("sync <secret>"), so that a copy of its disk taken next has every file written before the checkpoint.
  // Best effort: a guest that cannot be asked or does not answer is copied as a power cut would leave it,
  // and the node's log says so.
  Step guest_sync_step(const SandboxSpec& spec);
  // Waits, at most kIdentityAckMs, for the guest to say it applied the line: its clock, so that the first
  // request a wake lets through sees the right time, and its SSH files, so that those connections find the
  // node's keys as they are now (a key removed while the sandbox slept is refused). The keys acknowledged
  // are remembered per sandbox.
  void await_identity_ack(Op* op, SentIdentity sent, StepDone done);
  // Per sandbox: the SSH fields its guest acknowledged last (a hash of them).
  std::map<std::string, size_t> acknowledged_keys_;
  // The guest's SSH port when this instance forwards it (sandboxes started before guests had SSH do not).
  uint16_t forwarded_ssh_port(const SandboxSpec& spec, const RuntimeInfo& info) const {
    const uint16_t port = agent_ssh_port(spec);
    return port != 0 && info.driver_data.contains(kPortPrefix + std::to_string(port)) ? port : 0;
  }
  // What a failed start leaves: the namespace we hold and, with internet access, its chain.
  void forget_failed_start(const SandboxSpec& spec) {
    netns_.erase(spec.id);
    if (egress_ != nullptr) egress_->detach(spec);
  }
  // Spawns QEMU waiting for a saved state (args end in -incoming defer) as `op`'s instance.
  Status spawn_incoming(Op* op, const SandboxSpec& spec, const std::vector<std::string>& args);
  // start() from a memory snapshot's files: the saved guest continues instead of booting.
  void start_from_memory(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done);
  void poll_migration(Op* op, StepDone done);
  Step settle_migration_step();
  void settle_migration(Op* op, StepDone done, bool cancel_sent);
  void poll_incoming(Op* op, uint64_t started_ms, StepDone done);
  static std::string state_path(const RuntimeInfo& info) { return info.sandbox_dir + "/qemu.state"; }
  std::string peer(const Op* op) const { return "qemu (sandbox " + op->sandbox_id + ")"; }

  ImageLayers image_layers_;
  SandboxEgress* egress_;  // the node's, shared with the process driver; null: no internet access here
  GuestDisks disks_;
  bool kvm_;
  std::string kernel_;
  std::string initrd_;
  // A member of the subclass, so it is destroyed (dropping its waiters) before VmmDriver's ops they reach.
  GuestImage image_;
  uint32_t boot_timeout_ms_;
  uint32_t boot_attempts_;
  uint16_t agent_port_;
  std::string ssh_keys_dir_;  // the node's registered SSH keys (noderuntime/ssh_keys.h), sent to guests with SSH
  uint64_t tsc_khz_;
  UniqueFd host_netns_;  // the node's: where the driver's thread returns after each switch
  std::string host_netns_error_;
  // Each QEMU's network namespace, kept open so a connect needs one setns() pair and no /proc lookup.
  struct Netns {
    VmmProcess process;
    UniqueFd fd;
  };
  std::map<std::string, Netns> netns_;
};

Result<RuntimeInfo> QemuDriver::prepare(const SandboxSpec& spec, const std::string& sandbox_dir) const {
  RuntimeInfo info;
  info.sandbox_dir = sandbox_dir;
  // The QMP socket and the command file live here: nobody but the node (root) may reach them.
  if (::chmod(sandbox_dir.c_str(), 0700) != 0) return fail_errno("chmod 0700 " + sandbox_dir, errno);
  info.driver_data[kApiSocket] = sandbox_dir + "/qmp.sock";
  // QEMU's listeners live in the VM's own network namespace, where no port is taken: each guest port is
  // forwarded from the same port on that namespace's loopback. (Records of QEMUs started before that keep
  // their host ports, which restore forwards the same way inside the new namespace.)
  std::vector<uint16_t> guest_ports = spec.exposed_ports;
  guest_ports.push_back(agent_port_);
  // SSH without an sshd: the host key is made once and kept with the sandbox, so it survives suspends,
  // hibernation and node restarts (known_hosts keeps working); the guest's root reads it, nobody else.
  if (uint16_t ssh = agent_ssh_port(spec); ssh != 0) {
    guest_ports.push_back(ssh);
    if (auto key = ensure_host_key(sandbox_dir + "/ssh", 0); !key) return key.failure();
  }
  for (uint16_t gp : guest_ports) info.driver_data[kPortPrefix + std::to_string(gp)] = std::to_string(gp);
  info.driver_data[kClockPort] = std::to_string(kClockGuestPort);
  if (Status s = write_command_file(command_path(sandbox_dir), command_script(spec)); !s) return s.failure();
  // A new one for each boot; a restore keeps the file its guest was booted with.
  const std::string secret = random_hex(kIdentitySecretHex / 2);
  if (secret.size() != kIdentitySecretHex) return fail(Error::kInternal, "no random bytes for the identity secret");
  if (Status s = write_private_file(sandbox_dir + "/" + kIdentitySecretFile, secret); !s) return s.failure();
  return info;
}

std::vector<std::string> QemuDriver::qemu_args(const SandboxSpec& spec, const RuntimeInfo& info) const {
  const std::string& dir = info.sandbox_dir;
  std::string append = "console=ttyS0 clocksource=tsc tsc=reliable quiet panic=-1";
  if (tsc_khz_ != 0) append += " tsc_early_khz=" + std::to_string(tsc_khz_);
  append += " sg.clock=" + std::to_string(kClockGuestPort) + " sg.agent=" + std::to_string(agent_port_);
  auto disk = info.driver_data.find(kDisk);
  if (disk != info.driver_data.end()) append += " sg.root=/dev/vda";
  const uint16_t ssh = forwarded_ssh_port(spec, info);
  if (ssh != 0) append += " sg.ssh=" + std::to_string(ssh);
  std::string netdev = user_netdev(spec.allow_internet_access);
  for (const auto& [key, value] : info.driver_data) {
    if (key.rfind(kPortPrefix, 0) == 0)
      netdev += ",hostfwd=tcp:127.0.0.1:" + value + "-:" + key.substr(std::strlen(kPortPrefix));
  }
  // Ports exposed after the create are in the spec only, forwarded from the same port (forward_port).
  for (uint16_t gp : spec.exposed_ports)
    if (!info.driver_data.contains(kPortPrefix + std::to_string(gp)))
      netdev += ",hostfwd=tcp:127.0.0.1:" + std::to_string(gp) + "-:" + std::to_string(gp);
  auto clock = info.driver_data.find(kClockPort);
  if (clock != info.driver_data.end())
    netdev += ",hostfwd=tcp:127.0.0.1:" + clock->second + "-:" + std::to_string(kClockGuestPort);
  const int cpus = std::max(1, static_cast<int>(std::ceil(spec.cpus)));
  const std::string memory_mb = std::to_string(std::max<uint32_t>(spec.memory_mb, 64));
  // A memfd, shared, so that a memory checkpoint saves the device state alone (x-ignore-shared) and copies
  // the RAM from the memfd; a guest from a memory snapshot maps the snapshot's RAM file privately, so the
  // sandboxes from one snapshot share every page none of them wrote.
  std::string ram = std::string("memory-backend-memfd,id=") + kRamBackendId + ",size=" + memory_mb + "M,share=on";
  if (auto file = info.driver_data.find(kRamFile); file != info.driver_data.end())
    ram = std::string("memory-backend-file,id=") + kRamBackendId + ",size=" + memory_mb +
          "M,mem-path=" + qemu_opt_value(file->second) + ",share=off";
  std::vector<std::string> args = {"-name", "sandgate-" + spec.id,
          "-M", std::string("microvm,memory-backend=") + kRamBackendId,
          "-object", ram,
          "-accel", kvm_ ? "kvm" : "tcg",
          "-cpu", kvm_ ? "host" : "max",
          "-m", memory_mb,
          "-smp", std::to_string(cpus),
          "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
          "-chardev", "file,id=console,append=on,path=" + dir + "/console.log",
          "-serial", "chardev:console",
          "-qmp", "unix:" + info.driver_data.at(kApiSocket) + ",server=on,wait=off",
          "-pidfile", dir + "/" + kPidFile,
          "-kernel", kernel_, "-initrd", initrd_, "-append", append,
          "-fw_cfg", std::string("name=") + kGuestCommandFwCfg + ",file=" + command_path(dir),
          "-netdev", netdev, "-device", "virtio-net-device,netdev=net0"};
  if (ssh != 0)
    for (const std::string& a : {std::string("-fw_cfg"), std::string("name=") + kGuestSshHostKeyFwCfg +
                                                            ",file=" + host_key_path(dir + "/ssh")})
      args.push_back(a);
  // Sandboxes booted before identity secrets have none (their guests' init does not ask for one).
  if (const std::string secret = dir + "/" + kIdentitySecretFile; ::access(secret.c_str(), R_OK) == 0)
    for (const std::string& a : {std::string("-fw_cfg"), std::string("name=") + kGuestIdentitySecretFwCfg + ",file=" + secret})
      args.push_back(a);
  if (disk != info.driver_data.end()) {
    for (const std::string& a : {std::string("-drive"), "file=" + disk->second + ",if=none,id=root,format=qcow2",
                                 std::string("-device"), std::string("virtio-blk-device,drive=root")})
      args.push_back(a);
  }
  return args;
}

void QemuDriver::start(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) {
  if (!spec.memory_snapshot_dir.empty()) return start_from_memory(spec, sandbox_dir, std::move(done));
  RuntimeInfo initial;
  initial.sandbox_dir = sandbox_dir;
  auto op = new_op(spec, "starting", initial);
  std::vector<Step> steps;
  // A first QEMU sandbox may wait here for minutes while the image is built; the loop keeps serving.
  steps.push_back([this](Op*, StepDone d) { image_.ensure(std::move(d)); });
  steps.push_back([this, spec](Op* o, StepDone d) {
    auto prepared = prepare(spec, o->info.sandbox_dir);
    if (!prepared) return d(prepared.failure());
    o->info = std::move(*prepared);
    d({});
  });
  // spec.image: the create's image, node.qemu_image by default; empty boots the initramfs alone. A sandbox
  // from a filesystem snapshot of a VM boots on that snapshot's disk, shared read-only under its own overlay.
  if (!spec.snapshot_disk.empty()) {
    steps.push_back([this, saved_disk = spec.snapshot_disk](Op* o, StepDone d) {
      if (::access(saved_disk.c_str(), R_OK) != 0)
        return d(fail(Error::kNotFound, "the snapshot's disk " + saved_disk + " cannot be read: " + std::strerror(errno)));
      disks_.overlay_on(saved_disk, o->info.sandbox_dir, [o, d](Result<std::string> disk) {
        if (!disk) return d(disk.failure());
        o->info.driver_data[kDisk] = *disk;
        d({});
      });
    });
  } else if (!spec.image.empty()) {
    steps.push_back([this, image = spec.image](Op* o, StepDone d) {
      if (!image_layers_) return d(fail(Error::kUnsupported, "image '" + image + "': this node has no image store"));
      auto trees = image_layers_(image);
      if (!trees) return d(fail(trees.error(), "image '" + image + "': " + trees.message()));
      // A first sandbox of the image may wait here while its base disk is made; the loop keeps serving.
      disks_.overlay(std::move(*trees), o->info.sandbox_dir, [o, d](Result<std::string> disk) {
        if (!disk) return d(disk.failure());
        o->info.driver_data[kDisk] = *disk;
        d({});
      });
    });
  }
  steps.push_back([this, spec](Op* o, StepDone d) {
    auto boot = std::make_shared<Boot>();
    boot->spec = spec;
    boot->args = qemu_args(spec, o->info);
    boot->console = o->info.sandbox_dir + "/console.log";
    boot->log = o->info.sandbox_dir + "/qemu.log";
    boot->done = std::move(d);
    boot_attempt(o, boot);
  });
  steps.push_back(clock_step(spec));
  run(std::move(op), std::move(steps), kill_step(), [this, spec, done = std::move(done)](Op* o, Status s) {
    if (!s) {
      forget_failed_start(spec);
      return done(s.failure());
    }
    done(o->info);
  });
}

Status QemuDriver::spawn_incoming(Op* op, const SandboxSpec& spec, const std::vector<std::string>& args) {
  std::error_code ec;
  std::filesystem::remove(op->info.driver_data[kApiSocket], ec);  // a dead QEMU's socket would fail the bind
  auto p = spawn_qemu(spec, args, op->info.sandbox_dir + "/qemu.log");
  if (!p) return p.failure();
  op->process = *p;
  op->spawned = true;
  op->info.pid = p->pid;
  op->info.start_time_ticks = p->start_time_ticks;
  return {};
}

void QemuDriver::start_from_memory(const SandboxSpec& spec, const std::string& sandbox_dir, RuntimeDone done) {
  RuntimeInfo initial;
  initial.sandbox_dir = sandbox_dir;
  auto op = new_op(spec, "starting from a memory snapshot", initial);
  const std::string saved = spec.memory_snapshot_dir + "/" + kMemoryState;
  const std::string saved_disk = spec.memory_snapshot_dir + "/" + kSnapshotDisk;
  const std::string saved_ram = spec.memory_snapshot_dir + "/" + kMemoryRam;
  // Snapshots taken of a guest whose RAM was no memfd have the RAM pages in their state instead.
  const bool ram_apart = ::access(saved_ram.c_str(), F_OK) == 0;
  std::vector<Step> steps;
  steps.push_back([this](Op*, StepDone d) { image_.ensure(std::move(d)); });
  steps.push_back([this, spec, saved, saved_ram, ram_apart](Op* o, StepDone d) {
    struct stat st{};
    if (::stat(saved.c_str(), &st) != 0 || st.st_size == 0)
      return d(fail(Error::kNotFound, "the memory snapshot has no saved state at " + saved));
    auto prepared = prepare(spec, o->info.sandbox_dir);
    if (!prepared) return d(prepared.failure());
    o->info = std::move(*prepared);
    if (ram_apart) {
      const uint64_t want = uint64_t{std::max<uint32_t>(spec.memory_mb, 64)} << 20;
      if (::stat(saved_ram.c_str(), &st) != 0) return d(fail_errno("stat " + saved_ram, errno));
      if (static_cast<uint64_t>(st.st_size) != want)
        return d(fail(Error::kInvalidArgument, "the memory snapshot's RAM file " + saved_ram + " holds " +
                                                   std::to_string(st.st_size) + " bytes, not the " +
                                                   std::to_string(want >> 20) + " MiB of its guest"));
      o->info.driver_data[kRamFile] = saved_ram;
    }
    if (::access((spec.memory_snapshot_dir + "/" + kIdentityAnswers).c_str(), F_OK) == 0)
      o->info.driver_data[kIdentityAnswers] = "1";
    d({});
  });
  // The snapshot's disk stays as it is, under this sandbox's own overlay; every sandbox from it shares it.
  if (::access(saved_disk.c_str(), F_OK) == 0) {
    steps.push_back([this, saved_disk](Op* o, StepDone d) {
      disks_.overlay_on(saved_disk, o->info.sandbox_dir, [o, d](Result<std::string> disk) {
        if (!disk) return d(disk.failure());
        o->info.driver_data[kDisk] = *disk;
        d({});
      });
    });
  }
  steps.push_back([this, spec](Op* o, StepDone d) {
    std::vector<std::string> args = qemu_args(spec, o->info);
    for (const char* a : {"-S", "-incoming", "defer"}) args.emplace_back(a);
    d(spawn_incoming(o, spec, args));
  });
  steps.push_back(connect_step(true));
  steps.push_back(incoming_step(saved, ram_apart));
  steps.push_back(command_step("cont"));
  steps.push_back(clock_step(spec));
  run(std::move(op), std::move(steps), kill_step(), [this, spec, done = std::move(done)](Op* o, Status s) {
    if (!s) {
      forget_failed_start(spec);
      return done(fail(s.error(), "from memory snapshot: " + s.message()));
    }
    done(o->info);
  });
}

void QemuDriver::checkpoint_memory(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                                   CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) {
  const std::string& dir = files.dir;
  if (source == CheckpointFrom::kHibernated) return checkpoint_hibernated(spec, info, dir, std::move(done));
  const bool paused = source == CheckpointFrom::kPaused;
  auto op = new_op(spec, "checkpointing", info);
  auto result = std::make_shared<VmCheckpoint>();
  auto stopped_at = std::make_shared<std::chrono::steady_clock::time_point>();
  const std::string state_file = dir + "/" + kMemoryState;
  auto ram = std::make_shared<std::string>();  // the guest's RAM memfd, if it has one
  std::vector<Step> steps;
  steps.push_back(connect_step(false));
  // A guest suspended in memory is stopped already: saved as it stands, and left stopped (pause_ms 0).
  if (!paused) {
    steps.push_back([this, stopped_at](Op* op, StepDone d) {
      *stopped_at = std::chrono::steady_clock::now();
      command_step("stop")(op, [d](Status s) {
        if (s) failpoint("memory-checkpoint:stopped");  // a node dying here leaves the guest stopped
        d(std::move(s));
      });
    });
  }
  // The disk first, while the guest stands and before the migration leaves the disk inactive: what the guest
  // wrote since its last checkpoint, or its whole overlay (as a disk checkpoint copies it).
  auto disk = info.driver_data.find(kDisk);
  auto plan = std::make_shared<DiskDeltaPlan>();
  if (disk != info.driver_data.end())
    for (Step& step : disk_backup_steps(files, disk->second, info.sandbox_dir, plan, [](double) {}))
      steps.push_back(std::move(step));
  // Stopped first, so the migration is one pass over a still guest (a live one would chase its writes).
  // With the RAM in a memfd the state is the devices' alone (KiB), and the RAM is copied from the memfd
  // while the guest still stands; otherwise every RAM page goes into the state.
  steps.push_back([this, ram, state_file](Op* op, StepDone d) {
    *ram = ram_memfd_path(static_cast<pid_t>(op->info.pid));
    migrate_step(state_file, false, !ram->empty())(op, std::move(d));
  });
  steps.push_back([this, ram, to = dir + "/" + kMemoryRam](Op* op, StepDone d) {
    if (ram->empty()) return d({});
    copy_step(*ram, to)(op, std::move(d));
  });
  if (info.driver_data.contains(kIdentityAnswers)) {
    steps.push_back([to = dir + "/" + kIdentityAnswers](Op*, StepDone d) { d(write_private_file(to, "")); });
  }
  if (!paused) {
    steps.push_back(cont_after_checkpoint_step(stopped_at, result));
  }
  // Noted once all of it went well: a failure before keeps the last checkpoint's bitmap for the next one.
  if (disk != info.driver_data.end())
    for (Step& step : disk_backup_noted_steps(files, info.sandbox_dir, plan)) steps.push_back(std::move(step));
  // Whatever failed, the guest runs again (a migration still going is cancelled first), or stays stopped;
  // what a disk backup left goes.
  Step on_failure = [this, paused, id = files.id](Op* op, StepDone d) {
    if (!state(op).qmp) return d({});
    undo_disk_backup(op, id, [this, op, d, paused](Status) {
      settle_migration(op, [this, op, d, paused](Status) {
        if (paused) return d({});
        state(op).qmp->execute("cont", nullptr, [d](Result<nlohmann::json>) { d({}); });
      }, false);
    });
  };
  run(std::move(op), std::move(steps), std::move(on_failure),
      [result, plan, state_file, dir, done = std::move(done)](Op*, Status s) {
        if (!s) return done(s.failure());
        struct stat st{};
        if (::stat(state_file.c_str(), &st) == 0) result->state_bytes = static_cast<uint64_t>(st.st_size);
        if (::stat((dir + "/" + kMemoryRam).c_str(), &st) == 0)
          result->ram_bytes = static_cast<uint64_t>(st.st_blocks) * 512;
        if (::stat((dir + "/" + kSnapshotDisk).c_str(), &st) == 0)
          result->disk_bytes = static_cast<uint64_t>(st.st_blocks) * 512;
        result->parent = plan->base_id;
        done(*result);
      });
}

void QemuDriver::checkpoint_disk(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                                 CheckpointFrom source, std::function<void(Result<VmCheckpoint>)> done) {
  auto disk = info.driver_data.find(kDisk);
  if (disk == info.driver_data.end())
    return done(fail(Error::kUnsupported, "sandbox " + spec.id +
                                              " boots the initramfs alone (no image): its files live in its memory, "
                                              "which only a memory checkpoint saves (--type memory)"));
  if (source != CheckpointFrom::kHibernated)
    return checkpoint_live_disk(spec, info, files, source == CheckpointFrom::kRunning, std::move(done));
  // Hibernated: no QEMU runs to copy only the changes, and QEMU saved the disk when it hibernated. The whole
  // overlay is copied as it stands.
  auto op = new_op(spec, "checkpointing its disk", info);
  const std::string copy = files.dir + "/" + kSnapshotDisk;
  run(std::move(op), {copy_step(disk->second, copy)}, nullptr, [copy, done = std::move(done)](Op*, Status s) {
    if (!s) return done(s.failure());
    VmCheckpoint result;
    struct stat st{};
    if (::stat(copy.c_str(), &st) == 0) result.disk_bytes = static_cast<uint64_t>(st.st_blocks) * 512;
    done(result);
  });
}

void QemuDriver::checkpoint_live_disk(const SandboxSpec& spec, const RuntimeInfo& info, const CheckpointFiles& files,
                                      bool running, std::function<void(Result<VmCheckpoint>)> done) {
  auto op = new_op(spec, "checkpointing its disk", info);
  auto result = std::make_shared<VmCheckpoint>();
  auto plan = std::make_shared<DiskDeltaPlan>();
  const std::string overlay = info.driver_data.at(kDisk);
  const std::string target = files.dir + "/" + kSnapshotDisk;
  const std::string sandbox_dir = info.sandbox_dir;
  std::vector<Step> steps;
  // A paused guest is copied as it stands: QEMU flushed the disk when it stopped the guest.
  if (running) steps.push_back(guest_sync_step(spec));
  steps.push_back(connect_step(false));
  for (Step& step : disk_backup_steps(files, overlay, sandbox_dir, plan, [result, running](double ms) {
         if (running) result->pause_ms = ms;
       }))
    steps.push_back(std::move(step));
  for (Step& step : disk_backup_noted_steps(files, sandbox_dir, plan)) steps.push_back(std::move(step));
  Step on_failure = [this, id = files.id](Op* o, StepDone d) {
    if (!state(o).qmp) return d({});
    undo_disk_backup(o, id, std::move(d));
  };
  run(std::move(op), std::move(steps), std::move(on_failure),
      [result, plan, target, done = std::move(done)](Op*, Status s) {
        if (!s) return done(s.failure());
        struct stat st{};
        if (::stat(target.c_str(), &st) == 0) result->disk_bytes = static_cast<uint64_t>(st.st_blocks) * 512;
        result->parent = plan->base_id;
        done(*result);
      });
}

std::vector<QemuDriver::Step> QemuDriver::disk_backup_steps(const CheckpointFiles& files, const std::string& overlay,
                                                          const std::string& sandbox_dir,
                                                          std::shared_ptr<DiskDeltaPlan> plan,
                                                          std::function<void(double)> on_transaction) {
  const std::string target = files.dir + "/" + kSnapshotDisk;
  std::vector<Step> steps;
  steps.push_back([this](Op* o, StepDone d) { drop_checkpoint_node(o, std::move(d)); });
  steps.push_back([this, plan, overlay, sandbox_dir, max_chain = files.max_chain](Op* o, StepDone d) {
    state(o).qmp->execute("query-named-block-nodes", {{"flat", true}},
                          [plan, overlay, sandbox_dir, max_chain, d](Result<nlohmann::json> r) {
                            if (!r) return d(r.failure());
                            auto planned =
                                plan_disk_delta(*r, overlay, read_last_disk_checkpoint(sandbox_dir), max_chain);
                            if (!planned) return d(planned.failure());
                            *plan = std::move(*planned);
                            d({});
                          });
  });
  // Disks inherited through a line of snapshots as many as the bound: copied into the overlay first (the
  // guest runs on), so that the new disk backs on the image's base alone.
  steps.push_back([this, plan](Op* o, StepDone d) {
    if (plan->stream_base_node.empty()) return d({});
    state(o).qmp->execute("block-stream", disk_stream_arguments(*plan), [this, o, d](Result<nlohmann::json> r) {
      if (!r) return d(r.failure());
      uv_update_time(loop_);
      await_backup_job(o, uv_now(loop_), d);
    });
  });
  steps.push_back([this, plan, target](Op*, StepDone d) {
    disks_.delta_target(plan->backing, plan->backing_format, plan->virtual_size, target,
                        [d](Result<std::string> made) { d(made ? Status() : Status(made.failure())); });
  });
  steps.push_back([this, target](Op* o, StepDone d) {
    command_step("blockdev-add", {{"driver", "qcow2"},
                                  {"node-name", kCheckpointNode},
                                  {"file", {{"driver", "file"}, {"filename", target}}},
                                  {"backing", nullptr}})(o, std::move(d));
  });
  // The guest runs on; its disk's requests drain for the moment the transaction takes, which is the pause.
  steps.push_back([this, plan, on_transaction, id = files.id](Op* o, StepDone d) {
    const auto started = std::chrono::steady_clock::now();
    state(o).qmp->execute("transaction", disk_delta_transaction(*plan, id),
                          [on_transaction, started, d](Result<nlohmann::json> r) {
                            on_transaction(std::chrono::duration<double, std::milli>(
                                               std::chrono::steady_clock::now() - started)
                                               .count());
                            if (r) failpoint("disk-checkpoint:copying");  // a node dying here leaves the job in QEMU
                            d(r ? Status() : Status(r.failure()));
                          });
  });
  steps.push_back([this](Op* o, StepDone d) {
    uv_update_time(loop_);
    await_backup_job(o, uv_now(loop_), std::move(d));
  });
  steps.push_back(command_step("blockdev-del", {{"node-name", kCheckpointNode}}));
  return steps;
}

std::vector<QemuDriver::Step> QemuDriver::disk_backup_noted_steps(const CheckpointFiles& files,
                                                                 const std::string& sandbox_dir,
                                                                 std::shared_ptr<DiskDeltaPlan> plan) {
  std::vector<Step> steps;
  // From now on the next checkpoint starts from this one, if the node records it.
  steps.push_back([sandbox_dir, plan, disk = files.final_dir + "/" + kSnapshotDisk, id = files.id](Op*, StepDone d) {
    const LastDiskCheckpoint last{id, disk, plan->chain};
    Status written = write_last_disk_checkpoint(sandbox_dir, last);
    if (written) failpoint("disk-checkpoint:copied");  // a node dying here leaves a base that is never recorded
    d(std::move(written));
  });
  // Best effort, each awaited (the connection closes with the op): a bitmap left costs a little per write.
  steps.push_back([this, plan](Op* o, StepDone d) {
    std::vector<std::string> gone = plan->stale_bitmaps;
    if (plan->delta()) gone.push_back(plan->base_id);
    remove_bitmaps(o, std::move(gone), std::move(d));
  });
  return steps;
}

void QemuDriver::remove_bitmaps(Op* op, std::vector<std::string> names, StepDone done) {
  if (names.empty()) return done({});
  const std::string name = names.back();
  names.pop_back();
  state(op).qmp->execute("block-dirty-bitmap-remove", {{"node", "root"}, {"name", name}},
                         [this, op, names = std::move(names), done](Result<nlohmann::json>) mutable {
                           remove_bitmaps(op, std::move(names), std::move(done));
                         });
}

void QemuDriver::undo_disk_backup(Op* op, const std::string& id, StepDone done) {
  drop_checkpoint_node(op, [this, op, id, done](Status) {
    state(op).qmp->execute("block-dirty-bitmap-remove", {{"node", "root"}, {"name", id}},
                           [done](Result<nlohmann::json>) { done({}); });
  });
}

void QemuDriver::await_backup_job(Op* op, uint64_t started_ms, StepDone done) {
  uv_update_time(loop_);
  if (uv_now(loop_) - started_ms > kBackupJobTimeoutMs)  // the failure path cancels it
    return done(fail(Error::kTimeout, "the disk's checkpoint job did not finish within " +
                                          std::to_string(kBackupJobTimeoutMs / 1000) + " s"));
  state(op).qmp->execute("query-jobs", nullptr, [this, op, started_ms, done](Result<nlohmann::json> r) {
    if (!r) return done(r.failure());
    auto job = backup_job_state(*r);
    if (!job) {
      // Concluded with an error: dismissed here, so the failure path finds no job to cancel.
      return state(op).qmp->execute("job-dismiss", {{"id", kCheckpointNode}},
                                    [done, failure = job.failure()](Result<nlohmann::json>) { done(failure); });
    }
    if (*job == BackupJob::kAbsent) return done(fail(Error::kInternal, "the disk's checkpoint job vanished"));
    if (*job == BackupJob::kConcluded)
      return state(op).qmp->execute("job-dismiss", {{"id", kCheckpointNode}}, [done](Result<nlohmann::json> d) {
        done(d ? Status() : Status(d.failure()));
      });
    after(op, kPollMs, [this, op, started_ms, done] { await_backup_job(op, started_ms, done); });
  });
}

void QemuDriver::drop_checkpoint_node(Op* op, StepDone done, int rounds) {
  // A job cancelled concludes within moments; past a few seconds the node delete below fails as it may.
  constexpr int kMaxRounds = 250;
  state(op).qmp->execute("query-jobs", nullptr, [this, op, done, rounds](Result<nlohmann::json> r) {
    auto job = r ? backup_job_state(*r) : Result<BackupJob>(BackupJob::kAbsent);
    const bool running = job && *job == BackupJob::kRunning;
    if (running && rounds < kMaxRounds) {
      if (rounds == 0) state(op).qmp->execute("job-cancel", {{"id", kCheckpointNode}}, [](Result<nlohmann::json>) {});
      return after(op, kPollMs, [this, op, done, rounds] { drop_checkpoint_node(op, done, rounds + 1); });
    }
    auto del = [this, op, done] {
      state(op).qmp->execute("blockdev-del", {{"node-name", kCheckpointNode}}, [done](Result<nlohmann::json>) {
        done({});
      });
    };
    if (running || (job && *job == BackupJob::kAbsent)) return del();
    state(op).qmp->execute("job-dismiss", {{"id", kCheckpointNode}}, [del](Result<nlohmann::json>) { del(); });
  });
}

QemuDriver::Step QemuDriver::copy_step(std::string from, std::string to) {
  return [this, from = std::move(from), to = std::move(to)](Op*, StepDone d) {
    disks_.copy(from, to, [d](Result<std::string> copied) { d(copied ? Status() : Status(copied.failure())); });
  };
}

QemuDriver::Step QemuDriver::cont_after_checkpoint_step(
    std::shared_ptr<std::chrono::steady_clock::time_point> stopped_at, std::shared_ptr<VmCheckpoint> result) {
  return [this, stopped_at, result](Op* op, StepDone d) {
    command_step("cont")(op, [stopped_at, result, d](Status s) {
      result->pause_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - *stopped_at).count();
      d(std::move(s));
    });
  };
}

QemuDriver::Step QemuDriver::guest_sync_step(const SandboxSpec& spec) {
  return [this, spec](Op* op, StepDone done) {
    const std::string& id = spec.id;
    // Only an agent applies lines other than the identity's (the init's busybox script would misread one).
    auto agent = op->info.driver_data.find(kAgentState);
    const std::string secret = read_identity_secret(op->info.sandbox_dir);
    if (agent == op->info.driver_data.end() || agent->second != "listening" ||
        !op->info.driver_data.contains(kIdentityAnswers) || secret.empty()) {
      spdlog::warn("sandbox {}: its guest cannot be asked to write out its files (no listening agent): the disk is "
                   "copied as a power cut would leave it", id);
      return done({});
    }
    auto sent = send_guest_line(spec, op->info, "sync " + secret + "\n");
    if (!sent) {
      spdlog::warn("sandbox {}: cannot ask the guest to write out its files ({}): the disk is copied as a power cut "
                   "would leave it", id, sent.message());
      return done({});
    }
    await_guest_answer(op, std::move(*sent), kGuestSyncMs,
                       [id, done = std::move(done)](IdentityAnswer answer, std::string_view said) {
                         if (answer != IdentityAnswer::kApplied)
                           spdlog::warn("sandbox {}: the guest did not confirm it wrote out its files ({}): the disk "
                                        "is copied as it stands", id,
                                        answer == IdentityAnswer::kNone ? "no answer in time"
                                        : answer == IdentityAnswer::kClosed ? "closed without an answer"
                                                                            : std::string(said).c_str());
                         done({});
                       });
  };
}

void QemuDriver::checkpoint_hibernated(const SandboxSpec& spec, const RuntimeInfo& info, const std::string& dir,
                                       std::function<void(Result<VmCheckpoint>)> done) {
  auto state = info.driver_data.find(kStateFile);
  if (state == info.driver_data.end() || ::access(state->second.c_str(), R_OK) != 0)
    return done(fail(Error::kNotFound, "sandbox " + spec.id + " has no saved state to checkpoint"));
  auto op = new_op(spec, "checkpointing", info);
  std::vector<Step> steps;
  // The saved state holds the RAM pages (a plain migration): the checkpoint has no RAM file of its own.
  steps.push_back(copy_step(state->second, dir + "/" + kMemoryState));
  if (auto disk = info.driver_data.find(kDisk); disk != info.driver_data.end()) {
    steps.push_back(copy_step(disk->second, dir + "/" + kSnapshotDisk));
  }
  if (info.driver_data.contains(kIdentityAnswers)) {
    steps.push_back([to = dir + "/" + kIdentityAnswers](Op*, StepDone d) { d(write_private_file(to, "")); });
  }
  run(std::move(op), std::move(steps), nullptr, [dir, done = std::move(done)](Op*, Status s) {
    if (!s) return done(s.failure());
    VmCheckpoint out;
    struct stat st{};
    if (::stat((dir + "/" + kMemoryState).c_str(), &st) == 0) out.state_bytes = static_cast<uint64_t>(st.st_size);
    if (::stat((dir + "/" + kSnapshotDisk).c_str(), &st) == 0) out.disk_bytes = static_cast<uint64_t>(st.st_blocks) * 512;
    done(out);
  });
}

void QemuDriver::boot_attempt(Op* op, std::shared_ptr<Boot> boot) {
  std::error_code ec;
  std::filesystem::remove(boot->console, ec);
  std::filesystem::remove(op->info.driver_data[kApiSocket], ec);
  auto p = spawn_qemu(boot->spec, boot->args, boot->log);
  if (!p) return boot->done(p.failure());
  op->process = *p;
  op->spawned = true;
  op->info.pid = p->pid;
  op->info.start_time_ticks = p->start_time_ticks;
  uv_update_time(loop_);
  boot->deadline_ms = uv_now(loop_) + boot_timeout_ms_;
  boot->timed_out = false;
  auto w = VmmExitWatch::start(loop_, *p, [this, op, boot] {
    uv_timer_stop(state(op).timer);
    op->info.pid = 0;
    op->info.start_time_ticks = 0;
    op->process = {};
    if (boot->timed_out && boot->attempt < boot_attempts_) {
      spdlog::warn("sandbox {}: boot attempt {} stalled for {} ms; retrying", op->sandbox_id, boot->attempt,
                   boot_timeout_ms_);
      ++boot->attempt;
      return after(op, 0, [this, op, boot] { boot_attempt(op, boot); });
    }
    if (boot->timed_out) {
      return boot->done(fail(Error::kTimeout, "the guest did not boot within " + std::to_string(boot_timeout_ms_) +
                                                  " ms, " + std::to_string(boot->attempt) + " attempts"));
    }
    // The kernel unpacks the initramfs into guest RAM; when it does not fit, the boot ends in a panic whose
    // last lines (no root to mount) hide that cause, so it is named, with what to change.
    if (read_file(boot->console).find(kInitramfsTooLarge) != std::string::npos) {
      return boot->done(fail(Error::kInvalidArgument,
                             "the guest's initramfs (" + initrd_ + ") does not fit in the sandbox's " +
                                 std::to_string(boot->spec.memory_mb) +
                                 " MiB of memory (the guest kernel said \"" + kInitramfsTooLarge +
                                 "\"): create it with more memory"));
    }
    // QEMU's own log is empty when the guest ended itself (a kernel panic): then the console's last lines
    // say why.
    std::string why = tail_of(boot->log, 600);
    if (why.empty()) why = "the guest stopped; its console ended with: " + tail_of(boot->console, 600);
    boot->done(fail(Error::kUnavailable, "qemu exited during boot: " + why));
  });
  if (!w) return boot->done(w.failure());
  state(op).exit = std::move(*w);
  after(op, kPollMs, [this, op, boot] { poll_boot(op, boot); });
}

void QemuDriver::poll_boot(Op* op, std::shared_ptr<Boot> boot) {
  std::string console = read_file(boot->console);
  if (console.find(kGuestReadyMarker) != std::string::npos) {
    state(op).exit.reset();
    if (std::string agent = guest_agent_state(console); !agent.empty()) op->info.driver_data[kAgentState] = agent;
    else op->info.driver_data.erase(kAgentState);
    if (console.find(kGuestIdentityMarker) != std::string::npos) op->info.driver_data[kIdentityAnswers] = "1";
    else op->info.driver_data.erase(kIdentityAnswers);
    if (op->info.driver_data.count(kAgentState) && op->info.driver_data[kAgentState] != "listening")
      spdlog::warn("sandbox {}: the guest's agent is {}: the SDK route (exec, files, health) will refuse it",
                   op->sandbox_id, op->info.driver_data[kAgentState]);
    return boot->done({});
  }
  uv_update_time(loop_);
  if (uv_now(loop_) >= boot->deadline_ms) {
    boot->timed_out = true;
    if (Status s = kill_vmm(op->process); !s) spdlog::warn("sandbox {}: {}", op->sandbox_id, s.message());
    return;  // the exit watch retries or fails
  }
  after(op, kPollMs, [this, op, boot] { poll_boot(op, boot); });
}

QemuDriver::Step QemuDriver::connect_step(bool just_spawned) {
  return [this, just_spawned](Op* op, StepDone done) {
    QmpOptions o;
    o.connect_wait_ms = just_spawned ? 5000 : 0;
    State& st = state(op);
    st.qmp = std::make_unique<QmpClient>(loop_, op->info.driver_data[kApiSocket], peer(op), o);
    st.qmp->connect(std::move(done));
  };
}

QemuDriver::Step QemuDriver::command_step(std::string command, nlohmann::json args) {
  return [this, command, args](Op* op, StepDone done) {
    state(op).qmp->execute(command, args, [done = std::move(done)](Result<nlohmann::json> r) {
      if (!r) return done(r.failure());
      done({});
    });
  };
}

QemuDriver::Step QemuDriver::clock_step(const SandboxSpec& spec) {
  return [this, spec](Op* op, StepDone done) {
    SentIdentity sent = send_identity(spec, op->info);
    if (!sent.fd.valid()) return done({});
    await_identity_ack(op, std::move(sent), std::move(done));
  };
}

void QemuDriver::await_identity_ack(Op* op, SentIdentity sent, StepDone done) {
  await_guest_answer(op, std::move(sent.fd), kIdentityAckMs,
                     [this, id = op->sandbox_id, digest = sent.digest, done = std::move(done)](IdentityAnswer answer,
                                                                                                std::string_view said) {
                       switch (answer) {
                         case IdentityAnswer::kApplied:
                           if (digest) acknowledged_keys_[id] = *digest;
                           break;
                         case IdentityAnswer::kFailed:
                           spdlog::warn("sandbox {}: the guest applied its identity line only in part: {}", id, said);
                           break;
                         case IdentityAnswer::kClosed:
                           spdlog::warn("sandbox {}: the guest closed its identity connection without an answer (a "
                                        "wrong secret, a malformed line, or no listener)", id);
                           break;
                         case IdentityAnswer::kNone:
                           spdlog::warn("sandbox {}: the guest did not answer its identity line within {} ms", id,
                                        kIdentityAckMs);
                           break;
                       }
                       done({});
                     });
}

void QemuDriver::await_guest_answer(Op* op, UniqueFd fd, uint64_t limit_ms,
                                    std::function<void(IdentityAnswer, std::string_view)> done) {
  State& st = state(op);
  st.ack_fd = std::move(fd);
  st.ack_poll = new uv_poll_t;
  uv_poll_init(loop_, st.ack_poll, st.ack_fd.get());
  st.ack_poll->data = &st;
  // Whichever comes first, the answer or the deadline, settles it; the other finds ack_done gone.
  st.ack_done = [this, op, done = std::move(done)](IdentityAnswer answer, std::string_view said) {
    State& s = state(op);
    uv_timer_stop(s.timer);
    close_and_free(s.ack_poll);
    s.ack_fd.reset();
    done(answer, said);
  };
  uv_poll_start(st.ack_poll, UV_READABLE, [](uv_poll_t* poll, int status, int) {
    auto* s = static_cast<State*>(poll->data);
    char answer[64];
    ssize_t n = -1;  // a poll error: the guest refused or reset the connection
    if (status == 0) {
      n = ::recv(s->ack_fd.get(), answer, sizeof answer, 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    }
    auto finish = std::move(s->ack_done);
    if (!finish) return;
    std::string_view said(answer, n > 0 ? static_cast<size_t>(n) : 0);
    while (!said.empty() && (said.back() == '\n' || said.back() == '\r')) said.remove_suffix(1);
    // The end, a reset or a refused connection without a word: the guest did not take the line.
    finish(said.starts_with("ok") ? IdentityAnswer::kApplied
           : n > 0                ? IdentityAnswer::kFailed
                                  : IdentityAnswer::kClosed,
           said);
  });
  after(op, limit_ms, [&st] {
    auto finish = std::move(st.ack_done);
    if (finish) finish(IdentityAnswer::kNone, {});
  });
}

namespace {

// One field of the identity line: base64 without line breaks, "-" for nothing.
std::string identity_field(const std::string& bytes) { return bytes.empty() ? "-" : base64_encode(bytes); }

}  // namespace

QemuDriver::SentIdentity QemuDriver::send_identity(const SandboxSpec& spec, const RuntimeInfo& info) {
  const std::string& id = spec.id;
  auto it = info.driver_data.find(kClockPort);
  auto port = it == info.driver_data.end() ? std::nullopt : parse_port(it->second);
  if (!port) return {};
  std::optional<size_t> keys_digest;  // set when the line carries SSH files the guest is to acknowledge
  // The fields the header lists. A guest booted before identity secrets (no file) gets the first four only,
  // which is all its init reads.
  std::string line = std::to_string(std::time(nullptr)) + " " + id + " " + (spec.name.empty() ? spec.id : spec.name);
  const std::string seed = random_hex(32);
  line += " " + (seed.empty() ? std::string("-") : seed);
  const std::string secret = read_identity_secret(info.sandbox_dir);
  const bool with_secret = !secret.empty();  // else not applied
  if (with_secret) {
    std::string host_key, keys;
    if (forwarded_ssh_port(spec, info) != 0) {
      auto files = read_guest_ssh_files(ssh_keys_dir_, info.sandbox_dir + "/ssh");
      if (files) {
        host_key = std::move(files->host_key);
        keys = std::move(files->authorized_keys);  // none registered: "-", an empty file in the guest
      } else {
        spdlog::warn("sandbox {}: the guest's SSH server gets no keys: {}", id, files.message());
      }
    }
    const auto sequence = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string ssh_fields = identity_field(host_key) + " " + identity_field(keys);
    line += " " + ssh_fields + " " + std::to_string(sequence) + " " + secret;
    if (!host_key.empty()) keys_digest = std::hash<std::string>{}(ssh_fields);
  }
  line += '\n';
  auto sent = send_guest_line(spec, info, line);
  if (!sent) {
    spdlog::warn("sandbox {}: cannot send the guest its identity: {}", id, sent.message());
    return {};
  }
  UniqueFd fd = std::move(*sent);
  auto known = acknowledged_keys_.find(id);
  const bool keys_known = !keys_digest || (known != acknowledged_keys_.end() && known->second == *keys_digest);
  if (keys_known && !(with_secret && info.driver_data.contains(kIdentityAnswers))) return {};
  return SentIdentity{std::move(fd), keys_known ? std::nullopt : keys_digest};
}

Result<UniqueFd> QemuDriver::send_guest_line(const SandboxSpec& spec, const RuntimeInfo& info,
                                             const std::string& line) {
  const std::string& id = spec.id;
  auto it = info.driver_data.find(kClockPort);
  auto port = it == info.driver_data.end() ? std::nullopt : parse_port(it->second);
  if (!port) return fail(Error::kUnsupported, "this guest has no identity port");
  // The forwarded clock port listens on the loopback of the VM's namespace only.
  auto netns = netns_of(id, info);
  auto sock = netns ? socket_in(*netns, id) : Result<UniqueFd>(netns.failure());
  if (!sock) return sock.failure();
  UniqueFd fd = std::move(*sock);
  // This runs on the node's loop, so nothing here may wait on the guest: the connect is to QEMU's own
  // listener on loopback (bounded all the same, for a QEMU that does not accept), and the line goes into a
  // send buffer made large enough for it (root may exceed net.core.wmem_max), from which the kernel delivers
  // it after the close, at whatever pace the guest reads.
  ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  const timeval connect_limit{1, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &connect_limit, sizeof connect_limit);
  const int buffer = static_cast<int>(std::min<size_t>(line.size() + 65536, 64u << 20));
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_SNDBUFFORCE, &buffer, sizeof buffer) != 0)
    ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDBUF, &buffer, sizeof buffer);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(*port);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return fail_errno("connect", errno);
  ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) | O_NONBLOCK);
  const ssize_t sent = ::send(fd.get(), line.data(), line.size(), MSG_NOSIGNAL);
  // A part of the line has no newline, and the guest applies none of it.
  if (sent != static_cast<ssize_t>(line.size()))
    return fail(Error::kIo, "the line did not fit its socket (" + std::to_string(sent < 0 ? 0 : sent) + " of " +
                                std::to_string(line.size()) + " bytes sent)");
  return fd;
}

// slirp's rules change through the human monitor (QMP has no command for them), which answers in text: a
// failure is a message, where an add says nothing and a remove "host forwarding rule for ... removed".
// `expect` nullopt: any answer will do.
QemuDriver::Step QemuDriver::hmp_step(std::string command_line, std::optional<std::string> expect) {
  return [this, command_line, expect](Op* op, StepDone done) {
    state(op).qmp->execute("human-monitor-command", {{"command-line", command_line}},
                           [command_line, expect, done = std::move(done)](Result<nlohmann::json> r) {
                             if (!r) return done(r.failure());
                             std::string said = r->is_string() ? r->get<std::string>() : std::string();
                             while (!said.empty() && (said.back() == '\n' || said.back() == '\r')) said.pop_back();
                             bool ok = !expect || (expect->empty() ? said.empty() : said.find(*expect) != std::string::npos);
                             if (!ok) return done(fail(Error::kUnavailable, "QEMU refused `" + command_line + "`: " + said));
                             done({});
                           });
  };
}

// Whether the live QEMU's rule for guest `port` is the one forward_port() manages (from the same port on the
// VM's loopback). Not when it is forwarded from another host port (a record older than the VM's own
// namespace) or there is no QEMU to tell: the next start or restore forwards it from the spec.
bool QemuDriver::manages_live_rule(const RuntimeInfo& info, uint16_t port) {
  auto it = info.driver_data.find(kPortPrefix + std::to_string(port));
  return (it == info.driver_data.end() || it->second == std::to_string(port)) &&
         vmm_alive(VmmProcess{info.pid, info.start_time_ticks});
}

void QemuDriver::forward_port(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port, Done done) {
  if (!manages_live_rule(info, port)) return done({});
  const std::string rule = "tcp:127.0.0.1:" + std::to_string(port);
  // The rule is removed first, unchecked, so a port closed and exposed again (or forwarded since the
  // start) ends with exactly one rule.
  run(new_op(spec, "forwarding port " + std::to_string(port), info),
      {connect_step(false), hmp_step("hostfwd_remove net0 " + rule, std::nullopt),
       hmp_step("hostfwd_add net0 " + rule + "-:" + std::to_string(port), "")},
      nullptr, [done = std::move(done)](Op*, Status s) { done(std::move(s)); });
}

void QemuDriver::unforward_port(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port, Done done) {
  if (!manages_live_rule(info, port)) return done({});
  run(new_op(spec, "closing port " + std::to_string(port), info),
      {connect_step(false), hmp_step("hostfwd_remove net0 tcp:127.0.0.1:" + std::to_string(port), "removed")}, nullptr,
      [done = std::move(done)](Op*, Status s) { done(std::move(s)); });
}

void QemuDriver::pause(const SandboxSpec& spec, const RuntimeInfo& info, Done done) {
  run(new_op(spec, "pausing", info), {connect_step(false), command_step("stop")}, nullptr,
      [done = std::move(done)](Op*, Status s) { done(std::move(s)); });
}

void QemuDriver::resume(const SandboxSpec& spec, const RuntimeInfo& info, Done done) {
  run(new_op(spec, "resuming", info),
      {connect_step(false), settle_migration_step(), command_step("cont"), clock_step(spec)},
      nullptr,
      [done = std::move(done)](Op*, Status s) { done(std::move(s)); });
}

// Capabilities stay set in QEMU from one migration to the next: every migration sets x-ignore-shared to
// what it needs, so that a hibernation after a memory checkpoint saves the RAM again.
QemuDriver::Step QemuDriver::ignore_shared_step(bool ignore_shared) {
  nlohmann::json caps = {{"capabilities", {{{"capability", "x-ignore-shared"}, {"state", ignore_shared}}}}};
  return command_step("migrate-set-capabilities", std::move(caps));
}

QemuDriver::Step QemuDriver::migrate_step(const std::string& tmp, bool cancellable, bool ignore_shared) {
  return [this, tmp, cancellable, ignore_shared](Op* op, StepDone done) {
    op->cancellable = cancellable;
    ignore_shared_step(ignore_shared)(op, [this, op, tmp, done](Status caps) {
      if (!caps) return done(caps);
      // The default bandwidth cap (128 MiB/s) is for live migration over a network; this is a local file.
      nlohmann::json params = {{"max-bandwidth", int64_t{1} << 40}};
      state(op).qmp->execute("migrate-set-parameters", params, [this, op, tmp, done](Result<nlohmann::json> r) {
        if (!r) return done(r.failure());
        nlohmann::json args = {{"uri", "exec:cat > " + sh_quote(tmp)}};
        state(op).qmp->execute("migrate", args, [this, op, done](Result<nlohmann::json> r2) {
          if (!r2) return done(r2.failure());
          poll_migration(op, done);
        });
      });
    });
  };
}

// VmmDriver::cancel() marks the op while it is cancellable (until the state file is committed); the next
// round of polling turns that into migrate_cancel, and QEMU then reports the migration cancelled.
void QemuDriver::poll_migration(Op* op, StepDone done) {
  State& st = state(op);
  if (op->cancel_requested && !st.migrate_cancel_sent) {
    st.migrate_cancel_sent = true;
    st.qmp->execute("migrate_cancel", nullptr, [](Result<nlohmann::json>) {});
  }
  st.qmp->execute("query-migrate", nullptr, [this, op, done](Result<nlohmann::json> r) {
    if (!r) return done(r.failure());
    const std::string status = r->value("status", "");
    if (status == "completed") return done({});
    if (status == "failed")
      return done(fail(Error::kIo, "migration to the state file failed: " + r->value("error-desc", "no reason given")));
    if (status == "cancelled")
      return done(fail(Error::kConflict, "sandbox " + op->sandbox_id + ": hibernate cancelled; still paused in memory"));
    after(op, kPollMs, [this, op, done] { poll_migration(op, done); });
  });
}

// A node killed during a hibernation leaves the migration running (or finishing) inside QEMU, and `cont`
// then fails with "Migration is not finalized yet". The guest is still whole in memory: cancel the
// migration and wait until QEMU reports it over before resuming.
QemuDriver::Step QemuDriver::settle_migration_step() {
  return [this](Op* op, StepDone done) { settle_migration(op, std::move(done), false); };
}

void QemuDriver::settle_migration(Op* op, StepDone done, bool cancel_sent) {
  state(op).qmp->execute("query-migrate", nullptr, [this, op, done, cancel_sent](Result<nlohmann::json> r) {
    if (!r) return done(r.failure());
    const std::string status = r->value("status", "none");
    if (status == "none" || status == "completed" || status == "failed" || status == "cancelled") return done({});
    if (!cancel_sent) state(op).qmp->execute("migrate_cancel", nullptr, [](Result<nlohmann::json>) {});
    after(op, kPollMs, [this, op, done] { settle_migration(op, done, true); });
  });
}

void QemuDriver::hibernate(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) {
  auto op = new_op(spec, "hibernating", info);
  const std::string final_path = state_path(info);
  const std::string tmp = final_path + ".tmp";
  Step commit = [final_path, tmp](Op* o, StepDone d) {
    if (Status s = fsync_path(tmp, O_RDONLY); !s) return d(s);
    if (::rename(tmp.c_str(), final_path.c_str()) != 0) return d(fail_errno("rename " + tmp, errno));
    (void)fsync_path(o->info.sandbox_dir, O_RDONLY | O_DIRECTORY);
    o->info.driver_data[kStateFile] = final_path;
    d({});
  };
  Step end_watch = [this](Op* o, StepDone d) {
    stop_watch(o->sandbox_id);  // the exit we cause now is not the instance's own
    // quit is a courtesy; SIGKILL (kill_step) follows either way and waits until the process is gone.
    state(o).qmp->execute("quit", nullptr, [d](Result<nlohmann::json>) { d({}); });
  };
  Step on_failure = [tmp](Op*, StepDone d) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    d({});
  };
  std::vector<Step> steps = {connect_step(false)};
  // A backup job a killed node left running would fail the migration (the disk cannot be inactivated).
  if (info.driver_data.contains(kDisk))
    steps.push_back([this](Op* o, StepDone d) { drop_checkpoint_node(o, std::move(d)); });
  for (Step& step : std::vector<Step>{migrate_step(tmp, true, false), cancel_point_step(), commit, end_watch, kill_step()})
    steps.push_back(std::move(step));
  run(std::move(op), std::move(steps), on_failure, [this, done = std::move(done)](Op* o, Status s) {
        if (!s) return done(s.failure());
        netns_.erase(o->sandbox_id);  // QEMU is gone, and its namespace with our fd
        RuntimeInfo saved = o->info;
        saved.pid = 0;
        saved.start_time_ticks = 0;
        saved.driver_data.erase(kRamFile);  // the state holds all of the RAM: the restored guest gets a memfd
        done(saved);
      });
}

void QemuDriver::poll_incoming(Op* op, uint64_t started_ms, StepDone done) {
  state(op).qmp->execute("query-status", nullptr, [this, op, started_ms, done](Result<nlohmann::json> r) {
    if (!r) return done(fail(r.error(), "loading the saved state failed (" + r.message() + "): " +
                                            tail_of(op->info.sandbox_dir + "/qemu.log", 400)));
    if (r->value("status", "") != "inmigrate") return done({});
    uv_update_time(loop_);
    if (uv_now(loop_) - started_ms > boot_timeout_ms_)
      return done(fail(Error::kTimeout, "the saved state did not load within " + std::to_string(boot_timeout_ms_) + " ms"));
    after(op, kPollMs, [this, op, started_ms, done] { poll_incoming(op, started_ms, done); });
  });
}

QemuDriver::Step QemuDriver::incoming_step(std::string path, bool ignore_shared) {
  return [this, path = std::move(path), ignore_shared](Op* op, StepDone done) {
    ignore_shared_step(ignore_shared)(op, [this, op, path, done](Status caps) {
      if (!caps) return done(caps);
      nlohmann::json args = {{"uri", "exec:cat " + sh_quote(path)}};
      state(op).qmp->execute("migrate-incoming", args, [this, op, done](Result<nlohmann::json> r) {
        if (!r) return done(fail(r.error(), r.message() + ": " + tail_of(op->info.sandbox_dir + "/qemu.log", 400)));
        uv_update_time(loop_);
        poll_incoming(op, uv_now(loop_), done);
      });
    });
  };
}

void QemuDriver::restore(const SandboxSpec& spec, const RuntimeInfo& info, RuntimeDone done) {
  auto op = new_op(spec, "restoring", info);
  op->info.pid = 0;
  op->info.start_time_ticks = 0;
  op->process = {};
  if (!op->info.driver_data.count(kStateFile)) op->info.driver_data[kStateFile] = state_path(info);
  const std::string path = op->info.driver_data[kStateFile];
  std::vector<Step> steps;
  steps.push_back([path](Op*, StepDone d) {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0 || st.st_size == 0)
      return d(fail(Error::kNotFound, "no saved state at " + path));
    d({});
  });
  std::vector<std::string> args = qemu_args(spec, op->info);
  for (const char* a : {"-S", "-incoming", "defer"}) args.emplace_back(a);
  steps.push_back([spec](Op* o, StepDone d) {
    // QEMU reads the fw_cfg file again at start (a VM hibernated by a driver without it has none yet); the
    // restored guest does not run its command again.
    if (Status s = write_command_file(command_path(o->info.sandbox_dir), command_script(spec)); !s) return d(s);
    // One QEMU per sandbox: a restore interrupted earlier may have left its own (observe() adopts one that
    // ran; one that did not is stopped here, and its -pidfile lock would refuse the new one anyway).
    d(stop_unrecorded_qemu(spec, o->info, false));
  });
  steps.push_back([this](Op* o, StepDone d) { wait_for_unrecorded_exit(o, 500, std::move(d)); });
  steps.push_back([this, spec, args = std::move(args)](Op* o, StepDone d) {
    // A hibernated VM's namespace died with its QEMU: the restored one gets a new one, same ports inside.
    d(spawn_incoming(o, spec, args));
  });
  steps.push_back([](Op*, StepDone d) {
    failpoint("qemu:restore:spawned");  // a node dying here leaves a QEMU that never ran the guest
    d({});
  });
  steps.push_back(connect_step(true));
  steps.push_back(incoming_step(path, false));
  steps.push_back(command_step("cont"));
  steps.push_back([](Op*, StepDone d) {
    failpoint("qemu:restore:continued");  // ... and here one whose guest runs on from the saved state
    d({});
  });
  steps.push_back(clock_step(spec));
  steps.push_back([](Op* o, StepDone d) {
    // The guest has moved on from the saved state; see the header.
    std::error_code ec;
    std::filesystem::remove(o->info.driver_data[kStateFile], ec);
    o->info.driver_data.erase(kStateFile);
    d({});
  });
  run(std::move(op), std::move(steps), kill_step(), [this, done = std::move(done)](Op* o, Status s) {
    if (!s) {
      netns_.erase(o->sandbox_id);
      return done(fail(s.error(), "sandbox " + o->sandbox_id + ": restore: " + s.message()));
    }
    done(o->info);
  });
}

Result<bool> QemuDriver::query_paused(const RuntimeInfo& info, uint32_t connect_wait_ms) {
  bool paused = false;
  std::string path = info.driver_data.count(kApiSocket) ? info.driver_data.at(kApiSocket) : "";
  Status s = run_on_private_loop([&](uv_loop_t* loop, std::function<void(Status)> done) -> std::shared_ptr<void> {
    auto qmp = std::make_shared<QmpClient>(loop, path, "qemu", QmpOptions{.connect_wait_ms = connect_wait_ms});
    QmpClient* q = qmp.get();
    q->connect([q, &paused, done](Status c) {
      if (!c) return done(c);
      q->execute("query-status", nullptr, [&paused, done](Result<nlohmann::json> r) {
        if (!r) return done(r.failure());
        paused = r->value("status", "") != "running";
        done({});
      });
    });
    return qmp;
  });
  if (!s) return s.failure();
  return paused;
}

ObservedInstance QemuDriver::observe(const SandboxSpec& spec, const RuntimeInfo& info) {
  ObservedInstance o;
  o.alive = vmm_alive(VmmProcess{info.pid, info.start_time_ticks});
  if (o.alive) {
    auto paused = query_paused(info);
    if (!paused) spdlog::warn("sandbox {}: cannot ask qemu whether it is paused: {}", spec.id, paused.message());
    o.paused = paused.ok() && *paused;
    return o;
  }
  // Not the recorded QEMU but another for this sandbox: a restore the node was killed in. Once its guest runs
  // (after "cont") the disk has moved on from the saved state, which must not be restored again: that QEMU
  // is the sandbox now. Before, the guest has not run since the save: that QEMU goes, the state stays.
  if (auto stray = unrecorded_qemu(info); stray && !info.sandbox_dir.empty()) {
    RuntimeInfo found = info;
    found.pid = stray->pid;
    found.start_time_ticks = stray->start_time_ticks;
    // Asked in short rounds while it lives: one that exits meanwhile costs no more than the round it ends in.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kStrayQmpWaitMs);
    auto paused = query_paused(found, kStrayQmpRoundMs);
    while (!paused && vmm_alive(*stray) && std::chrono::steady_clock::now() < deadline)
      paused = query_paused(found, kStrayQmpRoundMs);
    if (!paused) {
      // Whether its guest ran is unknown: killing it and restoring the saved state could put RAM older than
      // the disk back. It is left as it is, and the sandbox failed; removing the sandbox kills it.
      spdlog::error("sandbox {}: qemu {} (left by a restore before the node stopped) does not answer: {}", spec.id,
                    stray->pid, paused.message());
      return o;
    }
    if (!*paused) {
      spdlog::warn("sandbox {}: adopting qemu {}, which a restore started and ran before the node stopped", spec.id,
                   stray->pid);
      if (auto state = found.driver_data.find(kStateFile); state != found.driver_data.end()) {
        std::error_code ec;
        std::filesystem::remove(state->second, ec);
        found.driver_data.erase(state);
      }
      std::error_code ec;
      std::filesystem::remove(state_path(info), ec);
      o.alive = true;
      o.runtime = std::move(found);
      return o;
    }
    if (Status s = stop_unrecorded_qemu(spec, info); !s) spdlog::warn("sandbox {}: {}", spec.id, s.message());
  }
  // A hibernation whose commit happened but whose record was not written (node killed) counts too.
  auto it = info.driver_data.find(kStateFile);
  const std::string path = it != info.driver_data.end() ? it->second : state_path(info);
  struct stat st{};
  o.hibernated = !info.sandbox_dir.empty() && ::stat(path.c_str(), &st) == 0 && st.st_size > 0;
  return o;
}

Result<GuestSocket> QemuDriver::open_socket(const SandboxSpec& spec, const RuntimeInfo& info, uint16_t port) {
  auto it = info.driver_data.find(kPortPrefix + std::to_string(port));
  auto host_port = it == info.driver_data.end() ? std::nullopt : parse_port(it->second);
  const auto& exposed = spec.exposed_ports;
  if (it == info.driver_data.end() && std::find(exposed.begin(), exposed.end(), port) != exposed.end())
    host_port = port;  // exposed after the create: forward_port() and qemu_args() forward it from itself
  if (!host_port)
    return fail(Error::kUnreachable, "guest port " + std::to_string(port) + " is not forwarded");
  // QEMU accepts every forwarded connection on the host and resets it only once the guest refuses, which the
  // proxy would see after it sent the request: refuse here, with the reason, instead.
  if (port == agent_port_) {
    auto agent = info.driver_data.find(kAgentState);
    if (agent != info.driver_data.end() && agent->second == "none")
      return fail(Error::kUnreachable,
                  "the guest image has no sandgate-agent, so exec, files and health cannot work; rebuild it with "
                  "deploy/build-guest-image.sh DIR <build>/agent/sandgate-agent");
    if (agent != info.driver_data.end() && agent->second != "listening")
      return fail(Error::kUnreachable, "the guest's sandgate-agent did not start (state '" + agent->second +
                                           "'); see console.log in the sandbox directory");
  }
  auto netns = netns_of(spec.id, info);
  if (!netns) return netns.failure();
  auto fd = socket_in(*netns, spec.id);
  if (!fd) return fd.failure();
  return GuestSocket{.fd = std::move(*fd), .connected = false, .connect_port = *host_port};
}

Result<UniqueFd> QemuDriver::socket_namespace(const SandboxSpec& spec, const RuntimeInfo& info) {
  auto netns = netns_of(spec.id, info);
  if (!netns) return netns.failure();
  UniqueFd copy(::fcntl(*netns, F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) return fail_errno("sandbox " + spec.id + ": dup of QEMU's network namespace", errno);
  return copy;
}

std::optional<VmmProcess> QemuDriver::unrecorded_qemu(const RuntimeInfo& info) {
  if (info.sandbox_dir.empty()) return std::nullopt;
  const std::string pidfile = info.sandbox_dir + "/" + kPidFile;
  auto holder = pidfile_holder(pidfile);
  if (!holder || (holder->pid == info.pid && holder->start_time_ticks == info.start_time_ticks)) return std::nullopt;
  // The holder's command line names this pidfile: a pid reused between the lock query and now is not taken
  // for a QEMU (and killed).
  std::ifstream cmdline("/proc/" + std::to_string(holder->pid) + "/cmdline", std::ios::binary);
  const std::string args((std::istreambuf_iterator<char>(cmdline)), std::istreambuf_iterator<char>());
  if (args.find(pidfile) == std::string::npos) return std::nullopt;
  return holder;
}

void QemuDriver::wait_for_unrecorded_exit(Op* op, int tries, std::function<void(Status)> done) {
  if (!unrecorded_qemu(op->info)) return done({});
  if (tries <= 0) return done(fail(Error::kTimeout, "a qemu left by an earlier restore did not exit after SIGKILL"));
  after(op, 10, [this, op, tries, done = std::move(done)]() mutable {
    wait_for_unrecorded_exit(op, tries - 1, std::move(done));
  });
}

Status QemuDriver::stop_unrecorded_qemu(const SandboxSpec& spec, const RuntimeInfo& info, bool wait) {
  auto stray = unrecorded_qemu(info);
  if (!stray) return {};
  spdlog::warn("sandbox {}: killing qemu {}, which a restore or create started before the node stopped", spec.id,
               stray->pid);
  if (Status s = kill_vmm(*stray); !s) return s;
  if (!wait) return {};
  // SIGKILL is not refused; the wait is for the kernel to finish the exit (and release the lock).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (vmm_alive(*stray)) {
    if (std::chrono::steady_clock::now() > deadline)
      return fail(Error::kTimeout, "qemu " + std::to_string(stray->pid) + " did not exit within 5 s of SIGKILL");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return {};
}

Result<VmmProcess> QemuDriver::spawn_qemu(const SandboxSpec& spec, const std::vector<std::string>& args,
                                          const std::string& log) {
  const std::string& sandbox_id = spec.id;
  if (!host_netns_.valid())
    return fail(Error::kUnsupported, "the QEMU driver cannot find the node's network namespace: " + host_netns_error_);
  netns_.erase(sandbox_id);  // an earlier instance's (a failed boot attempt): that QEMU is gone
  auto ns = create_netns(host_netns_.get());
  if (!ns) return fail(ns.error(), "sandbox " + sandbox_id + ": " + ns.message());
  if (spec.allow_internet_access) {
    // Before QEMU runs, so the guest's first connection already finds its route. The namespace has no
    // process yet: the tools enter it through our own fd. A new namespace per spawn (a restore, a boot
    // attempt) is attached again, which replaces the slot's earlier links.
    if (egress_ == nullptr)
      return fail(Error::kUnsupported, "sandbox " + sandbox_id + ": internet access: this node's QEMU driver has no egress");
    if (Status s = egress_->attach(spec, "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(ns->get())); !s)
      return fail(s.error(), "sandbox " + sandbox_id + ": " + s.message());
  }
  // posix_spawn's child starts in the namespace of the thread that spawns it.
  std::optional<Result<VmmProcess>> spawned;
  if (Status s = in_netns(ns->get(), host_netns_.get(), [&] {
        spawned = spawn_vmm("qemu", options_.binary, args, log, {.cwd = {}, .batch_scheduling = options_.batch_scheduling});
      });
      !s) {
    if (spawned && *spawned) (void)kill_vmm(**spawned);
    return s.failure();
  }
  if (!*spawned) return spawned->failure();
  netns_[sandbox_id] = Netns{**spawned, std::move(*ns)};
  return **spawned;
}

Result<int> QemuDriver::netns_of(const std::string& sandbox_id, const RuntimeInfo& info) {
  const VmmProcess process{info.pid, info.start_time_ticks};
  auto it = netns_.find(sandbox_id);
  if (it != netns_.end() && it->second.process.pid == process.pid &&
      it->second.process.start_time_ticks == process.start_time_ticks)
    return it->second.fd.get();
  if (process.pid <= 0) return fail(Error::kUnavailable, "sandbox " + sandbox_id + ": qemu is not running");
  const std::string path = "/proc/" + std::to_string(process.pid) + "/ns/net";
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return fail(Error::kUnavailable, "sandbox " + sandbox_id + ": open " + path + ": " + std::strerror(errno));
  // Checked after opening, so the namespace cannot be that of a process that reused the pid.
  if (!vmm_alive(process)) return fail(Error::kUnavailable, "sandbox " + sandbox_id + ": qemu is not running");
  it = netns_.insert_or_assign(sandbox_id, Netns{process, std::move(fd)}).first;
  return it->second.fd.get();
}

Result<UniqueFd> QemuDriver::socket_in(int netns, const std::string& sandbox_id) {
  if (!host_netns_.valid())  // no way back: never leave the node's thread in a VM's namespace
    return fail(Error::kUnsupported, "the QEMU driver cannot find the node's network namespace: " + host_netns_error_);
  UniqueFd sock;
  int socket_errno = 0;
  Status s = in_netns(netns, host_netns_.get(), [&] {
    sock = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    socket_errno = errno;
  });
  if (!s) return fail(s.error(), "sandbox " + sandbox_id + ": " + s.message());
  if (!sock.valid()) return fail_errno("sandbox " + sandbox_id + ": socket", socket_errno);
  return sock;
}

// spawn_vmm wants a path; the config's default is a bare name looked up in PATH.
std::string resolve_binary(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "/usr/bin/" + name;  // start() then reports it missing with this path
}

}  // namespace

std::unique_ptr<Driver> make_qemu_driver(uv_loop_t* loop, const NodeConfig& cfg, uint16_t agent_port,
                                         ImageLayers image_layers, SandboxEgress* egress) {
  return std::make_unique<QemuDriver>(loop, cfg, agent_port, resolve_binary(cfg.qemu_binary), std::move(image_layers),
                                      egress);
}

}  // namespace sg
