"""The engine core: the worker thread that owns the model runner, the scheduler's queues and
the KV blocks, and runs the loop. Requests reach it through its inbox (a queue: submissions and
wake-ups), never through shared state; each iteration it

1. takes what arrived in the inbox into the scheduler's waiting queue, and frees the rows of
   cancelled requests and of requests whose stop string was found;
2. admits waiting requests while rows and KV blocks last (scheduler.py decides how many prompt
   tokens), reusing each prompt's cached prefix, and prefills the rest of the short ones
   together and the next chunk of a long one;
3. gives every running row room for its next token (preempting the newest rows when the pool
   is empty) and runs one decode step for all of them (runner.py), with the long prompt's next
   chunk in the same forward where the own forward serves (a mixed step);
4. frees the rows that ended (EOS, length), and hands the step's tokens to the output processor
   (output.py), which detokenizes and delivers them.

Prompts are recomputed only after an out-of-memory split or a preemption: the requeued
sequences are prefilled again with the tokens they already produced (what of it is still cached
is reused). A row yields the same greedy tokens in any batch as alone: each row attends only to
its own tokens, at its own positions.

A worker that dies (a bug, not a step failure) closes the engine: every waiting and running
request gets UNAVAILABLE, the inbox refuses, and `closed` turns the service NOT_SERVING.

The inbox also keeps what the asyncio front must know at once, under its own lock: whether the
engine is closed, how many requests wait (the queue bound), and the idle flag (nothing waiting,
nothing running: a model switch may close the engine), cleared with the submission that makes
the engine busy and set by the worker only while no submission is pending.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from llmesh import errors
from services.inference.engine import metrics
from services.inference.engine.config import (
    DEFAULT_MAX_PREFILL_TOKENS,
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineConfig,
)
from services.inference.engine.kv_manager import BlockManager, KVStats
from services.inference.engine.model import LoadedModel
from services.inference.engine.output import Emitter
from services.inference.engine.runner import ModelRunner, Sampling
from services.inference.engine.sampling import (
    Adjustments,
    Constraints,
    GrammarRows,
    LogprobRows,
    RowAdjustment,
    RowLogprobs,
    Scores,
    choose_scored,
)
from services.inference.engine.scheduler import Admission, Scheduler, Speeds
from services.inference.engine.sequence import SequenceState

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


class Inbox:
    """The way into the worker from other threads: each submitted sequence, and a wake-up (None:
    a cancellation, the close), in one queue the worker blocks on when it has nothing to do."""

    def __init__(self, max_queue: int, scheduled: Callable[[], int], retry_after: Callable[[], float]) -> None:
        self._queue: queue.SimpleQueue[SequenceState | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max_queue = max_queue
        #: How many wait in the scheduler's queue (the worker's count, read as it is).
        self._scheduled = scheduled
        self._retry_after = retry_after
        #: Submitted and not yet in the scheduler's queue, and their prompt tokens.
        self.pending = 0
        self.pending_tokens = 0
        self.closed = False
        self.idle = threading.Event()
        self.idle.set()

    # --- other threads

    def submit(self, seq: SequenceState, free_rows: int) -> None:
        """Raises Unavailable (closed) or ResourceExhausted (the queue is full) at once."""
        with self._lock:
            if self.closed:
                raise errors.Unavailable("inference: the model is being unloaded", retry_after=1.0)
            # Requests the next iteration admits into free rows are not "waiting for a row".
            if self.pending + self._scheduled() >= self._max_queue + free_rows:
                raise errors.ResourceExhausted(
                    f"inference queue is full ({self._max_queue} waiting, LLMESH_MAX_QUEUE)",
                    retry_after=self._retry_after(),
                    reason="QUEUE_FULL",
                )
            self.pending += 1
            self.pending_tokens += len(seq.prompt_ids)
            self.idle.clear()
            self._queue.put(seq)

    def wake(self) -> None:
        self._queue.put(None)

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self._queue.put(None)

    # --- the worker

    def receive(self, timeout: float | None) -> list[SequenceState]:
        """The sequences that arrived: waits up to `timeout` seconds for the first message
        (None: does not wait), then takes whatever else is there."""
        messages: list[SequenceState | None] = []
        try:
            messages.append(self._queue.get_nowait() if timeout is None else self._queue.get(timeout=timeout))
            while True:
                messages.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return [m for m in messages if m is not None]

    def taken(self, seqs: list[SequenceState]) -> None:
        """`seqs` (received) are in the scheduler's queue now (counted there from here on)."""
        with self._lock:
            self.pending -= len(seqs)
            self.pending_tokens -= sum(len(s.prompt_ids) for s in seqs)

    def settle(self, busy: bool) -> None:
        """The worker's queue and batch are empty unless `busy`: idle if nothing is pending."""
        with self._lock:
            if not busy and not self.pending:
                self.idle.set()


