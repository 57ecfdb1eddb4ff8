#!/usr/bin/env bash
# Generates the credentials of the Kubernetes base (deploy/kubernetes/base): random values,
# 256 bits each, written to env files that the base's secretGenerator reads. Run it once before
# the first `kubectl apply -k`; rendering fails until it has run (no default password ships).
#
#   DIR/redis.env        Secret llmesh-redis: the cache's Redis (answers, collection versions)
#   DIR/redis-state.env  Secret llmesh-redis-state: the gateways' admission window and key limits
#   DIR/qdrant.env       Secret llmesh-qdrant: Qdrant's API key
#
# Each Redis file holds `password` (the server's), `url` (redis://, what the services dial) and
# `tls-url` (rediss://, read by the store-tls component: the mesh CA verifies the server and the
# pod's own certificate is presented to it). DIR defaults to deploy/kubernetes/base/secrets,
# ignored by git: keep these files out of version control, or feed the same keys from a secret
# manager instead.
#
# Idempotent: existing files are kept, so a rerun changes nothing. --rotate writes new values;
# apply again and every pod using them restarts (the generated Secrets' names carry a hash).
#
#   scripts/k8s-secrets.sh [--rotate] [DIR]
#
# MESH_NAMESPACE (default llmesh) is the namespace in the URLs' host names.
set -euo pipefail

rotate=0
while [ $# -gt 0 ]; do
  case "$1" in
    --rotate) rotate=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
dir=${1:-"$(cd "$(dirname "$0")/.." && pwd)/deploy/kubernetes/base/secrets"}
dir=${dir%/}
ns=${MESH_NAMESPACE:-llmesh}
case "$ns" in
  *[!a-z0-9-]*|"") echo "MESH_NAMESPACE: bad name '$ns' (a-z, 0-9, '-')" >&2; exit 2 ;;
esac
# The mounted mesh certificate of every llmesh pod (Secret llmesh-tls-<service>).
tls=/etc/llmesh/tls
umask 077
mkdir -p "$dir"

random() {  # 32 random bytes as hex: URL-safe, so it goes into a Redis URL as is
  od -An -vtx1 -N32 /dev/urandom | tr -d ' \n'
}

write() {  # file, then its key=value lines; replaced atomically (rename) so no reader sees half
  local file=$dir/$1
  shift
  if [ -s "$file" ] && [ "$rotate" = 0 ]; then
    echo "k8s-secrets: $file exists, kept (--rotate for new values)" >&2
    return
  fi
  printf '%s\n' "$@" > "$file.tmp"
  mv "$file.tmp" "$file"
  echo "k8s-secrets: wrote $file" >&2
}

redis() {  # file, service name
  local password host
  password=$(random)
  host=$2.$ns.svc.cluster.local:6379
  write "$1" \
    "password=$password" \
    "url=redis://:$password@$host/0" \
    "tls-url=rediss://:$password@$host/0?ssl_ca_certs=$tls/ca.crt&ssl_certfile=$tls/tls.crt&ssl_keyfile=$tls/tls.key"
}

redis redis.env redis
redis redis-state.env redis-state
write qdrant.env "api-key=$(random)"
