"""What the gateway accepts before it reads a request: each public method's limits (bytes and
element counts, checked on the request's bytes before they are parsed) and the key check that
runs on a call's metadata alone, so an unauthenticated caller's body is never parsed.

The counts are the validation's own bounds (services/gateway/plan.py and the retrieval and
embedding limits): a request the full validation would refuse for its counts is refused here,
before it costs its parsed size.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from llmesh.errors import ResourceExhausted, Unauthenticated
from llmesh.request_limits import RequestLimit
from llmesh.settings import RequestLimitSettings
from llmesh.v1 import gateway_pb2
from services.gateway.admin import AdminKeys
from services.gateway.auth import KeyRing
from services.gateway.plan import MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STOP_SEQUENCES, MAX_TOOL_CALLS, MAX_TOOLS, MAX_TURNS

SERVICE = "/llmesh.v1.Gateway/"
BATCHES_SERVICE = "/llmesh.v1.Batches/"
# Ingest, Search and Embed bounds the downstream services hold too (retrieval's own checks).
MAX_DOCUMENTS = 256
MAX_METADATA_KEYS = 32
MAX_EMBED_INPUTS = 256


def request_limits(s: RequestLimitSettings) -> dict[str, RequestLimit]:
    """Each public method's RequestLimit, by full method name."""
    generate = RequestLimit(
        gateway_pb2.GenerateRequest,
        s.max_generate_request_bytes,
        "LLMESH_MAX_GENERATE_REQUEST_BYTES",
        {
            "messages": MAX_TURNS,
            "messages.tool_calls": MAX_TOOL_CALLS,
            "tools": MAX_TOOLS,
            "sampling.stop": MAX_STOP_SEQUENCES,
            "sampling.logit_bias": MAX_LOGIT_BIAS,
            "response_format.choices": MAX_CHOICES,
        },
    )
    query = s.max_query_request_bytes
    return {
        f"{SERVICE}Generate": generate,
        f"{SERVICE}GenerateStream": generate,
        f"{SERVICE}Embed": RequestLimit(
            gateway_pb2.EmbedRequest,
            s.max_embed_request_bytes,
            "LLMESH_MAX_EMBED_REQUEST_BYTES",
            {"inputs": MAX_EMBED_INPUTS},
        ),
        f"{SERVICE}Ingest": RequestLimit(
            gateway_pb2.IngestRequest,
            s.max_ingest_request_bytes,
            "LLMESH_MAX_INGEST_REQUEST_BYTES",
            {"documents": MAX_DOCUMENTS, "documents.metadata": MAX_METADATA_KEYS},
        ),
        f"{SERVICE}Search": RequestLimit(
            gateway_pb2.SearchRequest, query, "LLMESH_MAX_QUERY_REQUEST_BYTES", {"filter": MAX_METADATA_KEYS}
        ),
        f"{SERVICE}ListModels": RequestLimit(gateway_pb2.ListModelsRequest, query, "LLMESH_MAX_QUERY_REQUEST_BYTES"),
        f"{SERVICE}PurgeCache": RequestLimit(gateway_pb2.PurgeCacheRequest, query, "LLMESH_MAX_QUERY_REQUEST_BYTES"),
    }


WINDOW_SECONDS = 60.0


class InvalidCallBudget:
    """How many of one key's calls may be refused as invalid in any minute. A client stuck in a
    loop of bad requests (a retry loop resending one oversized body) would otherwise cost the
    gateway a receive of every body before each refusal; past its budget the key is refused on
    its headers alone, for as long as the oldest counted refusal is under a minute old.

    Kept by key id, so the table holds at most one entry per configured key; the anonymous
    caller (keys off) has no identity to hold to account and is never limited."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._refused: dict[str, deque[float]] = {}

    def check(self, key_id: str) -> None:
        """RESOURCE_EXHAUSTED, with the seconds until a refusal leaves the window, when the key
        has spent its budget."""
        times = self._refused.get(key_id)
        if not key_id or times is None or len(times) < self.per_minute:
            return
        wait = times[0] + WINDOW_SECONDS - self._clock()
        if wait > 0:
            raise ResourceExhausted(
                f"this API key sent {self.per_minute} invalid requests within a minute; "
                "fix the requests, then retry after the delay given",
                retry_after=wait,
                reason="INVALID_REQUESTS_LIMIT",
            )

    def record(self, key_id: str) -> None:
        """One of the key's calls was refused as invalid."""
        if not key_id or self.per_minute <= 0:
            return
        times = self._refused.get(key_id)
        if times is None:
            times = self._refused[key_id] = deque(maxlen=self.per_minute)
        times.append(self._clock())


class KeyGate:
    """The call gate of the gateway's methods: a known API key (while keys are on), an admin key
    for PurgeCache, and the key's budget of invalid calls. Which tenants the key may act for is
    the servicer's to check, on the parsed request; this only keeps an unauthenticated caller,
    or one whose requests keep being refused, from costing a receive and a parse."""

    def __init__(
        self, api_keys: KeyRing, admin_keys: AdminKeys, invalid_calls: InvalidCallBudget | None = None
    ) -> None:
        self.api_keys = api_keys
        self.admin_keys = admin_keys
        self.invalid_calls = invalid_calls or InvalidCallBudget(0)

    def __call__(self, method: str, metadata: Sequence[tuple[str, Any]]) -> None:
        if not method.startswith((SERVICE, BATCHES_SERVICE)):
            return  # health and reflection
        token = authorization_in(metadata)
        if method == f"{SERVICE}PurgeCache":
            self.admin_keys.authorize(token)
        elif self.api_keys.enabled:
            self.admit_http(token)

    def admit_http(self, authorization: str | None) -> None:
        """The same check on an HTTP request's `authorization` header, before its body is read."""
        key = self.api_keys.key_of(authorization)
        self.invalid_calls.check(key.id)

    def refused(self, method: str, metadata: Sequence[tuple[str, Any]]) -> None:
        """A call was refused as invalid: it counts toward its key's budget."""
        if method.startswith(SERVICE) and method != f"{SERVICE}PurgeCache":
            self.refused_http(authorization_in(metadata))

    def refused_http(self, authorization: str | None) -> None:
        if self.invalid_calls.per_minute <= 0 or not self.api_keys.enabled:
            return
        try:
            key = self.api_keys.key_of(authorization)
        except Unauthenticated:  # not a known key: the refusal was the key's, counted by nobody
            return
        self.invalid_calls.record(key.id)


def authorization_in(metadata: Sequence[tuple[str, Any]]) -> str | None:
    """A call's `authorization` metadata, when it is text."""
    authorization = next((v for k, v in metadata if k == "authorization"), None)
    return authorization if isinstance(authorization, str) else None
