#!/usr/bin/env bash
# The code-interpreter flow's image: the e2e test image (tools/make-test-image.sh) plus one layer with Debian's
# pandas and matplotlib, what a user of run_code installs to get DataFrames and plots. Packed as a two-layer
# `docker save` archive whose first layer is the test image's own, so a store holding the test image unpacks
# only the second.
#
#   make-data-image.sh CACHE_DIR     prints the archive's path
#
# Cached in CACHE_DIR under a key of this script and the test image's archive; one builder at a time. Needs
# root (overlayfs, chroot) and the Debian mirror the test image was made from.
set -euo pipefail

cache=${1:?usage: make-data-image.sh CACHE_DIR}
here=$(cd "$(dirname "$0")" && pwd)
base=$("$here/tools/make-test-image.sh" "$cache")
packages=(python3-pandas python3-matplotlib)
# Debian's matplotlib depends on fontTools, whose dependencies bring sympy, scipy, pythran and with it a C++
# toolchain: most of the ~1 GB apt installs, and nothing a plot or a DataFrame loads. Those files (with the
# documentation, static libraries and the libraries' own test suites) are left out of the layer, as slim
# container images leave out documentation, so the image stays small and a QEMU disk made from it builds
# quickly. The packages stay installed as far as dpkg knows.
unused=(
  usr/share/doc usr/share/man usr/share/locale usr/share/info usr/share/unicode usr/share/lintian
  usr/lib/gcc usr/libexec/gcc usr/include usr/lib/python3.11/config-3.11-x86_64-linux-gnu
  usr/lib/python3/dist-packages/sympy usr/lib/python3/dist-packages/scipy usr/lib/python3/dist-packages/pythran
  usr/lib/python3/dist-packages/pandas/tests usr/lib/python3/dist-packages/matplotlib/tests
  'usr/bin/x86_64-linux-gnu-*' 'usr/lib/x86_64-linux-gnu/lib[atlu]san.so*' 'usr/lib/x86_64-linux-gnu/libhwasan.so*'
)

key=$( { cat "$0"; basename "$base"; } | sha256sum | cut -c1-16)
archive=$cache/data-image-$key.tar
if [[ -f $archive ]]; then
  echo "$archive"
  exit 0
fi

exec 9>"$cache/.data-lock"
flock 9
if [[ -f $archive ]]; then
  echo "$archive"
  exit 0
fi

work=$(mktemp -d "$cache/build-data-XXXXXX")
merged=$work/merged
cleanup() {
  umount "$merged/proc" 2>/dev/null || true
  umount "$merged" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/lower" "$work/upper" "$work/ovl" "$merged" "$work/in" "$work/out" "$work/out/l1"
tar -xf "$base" -C "$work/in"
l0=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0]["Layers"][0])' "$work/in/manifest.json")
tar --numeric-owner --xattrs --xattrs-include='*' -xf "$work/in/$l0" -C "$work/lower"

# The new layer is the overlay's upper dir: exactly what apt added or changed.
mount -t overlay overlay \
  -o "lowerdir=$work/lower,upperdir=$work/upper,workdir=$work/ovl,index=off,redirect_dir=off,metacopy=off" "$merged"
mount -t proc proc "$merged/proc"
had_resolv=0
[[ -e $merged/etc/resolv.conf || -L $merged/etc/resolv.conf ]] && had_resolv=1
[[ $had_resolv == 1 ]] || cp /etc/resolv.conf "$merged/etc/resolv.conf"
chroot "$merged" apt-get -q update >&2
DEBIAN_FRONTEND=noninteractive chroot "$merged" apt-get install -y -q --no-install-recommends "${packages[@]}" >&2
# matplotlib's font cache, made now rather than by the first plot in every guest (under TCG that is seconds).
chroot "$merged" env HOME=/root MPLBACKEND=Agg python3 -c 'import matplotlib.pyplot' >&2
chroot "$merged" apt-get clean
umount "$merged/proc"
umount "$merged"

# What only the build needed and what nothing loads, taken from the upper dir: only what apt added goes, the
# test image's own files stay.
rm -rf "$work/upper/var/lib/apt/lists" "$work/upper/var/cache/apt" "$work/upper/var/log"
for p in "${unused[@]}"; do
  # shellcheck disable=SC2086 # the globs are meant
  rm -rf "${work:?}"/upper/$p
done
find "$work/upper" -name '*.a' -type f -delete
[[ $had_resolv == 1 ]] || rm -f "$work/upper/etc/resolv.conf"
# overlayfs marks deletions with 0:0 character devices and replaced directories with an xattr; an OCI layer
# says both with .wh. names.
while IFS= read -r -d '' wh; do
  rm "$wh"
  : >"$(dirname "$wh")/.wh.$(basename "$wh")"
done < <(find "$work/upper" -type c -print0)
python3 - "$work/upper" <<'PY'
import os, sys
for dirpath, dirs, files in os.walk(sys.argv[1]):
    try:
        opaque = os.getxattr(dirpath, "trusted.overlay.opaque") == b"y"
    except OSError:
        opaque = False
    if opaque:
        open(os.path.join(dirpath, ".wh..wh..opq"), "w").close()
PY
tar --numeric-owner --xattrs --xattrs-exclude='trusted.overlay.*' -cf "$work/out/l1/layer.tar" -C "$work/upper" .

config_l0=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0]["Config"])' "$work/in/manifest.json")
mkdir -p "$work/out/$(dirname "$l0")"
mv "$work/in/$l0" "$work/out/$l0"
diff_l0=sha256:$(sha256sum "$work/out/$l0" | cut -d' ' -f1)
diff_l1=sha256:$(sha256sum "$work/out/l1/layer.tar" | cut -d' ' -f1)
python3 - "$work/in/$config_l0" "$work/out/config.json" "$diff_l0" "$diff_l1" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["rootfs"]["diff_ids"] = [sys.argv[3], sys.argv[4]]
json.dump(config, open(sys.argv[2], "w"))
EOF
config_name=$(sha256sum "$work/out/config.json" | cut -d' ' -f1).json
mv "$work/out/config.json" "$work/out/$config_name"
echo "[{\"Config\":\"$config_name\",\"RepoTags\":[\"sandgate-data:latest\"],\"Layers\":[\"$l0\",\"l1/layer.tar\"]}]" \
  >"$work/out/manifest.json"
tar -cf "$work/image.tar" -C "$work/out" .
mv "$work/image.tar" "$archive"
find "$cache" -maxdepth 1 -name 'data-image-*.tar' ! -name "data-image-$key.tar" -delete
echo "$archive"
