"""Gateway.Embed (no gRPC here): texts embedded by the mesh's embedding model, the one retrieval
indexes documents with, behind the same keys, tenants, key limits, usage counters and trace as a
generation.

The inference admission window does not weigh embeddings: they cost retrieval's CPU, not an
engine's rows. A key's own limits (requests and tokens per minute and per day) do count them, and
usage counts their tokens as input tokens of the embedding model.
"""

from __future__ import annotations

import logging
import time

from opentelemetry import trace

from llmesh.errors import InvalidArgument, LlmeshError, NotFound, PeerError, PermissionDenied
from llmesh.telemetry import current_trace_id
from llmesh.v1 import common_pb2, gateway_pb2, retrieval_pb2
from services.gateway.auth import Caller
from services.gateway.breaker import BreakerOpen
from services.gateway.deadline import Deadline
from services.gateway.hop_errors import PeerCallError
from services.gateway.peers import Peers
from services.gateway.usage import Metered, UsageMeter

log = logging.getLogger("llmesh.gateway")

MAX_MODEL_BYTES = 256
# The embedding model's name is learned from retrieval's answers; a lookup made only to learn it
# (a one-text Embed) gets this long, and after a failure is not tried again for RETRY_NAME_S.
LEARN_NAME_BUDGET_S = 1.0
RETRY_NAME_S = 5.0


def same_model(asked: str, served: str) -> bool:
    """`asked` names the served model: its name, or the name with an organisation prefix
    ("sentence-transformers/all-MiniLM-L6-v2" for "all-MiniLM-L6-v2")."""
    return bool(served) and asked.rsplit("/", 1)[-1] == served


class Embeddings:
    def __init__(self, peers: Peers, usage: UsageMeter) -> None:
        self.peers = peers
        self.usage = usage
        self.name = ""  # the embedding model's name, once retrieval has said it
        self._failed_at = float("-inf")

    async def model_name(self, deadline: Deadline) -> str:
        """The embedding model's name ("" while retrieval cannot say): learned from its answers,
        and asked for once (a one-text Embed) when no answer has said it yet."""
        if self.name or time.monotonic() - self._failed_at < RETRY_NAME_S:
            return self.name
        try:
            found = await self.peers.embed(
                retrieval_pb2.RetrievalEmbedRequest(inputs=["model"]), deadline, LEARN_NAME_BUDGET_S
            )
        except (PeerCallError, BreakerOpen, LlmeshError) as exc:
            self._failed_at = time.monotonic()
            log.info("embedding model name not known yet: %s", exc.message)
            return ""
        self.name = found.model
        return self.name

    @staticmethod
    def _check_name(asked: str, served: str) -> None:
        if served and not same_model(asked, served):
            raise NotFound(
                f"embedding model {asked!r} is not served here; this gateway embeds with {served}",
                reason="MODEL_NOT_FOUND",
                metadata={"model": asked},
            )

    @staticmethod
    def _authorize(caller: Caller | None, model: str) -> None:
        if caller is not None and not caller.key.allows(model):
            raise PermissionDenied(
                f"API key {caller.key_id} may not use model {model!r}",
                reason="MODEL_NOT_ALLOWED",
                metadata={"model": model},
            )

    async def embed(
        self, request: gateway_pb2.EmbedRequest, deadline: Deadline, caller: Caller | None, tenant_ok: bool = True
    ) -> gateway_pb2.EmbedResponse:
        """`tenant_ok`: the tenant's name passed the gateway's check (done by the caller)."""
        started = time.perf_counter()
        tenant = request.tenant or "default"
        name = self.name or "embedding"
        response: gateway_pb2.GenerateResponse | None = None
        span = trace.get_current_span()

        def finish(outcome: str, error: BaseException | None) -> None:
            elapsed = time.perf_counter() - started
            self.usage.finish(caller, tenant, name, outcome, "none", response, error, elapsed, event="embed")

        with Metered(finish):
            bad = []
            if not tenant_ok:
                bad.append(("tenant", "letters, digits, '_', '.', '-' only, at most 64 characters"))
            if len(request.model.encode("utf-8", "surrogatepass")) > MAX_MODEL_BYTES:
                bad.append(("model", f"longer than {MAX_MODEL_BYTES} bytes"))
            if bad:
                raise InvalidArgument(bad)
            if request.model:
                # Unknown while retrieval cannot say: then its answer decides (or its failure stands).
                self._check_name(request.model, await self.model_name(deadline))
            name = self.name or name
            if self.name:
                self._authorize(caller, self.name)
            await self.usage.admit(caller)
            span.set_attribute("llmesh.tenant", tenant)
            span.set_attribute("llmesh.embed.inputs", len(request.inputs))
            try:
                found = await self.peers.embed(retrieval_pb2.RetrievalEmbedRequest(inputs=request.inputs), deadline)
            except PeerCallError as exc:
                cause = exc.cause
                if isinstance(cause, PeerError) and cause.violations():
                    raise InvalidArgument(cause.violations()) from exc  # the fields, as the caller named them
                raise cause from exc
            self.name = name = found.model or self.name
            if request.model:
                self._check_name(request.model, name)
            self._authorize(caller, name)  # a first call, before the name was known
            span.set_attribute("gen_ai.request.model", name)
            usage = common_pb2.Usage(input_tokens=found.input_tokens)
            span.set_attribute("gen_ai.usage.input_tokens", found.input_tokens)
            response = gateway_pb2.GenerateResponse(usage=usage, model=name, trace_id=current_trace_id())
            return gateway_pb2.EmbedResponse(
                embeddings=[gateway_pb2.Embedding(index=i, values=v.values) for i, v in enumerate(found.vectors)],
                model=name,
                usage=usage,
                trace_id=current_trace_id(),
            )
