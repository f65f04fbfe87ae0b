// The QEMU driver's fault handling against a fake `qemu` (a Python script given as node.qemu_binary) that
// boots or stalls, dies during boot or during a migration, answers QMP errors, and loads or rejects a saved
// state. The real QEMU runs in tests/e2e/qemu_test.cc.
#include "noderuntime/qemu_driver.h"

#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>

#include "common/subprocess.h"
#include "noderuntime/disk_delta.h"
#include "noderuntime/guest_disk.h"
#include "noderuntime/hypervisor_client.h"
#include "noderuntime/sandbox_egress.h"
#include "snapshot/snapshot_store.h"
#include "tests/netns.h"
#include "tests/unit/node/fake_hypervisor.h"

namespace sg {
namespace {

using testing::TempDir;
using testing::TestLoop;

// FAKE_QEMU_MODE (read at spawn): ok | die-at-boot | initramfs-too-large | stall | qmp-error | migrate-die |
// migrate-fail.
// FAKE_QEMU_QMP_DELAY_MS (read at spawn): how long the fake waits between taking its -pidfile lock and creating
// its QMP socket (QEMU takes the lock first too; under load that gap grows).
// FAKE_QEMU_ACK_DELAY_MS (read at spawn): how long the guest port 1021 (the identity listener) takes before it
// acknowledges a line that carries SSH files ("ok"); each line is appended to <sandbox dir>/identity-lines
// and each acknowledgement, as it is sent, to <sandbox dir>/identity-acks.
// FAKE_QEMU_ANSWERS (read at spawn): when set, the console says "SANDGATE-GUEST-IDENTITY answers" and every
// identity line is answered "ok" (after FAKE_QEMU_ACK_DELAY_MS, recorded in identity-acks), as the guest's
// init does since it sets the clock first; unset, only lines with SSH files are (an older image).
// FAKE_QEMU_AGENT (read at spawn): when set, the console says "SANDGATE-GUEST-AGENT <it>" before the ready
// line, as the guest's init does; unset, no such line (an image older than that line).
// A line "sync <secret>" on that port (a disk checkpoint's) appends "sync while <QMP status>" to
// <sandbox dir>/syncs and is answered like the others.
// Every spawn appends its pid to <sandbox dir>/spawns and its network namespace to <sandbox dir>/netns, and
// writes its argv (NUL-separated) to <sandbox dir>/argv. Each `hostfwd=tcp:127.0.0.1:<port>-:...` rule gets
// a listener on that port (in the fake's own namespace) that answers "FAKE-GUEST <port>\n" and closes.
// A saved state is the bytes "SANDGATE-FAKE-STATE". With a memory-backend-memfd the fake holds a memfd of
// the backend's size (as QEMU names it) with "SANDGATE-FAKE-RAM" at its start and in its middle, holes
// elsewhere; a migration with x-ignore-shared on then saves "SANDGATE-FAKE-DEVICES" only, which loads only
// with x-ignore-shared on into a memory-backend-file (share=off) whose file starts with that RAM.
constexpr const char* kFakeQemu = R"PY(#!/usr/bin/env python3
import os, sys
args = sys.argv[1:]
mode = os.environ.get("FAKE_QEMU_MODE", "ok")
console = [a.split("path=")[1] for a in args if a.startswith("file,id=console")][0]
qmp = args[args.index("-qmp") + 1][len("unix:"):].split(",")[0]
d = os.path.dirname(qmp)
# Recorded before anything slower (the other imports), so a loaded machine still sees every spawn.
with open(os.path.join(d, "spawns"), "a") as f:
    f.write("%d\n" % os.getpid())
with open(os.path.join(d, "netns"), "a") as f:
    f.write(os.readlink("/proc/self/ns/net") + "\n")
with open(os.path.join(d, "argv"), "w") as f:
    f.write("\0".join(args))
import fcntl, json, shutil, socket, subprocess, threading, time
if "-pidfile" in args:  # as util/oslib-posix.c qemu_write_pidfile: a lock on the whole file, or exit
    pidfile = open(args[args.index("-pidfile") + 1], "a")
    try:
        fcntl.lockf(pidfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        sys.stderr.write("qemu-system-x86_64: cannot create PID file: Cannot lock pid file\n")
        sys.exit(1)
    pidfile.truncate(0); pidfile.write("%d\n" % os.getpid()); pidfile.flush()
time.sleep(int(os.environ.get("FAKE_QEMU_QMP_DELAY_MS", "0")) / 1000)
if mode == "die-at-boot":
    sys.stderr.write("qemu-system-x86_64: Could not set up host forwarding rule 'tcp:127.0.0.1:1-:80'\n")
    sys.exit(1)
if mode == "initramfs-too-large":  # what Linux prints, then the panic that hides it (QEMU's own log is empty)
    with open(console, "a") as f:
        f.write("[    1.2] Initramfs unpacking failed: write error\n[    1.4] Kernel panic - not syncing: VFS: "
                "Unable to mount root fs on unknown-block(0,0)\n[    1.5]  mount_block_root+0x14e/0x1e6\n")
    sys.exit(0)
def identity(c):  # the guest's identity handler: records the line, acknowledges SSH files after a delay
    line = c.makefile("rb").readline()
    with open(os.path.join(d, "identity-lines"), "ab") as f:
        f.write(line)
    fields = line.split()
    if fields[:1] == [b"sync"]:  # a disk checkpoint's request: noted with where the guest stands
        with open(os.path.join(d, "syncs"), "a") as f:
            f.write("sync while %s\n" % status)
    if "FAKE_QEMU_ANSWERS" in os.environ or (len(fields) == 8 and fields[4] != b"-"):
        time.sleep(int(os.environ.get("FAKE_QEMU_ACK_DELAY_MS", "0")) / 1000)
        with open(os.path.join(d, "identity-acks"), "a") as f:
            f.write("ok\n")
        c.sendall(b"ok\n")
    c.close()
def serve(l, port):
    while True:
        c, _ = l.accept()
        if port == 1021:
            threading.Thread(target=identity, args=(c,), daemon=True).start()
            continue
        c.sendall(b"FAKE-GUEST %d\n" % port)
        c.close()
listening = set()
def forward(port):  # listening before it returns, as QEMU's rule does before its answer
    if port in listening: return  # a rule removed and added again: the fake's listener stayed
    listening.add(port)
    l = socket.socket()
    l.bind(("127.0.0.1", port))
    l.listen(8)
    threading.Thread(target=serve, args=(l, port), daemon=True).start()
rules = set()
for rule in args[args.index("-netdev") + 1].split(","):
    if rule.startswith("hostfwd=tcp:127.0.0.1:"):
        rules.add(int(rule.split(":")[2].split("-")[0]))
        forward(int(rule.split(":")[2].split("-")[0]))
incoming = "-incoming" in args
backend = [a for a in args if a.startswith("memory-backend-")]
backend = dict(kv.split("=", 1) for kv in backend[0].split(",")[1:]) if backend else {}
ram = None
if [a for a in args if a.startswith("memory-backend-memfd")]:
    ram = os.memfd_create("memory-backend-memfd")
    size = int(backend["size"].rstrip("M")) << 20
    os.ftruncate(ram, size)
    os.pwrite(ram, b"SANDGATE-FAKE-RAM", 0)
    os.pwrite(ram, b"SANDGATE-FAKE-RAM", size // 2)
ignore_shared = False
# The guest's disk (-drive ...,id=root): its dirty bitmaps kept beside it, as QEMU keeps them in the qcow2.
disk = [a.split(",")[0][len("file="):] for a in args if a.startswith("file=") and ",id=root," in a]
disk = disk[0] if disk else None
def bitmaps():
    try:
        with open(disk + ".bitmaps") as b: return json.load(b)
    except FileNotFoundError: return []
def set_bitmaps(names):
    with open(disk + ".bitmaps", "w") as b: json.dump(names, b)
block_nodes, jobs = {}, {}
def block_command(cmd, a):  # (return value, error or None)
    if cmd == "query-named-block-nodes":
        img = json.loads(subprocess.run(["qemu-img", "info", "-U", "--output=json", disk], capture_output=True).stdout)
        inconsistent = mode == "bitmap-inconsistent"
        return [{"node-name": "#block1", "drv": "qcow2",
                 "image": {"filename": disk, "virtual-size": img["virtual-size"],
                           "backing-filename": img.get("backing-filename"),
                           "full-backing-filename": img.get("full-backing-filename"),
                           "backing-filename-format": img.get("backing-filename-format")},
                 "dirty-bitmaps": [dict({"name": n, "recording": True, "persistent": True, "busy": False},
                                        **({"inconsistent": True} if inconsistent else {})) for n in bitmaps()]},
                {"node-name": "#block0", "drv": "file", "image": {"filename": disk}}], None
    if cmd == "blockdev-add":
        if a["node-name"] in block_nodes: return None, "Duplicate nodes with node-name='%s'" % a["node-name"]
        block_nodes[a["node-name"]] = a["file"]["filename"]; return {}, None
    if cmd == "blockdev-del":
        if a["node-name"] not in block_nodes: return None, "Failed to find node with node-name='%s'" % a["node-name"]
        if any(j["status"] != "null" for j in jobs.values()): return None, "Node is in use"
        del block_nodes[a["node-name"]]; return {}, None
    if cmd == "transaction":
        names = bitmaps()
        for act in a["actions"]:
            x = act["data"]
            if act["type"] == "block-dirty-bitmap-add":
                if x["name"] in names: return None, "Bitmap already exists: %s" % x["name"]
                names.append(x["name"])
            elif act["type"] == "blockdev-backup":
                if x["sync"] == "bitmap" and x["bitmap"] not in bitmaps():
                    return None, "Bitmap '%s' could not be found" % x["bitmap"]
                with open(os.path.join(d, "backups"), "a") as f: f.write(json.dumps(x) + "\n")
                # The fake copies the whole overlay: what the driver asked for is in "backups".
                shutil.copyfile(disk, block_nodes[x["target"]])
                jobs[x["job-id"]] = {"id": x["job-id"], "type": "backup", "status": "concluded"}
                if mode == "backup-fail": jobs[x["job-id"]]["error"] = "No space left on device"
        set_bitmaps(names); return {}, None
    if cmd == "query-jobs": return list(jobs.values()), None
    if cmd == "job-dismiss":
        if a["id"] not in jobs: return None, "Job not found"
        del jobs[a["id"]]; return {}, None
    if cmd == "job-cancel": return {}, None
    if cmd == "block-dirty-bitmap-remove":
        names = bitmaps()
        if a["name"] not in names: return None, "Dirty bitmap '%s' not found" % a["name"]
        names.remove(a["name"]); set_bitmaps(names); return {}, None
    return None, None
srv = socket.socket(socket.AF_UNIX)
srv.bind(qmp)
srv.listen(1)
if mode == "stall":
    time.sleep(3600)
if not incoming:
    with open(console, "a") as f:
        f.write("[    1.0] booting\n")
        if "FAKE_QEMU_ANSWERS" in os.environ:
            f.write("SANDGATE-GUEST-IDENTITY answers\n")
        if "FAKE_QEMU_AGENT" in os.environ:
            f.write("SANDGATE-GUEST-AGENT %s\n" % os.environ["FAKE_QEMU_AGENT"])
        f.write("SANDGATE-GUEST-READY\n")
status = "inmigrate" if incoming else "running"
while True:
    c, _ = srv.accept()
    f = c.makefile("rw")
    f.write(json.dumps({"QMP": {"version": {}, "capabilities": []}}) + "\n"); f.flush()
    for line in f:
        m = json.loads(line)
        cmd, i, ret = m["execute"], m.get("id"), {}
        if cmd == "stop" and mode == "qmp-error":
            f.write(json.dumps({"error": {"class": "GenericError", "desc": "fake refuses to stop"}, "id": i}) + "\n")
            f.flush(); continue
        if disk is not None:
            with open(os.path.join(d, "qmp-commands"), "a") as log: log.write(cmd + "\n")
            ret, error = block_command(cmd, m.get("arguments", {}))
            if error is not None:
                f.write(json.dumps({"error": {"class": "GenericError", "desc": error}, "id": i}) + "\n")
                f.flush(); continue
            if ret is not None:
                f.write(json.dumps({"return": ret, "id": i}) + "\n"); f.flush(); continue
            ret = {}
        if cmd == "stop": status = "paused"
        elif cmd == "cont": status = "running"
        elif cmd == "query-status": ret = {"status": status, "running": status == "running"}
        elif cmd == "migrate-set-capabilities":
            for c in m["arguments"]["capabilities"]:
                if c["capability"] == "x-ignore-shared": ignore_shared = c["state"]
        elif cmd == "migrate":
            if mode == "migrate-die": os._exit(1)
            if mode != "migrate-fail":
                saved = b"SANDGATE-FAKE-DEVICES" if ignore_shared and ram is not None else b"SANDGATE-FAKE-STATE"
                subprocess.run(["sh", "-c", m["arguments"]["uri"][len("exec:"):]], input=saved)
            status = "postmigrate"
        elif cmd == "query-migrate":
            ret = {"status": "failed", "error-desc": "No space left on device"} if mode == "migrate-fail" else {"status": "completed"}
        elif cmd == "migrate-incoming":
            data = subprocess.run(["sh", "-c", m["arguments"]["uri"][len("exec:"):]], capture_output=True).stdout
            ram_from_file = False
            if "mem-path" in backend and backend.get("share") == "off":
                with open(backend["mem-path"], "rb") as r:
                    ram_from_file = r.read(17) == b"SANDGATE-FAKE-RAM"
            if data == b"SANDGATE-FAKE-DEVICES" and ignore_shared and ram_from_file:
                pass
            elif data != b"SANDGATE-FAKE-STATE":
                sys.stderr.write("qemu-system-x86_64: load of migration failed: Input/output error\n")
                os._exit(1)
            status = "paused"
        elif cmd == "human-monitor-command":  # slirp's rules, answered in text as QEMU 7.2 does
            line = m["arguments"]["command-line"]
            with open(os.path.join(os.path.dirname(qmp), "hmp"), "a") as h:
                h.write(line + "\n")
            words = line.split()
            port = int(words[2].split(":")[2].split("-")[0])
            if words[0] == "hostfwd_add" and port not in rules:
                rules.add(port)
                forward(port)
                ret = ""
            elif words[0] == "hostfwd_add":
                ret = "could not set up host forwarding rule '%s'\r\n" % words[2]
            elif words[0] == "hostfwd_remove" and port in rules:
                rules.discard(port)  # the fake's listener stays; the test looks at what was asked
                ret = "host forwarding rule for %s removed\r\n" % words[2]
            else:
                ret = "could not remove host forwarding rule '%s'\r\n" % words[2]
        elif cmd == "quit":
            f.write(json.dumps({"return": {}, "id": i}) + "\n"); f.flush(); os._exit(0)
        f.write(json.dumps({"return": ret, "id": i}) + "\n"); f.flush()
)PY";

// The guest image builder (node.guest_image_builder), in place of deploy/build-guest-image.sh: appends its
// arguments to <its dir>/builder-calls, prints progress, then per FAKE_BUILDER_MODE: ok writes OUT_DIR's
// vmlinuz, initrd.img and .stamp; fail exits 1 with a reason; no-kernel exits 77 (kernel not downloadable).
// While <its dir>/gate is absent it holds before finishing, so a test can line up starts behind one build.
constexpr const char* kFakeBuilder = R"SH(#!/bin/sh
here=$(dirname "$0")
echo "$*" >>"$here/builder-calls"
echo "build-guest-image: resolving linux-image-cloud-amd64 to a kernel package"
while [ ! -e "$here/gate" ]; do sleep 0.02; done
case "${FAKE_BUILDER_MODE:-ok}" in
  fail) echo "build-guest-image: linux-image-fake has no drivers/virtio/virtio.ko" >&2; exit 1 ;;
  no-kernel) echo "build-guest-image: cannot download linux-image-fake" >&2; exit 77 ;;
esac
mkdir -p "$1" && printf built >"$1/vmlinuz" && printf built >"$1/initrd.img" && echo fake >"$1/.stamp"
echo "build-guest-image: wrote $1/vmlinuz and $1/initrd.img"
)SH";

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<int> spawned_pids(const std::string& dir) {
  std::vector<int> pids;
  std::istringstream in(read_all(dir + "/spawns"));
  for (int pid; in >> pid;) pids.push_back(pid);
  return pids;
}

