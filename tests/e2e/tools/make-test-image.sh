#!/usr/bin/env bash
# The root filesystem every e2e test sandbox runs in (a process sandbox sees nothing of the host): a Debian
# "essential" tree with what the sandboxed test servers need, tests/e2e/tools at /sandgate-tests and a static
# h2_recorder built from its source, packed as a one-layer `docker save` archive for `sandgate image import`.
#
#   make-test-image.sh CACHE_DIR     prints the archive's path
#
# The archive is cached in CACHE_DIR under a key of every input (this script, the tools, the package list), so
# both passes of tests/run.sh (and every test process) share one image; a changed input builds a new one.
# Needs root (mmdebstrap --mode=root) and the Debian mirror.
set -euo pipefail

cache=${1:?usage: make-test-image.sh CACHE_DIR}
here=$(cd "$(dirname "$0")" && pwd)
packages=python3,python3-websockets,openssh-server,rsync,busybox,procps,apt,iproute2,mount
mirror=${SANDGATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}

# File names, not paths: two clones (or worktrees) of one commit share one image.
key=$( { cat "$0"; echo "$packages"; for f in "$here"/*; do echo "${f##*/}"; cat "$f"; done; } | sha256sum | cut -c1-16)
archive=$cache/test-image-$key.tar
if [[ -f $archive ]]; then
  echo "$archive"
  exit 0
fi

mkdir -p "$cache"
# One builder at a time per cache (several test processes may ask at once); the loser finds the archive.
exec 9>"$cache/.lock"
flock 9
if [[ -f $archive ]]; then
  echo "$archive"
  exit 0
fi

work=$(mktemp -d "$cache/build-XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/root" "$work/out" "$work/out/l0"
mmdebstrap --quiet --mode=root --variant=essential --include="$packages" bookworm "$work/root" "$mirror" >&2
mkdir -p "$work/root/sandgate-tests"
cp "$here"/*.py "$here"/*.sh "$here"/sshd_config "$work/root/sandgate-tests/"
# Static: it must run in the image whatever libraries the image has.
g++ -std=c++20 -O2 -static -o "$work/root/sandgate-tests/h2_recorder" "$here/h2_recorder.cc" -lnghttp2 -pthread
# sshd's privilege separation directory.
mkdir -p "$work/root/run/sshd"

tar --numeric-owner --xattrs -cf "$work/out/l0/layer.tar" -C "$work/root" .
diff_id=sha256:$(sha256sum "$work/out/l0/layer.tar" | cut -d' ' -f1)
cat >"$work/out/config.json" <<EOF
{"os":"linux","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"WorkingDir":"/"},
 "rootfs":{"type":"layers","diff_ids":["$diff_id"]}}
EOF
config_name=$(sha256sum "$work/out/config.json" | cut -d' ' -f1).json
mv "$work/out/config.json" "$work/out/$config_name"
echo "[{\"Config\":\"$config_name\",\"RepoTags\":[\"sandgate-test:latest\"],\"Layers\":[\"l0/layer.tar\"]}]" \
  >"$work/out/manifest.json"
tar -cf "$work/image.tar" -C "$work/out" .
mv "$work/image.tar" "$archive"
# Older images (other keys) are not needed any more.
find "$cache" -maxdepth 1 -name 'test-image-*.tar' ! -name "test-image-$key.tar" -delete
echo "$archive"
