#!/usr/bin/env bash
# Builds the QEMU driver's guest from Debian packages only: Debian's cloud kernel plus a busybox initramfs.
#   deploy/build-guest-image.sh OUT_DIR [AGENT_BINARY]
# Writes OUT_DIR/vmlinuz and OUT_DIR/initrd.img (point node.guest_kernel / node.guest_initrd at them, or use
# OUT_DIR = <state_dir>/guest, the node's default). AGENT_BINARY (or $SANDGATE_AGENT), when given and
# present, is put in the initramfs with every shared library it loads (ldd) and started on boot.
#
# Nothing is installed on the host: the kernel package is fetched with `apt-get download` and unpacked with
# `dpkg-deb -x` into the cache ($SANDGATE_GUEST_CACHE, default OUT_DIR/.cache), once. busybox-static is
# installed through apt if /bin/busybox is missing. A rerun with the same inputs does nothing (a stamp of the
# inputs' hashes sits next to the image). Exit 0 built or up to date, 1 error, 77 the kernel package cannot
# be resolved or downloaded (tests skip on it).
#
# The guest (what the QEMU driver relies on):
#   - fw_cfg file `opt/sandgate/command`: a shell script (the sandbox's env, cwd and argv, quoted) the init
#     runs as the sandbox's command (fw_cfg, not the kernel command line, so it never shows in the host's
#     process list); kernel command line `sg.agent=<port>`: the agent's port; `sg.clock=<port>`: the port the
#     init listens on for the host's epoch time (the driver sends it after a resume or restore, since the
#     guest clock stood still while the VM was stopped), followed by the sandbox's id, hostname and an RNG
#     seed (after a start too: a guest restored from a memory snapshot takes its new identity from it), and
#     for a guest with SSH the sandbox's host key and the node's authorized_keys (base64; "-" empty), then
#     the line's sequence and the boot's secret, fw_cfg file `opt/sandgate/identity_secret`, without which
#     the line is dropped (/lib/sandgate/identity applies each connection's line).
#   - kernel command line `sg.ssh=<port>` and fw_cfg file `opt/sandgate/ssh_host_key`: the agent also serves
#     SSH on that port (docs/ssh.md), with that host key, and the keys the identity line brings (re-read by
#     the agent for each connection, replaced whole by each line).
#   - kernel command line `sg.root=/dev/vda` (a QEMU sandbox booting an image's disk): the init mounts that
#     ext4 disk and runs the agent and the command chrooted into it (the agent with the libraries it was
#     copied with, from a tmpfs at /run/sandgate, so the image needs none of them; the command with the
#     image's /bin/sh, or busybox's when it has none). Without it the initramfs is the root filesystem.
#   - eth0 is QEMU user networking: 10.0.2.15/24, gateway 10.0.2.2, DNS 10.0.2.3.
#   - each identity line is answered once all of it is applied: "ok", or "failed <step>" naming the first
#     step that failed; "SANDGATE-GUEST-IDENTITY answers" on the serial console says this guest answers (the
#     driver waits for the answer before a wake lets requests through; guests built before it are not
#     waited for). The agent applies the lines (--identity-listen); without one, /lib/sandgate/identity does;
#   - "SANDGATE-GUEST-AGENT listening|none|failed" on the serial console, before the ready line: whether the
#     agent listens on sg.agent (none: the image has no agent; failed: it did not listen within 10 s);
#   - "SANDGATE-GUEST-READY" on the serial console once the network is up and the command started;
#     "SANDGATE-GUEST-EXIT <status>" when the command ends, after which the guest powers off (the VM exits).
set -euo pipefail

# Progress goes to stderr, like errors: sandgate-node logs every line while it builds on first use.
say() { echo "build-guest-image: $*" >&2; }
fatal() { echo "build-guest-image: $*" >&2; exit 1; }
skip() { echo "build-guest-image: $*" >&2; exit 77; }

