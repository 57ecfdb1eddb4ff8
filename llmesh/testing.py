"""Test fixtures shared by the suite and the benchmarks: prepared real models, a tiny
random-weight model on the real tokenizer, and services hosted in-process on port 0."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from llmesh import models
from llmesh.server import ServiceApp, ServiceHost
from llmesh.settings import ServiceSettings, load

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def real_models_dir() -> Path:
    """The prepared real models (SmolLM2, MiniLM), prepared on first use."""
    base = Path(os.environ.get("LLMESH_MODELS_DIR") or REPO_ROOT / ".data" / "models")
    models.prepare_all(base)
    return base


def build_tiny_model(models_dir: Path, name: str = "tiny", version: str = "v1", seed: int = 0) -> Path:
    """A 2-layer random-weight Llama on SmolLM2's real tokenizer, prepared like a real model
    (safetensors + manifest), so the loading and serving paths are the real ones."""
    root = models_dir / name
    target = root / version
    if (target / models.MANIFEST).is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    source = real_models_dir() / models.SMOLLM2 / "current"
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Larger than Llama's 0.02: with tiny weights attention is nearly uniform and every prompt
        # yields the same repeated token, which would hide batching bugs (positions, KV rows).
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    target.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(target)
    for fname in TOKENIZER_FILES:
        shutil.copy2(source / fname, target / fname)
    models.write_manifest(target, f"tiny-random-llama-{seed}", {"generator": "llmesh.testing", "seed": seed})
    if not (root / "current").exists():
        models.point_current(root, version)
    return target


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a server that cannot bind port 0 itself)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_settings(service: str, env: Mapping[str, str] | None = None) -> ServiceSettings:
    """Settings for an in-process service on ephemeral ports."""
    merged = {
        **os.environ,
        "LLMESH_LISTEN": "127.0.0.1:0",
        "LLMESH_METRICS_PORT": "0",
        "LLMESH_HTTP_LISTEN": "127.0.0.1:0",
        **(env or {}),
    }
    settings = load(service, merged)
    if not isinstance(settings, ServiceSettings):
        raise ValueError(f"{service!r} is not a service")
    return settings


@contextlib.asynccontextmanager
async def hosted(
    service: str, factory: Callable[[ServiceSettings], ServiceApp], env: Mapping[str, str] | None = None
) -> AsyncIterator[ServiceHost]:
    """Runs one service in this event loop on port 0; yields the host (host.port, host.app)."""
    host = ServiceHost(factory(service_settings(service, env)), service_settings(service, env))
    await host.start()
    # As `serve` does after warm-up: the heap so far (torch, the suite's earlier tests) out of
    # the collector's sight. Every service of a test shares this process, whose full collections
    # otherwise pause all of them for 0.3 s at a time: longer than a cache lookup's budget, so
    # a test's hop failed on where the collector happened to run. Unfrozen again when the host
    # stops, so what earlier tests left behind is still collected.
    gc.freeze()
    try:
        yield host
    finally:
        await host.stop(grace=1.0)
        gc.unfreeze()


class OtlpReceiver:
    """A real OTLP/gRPC trace receiver on loopback (what Jaeger v2 listens for on 4317),
    keeping every span it is sent, for trace assertions across processes."""

    def __init__(self, keep_spans: bool = True) -> None:
        """keep_spans=False only counts spans (cheap: a benchmark's receiver must not compete
        with the load it measures)."""
        import threading
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self
        self.keep_spans = keep_spans
        self.count = 0
        self.spans: list[dict[str, object]] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified on every export

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]
                receiver._collect(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _collect(self, request) -> None:  # type: ignore[no-untyped-def]
        from google.protobuf.json_format import MessageToDict

        if not self.keep_spans:
            n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with self._lock:
                self.count += n
            return
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {
                        a.key: MessageToDict(a.value).popitem()[1] if MessageToDict(a.value) else None
                        for a in span.attributes
                    }
                    found.append(
                        {
                            "service": resource.get("service.name", ""),
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": attributes,
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        }
                    )
        with self._lock:
            self.spans.extend(found)
            self.count += len(found)
            self._arrived.notify_all()

    def wait_for(self, predicate: Callable[[list[dict[str, object]]], bool], timeout: float) -> bool:
        """Blocks until `predicate(spans)` holds (checked on every export) or `timeout` passes."""
        with self._arrived:
            return self._arrived.wait_for(lambda: predicate(self.spans), timeout)

    def trace(self, trace_id: str) -> list[dict[str, object]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        # stop(None) cancels the calls and waits for the shutdown here. stop(0) returns at once
        # and leaves a thread cancelling calls on the C-core server; at interpreter exit (a
        # session fixture's teardown) that thread raced gRPC's own shutdown and segfaulted.
        self._server.stop(None).wait()


#: How often `eventually` and `wait_until` look again: short beside any condition a test waits
#: for, long beside the look itself.
POLL_INTERVAL_S = 0.01


def _pause(interval: float | Callable[[], float]) -> float:
    return interval() if callable(interval) else interval


def _timed_out(timeout: float, message: str | Callable[[], str]) -> AssertionError:
    what = message() if callable(message) else message
    return AssertionError(f"not within {timeout:g} s: {what}" if what else f"condition not met within {timeout:g} s")


async def eventually(
    predicate: Callable[[], Any],
    timeout: float,
    *,
    interval: float | Callable[[], float] = POLL_INTERVAL_S,
    message: str | Callable[[], str] = "",
) -> Any:
    """Looks at `predicate()` (awaited when it returns an awaitable) until it is truthy and returns
    that value; fails the test with `message` when `timeout` seconds pass first.

    The one way a test polls: for a condition the code under test signals by no event a test can
    wait on (a metric, a key in Redis, a port being bound). Where there is an event, wait on it.
    `interval` may be a callable, asked before each pause (a client honouring retry advice)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise _timed_out(timeout, message)
        await asyncio.sleep(min(_pause(interval), max(0.0, deadline - loop.time())))


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    *,
    interval: float | Callable[[], float] = POLL_INTERVAL_S,
    message: str | Callable[[], str] = "",
) -> Any:
    """`eventually` for blocking code (a test without an event loop, a thread)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, message)
        time.sleep(min(_pause(interval), max(0.0, deadline - time.monotonic())))


def record_calls(target: object, names: Sequence[str]) -> list[str]:
    """Wraps the methods `names` of `target` (an instance) so that each call appends its name to
    the returned list, in call order, and then runs as before."""
    calls: list[str] = []
    for name in names:
        real = getattr(target, name)

        def recorded(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(target, name, recorded)
    return calls


class FakeClock:
    """A monotonic clock tests move by hand (for windows, breakers, timeouts)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VLLM_MODEL_NAME = "smollm2"


