"""The openai backend: generation by an OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp).

* Prompts are counted and validated with our own tokenizer (the one admission and the cache key
  use) and go to the server unchanged, as token ids or as the rendered text (LLMESH_BACKEND_PROMPT).
* One `httpx.AsyncClient` for all replicas: pooled keep-alive connections with a bound, no
  connection per request. Streams are `/completions` with `stream=true` and
  `stream_options.include_usage`, read off the socket with a lean SSE framing; the chunks one
  read brings become one event, nothing held back waiting for more (the gateway's GenerateMany
  stream then carries a step's events of every stream as one message), and each body is read to
  its end so its connection goes back to the pool.
* A cancelled or expired call closes its HTTP stream at once (the handler task is cancelled
  inside `client.stream`), so the server frees the sequence (vLLM aborts on disconnect).
* Replicas: a list of base URLs, each polled on `/models`; a request goes to the healthy replica
  with the fewest requests in flight. The service serves while any replica lists the model.
  A request whose replica fails before its first token in a way another replica may fix (refused
  or dropped connection, timeout, HTTP 5xx, 429/503 overload, a stream that ends with nothing in
  it) is sent once more to another replica not tried yet (healthy, else listed); never after the
  first token (the caller has part of that replica's answer), never a request the server rejects
  (4xx: another would reject it too), never a cancelled one. Retries are held to a tenth of the
  requests by a retry budget (`llmesh.retry_budget`), so that they cannot multiply the load while
  replicas fail. The span says where it was retried; `llmesh_inference_backend_retries` counts.
* Silence: a replica that answered nothing (neither its `/metrics`, scraped every 0.1 s, nor its
  `/models`, nor a stream's chunk) for `silence_s` (LLMESH_BACKEND_SILENCE_SECONDS) is out of
  service (a frozen or wedged server accepts connections and answers nothing) until its first
  answer brings it back:
  the service turns NOT_SERVING (a gateway with other replicas ejects it) but, with no healthy
  replica, still sends work to a listed one (it may only be slow) and fails no stream.
  A change of health is announced at once (`wait_changed`): the service's NOT_SERVING goes out
  without waiting for a poll.
* At start, the token count of a probe text is compared with the server's `usage.prompt_tokens`:
  a tokenizer that does not match the served model stops the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
from opentelemetry import propagate, trace
from tokenizers import Tokenizer

from llmesh import errors
from llmesh.models import ModelError, resolve, verify
from llmesh.retry_budget import RetryBudget
from llmesh.settings import BackendSettings, GenerationLimits, redact_url
from services.inference import metrics
from services.inference.backend_load import SCRAPED, ReplicaLoad, combine, parse_metrics
from services.inference.engine import FINISH_STOP, GenerationEvent, ModelDescription, TokenLogprob
from services.inference.engine import metrics as engine_metrics
from services.inference.engine.decoding import Limits, ResolvedParams, SamplingParams, TokenPieces, resolve_params
from services.inference.engine.load import EngineLoad
from services.inference.openai_protocol import (
    Chunk,
    EchoSplitter,
    SSEReader,
    completion_body,
    error_for_status,
    merge_chunks,
    parse_chunk,
    token_logprobs,
)

log = logging.getLogger("llmesh.inference.openai")
tracer = trace.get_tracer("llmesh.inference")

#: Text whose token count tells tokenizers apart: words, digits, code, accents, CJK, emoji.
PROBE_TEXT = (
    "Tokenizer probe: llmesh counts 1234567 tokens; def f(x): return x**2 # naïve café, "
    "Grüße aus Köln! 東京タワー 🚀 <tag attr='v'>https://example.org/a?b=c</tag>"
)
#: Log a "still waiting" line this often while no replica lists the model at start.
WAIT_LOG_INTERVAL_S = 10.0
#: The engines' /metrics are scraped this often (the load the gateway admits on), never per
#: request; a scrape older than LOAD_STALE_S no longer counts.
LOAD_POLL_INTERVAL_S = 0.1
LOAD_STALE_S = 2.0
#: The scrape asks for the metrics it reads (prometheus_client's `name[]` filter). vLLM's plain
#: `/metrics` route renders all of them (51 KB, 14-19 ms of its API server's CPU, which streams
#: every token; 10 a second would be 15% of a core); the filtered answer is 2.4 KB in 2.6 ms.
#: The slash reaches the prometheus_client app vLLM (and SGLang) mount under /metrics, which
#: honours the filter; a server where it answers nothing usable is scraped on /metrics.
FILTERED_METRICS_PATH = "/metrics/?" + "&".join(f"name[]={name}" for name in SCRAPED)
#: How long the rest of a body after [DONE] is read for (it is the end of the chunked encoding,
#: there at once) so the connection goes back to the pool.
BODY_END_S = 1.0
#: The silence watch looks this many times per `silence_s`.
SILENCE_CHECKS = 4
#: Retries on another replica: each request earns a tenth of one, up to ten in a burst (the
#: gateway's defaults). Constants, not settings: a retry is worth making while replicas fail one
#: by one, and must stay a small share of the load when they all fail (an outage), which is all
#: the budget is for; there is no load it should be tuned to.
RETRY_BUDGET_RATIO = 0.1
RETRY_BUDGET_BURST = 10.0
#: Errors before the first token that another replica may not have: refused, failed, timed out
#: or overloaded. A request the server rejects (INVALID_ARGUMENT, FAILED_PRECONDITION) would be
#: rejected by any replica.
RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL})
#: ...except that our connection pool being full is ours, not the replica's: all replicas share it.
NO_RETRY_REASONS = frozenset({"BACKEND_CONNECTIONS_BUSY"})


@dataclass(frozen=True)
class BackendConfig:
    urls: tuple[str, ...]
    model: str
    api_key: str = ""
    prompt_as: str = "tokens"
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0
    max_connections: int = 512
    health_interval_s: float = 1.0
    silence_s: float = 0.4
    max_prompt_tokens: int = 1536
    max_new_tokens: int = 512
    default_max_new_tokens: int = 128
    send_priority: bool = False

    @classmethod
    def from_settings(cls, backend: BackendSettings, limits: GenerationLimits) -> BackendConfig:
        """From inference's LLMESH_BACKEND_* settings and its generation limits."""
        return cls(
            urls=backend.urls,
            model=backend.model,
            api_key=backend.api_key,
            prompt_as=backend.prompt,
            connect_timeout_s=backend.connect_timeout_seconds,
            read_timeout_s=backend.read_timeout_seconds,
            max_connections=backend.max_connections,
            health_interval_s=backend.health_interval_seconds,
            silence_s=backend.silence_seconds,
            max_prompt_tokens=limits.max_prompt_tokens,
            max_new_tokens=limits.max_new_tokens,
            default_max_new_tokens=limits.default_max_new_tokens,
            send_priority=backend.priority,
        )


