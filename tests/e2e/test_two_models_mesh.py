"""Two models as `llmesh up` runs them: the supervisor starts one inference process per model of
LLMESH_MODELS, the tokenizer with both tokenizers and the gateway routing to both (tiny
random-weight models on the real tokenizer, for speed). `llmesh ask --model` picks one; one
model's inference killed leaves the other answering."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.client import Mesh, MeshError
from llmesh.supervisor import Mesh as Processes
from llmesh.testing import build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

FIRST, SECOND = "tiny", "tiny-seed1"


@pytest.fixture(scope="module")
def mesh(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    build_tiny_model(models_dir, name=FIRST, seed=0)
    build_tiny_model(models_dir, name=SECOND, seed=1)
    env = {
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("two-models")),
        "LLMESH_MODELS_DIR": str(models_dir),
        # Ports are the supervisor's to choose here (port 0); on `llmesh up` each model listens on
        # the port its target names.
        "LLMESH_MODELS": f"{FIRST}=127.0.0.1:0,{SECOND}=127.0.0.1:0",
        "LLMESH_DEFAULT_MODEL": SECOND,
        "LLMESH_CACHE_TARGET": "127.0.0.1:1",
        "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
        "LLMESH_BREAKER_MINIMUM_CALLS": "2",
        "LLMESH_BREAKER_WINDOW": "2",
    }
    with Processes(env=env, services=("tokenizer", "inference", "gateway")) as procs:
        yield procs


def ask_cli(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "llmesh.cli", "ask", "Say hello.", "--target", target, "--json", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_one_inference_process_per_model_and_the_cli_picks_one(mesh: Processes) -> None:
    assert {f"inference/{FIRST}", f"inference/{SECOND}"} <= set(mesh.procs)
    assert "inference" not in mesh.procs
    target = mesh.target("gateway")
    with Mesh(target, timeout=120) as client:
        listed = client.list_models()
        assert [(m.name, m.default) for m in listed] == [(SECOND, True), (FIRST, False)]
        default = client.ask("Say hello.", use_retrieval=False, max_new_tokens=4)
        assert default.model.startswith(f"{SECOND}:tiny-random-llama-1@")
    for model, seed in ((FIRST, 0), (SECOND, 1)):
        done = ask_cli(target, "--model", model, "--max-new-tokens", "4", "--no-retrieval")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["model"].startswith(f"{model}:tiny-random-llama-{seed}@")
    unknown = ask_cli(target, "--model", "nope")
    assert unknown.returncode != 0 and "'nope'" in unknown.stdout + unknown.stderr


def test_one_model_killed_leaves_the_other_answering(mesh: Processes) -> None:
    mesh.stop_one(f"inference/{FIRST}", sig=signal.SIGKILL)
    with Mesh(mesh.target("gateway"), timeout=60) as client:
        with pytest.raises(MeshError) as down:
            client.ask("Still there?", model=FIRST, use_retrieval=False, use_cache=False, max_new_tokens=4)
        assert down.value.code == grpc.StatusCode.UNAVAILABLE
        alive = client.ask("Still there?", model=SECOND, use_retrieval=False, use_cache=False, max_new_tokens=4)
        assert alive.text and alive.model.startswith(f"{SECOND}:")
        assert [(m.name, m.available) for m in client.list_models()] == [(SECOND, True), (FIRST, False)]
