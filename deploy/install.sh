#!/usr/bin/env bash
# Installs a built sandgate as systemd services, as root:
#   binaries      -> $PREFIX/bin (default /usr/local/bin): sandgate-node, sandgate-init, sandgate-agent,
#                    sandgate-proxy, sandgate
#   scripts       -> $PREFIX/share/sandgate: build-guest-image.sh (the node builds the QEMU guest image with it)
#   units         -> /etc/systemd/system/sandgate-{node,proxy}.service
#   configuration -> /etc/sandgate/sandgate.toml, from deploy/sandgate.example.toml, only if absent, with
#                    proxy.user and node.socket_group set to the system user and group below
#   system user   -> sandgate (group sandgate, no home, no shell): sandgate-proxy drops root to it once its
#                    ports are bound (proxy.user); the node's socket is served to its group (node.socket_group)
#   file access   -> the private keys (key, fleet_key) and the operator token file the config names become readable by that
#                    user (keys: root:sandgate 0640; token: sandgate:sandgate 0600), so a SIGHUP still works
# Build first (deploy/build.sh; BUILD_DIR as there). Rerunning upgrades binaries and units, never the config, and
# applies the file access again (run it after adding certificates or the token file).
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

# The unprivileged identity of sandgate-proxy (docs/security.md#least-privilege). Idempotent: an existing user
# or group is kept as it is.
PROXY_USER=sandgate
if ! getent group "$PROXY_USER" >/dev/null; then
  groupadd --system "$PROXY_USER"
  say "created system group $PROXY_USER"
fi
if ! getent passwd "$PROXY_USER" >/dev/null; then
  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin --gid "$PROXY_USER" \
    --comment "sandgate TLS ingress" "$PROXY_USER"
  say "created system user $PROXY_USER"
fi

install -d -m 0755 "$CONF_DIR"
CONF=$CONF_DIR/sandgate.toml
if [[ -e $CONF ]]; then
  say "keeping existing $CONF"
  # An upgrade from a version without least privilege: say what to add, but never edit the operator's file.
  if ! grep -Eq '^[[:space:]]*user[[:space:]]*=[[:space:]]*"[^"]+"' "$CONF"; then
    say "note: $CONF does not set proxy.user, so sandgate-proxy keeps running as root; to drop root, add"
    say "      user = \"$PROXY_USER\" to [proxy] and socket_group = \"$PROXY_USER\" to [node], then restart both"
  fi
else
  sed -e "s/^user = \"\"\$/user = \"$PROXY_USER\"/" -e "s/^socket_group = \"\"\$/socket_group = \"$PROXY_USER\"/" \
    "$ROOT/deploy/sandgate.example.toml" >"$CONF.tmp"
  # Both substitutions must have happened: a proxy dropping root without the socket group cannot reach the node.
  [[ $(grep -Ec "^(user|socket_group) = \"$PROXY_USER\"\$" "$CONF.tmp") -eq 2 ]] ||
    die "deploy/sandgate.example.toml no longer has the lines user = \"\" and socket_group = \"\""
  chmod 0644 "$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
  say "installed $CONF (the documented defaults with proxy.user = \"$PROXY_USER\": edit domain, listen and certificates)"
fi

# The files the proxy re-reads on SIGHUP as proxy.user, named in the config as key = "..." and
# operator_token_file = "..." (basic strings; relative paths are relative to the config's directory).
config_values() { # key
  sed -n -E "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*\"([^\"]*)\".*/\1/p" "$CONF"
}
config_paths() { # key
  config_values "$1" | while read -r path; do
    [[ -z $path ]] && continue
    if [[ $path == /* ]]; then echo "$path"; else echo "$CONF_DIR/$path"; fi
  done
}
proxy_user=$(config_values user | head -n1)
proxy_group=$(config_values group | head -n1)
if [[ -n $proxy_user ]] && getent passwd "$proxy_user" >/dev/null; then
  [[ -n $proxy_group ]] || proxy_group=$(id -gn "$proxy_user")
  while read -r key; do
    [[ -f $key ]] || continue
    # Only files of sandgate's own directory change hands: a key elsewhere (/etc/ssl/private, say) may be
    # shared with other services, so its owner decides; the note says how.
    if [[ $(readlink -f "$key") != "$CONF_DIR"/* ]]; then
      say "note: proxy.user $proxy_user must be able to read $key (e.g. usermod -aG <its group> $proxy_user)"
      continue
    fi
    # Group-readable, not owned: the key stays root's, and the proxy's group is its only other reader.
    chown "root:$proxy_group" "$key"
    chmod 0640 "$key"
    say "$key: root:$proxy_group 0640 (readable by proxy.user $proxy_user)"
  done < <(config_paths key; config_paths fleet_key)
  while read -r token; do
    [[ -f $token ]] || continue
    if [[ $(readlink -f "$token") != "$CONF_DIR"/* ]]; then
      say "note: proxy.user $proxy_user must own $token (mode 0600; the node, as root, reads it anyway)"
      continue
    fi
    # Owner-only is the one mode node and proxy accept, so the proxy's user owns it; the node is root.
    chown "$proxy_user:$proxy_group" "$token"
    chmod 0600 "$token"
    say "$token: $proxy_user:$proxy_group 0600 (readable by proxy.user $proxy_user and by the node)"
  done < <(config_paths operator_token_file)
fi

if [[ -d /run/systemd/system ]]; then
  systemctl daemon-reload
else
  say "systemd is not running here; the units take effect on a systemd host"
fi

cat >&2 <<EOT

Next steps:
  1. Edit $CONF_DIR/sandgate.toml: domain, proxy.listen, [[proxy.certificates]], operator_token_file.
     A local CA and a *.DOMAIN certificate for testing: $ROOT/deploy/gen-cert.sh $CONF_DIR/tls DOMAIN
     An operator token: (umask 077 && openssl rand -hex 32 >$CONF_DIR/operator.token)
  2. Rerun $0: it makes the keys and the token file the config names readable by the proxy's user.
  3. systemctl enable --now sandgate-node sandgate-proxy
  4. sandgate ls
After an upgrade: systemctl restart sandgate-proxy sandgate-node (sandboxes survive a node restart).
EOT
