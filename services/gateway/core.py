"""The gateway object: its wiring (peers, models and aliases, admission, collection versions)
and its public entry points (generate, ingest, purge, embed, search, the model lists). A
request's own way is `pipeline.RequestPath`, over the `Plan` that `plan.validate` builds; this
module runs one path per attempt (an alias tries its models in order) and records the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence

from llmesh import chunking
from llmesh.chat_template import ChatTemplate
from llmesh.errors import InvalidArgument, LlmeshError, NotFound, PermissionDenied, ResourceExhausted, Unavailable
from llmesh.metrics import trace_exemplar
from llmesh.telemetry import current_trace_id
from llmesh.v1 import cache_pb2, common_pb2, gateway_pb2, inference_pb2, retrieval_pb2
from services.gateway import metrics
from services.gateway.admission import AdmissionController, LoadBook, RedisWeightWindow, WeightWindow
from services.gateway.auth import Caller
from services.gateway.breaker import State
from services.gateway.deadline import Deadline
from services.gateway.embeddings import Embeddings
from services.gateway.hop_errors import BREAKER_FAILURE_CODES, DOWNSTREAM_ERRORS, PeerCallError
from services.gateway.ingest import IngestBudget
from services.gateway.limits import KeyLimitExceeded
from services.gateway.peers import Peers
from services.gateway.pipeline import Delta, Final, RequestPath, RequestState, server_timing
from services.gateway.plan import (
    DEFAULT_SYSTEM_PROMPT,
    NAME_RE,
    GatewayConfig,
    InputTokenPredictor,
    Plan,
    build_messages,
    one_turn_form,
    validate,
)
from services.gateway.request_gateway import ModelChoice, ModelRoute
from services.gateway.shape import cache_scope
from services.gateway.usage import Metered, UsageMeter
from services.gateway.versions import BACKGROUND_DEADLINE_S

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "Delta",
    "Final",
    "Gateway",
    "GatewayConfig",
    "InputTokenPredictor",
    "ModelChoice",
    "ModelRoute",
    "build_messages",
    "model_key_of",
    "one_turn_form",
    "server_timing",
    "validate",
]

log = logging.getLogger("llmesh.gateway")

MODEL_INFO_TTL_S = 30.0
# Cache stores run after the final message, in the background; past this many the rest are skipped.
MAX_BACKGROUND_STORES = 64


def _worth_a_fallback(exc: BaseException) -> bool:
    """An alias's next model is tried when this one is unavailable or shed, not when
    the request itself is wrong (those errors would be the same on any model)."""
    if isinstance(exc, KeyLimitExceeded):
        return False
    if isinstance(exc, PeerCallError):
        return exc.code in BREAKER_FAILURE_CODES or exc.code.name == "RESOURCE_EXHAUSTED"
    return isinstance(exc, (Unavailable, ResourceExhausted))


def model_key_of(info: inference_pb2.ModelInfo) -> str:
    """`model_id@sha256[:16]/dtype` ("SmolLM2-135M-Instruct@0123456789abcdef/bfloat16"); the
    dtype is left out where the backend does not report one (the openai backend)."""
    key = f"{info.model_id}@{info.sha256[:16]}"
    return f"{key}/{info.dtype}" if info.dtype else key


class Gateway:
    def __init__(
        self,
        peers: Peers,
        config: GatewayConfig,
        window: WeightWindow | RedisWeightWindow,
        models: Sequence[str] = ("",),
        default_model: str = "",
        aliases: Mapping[str, Sequence[str]] | None = None,
        usage: UsageMeter | None = None,
        loads: LoadBook | None = None,
        local_templates: Mapping[str, ChatTemplate] | None = None,
        ingest_budget_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.peers = peers
        self.ingests = IngestBudget(ingest_budget_bytes)
        # Chat templates by tokenizer name (a route's `tokenizer`): learned from the tokenizer
        # service, and those read from the models folder at start (for while it is away).
        self.templates: dict[str, ChatTemplate] = {}
        self.local_templates = dict(local_templates or {})
        self._learning: dict[str, asyncio.Task[None]] = {}
        self.config = config
        self.window = window
        # Admission from the engines' own load (`loads`, fed by WatchLoad), the window
        # and the learned limit as its fallback, behind one controller.
        self.admission = AdmissionController(window, loads)
        metrics.ADMISSION_BUDGET.set(window.config.budget)
        self.routes = {name: ModelRoute(name) for name in models}
        if default_model not in self.routes:
            raise ValueError(f"default model {default_model!r} is not one of {list(self.routes)}")
        self.default_model = default_model
        # Model aliases: an ordered list of models, the next serving when one cannot.
        self.aliases = {name: tuple(chain) for name, chain in (aliases or {}).items()}
        for alias, chain in self.aliases.items():
            if alias in self.routes or not chain or any(not m or m not in self.routes for m in chain):
                raise ValueError(f"alias {alias!r}: must not be a model's name and must list served models")
        self.usage = usage or UsageMeter()
        self.embeddings = Embeddings(peers, self.usage)
        # One per model (a tokenizer's rate is wrong for another); "" serves until a model is known.
        self.predictors: dict[str, InputTokenPredictor] = {}
        self.predictor = self.predictor_for("")
        # The collection versions are the retrieval upstream's; how long one is trusted is ours.
        self.versions = peers.retrieval.versions
        self.versions.ttl = config.version_ttl
        self._background: set[asyncio.Task[None]] = set()
        self.stores_skipped = 0

    def predictor_for(self, model: str) -> InputTokenPredictor:
        found = self.predictors.get(model)
        if found is None:
            found = self.predictors[model] = InputTokenPredictor()
        return found

    async def model_key(self, deadline: Deadline, model: str = "") -> str:
        """Model id + weights digest + dtype of one model (a route name; "" = the default): new
        weights, or the same weights served in another dtype (or quantization), never serve
        answers cached from the old ones. A named model's key starts with its name, so
        one model's cached answers never serve another, even on the same weights."""
        route = self.routes[model or self.default_model]
        if route.learned is None or time.monotonic() - route.learned[0] > MODEL_INFO_TTL_S:
            try:
                return await self._learn(route, deadline)
            except DOWNSTREAM_ERRORS:
                if route.learned is None:
                    raise
                return route.learned[1]  # inference down: cached answers for the last known weights still serve
        return route.learned[1]

    async def _learn(self, route: ModelRoute, deadline: Deadline) -> str:
        """Asks the model's inference for its model key now (its upstream's `:info` call)."""
        now = time.monotonic()
        info = await self.peers.model_info(deadline, route.name)
        prefix = f"{route.name}:" if route.name else ""
        route.learned = (now, f"{prefix}{model_key_of(info)}")
        route.dtype = info.dtype
        return route.learned[1]

    async def route(self, model: str, deadline: Deadline) -> ModelRoute:
        """The route of the model a request names ("" = the default); NotFound naming the model
        and the ones served."""
        if not model:
            return self.routes[self.default_model]
        found = self.routes.get(model)
        if found is not None and found.name:
            return found
        unnamed = self.routes.get("")
        if unnamed is not None:
            # The one model of a deployment that names none answers to the id it reports.
            await self.model_key(deadline, "")
            if unnamed.public_name() == model:
                return unnamed
        raise NotFound(
            f"model {model!r} is not served here; this gateway serves {', '.join(await self.served_models(deadline))}",
            reason="MODEL_NOT_FOUND",
            metadata={"model": model},
        )

    async def resolve(self, model: str, deadline: Deadline) -> ModelChoice:
        """The model a request names resolved once: an alias's routes in order, or the one
        model's route (`route`: NotFound naming the models served)."""
        chain = self.aliases.get(model)
        if chain is not None:
            return ModelChoice(model, tuple(self.routes[name] for name in chain), alias=True)
        return ModelChoice(model, (await self.route(model, deadline),))

    async def served_models(self, deadline: Deadline) -> list[str]:
        """Names of the models this gateway answers with, the default first: the one list every
        API shows. The unnamed model of a one-model deployment shows the id its inference reports."""
        names: list[str] = []
        for route in sorted(self.routes.values(), key=lambda r: r.name != self.default_model):
            if not route.name:
                await self.model_key(deadline, "")
            name = route.public_name()
            if name is not None:
                names.append(name)
        return [*names, *self.aliases]  # an alias is asked for by name as a model is

    async def served_dtypes(self, deadline: Deadline) -> dict[str, str]:
        """The dtype each served model's inference last reported ("bfloat16+int4"), by the name
        `served_models` lists (models whose backend says none, and aliases, are left out)."""
        for route in self.routes.values():
            with contextlib.suppress(*DOWNSTREAM_ERRORS):  # a model whose inference is down shows no dtype
                await self.model_key(deadline, route.name)
        return {name: r.dtype for r in self.routes.values() if r.dtype and (name := r.public_name()) is not None}

    def _label(self, model: str) -> str:
        """The metrics label of a request's model: a served model's name (a bounded set), never
        the caller's text ("unknown" for a name not served)."""
        if model in self.aliases:
            return model  # an alias's name is a configured, bounded label value
        route = self.routes.get(model) if model else self.routes[self.default_model]
        if route is None and "" in self.routes and self.routes[""].public_name() == model:
            route = self.routes[""]
        if route is None:
            return "unknown"
        # The unnamed model of a one-model deployment: the id its inference reports, once learned.
        return route.public_name() or "default"

    async def list_models(self, deadline: Deadline) -> gateway_pb2.ListModelsResponse:
        """Every model with its key and whether its inference answers now: each is asked for its
        model info (all at once, with the model-info budget each, through its breaker); one that
        fails or whose breaker is open is listed unavailable, with the key last learned."""

        async def entry(route: ModelRoute) -> gateway_pb2.ModelEntry:
            try:
                key, available = await self._learn(route, deadline), True  # asked again now
            except DOWNSTREAM_ERRORS:
                # The last key is listed, and the next request asks again (it serves meanwhile).
                route.expire()
                key, available = (route.learned[1] if route.learned is not None else ""), False
            return gateway_pb2.ModelEntry(
                name=route.public_name() or "",
                default=route.name == self.default_model,
                key=key,
                available=available,
            )

        ordered = sorted(self.routes.values(), key=lambda r: r.name != self.default_model)
        embedder = asyncio.ensure_future(self.embedding_model(deadline))
        entries = list(await asyncio.gather(*(entry(r) for r in ordered)))
        by_name = {e.name: e for e in entries}
        for alias, chain in self.aliases.items():  # available while one of its models is
            available = any(by_name[m].available for m in chain if m in by_name)
            entries.append(gateway_pb2.ModelEntry(name=alias, available=available, alias_of=chain))
        name = await embedder
        if name:  # the embedding model, for Embed (while retrieval can say its name): last, no key
            entries.append(gateway_pb2.ModelEntry(name=name, available=True))
        return gateway_pb2.ListModelsResponse(models=entries)

    async def embedding_model(self, deadline: Deadline) -> str:
        """The mesh's embedding model's name, the one Embed and /v1/embeddings embed with ("" while
        retrieval cannot say it): learned from retrieval's answers (services/gateway/embeddings.py)."""
        return await self.embeddings.model_name(deadline)

    def cache_scope(self, plan: Plan, model: str, collection: str, version: int) -> cache_pb2.CacheScope:
        """The cache scope of the plan as it stands, with the retrieval it uses (services/gateway/shape.py)."""
        return cache_scope(
            model=model,
            tenant=plan.tenant,
            sampling=plan.sampling,
            shape=plan.shape,
            collection=collection,
            version=version,
            top_k=plan.top_k,
            min_score=self.config.min_context_score,
        )

    async def generate(
        self,
        request: gateway_pb2.GenerateRequest,
        deadline: Deadline,
        caller: Caller | None = None,
        choice: ModelChoice | None = None,
    ) -> AsyncIterator[Delta | Final]:
        """Streams text deltas, then one Final with the whole response; records the outcome.
        `caller`: the API key and tenant it comes from (its limits and usage; None: anonymous).
        `choice`: the request's model as the caller resolved it already (`resolve`), else the
        path resolves it."""
        started = time.perf_counter()
        tier = "none"
        outcome = "error"
        label = self._label(request.model)
        response: gateway_pb2.GenerateResponse | None = None
        error: BaseException | None = None
        attempts: list[RequestState] = []
        try:
            # The key's models, then its own limits, before any work.
            requested = request.model or self.default_model
            if caller is not None and requested and not caller.key.allows(requested):
                raise PermissionDenied(
                    f"API key {caller.key_id} may not use model {requested!r}",
                    reason="MODEL_NOT_ALLOWED",
                    metadata={"model": requested},
                )
            await self.usage.admit(caller)
            async for event in self._generate(request, deadline, attempts, choice):
                if isinstance(event, Final):
                    tier = (
                        "none"
                        if not event.response.cache.hit
                        else ("exact" if event.response.cache.tier == common_pb2.CACHE_TIER_EXACT else "semantic")
                    )
                    outcome = "ok"
                    response = event.response
                    label = self._label(response.answered_by) if response.answered_by else label
                yield event
        except LlmeshError as exc:
            outcome = exc.code.name.lower()
            error = exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            elapsed = time.perf_counter() - started
            if label == "default":  # asked before the unnamed model's id was learned: learned by now
                label = self._label(request.model)
            metrics.REQUESTS.labels(outcome, tier, label).inc()
            if outcome == "ok":
                metrics.REQUEST_DURATION.labels(tier, label).observe(elapsed, trace_exemplar())
            # Usage per tenant and model, the key's tokens, one access-log line per request.
            # A request that ended early (cancelled, failed mid-stream) is billed what it spent.
            if response is None and any(p.spent.input_tokens for p in attempts):
                spent = common_pb2.Usage(
                    input_tokens=sum(p.spent.input_tokens for p in attempts),
                    output_tokens=sum(p.spent.output_tokens for p in attempts),
                )
                response = gateway_pb2.GenerateResponse(usage=spent, trace_id=current_trace_id())
            self.usage.finish(caller, request.tenant or "default", label, outcome, tier, response, error, elapsed)

    async def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        deadline: Deadline,
        attempts: list[RequestState] | None = None,
        choice: ModelChoice | None = None,
    ) -> AsyncIterator[Delta | Final]:
        attempts = [] if attempts is None else attempts
        plan = validate(request, self.config)
        if choice is None or choice.asked != request.model:  # not resolved by the caller
            chain = self.aliases.get(request.model)
            if chain is None:
                # Resolved by the path itself, after the lane is checked.
                path = RequestPath(self, plan, deadline)
                attempts.append(path.state)
                async for event in self._attempt(path):
                    yield event
                return
            choice = ModelChoice(request.model, tuple(self.routes[name] for name in chain), alias=True)
        if not choice.alias:
            path = RequestPath(self, plan, deadline, choice.routes[0])
            attempts.append(path.state)
            async for event in self._attempt(path):
                yield event
            return
        # An alias tries its models in order (model_fallback).
        for i, route in enumerate(choice.routes):
            name, last = route.name, i == len(choice.routes) - 1
            if not last and self.peers.model(name).state() is State.OPEN:
                log.info("alias %s: %s unavailable (breaker open), trying the next model", request.model, name)
                continue
            path = RequestPath(self, plan.for_model(name), deadline, route, fallback=i > 0)
            attempts.append(path.state)
            answered = False
            try:
                async for event in self._attempt(path):
                    answered = True
                    yield event
                return
            except (Unavailable, PeerCallError, ResourceExhausted) as exc:
                if answered or last or not _worth_a_fallback(exc):
                    raise
                log.info("alias %s: %s could not answer (%s), trying the next model", request.model, name, exc)

    async def _attempt(self, path: RequestPath) -> AsyncIterator[Delta | Final]:
        started, state = time.perf_counter(), path.state
        try:
            async for event in path.run():
                yield event
        except ResourceExhausted as exc:
            # A shed caller sees where the time went before the refusal, as a served one does.
            total = (time.perf_counter() - started) * 1000
            exc.extra_trailing.append(("server-timing", server_timing({**state.timings, "total": total})))
            raise
        finally:
            state.release()  # every exit path: what was held or reserved and not generated goes back

    def learn_template(self, tokenizer: str) -> None:
        """Asks the tokenizer, once per model in the background, for the chat template the
        gateway renders with while the tokenizer is away."""
        if tokenizer in self.templates or tokenizer in self._learning:
            return

        async def learn() -> None:
            try:
                found = await self.peers.get_chat_template(Deadline.after(BACKGROUND_DEADLINE_S), tokenizer)
                self.templates[tokenizer] = ChatTemplate(found.template, dict(found.special_tokens))
            except (*DOWNSTREAM_ERRORS, LlmeshError, ValueError) as exc:
                log.warning("could not learn the chat template of %r: %s", tokenizer, exc)
            finally:
                self._learning.pop(tokenizer, None)

        task = asyncio.get_running_loop().create_task(learn())
        self._learning[tokenizer] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def store_later(self, plan: Plan, scope: cache_pb2.CacheScope, response: gateway_pb2.GenerateResponse) -> None:
        """Stores the answer in the background, with the store hop's own budget (the caller's
        deadline no longer matters: the caller has its answer)."""
        if len(self._background) >= MAX_BACKGROUND_STORES:
            self.stores_skipped += 1
            metrics.DEGRADED.labels("cache_store_skipped").inc()
            return
        task = asyncio.get_running_loop().create_task(
            self._store(plan, scope, response, Deadline.after(BACKGROUND_DEADLINE_S))
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle(self) -> None:
        """Waits for background stores (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _store(
        self, plan: Plan, scope: cache_pb2.CacheScope, response: gateway_pb2.GenerateResponse, deadline: Deadline
    ) -> None:
        answer = cache_pb2.CachedAnswer(
            text=response.text,
            finish_reason=response.finish_reason,
            usage=response.usage,
            sources=response.sources,
        )
        try:
            await self.peers.cache_store(
                cache_pb2.CacheStoreRequest(prompt=plan.prompt, scope=scope, answer=answer), deadline
            )
        except (*DOWNSTREAM_ERRORS, LlmeshError) as exc:
            log.warning("cache store failed: %s", exc.message)

    async def ingest(
        self, request: gateway_pb2.IngestRequest, deadline: Deadline, caller: Caller | None = None
    ) -> gateway_pb2.IngestResponse:
        """Documents into a collection, as a bounded, metered operation: the chunk window checked
        here (retrieval and the tokenizer check it again), then the key's own limits, then this
        gateway's ingest budget by document bytes (services/gateway/ingest.py). The documents'
        tokens count as the key's tokens and as the embedding model's input tokens in usage."""
        started = time.perf_counter()
        document_tokens = 0

        def finish(outcome: str, error: BaseException | None) -> None:
            self._finish_retrieval_call(caller, request.tenant, outcome, error, started, "ingest", document_tokens)

        with Metered(finish):
            violations = chunking.request_violations(request.chunk_tokens, request.overlap_tokens)
            if violations:
                raise InvalidArgument(violations)
            await self.usage.admit(caller)
            nbytes = sum(len(d.text.encode("utf-8", "surrogatepass")) for d in request.documents)
            upsert = retrieval_pb2.UpsertRequest(
                collection=request.collection or self.config.default_collection,
                tenant=request.tenant or "default",
                documents=request.documents,
                chunk_tokens=request.chunk_tokens,
                overlap_tokens=request.overlap_tokens,
            )
            last = retrieval_pb2.UpsertProgress()
            with self.ingests.admit(nbytes):
                try:
                    async for progress in self.peers.upsert(upsert, deadline):
                        last = progress
                finally:
                    # The next request learns the new version (whatever happened: a part may have landed).
                    self.versions.forget(upsert.collection, upsert.tenant)
            if not last.done:
                raise LlmeshError("ingest ended before it was done")
            document_tokens = last.document_tokens
            return gateway_pb2.IngestResponse(
                documents=last.documents_done,
                chunks=last.chunks_done,
                collection_version=last.collection_version,
                trace_id=current_trace_id(),
                document_tokens=document_tokens,
            )

    def _finish_retrieval_call(
        self,
        caller: Caller | None,
        tenant: str,
        outcome: str,
        error: BaseException | None,
        started: float,
        event: str,
        input_tokens: int = 0,
    ) -> None:
        """Usage and the access line of an ingest or a search, under the embedding model's name
        (what does their work)."""
        spent = (
            gateway_pb2.GenerateResponse(usage=common_pb2.Usage(input_tokens=input_tokens), trace_id=current_trace_id())
            if input_tokens
            else None
        )
        model = self.embeddings.name or "embedding"
        elapsed = time.perf_counter() - started
        self.usage.finish(caller, tenant or "default", model, outcome, "none", spent, error, elapsed, event=event)

    async def purge_cache(
        self, request: gateway_pb2.PurgeCacheRequest, deadline: Deadline
    ) -> gateway_pb2.PurgeCacheResponse:
        """Removes one tenant's cached answers: all, a collection's, or a model's (the answers of the
        model key the name serves now; entries of earlier weights can never serve again anyway)."""
        bad = []
        if not request.tenant:
            bad.append(("tenant", "required"))
        elif not NAME_RE.match(request.tenant):
            bad.append(("tenant", "letters, digits, '_', '.', '-' only, at most 64 characters"))
        if request.collection and request.model:
            bad.append(("model", "set collection or model, not both"))
        if request.collection and not NAME_RE.match(request.collection):
            bad.append(("collection", "letters, digits, '_', '.', '-' only, at most 64 characters"))
        if bad:
            raise InvalidArgument(bad)
        invalidate = cache_pb2.InvalidateRequest(tenant=request.tenant)
        if request.collection:
            invalidate.collection = request.collection
        elif request.model:
            route = await self.route(request.model, deadline)
            invalidate.model = await self.model_key(deadline, route.name)
        else:
            invalidate.all = True
        try:
            done = await self.peers.cache_invalidate(invalidate, deadline)
        except PeerCallError as exc:
            raise exc.cause from exc
        return gateway_pb2.PurgeCacheResponse(removed=done.removed, trace_id=current_trace_id())

    async def embed(
        self, request: gateway_pb2.EmbedRequest, deadline: Deadline, caller: Caller | None = None
    ) -> gateway_pb2.EmbedResponse:
        """Embeddings of `request.inputs` with the mesh's embedding model (services/gateway/embeddings.py)."""
        tenant_ok = not request.tenant or bool(NAME_RE.match(request.tenant))
        return await self.embeddings.embed(request, deadline, caller, tenant_ok)

    async def search(
        self, request: gateway_pb2.SearchRequest, deadline: Deadline, caller: Caller | None = None
    ) -> gateway_pb2.SearchResponse:
        """A caller's own search of a collection, behind the key's own limits as a generation is."""
        started = time.perf_counter()

        def finish(outcome: str, error: BaseException | None) -> None:
            self._finish_retrieval_call(caller, request.tenant, outcome, error, started, "search")

        with Metered(finish):
            if not request.query.strip():
                raise InvalidArgument([("query", "must not be empty")])
            await self.usage.admit(caller)
            found = await self.peers.search(
                retrieval_pb2.RetrievalSearchRequest(
                    query=request.query,
                    collection=request.collection or self.config.default_collection,
                    tenant=request.tenant or "default",
                    top_k=request.top_k,
                    score_threshold=request.score_threshold,
                    filter=request.filter,
                ),
                deadline,
                optional=False,
            )
            return gateway_pb2.SearchResponse(results=found.results, trace_id=current_trace_id())