std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> out;
  std::istringstream in(read_all(path));
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// What a connection through `sock` (connected to 127.0.0.1:port) reads first; "" when it cannot connect.
std::string first_line(UniqueFd sock, uint16_t port) {
  ::fcntl(sock.get(), F_SETFL, ::fcntl(sock.get(), F_GETFL) & ~O_NONBLOCK);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return "";
  timeval tv{2, 0};
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[128];
  ssize_t n = ::recv(sock.get(), buf, sizeof buf, 0);
  std::string line(buf, n > 0 ? static_cast<size_t>(n) : 0);
  return line.substr(0, line.find('\n'));
}

bool alive(int pid) {
  std::string stat = read_all("/proc/" + std::to_string(pid) + "/stat");
  size_t p = stat.rfind(')');
  return p != std::string::npos && p + 2 < stat.size() && stat[p + 2] != 'Z';
}

class QemuDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = dir_.path() + "/fake-qemu";
    std::ofstream(bin_) << kFakeQemu;
    ::chmod(bin_.c_str(), 0755);
    // Never the real builder (it would download a kernel): every test gets the fake, open by default.
    builder_ = dir_.path() + "/fake-builder";
    std::ofstream(builder_) << kFakeBuilder;
    ::chmod(builder_.c_str(), 0755);
    std::ofstream(dir_.path() + "/gate") << "";
    cfg_.guest_image_builder = builder_;
    cfg_.agent_path = dir_.path() + "/sandgate-agent";
    std::ofstream(cfg_.agent_path) << "#!/bin/sh\n";
    ::chmod(cfg_.agent_path.c_str(), 0755);
    std::ofstream(dir_.path() + "/vmlinuz") << "kernel";
    std::ofstream(dir_.path() + "/initrd.img") << "initrd";
    sandbox_dir_ = dir_.path() + "/sb";
    std::filesystem::create_directories(sandbox_dir_);
    sandbox_dirs_ = {sandbox_dir_};
    cfg_.qemu_binary = bin_;
    cfg_.qemu_accel = "tcg";
    cfg_.guest_kernel = dir_.path() + "/vmlinuz";
    cfg_.guest_initrd = dir_.path() + "/initrd.img";
    cfg_.qemu_boot_timeout_ms = 5000;
    cfg_.qemu_boot_attempts = 2;
    spec_.id = "sb-qemutest0001";
    spec_.command = {"/bin/sh", "-c", "echo it's quoted"};
    spec_.exposed_ports = {8080};
    spec_.memory_mb = 128;
    mode("ok");
  }
  void TearDown() override {
    driver_.reset();
    for (const std::string& d : sandbox_dirs_)
      for (int pid : spawned_pids(d)) ::kill(pid, SIGKILL);
    ::unsetenv("FAKE_QEMU_MODE");
    ::unsetenv("FAKE_QEMU_AGENT");
    ::unsetenv("FAKE_QEMU_QMP_DELAY_MS");
    ::unsetenv("FAKE_QEMU_ACK_DELAY_MS");
    ::unsetenv("FAKE_QEMU_ANSWERS");
    ::unsetenv("FAKE_BUILDER_MODE");
  }
  static void mode(const char* m) { ::setenv("FAKE_QEMU_MODE", m, 1); }
  Driver& driver() {
    if (!driver_) driver_ = make_qemu_driver(loop_.get(), cfg_, 9501, layers_, egress_.get());
    return *driver_;
  }
  Result<RuntimeInfo> wait_runtime(const std::function<void(Driver::RuntimeDone)>& op) {
    std::optional<Result<RuntimeInfo>> r;
    op([&](Result<RuntimeInfo> x) { r = std::move(x); });
    EXPECT_FALSE(r.has_value());
    EXPECT_TRUE(loop_.run_until([&] { return r.has_value(); }, 20000));
    return r ? *r : Result<RuntimeInfo>(fail(Error::kInternal, "no answer"));
  }
  Status wait_status(const std::function<void(Driver::Done)>& op) {
    std::optional<Status> r;
    op([&](Status x) { r = std::move(x); });
    EXPECT_TRUE(loop_.run_until([&] { return r.has_value(); }, 20000));
    return r ? *r : fail(Error::kInternal, "no answer");
  }
  Result<RuntimeInfo> start() {
    return wait_runtime([&](Driver::RuntimeDone d) { driver().start(spec_, sandbox_dir_, std::move(d)); });
  }
  Result<RuntimeInfo> start_in(const std::string& dir) {
    return wait_runtime([&](Driver::RuntimeDone d) { driver().start(spec_, dir, std::move(d)); });
  }
  Status pause(const RuntimeInfo& info) {
    return wait_status([&](Driver::Done d) { driver().pause(spec_, info, std::move(d)); });
  }
  Result<RuntimeInfo> hibernate(const RuntimeInfo& info) {
    return wait_runtime([&](Driver::RuntimeDone d) { driver().hibernate(spec_, info, std::move(d)); });
  }
  // A memory checkpoint of spec_ into `dir` (made here); nullopt if it never answered.
  std::optional<Result<VmCheckpoint>> checkpoint_memory(const RuntimeInfo& info, const std::string& dir,
                                                        CheckpointFrom source = CheckpointFrom::kRunning,
                                                        std::string id = snapshot::generate_snapshot_id()) {
    std::filesystem::create_directories(dir);
    std::optional<Result<VmCheckpoint>> saved;
    driver().checkpoint_memory(spec_, info, CheckpointFiles{.id = std::move(id), .dir = dir, .final_dir = dir},
                               source,
                               [&](Result<VmCheckpoint> r) { saved.emplace(std::move(r)); });
    EXPECT_TRUE(loop_.run_until([&] { return saved.has_value(); }, 20000));
    return saved;
  }
  // A disk checkpoint of spec_ into `dir` (made here); nullopt if it never answered.
  // Into `dir` as snapshot `id` (a new one by default), which stays there once recorded.
  std::optional<Result<VmCheckpoint>> checkpoint_disk(const RuntimeInfo& info, const std::string& dir,
                                                      CheckpointFrom source = CheckpointFrom::kRunning,
                                                      std::string id = snapshot::generate_snapshot_id()) {
    std::filesystem::create_directories(dir);
    std::optional<Result<VmCheckpoint>> saved;
    driver().checkpoint_disk(spec_, info, CheckpointFiles{.id = std::move(id), .dir = dir, .final_dir = dir}, source,
                             [&](Result<VmCheckpoint> r) { saved.emplace(std::move(r)); });
    EXPECT_TRUE(loop_.run_until([&] { return saved.has_value(); }, 20000));
    return saved;
  }
  Result<RuntimeInfo> restore(const RuntimeInfo& info) {
    return wait_runtime([&](Driver::RuntimeDone d) { driver().restore(spec_, info, std::move(d)); });
  }
  bool none_alive() {
    for (int pid : spawned_pids(sandbox_dir_))
      if (alive(pid)) return false;
    return true;
  }

  // The image in <tmp>/guest, missing: what a fresh node's default <state_dir>/guest looks like.
  std::string use_missing_image() {
    const std::string guest = dir_.path() + "/guest";
    cfg_.guest_kernel = guest + "/vmlinuz";
    cfg_.guest_initrd = guest + "/initrd.img";
    return guest;
  }
  std::vector<std::string> builder_calls() {
    std::vector<std::string> calls;
    std::istringstream in(read_all(dir_.path() + "/builder-calls"));
    for (std::string line; std::getline(in, line);) calls.push_back(line);
    return calls;
  }
  // A second sandbox beside spec_ / sandbox_dir_.
  std::pair<SandboxSpec, std::string> other_sandbox() {
    SandboxSpec spec = spec_;
    spec.id = "sb-qemutest0002";
    std::string dir = dir_.path() + "/sb2";
    std::filesystem::create_directories(dir);
    sandbox_dirs_.push_back(dir);
    return {spec, dir};
  }
  // A second sandbox started from the memory snapshot `snap`; `runtime` is the start's result.
  struct FromSnapshot {
    SandboxSpec spec;
    std::string dir;
    Result<RuntimeInfo> runtime;
  };
  FromSnapshot start_from_snapshot(const std::string& snap) {
    auto [spec, dir] = other_sandbox();
    spec.memory_snapshot_dir = snap;
    const SandboxSpec& started = spec;
    const std::string& started_dir = dir;
    Result<RuntimeInfo> runtime =
        wait_runtime([&](Driver::RuntimeDone done) { driver().start(started, started_dir, std::move(done)); });
    return {std::move(spec), std::move(dir), std::move(runtime)};
  }

  TempDir dir_;
  TestLoop loop_;
  std::string bin_;
  std::string builder_;
  std::string sandbox_dir_;
  std::vector<std::string> sandbox_dirs_;
  NodeConfig cfg_;
  SandboxSpec spec_;
  std::unique_ptr<SandboxEgress> egress_;  // before driver_: the driver uses it until it is gone
  std::unique_ptr<Driver> driver_;
  ImageLayers layers_;
};

