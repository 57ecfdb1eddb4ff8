"""`llmesh up` restarts a service process that dies: the restart policy on a fake clock (backoff,
per-minute limit, reset after serving a while), and the supervised Mesh on stand-in processes
(`sleep`, no service): the restart gets the same ports, a process stopped on purpose stays
stopped, and one that keeps dying past the limit fails the mesh."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
from collections.abc import Iterator

import pytest

from llmesh.metrics import SUPERVISOR_RESTARTS
from llmesh.settings import SettingsError, load
from llmesh.supervisor import Failure, Mesh, RestartPolicy, ServiceProcess, Supervision, describe_exit


def test_backoff_doubles_from_half_a_second_up_to_the_cap() -> None:
    policy = RestartPolicy(limit=100, backoff_max=10.0)
    delays = []
    for t in range(8):
        decision = policy.exited(now=float(t), serving_since=float(t) - 1.0)
        assert decision.restart and decision.attempt == t + 1
        delays.append(decision.delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_a_cap_below_half_a_second_is_the_whole_backoff() -> None:
    policy = RestartPolicy(limit=100, backoff_max=0.2)
    assert [policy.exited(float(t), None).delay for t in range(3)] == [0.2, 0.2, 0.2]


def test_the_restart_past_the_per_minute_limit_is_refused_until_the_minute_has_passed() -> None:
    policy = RestartPolicy(limit=5, backoff_max=10.0)
    for t in (0.0, 5.0, 10.0, 20.0, 40.0):
        assert policy.exited(t, None).restart
    refused = policy.exited(59.0, None)
    assert not refused.restart and refused.recent == 5 and refused.delay == 0.0
    # 60 s after the first restart it has left the window: one restart fits again.
    again = policy.exited(60.0, None)
    assert again.restart and again.recent == 5


def test_no_restarts_with_a_limit_of_zero() -> None:
    decision = RestartPolicy(limit=0, backoff_max=10.0).exited(0.0, None)
    assert not decision.restart and decision.recent == 0


def test_a_process_that_served_long_enough_starts_the_backoff_over() -> None:
    policy = RestartPolicy(limit=100, backoff_max=10.0, stable_after=30.0)
    for t in range(4):
        policy.exited(float(t), serving_since=float(t))
    assert policy.exited(4.0, serving_since=3.5).delay == 8.0  # served half a second: no reset
    reset = policy.exited(100.0, serving_since=70.0)  # served 30 s
    assert reset.delay == 0.5 and reset.attempt == 1
    assert policy.exited(101.0, serving_since=None).delay == 1.0  # a restart that never served: no reset


def test_exits_are_described_by_signal_or_exit_code() -> None:
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(0) == "exit code 0"


def test_settings_of_llmesh_up() -> None:
    defaults = Supervision.from_settings(load("cli", {}))
    assert (defaults.limit_per_minute, defaults.backoff_max, defaults.metrics_port) == (5, 10.0, 9096)
    chosen = load(
        "cli",
        {
            "LLMESH_RESTART_LIMIT_PER_MINUTE": "2",
            "LLMESH_RESTART_BACKOFF_MAX_SECONDS": "3",
            "LLMESH_UP_METRICS_PORT": "0",
            "LLMESH_METRICS_HOST": "0.0.0.0",
        },
    )
    supervision = Supervision.from_settings(chosen)
    assert (supervision.limit_per_minute, supervision.backoff_max) == (2, 3.0)
    assert (supervision.metrics_host, supervision.metrics_port) == ("0.0.0.0", 0)
    with pytest.raises(SettingsError, match="LLMESH_RESTART_BACKOFF_MAX_SECONDS='0'"):
        load("cli", {"LLMESH_RESTART_BACKOFF_MAX_SECONDS": "0"})
    with pytest.raises(AttributeError):
        _ = load("gateway", {}).restart_limit_per_minute  # no service reads them


def test_a_restart_binds_the_ports_the_process_had_bound() -> None:
    env = {
        "LLMESH_LISTEN": "127.0.0.1:0",
        "LLMESH_HTTP_LISTEN": "127.0.0.1:0",
        "LLMESH_HEALTH_LISTEN": "0.0.0.0:0",
        "LLMESH_METRICS_PORT": "0",
        "LLMESH_MODEL": "smollm2",
    }
    sp = ServiceProcess("gateway", None, 41001, 41002, 41003, 41004, env=env)  # type: ignore[arg-type]
    assert sp.restart_env() == {
        "LLMESH_LISTEN": "127.0.0.1:41001",
        "LLMESH_HTTP_LISTEN": "127.0.0.1:41004",
        "LLMESH_HEALTH_LISTEN": "0.0.0.0:41003",
        "LLMESH_METRICS_PORT": "41002",
        "LLMESH_MODEL": "smollm2",
    }
    fixed = ServiceProcess("gateway", None, 50051, env={"LLMESH_LISTEN": "127.0.0.1:50051"})  # type: ignore[arg-type]
    assert fixed.restart_env() == {"LLMESH_LISTEN": "127.0.0.1:50051"}


class StandIns(Mesh):
    """A supervised Mesh whose processes are `sleep`s standing in for services (no model, no
    port), each one put on `spawned` as it starts."""

    def __init__(self, supervision: Supervision) -> None:
        super().__init__(env={"LLMESH_REDIS_URL": "redis://x:1/0"}, services=(), supervision=supervision)
        self.spawned: queue.Queue[ServiceProcess] = queue.Queue()
        self.next_port = 42000

    def _spawn(
        self, name: str, env: dict[str, str], module: str, timeout: float, restart: bool = False
    ) -> ServiceProcess:
        proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
        self.next_port += 1
        port = int(env["LLMESH_LISTEN"].rpartition(":")[2]) or self.next_port
        sp = ServiceProcess(name, proc, port, env=env, module=module, serving_since=self._clock())
        self.spawned.put(sp)
        return sp


@pytest.fixture
def fast() -> Supervision:
    # A tiny backoff cap: the restarts here wait 10 ms, not 0.5 s.
    return Supervision(limit_per_minute=2, backoff_max=0.01)


@pytest.fixture
def mesh(fast: Supervision) -> Iterator[StandIns]:
    mesh = StandIns(fast)
    yield mesh
    mesh.stop()


def kill(sp: ServiceProcess) -> None:
    sp.proc.send_signal(signal.SIGKILL)


def restarts(name: str) -> float:
    return SUPERVISOR_RESTARTS.labels(service=name)._value.get()


def test_a_killed_process_is_restarted_with_its_environment_and_port(mesh: StandIns) -> None:
    before = restarts("tokenizer")
    first = mesh.start_one("tokenizer", extra_env={"LLMESH_SOME": "x"})
    assert mesh.spawned.get(timeout=10) is first
    kill(first)
    second = mesh.spawned.get(timeout=10)
    assert second.name == "tokenizer" and second.proc.pid != first.proc.pid
    assert second.env["LLMESH_LISTEN"] == f"127.0.0.1:{first.port}" and second.env["LLMESH_SOME"] == "x"
    assert second.port == first.port
    assert restarts("tokenizer") == before + 1
    assert not mesh.failed.is_set()


def test_a_process_stopped_through_stop_one_stays_stopped(mesh: StandIns) -> None:
    before = restarts("cache")
    mesh.start_one("cache")
    mesh.spawned.get(timeout=10)
    watcher = next(t for t in threading.enumerate() if t.name == "supervise-cache")
    mesh.stop_one("cache", sig=signal.SIGKILL)
    watcher.join(10)
    assert not watcher.is_alive()
    assert mesh.spawned.empty() and "cache" not in mesh.procs and restarts("cache") == before


def test_a_process_that_keeps_dying_past_the_limit_fails_the_mesh(mesh: StandIns) -> None:
    sp = mesh.start_one("retrieval")
    mesh.spawned.get(timeout=10)
    for _ in range(2):  # the limit: two restarts a minute
        kill(sp)
        sp = mesh.spawned.get(timeout=10)
    kill(sp)
    assert mesh.failed.wait(10)
    assert mesh.failure == Failure("retrieval", "signal SIGKILL", 2, 2)
    assert str(mesh.failure) == (
        "retrieval exited with signal SIGKILL; restarts in the last minute: 2, the limit "
        "(LLMESH_RESTART_LIMIT_PER_MINUTE=2)"
    )
    assert mesh.spawned.empty()


def test_without_supervision_a_dead_process_stays_dead() -> None:
    class Unsupervised(StandIns):
        def __init__(self) -> None:
            Mesh.__init__(self, env={"LLMESH_REDIS_URL": "redis://x:1/0"}, services=())
            self.spawned = queue.Queue()
            self.next_port = 42000

    mesh = Unsupervised()
    try:
        sp = mesh.start_one("gateway")
        kill(sp)
        sp.proc.wait(10)
        assert not any(t.name.startswith("supervise-") and t.is_alive() for t in threading.enumerate())
        assert mesh.spawned.qsize() == 1
    finally:
        mesh.stop()


def test_the_metrics_endpoint_serves_the_restart_counter(fast: Supervision) -> None:
    import urllib.request

    mesh = StandIns(Supervision(limit_per_minute=2, backoff_max=0.01, metrics_port=0))
    try:
        mesh.start()
        assert mesh.metrics is not None
        before = restarts("inference/tiny#2")
        kill(mesh.start_one("inference/tiny#2"))
        mesh.spawned.get(timeout=10)
        mesh.spawned.get(timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{mesh.metrics.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert f'llmesh_supervisor_restarts_total{{service="inference/tiny#2"}} {before + 1}' in text
        assert "llmesh_serving" not in text  # the services' metrics are not the supervisor's
    finally:
        mesh.stop()
    assert mesh.metrics is None
