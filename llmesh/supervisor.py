"""Starts the services as separate processes and stops them gracefully: used by `llmesh up`,
the end-to-end tests and the benchmarks (one implementation for all three)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh import redis_server, telemetry
from llmesh.settings import DEFAULT_METRICS_PORTS, parse_models

# Start order: a service starts after the peers it dials.
START_ORDER = ("tokenizer", "inference", "cache", "retrieval", "gateway")
TARGET_ENV = {
    "tokenizer": "LLMESH_TOKENIZER_TARGET",
    "inference": "LLMESH_INFERENCE_TARGET",
    "cache": "LLMESH_CACHE_TARGET",
    "retrieval": "LLMESH_RETRIEVAL_TARGET",
}


class LogEcho:
    """Writes the services' log lines to one stream: JSON lines as they come (a line that is not
    JSON, such as a crash's traceback, is wrapped into one) or, for a person at a terminal, short
    colored lines. LLMESH_LOG_FORMAT decides, as it does for a service's own output."""

    def __init__(self, log_format: str = "auto", stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.console = telemetry.console_format(log_format, self.stream)
        self.color = self.console and telemetry.wants_color(self.stream)
        self._lock = threading.Lock()

    @property
    def raw_json(self) -> bool:
        """JSON lines of the services pass through unparsed."""
        return not self.console

    def show(self, service: str, raw: str, entry: dict[str, Any] | None) -> None:
        """`entry`: the parsed JSON line, None when the line is not JSON (it is wrapped into one)."""
        if entry is None:
            entry = {"ts": _utc_now(), "level": "INFO", "service": service, "logger": "stderr", "msg": raw}
        elif not self.console:
            self._write(raw or json.dumps(entry, default=str))
            return
        entry.setdefault("service", service)
        self._write(telemetry.render_console(entry, self.color) if self.console else json.dumps(entry, default=str))

    def passthrough(self, service: str, raw: str) -> None:
        """JSON output, without parsing a line that looks like JSON."""
        if raw.startswith("{"):
            self._write(raw)
        else:
            self.show(service, raw, None)

    def say(self, msg: str, level: str = "INFO", **fields: object) -> None:
        """A line of the supervisor itself (service `llmesh`), in the same format."""
        self.show("llmesh", "", {"ts": _utc_now(), "level": level, "service": "llmesh", "msg": msg, **fields})

    def _write(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream, flush=True)


def _utc_now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen[bytes]
    port: int = 0
    metrics_port: int = 0
    health_port: int = 0  # the plaintext health-only listener (LLMESH_HEALTH_LISTEN), 0 when none
    # The gateway's OpenAI-compatible HTTP API (0: none, or not listening yet).
    http_port: int = 0
    log_lines: list[str] = field(default_factory=list)
    _listening: threading.Event = field(default_factory=threading.Event)
    _http_listening: threading.Event = field(default_factory=threading.Event)
    _reader: threading.Thread | None = None

    def read_logs(self, echo: LogEcho | None) -> None:
        self._reader = threading.Thread(target=self._pump, args=(echo,), daemon=True)
        self._reader.start()

    def wait_logs(self, timeout: float = 5.0) -> None:
        """After the process exited: its last lines (draining, stopped) are read and echoed."""
        if self._reader is not None:
            self._reader.join(timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def http_base_url(self, timeout: float = 30.0) -> str:
        """`http://127.0.0.1:PORT/v1`, the base URL OpenAI clients take, once the API listens."""
        if not self._http_listening.wait(timeout) or not self.http_port:
            raise RuntimeError(f"{self.name} serves no HTTP API")
        return f"http://127.0.0.1:{self.http_port}/v1"

    def _pump(self, echo: LogEcho | None) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            # A progress bar redraws with \r: only its last state is a line.
            line = raw.decode("utf-8", "replace").rstrip("\n").rsplit("\r", 1)[-1]
            if not line.strip():
                continue
            self.log_lines.append(line)
            if not self._http_listening.is_set() and '"event": "http_listening"' in line:
                try:
                    self.http_port = int(json.loads(line)["http_port"])
                    self._http_listening.set()
                except (ValueError, KeyError, TypeError):
                    pass
            listening = self._listening.is_set()
            # Parsed only when something reads the fields: under load the gateway logs every request.
            if listening and (echo is None or echo.raw_json):
                if echo is not None:
                    echo.passthrough(self.name, line)
                continue
            entry = _parse(line)
            if echo is not None:
                echo.show(self.name, line, entry)
            if not listening and entry is not None and entry.get("event") == "listening":
                try:
                    self.port, self.metrics_port = int(entry["port"]), int(entry["metrics_port"])
                    self.health_port = int(entry.get("health_port", 0))
                    self._listening.set()
                except (ValueError, KeyError, TypeError):
                    pass
        self._listening.set()
        self._http_listening.set()


def _parse(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def tls_credentials(env: Mapping[str, str]) -> grpc.ChannelCredentials | None:
    """Credentials to reach a service started with this environment (TLS when it serves TLS)."""
    if not env.get("LLMESH_TLS_CERT"):
        return None
    read = lambda var: Path(env[var]).read_bytes() if env.get(var) else None  # noqa: E731
    return grpc.ssl_channel_credentials(read("LLMESH_TLS_CA"), read("LLMESH_TLS_KEY"), read("LLMESH_TLS_CERT"))


def wait_serving(
    target: str,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Polls the standard health service until SERVING."""
    deadline = time.monotonic() + timeout
    channel_cm = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel_cm as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{target}: process exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not SERVING after {timeout:.0f}s")
            time.sleep(0.1)


class Mesh:
    """The five services as child processes."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        ports: Mapping[str, int] | None = None,
        services: tuple[str, ...] = START_ORDER,
        echo_logs: bool = False,
        cwd: Path | None = None,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
        log_stream: TextIO | None = None,
    ) -> None:
        self.base_env = {**os.environ, **(env or {})}
        # Settings for one service only (e.g. the gateway's LLMESH_NICE), under extra_env.
        self.service_env = {name: dict(values) for name, values in (service_env or {}).items()}
        self.ports = dict(ports or {})
        self.services = services
        self.echo = LogEcho(self.base_env.get("LLMESH_LOG_FORMAT", "auto"), log_stream) if echo_logs else None
        self.cwd = cwd
        self.procs: dict[str, ServiceProcess] = {}
        #: The embedded Redis, when LLMESH_REDIS_URL is unset (started first, stopped last).
        self.redis: redis_server.EmbeddedRedis | None = None
        #: The embedded Redis of the gateways' shared state, when LLMESH_ADMISSION_REDIS_URL=embedded.
        self.redis_state: redis_server.EmbeddedRedis | None = None
        #: LLMESH_MODELS: one inference service per model (process `inference/NAME`) instead of one.
        try:
            self.models = parse_models(self.base_env.get("LLMESH_MODELS", ""))
        except ValueError as exc:
            raise RuntimeError(f"LLMESH_MODELS: {exc}") from None

    def start_one(
        self, name: str, timeout: float = 180.0, extra_env: Mapping[str, str] | None = None, module: str = ""
    ) -> ServiceProcess:
        """`module`: the service to run when `name` is not one (`inference/NAME` runs `inference`)."""
        env = dict(self.base_env)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Children write JSON lines: the supervisor reads its ports from them and renders them.
        env["LLMESH_LOG_FORMAT"] = "json"
        telemetry.quiet_progress_bars(env)
        env["LLMESH_LISTEN"] = f"127.0.0.1:{self.ports.get(name, 0)}"
        if name not in self.ports:
            env["LLMESH_METRICS_PORT"] = "0"  # ephemeral ports: tests and benchmarks run side by side
            env["LLMESH_HTTP_LISTEN"] = "127.0.0.1:0"
        for peer, var in TARGET_ENV.items():
            if peer in self.procs:
                env[var] = self.procs[peer].target
        if self.models:
            # Every model's tokenizer, and the gateway routing to each model's inference.
            env.setdefault("LLMESH_TOKENIZER_MODELS", ",".join(self.models))
            running = {
                m: "|".join(self.procs[r].target for r in self.replicas(m) if r in self.procs) for m in self.models
            }
            if any(running.values()):
                env["LLMESH_MODELS"] = ",".join(f"{m}={target}" for m, target in running.items() if target)
        env["OTEL_SERVICE_NAME"] = f"llmesh-{name.replace('/', '-').replace('#', '-')}"
        env.update(self.service_env.get(name, {}))
        env.update(extra_env or {})
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{module or name}"],
            env=env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        sp = ServiceProcess(name, proc)
        sp.read_logs(self.echo)
        if not sp._listening.wait(timeout) or not sp.port:
            self._kill(sp)
            raise RuntimeError(f"{name} did not start:\n" + "\n".join(sp.log_lines[-30:]))
        try:
            wait_serving(sp.target, timeout, proc, tls_credentials(env))
        except (RuntimeError, TimeoutError) as exc:
            self._kill(sp)
            raise RuntimeError(f"{name}: {exc}\n" + "\n".join(sp.log_lines[-30:])) from exc
        self.procs[name] = sp
        return sp

    def start(self, timeout: float = 180.0) -> Mesh:
        try:
            for role in redis_server.wanted_roles(self.base_env, self.services):
                server = redis_server.EmbeddedRedis.from_env(self.base_env, self.cwd, role).start()
                if role == redis_server.STATE:
                    self.redis_state = server
                else:
                    self.redis = server
                if self.echo is not None:
                    url = redis_server.redacted(server.url)
                    self.echo.say(f"embedded redis ({role}) ready", url=url, dir=str(server.directory))
            for name in START_ORDER:
                if name == "inference" and self.models and name in self.services:
                    self.start_models(timeout)
                elif name in self.services:
                    self.start_one(name, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def replicas(self, model: str) -> list[str]:
        """The process names of a model's inference replicas: `inference/NAME` for the first,
        `inference/NAME#2`, `#3`, ... for the others (one per `host:port` of its target)."""
        count = len(self.models[model].split("|"))
        return [f"inference/{model}" + (f"#{k + 1}" if k else "") for k in range(count)]

    def start_models(self, timeout: float = 180.0) -> None:
        """One inference service per model of LLMESH_MODELS, each serving its model folder, and
        one per replica where its target lists several (`host:port|host:port`). On fixed ports
        (`llmesh up`) each listens on the port its target names, with metrics on the inference
        metrics port + 100 per process after the first (9093, 9193, ...)."""
        fixed = "inference" in self.ports
        i = 0
        for model, target in self.models.items():
            for name, address in zip(self.replicas(model), target.split("|"), strict=True):
                extra = {"LLMESH_INFERENCE_MODEL": model}
                if fixed:
                    self.ports[name] = int(address.rpartition(":")[2])
                    extra["LLMESH_METRICS_PORT"] = str(DEFAULT_METRICS_PORTS["inference"] + 100 * i)
                # Settings of this model's processes (service_env["inference/NAME"]), else `inference`'s.
                own = self.service_env.get(f"inference/{model}") or self.service_env.get("inference", {})
                self.start_one(name, timeout, {**own, **extra}, module="inference")
                i += 1

    def target(self, name: str) -> str:
        return self.procs[name].target

    def stop_one(self, name: str, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int | None:
        sp = self.procs.pop(name, None)
        if sp is None:
            return None
        if sp.proc.poll() is None:
            sp.proc.send_signal(sig)
            try:
                sp.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill(sp)
        sp.wait_logs()
        return sp.proc.returncode

    def stop(self) -> None:
        for name in reversed(START_ORDER):
            if name == "inference":
                for model in reversed(self.models):
                    for replica in reversed(self.replicas(model)):
                        self.stop_one(replica)
            self.stop_one(name)
        # Processes started under names of their own (`start_one("retrieval-a", module=...)`):
        # newest first, so nothing a caller started outlives the mesh.
        for name in reversed(list(self.procs)):
            self.stop_one(name)
        # After every service drained: the server writes its snapshot and exits.
        for server in (self.redis, self.redis_state):
            if server is not None:
                server.stop()
        self.redis = self.redis_state = None

    @staticmethod
    def _kill(sp: ServiceProcess) -> None:
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait(10)

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
