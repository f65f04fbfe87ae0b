# shellcheck shell=bash
# shellcheck disable=SC2034,SC2154  # clk_tck is used, and here/root/wait_deadline are set, by the sourcing script
# Helpers shared by bench/compare/run.sh and bench/compare/connections.sh; sourced, not run.
#
# The sourcing script defines log and die, and sets (before calling the helpers that use them):
#   tmp            the temp dir (logs of started processes go to $tmp/NAME.log)
#   pids=()        every long-running process started, stopped in reverse order by the cleanup
#   KEEP_TMP       1 keeps the temp dir on exit
#   QUIET_WAIT, wait_deadline   see wait_quiet
#   root, here     the repository root and bench/compare

# ---------------------------------------------------------------------------------------------- cleanup
stop_pid() {  # TERM, wait up to 10 s, then KILL; only the given pid
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  wait "$pid" 2>/dev/null || true
}
stop_started() {  # every pid in pids, newest first
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do stop_pid "${pids[i]}"; done
}
remove_cgroup() {  # NAME: kill anything left in this run's (uniquely named) sandbox cgroups, then remove them
  local d p
  for d in /sys/fs/cgroup/*/"$1" /sys/fs/cgroup/"$1"; do
    [[ -d $d ]] || continue
    for p in $(cat "$d"/*/cgroup.procs 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    for p in "$d"/*/cgroup.freeze; do [[ -f $p ]] && echo 0 >"$p"; done
    for p in "$d"/*/freezer.state; do [[ -f $p ]] && echo THAWED >"$p"; done
    sleep 0.2
    rmdir "$d"/* "$d" 2>/dev/null
  done
}
remove_tmp() {  # the temp dir, unless KEEP_TMP=1
  if [[ -n $tmp && -d $tmp ]]; then
    if [[ $KEEP_TMP == 1 ]]; then log "kept $tmp"; else rm -rf "$tmp"; fi
  fi
}
set_traps() {  # the sourcing script's cleanup on exit; INT and TERM exit through it
  trap cleanup EXIT
  trap 'log "interrupted"; exit 130' INT
  trap 'log "terminated"; exit 143' TERM
}

# ---------------------------------------------------------------------------------------------- processes
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
used_ports=" "
pick_port() {  # VAR: a free, not yet handed out port into VAR
  local p i
  for ((i = 0; i < 200; i++)); do
    p=$((20000 + RANDOM % 30000))
    if port_free "$p" && [[ $used_ports != *" $p "* ]]; then
      used_ports+="$p "
      printf -v "$1" '%s' "$p"
      return 0
    fi
  done
  die "no free port found"
}
wait_port() {  # PORT PID NAME: up to 15 s for a listener, failing early if PID died
  local i
  for ((i = 0; i < 150; i++)); do
    if ! port_free "$1"; then return 0; fi
    kill -0 "$2" 2>/dev/null || die "$3 exited during startup (log: $tmp/$3.log): $(tail -5 "$tmp/$3.log" 2>/dev/null)"
    sleep 0.1
  done
  die "$3 did not listen on 127.0.0.1:$1 within 15 s: $(tail -5 "$tmp/$3.log" 2>/dev/null)"
}
wait_log() {  # FILE PATTERN PID NAME: up to 15 s for a line
  local i
  for ((i = 0; i < 150; i++)); do
    if grep -q "$2" "$1" 2>/dev/null; then return 0; fi
    kill -0 "$3" 2>/dev/null || die "$4 exited during startup: $(tail -5 "$1" 2>/dev/null)"
    sleep 0.1
  done
  die "$4 not ready within 15 s: $(tail -5 "$1" 2>/dev/null)"
}
start() {  # NAME CMD...: background, output to $tmp/NAME.log; sets $started
  local name=$1
  shift
  "$@" >"$tmp/$name.log" 2>&1 &
  started=$!
  pids+=("$started")
}

poll() {  # CMD...: up to 100 tries, 0.2 s apart, until CMD succeeds; fails if it never did
  local i
  for ((i = 0; i < 100; i++)); do
    "$@" && return 0
    sleep 0.2
  done
  return 1
}

# ---------------------------------------------------------------------------------------------- CPU
clk_tck=$(getconf CLK_TCK)
# "utime stime" (ticks) of the given pids and their direct children (nginx: master + worker).
cpu_ticks() {
  local pid c all=()
  for pid in "$@"; do
    all+=("$pid")
    for c in $(cat /proc/"$pid"/task/*/children 2>/dev/null); do all+=("$c"); done
  done
  # Fields after the ")" of comm: state is $1, so utime ($14) and stime ($15) are $12 and $13.
  for pid in "${all[@]}"; do [[ -r /proc/$pid/stat ]] && sed 's/^.*) //' "/proc/$pid/stat"; done |
    awk '{ u += $12; s += $13 } END { print u + 0, s + 0 }'
}
cpu_ticks_total() { cpu_ticks "$@" | awk '{ print $1 + $2 }'; }  # utime+stime, one number
machine_ticks() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }
busy_cores() {  # cores busy over the next second (all processes; ours are idle between measurements)
  local a b
  a=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6 }' /proc/stat)
  sleep 1
  b=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6 }' /proc/stat)
  awk -v a="$a" -v b="$b" -v n="$(nproc)" 'BEGIN { split(a, x, " "); split(b, y, " ")
    busy = y[1] - x[1]; all = busy + y[2] - x[2]; printf "%.2f\n", (all > 0 ? n * busy / all : 0) }'
}
wait_quiet() {  # up to QUIET_WAIT s (within the run's WAIT_BUDGET) until other processes are nearly idle
  local deadline=$((SECONDS + QUIET_WAIT)) quiet said=0
  ((deadline < wait_deadline)) || deadline=$wait_deadline
  ((SECONDS < deadline)) || return 0
  while :; do
    quiet=$(busy_cores)
    awk -v b="$quiet" 'BEGIN { exit !(b < 0.2) }' && return 0
    if ((SECONDS >= deadline)); then
      log "machine still busy (${quiet} cores used by other processes); measuring anyway"
      return 0
    fi
    ((said++)) || log "machine busy (${quiet} cores used by other processes); waiting up to $((deadline - SECONDS))s"
    sleep 2
  done
}

