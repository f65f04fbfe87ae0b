#!/bin/sh
# The kTLS guest test proper (run by tests/ktls/guest-init inside the qemu guest; busybox sh).
# Starts sandgate-node and sandgate-proxy (ktls = "on": a connection that cannot be offloaded fails), imports
# the backend's image (SG/backend-image.tar: ktls_backend and its libraries), a sandbox of it running
# ktls_backend, then for TLS 1.2 and 1.3 x AES-128-GCM, AES-256-GCM, ChaCha20-Poly1305
# moves SIZE bytes each way with ktls_client and checks: data intact both ways (sha256 / byte compare),
# close_notify half-close in both directions, the access log's path = ktls-splice, and the kernel's
# /proc/net/tls_stat software TX and RX counters rising with no decrypt errors; once more with two empty
# application-data records in the upload (the client seals its own records for that). Then a TLS 1.2 session resumed
# by its ID (the SSL freed for the kernel left it in the cache), a TLS 1.3 KeyUpdate
# must end the connection with cause ktls_key_update, and a fatal alert from the client with cause
# client_closed. Then pipelined HTTP/1.1 requests on an HTTP port: Content-Length and chunked bodies spliced
# intact, a refused Upgrade, and a request for another route answered 421 without waiting for the backend's
# close. BENCH=1 adds a ktls-splice vs userspace run: CPU for BENCH_SIZE bytes each way, and the proxy's RSS
# per idle keep-alive connection (HOLD of them held on the HTTP port).
# Prints "KTLS-CASE PASS|FAIL ..." per case and "KTLS-GUEST-RESULT PASS|FAIL".
#   env: SG (binaries, certs), RUN (scratch dir), STATE (the node's state dir goes here: a file system that
#        takes idmapped mounts, for the image's layers), SIZE (bytes each way), BIG_SIZE (one more TLS 1.3
#        case), BENCH, BENCH_SIZE, HOLD, SOAK (N > 0: the soak alone, instead of the cases; see soak()),
#        SOAK_LINGER (seconds the soak's backend keeps a connection open after its client left; default 0)
set -u
SG=${SG:-/sg}
RUN=${RUN:-/run/ktls}
STATE=${STATE:-/state}
SIZE=${SIZE:-67108864}
BIG_SIZE=${BIG_SIZE:-$SIZE}
BENCH=${BENCH:-0}
BENCH_SIZE=${BENCH_SIZE:-$SIZE}
HOLD=${HOLD:-1000}
SOAK=${SOAK:-0}
SOAK_LINGER=${SOAK_LINGER:-0}
PER_CLIENT=2048
[ "$SOAK" -gt 1984 ] && PER_CLIENT=$((SOAK + 64))
# The proxy sizes max_connections from its descriptor limit (6 per connection where kTLS is possible): the
# guest's default of 4096 would stop the bench's HOLD connections near 650.
ulimit -n 65536
[ $((SOAK * 6 + 4096)) -gt 65536 ] && ulimit -n $((SOAK * 6 + 4096))
PORT=8443
SNI=9000-kt.sandbox.localhost
failures=0
mkdir -p "$RUN"

write_config() { # $1 = ktls mode
  cat >"$RUN/sandgate.toml" <<TOML
domain = "sandbox.localhost"
node_socket = "unix:$RUN/node.sock"
log_level = "info"

[proxy]
listen = "127.0.0.1:$PORT"
workers = 1
ktls = "$1"
access_log = "$RUN/access.log"
# The bench holds HOLD connections from one address to one sandbox.
max_connections_per_client = $PER_CLIENT
max_connections_per_sandbox = $PER_CLIENT

[[proxy.certificates]]
cert = "$SG/tls/server.pem"
key = "$SG/tls/server.key"

[node]
state_dir = "$STATE/node"
on_shutdown = "terminate"
cgroup_name = "sgktls"
init_path = "$SG/sandgate-init"
# The state disk is 128 MiB: the default reserve (1 GiB free kept on the layer store's filesystem) would
# refuse the backend image's import.
store_free_space_reserve_mb = 8
TOML
}

wait_for_line() { # $1 file, $2 text; 30 s
  i=0
  while ! grep -q "$2" "$1" 2>/dev/null; do
    i=$((i + 1))
    [ $i -gt 300 ] && return 1
    sleep 0.1
  done
}

tls_stat() { awk -v k="$1" '$1 == k { print $2 }' /proc/net/tls_stat; }
log_lines() { wc -l <"$RUN/access.log" 2>/dev/null || echo 0; }

