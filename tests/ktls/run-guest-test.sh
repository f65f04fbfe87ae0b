#!/usr/bin/env bash
# kTLS end-to-end test in a qemu guest: this host's kernel has no CONFIG_TLS, Debian's kernel package does.
#   tests/ktls/run-guest-test.sh BUILD_DIR        (ctest: ktls_guest)
# Downloads Debian's kernel package once (apt-get download + dpkg-deb -x into BUILD_DIR/ktls-cache; no
# kernel is installed on the host), builds an initramfs from busybox-static, tls.ko and the crypto modules,
# the project's binaries and every shared library they load, a test backend and TLS client
# (tests/ktls/*.c), boots it with qemu under TCG and runs tests/ktls/guest-run.sh inside.
# Exit: 0 all cases passed, 1 a case failed or the guest did not finish, 77 skipped (qemu or the kernel
# package cannot be installed or downloaded, or BUILD_DIR is a sanitizer build: the guest runs the plain
# build, ASan under TCG would take far longer than the test's budget and adds nothing to what it checks).
#   env: KTLS_SIZE (bytes each way per matrix case; default 8 MiB: TCG moves 1-3 MB/s through the guest's
#        TLS stack, and 64 MiB x 6 cases would take ~10 minutes), KTLS_BIG_SIZE (bytes each way of one
#        extra TLS 1.3 AES-128-GCM case, default 64 MiB: long enough for many pipe refills and record
#        sequence numbers far from the handover), KTLS_BENCH=1 (also the ktls-splice vs userspace
#        comparison), KTLS_TIMEOUT (seconds for the guest, default 480)
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
guest_timeout=${KTLS_TIMEOUT:-480}
cache=$build/ktls-cache
work=$build/ktls-guest
mkdir -p "$cache"

apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 ||
    { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1; }
}
command -v qemu-system-x86_64 >/dev/null || apt_install qemu-system-x86 || skip "cannot install qemu-system-x86"
dpkg -s busybox-static >/dev/null 2>&1 || apt_install busybox-static || skip "cannot install busybox-static"

# The kernel Debian's linux-image-amd64 points at, unpacked once.
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
[[ -n $kpkg ]] || { apt-get update >/dev/null 2>&1 || true; kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'); }
[[ -n $kpkg ]] || skip "apt cannot resolve linux-image-amd64 to a kernel package"
kver=${kpkg#linux-image-}
# The node's process sandboxes mount their image's layers idmapped (docs/security.md, "Process sandbox
# boundary"). The guest keeps the node's state in tmpfs, which takes idmapped mounts from Linux 6.3 on; Debian
# 12's kernel is 6.1, and the filesystems that would take them there (ext4, ...) are modules this initramfs
# does not load yet. Until the guest gets an ext4 state disk, the test cannot start its backend sandbox.
kmajor=${kver%%.*}
kminor=${kver#*.}
kminor=${kminor%%.*}
if (( kmajor < 6 || (kmajor == 6 && kminor < 3) )); then
  skip "guest kernel $kver has no idmapped tmpfs (6.3+), which the process sandbox's image layers need"
fi
kroot=$cache/$kpkg
if [[ ! -f $kroot/boot/vmlinuz-$kver ]]; then
  (cd "$cache" && rm -f "$kpkg"_*.deb && apt-get download "$kpkg" >/dev/null 2>&1) ||
    (apt-get update >/dev/null 2>&1 && cd "$cache" && apt-get download "$kpkg" >/dev/null 2>&1) ||
    skip "cannot download $kpkg"
  rm -rf "$kroot.tmp" && dpkg-deb -x "$cache/$kpkg"_*.deb "$kroot.tmp" && mv "$kroot.tmp" "$kroot"
  rm -f "$cache/$kpkg"_*.deb
fi
[[ -f $kroot/lib/modules/$kver/kernel/net/tls/tls.ko ]] || { echo "ktls_guest: $kpkg has no tls.ko" >&2; exit 1; }

for b in proxy/sandgate-proxy noderuntime/sandgate-node noderuntime/sandgate-init cli/sandgate; do
  [[ -x $build/$b ]] || { echo "ktls_guest: $build/$b is missing; build first" >&2; exit 1; }
done

# The initramfs.
rm -rf "$work" && mkdir -p "$work/root/sg" "$work/root/bin" "$work/root/lib/modules/$kver/kernel"
root=$work/root
cp /bin/busybox "$root/bin/busybox"
cp "$build"/proxy/sandgate-proxy "$build"/noderuntime/sandgate-node "$build"/noderuntime/sandgate-init \
  "$build"/cli/sandgate "$root/sg/"
cc -O2 -Wall -Wextra -Werror -o "$root/sg/ktls_client" "$src/tests/ktls/ktls_client.c" -lssl -lcrypto
cc -O2 -Wall -Wextra -Werror -pthread -o "$root/sg/ktls_backend" "$src/tests/ktls/ktls_backend.c" -lcrypto
for bin in "$root"/sg/*; do
  ldd "$bin" | awk '/=> \// { print $3 } /^[ \t]*\// { print $1 }'
done | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
for dir in net/tls crypto lib arch/x86/crypto; do
  [[ -d $kroot/lib/modules/$kver/kernel/$dir ]] || continue
  mkdir -p "$root/lib/modules/$kver/kernel/$dir"
  cp -r "$kroot/lib/modules/$kver/kernel/$dir/." "$root/lib/modules/$kver/kernel/$dir/"
done
cp "$kroot"/lib/modules/"$kver"/modules.{order,builtin}* "$root/lib/modules/$kver/" 2>/dev/null || true
bash "$src/deploy/gen-cert.sh" "$root/sg/tls" sandbox.localhost >/dev/null
cp "$src/tests/ktls/guest-run.sh" "$root/sg/guest-run.sh"
cp "$src/tests/ktls/guest-init" "$root/init"
chmod +x "$root/init"
printf 'export SIZE=%s BIG_SIZE=%s BENCH=%s\n' "$size" "$big_size" "$bench" >"$root/sg/guest-env"
(cd "$root" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$work/initrd.gz"

echo "ktls_guest: booting $kpkg under TCG ($(( size / 1048576 )) MiB each way per case, one of $(( big_size / 1048576 )) MiB)"
start=$(date +%s)
set +e
timeout -k 10 "$guest_timeout" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 1024 -nographic -no-reboot \
  -kernel "$kroot/boot/vmlinuz-$kver" -initrd "$work/initrd.gz" \
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
