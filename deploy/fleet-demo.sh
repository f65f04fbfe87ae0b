#!/usr/bin/env bash
# A fleet on one machine (docs/fleet.md): a 3-member etcd cluster and 3 sandgate-nodes, each with its own
# state dir, cgroup and API socket, and next to each its sandgate-proxy: a client listener on
# 127.0.0.1:8441..8443 and a fleet listener (mutual TLS with the fleet CA) on 127.0.0.1:9451..9453, all on
# loopback. Any proxy reaches any node's sandboxes. Prints what to try; Ctrl-C stops everything.
#
#   deploy/fleet-demo.sh                 # install deps, build, start
#   SANDGATE_NO_BUILD=1 deploy/fleet-demo.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
STATE=${SANDGATE_STATE_DIR:-$PWD/.fleet-demo}
ETCD_BASE_PORT=${FLEET_ETCD_PORT:-23790}  # members use BASE+1..3 (clients) and BASE+11..13 (peers)
IMAGE=default
STARTUP_SECS=30

say() { printf 'fleet-demo: %s\n' "$*" >&2; }
die() {
  say "error: $*"
  exit 1
}
# Waits (STARTUP_SECS at most) for a daemon's log to show LINE; dies with WHAT otherwise.
wait_for_line() {
  local line=$1 log=$2 what=$3
  for ((t = 0; t < STARTUP_SECS * 5; t++)); do
    grep -q "$line" "$log" 2>/dev/null && return 0
    sleep 0.2
  done
  die "$what within ${STARTUP_SECS}s (see $log)"
}

if [[ ${SANDGATE_NO_BUILD:-} != 1 ]]; then
  "$ROOT/deploy/install-deps.sh"
  BUILD_TARGETS="sandgate-node sandgate-proxy sandgate sandgate-init sandgate-agent" "$ROOT/deploy/build.sh" -DSANDGATE_BENCH=OFF
fi
NODE_BIN=$BUILD_DIR/noderuntime/sandgate-node
PROXY_BIN=$BUILD_DIR/proxy/sandgate-proxy
CLI=$BUILD_DIR/cli/sandgate
DOMAIN=sandbox.localhost
for bin in "$NODE_BIN" "$PROXY_BIN" "$CLI" /usr/bin/etcd; do
  [[ -x $bin ]] || die "$bin not found (build first, or apt-get install etcd-server)"
done

mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd -P)
PIDS=()
cleanup() {
  trap - INT TERM EXIT
  say "stopping"
  # Proxies, then nodes (each revokes its lease: its node key goes at once), then etcd.
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[i]}" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup INT TERM EXIT

CLUSTER=""
ENDPOINTS=""
for i in 1 2 3; do
  CLUSTER+="${CLUSTER:+,}e$i=http://127.0.0.1:$((ETCD_BASE_PORT + 10 + i))"
  ENDPOINTS+="${ENDPOINTS:+, }\"http://127.0.0.1:$((ETCD_BASE_PORT + i))\""
done
for i in 1 2 3; do
  client=http://127.0.0.1:$((ETCD_BASE_PORT + i))
  peer=http://127.0.0.1:$((ETCD_BASE_PORT + 10 + i))
  state=new
  [[ -d $STATE/etcd-$i/member ]] && state=existing
  /usr/bin/etcd --name "e$i" --data-dir "$STATE/etcd-$i" --listen-client-urls "$client" \
    --advertise-client-urls "$client" --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
    --initial-cluster "$CLUSTER" --initial-cluster-state "$state" --initial-cluster-token sandgate-fleet-demo \
    >>"$STATE/etcd-$i.log" 2>&1 &
  PIDS+=($!)
done
for ((t = 0; t < STARTUP_SECS * 5; t++)); do
  curl -fsS --max-time 1 "http://127.0.0.1:$((ETCD_BASE_PORT + 1))/health" 2>/dev/null | grep -q '"true"' && break
  sleep 0.2
done
curl -fsS --max-time 1 "http://127.0.0.1:$((ETCD_BASE_PORT + 1))/health" | grep -q '"true"' ||
  die "etcd did not become healthy within ${STARTUP_SECS}s (see $STATE/etcd-*.log)"
say "etcd is up (3 members: $ENDPOINTS)"