class LocalTokenizer:
    """Our side of the model: its tokenizer only (the weights live in the backend)."""

    def __init__(self, path: Path, digest: str) -> None:
        self.path = path
        self.digest = digest
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._pieces = TokenPieces(self.tokenizer)

    @classmethod
    def load(cls, models_path: Path, model_setting: str) -> LocalTokenizer:
        try:
            verified = verify(resolve(models_path, model_setting))
        except ModelError as exc:
            raise errors.FailedPrecondition(f"inference: {exc}", reason="MODEL_INVALID") from exc
        return cls(verified.path, str(verified.manifest["files"].get("tokenizer.json", verified.digest)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def counts(self, text: str) -> set[int]:
        """Token counts a server may report for `text`: with or without the special tokens it adds."""
        return {len(self.encode(text)), len(self.tokenizer.encode(text, add_special_tokens=True).ids)}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def piece_of(self, token: str) -> tuple[int, str, bytes]:
        """A backend's token string as (id, text, bytes): vLLM's "token_id:N" (what we ask for)
        from our tokenizer; another server's token text as it is, its id where it is one token."""
        name, _, number = token.partition(":")
        if name == "token_id" and number.isdigit() and int(number) < self.vocab_size:
            token_id = int(number)
            return (token_id, *self._pieces.piece(token_id))
        ids = self.encode(token)
        return (ids[0] if len(ids) == 1 else 0), token, token.encode("utf-8", "surrogatepass")


@dataclass(eq=False)
class Replica:
    base_url: str
    healthy: bool = False  # serves now: lists the model and answered within silence_s
    listed: bool = False  # its /models listed the model when it last answered
    answered_at: float = -math.inf  # when it last answered anything (monotonic)
    in_flight: int = 0
    max_model_len: int = 0
    engine: str = ""  # what the server calls itself, e.g. "vllm 0.32.0"
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    metrics_path: str = FILTERED_METRICS_PATH  # "/metrics" once the filtered scrape brought nothing
    #: The URL as logs, errors and ModelInfo show it: without a password it may carry.
    shown: str = field(init=False)

    def __post_init__(self) -> None:
        self.shown = redact_url(self.base_url)

    @property
    def origin(self) -> str:
        parts = urlsplit(self.base_url)
        return f"{parts.scheme}://{parts.netloc}"


class OpenAIStream:
    """A request's events from the backend; cancel() closes the HTTP stream if still open."""

    def __init__(self, events: AsyncGenerator[GenerationEvent, None]) -> None:
        self._events = events
        self._done = False
        self._closing: asyncio.Future[None] | None = None  # held so the close task is not collected

    def __aiter__(self) -> OpenAIStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        try:
            event = await self._events.__anext__()
        except BaseException:  # finished, failed or cancelled: the generator has closed the stream
            self._done = True
            raise
        return event

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._closing = asyncio.ensure_future(self._events.aclose())


class OpenAIBackend:
    def __init__(
        self, config: BackendConfig, tokenizer: LocalTokenizer, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.clock = clock
        self.replicas = [Replica(url) for url in config.urls]
        self._changed = asyncio.Event()  # a replica's health changed since the last wait_changed
        self._last_silence_check = math.inf
        self._hold_silence_until = -math.inf
        self._turn = itertools.count()
        self.budget = RetryBudget(RETRY_BUDGET_RATIO, RETRY_BUDGET_BURST)
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s,
                read=config.read_timeout_s,
                write=config.connect_timeout_s,
                pool=config.connect_timeout_s,
            ),
            limits=httpx.Limits(
                max_connections=config.max_connections,
                max_keepalive_connections=config.max_connections,
                keepalive_expiry=30.0,
            ),
        )
        self._monitor: asyncio.Task[None] | None = None
        self._load_poll: list[asyncio.Task[None]] = []
        self._silence: asyncio.Task[None] | None = None
        self.limits = Limits(
            max_prompt_tokens=config.max_prompt_tokens,
            max_new_tokens=config.max_new_tokens,
            default_max_new_tokens=config.default_max_new_tokens,
            max_context_tokens=config.max_prompt_tokens + config.max_new_tokens,
            vocab_size=tokenizer.vocab_size,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Waits until a replica lists the model, checks the tokenizer against it, then keeps
        watching the replicas' health."""
        waited_since = time.monotonic()
        next_log = waited_since + WAIT_LOG_INTERVAL_S
        while not await self.check_health():
            if time.monotonic() >= next_log:
                log.warning(
                    "waiting for the inference backend: no replica of %s lists model %r (%.0f s)",
                    ", ".join(r.shown for r in self.replicas),
                    self.config.model,
                    time.monotonic() - waited_since,
                )
                next_log += WAIT_LOG_INTERVAL_S
            await asyncio.sleep(self.config.health_interval_s)
        await self.check_tokenizer()
        self._monitor = asyncio.create_task(self._watch())
        self._load_poll = [asyncio.create_task(self._poll_load(r)) for r in self.replicas]
        self._silence = asyncio.create_task(self._watch_silence())
        desc = self.description
        log.info("serving %s through %s (%s)", desc.model_id, ", ".join(r.shown for r in self.replicas), desc.version)

    async def close(self) -> None:
        for task in (self._monitor, self._silence, *self._load_poll):
            if task is not None:
                task.cancel()
        await self.client.aclose()

    async def load_version(self, version: str) -> ModelDescription:
        raise errors.FailedPrecondition(
            "inference: model versions are switched on the backend server when LLMESH_INFERENCE_BACKEND=openai",
            reason="BACKEND_MANAGES_MODEL",
        )

    # ------------------------------------------------------------------ health

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    async def check_health(self) -> bool:
        """Polls every replica's /models once; True when any lists the model."""
        await asyncio.gather(*(self._probe(r) for r in self.replicas))
        return self.serving

    async def _probe(self, replica: Replica) -> None:
        listed = False
        try:
            answer = await self.client.get(f"{replica.base_url}/models", timeout=self.config.connect_timeout_s + 1)
            replica.answered_at = self.clock()
            if answer.status_code == 200:
                for entry in answer.json().get("data") or ():
                    if entry.get("id") == self.config.model:
                        listed = True
                        replica.max_model_len = int(entry.get("max_model_len") or 0)
                        owner = entry.get("owned_by") or "openai-compatible"
                        if not replica.engine.startswith(owner):
                            replica.engine = await self._engine_name(replica, owner)
        except httpx.TimeoutException:
            return  # silent, not refusing: the silence watch judges, and its first answer brings it back
        except (httpx.HTTPError, ValueError):
            listed = False
        if listed != replica.listed:
            if listed:
                log.info("inference backend %s serves %s", replica.shown, self.config.model)
            else:
                log.warning("inference backend %s does not serve %s", replica.shown, self.config.model)
            replica.listed = listed
        self._set_healthy(replica, listed and not self._silent(replica, self.clock()))

    def _answered(self, replica: Replica) -> None:
        """The replica answered (any HTTP response): it is not frozen."""
        replica.answered_at = self.clock()
        if replica.listed and not replica.healthy:
            log.info("inference backend %s answers again", replica.shown)
            self._set_healthy(replica, True)

    def _silent(self, replica: Replica, now: float) -> bool:
        return now - replica.answered_at > self.config.silence_s

    def _set_healthy(self, replica: Replica, healthy: bool) -> None:
        if healthy != replica.healthy:
            replica.healthy = healthy
            self._changed.set()

    async def wait_changed(self) -> None:
        """Returns once a replica's health changed since the last call (at once if it did)."""
        await self._changed.wait()
        self._changed.clear()

    async def _watch_silence(self) -> None:
        every = self.config.silence_s / SILENCE_CHECKS
        while True:
            await asyncio.sleep(every)
            self.check_silence()

    def check_silence(self) -> None:
        """Takes the replicas silent for longer than silence_s out of service. A check that comes
        late (this process's event loop lagged: the answers may be waiting unread) holds the
        judgement for a silence period, since the silence was this side's."""
        now = self.clock()
        if now - self._last_silence_check > self.config.silence_s / 2:
            self._hold_silence_until = now + self.config.silence_s
        self._last_silence_check = now
        if now < self._hold_silence_until:
            return
        for r in self.replicas:
            if r.healthy and self._silent(r, now):
                log.warning(
                    "inference backend %s answered nothing for %.2f s: out of service until it answers",
                    r.shown,
                    now - r.answered_at,
                )
                self._set_healthy(r, False)

    # ------------------------------------------------------------------ load

    async def _poll_load(self, replica: Replica) -> None:
        """One loop per replica, so a frozen one's hanging scrape delays no other's."""
        while True:
            if replica.listed:
                await self._scrape(replica)
            await asyncio.sleep(LOAD_POLL_INTERVAL_S)

    async def _scrape(self, replica: Replica) -> None:
        try:
            answer = await self.client.get(
                f"{replica.origin}{replica.metrics_path}",
                timeout=self.config.connect_timeout_s,
                headers={"accept-encoding": "identity"},  # 2 KB: compressing costs the server more
            )
        except httpx.HTTPError:
            replica.load.forget()
            return
        self._answered(replica)  # any answer, even a server without /metrics: it is alive
        sample = parse_metrics(answer.text) if answer.status_code == 200 else None
        if (sample is None or not sample.found) and replica.metrics_path != "/metrics":
            log.info("%s: no load in the filtered /metrics; scraping the whole /metrics", redact_url(replica.origin))
            replica.metrics_path = "/metrics"
        if sample is None:
            replica.load.forget()
            return
        replica.load.update(sample, time.monotonic())

    def load(self) -> EngineLoad | None:
        """The listed replicas' load from their scrapes of the last LOAD_STALE_S (None: no server
        reports one); a silent one's goes stale on its own."""
        now = time.monotonic()
        loads = [
            found
            for r in self.replicas
            if r.listed and now - r.load.scraped_at <= LOAD_STALE_S and (found := r.load.load()) is not None
        ]
        return combine(loads)

    async def _engine_name(self, replica: Replica, owner: str) -> str:
        """vLLM, SGLang and TGI tell their version on /version (outside /v1)."""
        try:
            answer = await self.client.get(f"{replica.origin}/version", timeout=self.config.connect_timeout_s)
            version = answer.json().get("version") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            version = None
        return f"{owner} {version}" if version else owner

    @property
    def serving(self) -> bool:
        return any(r.healthy for r in self.replicas)

    # ------------------------------------------------------------------ model

    @property
    def encoder(self) -> LocalTokenizer:
        return self.tokenizer

    @property
    def description(self) -> ModelDescription:
        serving = [r for r in self.replicas if r.healthy] or self.replicas
        context = min((r.max_model_len for r in serving if r.max_model_len), default=0)
        return ModelDescription(
            model_id=self.config.model,
            version=serving[0].engine or "openai-compatible",
            digest=self.tokenizer.digest,
            path=self.tokenizer.path,
            device=",".join(r.shown for r in serving),
            dtype="",
            max_context_tokens=context or self.limits.max_context_tokens,
            max_batch_size=0,
        )

    def _limits(self) -> Limits:
        context = self.description.max_context_tokens
        return Limits(**{**self.limits.__dict__, "max_context_tokens": context})

    async def check_tokenizer(self) -> None:
        """Our token count of PROBE_TEXT against the backend's; a mismatch stops the service."""
        replica = self._pick()
        body = {"model": self.config.model, "prompt": PROBE_TEXT, "max_tokens": 1, "temperature": 0.0}
        try:
            answer = await self.client.post(f"{replica.base_url}/completions", json=body)
        except httpx.HTTPError as exc:
            raise errors.Unavailable(f"inference backend {replica.shown} failed the tokenizer probe: {exc}") from exc
        if answer.status_code != 200:
            raise error_for_status(answer.status_code, answer.headers, answer.content)
        theirs = int((answer.json().get("usage") or {}).get("prompt_tokens") or -1)
        ours = self.tokenizer.counts(PROBE_TEXT)
        if theirs not in ours:
            message = (
                f"inference: the tokenizer at {self.tokenizer.path} counts {min(ours)} tokens in the probe text "
                f"where the backend's model {self.config.model!r} at {replica.shown} counts {theirs}: they are "
                "different tokenizers. Admission and the cache key count tokens with ours, so the service stops; "
                "point LLMESH_INFERENCE_MODEL at the model the backend serves."
            )
            log.error("%s", message)
            raise errors.FailedPrecondition(message, reason="TOKENIZER_MISMATCH")
        log.info("tokenizer matches the backend's model (%d probe tokens)", theirs)

    # ------------------------------------------------------------------ generation

    def _pick(self) -> Replica:
        replica = self._choose()
        if replica is None:
            raise errors.Unavailable(
                f"inference backend: no replica serves {self.config.model!r}",
                reason="BACKEND_UNAVAILABLE",
                retry_after=self.config.health_interval_s,
            )
        return replica

    def _choose(self, tried: Collection[Replica] = ()) -> Replica | None:
        """The healthy replica (not in `tried`) with the fewest in flight, equals taking turns."""
        # A silent replica that still lists the model may only be slow (a starved machine): with
        # no healthy one it still takes work rather than the service refusing it. Its NOT_SERVING
        # has told the callers who have another replica to go there.
        left = [r for r in self.replicas if r not in tried]
        ready = [r for r in left if r.healthy] or [r for r in left if r.listed]
        if not ready:
            return None
        start = next(self._turn) % len(ready)
        return min(ready[start:] + ready[:start], key=lambda r: r.in_flight)

    async def prepare(self, params: SamplingParams) -> None:
        """Nothing: the engine behind compiles its own grammars."""

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str = "", priority: int = 0
    ) -> OpenAIStream:
        """`priority`: the request's (0 interactive, higher for batch work), sent as vLLM's own
        `priority` field where the backend schedules by it (LLMESH_BACKEND_PRIORITY)."""
        try:
            resolved = resolve_params(params, prompt_ids, self._limits())
        except errors.InvalidArgument:
            engine_metrics.REQUESTS.labels("invalid").inc()
            raise
        replica = self._pick()
        self.budget.earn()
        prompt: list[int] | str = prompt_ids if self.config.prompt_as == "tokens" else self.tokenizer.decode(prompt_ids)
        body = completion_body(self.config.model, prompt, resolved, response_format=params.response_format)
        if priority and self.config.send_priority:
            body["priority"] = priority
        echo = None
        if body.get("echo"):
            echo = EchoSplitter(len(prompt_ids), self.tokenizer.decode(prompt_ids))
        return OpenAIStream(self._stream(replica, body, resolved, len(prompt_ids), request_id, echo))

    def _start_span(
        self, resolved: ResolvedParams, prompt_tokens: int, request_id: str, replica: Replica
    ) -> trace.Span:
        span = tracer.start_span(
            "inference.generate",
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.system": "openai",
                "gen_ai.request.model": self.config.model,
                "gen_ai.request.max_tokens": resolved.max_new_tokens,
                "gen_ai.request.temperature": resolved.temperature,
                "gen_ai.request.top_p": resolved.top_p,
                "gen_ai.usage.input_tokens": prompt_tokens,
                **self._server_attributes(replica),
                "llmesh.request.id": request_id,
            },
        )
        if resolved.seed is not None:
            span.set_attribute("gen_ai.request.seed", resolved.seed)
        return span

    @staticmethod
    def _server_attributes(replica: Replica) -> dict[str, str | int]:
        parts = urlsplit(replica.base_url)
        return {
            "server.address": parts.hostname or "",
            "server.port": parts.port or (443 if parts.scheme == "https" else 80),
            "llmesh.inference.backend": replica.engine or "openai-compatible",
        }

    def _event(self, chunk: Chunk, resolved: ResolvedParams) -> GenerationEvent:
        """A chunk's text; with logprobs asked, its tokens and their log probabilities too."""
        if not resolved.logprobs or not chunk.logprobs:
            return GenerationEvent(list(chunk.token_ids), chunk.text, tokens=chunk.tokens)
        entries = token_logprobs(chunk.logprobs, resolved.top_logprobs, self.tokenizer.piece_of)
        return GenerationEvent([e.token_id for e in entries], chunk.text, logprobs=entries)

    def _prompt_logprobs(self, echo: EchoSplitter | None, resolved: ResolvedParams) -> list[TokenLogprob]:
        """The echoed prompt's scores as the engine's prompt_logprobs (the first scores 0)."""
        if echo is None or resolved.prompt_logprobs is None or not echo.prompt:
            return []
        entries = token_logprobs(tuple(echo.prompt), resolved.prompt_logprobs, self.tokenizer.piece_of)
        entries[0] = dataclasses.replace(entries[0], logprob=0.0, top=())
        return entries

    async def _stream(
        self,
        replica: Replica,
        body: dict[str, Any],
        resolved: ResolvedParams,
        prompt_tokens: int,
        request_id: str,
        echo: EchoSplitter | None = None,
    ) -> AsyncGenerator[GenerationEvent, None]:
        span = self._start_span(resolved, prompt_tokens, request_id, replica)
        headers: dict[str, str] = {"x-request-id": request_id} if request_id else {}
        propagate.inject(headers, context=trace.set_span_in_context(span))
        started = time.monotonic()
        first_token = True
        finish: str | None = None
        usage = Chunk()  # the usage chunk (include_usage): counts, model and id
        outcome = "error"
        try:
            head, rest = await self._open(replica, body, headers, span)
            async with contextlib.aclosing(rest):
                async for raw in _resumed(head, rest):
                    chunk = echo.split(raw) if echo is not None else raw
                    if chunk.prompt_tokens is not None:
                        usage = chunk
                    finish = chunk.finish_reason or finish
                    if chunk.generated and not resolved.prompt_only:
                        if first_token:
                            first_token = False
                            engine_metrics.TIME_TO_FIRST_TOKEN.observe(time.monotonic() - started)
                            event = self._event(chunk, resolved)
                            event.prompt_logprobs = self._prompt_logprobs(echo, resolved)
                            yield event
                        else:
                            yield self._event(chunk, resolved)
            assert finish is not None  # `_chunks` raised on a stream without one
            input_tokens = usage.prompt_tokens if usage.prompt_tokens is not None else prompt_tokens
            # vLLM samples one token for an echo with max_tokens 0 and counts it; none is answered.
            output_tokens = 0 if resolved.prompt_only else usage.completion_tokens or 0
            outcome = finish
            engine_metrics.PROMPT_TOKENS.inc(input_tokens)
            engine_metrics.GENERATION_TOKENS.inc(output_tokens)
            engine_metrics.REQUEST_DURATION.observe(time.monotonic() - started)
            span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [finish])
            if usage.model:
                span.set_attribute("gen_ai.response.model", usage.model)
            if usage.response_id:
                span.set_attribute("gen_ai.response.id", usage.response_id)
            last = GenerationEvent([], "", "", finish, input_tokens, output_tokens)
            last.cached_input_tokens = usage.cached_tokens or 0
            if first_token:  # nothing generated (prompt_only): the prompt's scores come last
                last.prompt_logprobs = self._prompt_logprobs(echo, resolved)
            yield last
        except (asyncio.CancelledError, GeneratorExit):
            if outcome == "error":  # not yet answered in full
                outcome = "cancelled"
            raise
        except errors.LlmeshError as exc:
            outcome = "invalid" if isinstance(exc, errors.InvalidArgument) else "error"
            span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
            raise
        finally:
            engine_metrics.REQUESTS.labels(outcome if outcome in engine_metrics.OUTCOMES else FINISH_STOP).inc()
            if outcome == "error":
                span.set_status(trace.Status(trace.StatusCode.ERROR, "inference backend failed"))
            span.end()

    async def _open(
        self, replica: Replica, body: dict[str, Any], headers: dict[str, str], span: trace.Span
    ) -> tuple[list[Chunk], AsyncGenerator[Chunk, None]]:
        """Opens the stream on `replica` and reads it up to its first token (or its end). If it
        fails before that in a way another replica may fix, it is opened once more on another one
        not tried yet, within the retry budget. Returns the stream that answered: the chunks read
        (the first token last) and the rest, which the caller closes. After the first token
        nothing is retried: the caller has part of that replica's answer."""
        tried: list[Replica] = []
        while True:
            tried.append(replica)
            chunks = self._chunks(replica, body, headers)
            head: list[Chunk] = []
            try:
                async for chunk in chunks:
                    head.append(chunk)
                    if chunk.generated:
                        break
            except errors.LlmeshError as exc:  # `chunks` has ended: its stream is closed
                again = self._retry_on(exc, tried)
                if again is None:
                    raise
                reason = metrics.retry_reason(exc.reason)
                metrics.BACKEND_RETRIES.labels(reason).inc()
                log.info(
                    "retrying on %s: %s failed before the first token: %s",
                    again.shown,
                    replica.shown,
                    exc.message,
                )
                span.add_event(
                    "llmesh.inference.retry",
                    {
                        "llmesh.inference.failed_replica": replica.shown,
                        "llmesh.inference.replica": again.shown,
                        "error.type": reason,
                    },
                )
                span.set_attributes({**self._server_attributes(again), "llmesh.inference.retried": True})
                replica = again
                continue
            return head, chunks

    def _retry_on(self, error: errors.LlmeshError, tried: list[Replica]) -> Replica | None:
        """The replica to try `error`'s request on next: once, where another may do better, on
        one not tried yet, while the budget allows; None: the error is the caller's."""
        if len(tried) > 1 or error.code not in RETRY_CODES or error.reason in NO_RETRY_REASONS:
            return None
        again = self._choose(tried)
        if again is None or not self.budget.spend():
            return None
        return again

    async def _chunks(
        self, replica: Replica, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncGenerator[Chunk, None]:
        """One replica's stream: what each socket read brings as one chunk (never held back for
        more: several tokens coalesce only when they arrived together); its failures, a stream
        that ends without a finish reason included, as typed errors. The replica counts it in
        flight from the request until the stream is closed."""
        replica.in_flight += 1
        try:
            finished = False
            async with self.client.stream(
                "POST", f"{replica.base_url}/completions", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    raise error_for_status(response.status_code, response.headers, await response.aread())
                reader = SSEReader()
                body_parts = response.aiter_bytes()
                async for raw in body_parts:
                    payloads = reader.feed(raw)
                    if payloads:
                        chunk = merge_chunks([parse_chunk(p) for p in payloads])
                        finished = finished or chunk.finish_reason is not None
                        self._answered(replica)  # it answers: not frozen
                        yield chunk
                    if reader.done:
                        break
                # The body to its end (after [DONE], the chunked encoding's last chunk): a response
                # closed before its end closes its connection, and every request then opened a
                # new one, at a cost to both sides (vLLM's server accepts each).
                with contextlib.suppress(TimeoutError, httpx.HTTPError):
                    async with asyncio.timeout(BODY_END_S):
                        async for _ in body_parts:
                            pass
            if not finished:
                raise errors.Unavailable(
                    f"inference backend {replica.shown} ended the stream without finishing",
                    reason="BACKEND_STREAM_BROKEN",
                )
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.PoolTimeout):
                raise errors.ResourceExhausted(
                    f"inference backend: all {self.config.max_connections} connections are busy "
                    "(LLMESH_BACKEND_MAX_CONNECTIONS)",
                    retry_after=1.0,
                    reason="BACKEND_CONNECTIONS_BUSY",
                ) from exc
            raise errors.Unavailable(
                f"inference backend {replica.shown} timed out: {type(exc).__name__}", reason="BACKEND_TIMEOUT"
            ) from exc
        except httpx.ConnectError as exc:
            replica.healthy = False  # the health poll brings it back
            raise errors.Unavailable(
                f"inference backend {replica.shown} could not be reached: {exc}", reason="BACKEND_UNREACHABLE"
            ) from exc
        except httpx.HTTPError as exc:
            raise errors.Unavailable(
                f"inference backend {replica.shown} failed mid-stream: {type(exc).__name__}: {exc}",
                reason="BACKEND_STREAM_BROKEN",
            ) from exc
        finally:
            replica.in_flight -= 1


async def _resumed(head: list[Chunk], rest: AsyncGenerator[Chunk, None]) -> AsyncGenerator[Chunk, None]:
    """The chunks read already, then the rest of the stream."""
    for chunk in head:
        yield chunk
    async for chunk in rest:
        yield chunk