# COL LIMIT WHAT NOUN CMD...: runs CMD (each time after wait_quiet) up to 1 + RETRIES times and prints the
# output line whose field COL (the CPU s "others" used meanwhile) is smallest; stops at the first line where
# it is at most 0.1 * LIMIT (a number, or "$N": field N of that line), or once the WAIT_BUDGET is spent.
least_disturbed() {
  local col=$1 limit=$2 what=$3 noun=$4 r best="" attempt
  shift 4
  for ((attempt = 0; attempt <= RETRIES; attempt++)); do
    wait_quiet
    r=$("$@")
    if [[ -z $best ]] || awk -v a="$r" -v b="$best" -v c="$col" 'BEGIN { split(a, x, " "); split(b, y, " "); exit !(x[c] < y[c]) }'; then
      best=$r
    fi
    awk -v r="$best" -v c="$col" -v l="$limit" 'BEGIN { split(r, x, " "); if (l ~ /^\$/) l = x[substr(l, 2)]
      exit !(x[c] <= 0.1 * l) }' && break
    ((SECONDS < wait_deadline)) || break
    log "$what: other processes used $(cut -d' ' -f"$col" <<<"$r") CPU s during the $noun; repeating"
  done
  echo "$best"
}

# ---------------------------------------------------------------------------------------------- setup
apt_install() {  # PKG...: benchmark-only packages; services they start (nginx, haproxy) are stopped again
  local had_policy=0 svc
  log "installing benchmark-only packages: $*"
  [[ -e /usr/sbin/policy-rc.d ]] && had_policy=1
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get install -y --no-install-recommends "$@" >&2 ||
    { timeout 300 apt-get update >&2 && timeout 600 apt-get install -y --no-install-recommends "$@" >&2; } ||
    die "apt-get install $* failed"
  if ((!had_policy)); then  # this script runs its own
    for svc in nginx haproxy; do
      [[ " $* " == *" $svc "* ]] && timeout 30 invoke-rc.d "$svc" stop >/dev/null 2>&1 || true
    done
  fi
}
make_tmp() {  # NAME: sets tmp to a new /tmp/NAME.XXXXXX; builds the backend there, and the certificate in $tmp/tls
  tmp=$(mktemp -d "/tmp/$1.XXXXXX")
  chmod 755 "$tmp"
  log "temp dir $tmp"
  # Static: the same binary serves the anchors on the host and sandgate's sandbox, whose root is an image.
  cc -O2 -Wall -static -o "$tmp/backend" "$here/backend.c"
  "$root/deploy/gen-cert.sh" "$tmp/tls" sandbox.localhost 2>/dev/null
}
# CLI...: imports the image `bench` through the given CLI (busybox-static for /bin/sh, the backend at
# /bench/backend, one layer, a docker save archive), which the benchmarks' sandboxes run on.
import_bench_image() {
  local d=$tmp/bench-image a
  mkdir -p "$d/rootfs/"{bin,etc,proc,dev,tmp,sys,bench} "$d/out/l0"
  cp /bin/busybox "$d/rootfs/bin/"
  for a in sh sleep cat; do ln -sf busybox "$d/rootfs/bin/$a"; done
  cp "$tmp/backend" "$d/rootfs/bench/backend"
  tar -cf "$d/out/l0/layer.tar" -C "$d/rootfs" .
  printf '{"os":"linux","config":{"Env":["PATH=/bin"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$(sha256sum "$d/out/l0/layer.tar" | cut -d' ' -f1)" >"$d/config.json"
  a=$(sha256sum "$d/config.json" | cut -d' ' -f1).json
  mv "$d/config.json" "$d/out/$a"
  printf '[{"Config":"%s","Layers":["l0/layer.tar"]}]' "$a" >"$d/out/manifest.json"
  tar -cf "$d.tar" -C "$d/out" .
  timeout 120 "$@" image import "$d.tar" bench >"$tmp/image-import.out" 2>&1 ||
    die "sandgate image import failed: $(cat "$tmp/image-import.out")"
}