TEST_F(QemuDriverTest, MissingGuestImageFailsTheStartClearly) {
  cfg_.guest_kernel = dir_.path() + "/no-such-vmlinuz";
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kUnsupported);
  EXPECT_NE(r.message().find("build it with " + builder_), std::string::npos) << r.message();
  EXPECT_TRUE(spawned_pids(sandbox_dir_).empty());
  EXPECT_TRUE(builder_calls().empty());  // not the builder's output layout: the node does not build it
}

TEST_F(QemuDriverTest, QemuDyingDuringBootFailsWithItsMessage) {
  mode("die-at-boot");
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("Could not set up host forwarding"), std::string::npos) << r.message();
  EXPECT_EQ(spawned_pids(sandbox_dir_).size(), 1u);  // an error, not a stall: no retry
}

TEST_F(QemuDriverTest, AnInitramfsTooLargeForTheGuestsMemoryIsNamedWithWhatToChange) {
  mode("initramfs-too-large");
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kInvalidArgument);
  EXPECT_NE(r.message().find("does not fit in the sandbox's"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("more memory"), std::string::npos) << r.message();
  EXPECT_EQ(spawned_pids(sandbox_dir_).size(), 1u);  // not retried: the same memory fails the same way
}

TEST_F(QemuDriverTest, StalledBootIsKilledAndRetriedThenFails) {
  mode("stall");
  cfg_.qemu_boot_timeout_ms = 2500;  // long enough for the Python fake to record its spawn on a loaded machine
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kTimeout);
  EXPECT_NE(r.message().find("2 attempts"), std::string::npos) << r.message();
  EXPECT_EQ(spawned_pids(sandbox_dir_).size(), 2u);
  EXPECT_TRUE(none_alive());
}

TEST_F(QemuDriverTest, PauseHibernateRestoreTerminate) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_GT(info->pid, 0);
  EXPECT_TRUE(info->driver_data.count("port:8080"));
  EXPECT_TRUE(info->driver_data.count("port:9501"));
  auto sock = driver().open_socket(spec_, *info, 8080);
  ASSERT_TRUE(sock.ok());
  EXPECT_FALSE(sock->connected);
  EXPECT_EQ(std::to_string(sock->connect_port), info->driver_data["port:8080"]);
  EXPECT_EQ(driver().open_socket(spec_, *info, 9999).error(), Error::kUnreachable);
  // The namespace handed to the proxy with spares (for its socket maker) is QEMU's, where its sockets live.
  auto netns = driver().socket_namespace(spec_, *info);
  ASSERT_TRUE(netns.ok()) << netns.message();
  EXPECT_EQ(testing::namespace_inode(netns->get()), testing::socket_namespace_inode(sock->fd.get()));
  EXPECT_NE(testing::namespace_inode(netns->get()), testing::own_netns_inode()) << "not the node's";

  ASSERT_TRUE(pause(*info).ok());
  EXPECT_TRUE(driver().observe(spec_, *info).paused);
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  EXPECT_EQ(saved->pid, 0);
  EXPECT_EQ(read_all(saved->driver_data["state_file"]), "SANDGATE-FAKE-STATE");
  EXPECT_TRUE(loop_.run_until([&] { return none_alive(); }));
  auto seen = driver().observe(spec_, *saved);
  EXPECT_FALSE(seen.alive);
  EXPECT_TRUE(seen.hibernated);

  auto restored = restore(*saved);
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_GT(restored->pid, 0);
  EXPECT_EQ(restored->driver_data["port:8080"], info->driver_data["port:8080"]);  // same host ports
  EXPECT_FALSE(std::filesystem::exists(saved->driver_data["state_file"]));  // consumed
  EXPECT_TRUE(driver().observe(spec_, *restored).alive);

  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec_, *restored, std::move(d)); }).ok());
  EXPECT_TRUE(none_alive());
}

TEST_F(QemuDriverTest, AMemoryCheckpointLeavesTheGuestRunningAndAStartFromItContinuesIt) {
  ASSERT_TRUE(driver().capabilities().memory_checkpoint);
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string snap = dir_.path() + "/snap";
  auto saved = checkpoint_memory(*info, snap);
  ASSERT_TRUE(saved.has_value());
  ASSERT_TRUE(*saved) << saved->message();
  // The RAM is in a memfd: the state is the devices' alone, the RAM a sparse file of the guest's size.
  EXPECT_EQ(read_all(snap + "/" + kMemoryState), "SANDGATE-FAKE-DEVICES");
  EXPECT_EQ((*saved)->state_bytes, std::string("SANDGATE-FAKE-DEVICES").size());
  const std::string ram = snap + "/" + kMemoryRam;
  EXPECT_EQ(std::filesystem::file_size(ram), uint64_t{128} << 20);
  EXPECT_EQ(read_all(ram).substr(0, 17), "SANDGATE-FAKE-RAM");
  EXPECT_EQ(read_all(ram).substr(uint64_t{64} << 20, 17), "SANDGATE-FAKE-RAM");
  EXPECT_GT((*saved)->ram_bytes, 0u);
  EXPECT_LE((*saved)->ram_bytes, uint64_t{1} << 20) << "the holes of the RAM stay holes in its copy";
  EXPECT_EQ((*saved)->disk_bytes, 0u);  // booted without a disk
  EXPECT_GT((*saved)->pause_ms, 0);
  auto seen = driver().observe(spec_, *info);
  EXPECT_TRUE(seen.alive);
  EXPECT_FALSE(seen.paused) << "the source must run again after its checkpoint";

  // A second sandbox from it: QEMU loads the saved state instead of booting, and runs.
  auto [other_spec, other_dir] = other_sandbox();
  SandboxSpec spec = other_spec;
  const std::string dir = other_dir;
  spec.memory_snapshot_dir = snap;
  auto from = wait_runtime([&](Driver::RuntimeDone d) { driver().start(spec, dir, std::move(d)); });
  ASSERT_TRUE(from.ok()) << from.message();
  EXPECT_NE(from->pid, info->pid);
  auto running = driver().observe(spec, *from);
  EXPECT_TRUE(running.alive);
  EXPECT_FALSE(running.paused);
  EXPECT_EQ(read_all(snap + "/" + kMemoryState), "SANDGATE-FAKE-DEVICES") << "the snapshot is not consumed";
  EXPECT_EQ(read_all(dir + "/console.log").find("SANDGATE-GUEST-READY"), std::string::npos) << "it did not boot";
  // It maps the snapshot's RAM privately: the sandboxes from one snapshot share the pages none of them wrote.
  EXPECT_NE(read_all(dir + "/argv").find("memory-backend-file,id=microvm.ram,size=128M,mem-path=" + ram + ",share=off"),
            std::string::npos) << read_all(dir + "/argv");

  // A hibernation after the checkpoint saves the source's RAM again (x-ignore-shared is set back).
  ASSERT_TRUE(pause(*info).ok());
  auto hibernated = hibernate(*info);
  ASSERT_TRUE(hibernated.ok()) << hibernated.message();
  EXPECT_EQ(read_all(hibernated->driver_data["state_file"]), "SANDGATE-FAKE-STATE");
  // And one from the snapshot, hibernated, comes back on a memfd of its own with all of its RAM.
  ASSERT_TRUE(wait_status([&](Driver::Done d) { driver().pause(spec, *from, std::move(d)); }).ok());
  auto from_hibernated = wait_runtime([&](Driver::RuntimeDone d) { driver().hibernate(spec, *from, std::move(d)); });
  ASSERT_TRUE(from_hibernated.ok()) << from_hibernated.message();
  EXPECT_EQ(from_hibernated->driver_data.count("ram_file"), 0u);
  auto from_restored = wait_runtime([&](Driver::RuntimeDone d) { driver().restore(spec, *from_hibernated, std::move(d)); });
  ASSERT_TRUE(from_restored.ok()) << from_restored.message();
  EXPECT_NE(read_all(dir + "/argv").find("memory-backend-memfd,id=microvm.ram,size=128M,share=on"), std::string::npos)
      << read_all(dir + "/argv");
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec, *from_restored, std::move(d)); }).ok());

  // A RAM file of another size than the guest's is refused, naming both.
  auto odd_sandbox = other_sandbox();
  SandboxSpec odd_spec = odd_sandbox.first;
  const std::string odd_dir = odd_sandbox.second;
  odd_spec.id = "sb-qemutest0004";
  odd_spec.memory_snapshot_dir = snap;
  std::filesystem::resize_file(ram, uint64_t{64} << 20);
  auto odd = wait_runtime([&](Driver::RuntimeDone d) { driver().start(odd_spec, odd_dir, std::move(d)); });
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.message().find("not the 128 MiB of its guest"), std::string::npos) << odd.message();

  // Without the state there is nothing to continue: named, nothing started.
  auto empty = other_sandbox();
  SandboxSpec empty_spec = empty.first;
  const std::string empty_dir = empty.second;
  empty_spec.id = "sb-qemutest0003";
  empty_spec.memory_snapshot_dir = dir_.path() + "/no-snapshot";
  auto none = wait_runtime([&](Driver::RuntimeDone d) { driver().start(empty_spec, empty_dir, std::move(d)); });
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error(), Error::kNotFound);
  EXPECT_NE(none.message().find("no saved state"), std::string::npos) << none.message();
}