class EngineCore:
    """The worker of one engine (see the module docstring). Other threads use only `inbox`,
    `cancel`, `close` and the counters it keeps (read as they are)."""

    def __init__(self, model: LoadedModel, config: EngineConfig, tag: str) -> None:
        self.model = model
        self.config = config
        self.tag = tag
        seq_tokens = config.max_seq_tokens(model.max_context_tokens)
        num_blocks = config.kv_blocks(seq_tokens, model.kv_bytes_per_token, model.device)
        self.kv = BlockManager(num_blocks, config.block_tokens, config.prefix_caching)
        #: The physical KV footprint in tokens (the usable blocks), allocated here.
        self.max_total_tokens = self.kv.usable_blocks * config.block_tokens
        buckets = config.buckets(config.max_batch_size, model.device)
        self.runner = ModelRunner(model, num_blocks, config.block_tokens, seq_tokens, buckets, config.cuda_graphs)
        self.max_prefill_tokens = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS.get(model.device.type, 2048)
        self.scheduler = Scheduler(config, self.kv, self.max_prefill_tokens, self._end, self.retry_after)
        self.output = Emitter(tag, model.verified.model_id, model.verified.version, model.tokenizer)
        self.inbox = Inbox(config.max_queue, lambda: len(self.scheduler.waiting), self.retry_after)
        self.thread: threading.Thread | None = None
        self._device = device_lock(model.device)
        self._segments = itertools.count(1)
        self._segment_id = ""
        self._segment_steps = 0
        self._membership_changed = False
        #: Measured speeds (EWMA) that size prefill chunks while a batch decodes.
        self.speeds = Speeds()
        #: Fault injection for tests: called before each forward with ("prefill"|"decode", batch size).
        self.fault_hook: Callable[[str, int], None] | None = None
        #: Called (from the worker thread) when the worker dies and the engine closes.
        self.on_dead: list[Callable[[], None]] = []
        self.dead = False
        self.steps = 0
        self.preemptions = 0
        #: Share of admitted prompt tokens served from the prefix cache (EWMA over admissions).
        self.prefix_hit_rate: float | None = None
        self._reported = KVStats(0, 0, 0, 0, 0, 0)
        self._report_kv()

    # ----------------------------------------------------------------- other threads

    def retry_after(self) -> float:
        per_row = self.output.avg_duration / max(1, self.config.max_batch_size)
        return round(min(30.0, max(0.5, per_row * (len(self.scheduler.waiting) + self.inbox.pending))), 3)

    def cancel(self, seq: SequenceState) -> None:
        seq.cancelled = True
        self.inbox.wake()

    def close(self, reason: str) -> None:
        """Stops the worker; anything still queued or running gets UNAVAILABLE."""
        self.inbox.close()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        self._fail_everything(errors.Unavailable(f"inference: {reason}", retry_after=1.0))
        self.output.sync()
        self.output.stop()
        # This engine's share of the process-wide gauges goes with it.
        metrics.PREFIX_CACHED_BLOCKS.dec(self._reported.cached_blocks)
        metrics.KV_BLOCKS_FREE.dec(self._reported.free_blocks)
        self._reported = dataclasses.replace(self._reported, cached_blocks=0, free_blocks=0)
        self.inbox.idle.set()

    # ----------------------------------------------------------------- warm-up (before the loop)

    def serve_now(self, seqs: list[SequenceState]) -> None:
        """Runs `seqs` to their end on the calling thread (warm-up, before the worker starts)."""
        self.scheduler.add(seqs)
        while self.scheduler.busy:
            self._iteration(self.scheduler.admit(self.speeds))

    def capture(self) -> None:
        """The CUDA graphs, with no other engine's step on the device meanwhile."""
        with self._device:
            self.runner.capture()

    def forget_warm_up(self) -> None:
        """Warm-up prompts are no user's: the prefix cache is emptied, the hit rate forgotten."""
        self.kv.forget_cached()
        self._report_kv()
        self.prefix_hit_rate = None

    # ----------------------------------------------------------------- the loop

    def run(self) -> None:
        """The worker thread's loop, until the engine closes or the worker dies."""
        self.thread = threading.current_thread()
        admission: Admission | None = None
        try:
            with torch.inference_mode():
                while True:
                    admission = self._next_work()
                    if admission is None:
                        return
                    with self._device:
                        self._iteration(admission)
                    admission = None
        except BaseException as exc:
            log.exception("inference worker died; closing the engine")
            self._die(exc, admission)

    def _receive(self, timeout: float | None) -> None:
        arrived = self.inbox.receive(timeout)
        if arrived:
            self.scheduler.add(arrived)
            self.inbox.taken(arrived)

    def _next_work(self) -> Admission | None:
        """Blocks until there is something to do; returns what joins the batch (maybe nothing),
        or None when the engine closes."""
        scheduler = self.scheduler
        while True:
            self._receive(None)
            now = time.monotonic()
            scheduler.expire(now)
            if self.inbox.closed:
                return None
            if scheduler.running or scheduler.chunking is not None:
                return scheduler.admit(self.speeds)
            if scheduler.waiting:
                # Empty batch: give requests arriving together a moment to share a prefill.
                left = scheduler.waiting[0].enqueued_at + self.config.batch_wait_s - now
                if left > 0 and len(scheduler.waiting) < self.config.max_batch_size:
                    self._receive(left)
                    continue
                admission = scheduler.admit(self.speeds)
                if admission.group or admission.chunked is not None:
                    return admission
                # Nothing fits an empty pool: only a request longer than the pool, which
                # validation refuses; wait rather than spin.
                self._receive(0.05)
                continue
            self.inbox.settle(busy=False)
            self._receive(1.0)

    def _die(self, exc: BaseException, admission: Admission | None = None) -> None:
        self.dead = True
        self.inbox.close()
        failure = errors.Unavailable(f"inference: the engine stopped ({exc})", retry_after=1.0)
        # The admission being worked on when the worker died is in no queue and maybe no batch.
        if admission is not None:
            for seq in [*admission.group, *([admission.chunked] if admission.chunked is not None else [])]:
                self._end(seq, None, failure, "error")
        self._fail_everything(failure)
        self.inbox.idle.set()
        for callback in self.on_dead:
            try:
                callback()
            except Exception:
                log.exception("on_dead callback failed")

    def _fail_everything(self, failure: BaseException) -> None:
        self._receive(None)  # the inbox is closed: nothing arrives after this
        waiting = self.scheduler.take_all()
        seqs = [*waiting, *self.scheduler.holding()]
        for seq in seqs:
            self._end(seq, None, failure, "error")
        self._reset_batch()

    def _iteration(self, admission: Admission) -> None:
        group = admission.group
        try:
            self._drop_ended_rows()
            scheduler = self.scheduler
            if admission.chunked is not None:
                scheduler.start_chunking(admission.chunked)
            if group:
                self._prefill(group)
            if scheduler.chunking is not None and scheduler.running and self.runner.can_mix:
                self._mixed_step()
            else:
                if scheduler.chunking is not None:
                    self._prefill_chunk()
                if scheduler.running:
                    self._decode()
            if self._membership_changed:
                self._new_segment()
        except Exception as exc:  # a bug or a device error: fail this batch, keep serving
            log.exception("inference step failed")
            failure = errors.LlmeshError("inference step failed", reason="ENGINE_ERROR")
            failure.__cause__ = exc
            # Sequences requeued by an OOM split earlier in this iteration are waiting again and
            # are served later; everything that holds blocks fails.
            holding = self.scheduler.holding()
            holding += [s for s in group if s.blocks is not None and s not in holding]
            for seq in holding:
                self._end(seq, None, failure, "error")
            self._reset_batch()
        finally:
            self._report_kv()
            if not self.scheduler.running and self.scheduler.chunking is None:
                self.inbox.settle(busy=bool(self.scheduler.waiting))

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
        self.output.put(("end", seq, reason, failure, outcome))

    def _release(self, seq: SequenceState) -> None:
        if self.scheduler.leave(seq):
            self._membership_changed = True
        if seq.blocks is not None:
            self.kv.free(seq.blocks)
            seq.blocks = None

    def _reset_batch(self) -> None:
        """After a failed step: the batch is gone. Its blocks are released; blocks registered
        in the prefix cache stay valid (a step only writes positions past a row's registered
        blocks, and never into a shared block)."""
        for seq in self.scheduler.holding():
            self._release(seq)
        self._new_segment()

    def _drop_ended_rows(self) -> None:
        for seq in self.scheduler.holding():
            if seq.cancelled:
                self._end(seq, FINISH_CANCELLED, None, None)
            elif seq.stop_hit:  # the emitter already sent the last event
                seq.released = True
                self._release(seq)

    def _join(self, seqs: list[SequenceState]) -> None:
        self.scheduler.join(seqs)
        self._new_segment()
        for seq in seqs:
            if not seq.batch_id:
                seq.batch_id = self._segment_id

    def _new_segment(self) -> None:
        self._membership_changed = False
        previous = self._segment_steps
        self._segment_id = f"{self.tag}-{next(self._segments)}"
        self._segment_steps = 0
        running = self.scheduler.running
        reserved = sum(s.reserved_tokens for s in running)
        self.output.put(("segment", self._segment_id, list(running), reserved, previous))

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
        # The masks are computed in the choice, in one batch call (engine/sampling.py).
        grammars = constrained[0][1].grammars
        return GrammarRows(
            [row for row, _ in constrained], [g for _, g in constrained], grammars.words, grammars.fill_masks
        )

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
            speed = sum(computed) / (time.perf_counter() - started)
            self.speeds.prefill_tok_s = _ewma(self.speeds.prefill_tok_s, speed)
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
        seq = self.scheduler.chunking
        assert seq is not None
        ids = seq.prefill_ids
        start = seq.prefilled
        n = min(self.scheduler.chunk_tokens(self.speeds), len(ids) - start)
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
            if self.scheduler.running:
                self._halve_running()
                return  # retried next iteration
            self._end(seq, None, _oom_failure(), "error")
            return
        if n >= 16:
            self.speeds.prefill_tok_s = _ewma(self.speeds.prefill_tok_s, n / (time.perf_counter() - started))
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
        self.scheduler.chunk_finished()
        self._started([seq], seq.prefill_started_ns, len(ids), len(ids))
        self._accept([(seq, int(chosen[0]))], scores)

    def _mixed_step(self) -> None:
        """One forward for every decoding row and the next chunk of the long prompt (chunked
        prefill inside the step, vLLM's way): the running rows wait for no separate prefill
        forward, and the chunk (about one step's worth, scheduler.py) shares the step's
        matmuls."""
        self._make_room()
        seq = self.scheduler.chunking
        running = list(self.scheduler.running)  # the chunk's sequence joins them when complete
        if seq is None or not running:  # preemption emptied one side: the plain path
            if seq is not None:
                self._prefill_chunk()
            if running:
                self._decode()
            return
        start = seq.prefilled
        n = min(self.scheduler.chunk_tokens(self.speeds), len(seq.prefill_ids) - start)
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
        rows = len(self.scheduler.running)
        self.output.put(("prefill", group, started_ns, time.time_ns(), tokens, padded, self._segment_id, rows))

    def _make_room(self) -> None:
        """Every running row gets a block for its next token; when the pool runs out, the long
        prompt being chunked and then the newest rows are preempted (requeued at the front:
        they resume with what is still cached of their tokens) until the rest fit."""
        running = self.scheduler.running
        i = 0
        while i < len(running):
            seq = running[i]
            assert seq.blocks is not None
            if self.kv.grow(seq.blocks, seq.length + 1):
                i += 1
                continue
            self.preemptions += 1
            victim = self.scheduler.preemption_victim()
            if victim is None:  # one row longer than the pool: validation keeps requests below its size
                self._end(seq, None, _oom_failure(), "error")
                continue
            if victim is self.scheduler.chunking:
                log.info("KV blocks exhausted; the prompt being prefilled waits")
            else:
                log.info("KV blocks exhausted; preempting the newest running sequence")
            self._requeue([victim])

    def _decode(self) -> None:
        started = time.perf_counter()
        self._make_room()
        while True:
            running = self.scheduler.running
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
                if not self.scheduler.running:
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
            self.speeds.step_s = _ewma(self.speeds.step_s, time.perf_counter() - started)
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
        self.output.put(("tokens", time.monotonic(), items))

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
            self.scheduler.requeue_front(again, time.monotonic())

    def _on_prefill_oom(self, group: list[SequenceState]) -> list[SequenceState]:
        metrics.OOM_RETRIES.inc()
        self._empty_device_cache()
        if len(group) > 1:
            half = len(group) // 2
            log.warning("out of device memory in prefill; prefilling %d of %d now", half, len(group))
            self._requeue(group[half:])
            return group[:half]
        if self.scheduler.running:
            self._halve_running()
            return group
        self._end(group[0], None, _oom_failure(), "error")
        return []

    def _on_decode_oom(self) -> None:
        metrics.OOM_RETRIES.inc()
        # Layers that ran before the failure wrote this step's token: harmless, the positions
        # did not advance, so the retry writes the same place again.
        self._empty_device_cache()
        running = self.scheduler.running
        if len(running) > 1:
            self._halve_running()
            return
        self._end(running[0], None, _oom_failure(), "error")

    def _halve_running(self) -> None:
        """Requeues the newest half of the running rows."""
        running = self.scheduler.running
        half = len(running) // 2
        moved = running[half:]
        log.warning("out of device memory; requeueing %d of %d running sequences", len(moved), len(running))
        self._requeue(list(moved))

    def _empty_device_cache(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()


def _oom_failure() -> errors.ResourceExhausted:
    return errors.ResourceExhausted("inference: out of device memory", retry_after=1.0)


def _ewma(previous: float | None, value: float, weight: float = 0.2) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value
