"""`llmesh up` supervises: a service killed with SIGKILL (what the OOM killer sends) is started
again on the same port while the others keep serving, and the mesh comes back whole.

The mesh is started the way `llmesh up` starts it (the supervisor with its settings, the embedded
Redis, the real services and models), on free ports. One mesh for every kill: inference first
(a cached answer is served while it is away, a fresh generation is answered again within 30 s
of the kill), then tokenizer, cache, retrieval and gateway in turn."""

from __future__ import annotations

import os
import queue
import secrets
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.client import Mesh, MeshError
from llmesh.settings import load
from llmesh.supervisor import Mesh as Processes
from llmesh.supervisor import ServiceProcess, Supervision, wait_serving
from llmesh.testing import free_port, wait_until
from llmesh.v1 import gateway_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

QUESTION = "What is the capital of France?"
#: The requirement: the gateway answers a fresh generation within this long after inference died.
BACK_WITHIN_S = 30.0
#: Pause between two asks of a poll when the gateway's refusal carries no retry info.
POLL_S = 0.2


class HeldRestarts(Processes):
    """The supervisor of `llmesh up`, with seams for the test: while `hold` is set, a restart
    waits for the test before it starts the process (so "while it is away" is certain, not a race),
    and each restarted process is put on `restarted` once it serves."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.hold = threading.Event()
        self.release = threading.Event()
        self.due: queue.Queue[str] = queue.Queue()
        self.restarted: queue.Queue[ServiceProcess] = queue.Queue()

    def _spawn(
        self, name: str, env: dict[str, str], module: str, timeout: float, restart: bool = False
    ) -> ServiceProcess:
        if restart and self.hold.is_set():
            self.due.put(name)
            self.release.wait(timeout)
        return super()._spawn(name, env, module, timeout, restart)

    def on_restarted(self, sp: ServiceProcess) -> None:
        self.restarted.put(sp)


@pytest.fixture
def mesh(models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldRestarts]:
    for var in ("LLMESH_REDIS_URL", "LLMESH_ADMISSION_REDIS_URL"):
        monkeypatch.delenv(var, raising=False)  # as on a machine without Redis: the embedded one
    env = {
        "LLMESH_DATA_DIR": str(tmp_path / "data"),
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_EMBEDDED_REDIS_PORT": str(free_port()),
        "LLMESH_UP_METRICS_PORT": "0",
        "LLMESH_MAX_BATCH_SIZE": "4",
        "LLMESH_MESH_TOKEN": secrets.token_urlsafe(32),  # as llmesh up sets it: a restart must carry it
    }
    procs = HeldRestarts(env=env, supervision=Supervision.from_settings(load("cli", {**os.environ, **env})))
    with procs:
        try:
            yield procs
        finally:
            procs.release.set()  # a restart the test held when it failed: stop() ends it


def restarts(mesh: Processes) -> dict[str, float]:
    assert mesh.metrics is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.metrics.port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("llmesh_supervisor_restarts_total{"):
            labels, _, value = line.rpartition(" ")
            found[labels.split('service="')[1].split('"')[0]] = float(value)
    return found


def fresh_generation(target: str, deadline: float, prompt: str) -> gateway_pb2.GenerateResponse:
    """A generation (no cache), asked until answered or the deadline passes. Between attempts it
    waits as long as the gateway's answer says (an open breaker's retry info, at most 0.5 s), else
    POLL_S: a client's back-off, paced through the suite's one polling helper."""
    pause = POLL_S

    def attempt() -> gateway_pb2.GenerateResponse | None:
        nonlocal pause
        try:
            left = max(0.001, deadline - time.monotonic())
            return client.ask(prompt, use_cache=False, use_retrieval=False, max_new_tokens=4, timeout=left)
        except MeshError as exc:
            if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            pause = min(exc.retry_after or POLL_S, 0.5)
            return None

    with Mesh(target, retries=0, throttle=False) as client:
        answer: gateway_pb2.GenerateResponse = wait_until(
            attempt,
            deadline - time.monotonic(),
            interval=lambda: pause,
            message="no fresh generation before the deadline",
        )
        return answer


def cached_answer(client: Mesh) -> gateway_pb2.GenerateResponse:
    """The question's answer from the cache: asked until the store (which runs after the answer,
    in the background) has it; each miss is a whole generation, so three asks leave it time."""
    for _ in range(4):
        answer = client.ask(QUESTION, max_new_tokens=8, use_retrieval=False)
        if answer.cache.hit:
            return answer
    raise AssertionError("the answer was never served from the cache")


#: A method of each internal service: what a local process without the credential tries.
INTERNAL_METHODS = {
    "tokenizer": "/llmesh.v1.Tokenizer/Count",
    "inference": "/llmesh.v1.Inference/GetModelInfo",
    "cache": "/llmesh.v1.Cache/Store",
    "retrieval": "/llmesh.v1.Retrieval/Search",
}


def refused_without_credential(target: str, method: str) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(b"", timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_killed_services_are_restarted_and_the_mesh_comes_back(mesh: HeldRestarts) -> None:
    gateway = mesh.target("gateway")
    before = restarts(mesh)
    # Closed by default: each internal port refuses a caller without the mesh credential (the
    # gateway, which holds it, answers below).
    for name, method in INTERNAL_METHODS.items():
        assert refused_without_credential(mesh.target(name), method) == grpc.StatusCode.UNAUTHENTICATED, name
    with Mesh(gateway, timeout=120) as client:
        cached = cached_answer(client)

        # Inference: killed, and held away until the cached answer was asked for.
        mesh.hold.set()
        inference = mesh.procs["inference"]
        killed_at = time.monotonic()
        inference.proc.send_signal(signal.SIGKILL)
        assert mesh.due.get(timeout=30) == "inference"
        assert inference.proc.poll() == -signal.SIGKILL
        while_away = client.ask(QUESTION, max_new_tokens=8, use_retrieval=False)
        assert while_away.cache.hit and while_away.text == cached.text
        with pytest.raises(MeshError) as down:
            client.ask("Count to three.", use_cache=False, use_retrieval=False, max_new_tokens=4, timeout=30)
        assert down.value.code == grpc.StatusCode.UNAVAILABLE, down.value
        assert mesh.procs["inference"] is inference  # still away: the restart was held
        mesh.hold.clear()
        mesh.release.set()

    deadline = killed_at + BACK_WITHIN_S
    try:
        restarted = mesh.restarted.get(timeout=max(0.001, deadline - time.monotonic()))
    except queue.Empty:
        pytest.fail(f"inference not serving again within {BACK_WITHIN_S:.0f}s of the kill")
    assert restarted.name == "inference" and restarted.port == inference.port
    back = fresh_generation(gateway, deadline, "Name a colour.")
    assert back.text and not back.cache.hit
    print(f"inference: a fresh generation {time.monotonic() - killed_at:.1f}s after the kill")

    # Each other service in turn: killed, restarted on its port, and the mesh answers again.
    for name in ("tokenizer", "cache", "retrieval", "gateway"):
        old = mesh.procs[name]
        killed_at = time.monotonic()
        old.proc.send_signal(signal.SIGKILL)
        new = mesh.restarted.get(timeout=180)
        assert new.name == name and new.proc.pid != old.proc.pid and new.port == old.port
        assert mesh.procs[name] is new
        wait_serving(new.target, 10)
        answer = fresh_generation(gateway, time.monotonic() + 120, f"Say the word {name}.")
        assert answer.text
        print(f"{name}: a fresh generation {time.monotonic() - killed_at:.1f}s after the kill")

    assert not mesh.failed.is_set()
    after = restarts(mesh)
    for name in ("inference", "tokenizer", "cache", "retrieval", "gateway"):
        assert after.get(name, 0) == before.get(name, 0) + 1, (name, before, after)
