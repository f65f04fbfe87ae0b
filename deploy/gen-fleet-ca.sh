#!/usr/bin/env bash
# Creates the fleet CA and one certificate per node for the proxies' cross-node hop (mutual TLS between
# each node's proxy and the others' proxy.fleet_listen; docs/fleet.md#cross-node-routing).
#   deploy/gen-fleet-ca.sh DIR NODE[=ADDR[,ADDR...]]...    ADDR: a numeric IPv4 address, or DNS:NAME
# Writes DIR/fleet-ca.pem + DIR/fleet-ca.key (10 years) once, and DIR/NODE.pem + DIR/NODE.key per node
# (1 year; the certificate's DNS name and CN are the node's name, which is how a proxy knows who it talks
# to), ECDSA P-256, keys mode 0600. Each certificate is both server and client (a node's proxy is both
# ends of hops). With NODE=IP it also names that address (an IP SAN): the machine's etcd member serves
# with it, and etcd clients verify the member's address (deploy/fleet-machine.sh's TLS etcd). A member
# checks a peer's certificate against the address the peer connects from, so a machine whose connections
# may leave from another of its addresses lists that one too (NODE=IP,OTHER_IP). DNS:NAME adds a DNS name:
# an etcd member on Kubernetes (deploy/kubernetes/fleet.yaml) is dialled by its stable name and through its
# client Service's (fleet.etcd_server_name). Existing
# files are kept: run it again with a new node name to add a node (remove a node's pair to remake it).
# Copy fleet-ca.pem and that node's pair to each machine; fleet-ca.key stays where nodes are enrolled.
set -euo pipefail

die() {
  echo "gen-fleet-ca: $*" >&2
  exit 1
}

[[ $# -ge 2 ]] || die "usage: $0 DIR NODE..."
dir=$1
shift
command -v openssl >/dev/null || die "openssl not found; run deploy/install-deps.sh"
declare -A node_ip=()
nodes=()
for arg in "$@"; do
  node=${arg%%=*}
  # The proxy's rule (fleet_hop.h valid_node_name): a lowercase DNS label.
  [[ $node =~ ^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$ ]] || die "'$node' is not a node name (lowercase letters, digits, '-', at most 63)"
  if [[ $arg == *=* ]]; then
    IFS=, read -r -a ips <<<"${arg#*=}"
    [[ ${#ips[@]} -ge 1 ]] || die "'$arg': no address after '='"
    for ip in "${ips[@]}"; do
      if [[ $ip == DNS:* ]]; then
        [[ ${ip#DNS:} =~ ^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$ ]] ||
          die "'$arg': '${ip#DNS:}' is not a DNS name"
        node_ip[$node]+="${node_ip[$node]:+,}$ip"
        continue
      fi
      [[ $ip =~ ^([0-9]{1,3}\.){3}[0-9]{1,3}$ ]] || die "'$arg': '$ip' is not a numeric IPv4 address or DNS:NAME"
      node_ip[$node]+="${node_ip[$node]:+,}IP:$ip"
    done
  fi
  nodes+=("$node")
done

mkdir -p "$dir"
ca=$dir/fleet-ca.pem ca_key=$dir/fleet-ca.key
tmp=$(mktemp -d "$dir/.gen-fleet-ca.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
umask 077

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
serial() { echo "0x$(openssl rand -hex 16)"; }

if [[ ! -s $ca || ! -s $ca_key ]]; then
  cat >"$tmp/ca.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = sandgate fleet CA
[ca_ext]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
CNF
  new_key "$tmp/ca.key"
  openssl req -new -x509 -config "$tmp/ca.cnf" -extensions ca_ext -key "$tmp/ca.key" -days 3650 \
    -set_serial "$(serial)" -out "$tmp/ca.pem"
  mv "$tmp/ca.key" "$ca_key"
  mv "$tmp/ca.pem" "$ca"
  chmod 0644 "$ca"
fi

for node in "${nodes[@]}"; do
  [[ -s $dir/$node.pem && -s $dir/$node.key ]] && continue
  san="DNS:$node${node_ip[$node]:+,${node_ip[$node]}}"
  cat >"$tmp/$node.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = $node
[node_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = $san
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
CNF
  new_key "$tmp/$node.key"
  openssl req -new -config "$tmp/$node.cnf" -key "$tmp/$node.key" -out "$tmp/$node.csr"
  openssl x509 -req -in "$tmp/$node.csr" -CA "$ca" -CAkey "$ca_key" -set_serial "$(serial)" -days 365 \
    -extfile "$tmp/$node.cnf" -extensions node_ext -out "$tmp/$node.pem" 2>/dev/null
  mv "$tmp/$node.key" "$dir/$node.key"
  mv "$tmp/$node.pem" "$dir/$node.pem"
  chmod 0644 "$dir/$node.pem"
  echo "node $node: $dir/$node.pem, $dir/$node.key"
done