TEST_F(QemuDriverTest, AFailedMemoryCheckpointSetsTheGuestRunningAgain) {
  mode("migrate-fail");
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string snap = dir_.path() + "/snap";
  auto saved = checkpoint_memory(*info, snap);
  ASSERT_TRUE(saved.has_value());
  ASSERT_FALSE(*saved);
  EXPECT_NE(saved->message().find("No space left on device"), std::string::npos) << saved->message();
  auto seen = driver().observe(spec_, *info);
  EXPECT_TRUE(seen.alive);
  EXPECT_FALSE(seen.paused);
}

// A guest suspended in memory (stopped) is saved as it stands and stays stopped, after a failure too; a
// sandbox started from that checkpoint runs.
TEST_F(QemuDriverTest, AMemoryCheckpointOfAPausedGuestLeavesItPaused) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(pause(*info).ok());
  const std::string snap = dir_.path() + "/snap";
  auto saved = checkpoint_memory(*info, snap, CheckpointFrom::kPaused);
  ASSERT_TRUE(saved.has_value());
  ASSERT_TRUE(*saved) << saved->message();
  EXPECT_EQ(read_all(snap + "/" + kMemoryState), "SANDGATE-FAKE-DEVICES");
  EXPECT_EQ((*saved)->pause_ms, 0) << "the guest stood still already";
  auto seen = driver().observe(spec_, *info);
  EXPECT_TRUE(seen.alive);
  EXPECT_TRUE(seen.paused) << "a suspended guest must stay stopped after its checkpoint";
  auto from = start_from_snapshot(snap);
  ASSERT_TRUE(from.runtime.ok()) << from.runtime.message();
  EXPECT_FALSE(driver().observe(from.spec, *from.runtime).paused);
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(from.spec, *from.runtime, std::move(d)); }).ok());
  EXPECT_TRUE(driver().observe(spec_, *info).paused);
  // The same guest resumes as usual afterwards.
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().resume(spec_, *info, std::move(d)); }).ok());
  EXPECT_FALSE(driver().observe(spec_, *info).paused);
}

// A hibernated guest's checkpoint is its saved state (RAM included) copied: no QEMU runs for it, the
// sandbox stays restorable, and a sandbox started from the checkpoint runs.
TEST_F(QemuDriverTest, AMemoryCheckpointOfAHibernatedGuestCopiesItsSavedState) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  const size_t spawns = spawned_pids(sandbox_dir_).size();
  const std::string snap = dir_.path() + "/snap";
  auto checkpoint = checkpoint_memory(*saved, snap, CheckpointFrom::kHibernated);
  ASSERT_TRUE(checkpoint.has_value());
  ASSERT_TRUE(*checkpoint) << checkpoint->message();
  EXPECT_EQ(read_all(snap + "/" + kMemoryState), "SANDGATE-FAKE-STATE");
  EXPECT_FALSE(std::filesystem::exists(snap + "/" + kMemoryRam)) << "the RAM is in the saved state";
  EXPECT_EQ((*checkpoint)->ram_bytes, 0u);
  EXPECT_EQ(spawned_pids(sandbox_dir_).size(), spawns) << "a QEMU ran for the checkpoint";
  EXPECT_TRUE(driver().observe(spec_, *saved).hibernated);
  auto from = start_from_snapshot(snap);
  ASSERT_TRUE(from.runtime.ok()) << from.runtime.message();
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(from.spec, *from.runtime, std::move(d)); }).ok());
  auto restored = restore(*saved);
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec_, *restored, std::move(d)); }).ok());
  // Without a saved state there is nothing to copy.
  RuntimeInfo none = *saved;
  none.driver_data.erase("state_file");
  auto missing = checkpoint_memory(none, dir_.path() + "/snap2", CheckpointFrom::kHibernated);
  ASSERT_TRUE(missing.has_value());
  EXPECT_EQ(missing->error(), Error::kNotFound);
}

TEST_F(QemuDriverTest, AFailedMemoryCheckpointOfAPausedGuestLeavesItPaused) {
  mode("migrate-fail");
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(pause(*info).ok());
  auto saved = checkpoint_memory(*info, dir_.path() + "/snap", CheckpointFrom::kPaused);
  ASSERT_TRUE(saved.has_value());
  ASSERT_FALSE(*saved);
  auto seen = driver().observe(spec_, *info);
  EXPECT_TRUE(seen.alive);
  EXPECT_TRUE(seen.paused);
}

// A node killed inside a restore, just after it spawned QEMU, and restarted at once: the stray QEMU holds the
// sandbox's pidfile but has no QMP socket yet. The restarted node asks it until it answers (it says
// "inmigrate": its guest never ran), stops it and finds the saved state to restore, instead of giving the
// sandbox up as failed (what a loaded CI machine saw with the real QEMU).
TEST_F(QemuDriverTest, AStrayQemuFromAnInterruptedRestoreIsAskedUntilItsMonitorAnswers) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(pause(*info).ok());
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  ASSERT_TRUE(loop_.run_until([&] { return none_alive(); }));

  // The restore's QEMU as the driver spawns it (the start's command line with -incoming), slow to its monitor.
  std::vector<std::string> args;
  {
    std::istringstream in(read_all(sandbox_dir_ + "/argv"));
    for (std::string a; std::getline(in, a, '\0');) args.push_back(a);
  }
  args.insert(args.end(), {"-incoming", "defer"});
  std::filesystem::remove(saved->driver_data["api_socket"]);
  // In a network namespace of its own, as the driver spawns it: its forwards' host ports are free there.
  args.insert(args.begin(), {"-n", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\"", bin_});
  ::setenv("FAKE_QEMU_QMP_DELAY_MS", "1500", 1);
  auto stray = spawn_vmm("stray", "/usr/bin/unshare", args, dir_.path() + "/stray.log");
  ::unsetenv("FAKE_QEMU_QMP_DELAY_MS");
  ASSERT_TRUE(stray) << stray.message();
  const std::string pidfile = sandbox_dir_ + "/qemu.pid";
  ASSERT_TRUE(loop_.run_until([&] { return pidfile_holder(pidfile).has_value(); }, 10000));
  ASSERT_FALSE(std::filesystem::exists(saved->driver_data["api_socket"])) << "the monitor came before the test";

  auto seen = driver().observe(spec_, *saved);
  EXPECT_FALSE(seen.alive);
  EXPECT_TRUE(seen.hibernated) << "the sandbox would be marked failed";
  // The test's child, reaped here (a real stray's parent, init, reaps it); one left running fails this.
  EXPECT_TRUE(loop_.run_until([&] { return ::waitpid(stray->pid, nullptr, WNOHANG) == stray->pid; }, 5000))
      << "the stray was not stopped";

  auto restored = restore(*saved);
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec_, *restored, std::move(d)); }).ok());
}

TEST_F(QemuDriverTest, QmpErrorFailsThePauseWithItsDescription) {
  mode("qmp-error");
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  Status s = pause(*info);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("fake refuses to stop"), std::string::npos) << s.message();
}

TEST_F(QemuDriverTest, QemuExitingDuringMigrateKeepsTheEarlierState) {
  mode("migrate-die");
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  std::ofstream(sandbox_dir_ + "/qemu.state") << "EARLIER";
  ASSERT_TRUE(pause(*info).ok());
  auto r = hibernate(*info);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(read_all(sandbox_dir_ + "/qemu.state"), "EARLIER");
  EXPECT_FALSE(std::filesystem::exists(sandbox_dir_ + "/qemu.state.tmp"));
}

TEST_F(QemuDriverTest, FailedMigrationLeavesTheVmPausedInMemory) {
  mode("migrate-fail");
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(pause(*info).ok());
  auto r = hibernate(*info);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("No space left on device"), std::string::npos) << r.message();
  auto seen = driver().observe(spec_, *info);
  EXPECT_TRUE(seen.alive);
  EXPECT_TRUE(seen.paused);
  EXPECT_FALSE(std::filesystem::exists(sandbox_dir_ + "/qemu.state"));
}

TEST_F(QemuDriverTest, RestoreWithoutStateFailsAndStartsNothing) {
  RuntimeInfo info;
  info.sandbox_dir = sandbox_dir_;
  info.driver_data["api_socket"] = sandbox_dir_ + "/qmp.sock";
  info.driver_data["state_file"] = sandbox_dir_ + "/qemu.state";
  auto r = restore(info);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kNotFound);
  EXPECT_TRUE(spawned_pids(sandbox_dir_).empty());
  EXPECT_FALSE(driver().observe(spec_, info).hibernated);
}

TEST_F(QemuDriverTest, TruncatedStateFailsTheRestoreAndIsKept) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(pause(*info).ok());
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  const std::string state = saved->driver_data["state_file"];
  std::filesystem::resize_file(state, 11);
  auto r = restore(*saved);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("load of migration failed"), std::string::npos) << r.message();
  EXPECT_EQ(read_all(state), "SANDGATE-FA");
  EXPECT_TRUE(loop_.run_until([&] { return none_alive(); }));
}

TEST_F(QemuDriverTest, MissingGuestImageIsBuiltOnceForConcurrentStarts) {
  const std::string guest = use_missing_image();
  std::filesystem::remove(dir_.path() + "/gate");  // hold the build until both starts wait for it
  auto [spec2, dir2] = other_sandbox();
  std::optional<Result<RuntimeInfo>> first, second;
  driver().start(spec_, sandbox_dir_, [&](Result<RuntimeInfo> r) { first = std::move(r); });
  ASSERT_TRUE(loop_.run_until([&] { return builder_calls().size() == 1; }, 10000));
  driver().start(spec2, dir2, [&](Result<RuntimeInfo> r) { second = std::move(r); });
  // One turn runs the second start's first step (a 0 ms timer): it asks for the image while the build is held,
  // so a builder that is not single-flight would be invoked twice.
  uv_run(loop_.get(), UV_RUN_NOWAIT);
  EXPECT_FALSE(second.has_value());
  std::ofstream(dir_.path() + "/gate") << "";
  ASSERT_TRUE(loop_.run_until([&] { return first.has_value() && second.has_value(); }, 20000));
  ASSERT_TRUE(first->ok()) << first->message();
  ASSERT_TRUE(second->ok()) << second->message();
  ASSERT_EQ(builder_calls().size(), 1u);
  EXPECT_EQ(builder_calls()[0], guest + " " + cfg_.agent_path);  // the agent goes into the image
  EXPECT_EQ(read_all(guest + "/vmlinuz"), "built");
  EXPECT_EQ(spawned_pids(sandbox_dir_).size(), 1u);
  EXPECT_EQ(spawned_pids(dir2).size(), 1u);
}

