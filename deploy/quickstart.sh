#!/usr/bin/env bash
# sandgate quickstart: from a fresh Debian 12 (as root) to a running sandgate-node + TLS proxy on loopback
# with a demo sandbox, in one command:
#
#   deploy/quickstart.sh
#
# Environment:
#   SANDGATE_STATE_DIR   config, certificates, socket and node state (default: $PWD/.state)
#   SANDGATE_LISTEN      proxy listen address (default: 127.0.0.1:8443)
#   SANDGATE_NO_BUILD=1  skip install-deps.sh and build.sh and use the existing build
#   BUILD_DIR            build directory (default: <repo>/build)
#
# Builds only what it runs (the daemons, the CLI, sandgate-init and sandgate-agent), and on the first run the
# node's `default` image (a Debian bookworm root with python3, curl and ca-certificates, made by mmdebstrap
# from the host's Debian mirror; docs/images.md), which later runs find in the node's state and skip.
#
# Stays in the foreground with both daemons' logs on the terminal. Ctrl-C (or SIGTERM) stops the proxy, then
# the node, which terminates its sandboxes on the way out (on_shutdown = "terminate"): nothing is left running.
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd) # through symlinks, too
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
LISTEN=${SANDGATE_LISTEN:-127.0.0.1:8443}
DOMAIN=sandbox.localhost
DEMO_TIMEOUT=60
# What the demo and a user expect in a sandbox: python3 (the demo's server), curl and the CA certificates; a
# shell and coreutils are Debian's essential packages, always there.
DEFAULT_PACKAGES=python3,curl,ca-certificates
# Another image store and default image (e.g. one already holding a Debian image with python3): nothing is
# built then if that image exists.
IMAGES_DIR=${SANDGATE_IMAGES_DIR:-}
DEFAULT_IMAGE=${SANDGATE_DEFAULT_IMAGE:-default}
STARTUP_SECS=30

say() { printf 'quickstart: %s\n' "$*" >&2; }
die() {
  say "error: $*"
  exit 1
}

# ---- build ----------------------------------------------------------------------------------------------
if [[ ${SANDGATE_NO_BUILD:-} != 1 ]]; then
  "$ROOT/deploy/install-deps.sh"
  # Only the targets this script runs (not the ~100 test targets); the benchmarks are not even configured.
  BUILD_TARGETS="sandgate-node sandgate-proxy sandgate sandgate-init sandgate-agent" \
    "$ROOT/deploy/build.sh" -DSANDGATE_BENCH=OFF
elif [[ $(id -u) -ne 0 ]]; then
  say "warning: not running as root; sandgate-node needs root to create sandboxes (cgroups, namespaces)"
fi
NODE_BIN=$BUILD_DIR/noderuntime/sandgate-node
PROXY_BIN=$BUILD_DIR/proxy/sandgate-proxy
CLI=$BUILD_DIR/cli/sandgate
for bin in "$NODE_BIN" "$PROXY_BIN" "$CLI"; do
  [[ -x $bin ]] || die "$bin not found; build first (deploy/build.sh) or unset SANDGATE_NO_BUILD"
done

