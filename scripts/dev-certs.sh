#!/usr/bin/env bash
# Makes a local CA and certificates for the dev stack (`make certs`): one certificate shared by
# the services (server and client use, SANs for localhost and the compose/Kubernetes names) and
# one for callers. Development only: the CA key sits next to the certificates.
set -euo pipefail
out=${1:-.certs}
mkdir -p "$out"
cd "$out"
days=825
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days $days \
  -subj "/CN=llmesh dev CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
sans="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:gateway,DNS:tokenizer,DNS:inference,DNS:cache,DNS:retrieval"
sans="$sans,DNS:*.llmesh.svc.cluster.local,DNS:*.llmesh.svc"
issue() {  # name, common name, extended key usage, SANs
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
    "$3" "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" -days $days \
    -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
issue service "llmesh service" "serverAuth,clientAuth" "$sans"
issue client "llmesh client" "clientAuth" "DNS:llmesh-client"
chmod 600 ./*.key
echo "wrote $(pwd): ca.pem, service.pem/.key (services), client.pem/.key (callers)"