TEST_F(QemuDriverTest, FailedGuestImageBuildFailsTheStartWithItsCauseAndIsRetried) {
  const std::string guest = use_missing_image();
  ::setenv("FAKE_BUILDER_MODE", "fail", 1);
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("has no drivers/virtio/virtio.ko"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("by hand"), std::string::npos) << r.message();  // the next step
  EXPECT_TRUE(spawned_pids(sandbox_dir_).empty());

  ::setenv("FAKE_BUILDER_MODE", "no-kernel", 1);
  r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("cannot download linux-image-fake"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("Debian mirrors"), std::string::npos) << r.message();

  ::unsetenv("FAKE_BUILDER_MODE");
  auto ok = start();
  ASSERT_TRUE(ok.ok()) << ok.message();
  EXPECT_EQ(builder_calls().size(), 3u);
}

TEST_F(QemuDriverTest, ExistingGuestImageIsNotRebuilt) {
  // The fixture's image has no builder stamp: made by hand, used as it is.
  auto r = start();
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_TRUE(builder_calls().empty());
  EXPECT_EQ(read_all(cfg_.guest_kernel), "kernel");
  // Gone before the sandbox starts again: its -pidfile lock would refuse a second QEMU, as QEMU's does.
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec_, *r, std::move(d)); }).ok());

  // One the builder made gets its inputs checked once per node process (here: a builder that fails, which
  // keeps the image that is there); later starts do not ask again.
  driver_.reset();
  const std::string guest = use_missing_image();
  std::filesystem::create_directories(guest);
  for (const char* f : {"/vmlinuz", "/initrd.img", "/.stamp"}) std::ofstream(guest + f) << "old";
  ::setenv("FAKE_BUILDER_MODE", "fail", 1);
  // Not a structured binding: clang 14 (the sanitizer tree's compiler) cannot capture one in a lambda.
  const auto second = other_sandbox();
  r = start();
  ASSERT_TRUE(r.ok()) << r.message();
  auto r2 = wait_runtime([&](Driver::RuntimeDone d) { driver().start(second.first, second.second, std::move(d)); });
  ASSERT_TRUE(r2.ok()) << r2.message();
  EXPECT_EQ(builder_calls().size(), 1u);
  EXPECT_EQ(read_all(guest + "/vmlinuz"), "old");
}

TEST_F(QemuDriverTest, MissingGuestImageWithoutAutobuildNamesTheCommand) {
  use_missing_image();
  cfg_.guest_image_autobuild = false;
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kUnsupported);
  EXPECT_NE(r.message().find("guest_image_autobuild"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find(builder_ + " " + dir_.path() + "/guest " + cfg_.agent_path), std::string::npos)
      << r.message();
  EXPECT_TRUE(builder_calls().empty());
}

TEST_F(QemuDriverTest, GuestWithoutAgentRefusesTheAgentPortOnly) {
  ::setenv("FAKE_QEMU_AGENT", "none", 1);
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(info->driver_data["agent"], "none");
  auto agent = driver().open_socket(spec_, *info, 9501);
  ASSERT_FALSE(agent.ok());
  EXPECT_EQ(agent.error(), Error::kUnreachable);
  EXPECT_NE(agent.message().find("sandgate-agent"), std::string::npos) << agent.message();
  EXPECT_TRUE(driver().open_socket(spec_, *info, 8080).ok());  // the command's ports are not affected
}

TEST_F(QemuDriverTest, GuestWhoseAgentFailedRefusesTheAgentPort) {
  ::setenv("FAKE_QEMU_AGENT", "failed", 1);
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  auto agent = driver().open_socket(spec_, *info, 9501);
  ASSERT_FALSE(agent.ok());
  EXPECT_EQ(agent.error(), Error::kUnreachable);
  EXPECT_NE(agent.message().find("sandgate-agent did not start"), std::string::npos) << agent.message();
}

TEST_F(QemuDriverTest, GuestWithListeningAgentOpensTheAgentPort) {
  ::setenv("FAKE_QEMU_AGENT", "listening", 1);
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(info->driver_data["agent"], "listening");
  auto agent = driver().open_socket(spec_, *info, 9501);
  ASSERT_TRUE(agent.ok()) << agent.message();
  EXPECT_EQ(std::to_string(agent->connect_port), info->driver_data["port:9501"]);
}

TEST_F(QemuDriverTest, GuestWithoutAgentMarkerIsTrustedToHaveOne) {
  // An image built before the SANDGATE-GUEST-AGENT line: the driver cannot tell, so it lets the proxy try.
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_FALSE(info->driver_data.count("agent"));
  EXPECT_TRUE(driver().open_socket(spec_, *info, 9501).ok());
}

// A port exposed after the start is forwarded into the running QEMU through the monitor, and from the spec
// by every later start; closing it removes the rule.
TEST_F(QemuDriverTest, APortExposedAfterTheStartIsForwardedIntoTheRunningGuestAndByTheNextStart) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(driver().open_socket(spec_, *info, 3000).error(), Error::kUnreachable);  // not exposed yet
  ASSERT_TRUE(wait_status([&](Driver::Done d) { driver().forward_port(spec_, *info, 3000, std::move(d)); }).ok());
  SandboxSpec exposed = spec_;
  exposed.exposed_ports.push_back(3000);
  auto sock = driver().open_socket(exposed, *info, 3000);
  ASSERT_TRUE(sock.ok()) << sock.message();
  EXPECT_EQ(first_line(std::move(sock->fd), sock->connect_port), "FAKE-GUEST 3000");
  // Again (a policy change): the old rule goes first, so there is still exactly one.
  ASSERT_TRUE(wait_status([&](Driver::Done d) { driver().forward_port(spec_, *info, 3000, std::move(d)); }).ok());
  ASSERT_TRUE(wait_status([&](Driver::Done d) { driver().unforward_port(spec_, *info, 3000, std::move(d)); }).ok());
  EXPECT_EQ(lines_of(sandbox_dir_ + "/hmp"),
            (std::vector<std::string>{"hostfwd_remove net0 tcp:127.0.0.1:3000",
                                      "hostfwd_add net0 tcp:127.0.0.1:3000-:3000",
                                      "hostfwd_remove net0 tcp:127.0.0.1:3000",
                                      "hostfwd_add net0 tcp:127.0.0.1:3000-:3000",
                                      "hostfwd_remove net0 tcp:127.0.0.1:3000"}));
  // QEMU's refusal is the failure, with its words.
  auto refused = wait_status([&](Driver::Done d) { driver().unforward_port(spec_, *info, 3000, std::move(d)); });
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("could not remove host forwarding rule"), std::string::npos) << refused.message();

  // Hibernated, there is no QEMU to tell: the restore forwards the port from the spec.
  ASSERT_TRUE(pause(*info).ok());
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  ASSERT_TRUE(wait_status([&](Driver::Done d) { driver().forward_port(exposed, *saved, 3000, std::move(d)); }).ok());
  auto restored = wait_runtime([&](Driver::RuntimeDone d) { driver().restore(exposed, *saved, std::move(d)); });
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_NE(read_all(sandbox_dir_ + "/argv").find("hostfwd=tcp:127.0.0.1:3000-:3000"), std::string::npos);
  auto after = driver().open_socket(exposed, *restored, 3000);
  ASSERT_TRUE(after.ok()) << after.message();
  EXPECT_EQ(first_line(std::move(after->fd), after->connect_port), "FAKE-GUEST 3000");
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(exposed, *restored, std::move(d)); }).ok());
}

// Issue 10: QEMU's forwards listened on the host's loopback, where any local user (and, through 10.0.2.2,
// any guest) reached every VM's agent. Now each QEMU has a namespace of its own, a new one per spawn, and only
// the sockets the driver opens inside it reach the guest's ports.
TEST_F(QemuDriverTest, EachQemuListensOnlyInItsOwnNetworkNamespace) {
  const std::string host_ns = std::filesystem::read_symlink("/proc/thread-self/ns/net").string();
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  auto namespaces = lines_of(sandbox_dir_ + "/netns");
  ASSERT_EQ(namespaces.size(), 1u);
  EXPECT_NE(namespaces[0], host_ns);
  const std::string argv = read_all(sandbox_dir_ + "/argv");
  EXPECT_NE(argv.find("user,id=net0,restrict=on,"), std::string::npos) << argv;
  for (const char* rule : {"hostfwd=tcp:127.0.0.1:8080-:8080", "hostfwd=tcp:127.0.0.1:9501-:9501",
                           "hostfwd=tcp:127.0.0.1:1021-:1021"})
    EXPECT_NE(argv.find(rule), std::string::npos) << rule << " in " << argv;

  auto sock = driver().open_socket(spec_, *info, 8080);
  ASSERT_TRUE(sock.ok()) << sock.message();
  EXPECT_EQ(sock->connect_port, 8080);
  EXPECT_EQ(first_line(std::move(sock->fd), sock->connect_port), "FAKE-GUEST 8080");
  // The same port from the node's (host's) namespace is not the guest's.
  UniqueFd host_sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_NE(first_line(std::move(host_sock), 8080), "FAKE-GUEST 8080");

  // A restarted node (a new driver) finds the namespace through the adopted QEMU.
  driver_.reset();
  auto adopted = driver().open_socket(spec_, *info, 9501);
  ASSERT_TRUE(adopted.ok()) << adopted.message();
  EXPECT_EQ(first_line(std::move(adopted->fd), adopted->connect_port), "FAKE-GUEST 9501");

  // Hibernated, the namespace dies with QEMU; the restored QEMU gets a new one with the same ports inside.
  ASSERT_TRUE(pause(*info).ok());
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  EXPECT_EQ(driver().open_socket(spec_, *saved, 8080).error(), Error::kUnavailable);
  auto restored = restore(*saved);
  ASSERT_TRUE(restored.ok()) << restored.message();
  namespaces = lines_of(sandbox_dir_ + "/netns");
  ASSERT_EQ(namespaces.size(), 2u);
  EXPECT_NE(namespaces[1], host_ns);
  auto again = driver().open_socket(spec_, *restored, 8080);
  ASSERT_TRUE(again.ok()) << again.message();
  EXPECT_EQ(first_line(std::move(again->fd), again->connect_port), "FAKE-GUEST 8080");
}

