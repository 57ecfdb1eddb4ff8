"""What the gateway accepts before it reads a request: each public method's limits (bytes and
element counts, checked on the request's bytes before they are parsed) and the key check that
runs on a call's metadata alone, so an unauthenticated caller's body is never parsed.

The counts are the validation's own bounds (services/gateway/plan.py and the retrieval and
embedding limits): a request the full validation would refuse for its counts is refused here,
before it costs its parsed size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmesh.request_limits import RequestLimit
from llmesh.v1 import gateway_pb2
from services.gateway.admin import AdminKeys
from services.gateway.auth import KeyRing
from services.gateway.plan import MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STOP_SEQUENCES, MAX_TOOL_CALLS, MAX_TOOLS, MAX_TURNS

SERVICE = "/llmesh.v1.Gateway/"
# Ingest, Search and Embed bounds the downstream services hold too (retrieval's own checks).
MAX_DOCUMENTS = 256
MAX_METADATA_KEYS = 32
MAX_EMBED_INPUTS = 256


def request_limits(settings: Any) -> dict[str, RequestLimit]:
    """Each public method's RequestLimit, by full method name."""
    s = settings
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


class KeyGate:
    """The call gate of the gateway's methods: a known API key (while keys are on), an admin key
    for PurgeCache. Which tenants the key may act for is the servicer's to check, on the parsed
    request; this only keeps an unauthenticated caller from costing a parse."""

    def __init__(self, api_keys: KeyRing, admin_keys: AdminKeys) -> None:
        self.api_keys = api_keys
        self.admin_keys = admin_keys

    def __call__(self, method: str, metadata: Sequence[tuple[str, Any]]) -> None:
        if not method.startswith(SERVICE):
            return  # health and reflection
        authorization = next((v for k, v in metadata if k == "authorization"), None)
        token = authorization if isinstance(authorization, str) else None
        if method == f"{SERVICE}PurgeCache":
            self.admin_keys.authorize(token)
        elif self.api_keys.enabled:
            self.api_keys.key_of(token)
