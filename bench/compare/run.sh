#!/usr/bin/env bash
# Side-by-side bulk TLS forwarding benchmark: sandgate-proxy (userspace TLS path) vs nginx (stream, TLS
# termination) vs HAProxy (mode tcp, TLS termination), plus no-TLS floors, all on 127.0.0.1 with the SAME
# certificate (ECDSA P-256 wildcard from deploy/gen-cert.sh), the SAME backend program and the same client.
#
#   bench/compare/run.sh
#
# Environment (all optional):
#   SIZE_MIB=1024     bytes moved per transfer, in MiB (one connection per transfer)
#   RUNS=3            repetitions of every (proxy, direction) cell; the table reports medians
#   PROXIES="sandgate nginx haproxy splice direct"   which rows to measure (subset, any order)
#   BUILD_DIR=<repo>/build   where sandgate-proxy, sandgate-node, sandgate-init and sandgate are
#   CIPHER=TLS_AES_128_GCM_SHA256   TLS 1.3 suite pinned by the client for every TLS proxy
#   CURL_MAX_TIME=300 seconds one transfer may take before it counts as a failure
#   DIRECTIONS="download upload"   which directions to measure
#   ATTACH_WAIT=0     seconds to pause before measuring, after printing the proxy pids (to attach perf/strace)
#   QUIET_WAIT=60     before each transfer, wait up to this many seconds for the machine to be idle (other
#                     processes using < 0.2 core over 1 s). During each transfer the CPU used by everything
#                     except proxy, curl and backend is measured ("others"); a transfer during which others
#                     used more than 0.1 core on average is repeated (up to RETRIES=2 times), and the
#                     least disturbed attempt is kept. The table reports the median "others" per cell.
#   WAIT_BUDGET=300   total seconds all that waiting and repeating may add to a run; once spent, every
#                     transfer is measured once, right away (the report then shows how disturbed it was)
#   KEEP_TMP=1        keep the temp dir (configs, logs) for inspection
#   OUT=bench/compare/last-run.md   where the Markdown report is also written
#
# What is measured, per (proxy, direction): one connection moving SIZE_MIB MiB either backend -> client
# ("download": GET /dl/N, the backend streams N zero bytes) or client -> backend ("upload": PUT of an N-byte
# sparse file, the backend counts it). Reported: median wall seconds (curl's time_total, TLS handshake
# included), throughput from that median, the PROXY PROCESS's CPU seconds per GiB (utime+stime from
# /proc/PID/stat before/after, all threads; nginx master+worker summed) and the client's (curl) CPU s/GiB.
# Fairness: one worker each (sandgate `workers = 1`, nginx `worker_processes 1`, HAProxy `nbthread 1`);
# buffer sizes are left at each proxy's defaults. Rows:
#   sandgate  sandgate-node + sandgate-proxy (ktls = "off": the userspace SSL_read/SSL_write path); the
#             backend runs inside a sandbox (own netns, `--cpus 2` so its CPU quota never throttles it),
#             reached as https://9000-bench.sandbox.localhost:PORT
#   nginx     nginx `stream { server { listen ... ssl; proxy_pass ...; } }`, TLS 1.3 only
#   haproxy   HAProxy `mode tcp`, `bind ... ssl crt`, TLS 1.3 only
#   splice    floor: splice_forward.c, a plain-TCP forwarder moving bytes with splice(2) (no TLS at all)
#   direct    floor: curl to the backend over plain loopback, no proxy (proxy CPU column is empty)
# nginx, haproxy and the splice forwarder forward to the same backend binary listening on host loopback.
#
# Benchmark-only dependencies: nginx, libnginx-mod-stream and haproxy are installed with apt-get if missing
# (Debian's services are not left running); curl and cc must exist. Everything this script starts is
# stopped on exit, error or Ctrl-C; every wait and transfer has a deadline.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$root/build}
SIZE_MIB=${SIZE_MIB:-1024}
RUNS=${RUNS:-3}
PROXIES=${PROXIES:-sandgate nginx haproxy splice direct}
CIPHER=${CIPHER:-TLS_AES_128_GCM_SHA256}
CURL_MAX_TIME=${CURL_MAX_TIME:-300}
DIRECTIONS=${DIRECTIONS:-download upload}
ATTACH_WAIT=${ATTACH_WAIT:-0}
QUIET_WAIT=${QUIET_WAIT:-60}
RETRIES=${RETRIES:-2}
WAIT_BUDGET=${WAIT_BUDGET:-300}
wait_deadline=$((SECONDS + 100000))  # set when measuring starts
KEEP_TMP=${KEEP_TMP:-0}
OUT=${OUT:-$here/last-run.md}