// Issue 10: the command and env were base64 on the kernel command line, readable by any local user in
// /proc/<qemu pid>/cmdline. They travel as a 0600 fw_cfg file in a 0700 sandbox dir now.
TEST_F(QemuDriverTest, CommandAndEnvReachTheGuestAsAPrivateFwCfgFileNotOnTheCommandLine) {
  ::chmod(sandbox_dir_.c_str(), 0755);
  spec_.env = {{"API_KEY", "sk-very-secret"}};
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string argv = read_all(sandbox_dir_ + "/argv");
  EXPECT_EQ(argv.find("sk-very-secret"), std::string::npos) << argv;
  EXPECT_EQ(argv.find("sg.cmd"), std::string::npos) << argv;
  const std::string file = sandbox_dir_ + "/guest-command.sh";
  EXPECT_NE(argv.find(std::string("-fw_cfg") + '\0' + "name=opt/sandgate/command,file=" + file), std::string::npos)
      << argv;
  struct stat st{};
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(sandbox_dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(read_all(file), "export API_KEY='sk-very-secret'\ncd '/' || exit 126\nexec '/bin/sh' '-c' 'echo it'\\''s quoted'\n");
}

// SSH without an sshd (docs/ssh.md): the agent's SSH port is forwarded like the agent's, the guest is told
// it on the kernel command line, and the sandbox's host key (made once, root's, 0600) reaches it as a
// fw_cfg file, never on the command line. A sandbox without an agent gets none of it.
TEST_F(QemuDriverTest, TheGuestsSshPortIsForwardedAndItsHostKeyGoesByFwCfg) {
  spec_.driver = "qemu";
  spec_.agent_port = 9501;
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string key = sandbox_dir_ + "/ssh/host_ed25519";
  struct stat st{};
  ASSERT_EQ(::stat(key.c_str(), &st), 0) << "no host key";
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, 0u);
  const std::string argv = read_all(sandbox_dir_ + "/argv");
  EXPECT_NE(argv.find(std::string("name=") + kGuestSshHostKeyFwCfg + ",file=" + key), std::string::npos) << argv;
  EXPECT_NE(argv.find(" sg.ssh=9502"), std::string::npos) << argv;
  EXPECT_NE(argv.find("hostfwd=tcp:127.0.0.1:9502-:9502"), std::string::npos) << argv;
  EXPECT_EQ(argv.find("OPENSSH PRIVATE KEY"), std::string::npos);
  auto sock = driver().open_socket(spec_, *info, 9502);
  ASSERT_TRUE(sock.ok()) << sock.message();
  EXPECT_EQ(first_line(std::move(sock->fd), sock->connect_port), "FAKE-GUEST 9502");
  // Made once: a restart of the sandbox keeps the key known_hosts has.
  const std::string before = read_all(key);
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec_, *info, std::move(d)); }).ok());
  ASSERT_TRUE(start().ok());
  EXPECT_EQ(read_all(key), before);

  const auto second = other_sandbox();
  SandboxSpec other = second.first;
  const std::string other_dir = second.second;
  other.agent_port = 0;
  auto plain = wait_runtime([&](Driver::RuntimeDone d) { driver().start(other, other_dir, std::move(d)); });
  ASSERT_TRUE(plain.ok()) << plain.message();
  EXPECT_EQ(read_all(other_dir + "/argv").find("sg.ssh="), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(other_dir + "/ssh"));
}

// The identity line carries the SSH keys; a start, resume or restore lets connections through only once the
// guest acknowledged keys it did not have (a key removed while the sandbox slept must be refused by the
// connection that wakes it), and does not wait when the guest has them already. The fake guest takes 800 ms
// to acknowledge and writes identity-acks as it does.
TEST_F(QemuDriverTest, AWakeWaitsForTheGuestToAcknowledgeKeysItDidNotHave) {
  spec_.driver = "qemu";
  spec_.agent_port = 9501;
  ::setenv("FAKE_QEMU_ACK_DELAY_MS", "800", 1);
  const std::string keys_dir = dir_.path() + "/ssh-keys";  // ssh_keys_dir(cfg_.state_dir)
  cfg_.state_dir = dir_.path();
  std::filesystem::create_directories(keys_dir);
  auto acks = [&] { return lines_of(sandbox_dir_ + "/identity-acks").size(); };
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(acks(), 1u) << "the start did not wait for the guest's acknowledgement";
  auto lines = lines_of(sandbox_dir_ + "/identity-lines");
  ASSERT_EQ(lines.size(), 1u);
  std::istringstream fields(lines[0]);
  std::vector<std::string> f((std::istream_iterator<std::string>(fields)), std::istream_iterator<std::string>());
  ASSERT_EQ(f.size(), 8u) << lines[0];
  EXPECT_EQ(f[1], spec_.id);
  EXPECT_EQ(f[5], "-") << "no key is registered yet";
  EXPECT_EQ(f[7], read_all(sandbox_dir_ + "/identity.secret"));

  // The same keys: a wake sends the line (the clock) and does not wait.
  ASSERT_TRUE(pause(*info).ok());
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().resume(spec_, *info, std::move(d)); }).ok());
  EXPECT_EQ(acks(), 1u) << "a wake with the keys the guest has waited for it";
  EXPECT_TRUE(loop_.run_until([&] { return lines_of(sandbox_dir_ + "/identity-lines").size() == 2; }, 5000));

  // A key registered while it slept: the wake waits until the guest has it.
  ASSERT_TRUE(loop_.run_until([&] { return acks() == 2; }, 5000));  // the resume's line, acknowledged late
  ASSERT_TRUE(pause(*info).ok());
  std::ofstream(keys_dir + "/authorized_keys") << "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 late\n";
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().resume(spec_, *info, std::move(d)); }).ok());
  EXPECT_EQ(acks(), 3u) << "the wake let connections through before the guest had the new key";
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec_, *info, std::move(d)); }).ok());
}

// A guest that answers its identity lines (it sets its clock first): every start, resume and restore waits
// for the answer, so the first request after a wake sees the right time; a sandbox started from a memory
// snapshot of it waits too (the snapshot says its guest answers).
TEST_F(QemuDriverTest, EveryWakeWaitsForAGuestThatAnswersToSayItsClockIsSet) {
  ::setenv("FAKE_QEMU_ANSWERS", "1", 1);
  ::setenv("FAKE_QEMU_ACK_DELAY_MS", "300", 1);
  auto acks = [&](const std::string& dir) { return lines_of(dir + "/identity-acks").size(); };
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(info->driver_data["identity_answers"], "1");
  EXPECT_EQ(acks(sandbox_dir_), 1u) << "the start did not wait for the answer";
  ASSERT_TRUE(pause(*info).ok());
  ASSERT_TRUE(wait_status([&](Driver::Done d) { driver().resume(spec_, *info, std::move(d)); }).ok());
  EXPECT_EQ(acks(sandbox_dir_), 2u) << "the resume let requests through before the guest's clock was set";
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  auto restored = restore(*saved);
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_EQ(acks(sandbox_dir_), 3u) << "the restore did not wait for the answer";

  const std::string snap = dir_.path() + "/snap";
  auto checkpoint = checkpoint_memory(*restored, snap);
  ASSERT_TRUE(checkpoint.has_value() && checkpoint->ok());
  EXPECT_TRUE(std::filesystem::exists(snap + "/identity_answers"));
  auto from = start_from_snapshot(snap);
  ASSERT_TRUE(from.runtime.ok()) << from.runtime.message();
  EXPECT_EQ(from.runtime->driver_data["identity_answers"], "1");
  EXPECT_EQ(acks(from.dir), 1u) << "the start from the snapshot did not wait for the answer";
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(from.spec, *from.runtime, std::move(d)); }).ok());
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(spec_, *restored, std::move(d)); }).ok());
}

// An initramfs guest's files live in its memory: a filesystem checkpoint is refused, naming the one that
// saves them, and the guest runs on untouched.
TEST_F(QemuDriverTest, AFilesystemCheckpointOfAGuestWithoutADiskIsRefusedNamingTheMemoryCheckpoint) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  auto saved = checkpoint_disk(*info, dir_.path() + "/snap");
  ASSERT_TRUE(saved.has_value());
  ASSERT_FALSE(*saved);
  EXPECT_EQ(saved->error(), Error::kUnsupported);
  EXPECT_NE(saved->message().find("--type memory"), std::string::npos) << saved->message();
  EXPECT_FALSE(driver().observe(spec_, *info).paused);
}

TEST_F(QemuDriverTest, CommandLargerThanTheLimitIsRefusedBeforeAnythingRuns) {
  spec_.env = {{"BIG", std::string(kMaxGuestCommandBytes, 'x')}};
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kLimitExceeded);
  EXPECT_NE(r.message().find(std::to_string(kMaxGuestCommandBytes)), std::string::npos) << r.message();
  EXPECT_TRUE(spawned_pids(sandbox_dir_).empty());
  // Just under the limit is fine.
  spec_.env = {{"BIG", std::string(kMaxGuestCommandBytes - 200, 'x')}};
  auto ok = start();
  EXPECT_TRUE(ok.ok()) << ok.message();
}

// How many of this process's fds hold the network namespace `ns` ("net:[<inode>]").
size_t fds_holding(const std::string& ns) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec).string() == ns) ++n;
  }
  return n;
}

TEST_F(QemuDriverTest, NamespaceOfAQemuThatExitedByItselfIsReleased) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(driver().open_socket(spec_, *info, 8080).ok());
  const std::string ns = lines_of(sandbox_dir_ + "/netns").at(0);
  EXPECT_EQ(fds_holding(ns), 1u);
  bool exited = false;
  ASSERT_TRUE(driver().watch_exit(spec_, *info, [&] { exited = true; }).ok());
  ::kill(info->pid, SIGKILL);
  ASSERT_TRUE(loop_.run_until([&] { return exited; }, 10000));
  EXPECT_EQ(fds_holding(ns), 0u);
}

