"""The gateway's request path, one stage after another over the request's `Plan` (plan.py):

    route -> precheck -> scope -> cache -> retrieve -> cache_without_context -> render_prompt
    -> admit -> infer -> response -> store -> reply

`RequestPath.run` reads as that list; each stage is one method. The path owns its request's one
record, `RequestState`: what the stages found, hop timings, degradations, the admission hold and
ticket, the tokens spent. The asked plan is never replaced: a narrowing (context given up,
max_new_tokens capped) is recorded in the state and the plan followed is derived from both. Every
optional hop degrades instead of failing: no cache when the cache is down, no context when
retrieval is down, and the response lists what was left out. Every admission decision, and the
record of every refusal, is the request's `RequestAdmission`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from llmesh import tool_calls
from llmesh.chat_template import TemplateRefused
from llmesh.errors import InvalidArgument, ResourceExhausted
from llmesh.telemetry import current_trace_id
from llmesh.v1 import cache_pb2, common_pb2, gateway_pb2, inference_pb2, retrieval_pb2
from services.gateway import metrics
from services.gateway.admission import (
    BATCH,
    REASON_DEADLINE,
    Admission,
    AdmissionController,
    Ask,
    Hold,
    RequestTooHeavy,
    Ticket,
)
from services.gateway.deadline import CallerDeadline, Deadline
from services.gateway.hop_errors import BREAKER_FAILURE_CODES, DOWNSTREAM_ERRORS, PeerCallError
from services.gateway.plan import (
    InputTokenPredictor,
    Plan,
    as_tool_calls,
    build_messages,
    context_bytes,
    raw_prompt,
    set_calls,
)
from services.gateway.recent_hits import request_key
from services.gateway.request_gateway import ModelRoute, RequestGateway

log = logging.getLogger("llmesh.gateway")

# Retrieval searches with at most this much question (RetrievalSearchRequest.query); a longer one
# is answered without context.
RETRIEVAL_MAX_QUERY_BYTES = 16 * 1024
# A request that would be shed on a miss waits for the cache only this long: a refusal is fast
# whatever state the cache is in (frozen, or its breaker still deciding).
SHED_RISK_LOOKUP_S = 0.02
# ...unless the cache answered that request lately and keeps answering other lookups (busy, not
# frozen): then it waits up to this long in all, so a refusal stays fast...
KNOWN_HIT_WAIT_S = 0.05
CACHEABLE_FINISH = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_TOOL_CALLS,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP_SEQUENCE,
)


@dataclass
class Delta:
    text: str
    # The answer it belongs to (n > 1) and its tokens' log probabilities (SamplingParams.logprobs).
    index: int = 0
    logprobs: Sequence[common_pb2.TokenLogprob] = ()
    # Automatic tool choice: the calls completed with this delta (the text is what lies outside
    # calls; a call's markup is never streamed as text).
    tool_calls: Sequence[tool_calls.CallDelta] = ()


@dataclass
class Answer:
    """One of a request's n answers while it is generated."""

    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: the prompt's tokens scored (from the first message).
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    generated: int = 0
    finished: bool = False
    # Automatic tool choice: the text split into shown text and calls as it streams.
    calls: tool_calls.CallStream | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class RequestState:
    """The one record of what happens to one request (one attempt: an alias's model each) on its
    path: what the stages found (route, model key, scope, context, prompt, answers), how the asked
    plan was narrowed, hop timings, degradations, the admission hold and ticket, the tokens spent.
    Its `RequestPath` is its only writer; the gateway reads it when the attempt ends (timings,
    spent tokens) and releases what it holds."""

    degradations: list[str] = field(default_factory=list)
    # The predicted weight reserved from the precheck until the exact admission.
    hold: Hold | None = None
    # The admitted reservation: progress reported as tokens arrive, finished on every exit path.
    ticket: Ticket | None = None
    # The prompt-length predictor of the model the request goes to (one per model).
    predictor: InputTokenPredictor | None = None
    # Milliseconds spent per hop, returned to the caller as `server-timing` metadata.
    timings: dict[str, float] = field(default_factory=dict)
    # Tokens spent so far, counted for a request that ends without its final message.
    spent: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    # How the asked plan was narrowed (the path derives the plan it follows from these): the
    # context given up, and admission's cap on max_new_tokens (0: none).
    retrieval_dropped: bool = False
    max_new_tokens_cap: int = 0
    # Set by the stages, in order.
    route: ModelRoute | None = None
    model: str = ""  # the model key
    collection: str = ""
    version: int = 0
    scope: cache_pb2.CacheScope = field(default_factory=cache_pb2.CacheScope)
    sources: list[common_pb2.ScoredChunk] = field(default_factory=list)
    prompt: list[int] | str = ""
    input_tokens: int = 0
    answers: list[Answer] = field(default_factory=list)
    # How the rendered prompt shows tools (automatic tool choice): the format the model's
    # calls come in, and whether the template showed them (else the preamble did, and the
    # answer decodes under the grammar of text or calls).
    tool_format: str = "hermes"
    template_renders_tools: bool = False

    @contextlib.contextmanager
    def timed(self, hop: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[hop] = self.timings.get(hop, 0.0) + (time.perf_counter() - started) * 1000

    def degrade(self, what: str) -> None:
        if what not in self.degradations:
            self.degradations.append(what)
            metrics.DEGRADED.labels(what).inc()

    def release(self) -> None:
        """Every exit path: what was held or reserved and not generated goes back."""
        if self.hold is not None:
            self.hold.release()
        if self.ticket is not None:
            self.ticket.finish()

    @property
    def route_name(self) -> str:
        return self.route.name if self.route is not None else ""

    @property
    def answered_by(self) -> str:
        return (self.route.public_name() if self.route is not None else None) or ""


def total_usage(answers: Sequence[Answer], input_tokens: int) -> common_pb2.Usage:
    """The request's usage: every answer's as inference reported it (n > 1: the prompt was
    processed once per answer), `input_tokens` for an answer that never reported any."""
    usage = common_pb2.Usage()
    for answer in answers:
        usage.input_tokens += answer.usage.input_tokens if answer.finished else input_tokens
        usage.output_tokens += answer.usage.output_tokens
        usage.cached_input_tokens += answer.usage.cached_input_tokens
        usage.cached_output_tokens += answer.usage.cached_output_tokens
        usage.prefix_cached_input_tokens += answer.usage.prefix_cached_input_tokens
    return usage


@dataclass
class Final:
    response: gateway_pb2.GenerateResponse
    timings: dict[str, float] = field(default_factory=dict)


def server_timing(timings: dict[str, float]) -> str:
    """The W3C Server-Timing form: `cache;dur=0.8, inference;dur=412.3`."""
    return ", ".join(f"{hop};dur={ms:.1f}" for hop, ms in timings.items())


def from_cache(
    plan: Plan, state: RequestState, hit: cache_pb2.CacheLookupResponse, tool_format: str = "hermes"
) -> tuple[Delta, Final]:
    """The events of a cache hit; it carries what this request degraded (how it reached the
    scope it was answered under, e.g. without retrieval) and the model that answers for it. Its
    usage bills nothing processed or generated: the cached answer's tokens were saved."""
    if state.hold is not None:
        state.hold.release()
    answer = hit.answer
    saved = common_pb2.Usage(
        cached_input_tokens=answer.usage.input_tokens + answer.usage.cached_input_tokens,
        cached_output_tokens=answer.usage.output_tokens + answer.usage.cached_output_tokens,
    )
    response = gateway_pb2.GenerateResponse(
        text=answer.text,
        finish_reason=answer.finish_reason,
        usage=saved,
        cache=gateway_pb2.CacheInfo(hit=True, tier=hit.tier, similarity=hit.similarity),
        sources=answer.sources,
        trace_id=current_trace_id(),
        model=state.model,
        degradations=state.degradations,
        answered_by=state.answered_by,
    )
    as_tool_calls(plan, response, tool_format)
    if plan.tool_mode == "auto":  # the stream shows what the answer shows: text and calls
        calls = [tool_calls.CallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(response.tool_calls)]
        return Delta(response.text, tool_calls=calls), Final(response, state.timings)
    return Delta(answer.text), Final(response, state.timings)


def render_chatml(messages: list[common_pb2.ChatMessage], tools: Sequence[common_pb2.Tool] = ()) -> str:
    """ChatML: the last resort while the tokenizer is down and the model's own template is not
    known here (see `RequestPath._render_locally`); tools as llmesh's preamble shows them."""
    if tools or any(m.tool_calls or m.role == "tool" for m in messages):
        messages = tool_calls.text_turns(messages, tools)
    body = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieves a background call's outcome (no "exception was never retrieved" warnings)."""
    if not task.cancelled():
        task.exception()


class RequestAdmission:
    """Every admission decision of one request, in one place: the predicted weight reserved before
    the expensive hops (`reserve`, asked again after a cache miss), the exact weight admitted
    (`admit`), and the one record of each refusal (`shed`: metric, span, retry advice). It is given
    its collaborators, not the gateway: the admission controller that judges, the request's
    record (where the hold and the ticket live), its deadline and its span."""

    def __init__(
        self, controller: AdmissionController, state: RequestState, deadline: Deadline, span: trace.Span
    ) -> None:
        self.controller = controller
        self.state = state
        self.deadline = deadline
        self.span = span

    def ask(self, plan: Plan) -> Ask:
        # n answers weigh n times one: n x max_new_tokens tokens to generate over the prompt.
        state = self.state
        return Ask(plan.tenant, plan.lane, state.model, state.route_name, plan.sampling.max_new_tokens * plan.n)

    def reserve(
        self, plan: Plan, predictor: InputTokenPredictor, waiting_for_cache: bool = False
    ) -> ResourceExhausted | None:
        """None when the request may go on to its hops (it may then hold its prediction until its
        exact weight is admitted); else the refusal, for the caller to `shed` (or to let a cache
        hit make moot). Decided by `AdmissionController.reserve`: the engines' reported load, or
        the fallback."""
        state = self.state
        predicted = predictor.predict(plan) + plan.grammar_tokens()
        if state.hold is not None:
            state.hold.release()
            state.hold = None
        hold, refusal = self.controller.reserve(
            self.ask(plan), predicted, self.deadline.remaining(), waiting_for_cache=waiting_for_cache
        )
        state.hold = hold
        if refusal is not None:
            self.span.set_attribute("llmesh.admission.predicted_input_tokens", predicted)
        return refusal

    async def admit(self, plan: Plan, input_tokens: int) -> Admission:
        """The exact weight admitted (replacing the hold), its ticket kept in the state; a
        request too heavy ever to fit is InvalidArgument, any other refusal shed."""
        state, span = self.state, self.span
        capacity = self.controller.capacity(state.model)
        try:
            admission: Admission = await self.controller.admit(
                self.ask(plan), input_tokens + plan.grammar_tokens(), state.hold, self.deadline.remaining()
            )
        except RequestTooHeavy as exc:
            self.shed(plan, exc, "refused_too_heavy")
            raise InvalidArgument(
                [
                    (
                        "sampling.max_new_tokens",
                        f"{input_tokens} input tokens x {plan.sampling.max_new_tokens} new tokens"
                        f"{f' x n={plan.n}' if plan.n > 1 else ''} exceeds the largest admissible "
                        f"weight ({exc.metadata.get('max_weight', '?')})",
                    )
                ]
            ) from exc
        except ResourceExhausted as exc:
            raise self.shed(plan, exc, "shed_deadline" if exc.reason == REASON_DEADLINE else "shed") from None
        metrics.ADMISSION_WEIGHT.set(admission.occupancy)
        metrics.ADMISSION_IN_FLIGHT_LIMIT.set(capacity.limit())
        metrics.ADMISSION_IN_FLIGHT.set(capacity.in_flight)
        metrics.ADMISSION_THROUGHPUT.set(capacity.throughput)
        span.set_attribute("llmesh.admission.in_flight_limit", capacity.limit())
        span.set_attribute("llmesh.admission.decision", "capped" if admission.degraded else "admitted")
        span.set_attribute("llmesh.admission.weight", admission.weight)
        span.set_attribute("llmesh.admission.occupancy", admission.occupancy)
        span.set_attribute("llmesh.admission.budget", admission.budget)
        state.ticket = admission.ticket
        return admission

    def shed(self, plan: Plan, exc: ResourceExhausted, decision: str) -> ResourceExhausted:
        """The one record of a refusal (metric and span); returns it for the caller to raise,
        with its retry advice spread when many callers are being refused (not for a request
        too heavy ever to fit: no retry helps it)."""
        if not isinstance(exc, RequestTooHeavy):
            exc = self.controller.shed(self.ask(plan), exc)
        metrics.SHED.labels(exc.reason).inc()
        self.span.set_attribute("llmesh.admission.decision", decision)
        self.span.set_attribute("llmesh.admission.reason", exc.reason)
        self.span.set_attribute("llmesh.admission.retry_after_s", exc.retry_after)
        return exc


class RequestPath:
    """One request's way through the gateway (see the module); `run` yields its events."""

    def __init__(
        self,
        gateway: RequestGateway,
        plan: Plan,
        deadline: Deadline,
        route: ModelRoute | None = None,
        fallback: bool = False,
    ) -> None:
        """`route`: the model's route when the caller resolved it already (else `_route` resolves
        `plan.model`); `fallback`: an alias's later model answers."""
        self.gateway = gateway
        # What was asked, never replaced; `plan` is what the path follows, derived from it and the
        # narrowing the state records (`_narrow`).
        self.asked = plan
        self.plan = plan
        self.deadline = deadline
        self.span = trace.get_current_span()
        self.state = RequestState(route=route)
        self.admission = RequestAdmission(gateway.admission, self.state, deadline, self.span)
        if fallback:
            self.state.degrade("model_fallback")

    async def run(self) -> AsyncIterator[Delta | Final]:
        await self._route()
        if not self.plan.use_cache:
            self._precheck()  # no cache hit is possible: shed before any other downstream call
        await self._scope()
        hit = await self._cache() if self.plan.use_cache else None
        if hit is None:
            await self._retrieve()
            hit = await self._cache_without_context()
        if hit is not None:
            for event in hit:
                yield event
            return
        await self._render_prompt()
        await self._admit()
        with self.state.timed("inference"):
            async for delta in self._infer():
                yield delta
        response = self._response()
        self._store(response)
        yield self._reply(response)

    # ------------------------------------------------------------------ the stages

    async def _route(self) -> None:
        """The lane checked, the request span described, and the model resolved to its route and key."""
        plan, span, state = self.plan, self.span, self.state
        if plan.lane not in self.gateway.window.lanes:
            raise InvalidArgument([("lane", f"must be one of {', '.join(self.gateway.window.lanes)}")])
        span.set_attribute("llmesh.tenant", plan.tenant)
        span.set_attribute("gen_ai.request.max_tokens", plan.sampling.max_new_tokens)
        span.set_attribute("gen_ai.request.temperature", plan.sampling.temperature)
        if plan.n > 1:
            span.set_attribute("gen_ai.request.choice.count", plan.n)
        if self.gateway.config.log_prompts:
            span.set_attribute("llmesh.prompt", plan.prompt)
        with state.timed("model"):
            if state.route is None:  # not resolved by the caller
                state.route = await self.gateway.route(plan.model, self.deadline)
            state.model = await self.gateway.model_key(self.deadline, state.route.name)
        state.predictor = self.gateway.predictor_for(state.route.name)
        span.set_attribute("gen_ai.request.model", state.route.public_name() or state.model)
        span.set_attribute("llmesh.model_key", state.model)

    def _precheck(self) -> None:
        """Sheds before the expensive hops (retrieval search, tokenizer) when the request's
        predicted weight does not fit or could not start or finish in time."""
        with self.state.timed("admission"):
            refusal = self.admission.reserve(self.plan, self._predictor())
            if refusal is not None:
                raise self.admission.shed(self.plan, refusal, "shed_early")

    async def _scope(self) -> None:
        """The collection and version the answer will be grounded in, and the cache scope."""
        with self.state.timed("retrieval"):
            self.state.collection, self.state.version = await self._retrieval_scope()
        self.state.scope = self.gateway.cache_scope(
            self.plan, self.state.model, self.state.collection, self.state.version
        )

    async def _cache(self) -> tuple[Delta, Final] | None:
        """The first lookup, under the scope with retrieval. Admission is decided before it, as
        if it missed: a request that fits holds its predicted weight now (given back on a hit),
        so it is never refused after waiting for the cache. One that would be shed waits for the
        cache only SHED_RISK_LOOKUP_S (a hit costs nothing, so it is still served), and not at
        all while the cache is failing."""
        state, plan = self.state, self.plan
        with state.timed("admission"):
            refusal = self.admission.reserve(plan, self._predictor(), waiting_for_cache=True)
        if refusal is not None and self.gateway.peers.cache.suspect():
            raise self.admission.shed(plan, refusal, "shed_early")
        # A request the cache answered lately will almost surely be answered again (it costs
        # the model nothing): it waits longer, while the cache is answering (see `_lookup`).
        wait = SHED_RISK_LOOKUP_S if refusal is not None else None
        with state.timed("cache"):
            hit = await self._lookup(self.state.scope, wait, request_key(plan.prompt, self.state.scope))
        if hit is not None:
            return from_cache(self.plan, state, hit, self._known_tool_format())
        # Missed. It did not fit before the lookup, or it fit but holds nothing (where engines
        # report their load, a request holds nothing while its lookup waits) and the engines may
        # have filled meanwhile (a lookup can take its whole budget): decided again now, before
        # the expensive hops (retrieval search, tokenizer). Shed here, or it holds its
        # prediction from here on and is not refused after them.
        if refusal is not None or self.state.hold is None:
            self._precheck()
        return None

    async def _retrieve(self) -> None:
        """The context. The answer is stored under the retrieval it really had: without context
        (a failed search, or retrieval down) its scope is not the RAG one."""
        if "retrieval_unavailable" in self.state.degradations and self.state.collection:
            # Only a cached answer could use the last known version: generate without context.
            self.state.sources, self.state.collection, self.state.version = [], "", 0
            return
        with self.state.timed("retrieval"):
            retrieved = await self._search(self.state.collection)
        # A failed or timed-out search: no context, so the RAG scope is not this answer's.
        self.state.sources, self.state.version = retrieved if retrieved is not None else ([], 0)
        self.state.collection = self.state.collection if retrieved is not None else ""

    async def _cache_without_context(self) -> tuple[Delta, Final] | None:
        """The context was meant but lost: the scope without it, and an answer made without
        context earlier serves (the second lookup), saying what it lacks."""
        if self.state.collection or not self.state.scope.collection:
            return None
        self._narrow(drop_retrieval=True)
        self.state.scope = self.gateway.cache_scope(self.plan, self.state.model, "", 0)
        if not self.plan.use_cache:
            return None
        with self.state.timed("cache"):
            hit = await self._lookup(self.state.scope)
        if hit is None:
            return None
        return from_cache(self.plan, self.state, hit, self._known_tool_format())

    async def _render_prompt(self) -> None:
        """The prompt rendered and counted. Over the prompt limit: the retrieved chunks go first
        (the lowest-scored first), and only a prompt over it without any context is refused."""
        state, limit = self.state, self.gateway.config.max_prompt_tokens
        tokenizer = self.state.route.tokenizer if self.state.route is not None else ""
        with state.timed("tokenizer"):
            self.state.prompt, self.state.input_tokens = await self._render(self.state.sources, tokenizer)
            while self.state.input_tokens > limit and self.state.sources:
                self.state.sources = self.state.sources[:-1]
                state.degrade("context_trimmed")
                self.state.prompt, self.state.input_tokens = await self._render(self.state.sources, tokenizer)
        if "tokenizer_estimate" not in state.degradations and not self.plan.raw:
            # Learned from templated prompts only: a raw one has no template's overhead.
            self._predictor().observe(self.plan, self.state.input_tokens, context_bytes(self.state.sources))
        if self.state.input_tokens > limit:
            raise InvalidArgument(
                [
                    (
                        "messages" if self.plan.turns_wire else "prompt",
                        f"{self.state.input_tokens} tokens rendered; the limit is {limit}",
                    )
                ]
            )

    async def _admit(self) -> None:
        """The exact weight admitted (it replaces the prediction held since the precheck); a
        capped admission narrows the plan's max_new_tokens."""
        plan, state = self.plan, self.state
        with state.timed("admission"):
            admission = await self.admission.admit(plan, state.input_tokens)
        if admission.degraded:
            if admission.max_new_tokens:
                capped = admission.max_new_tokens // plan.n  # the cap is over all n answers
                self._narrow(max_new_tokens=max(1, capped))
            state.degrade("max_new_tokens_capped")

    async def _infer(self) -> AsyncIterator[Delta]:
        """Runs the answers' inference streams (n at once for n > 1: seeds offset by the answer's
        index when a seed is given, so seeded answers differ and stay reproducible) and yields
        their deltas as they come; each answer's text, log probabilities, finish and usage are
        kept in `answers`. Leaving early (the caller cancelled or went away, a stream failed)
        cancels every stream still running."""
        plan, state, input_tokens = self.plan, self.state, self.state.input_tokens
        self.state.answers = answers = [Answer(i) for i in range(plan.n)]
        form = plan.response_format if plan.response_format.type else None
        if plan.tool_mode == "auto":
            names = tool_calls.names_of(plan.tools)
            for answer in answers:
                answer.calls = tool_calls.CallStream(self.state.tool_format, names)
            if not self.state.template_renders_tools:
                form = common_pb2.ResponseFormat(type="grammar", grammar=tool_calls.auto_grammar(plan.tools))
        generated = 0

        def take(answer: Answer, message: inference_pb2.InferenceResponse) -> Delta | None:
            nonlocal generated
            # Tokens as they come (a backend that sends text only: a message is the tokens it
            # says, else one); the final usage settles the count.
            step = len(message.token_ids) or message.tokens or (1 if message.text else 0)
            if message.finish_reason and message.usage.output_tokens:
                step = max(step, message.usage.output_tokens - answer.generated)
            answer.generated += step
            generated += step
            # What the request spent once inference answered, billed if it ends early.
            state.spent.input_tokens, state.spent.output_tokens = input_tokens, generated
            if state.ticket is not None:
                state.ticket.progress(step)
            if message.text:
                answer.pieces.append(message.text)
            answer.logprobs.extend(message.logprobs)
            answer.prompt_logprobs.extend(message.prompt_logprobs)
            if message.finish_reason:
                answer.finish = message.finish_reason
                answer.usage = message.usage
                answer.finished = True
            if answer.calls is not None:
                text, calls = answer.calls.feed(message.text)
                if text or calls or message.logprobs:
                    return Delta(text, answer.index, message.logprobs, calls)
                return None
            if message.text or message.logprobs:
                return Delta(message.text, answer.index, message.logprobs)
            return None

        def sampling_of(answer: Answer) -> common_pb2.SamplingParams:
            if answer.index == 0 or not plan.sampling.HasField("seed"):
                return plan.sampling
            offset = common_pb2.SamplingParams()
            offset.CopyFrom(plan.sampling)
            offset.seed = (plan.sampling.seed + answer.index) % (1 << 64)
            return offset

        # Batch-lane work yields to interactive work inside the engine too, not only at admission.
        priority = 1 if plan.lane == BATCH else 0  # InferenceRequest.priority: 0 interactive, 1 batch

        def stream(answer: Answer) -> AsyncIterator[inference_pb2.InferenceResponse]:
            return self.gateway.peers.generate(
                self.state.prompt,
                sampling_of(answer),
                uuid.uuid4().hex,
                self.deadline,
                self.state.route_name,
                form,
                priority,
            )

        if len(answers) == 1:
            async for message in stream(answers[0]):
                delta = take(answers[0], message)
                if delta is not None:
                    yield delta
            for delta in self._held_back():
                yield delta
            return
        queue: asyncio.Queue[tuple[Answer, inference_pb2.InferenceResponse | BaseException | None]] = asyncio.Queue()

        async def pump(answer: Answer) -> None:
            try:
                async for message in stream(answer):
                    queue.put_nowait((answer, message))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait((answer, exc))
            else:
                queue.put_nowait((answer, None))

        pumps = [asyncio.ensure_future(pump(answer)) for answer in answers]
        try:
            running = len(pumps)
            while running:
                answer, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    delta = take(answer, item)
                    if delta is not None:
                        yield delta
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        for delta in self._held_back():
            yield delta

    def _held_back(self) -> Iterator[Delta]:
        """Automatic tool choice, once the answers are complete: what each held back while it
        could still become a call (text that was not one after all, a call the end completed)."""
        for answer in self.state.answers:
            if answer.calls is not None:
                text, calls = answer.calls.finish()
                if text or calls:
                    yield Delta(text, answer.index, (), calls)

    def _response(self) -> gateway_pb2.GenerateResponse:
        """The generated answer (the first of n) as the response, its usage on the span; the
        weight not generated goes back before the caller hears."""
        usage = total_usage(self.state.answers, self.state.input_tokens)
        self.span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
        first = self.state.answers[0]
        response = gateway_pb2.GenerateResponse(
            text=first.text,
            finish_reason=first.finish,
            usage=usage,
            cache=gateway_pb2.CacheInfo(hit=False),
            sources=self.state.sources,
            trace_id=current_trace_id(),
            model=self.state.model,
            degradations=self.state.degradations,
            answered_by=self.state.answered_by,
            logprobs=first.logprobs,
            prompt_logprobs=first.prompt_logprobs,
        )
        if self.state.ticket is not None:
            self.state.ticket.finish()
        return response

    def _store(self, response: gateway_pb2.GenerateResponse) -> None:
        """Stored under the scope the answer really had: the version its context was read at, and
        a capped max_new_tokens (the answer of a request that asks for that many). Not stored:
        a prompt rendered by the fallback template (the tokenizer was away). The store runs
        after, in the background: the caller's answer never waits for it."""
        plan = self.plan
        if (
            plan.use_cache
            and response.finish_reason in CACHEABLE_FINISH
            and response.text
            and "tokenizer_estimate" not in self.state.degradations
        ):
            version = self.state.version or self.state.scope.collection_version
            self.gateway.store_later(
                plan, self.gateway.cache_scope(plan, self.state.model, self.state.collection, version), response
            )

    def _reply(self, response: gateway_pb2.GenerateResponse) -> Final:
        """The final message: a tool call's text answered as the call (stored as generated), and
        for n > 1 every answer as a choice."""
        plan = self.plan
        if plan.tool_mode:
            stored, response = response, gateway_pb2.GenerateResponse()
            response.CopyFrom(stored)
            self._calls_of(self.state.answers[0], response)
        if plan.n > 1:
            for answer in self.state.answers:
                choice = gateway_pb2.GenerateResponse(
                    text=answer.text, finish_reason=answer.finish, logprobs=answer.logprobs
                )
                self._calls_of(answer, choice)
                response.choices.add(
                    index=answer.index,
                    text=choice.text,
                    finish_reason=choice.finish_reason,
                    tool_calls=choice.tool_calls,
                    logprobs=choice.logprobs,
                )
            if response.tool_calls:  # the first answer's call, under the same id in both places
                del response.tool_calls[:]
                response.tool_calls.extend(response.choices[0].tool_calls)
        return Final(response, self.state.timings)

    # ------------------------------------------------------------------ what the stages call

    def _predictor(self) -> InputTokenPredictor:
        """The prompt-length predictor of the request's model (the gateway's until it is routed)."""
        return self.state.predictor or self.gateway.predictor

    def _narrow(self, drop_retrieval: bool = False, max_new_tokens: int = 0) -> None:
        """Records a narrowing (the context given up, admission's cap) and derives the plan the
        path follows from the asked one and every narrowing recorded."""
        state = self.state
        state.retrieval_dropped = state.retrieval_dropped or drop_retrieval
        state.max_new_tokens_cap = max_new_tokens or state.max_new_tokens_cap
        plan = self.asked.without_retrieval() if state.retrieval_dropped else self.asked
        self.plan = plan.with_max_new_tokens(state.max_new_tokens_cap) if state.max_new_tokens_cap else plan

    def _calls_of(self, answer: Answer, response: gateway_pb2.GenerateResponse) -> None:
        """An answer's tool calls into its response: for automatic tool choice the ones streamed
        (same ids, same text around them), else the constrained call its text is."""
        if answer.calls is None:
            as_tool_calls(self.plan, response)
            return
        set_calls(response, answer.calls.text, tool_calls.tool_calls_of(answer.calls.calls))

    def _known_tool_format(self) -> str:
        """The call format of the route's model as far as this gateway knows it before rendering
        (a cache hit is never rendered): its template's, learned or local, else Hermes."""
        tokenizer = self.state.route.tokenizer if self.state.route is not None else ""
        template = self.gateway.templates.get(tokenizer) or self.gateway.local_templates.get(tokenizer)
        return template.tool_format if template is not None else "hermes"

    async def _retrieval_scope(self) -> tuple[str, int]:
        """(collection, version) the answer will be grounded in, or ("", 0) without retrieval.
        While retrieval is down, the last known version: a cached answer for it still serves."""
        plan, state, deadline = self.plan, self.state, self.deadline
        if not plan.use_retrieval:
            return "", 0
        if len(plan.prompt.encode("utf-8", "surrogatepass")) > RETRIEVAL_MAX_QUERY_BYTES:
            # Retrieval cannot search with it: answered (and cached) without context, and says so.
            state.degrade("retrieval_query_too_long")
            self._narrow(drop_retrieval=True)
            return "", 0
        try:
            info, confirmed = await self.gateway.peers.retrieval.version(plan.collection, plan.tenant, deadline)
        except DOWNSTREAM_ERRORS as exc:
            log.warning("retrieval unavailable, answering without context: %s", exc.message)
            state.degrade("retrieval_unavailable")
            self._narrow(drop_retrieval=True)
            return "", 0
        if not info.exists or info.points == 0:
            self._narrow(drop_retrieval=True)
            return "", 0
        if not confirmed:
            state.degrade("retrieval_unavailable")
        return plan.collection, info.version

    async def _lookup(
        self, scope: cache_pb2.CacheScope, wait: float | None = None, key: bytes | None = None
    ) -> cache_pb2.CacheLookupResponse | None:
        """A hit, or None (a miss, or the cache unavailable). `wait`: give up on the cache after
        this long (the request is shed on a miss, so it only waits as long as a refusal may take),
        or up to KNOWN_HIT_WAIT_S while the cache keeps answering other lookups, when
        the cache answered this request (`key`) lately: it will almost surely be served, not shed.

        The wait, queueing behind other lookups included, never exceeds the lookup's hop budget.
        The call itself is not cancelled when the request stops waiting: it runs to its own budget
        in the background, so the cache's breaker hears how it ended (a frozen cache is cut off
        even when every request gives up on it early)."""
        # Attributes go on the request span: the client span of the RPC already times the hop.
        gateway, plan, state, deadline, span = self.gateway, self.plan, self.state, self.deadline, self.span
        cache = gateway.peers.cache
        budget = cache.lookup_budget
        patience = KNOWN_HIT_WAIT_S if key is not None and key in cache.recent_hits else 0.0
        asked_at = time.monotonic()
        lookup = asyncio.ensure_future(
            cache.lookup(
                cache_pb2.CacheLookupRequest(prompt=plan.prompt, scope=scope, allow_semantic=plan.semantic), deadline
            )
        )
        lookup.add_done_callback(_consume)
        lookup.add_done_callback(cache.heard)
        try:
            try:
                found = await asyncio.wait_for(asyncio.shield(lookup), budget if wait is None else min(wait, budget))
            except TimeoutError:
                if wait is None or wait >= budget:
                    raise
                found = await cache.wait_while_answering(lookup, asked_at + min(patience, budget))
        except TimeoutError:
            if wait is not None and wait < budget:
                return None  # the request decides without the cache; the lookup goes on
            cache.failed()
            log.warning("cache lookup took its whole budget (%.3fs)", budget)
            state.degrade("cache_unavailable")
            return None
        except DOWNSTREAM_ERRORS as exc:
            cache.failed()
            log.warning("cache unavailable: %s", exc.message)
            state.degrade("cache_unavailable")
            return None
        except CallerDeadline:
            if deadline.remaining() <= 0:
                raise
            # Not this request's deadline (the cache hop can never cost a caller its own): no cache.
            state.degrade("cache_unavailable")
            return None
        if found.degraded:
            cache.failed()
            state.degrade("cache_unavailable")
        if scope.collection and found.collection_version:
            self.gateway.peers.retrieval.versions.observe(scope.collection, scope.tenant, found.collection_version)
        if key is not None:
            if found.hit:
                cache.recent_hits.hit(key)
            else:
                cache.recent_hits.missed(key)
        span.set_attribute("llmesh.cache.hit", found.hit)
        if found.hit:
            span.set_attribute("llmesh.cache.tier", common_pb2.CacheTier.Name(found.tier))
            span.set_attribute("llmesh.cache.similarity", found.similarity)
        return found if found.hit else None

    async def _search(self, collection: str) -> tuple[list[common_pb2.ScoredChunk], int] | None:
        """The context and the collection version the search read it at ([], 0 without a
        collection); None when the search failed or ran out of its budget (degraded)."""
        if not collection:
            return [], 0
        plan, state, span = self.plan, self.state, self.span
        try:
            found = await self.gateway.peers.search(
                retrieval_pb2.RetrievalSearchRequest(
                    query=plan.prompt,
                    collection=collection,
                    tenant=plan.tenant,
                    top_k=plan.top_k,
                    score_threshold=self.gateway.config.min_context_score,
                ),
                self.deadline,
            )
        except DOWNSTREAM_ERRORS as exc:
            log.warning("retrieval search failed, answering without context: %s", exc.message)
            state.degrade("retrieval_unavailable")
            return None
        span.set_attribute("llmesh.retrieval.document_ids", [c.document_id for c in found.results])
        span.set_attribute("llmesh.retrieval.scores", [round(c.score, 4) for c in found.results])
        if found.collection_version:
            self.gateway.peers.retrieval.versions.observe(collection, plan.tenant, found.collection_version)
        return list(found.results), found.collection_version

    async def _render(self, sources: list[common_pb2.ScoredChunk], tokenizer: str = "") -> tuple[list[int] | str, int]:
        """The prompt as token ids and its exact length (`tokenizer`: whose, "" = the tokenizer
        service's default). While the tokenizer is down: the text rendered here with that
        model's own template (learned from the tokenizer while it answered, else read from the
        model's folder at start), and a local estimate (inference tokenizes the text itself)."""
        plan, state, gateway = self.plan, self.state, self.gateway
        if plan.raw:
            return await self._render_raw(sources, tokenizer)
        messages = build_messages(plan, sources)
        try:
            rendered = await gateway.peers.chat_template(messages, self.deadline, tokenizer, plan.tools)
        except DOWNSTREAM_ERRORS as exc:
            if isinstance(exc, PeerCallError) and exc.code not in BREAKER_FAILURE_CODES:
                raise
            log.warning("tokenizer unavailable, rendering and estimating tokens locally: %s", exc.message)
            state.degrade("tokenizer_estimate")
            text = self._render_locally(messages, tokenizer)
            return text, self._predictor().estimate(plan, context_bytes(sources), text)
        gateway.learn_template(tokenizer)
        self.state.tool_format = rendered.tool_format or "hermes"
        self.state.template_renders_tools = rendered.template_renders_tools
        return list(rendered.ids), len(rendered.ids)

    async def _render_raw(self, sources: list[common_pb2.ScoredChunk], tokenizer: str) -> tuple[list[int] | str, int]:
        """A raw completion's input: its token ids as given, or its text tokenized as it is
        (with the tokens the tokenizer adds to a text); while the tokenizer is down, the text
        (inference tokenizes it) and a local estimate."""
        plan, state, gateway = self.plan, self.state, self.gateway
        if plan.prompt_token_ids:
            return list(plan.prompt_token_ids), len(plan.prompt_token_ids)
        text = raw_prompt(plan, sources)
        try:
            encoded = await gateway.peers.encode(text, self.deadline, tokenizer)
        except DOWNSTREAM_ERRORS as exc:
            if isinstance(exc, PeerCallError) and exc.code not in BREAKER_FAILURE_CODES:
                raise
            log.warning("tokenizer unavailable, estimating a raw prompt's tokens locally: %s", exc.message)
            state.degrade("tokenizer_estimate")
            return text, self._predictor().estimate(plan, context_bytes(sources), text)
        return list(encoded.ids), len(encoded.ids)

    def _render_locally(self, messages: list[common_pb2.ChatMessage], tokenizer: str) -> str:
        template = self.gateway.templates.get(tokenizer) or self.gateway.local_templates.get(tokenizer)
        if template is None:
            # Neither learned nor on this host: ChatML, the template most chat models use, and
            # the response says the model's own was not known.
            self.state.degrade("chat_template_unknown")
            self.state.tool_format, self.state.template_renders_tools = "hermes", False
            return render_chatml(messages, self.plan.tools)
        self.state.tool_format, self.state.template_renders_tools = template.tool_format, template.renders_tools
        try:
            return template.render(messages, tools=self.plan.tools)
        except TemplateRefused as exc:
            raise InvalidArgument([("messages", f"the model's chat template refused them: {exc}")]) from exc