# ---- settings -------------------------------------------------------------------------------------------
mkdir -p "${SANDGATE_STATE_DIR:-$PWD/.state}"
STATE=$(cd "${SANDGATE_STATE_DIR:-$PWD/.state}" && pwd -P)
# The config is written with TOML literal strings, which cannot contain a single quote.
[[ $STATE != *"'"* ]] || die "the state directory path must not contain a single quote: $STATE"
SOCK=$STATE/node.sock
((${#SOCK} < 108)) || die "socket path $SOCK is too long for a unix socket; use a shorter SANDGATE_STATE_DIR"
CONF=$STATE/sandgate.toml
PIDFILE=$STATE/quickstart.pids
TLS=$STATE/tls
WWW=$STATE/demo-www
# Two quickstarts side by side (different state directories) must not share a parent cgroup.
CGROUP=sandgate-qs-$(printf '%s' "$STATE" | sha256sum | cut -c1-10)

PORT=${LISTEN##*:}
HOST=${LISTEN%:*}
HOST=${HOST#[}
HOST=${HOST%]}
[[ $PORT =~ ^[0-9]+$ && $PORT -ge 1 && $PORT -le 65535 && -n $HOST ]] ||
  die "SANDGATE_LISTEN=$LISTEN: expected host:port, e.g. 127.0.0.1:8443"
# Where a local client reaches the proxy: a wildcard listen address is reached through loopback.
case $HOST in
  0.0.0.0 | localhost) PROBE_HOST=127.0.0.1 ;;
  ::) PROBE_HOST=::1 ;;
  *) PROBE_HOST=$HOST ;;
esac
DEMO_HOST=8080-demo.$DOMAIN
DEMO_URL=https://$DEMO_HOST$([[ $PORT == 443 ]] || echo ":$PORT")/
API_URL=https://api.$DOMAIN$([[ $PORT == 443 ]] || echo ":$PORT")/
# The same address as the CLI writes it (HOST:PORT, [V6]:PORT), for the ingress file below.
case $PROBE_HOST in
  *:*) INGRESS=[$PROBE_HOST]:$PORT ;;
  *) INGRESS=$PROBE_HOST:$PORT ;;
esac
# curl resolves *.localhost to 127.0.0.1/::1 by itself; only another listen address needs --resolve.
CURL_RESOLVE=()
case $PROBE_HOST in
  127.0.0.1 | ::1) ;;
  *:*) CURL_RESOLVE=(--resolve "$DEMO_HOST:$PORT:[$PROBE_HOST]") ;;
  *) CURL_RESOLVE=(--resolve "$DEMO_HOST:$PORT:$PROBE_HOST") ;;
esac

