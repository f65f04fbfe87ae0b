#!/usr/bin/env bash
# Small-request benchmark, side by side: CPU per request and per new TLS connection through sandgate-proxy +
# sandgate-node (one build or several) and through nginx and HAProxy as anchors, all on 127.0.0.1 with the
# same certificate (ECDSA P-256 wildcard from deploy/gen-cert.sh), the same backend program
# (bench/compare/backend.c in its `small` mode: GET /dl/N answered with N bytes, keep-alive, many connections
# at once) and the same client (wrk). Modes: one NEW TLS
# connection per request (wrk -H "Connection: close"), full or resumed handshakes, and keep-alive (many
# requests per connection: req/s, CPU per request, p99 latency).
#
#   bench/compare/connections.sh                                   # the build in ./build vs nginx
#   BUILDS="before=/work/build-bench-before after=/work/build-bench-after" bench/compare/connections.sh
#
# Environment (all optional):
#   BIN_DIR=<repo>/build  the sandgate build to measure (its proxy/sandgate-proxy, noderuntime/sandgate-node,
#                     noderuntime/sandgate-init and cli/sandgate); its rows are labelled "sandgate"
#   BUILDS="label=dir ..."  several builds measured in the same session instead of BIN_DIR; each gets its own
#                     node + proxy (started once, idle while another row is measured). The same dir may
#                     appear under two labels, with NODE_TOML_<label> ("-" as "_") lines added to one's
#                     [node] table (e.g. NODE_TOML_other="batch_scheduling = false")
#   ACCESS="public private"  sandgate rows per build: a public port (no credential) and a private port with
#                     "Authorization: Bearer <the sandbox's token>" (the realistic case)
#   NGINX="stream http"  anchor rows: nginx `stream` + `ssl` + proxy_pass (TLS terminator, bytes forwarded)
#                     and nginx `http` + `ssl` + proxy_pass (parses the request, opens an upstream per
#                     request); "" for none
#   HAPROXY="tcp"     anchor row: HAProxy `mode tcp` + `bind ... ssl` (TLS terminator, bytes forwarded, one
#                     tcplog line per connection); "" for none
#   MODES="full resumed keepalive"  full: every connection is a full TLS 1.3 handshake (the client forgets
#                     the session before reconnecting); resumed: the client offers the session ticket it got
#                     on its last connection (PSK with ECDHE), as a browser or an HTTP client library would;
#                     keepalive: KEEPALIVE_CONNECTIONS connections opened once, requests back to back on each
#   KEEPALIVE_CONNECTIONS=64  wrk -c in keepalive mode
#   DURATION=10       seconds of each measurement (one wrk run)
#   RUNS=3            measurements per (row, mode); the table reports medians. Runs are interleaved (every
#                     cell once per run, start row rotated) so slow drift hits all rows alike
#   CONNECTIONS=4     wrk -c: connections in flight at once (each carries one request, then closes)
#   BODY_BYTES=100    response body size (GET /dl/BODY_BYTES)
#   WARMUP=2          seconds of unmeasured traffic per (row, mode) before the first run
#   CIPHER=TLS_AES_128_GCM_SHA256   the one TLS 1.3 suite the client offers (group: OpenSSL's default, X25519)
#   QUIET_WAIT=60     before each measurement, wait up to this many seconds for the machine to be idle (other
#                     processes using < 0.2 core over 1 s). During it, the CPU of everything except proxy,
#                     node, wrk and backends is measured ("others"); a measurement during which others used
#                     more than 0.1 core on average is repeated (up to RETRIES=2 times), the least disturbed
#                     attempt is kept
#   WAIT_BUDGET=600   total seconds all that waiting and repeating may add; once spent, every cell is
#                     measured once, right away (the report then shows how disturbed it was)
#   ATTACH_WAIT=0     seconds to pause before measuring, after printing the pids (to attach perf/strace)
#   KEEP_TMP=1        keep the temp dir (configs, logs, raw samples) for inspection
#   OUT=FILE          also write the Markdown report to FILE (it always goes to stdout; logs go to stderr)
#
# What is measured, per (row, mode) and run: wrk (1 thread, CONNECTIONS connections, DURATION s, header
# "Connection: close", so every request is a new TCP connection and a new TLS handshake; in keepalive mode
# KEEPALIVE_CONNECTIONS connections and no such header, and wrk's p99 latency too). Reported:
# connections/s (completed requests / wrk's time; all answers must be 200), and CPU per connection =
# utime+stime from /proc/PID/stat (all threads) before/after the run divided by the completed connections:
# the proxy process (nginx: master + worker), and for sandgate separately the node process (the proxy's
# internal/lookup and internal/open calls land there; the node's periodic work during the run is included).
# The client's CPU per connection (wrk, from bash `time`) and the share of resumed handshakes (counted in the
# client by a small LD_PRELOAD shim around SSL_clear, which is also what makes "full" mode forget sessions)
# are reported too. wrk offers no ALPN, so sandgate treats it like a client that may speak h2 (a browser,
# curl): before the policy cache, that meant the ClientHello-time internal/lookup call on every connection.
# Fairness: one worker each (sandgate `workers = 1`, nginx `worker_processes 1`); each proxy writes one
# access-log line per connection (sandgate's JSON log, nginx's access_log) to a temp file.
#
# Dependencies: wrk (Debian 4.1.0), nginx, libnginx-mod-stream and haproxy are installed with apt-get if missing
# (Debian's services are not left running); cc and the OpenSSL headers (libssl-dev) build the backend and
# the client shim. Runs as root (sandgate-node creates namespaces and cgroups). Everything this script starts
# is stopped on exit, error or Ctrl-C; every wait has a deadline.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
BIN_DIR=${BIN_DIR:-$root/build}
BUILDS=${BUILDS-sandgate=$BIN_DIR}
ACCESS=${ACCESS:-public private}
NGINX=${NGINX-stream http}
HAPROXY=${HAPROXY-tcp}
KEEPALIVE_CONNECTIONS=${KEEPALIVE_CONNECTIONS:-64}
MODES=${MODES:-full resumed keepalive}
DURATION=${DURATION:-10}
RUNS=${RUNS:-3}
CONNECTIONS=${CONNECTIONS:-4}
BODY_BYTES=${BODY_BYTES:-100}
WARMUP=${WARMUP:-2}
CIPHER=${CIPHER:-TLS_AES_128_GCM_SHA256}
QUIET_WAIT=${QUIET_WAIT:-60}
RETRIES=${RETRIES:-2}
WAIT_BUDGET=${WAIT_BUDGET:-600}
ATTACH_WAIT=${ATTACH_WAIT:-0}
KEEP_TMP=${KEEP_TMP:-0}
OUT=${OUT:-}
wait_deadline=$((SECONDS + 100000))  # set when measuring starts

