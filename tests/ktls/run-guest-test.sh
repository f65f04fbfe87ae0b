#!/usr/bin/env bash
# kTLS end-to-end test in a qemu guest: this host's kernel has no CONFIG_TLS, Debian's kernel package does.
#   tests/ktls/run-guest-test.sh BUILD_DIR        (ctest: ktls_guest)
# Downloads Debian's kernel package once (apt-get download + dpkg-deb -x into BUILD_DIR/ktls-cache; no
# kernel is installed on the host), builds an initramfs from busybox-static, tls.ko and the crypto modules,
# the block, ext4 and overlayfs modules, the project's binaries and every shared library they load, a TLS
# client (tests/ktls/ktls_client.c) and the image the backend sandbox runs (tests/ktls/ktls_backend.c and its
# libraries, as a `docker save` archive), makes an ext4 disk for the node's state (BUILD_DIR/ktls-guest), boots
# it with qemu under TCG and runs tests/ktls/guest-run.sh inside.
# Exit: 0 all cases passed, 1 a case failed or the guest did not finish, 77 skipped (qemu, busybox-static,
# e2fsprogs or the kernel package cannot be installed or downloaded, or BUILD_DIR is a sanitizer build: the
# guest runs the plain build, ASan under TCG would take far longer than the test's budget and adds nothing to
# what it checks).
#   env: KTLS_SIZE (bytes each way per matrix case; default 8 MiB: TCG moves 1-3 MB/s through the guest's
#        TLS stack, and 64 MiB x 6 cases would take ~10 minutes), KTLS_BIG_SIZE (bytes each way of one
#        extra TLS 1.3 AES-128-GCM case, default 64 MiB: long enough for many pipe refills and record
#        sequence numbers far from the handover), KTLS_BENCH=1 (also the ktls-splice vs userspace
#        comparison: CPU per byte, and RSS per idle connection with KTLS_HOLD of them, default 1000),
#        KTLS_TIMEOUT (seconds for the guest, default 480; with KTLS_SOAK, 600 + N / 5),
#        KTLS_SOAK=N (the soak of issue 12 instead of the cases: N idle forwarded TLS connections held, then
#        closed, on kTLS and on the userspace path; the proxy's descriptors must come back to their baseline.
#        The host's hard RLIMIT_NOFILE of 20,000 cannot carry 10,000 of them, the guest's root raises its own.
#        The guest gets 4 GiB for it: the backend runs a thread per connection), KTLS_SOAK_LINGER (seconds
#        the soak's backend keeps its side open after the client left: half-closed connections; default 0)
set -euo pipefail

skip() {
  echo "################################################################" >&2
  echo "ktls_guest SKIPPED: $*" >&2
  echo "################################################################" >&2
  exit 77
}

