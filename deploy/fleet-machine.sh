#!/usr/bin/env bash
# One machine of a fleet (docs/fleet.md#on-three-machines): writes what this machine needs to be an etcd
# member and a sandgate node + proxy of the fleet, for the systemd units Debian's etcd-server and
# deploy/install.sh put in place. Run it on each machine, as root, after deploy/install.sh:
#
#   deploy/fleet-machine.sh NAME IP MEMBERS
#     NAME     this machine's node name (and etcd member name): a lowercase DNS label, e.g. node1
#     IP       its address on the fleet's private network (numeric)
#     MEMBERS  every machine of the fleet as NAME=IP, comma-separated, the same on each machine:
#              node1=10.0.0.1,node2=10.0.0.2,node3=10.0.0.3
#              Each is an etcd member too. "-": this machine runs no etcd member, and ETCD_ENDPOINTS says
#              where the fleet's etcd is (more nodes than etcd members; the Kubernetes packaging)
#
# Environment (defaults in brackets):
#   DOMAIN [sandbox.localhost]   the wildcard domain the proxies serve
#   FLEET_CA_DIR                 deploy/gen-fleet-ca.sh's directory: fleet-ca.pem and NAME.pem/NAME.key are
#                                installed for the proxies' mutual-TLS hop (required)
#   OPERATOR_TOKEN_FILE          the fleet's operator token, the same file on every machine (placement sends
#                                creates between nodes with it); unset: one is made here if there is none,
#                                to copy to the other machines before running this there
#   TLS_CERT, TLS_KEY            the ingress certificate [/etc/sandgate/tls/server.pem, server.key]
#   INGRESS_LISTEN [0.0.0.0:443] the client listener
#   PUBLIC_PORT [0]              proxy.public_port: the port in URLs when clients come through another (a
#                                load balancer's 443 in front of 8443); 0 = the listener's
#   ETCD_CLIENT_PORT [2379] ETCD_PEER_PORT [2380] FLEET_PORT [9443] API_PORT [9444]
#   ETCD_TLS [1]                 etcd speaks TLS to its clients and its peers, and requires their certificates
#                                from the fleet CA: the member serves with NAME.pem, which must name IP
#                                (deploy/gen-fleet-ca.sh DIR NAME=IP ...), and node and proxy present it too.
#                                0: clear text (a private network you trust, firewalled as below)
#   ETCD_ENDPOINTS               with MEMBERS "-": the etcd members, comma-separated http(s)://IP:PORT (https:
#                                their certificates verified against the fleet CA, NAME.pem presented)
#   ETCD_SERVER_NAME             with https ETCD_ENDPOINTS: the name the members' certificates are checked
#                                against instead of the dialled address (fleet.etcd_server_name: a Service's
#                                address in front of them, which no certificate can name in advance)
#   CGROUP_NAME [sandgate]       node.cgroup_name
#   NODE_EXTRA                   TOML lines added to [node] (image store, limits, ...)
#   ROOT [/]                     where the files go; with another ROOT every path written into them is under
#                                it too, so the fleet can be tried on one machine (the e2e test does)
#
# Writes (under ROOT):
#   etc/default/etcd                         read by Debian's etcd.service: this member of a NAME=IP cluster
#   etc/sandgate/sandgate.toml               node + proxy in the fleet (an existing file is kept as .bak)
#   etc/sandgate/fleet/                      the fleet CA and this node's certificate and key (with ETCD_TLS,
#                                            etcd's copy in etc/sandgate/fleet/etcd/, owned by its user)
#   etc/sandgate/operator.token              unless OPERATOR_TOKEN_FILE is that file already
#   etc/systemd/system/sandgate-node.service.d/fleet.conf   the node starts after the local etcd member
# (with MEMBERS "-", neither etcd file)
# Starts nothing: it prints the systemctl line.
#
# etcd's ports, the node API (API_PORT) and the fleet listener are for the fleet's machines only: the node API
# speaks plain HTTP (with the operator token), and so does etcd with ETCD_TLS=0, so keep them on the private
# network and firewall them to the members' addresses (docs/fleet.md#on-three-machines has an nftables example).
set -euo pipefail

