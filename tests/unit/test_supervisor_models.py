"""`llmesh up` with LLMESH_MODELS: one inference process per model, each on the port its target
names with its own metrics port, the tokenizer given every model; without it, one inference as
before. Recorded from the supervisor's plan (no processes start here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from llmesh.settings import DEFAULT_PORTS
from llmesh.supervisor import Mesh


class Recorder(Mesh):
    """The supervisor with process starts recorded instead of run."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started: list[tuple[str, str, dict[str, str]]] = []

    def start_one(  # type: ignore[override]
        self, name: str, timeout: float = 180.0, extra_env: Mapping[str, str] | None = None, module: str = ""
    ) -> None:
        self.started.append((name, module or name, dict(extra_env or {})))


def test_one_inference_per_model_on_fixed_ports() -> None:
    env = {"LLMESH_MODELS": "small=127.0.0.1:50053,big=127.0.0.1:50056", "LLMESH_REDIS_URL": "redis://x:1/0"}
    mesh = Recorder(env=env, ports=DEFAULT_PORTS, service_env={"inference": {"LLMESH_DEVICE": "cpu"}})
    mesh.start()
    assert [(name, module) for name, module, _ in mesh.started] == [
        ("tokenizer", "tokenizer"),
        ("inference/small", "inference"),
        ("inference/big", "inference"),
        ("cache", "cache"),
        ("retrieval", "retrieval"),
        ("gateway", "gateway"),
    ]
    small, big = mesh.started[1][2], mesh.started[2][2]
    assert small == {"LLMESH_DEVICE": "cpu", "LLMESH_INFERENCE_MODEL": "small", "LLMESH_METRICS_PORT": "9093"}
    assert big == {"LLMESH_DEVICE": "cpu", "LLMESH_INFERENCE_MODEL": "big", "LLMESH_METRICS_PORT": "9193"}
    assert mesh.ports["inference/small"] == 50053 and mesh.ports["inference/big"] == 50056
    mesh.procs.clear()


def test_without_models_one_inference_as_before() -> None:
    mesh = Recorder(env={"LLMESH_REDIS_URL": "redis://x:1/0"}, ports=DEFAULT_PORTS)
    mesh.start()
    assert [name for name, _, _ in mesh.started] == ["tokenizer", "inference", "cache", "retrieval", "gateway"]
    assert mesh.models == {}


def test_bad_models_setting_is_refused_before_anything_starts() -> None:
    with pytest.raises(RuntimeError, match="LLMESH_MODELS: model entry 'small' must look like name=host:port"):
        Recorder(env={"LLMESH_MODELS": "small"})


def test_stop_stops_processes_started_under_names_of_their_own() -> None:
    """A test's `start_one("retrieval-a", module="retrieval")` is stopped with the mesh (it once
    outlived the test run: stop() knew only the standard names)."""
    stopped: list[str] = []

    class Stopper(Mesh):
        def stop_one(self, name: str, timeout: float = 30.0, sig: int = 15) -> int | None:
            if self.procs.pop(name, None) is not None:
                stopped.append(name)
            return 0

    mesh = Stopper(env={"LLMESH_REDIS_URL": "redis://x:1/0"}, services=())
    mesh.procs.update({"retrieval-a": object(), "retrieval-b": object(), "cache": object()})  # type: ignore[dict-item]
    mesh.stop()
    assert stopped == ["cache", "retrieval-b", "retrieval-a"] and not mesh.procs