[[ $# -eq 1 ]] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
build=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
grep -q '^SANDGATE_SANITIZE:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null &&
  skip "$build is a sanitizer build; the kTLS guest runs the plain build (run it with that build dir)"

size=${KTLS_SIZE:-8388608}
big_size=${KTLS_BIG_SIZE:-67108864}
bench=${KTLS_BENCH:-0}
hold=${KTLS_HOLD:-1000}
soak=${KTLS_SOAK:-0}
soak_linger=${KTLS_SOAK_LINGER:-0}
guest_timeout=${KTLS_TIMEOUT:-$((soak > 0 ? 600 + soak / 5 : 480))}
guest_mb=$((soak > 0 ? 4096 : 1024))
cache=$build/ktls-cache
work=$build/ktls-guest
mkdir -p "$cache"

apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 ||
    { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1; }
}
command -v qemu-system-x86_64 >/dev/null || apt_install qemu-system-x86 || skip "cannot install qemu-system-x86"
dpkg -s busybox-static >/dev/null 2>&1 || apt_install busybox-static || skip "cannot install busybox-static"
command -v mkfs.ext4 >/dev/null || apt_install e2fsprogs || skip "cannot install e2fsprogs"

# The kernel Debian's linux-image-amd64 points at, unpacked once.
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
[[ -n $kpkg ]] || { apt-get update >/dev/null 2>&1 || true; kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'); }
[[ -n $kpkg ]] || skip "apt cannot resolve linux-image-amd64 to a kernel package"
kver=${kpkg#linux-image-}
kroot=$cache/$kpkg
mods=$kroot/lib/modules/$kver
# The package has no modules.dep (Debian's postinst runs depmod); busybox's depmod makes it once, in the
# unpacked tree before it is renamed into place, so a cache without one is always unpacked again.
if [[ ! -f $mods/modules.dep ]]; then
  (cd "$cache" && rm -f "$kpkg"_*.deb && apt-get download "$kpkg" >/dev/null 2>&1) ||
    (apt-get update >/dev/null 2>&1 && cd "$cache" && apt-get download "$kpkg" >/dev/null 2>&1) ||
    skip "cannot download $kpkg"
  rm -rf "$kroot.tmp" "$kroot" && dpkg-deb -x "$cache/$kpkg"_*.deb "$kroot.tmp"
  /bin/busybox depmod -b "$kroot.tmp" "$kver"
  mv "$kroot.tmp" "$kroot"
  rm -f "$cache/$kpkg"_*.deb
fi
[[ -f $mods/kernel/net/tls/tls.ko ]] || { echo "ktls_guest: $kpkg has no tls.ko" >&2; exit 1; }

for b in proxy/sandgate-proxy noderuntime/sandgate-node noderuntime/sandgate-init cli/sandgate; do
  [[ -x $build/$b ]] || { echo "ktls_guest: $build/$b is missing; build first" >&2; exit 1; }
done

copy_libs() { # $1 = root to copy into, $2... = executables: every shared library they load, at its path
  local dest=$1
  shift
  for bin in "$@"; do
    ldd "$bin" | awk '/=> \// { print $3 } /^[ \t]*\// { print $1 }'
  done | sort -u | while read -r lib; do
    mkdir -p "$dest$(dirname "$lib")"
    cp -L "$lib" "$dest$lib"
  done
}

# The initramfs.
rm -rf "$work" && mkdir -p "$work/root/sg" "$work/root/bin" "$work/root/lib/modules/$kver/kernel"
root=$work/root
cp /bin/busybox "$root/bin/busybox"
cp "$build"/proxy/sandgate-proxy "$build"/noderuntime/sandgate-node "$build"/noderuntime/sandgate-init \
  "$build"/cli/sandgate "$root/sg/"
cc -O2 -Wall -Wextra -Werror -o "$root/sg/ktls_client" "$src/tests/ktls/ktls_client.c" -lssl -lcrypto
copy_libs "$root" "$root"/sg/*

# The backend's image: a process sandbox sees only its image, so it holds the backend and its libraries. One
# layer, packed like tests/e2e/tools/make-test-image.sh's archive; the guest's node imports it.
image=$work/image
mkdir -p "$image/root" "$image/out/l0"
cc -O2 -Wall -Wextra -Werror -pthread -o "$image/root/ktls_backend" "$src/tests/ktls/ktls_backend.c" -lcrypto
copy_libs "$image/root" "$image/root/ktls_backend"
tar --numeric-owner -cf "$image/out/l0/layer.tar" -C "$image/root" .
printf '{"os":"linux","config":{"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}\n' \
  "$(sha256sum "$image/out/l0/layer.tar" | cut -d' ' -f1)" >"$image/out/config.json"
echo '[{"Config":"config.json","RepoTags":["ktls-backend:latest"],"Layers":["l0/layer.tar"]}]' >"$image/out/manifest.json"
tar -cf "$root/sg/backend-image.tar" -C "$image/out" .

for dir in net/tls crypto lib arch/x86/crypto; do
  [[ -d $mods/kernel/$dir ]] || continue
  mkdir -p "$root/lib/modules/$kver/kernel/$dir"
  cp -r "$mods/kernel/$dir/." "$root/lib/modules/$kver/kernel/$dir/"
done
# The state disk's driver and file system, and overlayfs for the sandbox's root, with everything they depend
# on (modules.dep: "path: dependency paths..."). crc32c_generic is ext4's checksum, which it asks the crypto
# API for by name rather than linking against.
want=()
for m in virtio_pci virtio_blk ext4 overlay crc32c_generic; do
  path=$(grep -oE "^kernel/([^:]*/)?$m\.ko:" "$mods/modules.dep") || { echo "ktls_guest: $kpkg has no $m.ko" >&2; exit 1; }
  want+=("${path%:}")
done
while ((${#want[@]})); do
  m=${want[0]}
  want=("${want[@]:1}")
  [[ -f $root/lib/modules/$kver/$m ]] && continue
  mkdir -p "$root/lib/modules/$kver/$(dirname "$m")"
  cp "$mods/$m" "$root/lib/modules/$kver/$m"
  read -ra deps <<<"$(awk -v m="$m:" '$1 == m { $1 = ""; print }' "$mods/modules.dep")"
  want+=("${deps[@]}")
done
cp "$mods"/modules.{order,builtin}* "$root/lib/modules/$kver/" 2>/dev/null || true
bash "$src/deploy/gen-cert.sh" "$root/sg/tls" sandbox.localhost >/dev/null
cp "$src/tests/ktls/guest-run.sh" "$root/sg/guest-run.sh"
cp "$src/tests/ktls/guest-init" "$root/init"
chmod +x "$root/init"
printf 'export SIZE=%s BIG_SIZE=%s BENCH=%s HOLD=%s SOAK=%s SOAK_LINGER=%s\n' "$size" "$big_size" "$bench" "$hold" "$soak" \
  "$soak_linger" >"$root/sg/guest-env"
(cd "$root" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$work/initrd.gz"
# The node's state (image layers, sandbox dirs) on ext4: the layers are idmapped mounts, which Debian 12's 6.1
# takes on ext4 but on tmpfs only from 6.3 on. Sparse, few inodes and its tables written here, so the guest
# spends no TCG time on lazy initialization.
truncate -s 128M "$work/state.img"
mkfs.ext4 -q -F -N 4096 -E lazy_itable_init=0,lazy_journal_init=0 "$work/state.img"

if ((soak > 0)); then
  echo "ktls_guest: booting $kpkg under TCG (the soak: $soak connections)"
else
  echo "ktls_guest: booting $kpkg under TCG ($(( size / 1048576 )) MiB each way per case, one of $(( big_size / 1048576 )) MiB)"
fi
start=$(date +%s)
set +e
timeout -k 10 "$guest_timeout" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m "$guest_mb" -nographic -no-reboot \
  -kernel "$kroot/boot/vmlinuz-$kver" -initrd "$work/initrd.gz" \
  -drive file="$work/state.img",format=raw,if=virtio,cache=unsafe \
  -append 'console=ttyS0 quiet panic=-1 clocksource=tsc tsc=reliable' </dev/null >"$work/console.log" 2>&1
qemu_rc=$?
set -e
elapsed=$(( $(date +%s) - start ))
tr -d '\r' <"$work/console.log" | grep -oE '(KTLS-|kTLS not used).*' || true
echo "ktls_guest: guest ran ${elapsed}s (console: $work/console.log)"
if [[ $qemu_rc -eq 124 || $qemu_rc -eq 137 ]]; then
  echo "ktls_guest: FAIL: the guest did not finish within ${guest_timeout}s" >&2
  exit 1
fi
tr -d '\r' <"$work/console.log" | grep -q 'KTLS-GUEST-RESULT PASS$' || { echo "ktls_guest: FAIL" >&2; exit 1; }
echo "ktls_guest: PASS"