[[ $# -ge 1 && $# -le 2 ]] || { echo "usage: $0 OUT_DIR [AGENT_BINARY]" >&2; exit 2; }
mkdir -p "$1"
out=$(cd "$1" && pwd)
agent=${2:-${SANDGATE_AGENT:-}}
[[ -z $agent || -x $agent ]] || { echo "build-guest-image: no agent at $agent; building without it" >&2; agent=; }
cache=${SANDGATE_GUEST_CACHE:-$out/.cache}
mkdir -p "$cache"

apt_quiet() { DEBIAN_FRONTEND=noninteractive "$@" >/dev/null 2>&1; }
if [[ ! -x /bin/busybox ]]; then
  say "installing busybox-static"
  apt_quiet apt-get install -y --no-install-recommends busybox-static ||
    { apt_quiet apt-get update && apt_quiet apt-get install -y --no-install-recommends busybox-static; } ||
    fatal "cannot install busybox-static"
fi

# The kernel the cloud meta-package points at. Resolved once and remembered: apt's answer changes with every
# Debian point release, and a cached kernel is as good as the newest one for a guest.
if [[ -f $cache/kernel-package ]]; then
  kpkg=$(cat "$cache/kernel-package")
else
  say "resolving linux-image-cloud-amd64 to a kernel package"
  resolve() { apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'; }
  kpkg=$(resolve)
  [[ -n $kpkg ]] || { apt_quiet apt-get update || true; kpkg=$(resolve); }
  [[ -n $kpkg ]] || skip "apt cannot resolve linux-image-cloud-amd64 to a kernel package"
fi
kver=${kpkg#linux-image-}
kroot=$cache/$kpkg
if [[ ! -f $kroot/boot/vmlinuz-$kver ]]; then
  say "downloading $kpkg (once; cached in $cache)"
  (cd "$cache" && rm -f "$kpkg"_*.deb && apt_quiet apt-get download "$kpkg") ||
    (apt_quiet apt-get update && cd "$cache" && apt_quiet apt-get download "$kpkg") ||
    skip "cannot download $kpkg"
  say "unpacking $kpkg"
  rm -rf "$kroot.tmp" && dpkg-deb -x "$cache/$kpkg"_*.deb "$kroot.tmp" && mv "$kroot.tmp" "$kroot"
  rm -f "$cache/$kpkg"_*.deb
fi
echo "$kpkg" >"$cache/kernel-package"

# virtio-mmio, virtio-net and the fw_cfg sysfs driver are modules in the cloud kernel; insmod does not resolve
# dependencies, so they are listed in dependency order (checked below against each module's own "depends=").
modules=(drivers/firmware/qemu_fw_cfg.ko drivers/virtio/virtio_ring.ko drivers/virtio/virtio.ko drivers/virtio/virtio_mmio.ko
         drivers/block/virtio_blk.ko net/core/failover.ko drivers/net/net_failover.ko drivers/net/virtio_net.ko)
kmod=$kroot/lib/modules/$kver/kernel
loaded=" "
for m in "${modules[@]}"; do
  [[ -f $kmod/$m ]] || fatal "$kpkg has no $m"
  for dep in $(strings "$kmod/$m" | sed -n 's/^depends=//p' | tr ',' ' '); do
    [[ $loaded == *" $dep "* ]] || fatal "$m needs $dep, which is not loaded before it"
  done
  loaded+="$(basename "$m" .ko) "
done

self=$(readlink -f "$0")
stamp="$kpkg $(sha256sum "$self" | cut -d' ' -f1) $(sha256sum /bin/busybox | cut -d' ' -f1)"
[[ -n $agent ]] && stamp+=" $(sha256sum "$agent" | cut -d' ' -f1)"
if [[ -f $out/vmlinuz && -f $out/initrd.img && "$(cat "$out/.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "build-guest-image: $out is up to date ($kpkg)"
  exit 0
fi

say "writing the initramfs (busybox${agent:+, agent $agent}) and the kernel to $out"
work=$(mktemp -d "$out/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root
mkdir -p "$root"/{bin,sbin,etc,proc,sys,dev,run,tmp,root,newroot,lib/sandgate,sandgate/lib}
cp /bin/busybox "$root/bin/busybox"
for m in "${modules[@]}"; do cp "$kmod/$m" "$root/lib/sandgate/"; done
printf '%s\n' "${modules[@]##*/}" >"$root/lib/sandgate/modules"
if [[ -n $agent ]]; then
  cp "$agent" "$root/sandgate/sandgate-agent"
  # A static agent (the normal build) needs nothing else; ldd answers "not a dynamic executable" for it.
  { ldd "$agent" 2>/dev/null || true; } | awk '/=> \// { print $3 } /^[ \t]*\// { print $1 }' | sort -u |
  while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
    # For an image's root, where the agent runs through its own ld.so: links, copied only then.
    ln -sf "$lib" "$root/sandgate/lib/$(basename "$lib")"
  done
  # The initramfs is unpacked into guest RAM: debug info (most of a -g build, and of a sanitizer build's
  # agent) would not fit a small guest ("Initramfs unpacking failed: write error" at -m 128).
  if command -v strip >/dev/null; then
    for d in "$root/sandgate" "$root/lib" "$root/lib64" "$root/usr"; do
      [[ -d $d ]] && find "$d" -type f -exec strip --strip-debug {} + 2>/dev/null || true
    done
  fi
fi
echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
echo 'root:x:0:' >"$root/etc/group"

cat >"$root/init" <<'INIT'
#!/bin/busybox sh
# PID 1 of a sandgate QEMU guest (deploy/build-guest-image.sh documents the contract with the driver).
/bin/busybox --install -s /bin
export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts && mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
for m in $(cat /lib/sandgate/modules); do insmod "/lib/sandgate/$m" || echo "SANDGATE-GUEST insmod $m failed"; done
ip link set lo up
ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip route add default via 10.0.2.2 ||
  echo "SANDGATE-GUEST eth0 is not up"
echo 'nameserver 10.0.2.3' >/etc/resolv.conf
arg() { for w in $(cat /proc/cmdline); do case "$w" in "$1="*) echo "${w#*=}";; esac; done; }
clock=$(arg sg.clock)
agent=$(arg sg.agent)
# With an image's disk: mount it, give it /proc, /sys, /dev and a tmpfs /run holding the agent and its
# libraries, and run the agent and the command chrooted into it.
in_root=
sh=/bin/sh
agent_bin=/sandgate/sandgate-agent
rootdev=$(arg sg.root)
if [ -n "$rootdev" ]; then
  if mount -t ext4 "$rootdev" /newroot; then
    for d in proc sys dev run tmp; do mkdir -p "/newroot/$d"; done
    mount -t proc proc /newroot/proc
    mount -t sysfs sysfs /newroot/sys
    mount -t devtmpfs devtmpfs /newroot/dev
    mkdir -p /newroot/dev/pts && mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
    mount -t tmpfs tmpfs /newroot/run
    cp -RL /sandgate /newroot/run/sandgate
    cp /bin/busybox /newroot/run/sandgate/busybox
    in_root="chroot /newroot"
    [ -x /newroot/bin/sh ] || sh="/run/sandgate/busybox sh"
    if [ -x /sandgate/sandgate-agent ]; then
      agent_bin=/run/sandgate/sandgate-agent
      loader=$(cd /sandgate/lib && ls ld-linux* 2>/dev/null | head -1)
      [ -n "$loader" ] && agent_bin="/run/sandgate/lib/$loader --library-path /run/sandgate/lib $agent_bin"
    fi
    echo "SANDGATE-GUEST root $rootdev"
  else
    echo "SANDGATE-GUEST cannot mount $rootdev; running from the initramfs"
  fi
fi
# SSH (sg.ssh): the agent's host key and the registered keys live here, in the root the agent runs in;
# $ssh_dir is that directory as the init sees it.
ssh=$(arg sg.ssh)
ssh_dir=/newroot/run/sandgate-ssh
[ -n "$in_root" ] || ssh_dir=/run/sandgate-ssh
ssh_args=
hostkey_fw=/sys/firmware/qemu_fw_cfg/by_name/opt/sandgate/ssh_host_key/raw
if [ -n "$ssh" ] && [ -r "$hostkey_fw" ] && mkdir -p -m 700 "$ssh_dir" && cp "$hostkey_fw" "$ssh_dir/host_ed25519" &&
   chmod 600 "$ssh_dir/host_ed25519" && : >"$ssh_dir/authorized_keys"; then
  ssh_args="--ssh-listen 0.0.0.0:$ssh --ssh-host-key /run/sandgate-ssh/host_ed25519 --ssh-authorized-keys /run/sandgate-ssh/authorized_keys"
fi
# The node's identity lines (the clock, SSH files, hostname, RNG reseed, id) go to the agent, which applies
# them in its running process (agent/identity_listener.h): a wake waits for the answer, and a script run per
# line would add a fork and two execs to every wake. The agent binds that port before its own.
identity_args=
[ -n "$clock" ] && identity_args="--identity-listen 0.0.0.0:$clock"
# The driver routes the SDK (exec, files, health) to the agent, so it must know whether one listens: a
# connection forwarded to a guest port nobody listens on is reset by QEMU only after the request was sent.
agent_state=none
if [ -n "$agent" ] && [ -x /sandgate/sandgate-agent ]; then
  $in_root $agent_bin --listen "0.0.0.0:$agent" $ssh_args $identity_args >/dev/console 2>&1 &
  # Listening sockets in /proc/net/tcp: local port in hex, state 0A (LISTEN). Bounded: ~10 s.
  hex=$(printf '%04X' "$agent")
  agent_state=failed
  for i in $(seq 100); do
    if grep -q "^ *[0-9]*: [0-9A-F]*:$hex [0-9A-F]*:0000 0A" /proc/net/tcp; then agent_state=listening; break; fi
    sleep 0.1
  done
fi
echo "SANDGATE-GUEST-AGENT $agent_state"
if [ -n "$clock" ]; then
  # Without a listening agent: /lib/sandgate/identity for each line, from a listener that never goes away
  # (a line sent while another is being applied is not refused).
  if [ "$agent_state" != listening ]; then
    export in_root agent_bin ssh_dir ssh_args
    nc -ll -p "$clock" -e /lib/sandgate/identity </dev/null >/dev/null 2>&1 &
  fi
  echo "SANDGATE-GUEST-IDENTITY answers"
fi
cmdfile=/run/sandgate-command.sh
[ -n "$in_root" ] && cmdfile=/newroot/run/sandgate-command.sh
cat /sys/firmware/qemu_fw_cfg/by_name/opt/sandgate/command/raw >"$cmdfile" ||
  echo "SANDGATE-GUEST no command in fw_cfg"
$in_root $sh /run/sandgate-command.sh </dev/null >/dev/console 2>&1 &
command=$!
echo "SANDGATE-GUEST-READY"
wait "$command"
echo "SANDGATE-GUEST-EXIT $?"
poweroff -f
INIT
chmod +x "$root/init"

cat >"$root/lib/sandgate/identity" <<'IDENTITY'
#!/bin/busybox sh
# One identity line from the node, on stdin (run by the init's `nc -ll` for each connection, so several may
# run at once): "<epoch seconds> <sandbox id> <hostname> <seed hex> <host key> <keys> <sequence> <secret>"
# (noderuntime/qemu_driver.h). Anything in the guest can connect to the listener, so a line without this
# boot's secret (the root-only fw_cfg file, read again for each line: a guest restored from a memory
# snapshot checks its new QEMU's) or without its newline (cut short) is dropped. The clock comes first,
# then the SSH files, under a lock and only from a line newer than the last one written (each line carries
# all the keys), then the hostname, the RNG reseed (guests restored from one memory snapshot draw different
# numbers) and the id, where the agent's /health reads it; last the answer a wake waits for before it lets
# requests through: "ok", or "failed <step>" naming the first step that failed. (Guests whose agent listens
# do all of this in the agent, agent/identity_listener.h: no process per line.)
set -f
trap '' PIPE  # a node that does not wait for the "ok" has closed the connection already
read -r line || exit 0
set -- $line
secret=
read -r secret </sys/firmware/qemu_fw_cfg/by_name/opt/sandgate/identity_secret/raw 2>/dev/null
[ -n "$secret" ] && [ "$8" = "$secret" ] || exit 0
case "$7" in '' | *[!0-9]*) exit 0 ;; esac
failed=
[ -n "$1" ] && date -s "@$1" >/dev/null || failed=clock
# One field into a file, replaced whole: base64, or "-" for empty.
put_field() {
  if [ "$1" = - ]; then : >"$2.new"; else echo "$1" | base64 -d >"$2.new"; fi && chmod 600 "$2.new" && mv "$2.new" "$2"
}
if [ -n "$ssh_args" ]; then
  lock=/run/sandgate-identity.lock
  until mkdir "$lock" 2>/dev/null; do
    holder=$(cat "$lock/pid" 2>/dev/null)
    [ -n "$holder" ] && [ ! -d "/proc/$holder" ] && rm -rf "$lock"  # its holder died holding it
    sleep 0.05
  done
  echo $$ >"$lock/pid"
  last=$(cat /run/sandgate-identity.seq 2>/dev/null || echo 0)
  written=yes  # an older line than the last one written: the newer files are there already
  if [ "$7" -gt "$last" ]; then
    { { [ "$5" = - ] || put_field "$5" "$ssh_dir/host_ed25519"; } && put_field "$6" "$ssh_dir/authorized_keys" &&
      echo "$7" >/run/sandgate-identity.seq; } || written=
  fi
  rm -rf "$lock"
  [ -n "$written" ] || { echo "SANDGATE-GUEST cannot write the SSH files" >/dev/console; failed=${failed:-ssh-files}; }
fi
hostname "$3" || failed=${failed:-hostname}
if [ "$4" != - ] && [ -x /sandgate/sandgate-agent ]; then
  $in_root $agent_bin --reseed-rng "$4" >/dev/console 2>&1 || failed=${failed:-reseed}
fi
echo "$2" >/run/sandgate-id || failed=${failed:-id}
[ -n "$in_root" ] && echo "$2" >/newroot/run/sandgate-id
if [ -n "$failed" ]; then echo "failed $failed"; else echo ok; fi
exit 0
IDENTITY
chmod +x "$root/lib/sandgate/identity"

(cd "$root" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$work/initrd.img"
cp "$kroot/boot/vmlinuz-$kver" "$work/vmlinuz"
mv "$work/vmlinuz" "$out/vmlinuz"
mv "$work/initrd.img" "$out/initrd.img"
echo "$stamp" >"$out/.stamp"
echo "build-guest-image: wrote $out/vmlinuz and $out/initrd.img ($kpkg${agent:+, agent $agent})"
