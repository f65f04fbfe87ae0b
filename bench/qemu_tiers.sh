#!/usr/bin/env bash
# The QEMU driver's suspend tiers, measured on the mechanism the driver uses (same QEMU arguments, QMP
# commands and state file), without the node in between:
#   bench/qemu_tiers.sh [RUNS] [MEMORY_MB]      (defaults: 5 runs, 256 MiB)
# Boots one microvm guest (deploy/build-guest-image.sh into $SANDGATE_GUEST_DIR, default /tmp/sandgate-guest)
# running busybox httpd, then per run: pause (QMP stop), resume (QMP cont), hibernate (stop + migrate to
# "exec:cat > file" until completed, fsync), restore (spawn with -incoming defer, migrate-incoming, cont) to
# the first HTTP answer through the forwarded port. Prints a markdown table of medians.
set -euo pipefail
runs=${1:-5}
mem=${2:-256}
src=$(cd "$(dirname "$0")/.." && pwd)
guest=${SANDGATE_GUEST_DIR:-/tmp/sandgate-guest}
bash "$src/deploy/build-guest-image.sh" "$guest" >&2
work=$(mktemp -d /tmp/sandgate-qemu-bench.XXXXXX)
trap 'pkill -F "$work/qemu.pid" 2>/dev/null || true; rm -rf "$work"' EXIT

exec python3 - "$guest" "$work" "$runs" "$mem" <<'PY'
import json, os, socket, statistics, subprocess, sys, time, urllib.request

guest, work, runs, mem = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

http_port = free_port()
qmp_path = os.path.join(work, "qmp.sock")
console = os.path.join(work, "console.log")
cmd = b"mkdir -p /tmp/www; echo ok >/tmp/www/index.html; exec httpd -f -p 8080 -h /tmp/www\n"
# The guest's init reads its command from this fw_cfg file, as the driver passes it.
command_file = os.path.join(work, "command")
open(command_file, "wb").write(cmd)
# TCG guests read the host TSC, which microvm's kernel cannot calibrate (the driver measures it with rdtsc).
khz = None
for line in open("/proc/cpuinfo"):
    if line.startswith("cpu MHz"):
        khz = int(float(line.split(":")[1]) * 1000); break
append = "console=ttyS0 clocksource=tsc tsc=reliable quiet panic=-1 tsc_early_khz=%d" % khz
base = ["qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-cpu", "max", "-m", mem, "-smp", "1",
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-chardev", "file,id=console,append=on,path=" + console, "-serial", "chardev:console",
        "-qmp", "unix:%s,server=on,wait=off" % qmp_path, "-kernel", guest + "/vmlinuz", "-initrd", guest + "/initrd.img",
        "-append", append, "-fw_cfg", "name=opt/sandgate/command,file=" + command_file, "-netdev", "user,id=net0,hostfwd=tcp:127.0.0.1:%d-:8080" % http_port,
        "-device", "virtio-net-device,netdev=net0"]

def spawn(extra):
    if os.path.exists(qmp_path): os.unlink(qmp_path)
    p = subprocess.Popen(base + extra, stdin=subprocess.DEVNULL, stdout=open(os.path.join(work, "qemu.log"), "a"),
                         stderr=subprocess.STDOUT)
    open(os.path.join(work, "qemu.pid"), "w").write(str(p.pid))
    return p

class Qmp:
    def __init__(self):
        for _ in range(500):
            try:
                self.s = socket.socket(socket.AF_UNIX); self.s.connect(qmp_path); break
            except OSError: time.sleep(0.01)
        self.f = self.s.makefile("rw"); self.f.readline(); self.cmd("qmp_capabilities")
    def cmd(self, c, a=None):
        m = {"execute": c}
        if a is not None: m["arguments"] = a
        self.f.write(json.dumps(m) + "\n"); self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "event" not in r: return r

def http_ok():
    try: return urllib.request.urlopen("http://127.0.0.1:%d/" % http_port, timeout=5).read().strip() == b"ok"
    except Exception: return False

p = spawn([])
t = time.monotonic()
while not http_ok():
    if time.monotonic() - t > 180: sys.exit("guest did not boot")
    time.sleep(0.05)
boot = time.monotonic() - t
q = Qmp()
pause, resume, hib, size, restore, first = [], [], [], [], [], []
state = os.path.join(work, "qemu.state")
for i in range(runs):
    t = time.monotonic(); q.cmd("stop"); pause.append(time.monotonic() - t)
    t = time.monotonic(); q.cmd("cont"); resume.append(time.monotonic() - t)
    http_ok()
    t = time.monotonic()
    q.cmd("stop")
    q.cmd("migrate-set-parameters", {"max-bandwidth": 1 << 40})
    q.cmd("migrate", {"uri": "exec:cat > " + state + ".tmp"})
    while q.cmd("query-migrate")["return"].get("status") not in ("completed", "failed", "cancelled"):
        time.sleep(0.02)
    fd = os.open(state + ".tmp", os.O_RDONLY); os.fsync(fd); os.close(fd)
    os.rename(state + ".tmp", state)
    hib.append(time.monotonic() - t)
    size.append(os.path.getsize(state))
    q.cmd("quit"); p.wait()
    t = time.monotonic()
    p = spawn(["-S", "-incoming", "defer"])
    q = Qmp()
    q.cmd("migrate-incoming", {"uri": "exec:cat " + state})
    while q.cmd("query-status")["return"]["status"] == "inmigrate": time.sleep(0.02)
    q.cmd("cont")
    restore.append(time.monotonic() - t)
    while not http_ok(): time.sleep(0.01)
    first.append(time.monotonic() - t)
q.cmd("quit"); p.wait()

ms = lambda v: "%.1f ms" % (statistics.median(v) * 1000)
print("QEMU %s microvm, TCG, -m %s, %d runs (medians); cold boot to first HTTP answer: %.2f s\n" % (
    subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout.split()[3], mem, runs, boot))
print("| operation | median |")
print("|---|---|")
print("| pause (QMP stop) | %s |" % ms(pause))
print("| resume (QMP cont) | %s |" % ms(resume))
print("| hibernate (stop + migrate to file + fsync) | %s |" % ms(hib))
print("| state file size | %.1f MiB |" % (statistics.median(size) / 1048576))
print("| restore (spawn + load + cont) | %s |" % ms(restore))
print("| restore to first HTTP answer | %s |" % ms(first))
PY
