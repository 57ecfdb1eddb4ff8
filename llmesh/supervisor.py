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
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh import redis_server, telemetry
from llmesh.metrics import SUPERVISOR_REGISTRY, SUPERVISOR_RESTARTS, MetricsEndpoint
from llmesh.settings import DEFAULT_METRICS_PORTS, CliSettings, parse_models

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


@dataclass(frozen=True)
class RestartDecision:
    """What to do about a service process that exited on its own."""

    restart: bool
    #: Seconds to wait before starting it again (0 when it is not restarted).
    delay: float
    #: Deaths in a row, this one included, since it last served `stable_after` seconds.
    attempt: int
    #: Restarts within the last `window` seconds (this one included when it restarts).
    recent: int


class RestartPolicy:
    """When to restart one service process that died: exponential backoff (`initial`, doubling,
    at most `backoff_max`), back to `initial` once a process served `stable_after` seconds, and at
    most `limit` restarts within any `window` seconds; the next death past it is final.

    Pure bookkeeping on the times it is given (no clock, no sleeping), one per process name."""

    def __init__(
        self,
        limit: int,
        backoff_max: float,
        initial: float = 0.5,
        stable_after: float = 30.0,
        window: float = 60.0,
    ) -> None:
        self.limit = limit
        self.initial = min(initial, backoff_max)
        self.backoff_max = backoff_max
        self.stable_after = stable_after
        self.window = window
        self._restarts: deque[float] = deque()
        self._attempt = 0

    def exited(self, now: float, serving_since: float | None) -> RestartDecision:
        """`serving_since`: when the process that exited became SERVING (None: it never did)."""
        if serving_since is not None and now - serving_since >= self.stable_after:
            self._attempt = 0
        self._attempt += 1
        while self._restarts and self._restarts[0] <= now - self.window:
            self._restarts.popleft()
        if len(self._restarts) >= self.limit:
            return RestartDecision(False, 0.0, self._attempt, len(self._restarts))
        self._restarts.append(now)
        delay = min(self.initial * 2 ** (self._attempt - 1), self.backoff_max)
        return RestartDecision(True, delay, self._attempt, len(self._restarts))


@dataclass(frozen=True)
class Supervision:
    """`Mesh(supervision=...)`: restart a service process that exits on its own (what `llmesh up`
    does); without it a dead service stays dead (the tests and benchmarks stop services on purpose)."""

    limit_per_minute: int = 5
    backoff_max: float = 10.0
    #: `llmesh up`'s own /metrics (the restart counter); None: no endpoint.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    clock: Callable[[], float] = time.monotonic

    @classmethod
    def from_settings(cls, settings: CliSettings) -> Supervision:
        """From `load("cli")`: LLMESH_RESTART_LIMIT_PER_MINUTE, LLMESH_RESTART_BACKOFF_MAX_SECONDS,
        LLMESH_UP_METRICS_PORT on LLMESH_METRICS_HOST."""
        return cls(
            limit_per_minute=settings.supervisor.restart_limit_per_minute,
            backoff_max=settings.supervisor.restart_backoff_max_seconds,
            metrics_host=settings.runtime.metrics_host,
            metrics_port=settings.supervisor.metrics_port,
        )

    def policy(self) -> RestartPolicy:
        return RestartPolicy(self.limit_per_minute, self.backoff_max)


def describe_exit(returncode: int | None) -> str:
    """`signal SIGKILL` for a process a signal ended (Popen's negative codes), else `exit code N`."""
    if returncode is not None and returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class ServiceStartError(RuntimeError):
    """A service process did not come up (it exited, or never served); it is stopped."""

    def __init__(self, message: str, process: ServiceProcess) -> None:
        super().__init__(message)
        self.process = process


def _pin_port(address: str, port: int) -> str:
    """`host:0` -> `host:port` once the process bound `port`: a restart binds the same one."""
    host, sep, current = address.rpartition(":")
    return f"{host}:{port}" if sep and current == "0" and port else address


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
    #: What it was started with: a restart runs the same module with the same environment.
    env: dict[str, str] = field(default_factory=dict)
    module: str = ""
    #: When it answered SERVING (the supervision's clock), None until then.
    serving_since: float | None = None
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

    def restart_env(self) -> dict[str, str]:
        """Its environment with every port it had bound itself (port 0) pinned: peers and callers
        dial the addresses it had, so a restart listens on them again."""
        env = dict(self.env)
        for var, port in (
            ("LLMESH_LISTEN", self.port),
            ("LLMESH_HTTP_LISTEN", self.http_port),
            ("LLMESH_HEALTH_LISTEN", self.health_port),
        ):
            if env.get(var):
                env[var] = _pin_port(env[var], port)
        if env.get("LLMESH_METRICS_PORT") == "0" and self.metrics_port:
            env["LLMESH_METRICS_PORT"] = str(self.metrics_port)
        return env

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


