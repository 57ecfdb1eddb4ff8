"""The API keys file (LLMESH_API_KEYS_FILE): the gateway reads it (and re-reads it on change), the
`llmesh keys` command edits it. No key is stored, only its sha256; a key is shown once, when
`llmesh keys create` makes it.

    {"version": 1, "keys": [
      {"id": "k3f9a0c21d7", "sha256": "<64 hex>", "tenant": "acme", "models": ["smollm2"],
       "rpm": 60, "tpm": 20000, "tpd": 1000000, "name": "billing", "created_at": "2026-12-01T19:00:00Z"}
    ]}

`tenant` is the one tenant the key acts for (`*`: any the request names). `models` empty: every
model. A limit of 0 is no limit: `rpm` requests per minute, `tpm` tokens per minute, `tpd` tokens
per UTC day (tokens generated: prompt and completion; answers from the cache cost none).

Writes are atomic (a temporary file in the same folder, fsynced, renamed over the file, mode
0600) under an exclusive lock, so a gateway never reads half a file and two edits never lose one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
KEY_PREFIX = "llmesh"
ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TENANT_RE = re.compile(r"^(\*|[A-Za-z0-9][A-Za-z0-9_.-]{0,63})$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
LIMITS = ("rpm", "tpm", "tpd")


class KeysFileError(ValueError):
    """The keys file cannot be read or is not valid (the message names the entry and field)."""


@dataclass(frozen=True)
class KeyRecord:
    id: str
    sha256: str
    tenant: str
    models: tuple[str, ...] = ()
    rpm: int = 0
    tpm: int = 0
    tpd: int = 0
    name: str = ""
    created_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        body = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        body["models"] = list(self.models)
        return {**self.extra, **body}


def digest(key: str) -> str:
    """The stored form of a key: sha256 hex (keys are random, 190 bits: no salt or stretching needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(id, key): `llmesh_<id>_<secret>`; the id is public (logs, metrics), the secret is not."""
    key_id = "k" + secrets.token_hex(5)
    return key_id, f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(24)}"


def _nonneg_int(entry: dict[str, Any], name: str, where: str) -> int:
    value = entry.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KeysFileError(f"{where}: `{name}` must be a whole number >= 0 (0 = no limit), not {value!r}")
    return value


def parse(text: str, source: str = "keys file") -> list[KeyRecord]:
    try:
        body = json.loads(text) if text.strip() else {"keys": []}
    except json.JSONDecodeError as exc:
        raise KeysFileError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(body, dict) or not isinstance(body.get("keys", []), list):
        raise KeysFileError(f'{source}: expected {{"version": 1, "keys": [...]}}')
    if body.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise KeysFileError(f"{source}: version {body.get('version')!r} is not {FORMAT_VERSION}")
    records: list[KeyRecord] = []
    seen_ids: set[str] = set()
    seen_digests: set[str] = set()
    for i, entry in enumerate(body.get("keys", [])):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where}: expected an object")
        key_id, sha, tenant = entry.get("id"), entry.get("sha256"), entry.get("tenant")
        if not isinstance(key_id, str) or not ID_RE.match(key_id):
            raise KeysFileError(f"{where}: `id` must be 1-64 letters, digits, '_', '.', '-'")
        where = f"{source}: key {key_id}"
        if key_id in seen_ids:
            raise KeysFileError(f"{where}: the id appears twice")
        if not isinstance(sha, str) or not DIGEST_RE.match(sha):
            raise KeysFileError(f"{where}: `sha256` must be the key's sha256 as 64 lowercase hex digits")
        if sha in seen_digests:
            raise KeysFileError(f"{where}: the same key (sha256) appears twice")
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise KeysFileError(f"{where}: `tenant` must be a tenant name or `*`")
        models = entry.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise KeysFileError(f"{where}: `models` must be a list of model names ([] = every model)")
        seen_ids.add(key_id)
        seen_digests.add(sha)
        known = {"id", "sha256", "tenant", "models", *LIMITS, "name", "created_at"}
        records.append(
            KeyRecord(
                id=key_id,
                sha256=sha,
                tenant=tenant,
                models=tuple(models),
                rpm=_nonneg_int(entry, "rpm", where),
                tpm=_nonneg_int(entry, "tpm", where),
                tpd=_nonneg_int(entry, "tpd", where),
                name=str(entry.get("name", "")),
                created_at=str(entry.get("created_at", "")),
                extra={k: v for k, v in entry.items() if k not in known},
            )
        )
    return records


def load(path: Path) -> list[KeyRecord]:
    """The file's keys; a missing file holds none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise KeysFileError(f"{path}: {exc.strerror}") from None
    return parse(text, str(path))


def save(path: Path, records: list[KeyRecord]) -> None:
    """Atomically replaces the file (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"version": FORMAT_VERSION, "keys": [r.to_json() for r in records]}, indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def editing(path: Path) -> Iterator[list[KeyRecord]]:
    """The file's keys under an exclusive lock; the list as left in the block is saved."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        records = load(path)
        yield records
        save(path, records)


def create(
    path: Path,
    tenant: str,
    *,
    models: tuple[str, ...] = (),
    rpm: int = 0,
    tpm: int = 0,
    tpd: int = 0,
    name: str = "",
) -> tuple[KeyRecord, str]:
    """Adds a new key; returns its record and the key itself (shown once, never stored)."""
    if not TENANT_RE.match(tenant):
        raise KeysFileError(f"tenant {tenant!r}: letters, digits, '_', '.', '-' (or `*`)")
    for limit, value in zip(LIMITS, (rpm, tpm, tpd), strict=True):
        if value < 0:
            raise KeysFileError(f"{limit} must be >= 0 (0 = no limit)")
    key_id, key = new_key()
    record = KeyRecord(
        id=key_id,
        sha256=digest(key),
        tenant=tenant,
        models=tuple(models),
        rpm=rpm,
        tpm=tpm,
        tpd=tpd,
        name=name,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    with editing(path) as records:
        records.append(record)
    return record, key


def revoke(path: Path, key_id: str) -> KeyRecord:
    """Removes the key with this id; KeysFileError when there is none."""
    with editing(path) as records:
        for i, record in enumerate(records):
            if record.id == key_id:
                del records[i]
                return record
    raise KeysFileError(f"no key with id {key_id!r} in {path}")
