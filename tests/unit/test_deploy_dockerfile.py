"""The Dockerfile and its venv script: one target per service plus `models`, a torch-free
gateway, non-root runtime, offline Hugging Face, torch pinned like pyproject.toml."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from llmesh import settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL = ROOT / "deploy" / "docker" / "install-venv.sh"
TARGETS = (*settings.SERVICES, "models")


def stages() -> dict[str, tuple[str, list[str]]]:
    """name -> (base, instruction lines) for every `FROM base AS name` stage."""
    found: dict[str, tuple[str, list[str]]] = {}
    current: list[str] | None = None
    for raw in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)$", line, re.IGNORECASE)
        if match:
            current = []
            found[match.group(2)] = (match.group(1), current)
        elif current is not None:
            current.append(line)
    return found


def test_one_target_per_service_and_models() -> None:
    all_stages = stages()
    for target in TARGETS:
        assert target in all_stages, f"no `{target}` target"
        base, lines = all_stages[target]
        assert base == "runtime", f"{target} must derive from the slim runtime stage"
        assert f"COPY --from=venv-{target} /opt/venv /opt/venv" in lines, target
        venv_base, venv_lines = all_stages[f"venv-{target}"]
        assert venv_base == "builder"
        assert f"RUN install-venv {target} deps" in venv_lines
        assert f"RUN install-venv {target} project" in venv_lines


def test_service_entrypoints_and_ports() -> None:
    all_stages = stages()
    for name in settings.SERVICES:
        lines = all_stages[name][1]
        assert f'ENTRYPOINT ["python", "-m", "services.{name}"]' in lines, name
        assert f"ENV LLMESH_LISTEN=0.0.0.0:{settings.DEFAULT_PORTS[name]}" in lines, name
        assert f"EXPOSE {settings.DEFAULT_PORTS[name]} {settings.DEFAULT_METRICS_PORTS[name]}" in lines, name
    http = settings.DEFAULT_HTTP_PORT
    assert {f"ENV LLMESH_HTTP_LISTEN=0.0.0.0:{http}", f"EXPOSE {http}"} <= set(all_stages["gateway"][1])
    assert 'ENTRYPOINT ["llmesh"]' in all_stages["models"][1]
    assert 'CMD ["models", "prepare"]' in all_stages["models"][1]


def test_runtime_is_non_root_and_offline() -> None:
    lines = stages()["runtime"][1]
    text = "\n".join(lines)
    assert "USER 10001:10001" in lines
    assert "--uid 10001" in text
    assert "HF_HUB_OFFLINE=1" in text
    assert "LLMESH_METRICS_HOST=0.0.0.0" in text
    for name in TARGETS:  # no stage switches back to root
        assert not any(line.startswith("USER") for line in stages()[name][1]), name


def test_torch_pin_matches_pyproject_and_defaults_to_cpu() -> None:
    text = DOCKERFILE.read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    pins = {dep for deps in extras.values() for dep in deps if dep.startswith("torch==")}
    assert pins == {"torch==2.13.0"}
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in text, "CUDA variant undocumented"


def test_install_script_maps_targets_to_extras() -> None:
    script = INSTALL.read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = re.findall(r'^\s*([a-z |]+)\) extra="([^"]*)" ; needs_torch=(yes|no) ;;', script, re.MULTILINE)
    mapping: dict[str, tuple[str, str]] = {}
    for names, extra, torch in rows:
        for name in (n.strip() for n in names.split("|")):
            mapping[name] = (name if extra == "$target" else extra, torch)
    assert set(mapping) == set(TARGETS), mapping
    assert mapping["gateway"] == ("", "no"), "the gateway installs the core dependencies only"
    assert mapping["tokenizer"] == ("tokenizer", "no")
    for name in ("inference", "cache", "retrieval", "models"):
        assert mapping[name] == (name, "yes"), name
        assert name in extras, f"pyproject.toml has no [{name}] extra"
        assert any(dep.startswith("torch==") for dep in extras[name]), name
    assert not any(dep.startswith("torch") for dep in extras["tokenizer"])
    assert "requirements/dev.lock" in script and "-c /tmp/constraints.txt" in script
    # The dev lock pins the local CPU torch build (+cpu), which would block the CUDA variant.
    assert "grep -v '^torch=='" in script


def test_install_script_constraints_extraction(tmp_path: Path) -> None:
    """The sed expression that turns the hashed dev lock into plain pins."""
    match = re.search(r"sed -n '([^']+)' requirements/dev.lock", INSTALL.read_text())
    assert match
    lock = tmp_path / "dev.lock"
    lock.write_text(
        "# header\ngrpcio==1.85.1 \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\n    # via llmesh\n"
        "httpx[http2]==0.28.1 \\\n    --hash=sha256:dd\n"
        'torch==2.13.0 ; platform_system == "Linux" \\\n    --hash=sha256:cc\nzope.interface==7.2\n'
    )
    if shutil.which("sed") is None:
        pytest.skip("no sed")
    out = subprocess.run(["sed", "-n", match.group(1), str(lock)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["grpcio==1.85.1", "httpx==0.28.1", "torch==2.13.0", "zope.interface==7.2"]


def test_install_script_is_valid_sh() -> None:
    if shutil.which("sh") is None:
        pytest.skip("no sh")
    result = subprocess.run(["sh", "-n", str(INSTALL)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dockerignore_keeps_the_build_inputs() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for excluded in (".git", ".venv", ".data", "tests"):
        assert excluded in patterns, f"{excluded} should not be sent to the builder"
    for needed in ("llmesh", "services", "bench", "pyproject.toml", "requirements", "README.md"):
        assert needed not in patterns, f"{needed} is needed by the build"
    assert "!deploy/docker" in patterns