# ---------------------------------------------------------------------------------------------- sandgate
# BUILD SGDIR CGROUP NAME [NODE_TOML]: writes SGDIR/sandgate.toml (one proxy worker, userspace TLS, the
# $tmp/tls certificate, access log SGDIR/access.log; NODE_TOML: more [node] lines), starts sandgate-node and
# waits until it is ready. Logs go to $tmp/node$NAME.log; sets node_pid.
start_node() {
  local d=$1 sg=$2 cg=$3 node_toml=${5:-}
  mkdir -p "$sg/state"
  cat >"$sg/sandgate.toml" <<EOF
domain = "sandbox.localhost"
node_socket = "unix:$sg/node.sock"
log_level = "info"

[proxy]
listen = "127.0.0.1:0"
workers = 1
ktls = "off"
access_log = "$sg/access.log"

[[proxy.certificates]]
cert = "$tmp/tls/server.pem"
key = "$tmp/tls/server.key"

[node]
state_dir = "$sg/state"
on_shutdown = "terminate"
cgroup_name = "$cg"
init_path = "$d/noderuntime/sandgate-init"
$node_toml
EOF
  start "node$4" "$d/noderuntime/sandgate-node" --config "$sg/sandgate.toml"
  node_pid=$started
  wait_log "$tmp/node$4.log" "sandgate-node ready" "$node_pid" "sandgate-node${4:+ (${4#-})}"
}
# BUILD SGDIR NAME: starts sandgate-proxy with SGDIR/sandgate.toml and waits until it listens; logs to
# $tmp/proxy$NAME.log; sets proxy_pid and proxy_port.
start_proxy() {
  local d=$1 sg=$2
  start "proxy$3" "$d/proxy/sandgate-proxy" --config "$sg/sandgate.toml"
  proxy_pid=$started
  wait_log "$tmp/proxy$3.log" "sandgate-proxy ready on" "$proxy_pid" "sandgate-proxy${3:+ (${3#-})}"
  proxy_port=$(sed -n 's/.*sandgate-proxy ready on 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$tmp/proxy$3.log" | head -1)
  [[ -n $proxy_port ]] || die "cannot parse the proxy port${3:+ (${3#-})}: $(grep ready "$tmp/proxy$3.log")"
}
