#!/usr/bin/env bash
# Installs a built sandgate as systemd services, as root:
#   binaries      -> $PREFIX/bin (default /usr/local/bin): sandgate-node, sandgate-init, sandgate-agent,
#                    sandgate-proxy, sandgate
#   scripts       -> $PREFIX/share/sandgate: build-guest-image.sh (the node builds the QEMU guest image with it)
#   units         -> /etc/systemd/system/sandgate-{node,proxy}.service
#   configuration -> /etc/sandgate/sandgate.toml, from deploy/sandgate.example.toml, only if absent
# Build first (deploy/build.sh; BUILD_DIR as there). Rerunning upgrades binaries and units, never the config.
# Does not start anything: that is left to `systemctl enable --now` once the config and certificates are in place.
set -euo pipefail

ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd) # through symlinks, too
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
PREFIX=${PREFIX:-/usr/local}
CONF_DIR=/etc/sandgate
UNIT_DIR=/etc/systemd/system

say() { echo "install: $*" >&2; }
die() {
  say "error: $*"
  exit 1
}

[[ $(id -u) -eq 0 ]] || die "must run as root"

# sandgate-init and sandgate-agent go next to sandgate-node: that is where the node looks for them
# (node.init_path = "", node.agent_path = "").
BINARIES=(noderuntime/sandgate-node noderuntime/sandgate-init agent/sandgate-agent proxy/sandgate-proxy cli/sandgate)
for bin in "${BINARIES[@]}"; do
  [[ -x $BUILD_DIR/$bin ]] || die "$BUILD_DIR/$bin not found; run deploy/build.sh first"
done

install -d -m 0755 "$PREFIX/bin"
for bin in "${BINARIES[@]}"; do
  # install(1) replaces the file instead of writing into it, so running daemons keep their old binary.
  install -m 0755 "$BUILD_DIR/$bin" "$PREFIX/bin/"
  say "installed $PREFIX/bin/$(basename "$bin")"
done

# Where the node looks for it (node.guest_image_builder = ""): <bin>/../share/sandgate.
install -D -m 0755 "$ROOT/deploy/build-guest-image.sh" "$PREFIX/share/sandgate/build-guest-image.sh"
say "installed $PREFIX/share/sandgate/build-guest-image.sh"

for unit in sandgate-node.service sandgate-proxy.service; do
  sed "s|/usr/local/bin/|$PREFIX/bin/|g" "$ROOT/deploy/systemd/$unit" >"$UNIT_DIR/$unit.tmp"
  chmod 0644 "$UNIT_DIR/$unit.tmp"
  mv "$UNIT_DIR/$unit.tmp" "$UNIT_DIR/$unit"
  say "installed $UNIT_DIR/$unit"
done

install -d -m 0755 "$CONF_DIR"
if [[ -e $CONF_DIR/sandgate.toml ]]; then
  say "keeping existing $CONF_DIR/sandgate.toml"
else
  install -m 0644 "$ROOT/deploy/sandgate.example.toml" "$CONF_DIR/sandgate.toml"
  say "installed $CONF_DIR/sandgate.toml (the documented defaults: edit domain, listen and certificates)"
fi

if [[ -d /run/systemd/system ]]; then
  systemctl daemon-reload
else
  say "systemd is not running here; the units take effect on a systemd host"
fi

cat >&2 <<EOT

Next steps:
  1. Edit $CONF_DIR/sandgate.toml: domain, proxy.listen, [[proxy.certificates]].
     A local CA and a *.DOMAIN certificate for testing: $ROOT/deploy/gen-cert.sh $CONF_DIR/tls DOMAIN
  2. systemctl enable --now sandgate-node sandgate-proxy
  3. sandgate ls
After an upgrade: systemctl restart sandgate-proxy sandgate-node (sandboxes survive a node restart).
EOT
