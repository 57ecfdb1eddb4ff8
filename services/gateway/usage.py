"""Usage per tenant and model, per-key limits and the access log (no gRPC here).

Counters on the gateway's /metrics, by tenant and by the model that answered (its real name):
requests, prompt tokens processed, and of those apart the ones the engine reused from its prefix
cache and the ones it computed, tokens generated, tokens served from the cache instead (saved), sheds, refusals
by a key's own limit, errors. The tenant label set is bounded: tenants named by a key, then the
first LLMESH_USAGE_MAX_TENANTS others seen; later ones fold into `_other`.

One access-log line per request (JSON in production): tenant, key id (never the key), model,
cache tier, tokens, degradations, status, latency; the formatter adds the trace id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from types import TracebackType

from prometheus_client import Counter

from llmesh.errors import LlmeshError, ResourceExhausted
from llmesh.v1 import common_pb2, gateway_pb2
from services.gateway.auth import ANONYMOUS, Caller
from services.gateway.limits import KeyLimiter, KeyLimitExceeded

access = logging.getLogger("llmesh.gateway")


class Metered:
    """A metered call's ending, however it ends: `finish(outcome, error)` runs as the block exits,
    with "ok", a domain error's code (and the error), "cancelled", or "error" for anything else.
    The exception, if any, goes on."""

    def __init__(self, finish: Callable[[str, BaseException | None], None]) -> None:
        self.finish = finish

    def __enter__(self) -> Metered:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc is None:
            self.finish("ok", None)
        elif isinstance(exc, LlmeshError):
            self.finish(exc.code.name.lower(), exc)
        elif isinstance(exc, asyncio.CancelledError):
            self.finish("cancelled", None)
        else:
            self.finish("error", None)


OTHER_TENANTS = "_other"
LABELS = ["tenant", "model"]
REQUESTS = Counter(
    "llmesh_gateway_tenant_requests",
    "Generate, Embed, Ingest and Search requests by tenant and model (every outcome).",
    LABELS,
)
INPUT_TOKENS = Counter(
    "llmesh_gateway_tenant_input_tokens", "Prompt tokens the models processed, by tenant and model.", LABELS
)
CACHED_INPUT_TOKENS = Counter(
    "llmesh_gateway_tenant_cached_input_tokens",
    "Prompt tokens the models processed that the engine reused from its prefix cache (OpenAI's "
    "cached_tokens; part of input_tokens), by tenant and model.",
    LABELS,
)
UNCACHED_INPUT_TOKENS = Counter(
    "llmesh_gateway_tenant_uncached_input_tokens",
    "Prompt tokens the models processed and computed (input_tokens less cached_input_tokens), by tenant and model.",
    LABELS,
)
OUTPUT_TOKENS = Counter("llmesh_gateway_tenant_output_tokens", "Tokens generated, by tenant and model.", LABELS)
SAVED_TOKENS = Counter(
    "llmesh_gateway_tenant_saved_tokens",
    "Tokens served from the answer cache instead of processed and generated (the cached answer's "
    "prompt and completion), by tenant and model.",
    LABELS,
)
SHED = Counter("llmesh_gateway_tenant_shed", "Requests shed for overload, by tenant and model.", LABELS)
LIMITED = Counter(
    "llmesh_gateway_tenant_key_limited",
    "Requests refused by their API key's own limit (rpm, tpm, tpd), by tenant and model.",
    [*LABELS, "limit"],
)
ERRORS = Counter("llmesh_gateway_tenant_errors", "Requests that failed (not shed, not limited).", LABELS)


class TenantLabels:
    """A bounded set of tenant label values: known tenants, then the first `max_others` seen."""

    def __init__(self, max_others: int, known: Callable[[], Iterable[str]] = tuple) -> None:
        self.max_others = max_others
        self.known = known
        self.seen: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self.seen:
            return tenant
        if len(self.seen) < self.max_others or tenant in set(self.known()):
            self.seen.add(tenant)
            return tenant
        return OTHER_TENANTS


class UsageMeter:
    """Per-key limits before a request, counters and the access line after it."""

    def __init__(
        self, limiter: KeyLimiter | None = None, labels: TenantLabels | None = None, counters: bool = True
    ) -> None:
        self.limiter = limiter or KeyLimiter()
        self.labels = labels or TenantLabels(100)
        self.counters = counters  # LLMESH_USAGE_METRICS

    async def admit(self, caller: Caller | None) -> None:
        """KeyLimitExceeded when the caller's key is over one of its limits."""
        if caller is not None and caller.key.limits.any:
            await self.limiter.admit(caller.key.id, caller.key.limits)

    def finish(
        self,
        caller: Caller | None,
        tenant: str,
        model: str,
        outcome: str,
        tier: str,
        response: gateway_pb2.GenerateResponse | None,
        error: BaseException | None,
        elapsed: float,
        event: str = "generate",
    ) -> None:
        """Counts one request and writes its access line. `model`: the label of the model that
        answered (or was asked for, when none did); `event`: what the request was (generate, embed)."""
        caller = caller or Caller(ANONYMOUS, tenant)
        usage = response.usage if response is not None else None
        if usage is not None:
            self.limiter.record(caller.key.id, caller.key.limits, usage.input_tokens + usage.output_tokens)
        if self.counters:
            self._count(caller, model, outcome, usage, error)
        if access.isEnabledFor(logging.INFO):
            self._access(caller, model, outcome, tier, response, error, elapsed, event)

    def _count(
        self, caller: Caller, model: str, outcome: str, usage: common_pb2.Usage | None, error: BaseException | None
    ) -> None:
        labels = (self.labels(caller.tenant), model)
        REQUESTS.labels(*labels).inc()
        if usage is not None:
            if usage.input_tokens:
                INPUT_TOKENS.labels(*labels).inc(usage.input_tokens)
                reused = min(usage.prefix_cached_input_tokens, usage.input_tokens)
                if reused:
                    CACHED_INPUT_TOKENS.labels(*labels).inc(reused)
                if usage.input_tokens > reused:
                    UNCACHED_INPUT_TOKENS.labels(*labels).inc(usage.input_tokens - reused)
            if usage.output_tokens:
                OUTPUT_TOKENS.labels(*labels).inc(usage.output_tokens)
            saved = usage.cached_input_tokens + usage.cached_output_tokens
            if saved:
                SAVED_TOKENS.labels(*labels).inc(saved)
        if isinstance(error, KeyLimitExceeded):
            LIMITED.labels(*labels, error.limit).inc()
        elif isinstance(error, ResourceExhausted):
            SHED.labels(*labels).inc()
        elif outcome not in ("ok", "cancelled"):
            ERRORS.labels(*labels).inc()

    def _access(
        self,
        caller: Caller,
        model: str,
        outcome: str,
        tier: str,
        response: gateway_pb2.GenerateResponse | None,
        error: BaseException | None,
        elapsed: float,
        event: str = "generate",
    ) -> None:
        fields: dict[str, object] = {
            "event": event,
            "tenant": caller.tenant,
            "key_id": caller.key.id,
            "model": model,
            "outcome": outcome,
            "status": error.code.name if isinstance(error, LlmeshError) else "OK" if outcome == "ok" else outcome,
            "cache_tier": tier,
            "duration_ms": round(elapsed * 1000, 2),
        }
        if response is not None:
            fields.update(
                input_tokens=response.usage.input_tokens,
                cached_input_tokens=response.usage.prefix_cached_input_tokens,
                output_tokens=response.usage.output_tokens,
                saved_tokens=response.usage.cached_input_tokens + response.usage.cached_output_tokens,
                degradations=list(response.degradations),
                model_key=response.model,
            )
        if isinstance(error, LlmeshError) and error.reason:
            fields["reason"] = error.reason
        access.info(event, extra={"fields": fields})
