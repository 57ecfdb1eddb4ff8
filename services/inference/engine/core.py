"""The engine: one loaded model version served with iteration-level continuous batching.

Domain code only (no gRPC). Requests are submitted from asyncio (`Engine.submit`), validated at
once and put in a bounded waiting queue (a full queue answers ResourceExhausted at once). ONE
worker thread owns the model, the running batch and the KV blocks (through the block manager,
kv_manager.py); each iteration it

1. frees the rows of cancelled requests and of requests whose stop string was found;
2. admits waiting requests while rows and KV blocks last (scheduler.py decides how many prompt
   tokens), reusing each prompt's cached prefix, and prefills the rest of the short ones
   together and the next chunk of a long one;
3. gives every running row room for its next token (preempting the newest rows when the pool
   is empty) and runs one decode step for all of them (runner.py), with the long prompt's next
   chunk in the same forward where the own forward serves (a mixed step);
4. frees the rows that ended (EOS, length), and hands the step's tokens to the emitter thread
   (stream.py), which detokenizes and delivers them.

Prompts are recomputed only after an out-of-memory split or a preemption: the requeued
sequences are prefilled again with the tokens they already produced (what of it is still cached
is reused). A row yields the same greedy tokens in any batch as alone: each row attends only to
its own tokens, at its own positions.

A worker that dies (a bug, not a step failure) closes the engine: every waiting and running
request gets UNAVAILABLE, `submit` refuses, and `closed` turns the service NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from llmesh import errors
from llmesh.models import VerifiedModel
from services.inference import metrics
from services.inference.decoding import IncrementalDecoder, Limits, SamplingParams, StopMatcher, resolve_params
from services.inference.engine.config import (
    DEFAULT_MAX_PREFILL_TOKENS,
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
)
from services.inference.engine.kv_manager import BlockManager, KVStats
from services.inference.engine.load import EngineLoad
from services.inference.engine.model import LoadedModel, ModelDescription
from services.inference.engine.runner import ModelRunner, Sampling
from services.inference.engine.sampling import (
    Adjustments,
    Constraints,
    LogprobRows,
    RowAdjustment,
    RowLogprobs,
    Scores,
    choose_scored,
)
from services.inference.engine.scheduler import Admission, BatchState, Scheduler
from services.inference.engine.stream import Emitter, RequestStream, SequenceState, _Sink, tracer

if TYPE_CHECKING:
    from services.inference.engine.grammar import Grammars

log = logging.getLogger("llmesh.inference.engine")

# torch.cuda.OutOfMemoryError is this class too.
_OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)

#: One lock per CUDA device, held by every engine's worker around each iteration and by a
#: warm-up around its graph capture: capture forbids other work on the device, and during a
#: model switch the old engine still serves there. Reentrant: warm-up's own iterations take it.
_DEVICE_LOCKS: dict[str, threading.RLock] = {}
_DEVICE_LOCKS_GUARD = threading.Lock()


def device_lock(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type != "cuda":
        return contextlib.nullcontext()
    with _DEVICE_LOCKS_GUARD:
        return _DEVICE_LOCKS.setdefault(str(device), threading.RLock())


def _adjustments(seqs: list[SequenceState], rows: list[int]) -> Adjustments | None:
    """Penalties, biases and top_k / min_p of the rows that ask for them (None when none does)."""
    adjusted: list[RowAdjustment] = []
    filters: dict[int, tuple[int, float]] = {}
    for row, seq in zip(rows, seqs, strict=True):
        p = seq.params
        if p.adjusts_logits:
            adjusted.append(
                RowAdjustment(
                    row=row,
                    bias=p.logit_bias,
                    repetition=p.repetition_penalty,
                    presence=p.presence_penalty,
                    frequency=p.frequency_penalty,
                    seen=(*seq.prompt_ids, *seq.generated) if p.repetition_penalty != 1.0 else (),
                    generated=tuple(seq.generated) if p.presence_penalty or p.frequency_penalty else (),
                )
            )
        if not p.greedy and (p.top_k or p.min_p):
            filters[row] = (p.top_k, p.min_p)
    if not adjusted and not filters:
        return None
    return Adjustments(tuple(adjusted), filters)


def _logprob_rows(seqs: list[SequenceState]) -> LogprobRows | None:
    """The rows that return log probabilities (None when none does: the batch pays nothing)."""
    asked = [(row, s.params) for row, s in enumerate(seqs) if s.params.logprobs]
    if not asked:
        return None
    return LogprobRows(
        rows=tuple(row for row, _ in asked),
        temperatures=tuple(1.0 if p.greedy else p.temperature for _, p in asked),
        top=tuple(p.top_logprobs for _, p in asked),
    )


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, name: str = "") -> None:
        self.model = model
        self.config = config
        # Constrained decoding (engine/grammar.py): built on first use; llguidance loads only then.
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.name = name or model.verified.version
        self.tag = f"{self.name}.{secrets.token_hex(2)}"
        seq_tokens = config.max_seq_tokens(model.max_context_tokens)
        num_blocks = config.kv_blocks(seq_tokens, model.kv_bytes_per_token, model.device)
        self.kv = BlockManager(num_blocks, config.block_tokens, config.prefix_caching)
        #: The physical KV footprint in tokens (the usable blocks), allocated here.
        self.max_total_tokens = self.kv.usable_blocks * config.block_tokens
        buckets = config.buckets(config.max_batch_size, model.device)
        self.runner = ModelRunner(model, num_blocks, config.block_tokens, seq_tokens, buckets, config.cuda_graphs)
        self.max_prefill_tokens = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS.get(model.device.type, 2048)
        self.limits = Limits(
            max_prompt_tokens=config.max_prompt_tokens,
            max_new_tokens=config.max_new_tokens,
            default_max_new_tokens=config.default_max_new_tokens,
            max_context_tokens=min(model.max_context_tokens, seq_tokens, self.max_total_tokens),
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
        self.scheduler = Scheduler(config, self.kv, self.max_prefill_tokens, self._end, self._retry_after)
        self._thread: threading.Thread | None = None
        self._device = device_lock(model.device)
        # Worker state.
        self._running: list[SequenceState] = []
        self._chunking: SequenceState | None = None
        self._batch = BatchState()
        self._segments = itertools.count(1)
        self._segment_id = ""
        self._segment_steps = 0
        self._membership_changed = False
        self.emitter = Emitter(self)
        #: Measured speeds (EWMA) that size prefill chunks while a batch decodes.
        self.prefill_tok_s: float | None = None
        self.step_s: float | None = None
        #: Fault injection for tests: called before each forward with ("prefill"|"decode", batch size).
        self.fault_hook: Callable[[str, int], None] | None = None
        #: Called (from the worker thread) when the worker dies and the engine closes.
        self.on_dead: list[Callable[[Engine], None]] = []
        self.dead = False
        self.steps = 0
        self.preemptions = 0
        #: Share of admitted prompt tokens served from the prefix cache (EWMA over admissions).
        self.prefix_hit_rate: float | None = None
        self._reported = KVStats(0, 0, 0, 0, 0, 0)
        self._report_kv()

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
                engine._thread = threading.current_thread()
                box["engine"] = engine
            except BaseException as exc:
                box["error"] = exc
                return
            finally:
                ready.set()
            engine._run()

        threading.Thread(target=run, name=f"inference-{verified.version}", daemon=True).start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        engine: Engine = box["engine"]
        return engine

    def start(self) -> None:
        """Starts the worker thread of an engine built directly (tests)."""
        self._thread = threading.Thread(target=self._run, name=f"inference-{self.tag}", daemon=True)
        self._thread.start()

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
        with torch.inference_mode():
            for attempt in range(2 if self.runner.use_graphs else 1):
                if attempt:
                    with self._device:  # no other engine's step on the device while capturing
                        self.runner.capture()
                    seqs = [
                        self._new_sequence(
                            s.prompt_ids, SamplingParams(max_new_tokens=4, ignore_eos=True), "warm-up", None, True
                        )
                        for s in seqs
                    ]
                self.scheduler.extend(seqs)
                while self.scheduler.waiting or self._running or self._chunking is not None:
                    self._iteration(self.scheduler.admit(self._batch_state()))
        self.emitter.sync()
        for seq in seqs:
            failure = next((i for i in seq.sink.items if isinstance(i, BaseException)), None)
            if failure is not None:
                raise RuntimeError(f"warm-up failed: {failure}") from failure
        self.kv.forget_cached()
        self._report_kv()
        self.prefix_hit_rate = None

    def close(self, reason: str = "the model was unloaded") -> None:
        """Stops the worker; anything still queued or running gets UNAVAILABLE."""
        self.scheduler.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._fail_everything(errors.Unavailable(f"inference: {reason}", retry_after=1.0))
        self.emitter.sync()
        self.emitter.stop()
        # This engine's share of the process-wide gauges goes with it.
        metrics.PREFIX_CACHED_BLOCKS.dec(self._reported.cached_blocks)
        metrics.KV_BLOCKS_FREE.dec(self._reported.free_blocks)
        self._reported = dataclasses.replace(self._reported, cached_blocks=0, free_blocks=0)
        self.scheduler.idle.set()

    def drain(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running (the old engine after a model switch)."""
        return self.scheduler.idle.wait(timeout)

    @property
    def running_count(self) -> int:
        return len(self._running) + (self._chunking is not None)

    @property
    def cache_columns(self) -> int:
        """KV columns the next decode step attends to (0 when the batch is empty)."""
        running = self._running
        return max((s.length + 1 for s in running), default=0)

    @property
    def waiting_count(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def closed(self) -> bool:
        return self.scheduler.closed

    def load(self) -> EngineLoad:
        """The engine's load now, from any thread, without taking the worker's locks: the
        counters the worker keeps, read as they are (a snapshot may be a step old)."""
        # tuple() of a deque runs in C under the GIL: a consistent copy while the worker appends.
        waiting = tuple(self.scheduler.waiting)
        chunking = self._chunking
        waiting_tokens = sum(len(s.prompt_ids) + len(s.generated) for s in waiting)
        if chunking is not None:
            waiting_tokens += max(0, len(chunking.prompt_ids) + len(chunking.generated) - chunking.prefilled)
        stats = self.kv.stats()
        return EngineLoad(
            running=self.running_count,
            max_running=self.config.max_batch_size,
            waiting=len(waiting),
            kv_blocks_free=stats.free_blocks,
            kv_blocks_total=stats.total_blocks,
            block_tokens=self.kv.block_tokens,
            waiting_prompt_tokens=waiting_tokens,
            step_seconds=self.step_s,
            prefill_tokens_per_second=self.prefill_tok_s,
            prefix_hit_rate=self.prefix_hit_rate or 0.0,
            prefix_hashes=self.kv.prefix_hashes(),
        )

    # ----------------------------------------------------------------- submission (event loop)

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> RequestStream:
        """Validates and enqueues a request; raises InvalidArgument, ResourceExhausted (queue
        full) or Unavailable (engine closed) at once. Call from a running event loop."""
        loop = asyncio.get_running_loop()
        try:
            seq = self._new_sequence(list(prompt_ids), params, request_id, loop, False)
        except errors.InvalidArgument:
            metrics.REQUESTS.labels("invalid").inc()
            raise
        self._start_request_span(seq)
        try:
            free_rows = max(0, self.config.max_batch_size - self.running_count)
            self.scheduler.submit(seq, free_rows=free_rows)
        except errors.LlmeshError as exc:
            if seq.span is not None:
                seq.span.end()
            if isinstance(exc, errors.ResourceExhausted):
                metrics.REQUESTS.labels("rejected_queue_full").inc()
            raise
        return RequestStream(self, seq)

    def _retry_after(self) -> float:
        per_row = self.emitter.avg_duration / max(1, self.config.max_batch_size)
        return round(min(30.0, max(0.5, per_row * len(self.scheduler.waiting))), 3)

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
            sink=_Sink(loop),
            decoder=IncrementalDecoder(self.model.tokenizer),
            stopper=StopMatcher(resolved.stop),
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

    def _cancel(self, seq: SequenceState) -> None:
        seq.cancelled = True
        self.scheduler.wake()

    # ----------------------------------------------------------------- worker thread

    def _batch_state(self) -> BatchState:
        batch = self._batch
        batch.running = len(self._running)
        batch.chunking = self._chunking is not None
        batch.prefill_tok_s, batch.step_s = self.prefill_tok_s, self.step_s
        return batch

    def _run(self) -> None:
        admission: Admission | None = None
        try:
            with torch.inference_mode():
                while True:
                    admission = self.scheduler.next_work(self._batch_state())
                    if admission is None:
                        return
                    with self._device:
                        self._iteration(admission)
                    admission = None
        except BaseException as exc:
            log.exception("inference worker died; closing the engine")
            self._die(exc, admission)

    def _die(self, exc: BaseException, admission: Admission | None = None) -> None:
        self.dead = True
        self.scheduler.close()
        failure = errors.Unavailable(f"inference: the engine stopped ({exc})", retry_after=1.0)
        # The admission being worked on when the worker died is in no queue and maybe no batch.
        if admission is not None:
            for seq in [*admission.group, *([admission.chunked] if admission.chunked is not None else [])]:
                self._end(seq, None, failure, "error")
        self._fail_everything(failure)
        self.scheduler.idle.set()
        for callback in self.on_dead:
            try:
                callback(self)
            except Exception:
                log.exception("on_dead callback failed")

    def _fail_everything(self, failure: BaseException) -> None:
        waiting = self.scheduler.take_all()
        seqs = [*waiting, *self._running, *([self._chunking] if self._chunking is not None else [])]
        for seq in seqs:
            self._end(seq, None, failure, "error")
        self._reset_batch()

    def _iteration(self, admission: Admission) -> None:
        group = admission.group
        try:
            self._drop_ended_rows()
            if admission.chunked is not None:
                self._chunking = admission.chunked
            if group:
                self._prefill(group)
            if self._chunking is not None and self._running and self.runner.can_mix:
                self._mixed_step()
            else:
                if self._chunking is not None:
                    self._prefill_chunk()
                if self._running:
                    self._decode()
            if self._membership_changed:
                self._new_segment()
        except Exception as exc:  # a bug or a device error: fail this batch, keep serving
            log.exception("inference step failed")
            failure = errors.LlmeshError("inference step failed", reason="ENGINE_ERROR")
            failure.__cause__ = exc
            # Sequences requeued by an OOM split earlier in this iteration are waiting again and
            # are served later; everything that holds blocks fails.
            holding = [*self._running, *([self._chunking] if self._chunking is not None else [])]
            holding += [s for s in group if s.blocks is not None and s not in holding]
            for seq in holding:
                self._end(seq, None, failure, "error")
            self._reset_batch()
        finally:
            self._report_kv()
            if not self._running and self._chunking is None:
                self.scheduler.set_idle()

    def _report_kv(self) -> None:
        stats = self.kv.stats()
        last = self._reported
        if stats == last:
            return
        metrics.PREFIX_CACHED_BLOCKS.inc(stats.cached_blocks - last.cached_blocks)
        metrics.KV_BLOCKS_FREE.inc(stats.free_blocks - last.free_blocks)
        if stats.hit_tokens > last.hit_tokens:
            metrics.PREFIX_HIT_TOKENS.inc(stats.hit_tokens - last.hit_tokens)
        if stats.query_tokens > last.query_tokens:
            queried = stats.query_tokens - last.query_tokens
            metrics.PREFIX_QUERY_TOKENS.inc(queried)
            # Recent, not lifetime: a router wants where reuse happens now.
            self.prefix_hit_rate = _ewma(self.prefix_hit_rate, (stats.hit_tokens - last.hit_tokens) / queried)
        if stats.evictions > last.evictions:
            metrics.PREFIX_EVICTIONS.inc(stats.evictions - last.evictions)
        self._reported = stats

    # ----------------------------------------------------------------- batch membership

    def _end(self, seq: SequenceState, reason: str | None, failure: BaseException | None, outcome: str | None) -> None:
        """The worker is done with `seq`: release its blocks and tell the emitter."""
        self._release(seq)
        if seq.released:
            return
        seq.released = True
        self.emitter.put(("end", seq, reason, failure, outcome))

    def _release(self, seq: SequenceState) -> None:
        if seq in self._running:
            self._running.remove(seq)
            metrics.BATCH_SIZE.dec()
            self._membership_changed = True
        if self._chunking is seq:
            self._chunking = None
        if seq.blocks is not None:
            self.kv.free(seq.blocks)
            seq.blocks = None

    def _reset_batch(self) -> None:
        """After a failed step: the batch is gone. Its blocks are released; blocks registered
        in the prefix cache stay valid (a step only writes positions past a row's registered
        blocks, and never into a shared block)."""
        for seq in [*self._running, *([self._chunking] if self._chunking is not None else [])]:
            self._release(seq)
        self._running = []
        self._chunking = None
        self._new_segment()

    def _drop_ended_rows(self) -> None:
        for seq in [*self._running, *([self._chunking] if self._chunking is not None else [])]:
            if seq.cancelled:
                self._end(seq, FINISH_CANCELLED, None, None)
            elif seq.stop_hit:  # the emitter already sent the last event
                seq.released = True
                self._release(seq)

    def _join(self, seqs: list[SequenceState]) -> None:
        self._running.extend(seqs)
        metrics.BATCH_SIZE.inc(len(seqs))
        self._new_segment()
        for seq in seqs:
            if not seq.batch_id:
                seq.batch_id = self._segment_id

    def _new_segment(self) -> None:
        self._membership_changed = False
        previous = self._segment_steps
        self._segment_id = f"{self.tag}-{next(self._segments)}"
        self._segment_steps = 0
        reserved = sum(s.reserved_tokens for s in self._running)
        self.emitter.put(("segment", self._segment_id, list(self._running), reserved, previous))

    # ----------------------------------------------------------------- model steps

    def grammars(self) -> Grammars:
        """The model's grammar library, built on the first request with a response format."""
        with self._grammars_lock:
            if self._grammars is None:
                from services.inference.engine.grammar import Grammars

                model = self.model
                self._grammars = Grammars(model.tokenizer, model.vocab_size, model.eos_ids)
            return self._grammars

    def _sampling(self, seqs: list[SequenceState]) -> Sampling:
        """Sampling of the batch rows 0..len(seqs)-1 (row i is seqs[i])."""
        picked = [(row, s) for row, s in enumerate(seqs) if not s.params.greedy]
        return (
            [row for row, _ in picked],
            [s.params.temperature for _, s in picked],
            [s.params.top_p for _, s in picked],
            [s.seed for _, s in picked],
            [len(s.generated) for _, s in picked],
            self._constraints(seqs),
            _adjustments(seqs, list(range(len(seqs)))),
            _logprob_rows(seqs),
        )

    def _constraints(self, seqs: list[SequenceState]) -> Constraints | None:
        """The token masks of the rows under a grammar (None when no row has one)."""
        constrained = [(row, s.grammar) for row, s in enumerate(seqs) if s.grammar is not None]
        if not constrained:
            return None
        bitmask = torch.zeros((len(constrained), constrained[0][1].grammars.words), dtype=torch.int32)
        for i, (_, grammar) in enumerate(constrained):
            grammar.fill_mask(bitmask, i)
        return [row for row, _ in constrained], bitmask

    def _register(self, seq: SequenceState) -> None:
        """Puts the full blocks of what `seq` has in the cache into the prefix cache."""
        if seq.blocks is not None:
            self.kv.register(seq.blocks, seq.prefill_ids[: seq.length])

    def _prefill(self, group: list[SequenceState]) -> None:
        """Prefills whole prompts (their uncached rest fits one chunk) into their blocks."""
        started_ns = time.time_ns()
        started = time.perf_counter()
        while True:
            try:
                if self.fault_hook is not None:
                    self.fault_hook("prefill", len(group))
                rows = [self._prefill_row(s, len(s.prefill_ids)) for s in group]
                logits = self.runner.prefill(rows)
                chosen, scores = choose_scored(logits, *self._sampling(group))
                tokens = chosen.tolist()
                break
            except _OOM_ERRORS:
                group = self._on_prefill_oom(group)
                if not group:
                    return
        computed = [len(s.prefill_ids) - s.prefilled for s in group]
        if sum(computed) >= 16:  # tiny prefills say little about the speed
            self.prefill_tok_s = _ewma(self.prefill_tok_s, sum(computed) / (time.perf_counter() - started))
        for seq in group:
            seq.length = seq.prefilled = len(seq.prefill_ids)
            self._register(seq)
        self._started(group, started_ns, sum(computed), max(computed) * len(group))
        self._accept(list(zip(group, tokens, strict=True)), scores)

    def _prefill_row(self, seq: SequenceState, end: int) -> tuple[list[int], int, list[int]]:
        assert seq.blocks is not None
        return seq.prefill_ids[seq.prefilled : end], seq.prefilled, seq.blocks.blocks

    def _prefill_chunk(self) -> None:
        """The next chunk of the long prompt being prefilled (see scheduler.py for its size)."""
        seq = self._chunking
        assert seq is not None
        ids = seq.prefill_ids
        start = seq.prefilled
        n = min(self.scheduler.chunk_tokens(self._batch_state()), len(ids) - start)
        if not seq.prefill_started_ns:
            seq.prefill_started_ns = time.time_ns()
        started = time.perf_counter()
        try:
            if self.fault_hook is not None:
                self.fault_hook("prefill", 1)
            logits = self.runner.prefill([self._prefill_row(seq, start + n)])
        except _OOM_ERRORS:
            metrics.OOM_RETRIES.inc()
            self._empty_device_cache()
            if self._running:
                self._halve_running()
                return  # retried next iteration
            self._end(seq, None, _oom_failure(), "error")
            return
        if n >= 16:
            self.prefill_tok_s = _ewma(self.prefill_tok_s, n / (time.perf_counter() - started))
        self._chunk_done(seq, start + n, logits)

    def _chunk_done(self, seq: SequenceState, end: int, logits: torch.Tensor) -> None:
        """Bookkeeping after a chunk of `seq`'s prompt up to `end` was prefilled; its first
        token once the prompt is complete."""
        seq.prefilled = seq.length = end
        self._register(seq)
        ids = seq.prefill_ids
        if end < len(ids):
            return
        chosen, scores = choose_scored(logits, *self._sampling([seq]))
        self._chunking = None
        self._started([seq], seq.prefill_started_ns, len(ids), len(ids))
        self._accept([(seq, int(chosen[0]))], scores)

    def _mixed_step(self) -> None:
        """One forward for every decoding row and the next chunk of the long prompt (chunked
        prefill inside the step, vLLM's way): the running rows wait for no separate prefill
        forward, and the chunk (about one step's worth, scheduler.py) shares the step's
        matmuls."""
        self._make_room()
        seq = self._chunking
        running = list(self._running)  # the chunk's sequence joins self._running when complete
        if seq is None or not running:  # preemption emptied one side: the plain path
            if seq is not None:
                self._prefill_chunk()
            if running:
                self._decode()
            return
        start = seq.prefilled
        n = min(self.scheduler.chunk_tokens(self._batch_state()), len(seq.prefill_ids) - start)
        if not seq.prefill_started_ns:
            seq.prefill_started_ns = time.time_ns()
        try:
            if self.fault_hook is not None:
                self.fault_hook("prefill", 1)
                self.fault_hook("decode", len(running))
            rows = [(s.generated[-1], s.length, s.blocks.blocks) for s in running if s.blocks is not None]
            decode_logits, chunk_logits = self.runner.mixed(rows, self._prefill_row(seq, start + n))
            tokens, scores = self._choose_tokens(decode_logits, running)
        except _OOM_ERRORS:
            metrics.OOM_RETRIES.inc()
            self._empty_device_cache()
            if len(running) > 1:
                self._halve_running()
            else:
                self._requeue([seq])  # the prompt waits; the row decodes alone next
            return
        self._chunk_done(seq, start + n, chunk_logits)
        # Not a decode step's time (the chunk is in it): step_s sizes the chunks, and counting
        # them in would grow each next chunk.
        self._decoded(running, tokens, None, scores)

    def _choose_tokens(self, logits: torch.Tensor, running: list[SequenceState]) -> tuple[list[int], Scores | None]:
        """The decode rows' tokens from their logits (the sampler's one call site per step)."""
        chosen, scores = choose_scored(logits, *self._sampling(running), stage=self.runner.decode_stage)
        return chosen[: len(running)].tolist(), scores

    def _started(self, group: list[SequenceState], started_ns: int, tokens: int, padded: int) -> None:
        for seq in group:
            if not seq.prompt_counted and not seq.internal:
                seq.prompt_counted = True
                metrics.PROMPT_TOKENS.inc(len(seq.prompt_ids))
        self._join(group)
        self.emitter.put(
            ("prefill", group, started_ns, time.time_ns(), tokens, padded, self._segment_id, len(self._running))
        )

    def _make_room(self) -> None:
        """Every running row gets a block for its next token; when the pool runs out, the long
        prompt being chunked and then the newest rows are preempted (requeued at the front:
        they resume with what is still cached of their tokens) until the rest fit."""
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            assert seq.blocks is not None
            if self.kv.grow(seq.blocks, seq.length + 1):
                i += 1
                continue
            self.preemptions += 1
            if self._chunking is not None:
                log.info("KV blocks exhausted; the prompt being prefilled waits")
                self._requeue([self._chunking])
            elif len(self._running) > 1:
                log.info("KV blocks exhausted; preempting the newest running sequence")
                self._requeue([self._running[-1]])
            else:  # one row longer than the pool: validation keeps requests below its size
                self._end(seq, None, _oom_failure(), "error")

    def _decode(self) -> None:
        started = time.perf_counter()
        self._make_room()
        while True:
            running = self._running
            if not running:
                return
            try:
                if self.fault_hook is not None:
                    self.fault_hook("decode", len(running))
                rows = [(s.generated[-1], s.length, s.blocks.blocks) for s in running if s.blocks is not None]
                tokens, scores = self.runner.decode_scored(rows, self._sampling(running))
                break
            except _OOM_ERRORS:
                self._on_decode_oom()
                if not self._running:
                    return
        self._decoded(running, tokens, started, scores)

    def _decoded(
        self, running: list[SequenceState], tokens: list[int], started: float | None, scores: Scores | None
    ) -> None:
        bt = self.kv.block_tokens
        for seq in running:
            seq.length += 1
            if seq.length % bt == 0:
                self._register(seq)
        if started is not None:
            self.step_s = _ewma(self.step_s, time.perf_counter() - started)
        self.steps += 1
        self._segment_steps += 1
        self._accept(list(zip(running, tokens, strict=True)), scores)

    def _accept(self, pairs: list[tuple[SequenceState, int]], scores: Scores | None) -> None:
        """Per-row bookkeeping after a step (pairs[i] is batch row i): stop conditions visible
        in token ids; finished rows leave at once; the tokens and the log probabilities of the
        rows that asked go to the emitter in one message."""
        eos = self.model.eos_ids
        items: list[tuple[SequenceState, int, str | None, RowLogprobs | None]] = []
        for row, (seq, token) in enumerate(pairs):
            if seq.grammar is not None:  # the grammar may put the row on its closing path
                token = seq.grammar.take(token, seq.params.max_new_tokens - len(seq.generated) - 1)
            score = scores.get(row, token) if scores is not None else None
            seq.generated.append(token)
            reason = None
            # A complete structured answer ends with the EOS its grammar then allows (ignore_eos or not).
            if token in eos and (not seq.params.ignore_eos or seq.grammar is not None):
                reason = FINISH_STOP
            elif token in seq.params.stop_token_ids:
                reason = FINISH_STOP  # like EOS: the stop token is not part of the text
            elif len(seq.generated) >= seq.params.max_new_tokens:
                reason = FINISH_LENGTH
            items.append((seq, token, reason, score))
            if reason is not None:
                seq.released = True
                self._release(seq)
        self.emitter.put(("tokens", time.monotonic(), items))

    # ----------------------------------------------------------------- OOM handling

    def _requeue(self, seqs: list[SequenceState]) -> None:
        again: list[SequenceState] = []
        for seq in seqs:
            self._release(seq)
            seq.length = seq.prefilled = 0
            seq.prefill_started_ns = 0
            if seq.stop_hit:  # its last event is sent: nothing more to compute
                seq.released = True
            elif seq.cancelled:
                self._end(seq, FINISH_CANCELLED, None, None)
            else:
                again.append(seq)
        if again:
            self.scheduler.requeue_front(again)

    def _on_prefill_oom(self, group: list[SequenceState]) -> list[SequenceState]:
        metrics.OOM_RETRIES.inc()
        self._empty_device_cache()
        if len(group) > 1:
            half = len(group) // 2
            log.warning("out of device memory in prefill; prefilling %d of %d now", half, len(group))
            self._requeue(group[half:])
            return group[:half]
        if self._running:
            self._halve_running()
            return group
        self._end(group[0], None, _oom_failure(), "error")
        return []

    def _on_decode_oom(self) -> None:
        metrics.OOM_RETRIES.inc()
        # Layers that ran before the failure wrote this step's token: harmless, the positions
        # did not advance, so the retry writes the same place again.
        self._empty_device_cache()
        if len(self._running) > 1:
            self._halve_running()
            return
        self._end(self._running[0], None, _oom_failure(), "error")

    def _halve_running(self) -> None:
        """Requeues the newest half of the running rows."""
        half = len(self._running) // 2
        moved = self._running[half:]
        log.warning("out of device memory; requeueing %d of %d running sequences", len(moved), len(self._running))
        self._requeue(list(moved))

    def _empty_device_cache(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()


def to_int64(seed: int) -> int:
    """A 64-bit seed as the int64 the device hash takes (two's complement: all 64 bits kept)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _oom_failure() -> errors.ResourceExhausted:
    return errors.ResourceExhausted("inference: out of device memory", retry_after=1.0)


def _ewma(previous: float | None, value: float, weight: float = 0.2) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value