// The sandbox's image (the create's, node.qemu_image by default): a base disk per image (ext4 of the merged
// layer trees, read-only, shared), a qcow2
// overlay per sandbox on it, booted as the guest's root. Real mkfs.ext4, qemu-img and overlayfs; fake QEMU.
class QemuDiskTest : public QemuDriverTest {
 protected:
  void SetUp() override {
    QemuDriverTest::SetUp();
    if (::geteuid() != 0) GTEST_SKIP() << "the image's layers are merged with an overlayfs mount (root)";
    cfg_.state_dir = dir_.path() + "/state";
    spec_.image = "img";
    // Two layers: the upper one replaces /etc/which and adds /etc/top.
    lower_ = dir_.path() + "/layers/lower";
    upper_ = dir_.path() + "/layers/upper";
    std::filesystem::create_directories(lower_ + "/etc");
    std::filesystem::create_directories(upper_ + "/etc");
    std::ofstream(lower_ + "/etc/which") << "lower\n";
    std::ofstream(lower_ + "/etc/bottom") << "bottom\n";
    std::ofstream(upper_ + "/etc/which") << "upper\n";
    layers_ = [this](const std::string& name) -> Result<std::vector<std::string>> {
      ++lookups_;
      if (name != "img") return fail(Error::kNotFound, "no image named " + name);
      return std::vector<std::string>{lower_, upper_};
    };
  }
  // `path` inside the ext4 image `disk` (debugfs reads it without mounting).
  static std::string read_in_disk(const std::string& disk, const std::string& path) {
    FILE* p = ::popen(("debugfs -R 'cat " + path + "' " + disk + " 2>/dev/null").c_str(), "r");
    std::string out;
    char buf[256];
    for (size_t n; p && (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    if (p) ::pclose(p);
    return out;
  }
  std::string lower_, upper_;
  int lookups_ = 0;
};

TEST_F(QemuDiskTest, BootsAQcow2OverlayOnTheImagesSharedReadOnlyBaseDisk) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string disk = sandbox_dir_ + "/disk.qcow2";
  EXPECT_EQ(info->driver_data["disk"], disk);
  const std::string argv = read_all(sandbox_dir_ + "/argv");
  EXPECT_NE(argv.find(std::string("-drive") + '\0' + "file=" + disk + ",if=none,id=root,format=qcow2"),
            std::string::npos) << argv;
  EXPECT_NE(argv.find("virtio-blk-device,drive=root"), std::string::npos);
  EXPECT_NE(argv.find("sg.root=/dev/vda"), std::string::npos);

  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(cfg_.state_dir + "/qemu-disks")) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_EQ(files.size(), 2u);  // the base and its .trees; no temp file, mount point or log left
  const std::string base = files[0];
  EXPECT_EQ(base.substr(base.size() - 4), ".raw");
  EXPECT_EQ(files[1], base.substr(0, base.size() - 4) + ".trees");
  EXPECT_EQ(read_all(files[1]), lower_ + "\n" + upper_ + "\n");
  struct stat st{};
  ASSERT_EQ(::stat(base.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0444u);
  // The merged tree: the upper layer wins, the lower one shows through.
  EXPECT_EQ(read_in_disk(base, "/etc/which"), "upper\n");
  EXPECT_EQ(read_in_disk(base, "/etc/bottom"), "bottom\n");
  FILE* p = ::popen(("qemu-img info --output=json " + disk).c_str(), "r");
  std::string qinfo;
  char buf[512];
  for (size_t n; p && (n = std::fread(buf, 1, sizeof buf, p)) > 0;) qinfo.append(buf, n);
  if (p) ::pclose(p);
  EXPECT_NE(qinfo.find("\"backing-filename\": \"" + base + "\""), std::string::npos) << qinfo;

  // A second sandbox of the image shares the base (not rebuilt); a restore keeps the sandbox's own overlay.
  const struct timespec built = st.st_mtim;
  const std::string second = dir_.path() + "/sb2";
  std::filesystem::create_directories(second);
  sandbox_dirs_.push_back(second);
  auto other = start_in(second);
  ASSERT_TRUE(other.ok()) << other.message();
  EXPECT_EQ(other->driver_data["disk"], second + "/disk.qcow2");
  ASSERT_EQ(::stat(base.c_str(), &st), 0);
  EXPECT_EQ(st.st_mtim.tv_sec, built.tv_sec);
  EXPECT_EQ(st.st_mtim.tv_nsec, built.tv_nsec);

  ASSERT_TRUE(pause(*info).ok());
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  ASSERT_EQ(::stat(disk.c_str(), &st), 0);
  const struct timespec overlay_made = st.st_mtim;
  auto restored = restore(*saved);
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_EQ(restored->driver_data["disk"], disk);
  EXPECT_NE(read_all(sandbox_dir_ + "/argv").find("file=" + disk), std::string::npos);
  ASSERT_EQ(::stat(disk.c_str(), &st), 0);
  EXPECT_EQ(st.st_mtim.tv_nsec, overlay_made.tv_nsec);  // not recreated
}

// A filesystem checkpoint of a VM is a backup job of its disk, after the guest's agent wrote out its files;
// the guest never stops, and a VM started on the copy boots on an overlay of its own over it. A VM paused in
// memory is copied as it stands (not asked), and stays paused; a hibernated one's overlay is copied with no
// QEMU started.
TEST_F(QemuDiskTest, AFilesystemCheckpointCopiesTheDiskAfterTheGuestWroteOutItsFilesAndANewVmBootsOnIt) {
  ::setenv("FAKE_QEMU_ANSWERS", "1", 1);
  ::setenv("FAKE_QEMU_AGENT", "listening", 1);
  ASSERT_TRUE(driver().capabilities().disk_checkpoint);
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string disk = sandbox_dir_ + "/disk.qcow2";
  // What the guest wrote: a cluster in its overlay, which the copy must carry.
  ASSERT_EQ(std::system(("qemu-io -f qcow2 -c 'write -P 0xab 1M 64k' " + disk + " >/dev/null").c_str()), 0);
  const std::string snap = dir_.path() + "/snap";
  auto saved = checkpoint_disk(*info, snap);
  ASSERT_TRUE(saved.has_value());
  ASSERT_TRUE(*saved) << saved->message();
  EXPECT_EQ(lines_of(sandbox_dir_ + "/syncs"), std::vector<std::string>{"sync while running"})
      << "the guest was not asked to write out its files before the backup";
  const std::vector<std::string> commands = lines_of(sandbox_dir_ + "/qmp-commands");
  EXPECT_EQ(std::count(commands.begin(), commands.end(), "stop"), 0) << "the guest was stopped for its checkpoint";
  EXPECT_EQ((*saved)->parent, "") << "a first checkpoint is the whole overlay";
  EXPECT_GT((*saved)->pause_ms, 0);
  EXPECT_GT((*saved)->disk_bytes, 0u);
  EXPECT_EQ((*saved)->state_bytes, 0u);
  EXPECT_EQ(read_all(snap + "/" + kSnapshotDisk), read_all(disk));
  EXPECT_FALSE(std::filesystem::exists(snap + "/" + kMemoryState));
  EXPECT_FALSE(driver().observe(spec_, *info).paused) << "the guest must run again after its checkpoint";

  auto [spec, dir] = other_sandbox();
  spec.snapshot_disk = snap + "/" + kSnapshotDisk;
  spec.memory_mb = spec_.memory_mb * 2;  // a cold boot: the shape may differ
  const SandboxSpec& from_spec = spec;
  const std::string& from_dir = dir;
  auto from = wait_runtime([&](Driver::RuntimeDone d) { driver().start(from_spec, from_dir, std::move(d)); });
  ASSERT_TRUE(from.ok()) << from.message();
  EXPECT_EQ(from->driver_data["disk"], dir + "/disk.qcow2");
  FILE* p = ::popen(("qemu-img info --output=json " + dir + "/disk.qcow2").c_str(), "r");
  std::string qinfo;
  char buf[512];
  for (size_t n; p && (n = std::fread(buf, 1, sizeof buf, p)) > 0;) qinfo.append(buf, n);
  if (p) ::pclose(p);
  EXPECT_NE(qinfo.find("\"backing-filename\": \"" + spec.snapshot_disk + "\""), std::string::npos) << qinfo;
  EXPECT_EQ(lookups_, 1) << "a VM on a snapshot's disk looked its image's layers up";
  EXPECT_TRUE(wait_status([&](Driver::Done d) { driver().terminate(from_spec, *from, std::move(d)); }).ok());

  // Paused in memory: copied as it stands, not asked, left paused.
  ASSERT_TRUE(pause(*info).ok());
  auto paused = checkpoint_disk(*info, dir_.path() + "/snap-paused", CheckpointFrom::kPaused);
  ASSERT_TRUE(paused.has_value() && paused->ok()) << (paused ? paused->message() : "");
  EXPECT_EQ((*paused)->pause_ms, 0);
  EXPECT_FALSE((*paused)->parent.empty()) << "the second checkpoint copied the whole overlay again";
  EXPECT_EQ(lines_of(sandbox_dir_ + "/syncs").size(), 1u);
  EXPECT_TRUE(driver().observe(spec_, *info).paused);
  // Hibernated: the overlay copied with no QEMU running.
  auto hibernated = hibernate(*info);
  ASSERT_TRUE(hibernated.ok()) << hibernated.message();
  const size_t spawns = spawned_pids(sandbox_dir_).size();
  auto copied = checkpoint_disk(*hibernated, dir_.path() + "/snap-hibernated", CheckpointFrom::kHibernated);
  ASSERT_TRUE(copied.has_value() && copied->ok()) << (copied ? copied->message() : "");
  EXPECT_EQ(read_all(dir_.path() + "/snap-hibernated/" + kSnapshotDisk), read_all(disk));
  EXPECT_EQ(spawned_pids(sandbox_dir_).size(), spawns) << "a QEMU ran for the checkpoint";
  EXPECT_TRUE(driver().observe(spec_, *hibernated).hibernated);
}

// The backup jobs a live guest's checkpoints run: the first copies the overlay's own clusters (`sync: top`)
// and starts a bitmap named after its snapshot; the next copies what that bitmap marks into an overlay of the
// first one's disk, which it names as its parent, and the first bitmap goes. A base whose snapshot is gone,
// or a job that fails, never leaves a delta over nothing: the failed one's bitmap goes, the base stays.
TEST_F(QemuDiskTest, ALaterDiskCheckpointCopiesWhatChangedSinceTheLastOneOverItsDisk) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string disk = sandbox_dir_ + "/disk.qcow2";
  auto backups = [&] { return lines_of(sandbox_dir_ + "/backups"); };
  auto bitmaps = [&] { return read_all(disk + ".bitmaps"); };
  const std::string id1 = snapshot::generate_snapshot_id(), id2 = snapshot::generate_snapshot_id(),
                    id3 = snapshot::generate_snapshot_id(), id4 = snapshot::generate_snapshot_id(),
                    id5 = snapshot::generate_snapshot_id();
  const std::string snap1 = dir_.path() + "/" + id1, snap2 = dir_.path() + "/" + id2;

  auto first = checkpoint_disk(*info, snap1, CheckpointFrom::kRunning, id1);
  ASSERT_TRUE(first && *first) << (first ? first->message() : "");
  EXPECT_EQ((*first)->parent, "");
  ASSERT_EQ(backups().size(), 1u);
  auto job = nlohmann::json::parse(backups()[0]);
  EXPECT_EQ(job["sync"], "top");
  EXPECT_EQ(job["device"], "root");
  EXPECT_EQ(bitmaps(), "[\"" + id1 + "\"]");
  auto last = read_last_disk_checkpoint(sandbox_dir_);
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->id, id1);
  EXPECT_EQ(last->disk, snap1 + "/" + kSnapshotDisk);
  EXPECT_EQ(last->chain, 1u);

  auto second = checkpoint_disk(*info, snap2, CheckpointFrom::kRunning, id2);
  ASSERT_TRUE(second && *second) << (second ? second->message() : "");
  EXPECT_EQ((*second)->parent, id1);
  ASSERT_EQ(backups().size(), 2u);
  job = nlohmann::json::parse(backups()[1]);
  EXPECT_EQ(job["sync"], "bitmap");
  EXPECT_EQ(job["bitmap"], id1);
  EXPECT_EQ(job["bitmap-mode"], "never");
  EXPECT_EQ(bitmaps(), "[\"" + id2 + "\"]") << "the first checkpoint's bitmap stayed";
  EXPECT_EQ(read_last_disk_checkpoint(sandbox_dir_)->id, id2);
  EXPECT_EQ(read_last_disk_checkpoint(sandbox_dir_)->chain, 2u);

  // The second snapshot is gone (removed, or never recorded): the next one is whole again.
  std::filesystem::remove_all(snap2);
  auto third = checkpoint_disk(*info, dir_.path() + "/" + id3, CheckpointFrom::kRunning, id3);
  ASSERT_TRUE(third && *third) << (third ? third->message() : "");
  EXPECT_EQ((*third)->parent, "");
  EXPECT_EQ(nlohmann::json::parse(backups()[2])["sync"], "top");
  EXPECT_EQ(bitmaps(), "[\"" + id3 + "\"]");

  // A job that fails: a clear error; its bitmap and node go, and the next checkpoint is still a delta.
  ::setenv("FAKE_QEMU_MODE", "backup-fail", 1);
  ASSERT_TRUE(pause(*info).ok());
  auto hibernated = hibernate(*info);
  ASSERT_TRUE(hibernated.ok()) << hibernated.message();
  auto restored = restore(*hibernated);  // the fake reads its mode at spawn
  ASSERT_TRUE(restored.ok()) << restored.message();
  auto failed = checkpoint_disk(*restored, dir_.path() + "/" + id4, CheckpointFrom::kRunning, id4);
  ASSERT_TRUE(failed.has_value());
  ASSERT_FALSE(*failed);
  EXPECT_NE(failed->message().find("No space left on device"), std::string::npos) << failed->message();
  EXPECT_EQ(bitmaps(), "[\"" + id3 + "\"]") << "the failed checkpoint's bitmap stayed, or the base's went";
  EXPECT_EQ(read_last_disk_checkpoint(sandbox_dir_)->id, id3);
  EXPECT_FALSE(driver().observe(spec_, *restored).paused);
  mode("ok");
  ASSERT_TRUE(pause(*restored).ok());
  hibernated = hibernate(*restored);
  ASSERT_TRUE(hibernated.ok()) << hibernated.message();
  restored = restore(*hibernated);
  ASSERT_TRUE(restored.ok()) << restored.message();
  auto fifth = checkpoint_disk(*restored, dir_.path() + "/" + id5, CheckpointFrom::kRunning, id5);
  ASSERT_TRUE(fifth && *fifth) << (fifth ? fifth->message() : "");
  EXPECT_EQ((*fifth)->parent, id3) << "the bitmap did not last through the hibernation";
}