# ---- helpers --------------------------------------------------------------------------------------------
# A child that exited stays a zombie until waited for, so "kill -0" alone would call it alive.
alive() {
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $stat != Z* ]]
}
node_answers() { curl -fsS --max-time 2 --unix-socket "$SOCK" http://localhost/v1/health >/dev/null 2>&1; }
proxy_answers() { (exec 3<>"/dev/tcp/$PROBE_HOST/$PORT") 2>/dev/null; }

wait_ready() { # name pid check-command
  local name=$1 pid=$2 check=$3 i
  for ((i = 0; i < STARTUP_SECS * 5; i++)); do
    alive "$pid" || die "$name exited during startup (its log is above)"
    if "$check"; then
      say "$name is ready"
      return 0
    fi
    sleep 0.2
  done
  die "$name did not become ready within ${STARTUP_SECS}s"
}

# ---- leftovers from a previous run ----------------------------------------------------------------------
# A previous quickstart that was killed outright (SIGKILL) leaves its daemons running: they run in
# their own sessions so that Ctrl-C reaches only this script, which then stops them in order.
if [[ -f $PIDFILE ]]; then
  while read -r pid; do
    [[ $pid =~ ^[0-9]+$ ]] || continue
    # Only a process still running with this config is ours; the pid may have been reused since.
    if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "--config $CONF "; then
      say "stopping $(cat "/proc/$pid/comm" 2>/dev/null || echo "process") $pid left over from a previous run"
      kill -TERM "$pid" 2>/dev/null || true
      for ((i = 0; i < 600; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      if kill -0 "$pid" 2>/dev/null; then
        say "$pid did not stop within 60s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
  done < <(tac "$PIDFILE") # newest first: the proxy before the node
  rm -f "$PIDFILE"
fi
if [[ -e $SOCK ]]; then
  node_answers && die "a sandgate-node not started by this script already serves $SOCK; stop it first"
  say "removing stale socket $SOCK"
  rm -f "$SOCK"
fi
proxy_answers && die "something already listens on $PROBE_HOST:$PORT; stop it or set SANDGATE_LISTEN"

# ---- files ----------------------------------------------------------------------------------------------
"$ROOT/deploy/gen-cert.sh" "$TLS" "$DOMAIN"
# The operator token api.<domain> requires; kept across runs like the CA.
OPERATOR_TOKEN_FILE=$STATE/operator.token
[[ -s $OPERATOR_TOKEN_FILE ]] || (umask 077 && openssl rand -hex 32 >"$OPERATOR_TOKEN_FILE")
mkdir -p "$WWW"
# The node keeps sandbox state and tokens here and tightens only directories it creates itself.
mkdir -p -m 0700 "$STATE/node"
cat >"$WWW/index.html" <<'HTML'
<!doctype html>
<title>sandgate demo</title>
<h1>hello from the demo sandbox</h1>
<p>Served by <code>python3 -m http.server</code> inside a sandgate sandbox.</p>
HTML
# Regenerated on every run so it always matches this script; see deploy/sandgate.example.toml for all keys.
# No proxy.user: the proxy keeps the privileges it was started with. Everything here lives in the state
# directory under the caller's working directory (often in /root, mode 0700), which a system user could not
# even reach, and the files belong to the caller. deploy/install.sh is where the proxy drops root.
cat >"$CONF" <<TOML
# Written by deploy/quickstart.sh (overwritten on every run).
domain = "$DOMAIN"
node_socket = 'unix:$SOCK'
log_level = "info"
operator_token_file = '$OPERATOR_TOKEN_FILE'

[proxy]
listen = '$LISTEN'
access_log = "-"

[[proxy.certificates]]
cert = '$TLS/server.pem'
key = '$TLS/server.key'

[node]
state_dir = '$STATE/node'
# Ctrl-C must not leave sandboxes behind.
on_shutdown = "terminate"
cgroup_name = "$CGROUP"
default_timeout_secs = $DEMO_TIMEOUT
default_image = "$DEFAULT_IMAGE"
${IMAGES_DIR:+images_dir = '$IMAGES_DIR'}
TOML

# Next to the node socket, where the CLI looks once SANDGATE_API names that socket: `sandgate ssh-config` and
# `ssh-proxy` take the ingress address, its CA and the domain from here (SANDGATE_INGRESS or flags override).
cat >"$STATE/ingress" <<INGRESS
# Written by deploy/quickstart.sh (overwritten on every run): where this node's sandgate-proxy listens.
ingress=$INGRESS
cacert=$TLS/ca.pem
domain=$DOMAIN
INGRESS

# ---- run ------------------------------------------------------------------------------------------------
NODE_PID=
PROXY_PID=
STOPPING=
FAILED=

# shellcheck disable=SC2317,SC2034 # (only called from the traps, which read FAILED)
stop_child() { # pid name seconds
  local pid=$1 name=$2 secs=$3 i status
  [[ -n $pid ]] || return 0
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < secs * 10; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      say "$name did not stop within ${secs}s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      FAILED=1
    fi
  fi
  status=0
  wait "$pid" 2>/dev/null || status=$?
  if ((status != 0)); then
    say "$name exited with status $status"
    FAILED=1
  fi
}

# shellcheck disable=SC2317 # (only called from the traps)
shutdown() {
  [[ -z $STOPPING ]] || return 0
  STOPPING=1
  # A second Ctrl-C must not abandon the node halfway through terminating its sandboxes.
  trap 'say "still stopping: sandgate-node is terminating its sandboxes"' INT TERM HUP
  if [[ -n $PROXY_PID || -n $NODE_PID ]]; then
    say "stopping sandgate-proxy and sandgate-node"
  fi
  # The proxy first, so no request wakes a sandbox while the node is tearing them down.
  stop_child "$PROXY_PID" sandgate-proxy 15
  stop_child "$NODE_PID" sandgate-node 60
  rm -f "$PIDFILE"
  [[ -n $NODE_PID ]] && say "stopped"
  return 0
}
trap 'shutdown; exit $((FAILED ? 1 : 0))' INT TERM HUP
trap 'status=$?; shutdown; exit $((status ? status : FAILED ? 1 : 0))' EXIT

say "starting sandgate-node (config $CONF)"
# setsid: the daemons get no terminal signals; this script stops them in order when Ctrl-C reaches it.
setsid "$NODE_BIN" --config "$CONF" &
NODE_PID=$!
echo "$NODE_PID" >>"$PIDFILE"
wait_ready sandgate-node "$NODE_PID" node_answers

say "starting sandgate-proxy on $LISTEN"
setsid "$PROXY_BIN" --config "$CONF" &
PROXY_PID=$!
echo "$PROXY_PID" >>"$PIDFILE"
wait_ready sandgate-proxy "$PROXY_PID" proxy_answers

export SANDGATE_API=unix:$SOCK
# The image sandboxes start from when they name none: built once (a minute or two, its progress shown), then
# kept in the node's state dir, so a later run finds it and goes straight on.
if curl -fsS --max-time 5 --unix-socket "$SOCK" "http://localhost/v1/images/$DEFAULT_IMAGE" >/dev/null 2>&1; then
  say "image $DEFAULT_IMAGE exists; not rebuilding it (sandgate image rm $DEFAULT_IMAGE to rebuild)"
else
  say "building the $DEFAULT_IMAGE image (first run only): Debian bookworm + $DEFAULT_PACKAGES"
  "$CLI" image build "$DEFAULT_IMAGE" --packages "$DEFAULT_PACKAGES" ||
    die "building the $DEFAULT_IMAGE image failed (see above)"
fi
# A demo kept in the node's state by an earlier run that did not shut down cleanly would make create fail.
"$CLI" rm demo >/dev/null 2>&1 || true
say "creating the demo sandbox"
# The sandbox sees its own root filesystem only, so the page goes in through its environment.
"$CLI" create --name demo --timeout "$DEMO_TIMEOUT" --public 8080 --env "DEMO_PAGE=$(cat "$WWW/index.html")" -- \
  sh -c 'mkdir -p /srv/demo && printf "%s\n" "$DEMO_PAGE" >/srv/demo/index.html && cd /srv/demo &&
    exec python3 -m http.server 8080'

# The server inside needs a moment to bind 8080; until then the proxy cannot connect.
answer=
for ((i = 0; i < 50; i++)); do
  if answer=$(curl -fsS --max-time 5 "${CURL_RESOLVE[@]}" --cacert "$TLS/ca.pem" "$DEMO_URL" 2>/dev/null); then
    break
  fi
  answer=
  sleep 0.2
done
if [[ $answer == *"hello from the demo sandbox"* ]]; then
  say "the demo answers over TLS at $DEMO_URL"
else
  say "warning: $DEMO_URL did not answer yet; check the logs above"
fi

cat <<EOF

  sandgate is running: node API unix:$SOCK, TLS proxy $LISTEN, domain *.$DOMAIN.

  CA certificate (trust it, or pass it to curl):  $TLS/ca.pem

  Try, in another terminal:
    export SANDGATE_API=unix:$SOCK
    curl --cacert $TLS/ca.pem ${CURL_RESOLVE[*]:+${CURL_RESOLVE[*]} }$DEMO_URL
    $CLI ls
    $CLI get demo
    # the node API through the ingress, with the operator token:
    curl --cacert $TLS/ca.pem -H "Authorization: Bearer \$(cat $OPERATOR_TOKEN_FILE)" ${API_URL}v1/sandboxes
    # ssh to a sandbox NAME running sshd on an --expose'd 22/tcp (the ingress $INGRESS and its CA come from
    # $STATE/ingress):
    $CLI ssh-config NAME >> ~/.ssh/config   # then: ssh NAME

  The demo sandbox suspends after ${DEMO_TIMEOUT} s without traffic (watch the state in 'sandgate ls') and
  wakes up on the next request: run the curl again.

  Press Ctrl-C to stop; the node terminates its sandboxes on the way out.

EOF

# Returns when either daemon exits (a crash), or is interrupted by Ctrl-C / SIGTERM, whose trap shuts down.
status=0
wait -n "$NODE_PID" "$PROXY_PID" || status=$?
say "a daemon exited unexpectedly (status $status); shutting down"
exit 1
