#!/usr/bin/env bash
# Creates a local CA and a wildcard server certificate for sandgate's TLS ingress (for development and
# single-machine setups; use a real CA, e.g. ACME DNS-01, for anything public).
#   deploy/gen-cert.sh DIR DOMAIN
# Writes DIR/ca.pem + DIR/ca.key (CA, 10 years) and DIR/server.pem + DIR/server.key (SAN *.DOMAIN and DOMAIN,
# 90 days), all ECDSA P-256, keys mode 0600. Idempotent: an existing CA valid for 30 more days and a server
# certificate valid for 7 more days, issued by that CA for this DOMAIN, are kept.
set -euo pipefail

die() {
  echo "gen-cert: $*" >&2
  exit 1
}

[[ $# -eq 2 ]] || die "usage: $0 DIR DOMAIN"
dir=$1
domain=$2
# Same rule as config.cc's `domain`: lowercase DNS labels.
[[ $domain =~ ^[a-z0-9-]{1,63}(\.[a-z0-9-]{1,63})*$ ]] || die "'$domain' is not a lowercase DNS name"
command -v openssl >/dev/null || die "openssl not found; run deploy/install-deps.sh"

mkdir -p "$dir"
ca=$dir/ca.pem ca_key=$dir/ca.key cert=$dir/server.pem key=$dir/server.key
tmp=$(mktemp -d "$dir/.gen-cert.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
umask 077 # keys are created 0600 from the start, never briefly world-readable

cat >"$tmp/openssl.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
[ca_ext]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:*.$domain, DNS:$domain
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
CNF

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
# Random 128-bit serial: two certificates from one CA must never share one (browsers reject that).
serial() { echo "0x$(openssl rand -hex 16)"; }
valid_for() { openssl x509 -noout -checkend "$2" -in "$1" >/dev/null 2>&1; }
key_matches() { [[ $(openssl x509 -noout -pubkey -in "$1" 2>/dev/null) == $(openssl pkey -pubout -in "$2" 2>/dev/null) ]]; }

if [[ -s $ca && -s $ca_key ]] && valid_for "$ca" $((30 * 86400)) && key_matches "$ca" "$ca_key"; then
  echo "gen-cert: keeping CA $ca" >&2
else
  echo "gen-cert: creating CA $ca" >&2
  new_key "$tmp/ca.key"
  openssl req -x509 -new -config "$tmp/openssl.cnf" -extensions ca_ext -key "$tmp/ca.key" -sha256 -days 3650 \
    -set_serial "$(serial)" -subj "/O=sandgate/CN=sandgate local CA" -out "$tmp/ca.pem"
  mv "$tmp/ca.key" "$ca_key"
  mv "$tmp/ca.pem" "$ca"
  rm -f "$cert" # issued by the previous CA: no longer verifiable
fi

cert_ok() {
  [[ -s $cert && -s $key ]] || return 1
  valid_for "$cert" $((7 * 86400)) || return 1
  key_matches "$cert" "$key" || return 1
  openssl verify -CAfile "$ca" "$cert" >/dev/null 2>&1 || return 1
  local san
  san=$(openssl x509 -noout -ext subjectAltName -in "$cert" 2>/dev/null | sed -n '2s/^ *//p')
  [[ $san == "DNS:*.$domain, DNS:$domain" ]]
}

if cert_ok; then
  echo "gen-cert: keeping server certificate $cert" >&2
else
  echo "gen-cert: creating server certificate $cert for *.$domain" >&2
  new_key "$tmp/server.key"
  openssl req -new -config "$tmp/openssl.cnf" -key "$tmp/server.key" -subj "/O=sandgate/CN=*.$domain" \
    -out "$tmp/server.csr"
  openssl x509 -req -in "$tmp/server.csr" -CA "$ca" -CAkey "$ca_key" -set_serial "$(serial)" -days 90 -sha256 \
    -extfile "$tmp/openssl.cnf" -extensions server_ext -out "$tmp/server.pem" 2>/dev/null
  mv "$tmp/server.key" "$key"
  mv "$tmp/server.pem" "$cert"
fi

chmod 600 "$ca_key" "$key"
chmod 644 "$ca" "$cert"
echo "gen-cert: CA $ca, certificate $cert, key $key" >&2