for v in DURATION RUNS CONNECTIONS BODY_BYTES KEEPALIVE_CONNECTIONS; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "$v must be a positive integer" >&2; exit 2; }
done
[[ $WARMUP =~ ^[0-9]+$ ]] || { echo "WARMUP must be a non-negative integer" >&2; exit 2; }
for m in $MODES; do
  [[ $m == full || $m == resumed || $m == keepalive ]] || { echo "MODES: full, resumed and/or keepalive" >&2; exit 2; }
done
[[ -z $HAPROXY || $HAPROXY == tcp ]] || { echo "HAPROXY: tcp or empty" >&2; exit 2; }
for a in $ACCESS; do [[ $a == public || $a == private ]] || { echo "ACCESS: public and/or private" >&2; exit 2; }; done
for n in $NGINX; do [[ $n == stream || $n == http ]] || { echo "NGINX: stream and/or http" >&2; exit 2; }; done
command_line="BUILDS=\"$BUILDS\" ACCESS=\"$ACCESS\" NGINX=\"$NGINX\" HAPROXY=\"$HAPROXY\" MODES=\"$MODES\" DURATION=$DURATION RUNS=$RUNS CONNECTIONS=$CONNECTIONS KEEPALIVE_CONNECTIONS=$KEEPALIVE_CONNECTIONS bench/compare/connections.sh"

log() { echo "[connections] $*" >&2; }
die() {
  log "error: $*"
  exit 1
}
# shellcheck source=bench/compare/lib.sh
source "$here/lib.sh"

