#!/usr/bin/env bash
# QEMU boot to the first HTTP answer: the initramfs alone vs a root disk made from an image, the way the
# driver makes it (an ext4 base with mkfs.ext4 -d, a fresh qcow2 overlay per boot, sg.root=/dev/vda):
#   bench/qemu_disk_boot.sh [RUNS] [ROOTFS]     (defaults: 3 runs; a Debian bookworm "essential" tree made
#                                                with mmdebstrap when no ROOTFS directory is given)
# Same guest (deploy/build-guest-image.sh into $SANDGATE_GUEST_DIR, default /tmp/sandgate-guest, no agent),
# same command in both modes: busybox httpd, through a hostfwd port. Prints a markdown table of medians, and
# the one-off cost of the base disk.
set -euo pipefail
runs=${1:-3}
src=$(cd "$(dirname "$0")/.." && pwd)
guest=${SANDGATE_GUEST_DIR:-/tmp/sandgate-guest}
bash "$src/deploy/build-guest-image.sh" "$guest" >&2
work=$(mktemp -d /tmp/sandgate-disk-bench.XXXXXX)
trap 'pkill -F "$work/qemu.pid" 2>/dev/null || true; rm -rf "$work"' EXIT
rootfs=${2:-}
if [[ -z $rootfs ]]; then
  rootfs=$work/rootfs
  mmdebstrap --quiet --mode=root --variant=essential bookworm "$rootfs" http://deb.debian.org/debian >&2
fi
exec python3 - "$guest" "$work" "$runs" "$rootfs" <<'PY'
import os, socket, statistics, subprocess, sys, time, urllib.request

guest, work, runs, rootfs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tree = int(subprocess.run(["du", "-sb", rootfs], capture_output=True, text=True).stdout.split()[0])
base = os.path.join(work, "base.raw")
t = time.monotonic()
# The driver's size: the tree plus a quarter plus 256 MiB free.
subprocess.run(["mkfs.ext4", "-q", "-F", "-d", rootfs, base, "%dM" % ((tree + tree // 4 + (256 << 20)) >> 20)], check=True)
mkfs = time.monotonic() - t

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

command = os.path.join(work, "command")
open(command, "w").write("b=busybox; [ -x /run/sandgate/busybox ] && b=/run/sandgate/busybox\n"
                         "mkdir -p /tmp/www; echo ok >/tmp/www/index.html; exec $b httpd -f -p 8080 -h /tmp/www\n")
khz = None
for line in open("/proc/cpuinfo"):
    if line.startswith("cpu MHz"):
        khz = int(float(line.split(":")[1]) * 1000); break

def boot(disk):
    port = free_port()
    append = "console=ttyS0 clocksource=tsc tsc=reliable quiet panic=-1 tsc_early_khz=%d" % khz
    extra = []
    if disk:
        overlay = os.path.join(work, "disk.qcow2")
        if os.path.exists(overlay): os.unlink(overlay)
        t0 = time.monotonic()
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", overlay], check=True)
        append += " sg.root=/dev/vda"
        extra = ["-drive", "file=%s,if=none,id=root,format=qcow2" % overlay, "-device", "virtio-blk-device,drive=root"]
    else:
        t0 = time.monotonic()
    args = ["qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-cpu", "max", "-m", "256", "-smp", "1",
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-chardev", "file,id=console,path=" + os.path.join(work, "console.log"), "-serial", "chardev:console",
            "-kernel", guest + "/vmlinuz", "-initrd", guest + "/initrd.img", "-append", append,
            "-fw_cfg", "name=opt/sandgate/command,file=" + command,
            "-netdev", "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:%d-:8080" % port,
            "-device", "virtio-net-device,netdev=net0"] + extra
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    open(os.path.join(work, "qemu.pid"), "w").write(str(p.pid))
    while True:
        try:
            if urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=5).read().strip() == b"ok": break
        except Exception:
            pass
        if time.monotonic() - t0 > 180: sys.exit("the guest did not answer within 180 s (disk=%s)" % disk)
        time.sleep(0.02)
    took = time.monotonic() - t0
    p.kill(); p.wait()
    return took

results = {False: [], True: []}
for i in range(runs):
    for disk in (False, True):
        results[disk].append(boot(disk))
ms = lambda v: "%.0f ms" % (statistics.median(v) * 1000)
print("QEMU %s microvm, TCG, -m 256, %d runs each, alternating (medians); root disk from %s (%.0f MiB tree)\n" % (
    subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout.split()[3], runs,
    rootfs, tree / 1048576))
print("| boot to first HTTP answer | median | runs |")
print("|---|---|---|")
print("| initramfs only | %s | %s |" % (ms(results[False]), ", ".join("%.0f" % (x * 1000) for x in results[False])))
print("| image disk (qcow2 overlay, incl. qemu-img create) | %s | %s |" % (
    ms(results[True]), ", ".join("%.0f" % (x * 1000) for x in results[True])))
print("\nBase disk (once per image): mkfs.ext4 -d of the tree: %.1f s" % mkfs)
PY