SRC=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)
say() { echo "fleet-machine: $*" >&2; }
die() {
  say "error: $*"
  exit 1
}

[[ $# -eq 3 ]] || die "usage: $0 NAME IP MEMBERS (see the comment at the top of $0)"
NAME=$1 IP=$2 MEMBERS=$3
ROOT=${ROOT:-/}
ROOT=${ROOT%/}
DOMAIN=${DOMAIN:-sandbox.localhost}
ETCD_CLIENT_PORT=${ETCD_CLIENT_PORT:-2379}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-2380}
FLEET_PORT=${FLEET_PORT:-9443}
ETCD_TLS=${ETCD_TLS:-1}
API_PORT=${API_PORT:-9444}
INGRESS_LISTEN=${INGRESS_LISTEN:-0.0.0.0:443}
CGROUP_NAME=${CGROUP_NAME:-sandgate}
CONF_DIR=$ROOT/etc/sandgate
TLS_CERT=${TLS_CERT:-$CONF_DIR/tls/server.pem}
TLS_KEY=${TLS_KEY:-$CONF_DIR/tls/server.key}
[[ -n ${FLEET_CA_DIR:-} ]] || die "FLEET_CA_DIR is not set (deploy/gen-fleet-ca.sh DIR $NAME ... makes it)"

label='^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$'
ipv4='^([0-9]{1,3}\.){3}[0-9]{1,3}$'
[[ $NAME =~ $label ]] || die "NAME '$NAME' is not a node name (lowercase letters, digits, '-', at most 63)"
[[ $IP =~ $ipv4 ]] || die "IP '$IP' is not a numeric IPv4 address (etcd endpoints are numeric)"
[[ $ETCD_TLS == 0 || $ETCD_TLS == 1 ]] || die "ETCD_TLS must be 0 or 1, not '$ETCD_TLS'"
scheme=http
[[ $ETCD_TLS == 1 ]] && scheme=https
for port in "$ETCD_CLIENT_PORT" "$ETCD_PEER_PORT" "$FLEET_PORT" "$API_PORT"; do
  [[ $port =~ ^[0-9]+$ && $port -ge 1 && $port -le 65535 ]] || die "'$port' is not a port"
done

# The members, checked, as etcd's initial cluster and as sandgate's endpoint list.
initial_cluster="" endpoints="" self_listed=""
if [[ $MEMBERS == - ]]; then
  [[ -n ${ETCD_ENDPOINTS:-} ]] || die "MEMBERS is \"-\" (no etcd member here): ETCD_ENDPOINTS must say where etcd is"
  IFS=, read -r -a urls <<<"$ETCD_ENDPOINTS"
  scheme=
  for url in "${urls[@]}"; do
    [[ $url =~ ^(https?)://([0-9]{1,3}\.){3}[0-9]{1,3}:[0-9]+$ ]] || die "ETCD_ENDPOINTS: '$url' is not http(s)://IP:PORT"
    [[ -z $scheme || $scheme == "${BASH_REMATCH[1]}" ]] || die "ETCD_ENDPOINTS: all http:// or all https://, not both"
    scheme=${BASH_REMATCH[1]}
    endpoints+="${endpoints:+, }\"$url\""
  done
  members=()
else
  [[ -z ${ETCD_ENDPOINTS:-} ]] || die "ETCD_ENDPOINTS is for MEMBERS \"-\": here the members are the etcd cluster"
  IFS=, read -r -a members <<<"$MEMBERS"
fi
[[ $MEMBERS == - || ${#members[@]} -ge 1 ]] || die "MEMBERS is empty"
declare -A seen_names=() seen_ips=()
for member in "${members[@]+"${members[@]}"}"; do
  [[ $member == *=* ]] || die "member '$member' is not NAME=IP"
  m_name=${member%%=*} m_ip=${member#*=}
  [[ $m_name =~ $label ]] || die "member '$member': '$m_name' is not a node name"
  [[ $m_ip =~ $ipv4 ]] || die "member '$member': '$m_ip' is not a numeric IPv4 address"
  [[ -z ${seen_names[$m_name]:-} ]] || die "member name '$m_name' is listed twice"
  [[ -z ${seen_ips[$m_ip]:-} ]] || die "member address '$m_ip' is listed twice"
  seen_names[$m_name]=1 seen_ips[$m_ip]=1
  initial_cluster+="${initial_cluster:+,}$m_name=$scheme://$m_ip:$ETCD_PEER_PORT"
  endpoints+="${endpoints:+, }\"$scheme://$m_ip:$ETCD_CLIENT_PORT\""
  [[ $m_name == "$NAME" ]] && { [[ $m_ip == "$IP" ]] || die "MEMBERS says $NAME is $m_ip, not $IP"; self_listed=1; }
done
[[ $MEMBERS == - || -n $self_listed ]] || die "MEMBERS does not list $NAME=$IP"
[[ $MEMBERS == - ]] || (( ${#members[@]} % 2 == 1 )) || say "note: ${#members[@]} etcd members tolerate no more failures than $(( ${#members[@]} - 1 )); an odd count is the usual choice"

for f in fleet-ca.pem "$NAME.pem" "$NAME.key"; do
  [[ -f $FLEET_CA_DIR/$f ]] || die "$FLEET_CA_DIR/$f not found (deploy/gen-fleet-ca.sh $FLEET_CA_DIR $NAME=$IP)"
done
# etcd's clients check that the member's certificate names the address they dialled.
if [[ $MEMBERS != - && $scheme == https ]] &&
   ! openssl x509 -in "$FLEET_CA_DIR/$NAME.pem" -noout -ext subjectAltName 2>/dev/null | grep -qw "IP Address:$IP"; then
  die "$FLEET_CA_DIR/$NAME.pem does not name $IP, which etcd's clients check: remove $NAME.pem and $NAME.key and run deploy/gen-fleet-ca.sh $FLEET_CA_DIR $NAME=$IP (or ETCD_TLS=0 for clear text)"
fi

# Written whole or not at all: a file is replaced only once its new content is complete.
put() { # PATH MODE < content
  local path=$1 mode=$2
  install -d -m 0755 "$(dirname "$path")"
  cat >"$path.tmp"
  chmod "$mode" "$path.tmp"
  mv "$path.tmp" "$path"
  say "wrote $path"
}

# etcd: Debian's etcd.service reads /etc/default/etcd (EnvironmentFile=-/etc/default/%p) and runs as user etcd,
# which owns /var/lib/etcd. A machine that already is a member (its data dir exists) keeps its cluster state.
etcd_data=$ROOT/var/lib/etcd/sandgate
state=new
[[ -d $etcd_data/member ]] && state=existing
# A member's peer URLs are part of the cluster's state: a cluster that exists keeps its scheme.
if [[ $state == existing && $MEMBERS != - ]] &&
   ! grep -q "^ETCD_LISTEN_PEER_URLS=$scheme://" "$ROOT/etc/default/etcd" 2>/dev/null; then
  die "this member's etcd cluster exists and does not speak $scheme: keep it with ETCD_TLS=$([[ $scheme == https ]] && echo 0 || echo 1), or move it member by member (etcdctl member update with the new peer URLs) first"
fi
CONF_FLEET=$CONF_DIR/fleet
# etcd runs as the package's user: its copy of the key is that user's (root's elsewhere, e.g. a test's ROOT).
etcd_tls_lines=""
if [[ $MEMBERS != - && $scheme == https ]]; then
  etcd_owner=root
  getent passwd etcd >/dev/null && etcd_owner=etcd
  install -d -m 0750 -o "$etcd_owner" "$CONF_FLEET/etcd"
  install -m 0644 "$FLEET_CA_DIR/fleet-ca.pem" "$CONF_FLEET/etcd/ca.pem"
  install -m 0644 "$FLEET_CA_DIR/$NAME.pem" "$CONF_FLEET/etcd/member.pem"
  install -m 0600 -o "$etcd_owner" "$FLEET_CA_DIR/$NAME.key" "$CONF_FLEET/etcd/member.key"
  say "installed etcd's certificate and key in $CONF_FLEET/etcd (owner $etcd_owner)"
  # Clients (sandgate's node and proxy) and peers (the other members) need a certificate from the fleet CA.
  etcd_tls_lines="ETCD_CERT_FILE=$CONF_FLEET/etcd/member.pem
ETCD_KEY_FILE=$CONF_FLEET/etcd/member.key
ETCD_TRUSTED_CA_FILE=$CONF_FLEET/etcd/ca.pem
ETCD_CLIENT_CERT_AUTH=true
ETCD_PEER_CERT_FILE=$CONF_FLEET/etcd/member.pem
ETCD_PEER_KEY_FILE=$CONF_FLEET/etcd/member.key
ETCD_PEER_TRUSTED_CA_FILE=$CONF_FLEET/etcd/ca.pem
ETCD_PEER_CLIENT_CERT_AUTH=true"
fi
[[ $MEMBERS == - ]] || put "$ROOT/etc/default/etcd" 0644 <<EOF
# Written by sandgate's deploy/fleet-machine.sh: member $NAME of the fleet's etcd cluster.
ETCD_NAME=$NAME
ETCD_DATA_DIR=$etcd_data
ETCD_LISTEN_CLIENT_URLS=$scheme://$IP:$ETCD_CLIENT_PORT
ETCD_ADVERTISE_CLIENT_URLS=$scheme://$IP:$ETCD_CLIENT_PORT
ETCD_LISTEN_PEER_URLS=$scheme://$IP:$ETCD_PEER_PORT
ETCD_INITIAL_ADVERTISE_PEER_URLS=$scheme://$IP:$ETCD_PEER_PORT
ETCD_INITIAL_CLUSTER=$initial_cluster
ETCD_INITIAL_CLUSTER_STATE=$state
ETCD_INITIAL_CLUSTER_TOKEN=sandgate-fleet
# Revisions older than an hour go: every state change is a new revision, and without compaction the
# database grows to etcd's quota and then refuses every write (bench/RESULTS.md, etcd load).
ETCD_AUTO_COMPACTION_MODE=periodic
ETCD_AUTO_COMPACTION_RETENTION=1h
$etcd_tls_lines
EOF

install -d -m 0755 "$CONF_DIR/fleet"
install -m 0644 "$FLEET_CA_DIR/fleet-ca.pem" "$CONF_DIR/fleet/fleet-ca.pem"
install -m 0644 "$FLEET_CA_DIR/$NAME.pem" "$CONF_DIR/fleet/$NAME.pem"
install -m 0600 "$FLEET_CA_DIR/$NAME.key" "$CONF_DIR/fleet/$NAME.key"
say "installed the fleet CA and $NAME's certificate in $CONF_DIR/fleet"

token=$CONF_DIR/operator.token
if [[ -n ${OPERATOR_TOKEN_FILE:-} ]]; then
  [[ -s $OPERATOR_TOKEN_FILE ]] || die "OPERATOR_TOKEN_FILE $OPERATOR_TOKEN_FILE is empty or missing"
  if [[ $(readlink -f "$OPERATOR_TOKEN_FILE") != "$(readlink -f "$token" 2>/dev/null || true)" ]]; then
    install -m 0600 "$OPERATOR_TOKEN_FILE" "$token"
    say "installed the operator token as $token"
  fi
elif [[ ! -s $token ]]; then
  (umask 077 && openssl rand -hex 32 >"$token")
  say "made a new operator token $token: copy it to the other machines (OPERATOR_TOKEN_FILE) before running this there"
fi

# proxy.user / node.socket_group: the unprivileged identity deploy/install.sh made, if it did.
user_lines="" group_lines=""
if [[ $ROOT == "" ]] && getent passwd sandgate >/dev/null; then
  user_lines='user = "sandgate"'
  group_lines='socket_group = "sandgate"'
fi

# Both daemons present this node's fleet certificate to etcd and check the members' against the fleet CA.
fleet_tls_lines=""
[[ $scheme == https ]] && fleet_tls_lines="etcd_cacert = \"$CONF_FLEET/fleet-ca.pem\"
etcd_cert = \"$CONF_FLEET/$NAME.pem\"
etcd_key = \"$CONF_FLEET/$NAME.key\""
if [[ -n ${ETCD_SERVER_NAME:-} ]]; then
  [[ $MEMBERS == - && $scheme == https ]] || die "ETCD_SERVER_NAME is for https ETCD_ENDPOINTS (MEMBERS \"-\")"
  [[ $ETCD_SERVER_NAME =~ ^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$ ]] ||
    die "ETCD_SERVER_NAME '$ETCD_SERVER_NAME' is not a DNS name"
  fleet_tls_lines+="
etcd_server_name = \"$ETCD_SERVER_NAME\""
fi

conf=$CONF_DIR/sandgate.toml
if [[ -f $conf ]] && ! grep -q "^# Written by sandgate's deploy/fleet-machine.sh" "$conf"; then
  cp -p "$conf" "$conf.bak"
  say "kept the previous $conf as $conf.bak"
fi
put "$conf" 0644 <<EOF
# Written by sandgate's deploy/fleet-machine.sh: node and proxy $NAME of a fleet on etcd $endpoints.
# Every key and its default: deploy/sandgate.example.toml; the fleet: docs/fleet.md.
domain = "$DOMAIN"
node_socket = "unix:$ROOT/run/sandgate/node.sock"
operator_token_file = "$token"

[proxy]
listen = ["$INGRESS_LISTEN"]
public_port = ${PUBLIC_PORT:-0}
$user_lines
# The cross-node hop: other proxies bring this node's sandboxes' connections here, over mutual TLS.
fleet_listen = "$IP:$FLEET_PORT"
fleet_cert = "$CONF_DIR/fleet/$NAME.pem"
fleet_key = "$CONF_DIR/fleet/$NAME.key"
fleet_ca = "$CONF_DIR/fleet/fleet-ca.pem"

[[proxy.certificates]]
cert = "$TLS_CERT"
key = "$TLS_KEY"

[node]
state_dir = "$ROOT/var/lib/sandgate"
cgroup_name = "$CGROUP_NAME"
$group_lines
# Placement sends creates to this address with the operator token: private network only (see the top).
api_listen = ["$IP:$API_PORT"]
api_listen_allow_remote = true
${NODE_EXTRA:-}

[fleet]
etcd_endpoints = [$endpoints]
$fleet_tls_lines
node_name = "$NAME"
advertise_api = "http://$IP:$API_PORT"
advertise_ingress = "$IP:$FLEET_PORT"
EOF

# The node registers at start; with its etcd member on this machine it waits for it (Wants: a member that is
# down leaves the node fenced until the cluster answers, never unstarted).
[[ $MEMBERS == - ]] || put "$ROOT/etc/systemd/system/sandgate-node.service.d/fleet.conf" 0644 <<EOF
# Written by sandgate's deploy/fleet-machine.sh.
[Unit]
Wants=etcd.service
After=etcd.service
EOF

# The whole file as both daemons load it, and the certificates it names.
proxy_bin=${SANDGATE_PROXY:-/usr/local/bin/sandgate-proxy}
if [[ -x $proxy_bin ]]; then
  "$proxy_bin" --config "$conf" --check >/dev/null || die "$conf does not load (above); fix the environment and run again"
  say "$conf loads, and its certificates with it"
else
  say "note: $proxy_bin not found, so $conf was not checked (deploy/install.sh installs it)"
fi

units="etcd sandgate-node sandgate-proxy"
[[ $MEMBERS == - ]] && units="sandgate-node sandgate-proxy"
cat >&2 <<EOF

$NAME is ready to start. Once every machine ran this with the same MEMBERS:
  $SRC/deploy/install.sh      # again: proxy.user gets read access to the new key and token
  systemctl daemon-reload && systemctl enable --now $units
  sandgate nodes              # every node, once they registered
EOF