# ---------------------------------------------------------------------------------------------- builds
labels=()
declare -A bdir  # build label -> build dir
for b in $BUILDS; do
  [[ $b == *=* ]] || die "BUILDS entries are label=dir, got '$b'"
  l=${b%%=*} d=${b#*=}
  [[ $l =~ ^[A-Za-z0-9_-]+$ ]] || die "build label '$l': letters, digits, _ and - only"
  [[ -z ${bdir[$l]:-} ]] || die "build label '$l' given twice"
  for f in proxy/sandgate-proxy noderuntime/sandgate-node noderuntime/sandgate-init cli/sandgate; do
    [[ -x $d/$f ]] || die "$d/$f missing: build first (ninja -C $d sandgate-proxy sandgate-node sandgate-init sandgate)"
  done
  labels+=("$l")
  bdir[$l]=$(cd "$d" && pwd)
done
((${#labels[@]} > 0 || ${#NGINX} > 0 || ${#HAPROXY} > 0)) || die "nothing to measure"

# ---------------------------------------------------------------------------------------------- cleanup
tmp=""
pids=()  # every long-running process we started, stopped in reverse order
cg_names=()
declare -A cli_up  # build label -> 1 once its node answers (the sandbox is removed on exit)

# shellcheck disable=SC2317  # invoked by the EXIT trap (set_traps in lib.sh)
cleanup() {
  local rc=$? l cg
  set +e
  trap - EXIT INT TERM
  for l in "${!cli_up[@]}"; do
    timeout 15 "${bdir[$l]}/cli/sandgate" --api "unix:$tmp/sg-$l/node.sock" rm bench >/dev/null 2>&1
  done
  stop_started
  for cg in "${cg_names[@]}"; do remove_cgroup "$cg"; done
  remove_tmp
  exit "$rc"
}
set_traps

# ---------------------------------------------------------------------------------------------- deps
need_install=()
command -v wrk >/dev/null || need_install+=(wrk)
if [[ -n $NGINX ]]; then
  command -v nginx >/dev/null || need_install+=(nginx)
  [[ " $NGINX " != *" stream "* || -e /usr/lib/nginx/modules/ngx_stream_module.so ]] || need_install+=(libnginx-mod-stream)
fi
[[ -z $HAPROXY ]] || command -v haproxy >/dev/null || need_install+=(haproxy)
if ((${#need_install[@]})); then
  apt_install "${need_install[@]}"
fi
command -v cc >/dev/null || die "a C compiler (cc) is required"
[[ -e /usr/include/openssl/ssl.h ]] || die "the OpenSSL headers are required (apt-get install libssl-dev)"

# ---------------------------------------------------------------------------------------------- setup
make_tmp sandgate-connections

# The client side. wrk reuses one SSL object per connection slot: on reconnect it calls SSL_shutdown and
# SSL_clear, and SSL_clear keeps the last session, whose TLS 1.3 ticket the next handshake then offers.
# This shim counts, at each SSL_clear, whether the finished connection's handshake was resumed, and with
# SHIM_FORGET=1 drops the session so the next handshake is a full one. (wrk calls SSL_clear twice per
# connection; only the first call, on an SSL that has left TLS_ST_BEFORE, counts.)
cat >"$tmp/shim.c" <<'EOF'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <stdlib.h>
static unsigned long full_n, resumed_n;
static int forget = -1;
int SSL_clear(SSL* s) {
  static int (*real)(SSL*);
  if (!real) real = (int (*)(SSL*))dlsym(RTLD_NEXT, "SSL_clear");
  if (forget < 0) forget = getenv("SHIM_FORGET") && getenv("SHIM_FORGET")[0] == '1';
  if (SSL_get_state(s) != TLS_ST_BEFORE && SSL_get_session(s))
    __atomic_add_fetch(SSL_session_reused(s) ? &resumed_n : &full_n, 1, __ATOMIC_RELAXED);
  int r = real(s);
  if (forget) SSL_set_session(s, NULL);
  return r;
}
__attribute__((destructor)) static void report(void) {
  const char* out = getenv("SHIM_OUT");
  if (!out || full_n + resumed_n == 0) return;  /* also loaded into `timeout` and `env`: they write nothing */
  FILE* f = fopen(out, "w");
  if (f) {
    fprintf(f, "%lu %lu\n", full_n, resumed_n);
    fclose(f);
  }
}
EOF
cc -O2 -Wall -shared -fPIC -o "$tmp/shim.so" "$tmp/shim.c" -ldl
# The client's TLS settings: TLS 1.3 only, one cipher suite.
cat >"$tmp/client-openssl.cnf" <<EOF
openssl_conf = openssl_init
[openssl_init]
ssl_conf = ssl_module
[ssl_module]
system_default = tls_client
[tls_client]
MinProtocol = TLSv1.3
Ciphersuites = $CIPHER
EOF
# wrk connects to 127.0.0.1 whatever the URL's host (which gives SNI and Host), and skips its connect probe.
cat >"$tmp/loopback.lua" <<'EOF'
wrk.resolve = function(host, service)
  wrk.addrs = wrk.lookup("127.0.0.1", service)
end
EOF


rows=()
declare -A rport rhost rpids rnode rauth rlabel rlog
backend_port=""
if [[ -n $NGINX || -n $HAPROXY ]]; then
  pick_port backend_port
  start backend "$tmp/backend" 127.0.0.1 "$backend_port" small
  wait_port "$backend_port" "$started" backend
fi

for kind in $NGINX; do
  r=nginx-$kind
  pick_port "rport[$r]"
  mkdir -p "$tmp/$r"
  nginx_head="worker_processes 1;
pid $tmp/$r/nginx.pid;
error_log $tmp/$r/error.log warn;
events { worker_connections 1024; }"
  if [[ $kind == stream ]]; then
    cat >"$tmp/$r/nginx.conf" <<EOF
load_module /usr/lib/nginx/modules/ngx_stream_module.so;
$nginx_head
stream {
    log_format conn '\$remote_addr [\$time_local] \$protocol \$status \$bytes_sent \$bytes_received \$session_time \$ssl_session_reused';
    server {
        listen 127.0.0.1:${rport[$r]} ssl;
        ssl_certificate $tmp/tls/server.pem;
        ssl_certificate_key $tmp/tls/server.key;
        ssl_protocols TLSv1.3;
        access_log $tmp/$r/access.log conn;
        proxy_pass 127.0.0.1:$backend_port;
    }
}
EOF
  else
    cat >"$tmp/$r/nginx.conf" <<EOF
$nginx_head
http {
    log_format conn '\$remote_addr [\$time_local] "\$request" \$status \$body_bytes_sent \$request_time \$ssl_session_reused';
    client_body_temp_path $tmp/$r/body;
    proxy_temp_path $tmp/$r/proxy;
    fastcgi_temp_path $tmp/$r/fastcgi;
    uwsgi_temp_path $tmp/$r/uwsgi;
    scgi_temp_path $tmp/$r/scgi;
    server {
        listen 127.0.0.1:${rport[$r]} ssl;
        server_name *.sandbox.localhost;
        ssl_certificate $tmp/tls/server.pem;
        ssl_certificate_key $tmp/tls/server.key;
        ssl_protocols TLSv1.3;
        access_log $tmp/$r/access.log conn;
        location / { proxy_pass http://127.0.0.1:$backend_port; }
    }
}
EOF
  fi
  start "$r" nginx -p "$tmp/$r/" -c "$tmp/$r/nginx.conf" -e "$tmp/$r/error.log" -g 'daemon off;'
  wait_port "${rport[$r]}" "$started" "$r"
  rpids[$r]=$started rnode[$r]="" rauth[$r]="" rlog[$r]=$tmp/$r/access.log rhost[$r]=9000-bench.sandbox.localhost
  rlabel[$r]="nginx $(nginx -v 2>&1 | sed 's|.*nginx/||') $kind+ssl"
  rows+=("$r")
done

if [[ -n $HAPROXY ]]; then
  r=haproxy-tcp
  pick_port "rport[$r]"
  mkdir -p "$tmp/$r"
  cat "$tmp/tls/server.pem" "$tmp/tls/server.key" >"$tmp/$r/server.pem"
  # One thread like the others' one worker; the tcplog line per connection goes to stdout ($tmp/$r.log).
  cat >"$tmp/$r/haproxy.cfg" <<EOF
global
    nbthread 1
    maxconn 4096
    log stdout format raw local0
defaults
    mode tcp
    log global
    option tcplog
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend fe
    bind 127.0.0.1:${rport[$r]} ssl crt $tmp/$r/server.pem ssl-min-ver TLSv1.3
    default_backend be
backend be
    server s1 127.0.0.1:$backend_port
EOF
  haproxy -c -q -f "$tmp/$r/haproxy.cfg" || die "haproxy rejected its config"
  start "$r" haproxy -db -f "$tmp/$r/haproxy.cfg"
  wait_port "${rport[$r]}" "$started" "$r"
  rpids[$r]=$started rnode[$r]="" rauth[$r]="" rlog[$r]=$tmp/$r.log rhost[$r]=9000-bench.sandbox.localhost
  rlabel[$r]="HAProxy $(haproxy -v | head -1 | awk '{print $3}') mode tcp+ssl"
  rows+=("$r")
fi

for l in "${labels[@]}"; do
  d=${bdir[$l]} sg=$tmp/sg-$l cg="sandgate-bench-$$-$l"
  cg_names+=("$cg")
  mkdir -p "$sg/xdg"
  node_toml_var=NODE_TOML_${l//-/_}  # a label's "-" is "_" in the name
  start_node "$d" "$sg" "$cg" "-$l" "${!node_toml_var:-}"
  cli_up[$l]=1
  start_proxy "$d" "$sg" "-$l"
  pport=$proxy_port
  # One sandbox, two backends: 9000 public, 9001 private (needs the sandbox's token).
  import_bench_image "$d/cli/sandgate" --api "unix:$sg/node.sock"
  XDG_CONFIG_HOME=$sg/xdg timeout 60 "$d/cli/sandgate" --api "unix:$sg/node.sock" create --name bench \
    --image bench --public 9000 --expose 9001 --cpus 2 --timeout 86400 -- \
    /bin/sh -c "/bench/backend 127.0.0.1 9001 small & exec /bench/backend 127.0.0.1 9000 small" >"$tmp/create-$l.out" 2>&1 ||
    die "sandgate create ($l) failed: $(cat "$tmp/create-$l.out")"
  token=""
  [[ -r $sg/xdg/sandgate/tokens/bench ]] && token=$(tr -d '\n' <"$sg/xdg/sandgate/tokens/bench")
  for a in $ACCESS; do
    r=$l-$a
    rport[$r]=$pport rpids[$r]=$proxy_pid rnode[$r]=$node_pid rlog[$r]=$sg/access.log
    if [[ $a == public ]]; then
      rhost[$r]=9000-bench.sandbox.localhost rauth[$r]="" rlabel[$r]="sandgate $l, public port"
    else
      [[ -n $token ]] || die "no token saved by sandgate create ($l): $(cat "$tmp/create-$l.out")"
      rhost[$r]=9001-bench.sandbox.localhost rauth[$r]="Authorization: Bearer $token"
      rlabel[$r]="sandgate $l, private port + Bearer token"
    fi
    rows+=("$r")
  done
done
((${#rows[@]} > 0)) || die "no rows to measure"

url() { echo "https://${rhost[$1]}:${rport[$1]}/dl/$BODY_BYTES"; }
# Readiness (a sandbox's backends come up asynchronously) and an answer check: 200 and BODY_BYTES bytes.
declare -A negotiated
# shellcheck disable=SC2317  # invoked by poll
probe() {  # ROW: one request (headers in hdr); 200 and BODY_BYTES bytes; the answer is left in out
  out=$(curl -sS --http1.1 --max-time 10 --cacert "$tmp/tls/ca.pem" --tlsv1.3 --tls13-ciphers "$CIPHER" \
    --resolve "${rhost[$1]}:${rport[$1]}:127.0.0.1" "${hdr[@]}" -v -o /dev/null --fail \
    -w '%{http_code} %{size_download}' "$(url "$1")" 2>"$tmp/probe-$1.txt") && [[ $out == "200 $BODY_BYTES" ]]
}
for r in "${rows[@]}"; do
  hdr=()
  [[ -n ${rauth[$r]} ]] && hdr=(-H "${rauth[$r]}")
  poll probe "$r" || die "$r never served a probe request (${out:-}): $(tail -5 "$tmp/probe-$r.txt")"
  negotiated[$r]=$(sed -n 's/^\* SSL connection using //p' "$tmp/probe-$r.txt" | head -1)
  log "$r ready on port ${rport[$r]}: ${negotiated[$r]}"
done
if [[ " $ACCESS " == *" private "* ]]; then  # the private port really needs the token
  l=${labels[0]:-}
  if [[ -n $l ]]; then
    code=$(curl -sS --http1.1 --max-time 10 --cacert "$tmp/tls/ca.pem" \
      --resolve "${rhost[$l-private]}:${rport[$l-private]}:127.0.0.1" -o /dev/null -w '%{http_code}' "$(url "$l-private")" || true)
    [[ $code == 401 ]] || die "the private port answered $code without a token (401 expected)"
  fi
fi

# The backends' pids (host and sandboxes), whose CPU is not counted as "others".
backend_pids() {
  local pid
  for pid in $(pgrep -x backend); do
    case $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) in
      "$tmp/backend "* | "/bench/backend "*) echo "$pid" ;;  # the host's, the sandboxes' (image path)
    esac
  done
}

# ---------------------------------------------------------------------------------------------- measure
# One wrk run against ROW in MODE for SECS seconds. Prints
#   "requests req_per_s proxy_s node_s client_s others_s full resumed errors server_conns p99_ms"
# (in the modes with one request per connection, requests are connections)
wrk_once() {  # ROW MODE SECS
  local r=$1 mode=$2 secs=$3 p0 p1 n0 n1 m0 m1 b0 b1 l0 l1 forget=0
  local out="$tmp/wrk.out" timef="$tmp/time.txt" shim="$tmp/shim.out"
  local -a hdr=(-H "Connection: close")
  local conns=$CONNECTIONS
  [[ $mode == keepalive ]] && hdr=() conns=$KEEPALIVE_CONNECTIONS
  [[ -n ${rauth[$r]} ]] && hdr+=(-H "${rauth[$r]}")
  [[ $mode == full ]] && forget=1
  local bp
  bp=$(backend_pids | tr '\n' ' ')
  rm -f "$shim"
  l0=$(wc -l <"${rlog[$r]}")
  p0=$(cpu_ticks_total ${rpids[$r]})
  n0=0 n1=0
  [[ -n ${rnode[$r]} ]] && n0=$(cpu_ticks_total ${rnode[$r]})
  b0=$(cpu_ticks_total $bp)
  m0=$(machine_ticks)
  local TIMEFORMAT='%3U %3S'
  { time timeout $((secs + 30)) env SHIM_FORGET=$forget SHIM_OUT="$shim" LD_PRELOAD="$tmp/shim.so" \
    OPENSSL_CONF="$tmp/client-openssl.cnf" wrk -t1 -c"$conns" -d"${secs}s" --timeout 5s --latency -s "$tmp/loopback.lua" \
    "${hdr[@]}" "$(url "$r")" >"$out" 2>&1; } 2>"$timef" || die "$r $mode: wrk failed: $(cat "$out")"
  sleep 0.3  # let the servers finish the last connections and write their log lines before CPU is read
  p1=$(cpu_ticks_total ${rpids[$r]})
  [[ -n ${rnode[$r]} ]] && n1=$(cpu_ticks_total ${rnode[$r]})
  b1=$(cpu_ticks_total $bp)
  m1=$(machine_ticks)
  l1=$(wc -l <"${rlog[$r]}")
  local reqs wall non2xx sockerr full resumed cu cs p99
  reqs=$(awk '/ requests in / { print $1 }' "$out")
  wall=$(awk '/ requests in / { sub(/s,$/, "", $4); print $4 }' "$out")
  non2xx=$(awk '/Non-2xx or 3xx responses:/ { print $NF }' "$out")
  sockerr=$(awk '/Socket errors:/ { gsub(/,/, ""); print $4 + $6 + $8 + $10 }' "$out")
  # wrk --latency: "     99%    4.90ms" (us, ms, s or m)
  p99=$(awk '$1 == "99%" { v = $2; u = v; sub(/^[0-9.]+/, "", u); sub(/[a-z]+$/, "", v)
                           print (u == "us" ? v / 1000 : u == "s" ? v * 1000 : u == "m" ? v * 60000 : v) }' "$out")
  [[ -n $reqs && -n $wall && -n $p99 ]] || die "$r $mode: cannot parse wrk's output: $(cat "$out")"
  [[ -z $non2xx || $non2xx == 0 ]] || die "$r $mode: $non2xx answers were not 2xx: $(cat "$out")"
  ((reqs > 0)) || die "$r $mode: no request completed: $(cat "$out")"
  full=0 resumed=0
  [[ -s $shim ]] && read -r full resumed <"$shim"  # keepalive: no handshake after the first, no file
  read -r cu cs <"$timef"
  awk -v n="$reqs" -v w="$wall" -v p0="$p0" -v p1="$p1" -v n0="$n0" -v n1="$n1" -v b0="$b0" -v b1="$b1" \
    -v m0="$m0" -v m1="$m1" -v t="$clk_tck" -v cu="$cu" -v cs="$cs" -v f="$full" -v rs="$resumed" \
    -v e="${sockerr:-0}" -v sc="$((l1 - l0))" -v p99="$p99" \
    'BEGIN { proxy = (p1 - p0) / t; node = (n1 - n0) / t; be = (b1 - b0) / t
             others = (m1 - m0) / t - proxy - node - be - cu - cs; if (others < 0) others = 0
             printf "%d %.1f %.3f %.3f %.3f %.3f %d %d %d %d %.3f\n", n, n / w, proxy, node, cu + cs, others, f, rs, e, sc, p99 }'
}
measure() {  # ROW MODE: the least disturbed of up to 1 + RETRIES runs
  least_disturbed 6 "$DURATION" "$1 $2" run wrk_once "$1" "$2" "$DURATION"
}

if ((ATTACH_WAIT > 0)); then
  for r in "${rows[@]}"; do log "pids of $r: proxy ${rpids[$r]} node ${rnode[$r]:-none}"; done
  log "pausing ${ATTACH_WAIT}s (ATTACH_WAIT) before measuring"
  sleep "$ATTACH_WAIT" &
  wait $!  # in the background, so a TERM or INT stops the script at once
fi
if ((WARMUP > 0)); then
  for mode in $MODES; do
    for r in "${rows[@]}"; do
      w=$(wrk_once "$r" "$mode" "$WARMUP")
      log "warm-up $r $mode: $(cut -d' ' -f2 <<<"$w") conn/s"
    done
  done
fi
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
wait_deadline=$((SECONDS + WAIT_BUDGET))
declare -A samples  # "row mode" -> lines of wrk_once output
start_s=$SECONDS
nrows=${#rows[@]}
for ((run = 1; run <= RUNS; run++)); do
  for mode in $MODES; do
    for ((k = 0; k < nrows; k++)); do
      r=${rows[(k + run - 1) % nrows]}  # start row rotated each run
      s=$(measure "$r" "$mode")
      samples["$r $mode"]+="$s"$'\n'
      log "run $run/$RUNS $r $mode: requests req/s proxy-s node-s client-s others-s full resumed errors server-conns p99-ms = $s"
    done
  done
done
elapsed=$((SECONDS - start_s))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
if [[ $KEEP_TMP == 1 ]]; then
  for key in "${!samples[@]}"; do printf '%s\n%s' "# $key" "${samples[$key]}"; done >"$tmp/samples.txt"
fi

# ---------------------------------------------------------------------------------------------- report
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
col() { awk -v c="$2" 'NF { print $c }' <<<"$1" | median; }
{
  echo "Command: \`$command_line\` (wrk -t1, GET /dl/$BODY_BYTES, ${DURATION} s per run; full/resumed: -c$CONNECTIONS -H 'Connection: close', one request per TLS connection; keepalive: -c$KEEPALIVE_CONNECTIONS, requests back to back on each connection; medians of $RUNS interleaved runs; measuring took ${elapsed} s)"
  echo
  anchors=""
  [[ -n $NGINX ]] && anchors+=", $(nginx -v 2>&1 | sed 's/.*: //')"
  [[ -n $HAPROXY ]] && anchors+=", HAProxy $(haproxy -v | head -1 | awk '{print $3}')"
  echo "Date: $(date -u '+%Y-%m-%d %H:%M UTC'). Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), kernel $(uname -r), $(openssl version | awk '{print $1, $2}')$anchors, client $(wrk -v 2>&1 | head -1 | awk '{print $1, $2}')."
  echo
  for l in "${labels[@]}"; do
    echo "- build \`$l\`: ${bdir[$l]}$(git -C "${bdir[$l]}" rev-parse --short HEAD 2>/dev/null | sed 's/^/ (git /;s/$/)/')"
  done
  echo "- TLS as negotiated (curl probe): $(for r in "${rows[@]}"; do printf '%s: %s; ' "$r" "${negotiated[$r]}"; done | sed 's/; $//')."
  echo "- Load average before: $load_before, after: $load_after. \"others\" = cores the rest of the machine used during a run (median); near 0 means an otherwise idle machine."
  if [[ " $MODES " == *" keepalive "* ]]; then
    echo
    echo "Keep-alive, $KEEPALIVE_CONNECTIONS connections:"
    echo
    echo "| row | req/s (median) | req/s (min-max) | proxy CPU µs/req | node CPU µs/req | proxy+node µs/req | p99 latency ms | client (wrk) µs/req | errors | others cores |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for r in "${rows[@]}"; do
      data=${samples["$r keepalive"]}
      nu=$(awk 'NF { print 1e6 * $4 / $1 }' <<<"$data" | median)
      if [[ -n ${rnode[$r]} ]]; then nus=$(printf '%.1f' "$nu"); else nus="—"; fi
      printf '| %s | %.0f | %.0f-%.0f | %.1f | %s | %.1f | %.2f | %.1f | %s | %.2f |\n' "${rlabel[$r]}" \
        "$(col "$data" 2)" "$(awk 'NF { print $2 }' <<<"$data" | sort -g | head -1)" \
        "$(awk 'NF { print $2 }' <<<"$data" | sort -g | tail -1)" \
        "$(awk 'NF { print 1e6 * $3 / $1 }' <<<"$data" | median)" "$nus" \
        "$(awk 'NF { print 1e6 * ($3 + $4) / $1 }' <<<"$data" | median)" "$(col "$data" 11)" \
        "$(awk 'NF { print 1e6 * $5 / $1 }' <<<"$data" | median)" \
        "$(awk 'NF { e += $9 } END { print e + 0 }' <<<"$data")" \
        "$(awk -v d="$DURATION" 'NF { print $6 / d }' <<<"$data" | median)"
    done
  fi
  if [[ " $MODES " == *" full "* || " $MODES " == *" resumed "* ]]; then
    echo
    echo "One new TLS connection per request, $CONNECTIONS at a time:"
    echo
    echo "| row | handshake | conn/s (median) | conn/s (min-max) | proxy CPU µs/conn | node CPU µs/conn | proxy+node µs/conn | client (wrk) µs/conn | resumed handshakes | errors | others cores |"
    echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for mode in $MODES; do
      [[ $mode == keepalive ]] && continue
      for r in "${rows[@]}"; do
        data=${samples["$r $mode"]}
        cps=$(col "$data" 2)
        cmin=$(awk 'NF { print $2 }' <<<"$data" | sort -g | head -1)
        cmax=$(awk 'NF { print $2 }' <<<"$data" | sort -g | tail -1)
        pu=$(awk 'NF { print 1e6 * $3 / $1 }' <<<"$data" | median)
        nu=$(awk 'NF { print 1e6 * $4 / $1 }' <<<"$data" | median)
        tu=$(awk 'NF { print 1e6 * ($3 + $4) / $1 }' <<<"$data" | median)
        cu=$(awk 'NF { print 1e6 * $5 / $1 }' <<<"$data" | median)
        rs=$(awk 'NF { f += $7; r += $8 } END { printf "%.1f%%", (f + r > 0 ? 100 * r / (f + r) : 0) }' <<<"$data")
        er=$(awk 'NF { e += $9 } END { print e + 0 }' <<<"$data")
        ot=$(awk -v d="$DURATION" 'NF { print $6 / d }' <<<"$data" | median)
        if [[ -n ${rnode[$r]} ]]; then nus=$(printf '%.0f' "$nu"); else nus="—"; fi
        printf '| %s | %s | %.0f | %.0f-%.0f | %.0f | %s | %.0f | %.0f | %s | %s | %.2f |\n' "${rlabel[$r]}" "$mode" \
          "$cps" "$cmin" "$cmax" "$pu" "$nus" "$tu" "$cu" "$rs" "$er" "$ot"
      done
    done
  fi
  echo
  echo "CPU = utime+stime from /proc/PID/stat (${clk_tck} Hz ticks, all threads; nginx master+worker summed) around each ${DURATION} s run, divided by the requests wrk completed; each column's median is taken separately (proxy+node is the median of the per-run sums). One worker each: sandgate \`workers = 1\`, \`ktls = \"off\"\`; nginx \`worker_processes 1\`; HAProxy \`nbthread 1\`. Client, proxies, node and backend share the $(nproc) cores, so req/s and conn/s are bounded by all of them; CPU µs per request or connection is the per-proxy cost. p99: wrk's latency distribution (\`--latency\`). Resumed handshakes: share of connections whose handshake resumed a session (counted by the client)."
} >"$tmp/report.md"
[[ -n $OUT ]] && cp "$tmp/report.md" "$OUT"
cat "$tmp/report.md"
[[ -n $OUT ]] && log "report written to $OUT"
exit 0