# Waits for the proxy's access log line of the connection that just ended; prints it.
next_access_line() { # $1 = line count before
  i=0
  while [ "$(log_lines)" -le "$1" ]; do
    i=$((i + 1))
    [ $i -gt 100 ] && return 1
    sleep 0.05
  done
  sed -n "$(($1 + 1))p" "$RUN/access.log"
}

start_proxy() { # $1 = ktls mode
  write_config "$1"
  : >"$RUN/proxy.log"
  "$SG/sandgate-proxy" --config "$RUN/sandgate.toml" >>"$RUN/proxy.log" 2>&1 &
  PROXY_PID=$!
  wait_for_line "$RUN/proxy.log" "sandgate-proxy ready" || { echo "proxy did not start:"; cat "$RUN/proxy.log"; exit 1; }
}

client() { "$SG/ktls_client" $PORT $SNI "$SG/tls/ca.pem" "$@"; }
# The KeyUpdate and alert cases wait for the proxy to close the connection without the backend's answer: a
# proxy that keeps it open (the userspace path) must fail the case, not hold the guest until the host's
# timeout.
closing_client() { timeout 60 "$SG/ktls_client" $PORT $SNI "$SG/tls/ca.pem" "$@"; }

write_config on
"$SG/sandgate-node" --config "$RUN/sandgate.toml" >"$RUN/node.log" 2>&1 &
wait_for_line "$RUN/node.log" "sandgate-node ready" || { echo "node did not start:"; cat "$RUN/node.log"; exit 1; }
start_proxy on
# A raw TCP port: its bytes are spliced both ways. On an HTTP port every request head is read by the edge, so
# client -> sandbox is copied there (and the upload after the client's "head" would be a malformed request).
"$SG/sandgate" --api "unix:$RUN/node.sock" image import "$SG/backend-image.tar" ktls-backend >/dev/null ||
  { echo "image import failed"; cat "$RUN/node.log"; exit 1; }

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
bench() { # $1 = label
  before=$(cpu_ticks $PROXY_PID)
  out=$(client 1.3 TLS_AES_128_GCM_SHA256 "$BENCH_SIZE" "$BENCH_SIZE" 2>&1)
  after=$(cpu_ticks $PROXY_PID)
  echo "KTLS-BENCH path=$1 bytes_each_way=$BENCH_SIZE proxy_cpu_s=$(awk -v t=$((after - before)) 'BEGIN { printf "%.2f", t / 100 }') $out"
}
rss_kib() { awk '$1 == "VmRSS:" { print $2 }' "/proc/$1/status"; }
# The proxy's RSS with HOLD idle keep-alive connections held, against before them: per connection. Each run
# has a sandbox of its own, removed after it: the backend keeps a thread per connection for 30 s after its
# client left, and a second run beside a first's 1,000 got 502 from about its 560th connection on.
start_holder() { # $1 = connections, [$2 = seconds to wait for them, default 300]; sets holder, output in $RUN/hold.out
  : >"$RUN/hold.out"
  "$SG/ktls_client" $PORT 9001-idle.sandbox.localhost "$SG/tls/ca.pem" 1.3 TLS_AES_128_GCM_SHA256 0 100 hold "$1" \
    >"$RUN/hold.out" 2>&1 &
  holder=$!
  i=0
  until grep -q "^ok held\|^error" "$RUN/hold.out"; do
    i=$((i + 1))
    [ $i -gt $((${2:-300} * 10)) ] && break
    sleep 0.1
  done
}
bench_idle() { # $1 = label
  "$SG/sandgate" --api "unix:$RUN/node.sock" create --name idle --image ktls-backend --public 9001 \
    --pids-max $((HOLD + 64)) -- /ktls_backend 9001 http >/dev/null || { echo "KTLS-BENCH idle: create failed"; return; }
  # One connection first (it waits for the sandbox to answer): what the proxy allocates once is not counted.
  start_holder 1
  kill $holder
  wait $holder 2>/dev/null
  sleep 3
  before=$(rss_kib $PROXY_PID)
  start_holder "$HOLD"
  # A connection quiet for a second gives its forwarding buffers back (kReleaseIdleMemoryAfterMs), and the
  # allocator returns the pages within about a second more (dirty_decay_ms), later under TCG: RSS at +3 s and
  # +10 s; what an idle connection keeps is the second.
  sleep 3
  held_3s=$(rss_kib $PROXY_PID)
  sleep 7
  held=$(rss_kib $PROXY_PID)
  kill $holder
  wait $holder 2>/dev/null
  "$SG/sandgate" --api "unix:$RUN/node.sock" rm idle >/dev/null
  if grep -q "^ok held" "$RUN/hold.out"; then
    echo "KTLS-BENCH idle path=$1 connections=$HOLD proxy_rss_kib_before=$before held_3s=$held_3s held_10s=$held" \
      "kib_per_connection=$(awk -v b="$before" -v h="$held" -v n="$HOLD" 'BEGIN { printf "%.1f", (h - b) / n }')"
  else
    echo "KTLS-BENCH idle path=$1 connections=$HOLD not held: $(head -c 300 "$RUN/hold.out")"
  fi
}
fd_count() { ls "/proc/$1/fd" | wc -l; }
wait_for_fds() { # $1 = pid, $2 = count, $3 = seconds; prints the seconds it took, or "never"
  t=0
  while [ "$(fd_count "$1")" -gt "$2" ]; do
    t=$((t + 1))
    [ $t -gt $(($3 * 10)) ] && { echo never; return 1; }
    sleep 0.1
  done
  awk -v t=$t 'BEGIN { printf "%.1f", t / 10 }'
}
# The soak of issue 12 (SOAK=N): N idle forwarded TLS connections held, then closed, on a fresh proxy per
# path. The baseline is the proxy's descriptors when it started and its RSS once one warm-up connection came
# and went and the route cache let go of that route's spare sockets (an unused route expires within 30 s);
# after the N are closed the descriptors must come back to it (the spares of the soak's route included) and
# RSS, read at +5 s and +15 s and when the descriptors are back, must be within a quarter of what the N took
# 10 s after that.
soak() { # $1 = ktls mode
  label=ktls-splice
  [ "$1" = off ] && label=userspace
  kill $PROXY_PID
  wait $PROXY_PID
  start_proxy "$1"
  fds_start=$(fd_count $PROXY_PID)
  "$SG/sandgate" --api "unix:$RUN/node.sock" create --name idle --image ktls-backend --public 9001 --timeout 86400 \
    --memory-mb 3072 --pids-max $((SOAK + 64)) -- /ktls_backend 9001 http "$SOAK_LINGER" >/dev/null ||
    { echo "KTLS-SOAK FAIL path=$label: create failed"; failures=$((failures + 1)); return; }
  start_holder 1
  kill $holder
  wait $holder 2>/dev/null
  settled=$(wait_for_fds $PROXY_PID "$fds_start" 60)
  rss_before=$(rss_kib $PROXY_PID)
  start_holder "$SOAK" $((SOAK / 2 + 300))
  sleep 10
  fds_held=$(fd_count $PROXY_PID)
  rss_held=$(rss_kib $PROXY_PID)
  held_line=$(head -n 1 "$RUN/hold.out")
  kill $holder
  wait $holder 2>/dev/null
  sleep 5
  rss_5s=$(rss_kib $PROXY_PID)
  sleep 10
  rss_15s=$(rss_kib $PROXY_PID)
  back=$(wait_for_fds $PROXY_PID "$fds_start" 90)
  rss_back=$(rss_kib $PROXY_PID)
  sleep 10
  rss_back_10s=$(rss_kib $PROXY_PID)
  fds_after=$(fd_count $PROXY_PID)
  "$SG/sandgate" --api "unix:$RUN/node.sock" rm idle >/dev/null
  why=""
  case "$held_line" in "ok held $SOAK"*) ;; *) why="$why; not held: $(head -c 300 "$RUN/hold.out")" ;; esac
  [ "$settled" != never ] || why="$why; the warm-up's descriptors never went"
  # Two per held connection, client and sandbox side (an idle kTLS connection's splice pipe is given back),
  # plus at most the worker's 512 spare sockets.
  [ "$fds_held" -ge $((fds_start + 2 * SOAK)) ] && [ "$fds_held" -le $((fds_start + 2 * SOAK + 512)) ] ||
    why="$why; $fds_held descriptors while held"
  kill -0 $PROXY_PID 2>/dev/null && [ "$fds_after" -ge "$fds_start" ] || why="$why; the proxy is gone"
  [ "$back" != never ] || why="$why; descriptors not back to $fds_start within 90 s of the close"
  # The allocator keeps some of what the N took (its metadata, partly filled slabs): what stayed in the runs of
  # 2026-12-07 (4-13%). A quarter would be a leak of about 1 KiB per connection.
  [ $((rss_back_10s - rss_before)) -le $(((rss_held - rss_before) / 4)) ] ||
    why="$why; RSS $rss_back_10s KiB 10 s after the descriptors came back, baseline $rss_before"
  result=PASS
  [ -z "$why" ] || { result=FAIL; failures=$((failures + 1)); }
  echo "KTLS-SOAK $result path=$label connections=$SOAK $held_line fds_start=$fds_start held=$fds_held" \
    "after=$fds_after back_after_s=$back rss_kib_before=$rss_before held=$rss_held after_5s=$rss_5s" \
    "after_15s=$rss_15s at_fds_back=$rss_back fds_back_10s=$rss_back_10s$why"
}
if [ "$SOAK" -gt 0 ]; then
  for mode in on off; do soak $mode; done
  if [ $failures -eq 0 ]; then echo "KTLS-GUEST-RESULT PASS"; else echo "KTLS-GUEST-RESULT FAIL ($failures)"; fi
  exit 0
