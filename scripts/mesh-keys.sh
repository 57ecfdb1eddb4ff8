#!/usr/bin/env bash
# Issues the gateway's first credentials, once: an API keys file holding one key
# (LLMESH_API_KEYS_FILE; `llmesh keys` adds, lists and revokes keys in it, and the gateway
# re-reads it on change) and an admin key (LLMESH_ADMIN_KEYS, for PurgeCache):
#
#   OUT/keys.json    the API keys file: each key's sha256, never the key
#   OUT/admin-key    the admin key
#
# Each is generated only when absent, and its key is printed on stdout only then: the keys
# file keeps a digest, so this is the one time the API key can be read (compose:
# `docker compose logs keys`). Nothing is regenerated on a later run, so the job is safe on
# every `up`. Files are mode 0600; --owner hands them (and OUT) to the gateway's user.
#
#   scripts/mesh-keys.sh [--owner UID:GID] [--tenant TENANT] OUT
#
# --tenant: the tenant the first API key acts for (default `*`: any tenant a request names,
# an operator's key). Give each application a key of its own with
# `llmesh keys create --file OUT/keys.json --tenant NAME` (docs/deploy.md).
set -euo pipefail

owner="" tenant="*"
while [ $# -gt 0 ]; do
  case "$1" in
    --owner) owner=$2; shift ;;
    --tenant) tenant=$2; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
out=${1:?usage: mesh-keys.sh [--owner UID:GID] [--tenant TENANT] OUT}
out=${out%/}
umask 077
mkdir -p "$out"

if [ -s "$out/keys.json" ]; then
  echo "keys: $out/keys.json exists; no API key generated (llmesh keys list --file $out/keys.json)" >&2
else
  key=$(llmesh keys create --file "$out/keys.json" --tenant "$tenant" --name "first key (mesh-keys.sh)")
  echo "API key (tenant $tenant), shown only this once: $key"
fi

if [ -s "$out/admin-key" ]; then
  echo "keys: $out/admin-key exists; no admin key generated" >&2
else
  admin="llmesh-admin-$(openssl rand -hex 32)"
  # Written under another name and renamed: a reader never sees half a key.
  printf '%s\n' "$admin" > "$out/.admin-key.tmp"
  mv "$out/.admin-key.tmp" "$out/admin-key"
  echo "admin key (PurgeCache), shown only this once: $admin"
fi

if [ -n "$owner" ]; then
  chown -R "$owner" "$out"
fi
