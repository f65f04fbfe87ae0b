#!/usr/bin/env bash
# `sandgate image build` times against a real node (docs/images.md):
#   bench/image_build.sh BUILD_DIR [RUNS]      (default 3 runs)
# Starts sandgate-node on a unix socket in a temp dir, imports a one-layer busybox-static image, then per run
# times (wall clock, the CLI from start to exit) a `--from` build with one `--run` step and a Debian base
# made by mmdebstrap with the default image's packages. Prints each run and the medians.
set -euo pipefail
build=$(cd "${1:?usage: bench/image_build.sh BUILD_DIR [RUNS]}" && pwd)
runs=${2:-3}
work=$(mktemp -d /tmp/sandgate-image-bench.XXXXXX)
node_pid=
cleanup() {
  [[ -z $node_pid ]] || { kill "$node_pid" 2>/dev/null; wait "$node_pid" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/sandgate.toml" <<TOML
domain = "sandbox.localhost"
node_socket = 'unix:$work/node.sock'
log_level = "warn"
[proxy]
listen = "127.0.0.1:0"
[node]
state_dir = '$work/node'
on_shutdown = "terminate"
init_path = '$build/noderuntime/sandgate-init'
TOML
"$build/noderuntime/sandgate-node" --config "$work/sandgate.toml" >"$work/node.log" 2>&1 &
node_pid=$!
for ((i = 0; i < 100; i++)); do [[ -S $work/node.sock ]] && break; sleep 0.1; done
cli=("$build/cli/sandgate" --api "unix:$work/node.sock")

# The busybox image: one layer, a docker save archive.
mkdir -p "$work/bb/rootfs/"{bin,etc,proc,dev,tmp} "$work/bb/out/l0"
cp /bin/busybox "$work/bb/rootfs/bin/"
for a in sh echo mkdir cp; do ln -s busybox "$work/bb/rootfs/bin/$a"; done
tar -cf "$work/bb/out/l0/layer.tar" -C "$work/bb/rootfs" .
diff_id=sha256:$(sha256sum "$work/bb/out/l0/layer.tar" | cut -d' ' -f1)
printf '{"os":"linux","config":{"Env":["PATH=/bin"]},"rootfs":{"type":"layers","diff_ids":["%s"]}}' "$diff_id" \
  >"$work/bb/out/config.json"
config=$(sha256sum "$work/bb/out/config.json" | cut -d' ' -f1).json
mv "$work/bb/out/config.json" "$work/bb/out/$config"
printf '[{"Config":"%s","Layers":["l0/layer.tar"]}]' "$config" >"$work/bb/out/manifest.json"
tar -cf "$work/bb.tar" -C "$work/bb/out" .
"${cli[@]}" image import "$work/bb.tar" bb >/dev/null

seconds() { # command...: wall seconds of one run, its output kept in $work/last.log
  local start end
  start=$(date +%s.%N)
  "$@" >"$work/last.log" 2>&1 || { cat "$work/last.log" >&2; exit 1; }
  end=$(date +%s.%N)
  echo "$end - $start" | bc
}
median() { sort -n | awk '{a[NR] = $1} END {printf "%.2f", (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

busybox=() debian=()
for ((r = 1; r <= runs; r++)); do
  t=$(seconds "${cli[@]}" image build "run$r" --from bb --run 'echo built > /f; mkdir -p /opt && cp /bin/busybox /opt/')
  busybox+=("$t")
  echo "run $r: busybox --from + 1 --run step: ${t} s" >&2
  "${cli[@]}" image rm "run$r" >/dev/null
  t=$(seconds "${cli[@]}" image build "deb$r" --packages python3,curl,ca-certificates)
  debian+=("$t")
  echo "run $r: mmdebstrap base (python3,curl,ca-certificates): ${t} s ($(tail -1 "$work/last.log"))" >&2
  "${cli[@]}" image rm "deb$r" >/dev/null
done
echo "| build | runs | median |"
echo "|---|--:|--:|"
echo "| \`--from\` busybox + one \`--run\` step | $runs | $(printf '%s\n' "${busybox[@]}" | median) s |"
echo "| Debian base, \`--packages python3,curl,ca-certificates\` (mmdebstrap) | $runs | $(printf '%s\n' "${debian[@]}" | median) s |"