[[ $SIZE_MIB =~ ^[1-9][0-9]*$ ]] || { echo "SIZE_MIB must be a positive integer" >&2; exit 2; }
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "RUNS must be a positive integer" >&2; exit 2; }
bytes=$((SIZE_MIB * 1024 * 1024))
command_line="SIZE_MIB=$SIZE_MIB RUNS=$RUNS PROXIES=\"$PROXIES\" DIRECTIONS=\"$DIRECTIONS\" bench/compare/run.sh"

log() { echo "[compare] $*" >&2; }
die() {
  log "error: $*"
  exit 1
}
want() { [[ " $PROXIES " == *" $1 "* ]]; }
# shellcheck source=bench/compare/lib.sh
source "$here/lib.sh"

# ---------------------------------------------------------------------------------------------- cleanup
tmp=""
pids=()  # every long-running process we started, stopped in reverse order
node_up=0
cg_name="sandgate-bench-$$"
cli=()

# shellcheck disable=SC2317  # invoked by the EXIT trap (set_traps in lib.sh)
cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  if ((node_up)) && ((${#cli[@]})); then timeout 15 "${cli[@]}" rm bench >/dev/null 2>&1; fi
  stop_started
  remove_cgroup "$cg_name"
  remove_tmp
  exit "$rc"
}
set_traps

# ---------------------------------------------------------------------------------------------- deps
need_install=()
if want nginx; then
  command -v nginx >/dev/null || need_install+=(nginx)
  [[ -e /usr/lib/nginx/modules/ngx_stream_module.so ]] || need_install+=(libnginx-mod-stream)
fi
if want haproxy; then command -v haproxy >/dev/null || need_install+=(haproxy); fi
if ((${#need_install[@]})); then
  apt_install "${need_install[@]}"
fi
command -v curl >/dev/null || die "curl is required"
command -v cc >/dev/null || die "a C compiler (cc) is required"
if want sandgate; then
  for b in proxy/sandgate-proxy noderuntime/sandgate-node noderuntime/sandgate-init cli/sandgate; do
    [[ -x $BUILD_DIR/$b ]] || die "$BUILD_DIR/$b missing: build first (ninja -C build)"
  done
fi

# ---------------------------------------------------------------------------------------------- setup
make_tmp sandgate-compare
want splice && cc -O2 -Wall -pthread -o "$tmp/splice_forward" "$here/splice_forward.c"
cat "$tmp/tls/server.pem" "$tmp/tls/server.key" >"$tmp/tls/haproxy.pem"
truncate -s "$bytes" "$tmp/upload.bin"  # sparse: reading it costs the client little
cat "$tmp/upload.bin" >/dev/null          # ...once its (zero) pages are cached: the first run must not pay that

host=9000-bench.sandbox.localhost
declare -A port  # proxy -> client-facing port
declare -A ppids # proxy -> pids whose CPU is counted
declare -A scheme

backend_port=""
pick_port backend_port
start backend "$tmp/backend" 127.0.0.1 "$backend_port"
wait_port "$backend_port" "$started" backend
declare -A backend_pid=([direct]=$started [splice]=$started [nginx]=$started [haproxy]=$started [sandgate]="")

if want direct; then
  port[direct]=$backend_port ppids[direct]="" scheme[direct]=http
fi

if want splice; then
  pick_port "port[splice]"
  start splice "$tmp/splice_forward" "${port[splice]}" "$backend_port"
  wait_port "${port[splice]}" "$started" splice
  ppids[splice]=$started scheme[splice]=http
fi

if want nginx; then
  pick_port "port[nginx]"
  mkdir -p "$tmp/nginx"
  cat >"$tmp/nginx/nginx.conf" <<EOF
load_module /usr/lib/nginx/modules/ngx_stream_module.so;
worker_processes 1;
pid $tmp/nginx/nginx.pid;
error_log $tmp/nginx/error.log warn;
events { worker_connections 256; }
stream {
    server {
        listen 127.0.0.1:${port[nginx]} ssl;
        ssl_certificate $tmp/tls/server.pem;
        ssl_certificate_key $tmp/tls/server.key;
        ssl_protocols TLSv1.3;
        proxy_pass 127.0.0.1:$backend_port;
    }
}
EOF
  start nginx nginx -p "$tmp/nginx/" -c "$tmp/nginx/nginx.conf" -e "$tmp/nginx/error.log" -g 'daemon off;'
  wait_port "${port[nginx]}" "$started" nginx
  ppids[nginx]=$started scheme[nginx]=https
fi

if want haproxy; then
  pick_port "port[haproxy]"
  mkdir -p "$tmp/haproxy"
  cat >"$tmp/haproxy/haproxy.cfg" <<EOF
global
    nbthread 1
    maxconn 256
defaults
    mode tcp
    timeout connect 5s
    timeout client 300s
    timeout server 300s
frontend fe
    bind 127.0.0.1:${port[haproxy]} ssl crt $tmp/tls/haproxy.pem ssl-min-ver TLSv1.3
    default_backend be
backend be
    server s1 127.0.0.1:$backend_port
EOF
  haproxy -c -q -f "$tmp/haproxy/haproxy.cfg" || die "haproxy rejected its config"
  start haproxy haproxy -db -f "$tmp/haproxy/haproxy.cfg"
  wait_port "${port[haproxy]}" "$started" haproxy
  ppids[haproxy]=$started scheme[haproxy]=https
fi

if want sandgate; then
  start_node "$BUILD_DIR" "$tmp/sg" "$cg_name" ""
  node_up=1
  cli=("$BUILD_DIR/cli/sandgate" --api "unix:$tmp/sg/node.sock")
  start_proxy "$BUILD_DIR" "$tmp/sg" ""
  port[sandgate]=$proxy_port
  import_bench_image "${cli[@]}"
  timeout 60 "${cli[@]}" create --name bench --image bench --public 9000 --cpus 2 --timeout 86400 -- \
    /bench/backend 127.0.0.1 9000 >"$tmp/create.out" 2>&1 || die "sandgate create failed: $(cat "$tmp/create.out")"
  ppids[sandgate]=$proxy_pid scheme[sandgate]=https
fi
sandbox_backend_pid() {  # the sandbox's backend, seen from the host pid namespace (lookup only)
  local pid
  for pid in $(pgrep -x backend); do
    [[ $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) == "/bench/backend 127.0.0.1 9000 " ]] && echo "$pid"
  done | head -1
}

curl_base=(curl -sS --http1.1 --max-time "$CURL_MAX_TIME" -H 'Expect:')
tls_opts() {  # PROXY
  [[ ${scheme[$1]} == https ]] || return 0
  printf '%s\n' --cacert "$tmp/tls/ca.pem" --tlsv1.3 --tls-max 1.3 --tls13-ciphers "$CIPHER" \
    --resolve "$host:${port[$1]}:127.0.0.1"
}
url() {  # PROXY PATH
  if [[ ${scheme[$1]} == https ]]; then echo "https://$host:${port[$1]}$2"; else echo "http://127.0.0.1:${port[$1]}$2"; fi
}

# Readiness (the sandbox backend comes up asynchronously) and what TLS was negotiated.
declare -A negotiated
order=()
probe() { "${curl_base[@]}" "${topts[@]}" -v -o /dev/null --fail "$(url "$1" /dl/16)" 2>"$tmp/probe-$1.txt"; }  # PROXY
for p in sandgate nginx haproxy splice direct; do
  want "$p" || continue
  order+=("$p")
  mapfile -t topts < <(tls_opts "$p")
  poll probe "$p" || die "$p never served a probe request: $(tail -5 "$tmp/probe-$p.txt")"
  negotiated[$p]=$(sed -n 's/^\* SSL connection using //p' "$tmp/probe-$p.txt" | head -1)
  [[ -n ${negotiated[$p]} ]] || negotiated[$p]="plain TCP"
  log "$p ready on port ${port[$p]}: ${negotiated[$p]}"
done
if want sandgate; then
  backend_pid[sandgate]=$(sandbox_backend_pid)
  [[ -n ${backend_pid[sandgate]} ]] || log "warning: the sandbox backend's pid was not found; its CPU counts as others"
fi

# ---------------------------------------------------------------------------------------------- measure
# One transfer: prints "wall proxy_cpu client_cpu proxy_sys_cpu others_cpu" (seconds); others = CPU time the
# whole machine spent on anything but proxy, curl and backend during the transfer.
transfer_once() {  # PROXY DIRECTION
  local p=$1 dir=$2 c0 c1 m0 m1 b0 b1 timef="$tmp/time.txt" out="$tmp/curl.out" resp="$tmp/resp.txt"
  local -a topts args
  mapfile -t topts < <(tls_opts "$p")
  if [[ $dir == download ]]; then
    args=(-o /dev/null "$(url "$p" "/dl/$bytes")")
  else
    : >"$resp"
    args=(-T "$tmp/upload.bin" -o "$resp" "$(url "$p" /ul)")
  fi
  local bpid=${backend_pid[$p]}
  c0=$(cpu_ticks ${ppids[$p]})
  b0=$(cpu_ticks "$bpid")
  m0=$(machine_ticks)
  local TIMEFORMAT='%3U %3S'
  { time "${curl_base[@]}" "${topts[@]}" --fail -w '%{http_code} %{size_download} %{size_upload} %{time_total}\n' \
    "${args[@]}" >"$out" 2>"$tmp/curl.err"; } 2>"$timef" ||
    die "$p $dir transfer failed: $(cat "$tmp/curl.err") $(cat "$out")"
  sleep 0.1  # let the proxy finish closing the connection before its CPU is read
  c1=$(cpu_ticks ${ppids[$p]})
  b1=$(cpu_ticks "$bpid")
  m1=$(machine_ticks)
  read -r code down up wall <"$out"
  [[ $code == 200 ]] || die "$p $dir: HTTP $code"
  if [[ $dir == download ]]; then
    [[ $down == "$bytes" ]] || die "$p $dir: got $down of $bytes bytes"
  else
    [[ $up == "$bytes" && $(tr -d '\n' <"$resp") == "$bytes" ]] ||
      die "$p $dir: sent $up, backend counted $(cat "$resp") of $bytes bytes"
  fi
  read -r cu cs <"$timef"
  awk -v w="$wall" -v c0="$c0" -v c1="$c1" -v b0="$b0" -v b1="$b1" -v m0="$m0" -v m1="$m1" -v t="$clk_tck" \
    -v cu="$cu" -v cs="$cs" \
    'BEGIN { split(c0, a, " "); split(c1, b, " "); split(b0, x, " "); split(b1, y, " ")
             proxy = (b[1] + b[2] - a[1] - a[2]) / t; backend = (y[1] + y[2] - x[1] - x[2]) / t
             others = (m1 - m0) / t - proxy - backend - cu - cs; if (others < 0) others = 0
             printf "%.3f %.3f %.3f %.3f %.3f\n", w, proxy, cu + cs, (b[2] - a[2]) / t, others }'
}
transfer() {  # PROXY DIRECTION: the least disturbed of up to 1 + RETRIES attempts
  # shellcheck disable=SC2016  # $1: field 1 (wall s) of each result, expanded by least_disturbed
  least_disturbed 5 '$1' "$1 $2" transfer transfer_once "$1" "$2"
}

if ((ATTACH_WAIT > 0)); then
  for p in "${order[@]}"; do log "pids of $p: ${ppids[$p]:-none}"; done
  log "pausing ${ATTACH_WAIT}s (ATTACH_WAIT) before measuring"
  sleep "$ATTACH_WAIT"
fi
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
wait_deadline=$((SECONDS + WAIT_BUDGET))
declare -A samples  # "proxy dir" -> lines of "wall proxy_cpu client_cpu proxy_sys others"
start_s=$SECONDS
for ((run = 1; run <= RUNS; run++)); do
  # Interleaved: every cell once per run, so slow drift (thermal, noisy neighbours) hits all rows alike.
  for p in "${order[@]}"; do
    for dir in $DIRECTIONS; do
      r=$(transfer "$p" "$dir")
      samples["$p $dir"]+="$r"$'\n'
      log "run $run/$RUNS $p $dir: wall/proxy-cpu/client-cpu/proxy-sys/others s = $r"
    done
  done
done
elapsed=$((SECONDS - start_s))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

if want sandgate; then
  sg_path=$(grep -o '"path":"[^"]*"' "$tmp/sg/access.log" | sed 's/"path":"\(.*\)"/\1/' | sort | uniq -c |
    awk '{ printf "%s%s x%s", (NR > 1 ? ", " : ""), $2, $1 }')
fi

# ---------------------------------------------------------------------------------------------- report
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
label() {
  case $1 in
    sandgate) echo "sandgate-proxy (userspace TLS)" ;;
    nginx) echo "nginx $(nginx -v 2>&1 | sed 's|.*nginx/||') stream+ssl" ;;
    haproxy) echo "HAProxy $(haproxy -v | head -1 | awk '{print $3}') mode tcp+ssl" ;;
    splice) echo "floor: splice(2) TCP forward, no TLS" ;;
    direct) echo "floor: backend direct, no proxy, no TLS" ;;
  esac
}
gib=$(awk -v b="$bytes" 'BEGIN { print b / 1073741824 }')
{
  echo "Command: \`$command_line\` (each transfer moves $SIZE_MIB MiB over one connection; medians of $RUNS runs; measuring took ${elapsed} s)"
  echo
  echo "Date: $(date -u '+%Y-%m-%d %H:%M UTC'). Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), kernel $(uname -r), $(openssl version | awk '{print $1, $2}'), $(nginx -v 2>&1 | sed 's/.*: //'), HAProxy $(haproxy -v | head -1 | awk '{print $3}'), client $(curl -V | head -1 | awk '{print $1, $2}')."
  echo
  echo "TLS as negotiated by the client: $(for p in "${order[@]}"; do [[ ${scheme[$p]} == https ]] && printf '%s: %s; ' "$p" "${negotiated[$p]}"; done | sed 's/; $//')."
  if want sandgate; then echo "sandgate access log data paths: ${sg_path:-none}."; fi
  echo "Load average before: $load_before, after: $load_after. \"others\" = CPU seconds the rest of the machine used during a transfer (median per cell); near 0 means the cell was measured on an otherwise idle machine."
  echo
  echo "| proxy | direction | wall s (median) | wall s (min-max) | MiB/s (median) | proxy CPU s/GiB (median) | of it kernel (sys) | curl CPU s/GiB (median) | others CPU s |"
  echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  for p in "${order[@]}"; do
    for dir in $DIRECTIONS; do
      data=${samples["$p $dir"]}
      w=$(awk 'NF { print $1 }' <<<"$data" | median)
      wmin=$(awk 'NF { print $1 }' <<<"$data" | sort -g | head -1)
      wmax=$(awk 'NF { print $1 }' <<<"$data" | sort -g | tail -1)
      pc=$(awk -v g="$gib" 'NF { print $2 / g }' <<<"$data" | median)
      ps_=$(awk -v g="$gib" 'NF { print $4 / g }' <<<"$data" | median)
      cc_=$(awk -v g="$gib" 'NF { print $3 / g }' <<<"$data" | median)
      ot=$(awk 'NF { print $5 }' <<<"$data" | median)
      if [[ -z ${ppids[$p]} ]]; then pcs="—" pss="—"; else pcs=$(printf '%.2f' "$pc") pss=$(printf '%.2f' "$ps_"); fi
      printf '| %s | %s | %.2f | %.2f-%.2f | %.0f | %s | %s | %.2f | %.2f |\n' "$(label "$p")" \
        "$([[ $dir == download ]] && echo 'backend -> client' || echo 'client -> backend')" \
        "$w" "$wmin" "$wmax" "$(awk -v m="$SIZE_MIB" -v w="$w" 'BEGIN { print m / w }')" "$pcs" "$pss" "$cc_" "$ot"
    done
  done
  echo
  echo "One worker each: sandgate \`workers = 1\` (\`ktls = \"off\"\`), nginx \`worker_processes 1\` (master+worker CPU summed), HAProxy \`nbthread 1\`; default buffer sizes. Proxy CPU = utime+stime of the proxy process(es) from /proc/PID/stat (${clk_tck} Hz ticks) around each transfer; curl CPU from bash \`time\`. Client, proxy and backend share the $(nproc) cores, so wall throughput is bounded by all three; CPU s/GiB is the per-proxy cost."
} >"$tmp/report.md"
cp "$tmp/report.md" "$OUT"
cat "$tmp/report.md"
log "report written to $OUT"