def vllm_cpu_dtype() -> str:
    """The dtype vLLM's CPU build serves in here, by the rule our engine follows."""
    from llmesh.hardware import cpu_native_bf16

    return "bfloat16" if cpu_native_bf16().native else "float32"


class VllmServer:
    """A real vLLM (CPU build, its own venv made by `make vllm`) serving the prepared SmolLM2 on
    a free loopback port: the third-party engine the openai backend is tested and benchmarked on.

    The `vllm` console script fails in that venv (it looks up the distribution `vllm`, installed
    as `vllm-cpu`), so the OpenAI server module is run directly."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        kv_cache_gib: int = 2,
        max_model_len: int = 2048,
        eager: bool = False,
        otlp_endpoint: str = "",
        extra_args: tuple[str, ...] = (),
        dtype: str = "",
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`extra_args`: more vLLM flags (bench.prefix: `--enable-prefix-caching`); `env`: more
        of its environment (bench.replicas: each server's OpenMP threads on a core of their own).

        `dtype` "" follows our engine's rule (`llmesh.hardware`): bfloat16 where the CPU has
        native bf16, float32 where it has none, since torch emulates bf16 there about 100x
        slower than fp32 (1.2 against 134 GFLOP/s measured on an AVX2-only EPYC): vLLM in bf16
        on such a CPU would measure the emulation, not the engine.

        eager=True skips vLLM's torch.compile step (minutes on 2 cores, redone at every start
        because its compile cache fails to load in 0.32.0): for tests, which check behaviour."""
        self.model_dir = model_dir
        self.log_path = log_path
        self.eager = eager
        self.otlp_endpoint = otlp_endpoint  # vLLM exports its request spans there (OTLP/gRPC)
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len
        self.extra_args = extra_args
        self.extra_env = dict(env or {})
        self.dtype = dtype or vllm_cpu_dtype()
        self.port = free_port()
        self.process: Any = None

    @staticmethod
    def available() -> bool:
        return VLLM_PYTHON.is_file()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import subprocess

        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **self.extra_env,
        }
        cmd = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            VLLM_MODEL_NAME,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(["--enforce-eager"] if self.eager else []),
            *(["--otlp-traces-endpoint", self.otlp_endpoint] if self.otlp_endpoint else []),
            *self.extra_args,
        ]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()

    def wait_ready(self, timeout: float = 900.0) -> None:
        """Until /v1/models lists the model (vLLM serves after about 110 s on 2 cores)."""
        import json
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as answer:
                    ids = [m["id"] for m in json.load(answer)["data"]]
                if VLLM_MODEL_NAME in ids:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM did not serve within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def running_requests(self) -> float:
        """vLLM's own `vllm:num_requests_running` gauge from its /metrics."""
        import urllib.request

        with urllib.request.urlopen(f"{self.origin}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        values = [
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running")
        ]
        return sum(values)

    def kill(self) -> None:
        """SIGKILL to the whole process group (the API server and its engine core)."""
        import signal

        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        import signal
        import subprocess

        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


