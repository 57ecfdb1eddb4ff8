"""The API keys file and `llmesh keys`: keys stored as digests, atomic edits, clear errors, and the
gateway's key ring re-reading the file when it changes (a broken file keeps the keys in force)."""

from __future__ import annotations

import io
import json
import stat
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from llmesh import cli, keys_file
from llmesh.errors import PermissionDenied, Unauthenticated
from services.gateway.auth import KeyLimits, KeyRing


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_create_list_revoke_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    code, out, err = run_cli("keys", "create", "--tenant", "acme", "--rpm", "60", "--tpd", "1000", "--file", str(path))
    assert code == 0 and "shown only this once" in err
    key = out.strip()
    assert key.startswith("llmesh_k")
    stored = path.read_text()
    assert key not in stored and keys_file.digest(key) in stored  # the digest, never the key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [record] = keys_file.load(path)
    assert (record.tenant, record.rpm, record.tpm, record.tpd) == ("acme", 60, 0, 1000)
    assert key.split("_")[1] == record.id

    beta = ("--tenant", "beta", "--models", "smollm2,tiny", "--json")
    code, out, _ = run_cli("keys", "create", *beta, "--file", str(path))
    created = json.loads(out)
    assert code == 0 and created["models"] == ["smollm2", "tiny"] and created["key"].startswith("llmesh_")

    code, out, _ = run_cli("keys", "list", "--file", str(path))
    assert code == 0 and record.id in out and "smollm2,tiny" in out and key not in out
    code, out, _ = run_cli("keys", "list", "--json", "--file", str(path))
    assert [k["id"] for k in json.loads(out)] == [record.id, created["id"]]
    assert "sha256" not in out

    code, _, err = run_cli("keys", "revoke", record.id, "--file", str(path))
    assert code == 0 and record.id in err
    assert [r.id for r in keys_file.load(path)] == [created["id"]]
    code, _, err = run_cli("keys", "revoke", record.id, "--file", str(path))
    assert code == 1 and "no key with id" in err


def test_the_cli_needs_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMESH_API_KEYS_FILE", raising=False)
    code, _, err = run_cli("keys", "list")
    assert code == 2 and "LLMESH_API_KEYS_FILE" in err


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("{", "not valid JSON"),
        ('{"keys": [{"id": "a b", "sha256": "' + "0" * 64 + '", "tenant": "t"}]}', "`id`"),
        ('{"keys": [{"id": "a", "sha256": "xyz", "tenant": "t"}]}', "`sha256`"),
        ('{"keys": [{"id": "a", "sha256": "' + "0" * 64 + '", "tenant": "t", "rpm": -1}]}', "`rpm`"),
        ('{"keys": [{"id": "a", "sha256": "' + "0" * 64 + '", "tenant": "t", "models": "x"}]}', "`models`"),
        ('{"version": 2, "keys": []}', "version"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path: Path, body: str, problem: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(body)
    with pytest.raises(keys_file.KeysFileError, match=problem):
        keys_file.load(path)


def test_the_key_ring_reloads_on_change_and_keeps_the_old_keys_on_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    env_key = "env-key-owns-acme-000001"
    ring = KeyRing(f"{env_key}=acme", str(path))
    assert ring.enabled  # a configured file turns authentication on, even with no key in it
    with pytest.raises(Unauthenticated):
        ring.caller(None, "acme")
    record, key = keys_file.create(path, "acme", models=("smollm2",), rpm=5)
    assert ring.reload_if_changed()
    caller = ring.caller(f"Bearer {key}")
    assert caller.tenant == "acme" and caller.key_id == record.id
    assert caller.key.limits == KeyLimits(rpm=5) and caller.key.allows("smollm2") and not caller.key.allows("tiny")
    with pytest.raises(PermissionDenied):
        ring.caller(f"Bearer {key}", "beta")
    assert ring.caller(f"Bearer {env_key}").key_id.startswith("env-")
    assert not ring.reload_if_changed()  # unchanged: not re-read

    path.write_text("{ broken")
    assert not ring.reload_if_changed()
    assert ring.caller(f"Bearer {key}").key_id == record.id  # still in force

    keys_file.save(path, [])
    assert ring.reload_if_changed()
    with pytest.raises(Unauthenticated):
        ring.caller(f"Bearer {key}")
    assert ring.caller(f"Bearer {env_key}").tenant == "acme"  # the environment's keys stay
    assert ring.tenants() == {"acme"}


async def test_a_gateway_does_not_start_on_a_broken_keys_file(tmp_path: Path) -> None:
    from llmesh.settings import SettingsError, load
    from services.gateway.servicer import GatewayApp

    path = tmp_path / "keys.json"
    path.write_text('{"keys": [{"id": "x"}]}')
    with pytest.raises(SettingsError, match="LLMESH_API_KEYS_FILE"):
        GatewayApp(load("gateway", {"LLMESH_API_KEYS_FILE": str(path), "LLMESH_LISTEN": "127.0.0.1:0"}))