// A memory checkpoint of a guest with a disk copies the disk while the guest stands, before the migration
// leaves the disk inactive: a backup job like a disk checkpoint's, a delta over the last checkpoint.
TEST_F(QemuDiskTest, AMemoryCheckpointCopiesTheDiskWhileTheGuestStandsAsADeltaOverTheLastCheckpoint) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string id1 = snapshot::generate_snapshot_id(), id2 = snapshot::generate_snapshot_id();
  auto first = checkpoint_disk(*info, dir_.path() + "/" + id1, CheckpointFrom::kRunning, id1);
  ASSERT_TRUE(first && *first) << (first ? first->message() : "");
  std::filesystem::remove(sandbox_dir_ + "/qmp-commands");
  auto saved = checkpoint_memory(*info, dir_.path() + "/" + id2, CheckpointFrom::kRunning, id2);
  ASSERT_TRUE(saved && *saved) << (saved ? saved->message() : "");
  EXPECT_EQ((*saved)->parent, id1);
  EXPECT_GT((*saved)->disk_bytes, 0u);
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/" + id2 + "/" + kSnapshotDisk));
  const std::vector<std::string> commands = lines_of(sandbox_dir_ + "/qmp-commands");
  auto at = [&](const std::string& command) {
    return std::find(commands.begin(), commands.end(), command) - commands.begin();
  };
  EXPECT_LT(at("stop"), at("transaction"));
  EXPECT_LT(at("transaction"), at("migrate"));
  EXPECT_LT(at("migrate"), at("cont"));
  EXPECT_LT(at("cont"), static_cast<long>(commands.size()));
  EXPECT_EQ(nlohmann::json::parse(lines_of(sandbox_dir_ + "/backups").back())["bitmap"], id1);
  EXPECT_EQ(read_last_disk_checkpoint(sandbox_dir_)->id, id2);
  EXPECT_FALSE(driver().observe(spec_, *info).paused);
}

// A guest whose agent does not listen cannot be asked to write out its files: its disk is copied as it
// stands all the same (the node logs it), and nothing is sent to the init's identity script.
TEST_F(QemuDiskTest, AFilesystemCheckpointOfAGuestWithoutAListeningAgentCopiesTheDiskAsItStands) {
  ::setenv("FAKE_QEMU_ANSWERS", "1", 1);
  ::setenv("FAKE_QEMU_AGENT", "none", 1);
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  auto saved = checkpoint_disk(*info, dir_.path() + "/snap");
  ASSERT_TRUE(saved.has_value());
  ASSERT_TRUE(*saved) << saved->message();
  EXPECT_FALSE(std::filesystem::exists(sandbox_dir_ + "/syncs"));
  EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/snap/" + kSnapshotDisk));
  EXPECT_FALSE(driver().observe(spec_, *info).paused);
}

// An image removed and made again under its name with other layers: a sandbox of the new one boots a new base
// of the new content; the old base goes once its layers are gone (the layer store's GC after `image rm`), and
// a base whose layers are all there stays.
TEST_F(QemuDiskTest, ABaseIsKeyedByTheLayersAndGoesWithThem) {
  auto first = start();
  ASSERT_TRUE(first.ok()) << first.message();
  const std::string disks = cfg_.state_dir + "/qemu-disks";
  auto bases = [&] {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(disks))
      if (e.path().extension() == ".raw") out.push_back(e.path());
    return out;
  };
  ASSERT_EQ(bases().size(), 1u);
  const std::string old_base = bases()[0];

  const std::string again = dir_.path() + "/layers/again";  // "img" again, one other layer
  std::filesystem::create_directories(again + "/etc");
  std::ofstream(again + "/etc/which") << "again\n";
  layers_ = [again](const std::string&) -> Result<std::vector<std::string>> { return std::vector<std::string>{again}; };
  driver_.reset();
  const std::string second = dir_.path() + "/sb2";
  std::filesystem::create_directories(second);
  sandbox_dirs_.push_back(second);
  auto other = start_in(second);
  ASSERT_TRUE(other.ok()) << other.message();
  ASSERT_EQ(bases().size(), 2u);
  std::string new_base;
  for (const std::string& b : bases())
    if (b != old_base) new_base = b;
  EXPECT_EQ(read_in_disk(new_base, "/etc/which"), "again\n");

  remove_orphaned_guest_disks(disks);
  EXPECT_EQ(bases().size(), 2u);  // every layer is still there
  std::filesystem::remove_all(upper_);
  remove_orphaned_guest_disks(disks);
  EXPECT_EQ(bases(), std::vector<std::string>{new_base});
  EXPECT_FALSE(std::filesystem::exists(old_base.substr(0, old_base.size() - 4) + ".trees"));
}

TEST_F(QemuDiskTest, MissingImageFailsTheStartNamingItAndStartsNothing) {
  spec_.image = "gone";
  auto r = start();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kNotFound);
  EXPECT_NE(r.message().find("image 'gone'"), std::string::npos) << r.message();
  EXPECT_TRUE(spawned_pids(sandbox_dir_).empty());
}

TEST_F(QemuDriverTest, WithoutAnImageTheGuestBootsTheInitramfsAlone) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_FALSE(info->driver_data.count("disk"));
  const std::string argv = read_all(sandbox_dir_ + "/argv");
  EXPECT_EQ(argv.find("-drive"), std::string::npos);
  EXPECT_EQ(argv.find("sg.root"), std::string::npos);
}

// Internet access: the VM's namespace is attached to the node's egress (a real bridge and nftables table of
// the test's own; nothing is routed anywhere) before QEMU runs, and QEMU's user networking drops restrict=on.
class QemuEgressTest : public QemuDriverTest {
 protected:
  void SetUp() override {
    QemuDriverTest::SetUp();
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (network namespaces, nftables)";
    for (const char* tool : {"ip", "nft", "nsenter"})
      if (!run_tool({"sh", "-c", std::string("command -v ") + tool})) GTEST_SKIP() << tool << " is not installed";
    // The egress kernel tests' lock (egress_test.cc): they turn ip_forward on and off, one at a time.
    lock_ = UniqueFd(::open(SANDGATE_BIN_DIR "/egress-kernel-test.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(lock_.valid());
    ASSERT_EQ(::flock(lock_.get(), LOCK_EX), 0);
    forward_before_ = read_all("/proc/sys/net/ipv4/ip_forward");
    cfg_.egress_bridge = tag_;
    cfg_.egress_subnet = "10.249.0.0/16";
    cfg_.deny_out = {"192.0.2.0/24"};
    spec_.uid_base = cfg_.uid_range_base + 5 * kUidRangeSize;  // slot 5: 10.249.0.7
    egress_ = std::make_unique<SandboxEgress>(cfg_);
  }
  void TearDown() override {
    QemuDriverTest::TearDown();
    (void)run_tool({"ip", "link", "del", tag_});
    (void)run_tool({"nft", "delete", "table", "inet", tag_});
    if (!forward_before_.empty()) std::ofstream("/proc/sys/net/ipv4/ip_forward") << forward_before_;
  }
  // `ip ARGS` inside the network namespace of QEMU `pid` ("" when that fails).
  static std::string ip_in(int pid, std::vector<std::string> args) {
    std::vector<std::string> argv = {"nsenter", "--net=/proc/" + std::to_string(pid) + "/ns/net", "ip"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto out = run_tool(std::move(argv));
    return out ? *out : "";
  }
  Status terminate(const RuntimeInfo& info) {
    return wait_status([&](Driver::Done d) { driver().terminate(spec_, info, std::move(d)); });
  }
  std::string tag_ = "sgq" + std::to_string(::getpid() % 100000);
  std::string forward_before_;
  UniqueFd lock_;
};

TEST_F(QemuEgressTest, InternetAccessAttachesEachNewNamespaceAndTerminateRemovesTheChain) {
  spec_.allow_internet_access = true;
  spec_.deny_out = {"198.51.100.7"};
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string argv = read_all(sandbox_dir_ + "/argv");
  EXPECT_NE(argv.find("user,id=net0,hostfwd="), std::string::npos) << argv;
  EXPECT_EQ(argv.find("restrict"), std::string::npos) << argv;
  // QEMU's own namespace has the slot's eth0 and a default route to the node's bridge.
  EXPECT_NE(ip_in(info->pid, {"-o", "-4", "addr", "show", "dev", "eth0"}).find("10.249.0.7/16"), std::string::npos);
  EXPECT_NE(ip_in(info->pid, {"route", "show", "default"}).find("via 10.249.0.1"), std::string::npos);
  // The sandbox's chain: the always-denied range, node.deny_out and its own deny_out.
  auto chain = run_tool({"nft", "list", "chain", "inet", tag_, "sb5"});
  ASSERT_TRUE(chain) << chain.message();
  for (const char* net : {"169.254.0.0/16", "192.0.2.0/24", "198.51.100.7"})
    EXPECT_NE(chain->find(net), std::string::npos) << net << " in " << *chain;

  // Hibernated, the namespace (and the veth in it) dies with QEMU; the restored QEMU's new one is attached.
  ASSERT_TRUE(pause(*info).ok());
  auto saved = hibernate(*info);
  ASSERT_TRUE(saved.ok()) << saved.message();
  auto restored = restore(*saved);
  ASSERT_TRUE(restored.ok()) << restored.message();
  ASSERT_NE(restored->pid, info->pid);
  EXPECT_NE(ip_in(restored->pid, {"-o", "-4", "addr", "show", "dev", "eth0"}).find("10.249.0.7/16"), std::string::npos);
  EXPECT_NE(read_all(sandbox_dir_ + "/argv").find("user,id=net0,hostfwd="), std::string::npos);

  ASSERT_TRUE(terminate(*restored).ok());
  EXPECT_FALSE(run_tool({"nft", "list", "chain", "inet", tag_, "sb5"}));
  EXPECT_FALSE(run_tool({"ip", "link", "show", "dev", tag_ + "v5"}));
}

TEST_F(QemuEgressTest, WithoutInternetAccessNothingIsAttachedAndRestrictStays) {
  auto info = start();
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_NE(read_all(sandbox_dir_ + "/argv").find("user,id=net0,restrict=on,"), std::string::npos);
  const std::string links = ip_in(info->pid, {"-o", "link", "show"});
  EXPECT_NE(links.find("lo:"), std::string::npos) << links;
  EXPECT_EQ(links.find("eth0"), std::string::npos) << links;
  // The node's bridge is made only when a sandbox with internet access attaches.
  EXPECT_FALSE(run_tool({"ip", "link", "show", "dev", tag_}));
}

}  // namespace
}  // namespace sg