# The ingress certificate (*.$DOMAIN, a local CA) and the fleet CA with one certificate per node.
"$ROOT/deploy/gen-cert.sh" "$STATE/tls" "$DOMAIN" >/dev/null
"$ROOT/deploy/gen-fleet-ca.sh" "$STATE/fleet-ca" node1 node2 node3 >/dev/null

for i in 1 2 3; do
  dir=$STATE/node$i
  mkdir -p -m 0700 "$dir"
  cat >"$dir/sandgate.toml" <<EOF
domain = "$DOMAIN"
node_socket = "unix:$dir/node.sock"

[proxy]
listen = ["127.0.0.1:$((8440 + i))"]
workers = 1
access_log = "$dir/access.log"
fleet_listen = "127.0.0.1:$((9450 + i))"
fleet_cert = "$STATE/fleet-ca/node$i.pem"
fleet_key = "$STATE/fleet-ca/node$i.key"
fleet_ca = "$STATE/fleet-ca/fleet-ca.pem"

[[proxy.certificates]]
cert = "$STATE/tls/server.pem"
key = "$STATE/tls/server.key"

[node]
state_dir = "$dir/state"
cgroup_name = "sandgate-fleet-demo-$i"
init_path = "$BUILD_DIR/noderuntime/sandgate-init"
agent_path = "$BUILD_DIR/agent/sandgate-agent"
# One image store for the three (layers are shared by digest).
images_dir = "$STATE/images"
on_shutdown = "terminate"

[fleet]
etcd_endpoints = [$ENDPOINTS]
node_name = "node$i"
advertise_api = "unix:$dir/node.sock"
advertise_ingress = "127.0.0.1:$((9450 + i))"
lease_ttl_secs = 10
EOF
  "$NODE_BIN" --config "$dir/sandgate.toml" >>"$dir/node.log" 2>&1 &
  PIDS+=($!)
done
for i in 1 2 3; do
  wait_for_line "fleet: node node$i registered" "$STATE/node$i/node.log" "node$i did not register"
done
say "3 nodes registered"
for i in 1 2 3; do
  "$PROXY_BIN" --config "$STATE/node$i/sandgate.toml" >>"$STATE/node$i/proxy.log" 2>&1 &
  PIDS+=($!)
done
for i in 1 2 3; do
  wait_for_line "sandgate-proxy ready" "$STATE/node$i/proxy.log" "the proxy of node$i did not start"
done
say "3 proxies serving: 127.0.0.1:8441..8443"
if ! SANDGATE_API=unix:$STATE/node1/node.sock "$CLI" image ls 2>/dev/null | grep -q "^$IMAGE "; then
  say "building the '$IMAGE' image once (Debian bookworm + python3, one to two minutes)"
  SANDGATE_API=unix:$STATE/node1/node.sock "$CLI" image build "$IMAGE" --packages python3,curl,ca-certificates ||
    say "warning: the image build failed; creates need an image"
fi

cat <<EOF

Try:
  n1() { SANDGATE_API=unix:$STATE/node1/node.sock $CLI "\$@"; }
  n2() { SANDGATE_API=unix:$STATE/node2/node.sock $CLI "\$@"; }
  n1 nodes                                   # NAME STATE SANDBOXES CAPACITY API
  n1 create --name web --public 8080 -- python3 -m http.server 8080   # placed on one of the 3 (NODE in n1 ls)
  n2 create --name web -- python3 -m http.server 8080   # 409: the name is taken on that node
  # the sandbox through each node's proxy (the two that do not own it hop over mutual TLS):
  curl --cacert $STATE/tls/ca.pem https://8080-web.$DOMAIN:8441/
  curl --cacert $STATE/tls/ca.pem https://8080-web.$DOMAIN:8442/
  curl --cacert $STATE/tls/ca.pem https://8080-web.$DOMAIN:8443/
  n1 ls                                      # with a NODE column
  n1 node drain node3; n1 nodes              # node3: draining
  etcdctl --endpoints=http://127.0.0.1:$((ETCD_BASE_PORT + 1)) get --prefix /sandgate/
  kill -9 of a node: its node key goes within 10 s, its sandbox keys stay

Logs: $STATE/node*/node.log, $STATE/node*/proxy.log, $STATE/node*/access.log, $STATE/etcd-*.log.
Ctrl-C stops all.
EOF
wait -n "${PIDS[@]}" || true
say "a process exited; stopping the rest"