@dataclass(frozen=True)
class Failure:
    """Why a supervised mesh gave up: a service that kept dying past the restart limit."""

    service: str
    exit: str
    restarts_last_minute: int
    limit: int

    def __str__(self) -> str:
        if not self.limit:
            return f"{self.service} exited with {self.exit} (LLMESH_RESTART_LIMIT_PER_MINUTE=0: no restarts)"
        return (
            f"{self.service} exited with {self.exit}; restarts in the last minute: {self.restarts_last_minute}, "
            f"the limit (LLMESH_RESTART_LIMIT_PER_MINUTE={self.limit})"
        )


class Mesh:
    """The five services as child processes.

    With `supervision` (what `llmesh up` passes) a process that exits on its own is started again,
    with the same module, environment and ports, after a backoff; one that keeps dying past the
    limit sets `failed` (`failure` says which and why) for the owner to stop the mesh. A process
    stopped through `stop_one` or `stop` is never restarted. Without it a dead service stays dead:
    the tests and benchmarks stop services on purpose and expect them to stay stopped."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        ports: Mapping[str, int] | None = None,
        services: tuple[str, ...] = START_ORDER,
        echo_logs: bool = False,
        cwd: Path | None = None,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
        log_stream: TextIO | None = None,
        supervision: Supervision | None = None,
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
        #: The embedded state Redis of the gateways (batch jobs, stored responses; the shared window
        #: too with LLMESH_ADMISSION_REDIS_URL=embedded), when LLMESH_STATE_REDIS_URL=embedded.
        self.redis_state: redis_server.EmbeddedRedis | None = None
        #: LLMESH_MODELS: one inference service per model (process `inference/NAME`) instead of one.
        try:
            self.models = parse_models(self.base_env.get("LLMESH_MODELS", ""))
        except ValueError as exc:
            raise RuntimeError(f"LLMESH_MODELS: {exc}") from None
        self.supervision = supervision
        self._clock = supervision.clock if supervision is not None else time.monotonic
        # The supervisor's own lines (restarts) show even when the services' lines do not.
        self._say = (self.echo or LogEcho(self.base_env.get("LLMESH_LOG_FORMAT", "auto"), log_stream)).say
        #: `llmesh up`'s /metrics (Supervision.metrics_port), open while the mesh runs.
        self.metrics: MetricsEndpoint | None = None
        #: Set when a supervised service kept dying past the restart limit; `failure` says why.
        self.failed = threading.Event()
        self.failure: Failure | None = None
        # `procs` is changed by the restart threads and by the callers of stop_one and stop.
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        # Set by request_stop(), from a signal handler: a plain flag, as taking a lock there could
        # deadlock with the interrupted main thread.
        self._stop_requested = False
        # Restarts under way (started, not yet serving): stop_one and stop end them.
        self._restarting: dict[str, ServiceProcess] = {}
        self._watchers: list[threading.Thread] = []

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
        sp = self._spawn(name, env, module or name, timeout)
        with self._lock:
            self.procs[name] = sp
        if self.supervision is not None:
            watcher = threading.Thread(
                target=self._supervise, args=(name, sp, timeout), name=f"supervise-{name}", daemon=True
            )
            self._watchers = [w for w in self._watchers if w.is_alive()] + [watcher]
            watcher.start()
        return sp

    def request_stop(self) -> None:
        """No restarts from now on, before stop() runs; safe in a signal handler. Ctrl-C sends
        SIGINT to the services too: they drain and exit on their own, and must stay stopped."""
        self._stop_requested = True

    def _stopped(self) -> bool:
        return self._stop_requested or self._stopping.is_set()

    def _spawn(
        self, name: str, env: dict[str, str], module: str, timeout: float, restart: bool = False
    ) -> ServiceProcess:
        """Starts one process and waits until it answers SERVING (ServiceStartError, with the process
        stopped, when it does not). `restart`: registered so that stop_one and stop can end it."""
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{module}"],
            env=env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        sp = ServiceProcess(name, proc, env=env, module=module)
        sp.read_logs(self.echo)
        if restart:
            with self._lock:
                abandoned = self._stopped()
                self._restarting[name] = sp
            if abandoned:
                self._kill(sp)
        try:
            if not sp._listening.wait(timeout) or not sp.port:
                self._kill(sp)
                raise ServiceStartError(f"{name} did not start:\n" + "\n".join(sp.log_lines[-30:]), sp)
            try:
                wait_serving(sp.target, timeout, proc, tls_credentials(env))
            except (RuntimeError, TimeoutError) as exc:
                self._kill(sp)
                raise ServiceStartError(f"{name}: {exc}\n" + "\n".join(sp.log_lines[-30:]), sp) from exc
        finally:
            if restart:
                with self._lock:
                    if self._restarting.get(name) is sp:
                        del self._restarting[name]
        sp.serving_since = self._clock()
        return sp

    def _supervise(self, name: str, registered: ServiceProcess, timeout: float) -> None:
        """Restarts `name` each time its process exits on its own, until the mesh stops, the
        process is stopped on purpose (stop_one), or it dies past the restart limit."""
        assert self.supervision is not None
        policy = self.supervision.policy()
        exited = registered  # the process whose end is awaited: the registered one, or a failed restart
        while True:
            exited.proc.wait()
            with self._lock:
                # Gone from `procs`, or replaced by a start_one of the caller's: stopped on purpose.
                if self._stopped() or self.procs.get(name) is not registered:
                    return
                decision = policy.exited(self._clock(), exited.serving_since)
            how = describe_exit(exited.proc.returncode)
            if not decision.restart:
                self.failure = Failure(name, how, decision.recent, self.supervision.limit_per_minute)
                self.failed.set()
                return
            SUPERVISOR_RESTARTS.labels(service=name).inc()
            self._say(
                f"{name} exited with {how}; restart {decision.attempt} in {decision.delay:.3g}s",
                level="WARNING",
                process=name,
                exit=how,
                attempt=decision.attempt,
                backoff_s=decision.delay,
                restarts_last_minute=decision.recent,
            )
            if self._stopping.wait(decision.delay):
                return
            with self._lock:
                if self._stopped() or self.procs.get(name) is not registered:
                    return
            try:
                started = self._spawn(name, registered.restart_env(), registered.module, timeout, restart=True)
            except ServiceStartError as exc:
                exited = exc.process
                last = exc.process.log_lines[-1:] or [""]
                how = describe_exit(exc.process.proc.returncode)
                self._say(f"{name} did not start again ({how})", level="ERROR", process=name, last_line=last[0])
                continue
            with self._lock:
                abandoned = self._stopped() or self.procs.get(name) is not registered
                if not abandoned:
                    self.procs[name] = started
            if abandoned:
                self._kill(started)
                return
            self._say(f"{name} serving again", process=name, target=started.target, attempt=decision.attempt)
            self.on_restarted(started)
            registered = exited = started

    def on_restarted(self, sp: ServiceProcess) -> None:
        """Called once a restarted process serves and is in `procs` (a test waits on it)."""

    def start(self, timeout: float = 180.0) -> Mesh:
        self._stopping.clear()
        self._stop_requested = False
        try:
            supervision = self.supervision
            if supervision is not None and supervision.metrics_port is not None and self.metrics is None:
                host, port = supervision.metrics_host, supervision.metrics_port
                try:
                    self.metrics = MetricsEndpoint(host, port, SUPERVISOR_REGISTRY)
                except OSError as exc:
                    raise RuntimeError(f"metrics endpoint {host}:{port}: {exc.strerror or exc}") from exc
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
        """Stops one process for good: a supervised mesh does not restart it."""
        with self._lock:
            sp = self.procs.pop(name, None)
            starting = self._restarting.pop(name, None)
        if starting is not None:
            self._kill(starting)  # a restart under way: not serving yet, nothing to drain
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
        self._stopping.set()  # no restarts from here on
        with self._lock:
            starting = list(self._restarting.values())
            self._restarting.clear()
        for sp in starting:
            self._kill(sp)
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
        for watcher in self._watchers:
            watcher.join(10)
        self._watchers = []
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    @staticmethod
    def _kill(sp: ServiceProcess) -> None:
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait(10)

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
