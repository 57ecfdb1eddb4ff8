"""The asyncio front of the engine: `Engine`, one loaded model version served with
iteration-level continuous batching, as the service sees it.

Domain code only (no gRPC). Requests are submitted from asyncio (`Engine.submit`), validated at
once (limits, a response format's grammar) and put in the engine core's inbox (a full queue
answers ResourceExhausted at once); the caller iterates a `RequestStream` of the events the
output processor delivers on its event loop. Everything else happens on the engine core's
worker thread (engine_core.py): the loop, the scheduler's queues (scheduler.py), the KV blocks
(kv_manager.py), the forwards (runner.py); the front reads only the counters it keeps.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from llmesh import errors
from llmesh.hardware import dtype_name
from llmesh.models import VerifiedModel
from services.inference.engine import metrics
from services.inference.engine.config import EngineConfig
from services.inference.engine.decoding import IncrementalDecoder, Limits, SamplingParams, StopMatcher, resolve_params
from services.inference.engine.engine_core import EngineCore
from services.inference.engine.kv_manager import BlockManager
from services.inference.engine.load import EngineLoad
from services.inference.engine.model import LoadedModel, ModelDescription
from services.inference.engine.output import tracer
from services.inference.engine.runner import ModelRunner
from services.inference.engine.sequence import PRIORITY_INTERACTIVE, GenerationEvent, SequenceState, Sink, to_int64

if TYPE_CHECKING:
    from services.inference.engine.grammar import Grammars

log = logging.getLogger("llmesh.inference.engine")


class RequestStream:
    """Async iterator over one request's GenerationEvents. Stopping early (aclose, a cancelled
    task, a dropped RPC) must call cancel(): the engine then frees the row within one step."""

    def __init__(self, seq: SequenceState, cancel: Callable[[SequenceState], None]) -> None:
        self._seq = seq
        self._cancel = cancel
        self._done = False

    @property
    def batch_id(self) -> str:
        return self._seq.batch_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        q = self._seq.sink.queue
        assert q is not None
        try:
            item = await q.get()
        except BaseException:
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._cancel(self._seq)

    async def aclose(self) -> None:
        self.cancel()


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, name: str = "") -> None:
        self.model = model
        self.config = config
        # Constrained decoding (engine/grammar.py): built on first use; llguidance loads only then.
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        # One thread compiles grammars (off the event loop; llguidance releases the GIL), one
        # at a time: a flood of schemas queues there, not in the replica's streams.
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"grammar-{name or 'engine'}")
        self.name = name or model.verified.version
        self.tag = f"{self.name}.{secrets.token_hex(2)}"
        self.core = EngineCore(model, config, self.tag)
        #: Called (from the worker thread) when the worker dies and the engine closes.
        self.on_dead: list[Callable[[Engine], None]] = []
        self.core.on_dead.append(self._worker_died)
        self.limits = Limits(
            max_prompt_tokens=config.max_prompt_tokens,
            max_new_tokens=config.max_new_tokens,
            default_max_new_tokens=config.default_max_new_tokens,
            max_context_tokens=min(
                model.max_context_tokens, config.max_seq_tokens(model.max_context_tokens), self.max_total_tokens
            ),
            vocab_size=model.vocab_size,
        )
        self.description = ModelDescription(
            model_id=model.verified.model_id,
            version=model.verified.version,
            digest=model.verified.digest,
            path=model.verified.path,
            device=str(model.device),
            dtype=model.dtype_name,
            max_context_tokens=model.max_context_tokens,
            max_batch_size=config.max_batch_size,
        )
        self._served: Any = metrics.MODEL_SERVED.labels(
            model.verified.model_id, model.verified.version, dtype_name(model.dtype), model.quantize
        )
        self._served.inc()

    # ----------------------------------------------------------------- lifecycle

    @classmethod
    def boot(cls, verified: VerifiedModel, config: EngineConfig, device: str = "auto") -> Engine:
        """Loads, warms up and starts an engine; returns once it serves (blocking). (Named
        `boot`, not `load`: `load()` is the engine's load report.)

        Loading, warm-up and serving all run on the engine's own worker thread: torch's CPU
        kernels keep one OpenMP thread pool per calling thread, and a second pool (say, the
        warm-up's on an executor thread) makes OpenMP see more threads than cores and put its
        workers to sleep between kernels, which costs about a fifth of the decode speed on a
        small machine."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def run() -> None:
            try:
                engine = cls(LoadedModel(verified, device, config.dtype, config.quantize), config)
                engine.warm_up()
                engine.core.thread = threading.current_thread()
                box["engine"] = engine
            except BaseException as exc:
                box["error"] = exc
                return
            finally:
                ready.set()
            engine.core.run()

        threading.Thread(target=run, name=f"inference-{verified.version}", daemon=True).start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        engine: Engine = box["engine"]
        return engine

    def start(self) -> None:
        """Starts the worker thread of an engine built directly (tests)."""
        thread = threading.Thread(target=self.core.run, name=f"inference-{self.tag}", daemon=True)
        self.core.thread = thread
        thread.start()

    def warm_up(self) -> None:
        """A short generation through the real path (prefill, decode, sampling, removal) and, on
        CUDA, the capture of the decode graphs, before the worker starts, so the first user
        request pays no first-call costs. The prefix cache is emptied after: warm-up prompts
        are no user's."""
        ids = self.model.encode("Hello! How are you today?") or [self.model.pad_id]
        seqs = [
            self._new_sequence(ids, SamplingParams(max_new_tokens=4, ignore_eos=True), "warm-up", None, True),
            self._new_sequence(
                ids[:2],
                SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, seed=0, ignore_eos=True),
                "warm-up",
                None,
                True,
            ),
        ]
        core = self.core
        with torch.inference_mode():
            for attempt in range(2 if core.runner.use_graphs else 1):
                if attempt:
                    core.capture()
                    seqs = [
                        self._new_sequence(
                            s.prompt_ids, SamplingParams(max_new_tokens=4, ignore_eos=True), "warm-up", None, True
                        )
                        for s in seqs
                    ]
                core.serve_now(seqs)
        core.output.sync()
        for seq in seqs:
            failure = next((i for i in seq.sink.items if isinstance(i, BaseException)), None)
            if failure is not None:
                raise RuntimeError(f"warm-up failed: {failure}") from failure
        core.forget_warm_up()

    def close(self, reason: str = "the model was unloaded") -> None:
        """Stops the worker; anything still queued or running gets UNAVAILABLE."""
        self.core.close(reason)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        served, self._served = self._served, None
        if served is not None:
            served.dec()

    def _worker_died(self) -> None:
        for callback in self.on_dead:
            try:
                callback(self)
            except Exception:
                log.exception("on_dead callback failed")

    def drain(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running (the old engine after a model switch)."""
        return self.core.inbox.idle.wait(timeout)

    # ----------------------------------------------------------------- what the core keeps

    @property
    def kv(self) -> BlockManager:
        return self.core.kv

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def max_total_tokens(self) -> int:
        """The physical KV footprint in tokens (the usable blocks)."""
        return self.core.max_total_tokens

    @property
    def max_prefill_tokens(self) -> int:
        return self.core.max_prefill_tokens

    @property
    def fault_hook(self) -> Callable[[str, int], None] | None:
        """Fault injection for tests: called before each forward with ("prefill"|"decode", rows)."""
        return self.core.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str, int], None] | None) -> None:
        self.core.fault_hook = hook

    @property
    def dead(self) -> bool:
        return self.core.dead

    @property
    def steps(self) -> int:
        return self.core.steps

    @property
    def preemptions(self) -> int:
        return self.core.preemptions

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.core.prefix_hit_rate

    @property
    def step_s(self) -> float | None:
        return self.core.speeds.step_s

    @property
    def prefill_tok_s(self) -> float | None:
        return self.core.speeds.prefill_tok_s

    @property
    def running_count(self) -> int:
        return self.core.scheduler.batch_rows

    @property
    def cache_columns(self) -> int:
        """KV columns the next decode step attends to (0 when the batch is empty)."""
        running = self.core.scheduler.running
        return max((s.length + 1 for s in running), default=0)

    @property
    def waiting_count(self) -> int:
        return len(self.core.scheduler.waiting) + self.core.inbox.pending

    @property
    def closed(self) -> bool:
        return self.core.inbox.closed

    def load(self) -> EngineLoad:
        """The engine's load now, from any thread, without taking the worker's locks: the
        counters the worker keeps, read as they are (a snapshot may be a step old)."""
        core = self.core
        # tuple() of a deque runs in C under the GIL: a consistent copy while the worker appends.
        waiting = tuple(core.scheduler.waiting)
        chunking = core.scheduler.chunking
        inbox = core.inbox
        # Requests still in the inbox count as interactive: their priority is not read until they arrive.
        waiting_tokens, batch_waiting, batch_tokens = inbox.pending_tokens, 0, 0
        for s in waiting:
            tokens = len(s.prompt_ids) + len(s.generated)
            waiting_tokens += tokens
            if s.priority > PRIORITY_INTERACTIVE:
                batch_waiting += 1
                batch_tokens += tokens
        running_batch = sum(1 for s in tuple(core.scheduler.running) if s.priority > PRIORITY_INTERACTIVE)
        if chunking is not None:
            rest = max(0, len(chunking.prompt_ids) + len(chunking.generated) - chunking.prefilled)
            waiting_tokens += rest
            if chunking.priority > PRIORITY_INTERACTIVE:
                batch_tokens += rest
                running_batch += 1
        stats = core.kv.stats()
        return EngineLoad(
            running=self.running_count,
            max_running=self.config.max_batch_size,
            waiting=len(waiting) + inbox.pending,
            kv_blocks_free=stats.free_blocks,
            kv_blocks_total=stats.total_blocks,
            block_tokens=core.kv.block_tokens,
            waiting_prompt_tokens=waiting_tokens,
            step_seconds=core.speeds.step_s,
            prefill_tokens_per_second=core.speeds.prefill_tok_s,
            prefix_hit_rate=core.prefix_hit_rate or 0.0,
            prefix_hashes=core.kv.prefix_hashes(),
            running_batch=running_batch,
            waiting_batch=batch_waiting,
            waiting_batch_prompt_tokens=batch_tokens,
        )

    # ----------------------------------------------------------------- submission (event loop)

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str = "", priority: int = PRIORITY_INTERACTIVE
    ) -> RequestStream:
        """Validates and enqueues a request; raises InvalidArgument, ResourceExhausted (queue
        full) or Unavailable (engine closed) at once. Call from a running event loop.
        `priority`: PRIORITY_INTERACTIVE, or a higher number that waits and yields its row to
        a lower one (scheduler.py)."""
        loop = asyncio.get_running_loop()
        try:
            seq = self._new_sequence(list(prompt_ids), params, request_id, loop, False)
            seq.priority = priority
        except errors.InvalidArgument:
            metrics.REQUESTS.labels("invalid").inc()
            raise
        self._start_request_span(seq)
        try:
            free_rows = max(0, self.config.max_batch_size - self.running_count)
            self.core.inbox.submit(seq, free_rows=free_rows)
        except errors.LlmeshError as exc:
            if seq.span is not None:
                seq.span.end()
            if isinstance(exc, errors.ResourceExhausted):
                metrics.REQUESTS.labels("rejected_queue_full").inc()
            raise
        return RequestStream(seq, self.core.cancel)

    async def prepare(self, params: SamplingParams) -> None:
        """Compiles the request's response format, if it has one the grammar library does not hold
        yet, on the compile thread: a compile takes up to seconds for a large schema, and on the
        event loop it would stall every stream of this replica (the gateway ejects a replica
        silent for 0.75 s). Past the time limit the request is refused INVALID_ARGUMENT naming
        the field; the compile itself runs to its end on its thread, one at a time."""
        spec = params.response_format
        if spec is None:
            return
        loop = asyncio.get_running_loop()
        grammars = self._grammars
        if grammars is None:
            grammars = await loop.run_in_executor(self._compiler, self.grammars)
        if grammars.holds(spec):
            return
        compiling = loop.run_in_executor(self._compiler, grammars.compiled, spec)
        limit = self.config.grammar_compile_s
        try:
            await asyncio.wait_for(asyncio.shield(compiling), limit)
        except TimeoutError:
            compiling.add_done_callback(_consume)
            field = grammars.source_field(spec)
            raise errors.InvalidArgument(
                [(field, f"took longer than {limit:g} s to compile (LLMESH_GRAMMAR_COMPILE_SECONDS); simplify it")]
            ) from None

    def grammars(self) -> Grammars:
        """The model's grammar library, built on the first request with a response format."""
        with self._grammars_lock:
            if self._grammars is None:
                from services.inference.engine.grammar import Grammars

                model = self.model
                self._grammars = Grammars(model.tokenizer, model.vocab_size, model.eos_ids)
            return self._grammars

    def _new_sequence(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        loop: asyncio.AbstractEventLoop | None,
        internal: bool,
    ) -> SequenceState:
        resolved = resolve_params(params, prompt_ids, self.limits)
        seed = resolved.seed if resolved.seed is not None else secrets.randbits(64)
        now = time.monotonic()
        grammar = None
        if params.response_format is not None:  # compiled (or from the LRU) and checked now
            grammar = self.grammars().row(params.response_format, resolved.max_new_tokens)
        return SequenceState(
            grammar=grammar,
            prompt_ids=prompt_ids,
            params=resolved,
            request_id=request_id,
            sink=Sink(loop),
            decoder=IncrementalDecoder(self.model.tokenizer, not resolved.keep_special_tokens),
            stopper=StopMatcher(resolved.stop, resolved.include_stop_str),
            seed=to_int64(int(seed)),
            enqueued_at=now,
            queued_since=now,
            internal=internal,
        )

    def _start_request_span(self, seq: SequenceState) -> None:
        from opentelemetry import trace

        p = seq.params
        span = tracer.start_span(
            "inference.generate",
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": self.description.model_id,
                "gen_ai.request.max_tokens": p.max_new_tokens,
                "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p,
                "gen_ai.usage.input_tokens": len(seq.prompt_ids),
                "llmesh.model.version": self.description.version,
                "llmesh.request.id": seq.request_id,
            },
        )
        if p.seed is not None:
            span.set_attribute("gen_ai.request.seed", p.seed)
        seq.span = span
        seq.span_ctx = trace.set_span_in_context(span)


def _consume(future: Any) -> None:
    """Reads the outcome of a compile whose caller gave up on it (no 'never retrieved' warning)."""
    if not future.cancelled():
        future.exception()
