#!/usr/bin/env bash
# Issues the mesh's certificates: a mesh CA, one certificate per service (server and client
# use) and one for callers (`client`: operators, the CLI, tests), in the layout of the Secrets
# cert-manager writes, so every deployment reads the same file names:
#
#   OUT/<name>/tls.crt  tls.key  ca.crt        name: gateway tokenizer inference cache retrieval client
#                                              and each of MESH_EXTRA_SERVICES (space- or comma-separated,
#                                              e.g. "inference-assistant": one inference service per model)
#   CA_DIR/ca.crt ca.key                       the CA's key never goes into OUT (default OUT/../<OUT>-ca)
#
# Used by the compose `certs` job, `make certs`, the tests, and to create Kubernetes Secrets
# when cert-manager is absent (docs/deploy.md). Idempotent: an existing CA and every certificate
# valid for more than RENEW_DAYS more days are kept. --rotate issues new certificates from the
# same CA; --new-ca starts a new CA (every service must restart together then).
#
#   scripts/mesh-certs.sh [--rotate] [--new-ca] [--ca-dir DIR] [--owner UID:GID] OUT
#
# SANs: <name>, <name>.<ns>.svc, <name>.<ns>.svc.cluster.local (ns: MESH_NAMESPACE, default
# llmesh), localhost, 127.0.0.1 and ::1; GATEWAY_SANS adds more to the gateway's (e.g.
# "DNS:llm.example.com"). Lifetimes: CA_DAYS (3650), CERT_DAYS (365), RENEW_DAYS (30).
set -euo pipefail

services=(gateway tokenizer inference cache retrieval)
extras=${MESH_EXTRA_SERVICES:-}
for extra in ${extras//,/ }; do
  case "$extra" in
    *[!a-z0-9-]*|"") echo "MESH_EXTRA_SERVICES: bad name '$extra' (a-z, 0-9, '-')" >&2; exit 2 ;;
  esac
  services+=("$extra")
done
rotate=0 new_ca=0 ca_dir="" owner=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rotate) rotate=1 ;;
    --new-ca) new_ca=1 rotate=1 ;;
    --ca-dir) ca_dir=$2; shift ;;
    --owner) owner=$2; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
out=${1:?usage: mesh-certs.sh [--rotate] [--new-ca] [--ca-dir DIR] [--owner UID:GID] OUT}
out=${out%/}
ca_dir=${ca_dir:-$out-ca}
ns=${MESH_NAMESPACE:-llmesh}
ca_days=${CA_DAYS:-3650} cert_days=${CERT_DAYS:-365} renew_days=${RENEW_DAYS:-30}
umask 077
mkdir -p "$out" "$ca_dir"

valid() {  # certificate file, days it must stay valid
  [ -s "$1" ] && openssl x509 -in "$1" -noout -checkend $(($2 * 86400)) >/dev/null 2>&1
}

if [ "$new_ca" = 1 ] || ! valid "$ca_dir/ca.crt" "$renew_days" || [ ! -s "$ca_dir/ca.key" ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$ca_dir/ca.key" -out "$ca_dir/ca.crt" -days "$ca_days" \
    -subj "/CN=llmesh mesh CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  rotate=1
  echo "mesh CA: new ($ca_dir/ca.crt)"
fi

issue() {  # name, extended key usage, SANs
  local dir=$out/$1 tmp
  mkdir -p "$dir"
  if [ "$rotate" = 0 ] && valid "$dir/tls.crt" "$renew_days" && [ -s "$dir/tls.key" ] \
    && openssl verify -CAfile "$ca_dir/ca.crt" "$dir/tls.crt" >/dev/null 2>&1; then
    cp "$ca_dir/ca.crt" "$dir/ca.crt"
    return
  fi
  tmp=$(mktemp -d)
  openssl req -newkey rsa:2048 -nodes -keyout "$tmp/tls.key" -out "$tmp/tls.csr" -subj "/CN=$1" 2>/dev/null
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
    "$2" "$3" >"$tmp/ext"
  openssl x509 -req -in "$tmp/tls.csr" -CA "$ca_dir/ca.crt" -CAkey "$ca_dir/ca.key" -CAcreateserial \
    -CAserial "$ca_dir/ca.srl" -out "$tmp/tls.crt" -days "$cert_days" -extfile "$tmp/ext" 2>/dev/null
  # New files land whole: a service restarting mid-rotation reads the old pair or the new one.
  cp "$ca_dir/ca.crt" "$tmp/ca.crt"
  mv -f "$tmp/tls.key" "$dir/tls.key"
  mv -f "$tmp/tls.crt" "$dir/tls.crt"
  mv -f "$tmp/ca.crt" "$dir/ca.crt"
  rm -rf "$tmp"
  echo "issued $dir/tls.crt"
}

for name in "${services[@]}"; do
  sans="DNS:$name,DNS:$name.$ns.svc,DNS:$name.$ns.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:::1"
  if [ "$name" = gateway ] && [ -n "${GATEWAY_SANS:-}" ]; then
    sans="$sans,$GATEWAY_SANS"
  fi
  issue "$name" "serverAuth,clientAuth" "$sans"
done
issue client "clientAuth" "DNS:llmesh-client"

chmod 644 "$out"/*/tls.crt "$out"/*/ca.crt
chmod 600 "$out"/*/tls.key
chmod 755 "$out" "$out"/*/
if [ -n "$owner" ]; then
  chown -R "$owner" "$out"
fi
echo "mesh certificates in $out (CA key in $ca_dir)"