#: A Redis server the suite may use wholly (its databases are flushed as tests take them) instead
#: of the embedded one it starts otherwise: `LLMESH_TEST_REDIS_URL=redis://:pw@host:6379/0`.
TEST_REDIS_ENV = "LLMESH_TEST_REDIS_URL"


class TestRedis:
    """The Redis of one test run: the server `LLMESH_TEST_REDIS_URL` names, or else a scratch
    valkey-server (the embedded Redis's binary) on a free loopback port, started once and stopped
    at the end. `database()` hands each user (a test, a module's fixture) a database of its own,
    flushed, as a URL; nothing assumes 127.0.0.1:6379."""

    __test__ = False  # not a pytest test class
    DATABASES = 256  # the embedded server's: one per test that asks, no reuse in a run

    def __init__(self, base_url: str, databases: int, server: Any = None) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(base_url)
        self._base = parts._replace(path="")
        self.databases = databases
        self.server = server  # the EmbeddedRedis this run started, if any
        self._next = int(parts.path.strip("/") or 0) % databases
        self._held: set[int] = set()

    @classmethod
    def start(cls, directory: Path, env: Mapping[str, str] | None = None) -> TestRedis:
        """The named server (env[TEST_REDIS_ENV]) or a fresh embedded one under `directory`."""
        named = (os.environ if env is None else env).get(TEST_REDIS_ENV, "")
        if named:
            return cls(named, cls._databases_of(named))
        from llmesh.redis_server import EmbeddedRedis

        server = EmbeddedRedis(free_port(), directory, databases=cls.DATABASES, persist=False).start()
        return cls(server.url, cls.DATABASES, server)

    @staticmethod
    def _databases_of(url: str) -> int:
        import redis

        with redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5) as client:
            try:
                return int(client.config_get("databases").get("databases", 16))  # type: ignore[union-attr]
            except redis.ResponseError:  # CONFIG refused (a managed server): Redis's default
                return 16

    def url(self, db: int) -> str:
        return self._base._replace(path=f"/{db}").geturl()

    @property
    def host(self) -> str:
        return str(self._base.hostname)

    @property
    def port(self) -> int:
        return int(self._base.port or 6379)

    @property
    def password(self) -> str | None:
        return self._base.password

    def database(self) -> str:
        """A database nobody else in this run holds, flushed: its URL (give it back with `release`)."""
        import redis

        for _ in range(self.databases):
            db, self._next = self._next, (self._next + 1) % self.databases
            if db not in self._held:
                break
        else:
            raise RuntimeError(f"all {self.databases} Redis databases are held by tests")
        self._held.add(db)
        url = self.url(db)
        with redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5) as client:
            client.flushdb()
        return url

    def release(self, url: str) -> None:
        from urllib.parse import urlsplit

        self._held.discard(int(urlsplit(url).path.strip("/") or 0))

    @contextlib.contextmanager
    def held(self) -> Iterator[str]:
        """`database()` for the length of a `with` block."""
        url = self.database()
        try:
            yield url
        finally:
            self.release(url)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle in a directed graph (module -> the modules it imports), as the path that closes
    it (first node repeated at the end); None when there is none. For the structure tests."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None