fi

"$SG/sandgate" --api "unix:$RUN/node.sock" create --name kt --image ktls-backend --public 9000/tcp -- /ktls_backend 9000 \
  >/dev/null || { echo "sandbox create failed"; cat "$RUN/node.log"; exit 1; }
i=0
until client 1.3 TLS_AES_128_GCM_SHA256 1 1 >/dev/null 2>&1; do
  i=$((i + 1))
  [ $i -gt 100 ] && { echo "backend never answered through the proxy"; tail -5 "$RUN/access.log"; tail -20 "$RUN/proxy.log"
    tail -20 "$RUN/node.log"; tail -20 "$STATE"/node/sandboxes/*/output.log; exit 1; }
  sleep 0.2
done

run_case() { # $1 version, $2 cipher, [$3 bytes each way, $4 the client's mode]
  bytes=${3:-$SIZE}
  lines=$(log_lines)
  tx=$(tls_stat TlsTxSw)
  rx=$(tls_stat TlsRxSw)
  start=$(date +%s)
  out=$(client "$1" "$2" "$bytes" "$bytes" ${4:-} 2>&1)
  rc=$?
  secs=$(($(date +%s) - start))
  entry=$(next_access_line "$lines")
  why=""
  [ $rc -eq 0 ] || why="client: $out"
  case "$entry" in *'"path":"ktls-splice"'*) ;; *) why="$why; access log path is not ktls-splice: $entry" ;; esac
  case "$entry" in *"\"bytes_in\":"*) ;; *) why="$why; no access log line" ;; esac
  [ "$(tls_stat TlsTxSw)" -gt "$tx" ] || why="$why; TlsTxSw did not rise"
  [ "$(tls_stat TlsRxSw)" -gt "$rx" ] || why="$why; TlsRxSw did not rise"
  [ "$(tls_stat TlsDecryptError)" = 0 ] || why="$why; TlsDecryptError $(tls_stat TlsDecryptError)"
  if [ -z "$why" ]; then
    echo "KTLS-CASE PASS TLS$1 $2${4:+ $4} ${secs}s: $out"
  else
    echo "KTLS-CASE FAIL TLS$1 $2${4:+ $4} ${secs}s:$why"
    failures=$((failures + 1))
  fi
}

for v in 1.2 1.3; do
  if [ $v = 1.2 ]; then
    ciphers="ECDHE-ECDSA-AES128-GCM-SHA256 ECDHE-ECDSA-AES256-GCM-SHA384 ECDHE-ECDSA-CHACHA20-POLY1305"
  else
    ciphers="TLS_AES_128_GCM_SHA256 TLS_AES_256_GCM_SHA384 TLS_CHACHA20_POLY1305_SHA256"
  fi
  for c in $ciphers; do run_case $v $c; done
done
[ "$BIG_SIZE" != "$SIZE" ] && run_case 1.3 TLS_AES_128_GCM_SHA256 "$BIG_SIZE"
# Empty application-data records from the client (after the head and halfway through the upload), which
# Linux's splice from a kTLS socket reports as 0 bytes, as at EOF: the upload must still arrive whole.
run_case 1.3 TLS_AES_128_GCM_SHA256 1048576 empty

# The SSL freed for the kernel keeps its TLS 1.2 session in the proxy's cache: resumption by session ID.
out=$(client 1.2 ECDHE-ECDSA-AES128-GCM-SHA256 65536 65536 resume 2>&1)
case "$out" in
  ok*resumed=1) echo "KTLS-CASE PASS TLS1.2 session ID resumption after the SSL was freed: $out" ;;
  *) echo "KTLS-CASE FAIL TLS1.2 session ID resumption after the SSL was freed: $out"; failures=$((failures + 1)) ;;
esac

lines=$(log_lines)
out=$(closing_client 1.3 TLS_AES_128_GCM_SHA256 4194304 0 keyupdate 2>&1)
entry=$(next_access_line "$lines")
case "$entry" in
  *'"cause":"ktls_key_update"'*) echo "KTLS-CASE PASS TLS1.3 KeyUpdate ends the connection: $out" ;;
  *) echo "KTLS-CASE FAIL TLS1.3 KeyUpdate: $out; access log: $entry"; failures=$((failures + 1)) ;;
esac

# A fatal alert from the client ends the connection as the client's doing, with the alert in the detail.
lines=$(log_lines)
out=$(closing_client 1.3 TLS_AES_128_GCM_SHA256 4194304 0 alert 2>&1)
entry=$(next_access_line "$lines")
case "$entry" in
  *'"cause":"client_closed"'*'alert'*) echo "KTLS-CASE PASS TLS1.3 fatal alert ends the connection: $out" ;;
  *) echo "KTLS-CASE FAIL TLS1.3 fatal alert: $out; access log: $entry"; failures=$((failures + 1)) ;;
esac

# An HTTP port: each request head is read by the edge, and on kTLS the response bodies splice past the
# edge's response tracker while heads and chunk framing are copied and parsed. Four pipelined requests (a
# Content-Length body, a chunked body, an Upgrade the backend refuses, a Host of another route): the bodies
# arrive intact, the requests after the refused Upgrade are still checked (421), and the 421 comes as soon
# as the backend's answers are through, not when it closes (it lingers 30 s).
"$SG/sandgate" --api "unix:$RUN/node.sock" create --name kh --image ktls-backend --public 9001 -- /ktls_backend 9001 http \
  >/dev/null || { echo "sandbox create failed"; cat "$RUN/node.log"; exit 1; }
http_client() { timeout 60 "$SG/ktls_client" $PORT 9001-kh.sandbox.localhost "$SG/tls/ca.pem" 1.3 TLS_AES_128_GCM_SHA256 0 "$@"; }
i=0
until http_client 8 pipeline 9001-nobody.sandbox.localhost >/dev/null 2>&1; do
  i=$((i + 1))
  [ $i -gt 100 ] && break
  sleep 0.2
done
lines=$(log_lines)
out=$(http_client 4194304 pipeline 9001-nobody.sandbox.localhost 2>&1)
rc=$?
entry=$(next_access_line "$lines")
why=""
[ $rc -eq 0 ] || why="client: $out"
case "$entry" in *'"path":"ktls-splice"'*'"status":421'* | *'"status":421'*'"path":"ktls-splice"'*) ;;
  *) why="$why; access log: $entry" ;; esac
if [ -z "$why" ]; then
  echo "KTLS-CASE PASS TLS1.3 HTTP pipelined responses on kTLS: $out"
else
  echo "KTLS-CASE FAIL TLS1.3 HTTP pipelined responses on kTLS:$why"
  failures=$((failures + 1))
  # The guest's logs are gone with it (tmpfs): what a hang needs to be understood goes to the console.
  echo "access log since the case:"
  sed -n "$((lines + 1)),\$p" "$RUN/access.log"
  echo "proxy log (last 40 lines):"
  tail -n 40 "$RUN/proxy.log"
  echo "kernel TLS counters:"
  cat /proc/net/tls_stat 2>/dev/null
fi

# Each path on a fresh proxy, the idle connections first: memory the cases before freed may still be resident
# (jemalloc returns it after a decay), and new connections would fill it before raising the RSS.
if [ "$BENCH" = 1 ]; then
  for mode in on off; do
    kill $PROXY_PID
    wait $PROXY_PID
    start_proxy $mode
    label=ktls-splice
    [ $mode = off ] && label=userspace
    bench_idle $label
    bench $label
  done
fi

echo "proxy log (kTLS lines):"
grep -i ktls "$RUN/proxy.log" | head -5
if [ $failures -eq 0 ]; then echo "KTLS-GUEST-RESULT PASS"; else echo "KTLS-GUEST-RESULT FAIL ($failures)"; fi
