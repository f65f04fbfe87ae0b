#!/usr/bin/env bash
# Installs everything building, running and testing sandgate needs on Debian 12, as root.
# Idempotent and fast on reruns: when every package is already installed, apt is not touched at all.
set -euo pipefail

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config
  # libraries (see the find_package/pkg_check_modules calls in CMakeLists.txt)
  libssl-dev libuv1-dev node-llhttp libnghttp2-dev libjemalloc-dev nlohmann-json3-dev libtomlplusplus-dev
  libcli11-dev libspdlog-dev libfmt-dev libsqlite3-dev
  libarchive-dev  # image import: docker-save / OCI archives and their (gzip, zstd) layers
  libsimdjson-dev  # the node reads the proxies' activity reports (every worker, every second) with it
  libsystemd-dev  # sd_notify: both daemons tell systemd when they are ready, reloading or stopping
  libssh-dev zlib1g-dev  # the agent's SSH server (static libssh.a + libz.a), the node's key checks (docs/ssh.md)
  # tests and benchmarks
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  clang  # the sanitizer + fuzz tree (tests/run.sh): libFuzzer (-fsanitize=fuzzer), which gcc lacks
  libyaml-cpp-dev  # the Firecracker / Cloud Hypervisor contract tests read the hypervisors' YAML specs
  # runtime tools and the clients the tests and the quickstart use
  openssl ca-certificates curl python3 procps iproute2
  openssh-client openssh-server  # ssh/scp/sftp through the ingress to the agent's SSH server or an sshd in a sandbox
  rsync                          # tests only: rsync over ssh into a sandbox (the test image has it too)
  nghttp2-client                 # h2load and nghttp: HTTP/2 through the ingress
  python3-websockets             # a real WebSocket echo server/client for the WebSocket tests
  python3-pip python3-setuptools python3-venv  # the SDK suite pip-installs sdk/python into a venv, offline
  python3-pandas python3-matplotlib  # tests only: run_code's DataFrame (text/html) and plot (image/png) outputs
  python3-yaml                   # tests only: deploy/kubernetes's manifests checked without a cluster
  qemu-system-x86 busybox-static # the QEMU driver and the kTLS guest test (guest images from Debian packages)
  # the sandbox boundary and images (issue 10)
  mmdebstrap                     # image build: Debian root filesystems from Debian packages
  libseccomp-dev                 # the process sandbox's syscall filter (sandgate-init)
  uidmap                         # newuidmap/newgidmap: mmdebstrap's unshare mode
  qemu-utils                     # qemu-img: per-sandbox qcow2 overlays on an image's base disk
  nftables                       # egress filtering and NAT for sandboxes with internet access
  wrk                            # the reload and takeover tests keep HTTP load on the proxy with it
  prometheus                     # promtool: the tests check both daemons' /metrics with `promtool check metrics`
  testssl.sh                     # the TLS scanner the tests and bench/testssl.py run against the ingress
  etcd-server etcd-client        # the fleet's shared state (issue 13): the tests and deploy/fleet-demo.sh run their own members
)

log() { echo "install-deps: $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
  log "must run as root (it installs Debian packages)"
  exit 1
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  [[ $status == installed ]] || missing+=("$pkg")
done
if ((${#missing[@]} == 0)); then
  log "all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
aptlog=$(mktemp)
trap 'rm -f "$aptlog"' EXIT

# apt writes progress to stdout (kept in $aptlog, shown only on failure) and errors to stderr (always shown).
run_apt() {
  if ! apt-get -q -o Dpkg::Use-Pty=0 "$@" >"$aptlog"; then
    tail -n 40 "$aptlog" >&2
    log "apt-get $1 failed"
    exit 1
  fi
}

# Refresh the package lists only when they are missing, older than a day, or do not know a wanted package:
# an update costs seconds to minutes, and stale lists make downloads 404 after a point release.
needs_update() {
  if [[ -z $(find /var/lib/apt/lists -maxdepth 1 -type f -name '*_Packages*' -mmin -1440 -print -quit 2>/dev/null) ]]; then
    return 0
  fi
  local pkg candidate
  for pkg in "${missing[@]}"; do
    candidate=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')
    [[ -n $candidate && $candidate != "(none)" ]] || return 0
  done
  return 1
}

if needs_update; then
  log "updating package lists"
  run_apt update
fi
log "installing ${#missing[@]} package(s): ${missing[*]}"
# No service a package brings (prometheus, etcd, sshd) is started by installing it: sandgate needs their programs,
# not their daemons. A policy-rc.d the machine already has is left alone.
own_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  own_policy=1
  trap 'rm -f "$aptlog"; rm -f /usr/sbin/policy-rc.d' EXIT
fi
run_apt install -y --no-install-recommends "${missing[@]}"
((own_policy == 0)) || rm -f /usr/sbin/policy-rc.d
# Only promtool is wanted from prometheus: its server is not enabled at boot by this install either. Nor is
# etcd-server's own single-member etcd: a fleet configures its members (docs/fleet.md), tests start theirs.
if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null; then
  systemctl disable --quiet prometheus.service 2>/dev/null || true
fi
if [[ " ${missing[*]} " == *" etcd-server "* ]] && command -v systemctl >/dev/null; then
  systemctl disable --quiet etcd.service 2>/dev/null || true
fi
log "done"
