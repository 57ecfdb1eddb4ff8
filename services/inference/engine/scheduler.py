"""The waiting queue and admission: which requests join the batch this iteration, and how many
prompt tokens are prefilled before the next decode step. It knows no Engine: the engine core
hands it the block manager and a callback that ends a request, and asks it for work.

Admission is FIFO while the batch has a free row and the KV pool has the blocks of the
request's uncached prompt tokens, keeping one block per running row for it to grow into (a row
that still finds the pool empty is preempted by the engine core). A prompt's cached prefix
(kv_manager.py) is not prefilled again, so the work a prompt costs is its uncached tokens.
Prefill work per iteration is sized so running rows are not stalled much and arrivals are
still prefilled as fast as they come:

* a step's worth of prefill, `chunk_tokens`, is the prompt tokens that take about one decode
  step (measured prefill tokens/s x measured step time), at least MIN_PREFILL_CHUNK (128: a
  chat request's prompt is prefilled whole, with the other arrivals, not chunk by chunk). A prompt
  longer than that is prefilled in chunks of that size, one chunk per iteration, inside the
  decode step's forward where the engine can mix them (else between decode steps), so a long
  prompt stalls the running rows for about one step at a time;
* prompts that fit one chunk are prefilled whole, together, up to a budget that grows with the
  queue: one step's worth per two waiting requests (at least one step's worth), so under a
  churning closed loop of short requests the queue is emptied as fast as it fills;
* with no batch running nobody is stalled: up to `max_prefill_tokens` per iteration.

The idle flag (nothing waiting, nothing running: a model switch may close the engine) is
cleared and set under the queue's lock, together with the queue change that makes it true.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmesh import errors
from services.inference import metrics
from services.inference.engine.config import FINISH_CANCELLED, MIN_PREFILL_CHUNK, PREFILL_STALL_STEPS, EngineConfig
from services.inference.engine.kv_manager import BlockManager
from services.inference.engine.stream import SequenceState

#: Waiting requests per extra step's worth of prefill budget.
QUEUE_PER_BUDGET_STEP = 2

#: end(seq, finish reason, failure, outcome): the engine core finishes a request.
EndRequest = Callable[[SequenceState, str | None, BaseException | None, str | None], None]


@dataclass
class BatchState:
    """What admission needs to know of the running batch (the engine core's)."""

    running: int = 0
    chunking: bool = False
    prefill_tok_s: float | None = None
    step_s: float | None = None


@dataclass
class Admission:
    #: Whole prompts prefilled together this iteration (their blocks allocated).
    group: list[SequenceState] = field(default_factory=list)
    #: A long prompt to prefill chunk by chunk from now on, if one was admitted.
    chunked: SequenceState | None = None


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: BlockManager,
        max_prefill_tokens: int,
        end: EndRequest,
        retry_after: Callable[[], float],
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self._end = end
        self._retry_after = retry_after
        self._cond = threading.Condition()
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.idle = threading.Event()
        self.idle.set()
        self._closing = False
        self.closed = False

    # ----------------------------------------------------------------- event loop side

    def submit(self, seq: SequenceState, free_rows: int) -> None:
        with self._cond:
            if self.closed:
                raise errors.Unavailable("inference: the model is being unloaded", retry_after=1.0)
            # Requests the next iteration admits into free rows are not "waiting for a row".
            if len(self.waiting) >= self.config.max_queue + free_rows:
                raise errors.ResourceExhausted(
                    f"inference queue is full ({self.config.max_queue} waiting, LLMESH_MAX_QUEUE)",
                    retry_after=self._retry_after(),
                    reason="QUEUE_FULL",
                )
            self.waiting.append(seq)
            self.idle.clear()
            metrics.QUEUE_SIZE.inc()
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = self.closed = True
            self._cond.notify_all()

    # ----------------------------------------------------------------- worker side

    def extend(self, seqs: list[SequenceState]) -> None:
        with self._cond:
            self.waiting.extend(seqs)
            self.idle.clear()
            metrics.QUEUE_SIZE.inc(len(seqs))

    def take_all(self) -> list[SequenceState]:
        with self._cond:
            waiting, self.waiting = list(self.waiting), collections.deque()
        metrics.QUEUE_SIZE.dec(len(waiting))
        return waiting

    def requeue_front(self, seqs: list[SequenceState]) -> None:
        now = time.monotonic()
        for seq in seqs:
            seq.queued_since = now
        with self._cond:
            self.waiting.extendleft(reversed(seqs))
            self.idle.clear()
            metrics.QUEUE_SIZE.inc(len(seqs))

    def set_idle(self) -> None:
        """The engine core's batch emptied: idle if nothing waits either (under the lock, so a
        request submitted meanwhile keeps the engine busy)."""
        with self._cond:
            if not self.waiting:
                self.idle.set()

    def next_work(self, batch: BatchState) -> Admission | None:
        """Blocks until there is something to do; returns what joins the batch (maybe nothing),
        or None when the engine closes."""
        with self._cond:
            while True:
                now = time.monotonic()
                self._expire(now)
                if self._closing:
                    return None
                if batch.running or batch.chunking:
                    return self._admit(batch)
                if self.waiting:
                    # Empty batch: give requests arriving together a moment to share a prefill.
                    left = self.waiting[0].enqueued_at + self.config.batch_wait_s - now
                    if left > 0 and len(self.waiting) < self.config.max_batch_size:
                        self._cond.wait(left)
                        continue
                    admission = self._admit(batch)
                    if admission.group or admission.chunked is not None:
                        return admission
                    # Nothing fits an empty pool: only a request longer than the pool, which
                    # validation refuses; wait rather than spin.
                    self._cond.wait(0.05)
                    continue
                self.idle.set()
                self._cond.wait(1.0)

    def _expire(self, now: float) -> None:
        """Drops cancelled and timed-out requests from the queue (lock held)."""
        if not self.waiting:
            return
        timeout = self.config.queue_timeout_s
        keep: collections.deque[SequenceState] = collections.deque()
        for seq in self.waiting:
            if seq.cancelled:
                metrics.QUEUE_SIZE.dec()
                self._end(seq, FINISH_CANCELLED, None, None)
            elif now - seq.queued_since > timeout:
                metrics.QUEUE_SIZE.dec()
                failure = errors.ResourceExhausted(
                    f"no batch row within {timeout:g}s (LLMESH_QUEUE_TIMEOUT_SECONDS)",
                    retry_after=self._retry_after(),
                    reason="QUEUE_TIMEOUT",
                )
                self._end(seq, None, failure, "queue_timeout")
            else:
                keep.append(seq)
        self.waiting = keep

    def chunk_tokens(self, batch: BatchState) -> int:
        """Prompt tokens that take about one decode step (see the module docstring)."""
        if not batch.running:
            return self.max_prefill_tokens
        if batch.prefill_tok_s is None or batch.step_s is None:
            return min(self.max_prefill_tokens, 256)
        step = int(batch.prefill_tok_s * batch.step_s * PREFILL_STALL_STEPS)
        return max(MIN_PREFILL_CHUNK, min(self.max_prefill_tokens, step))

    def prefill_budget(self, batch: BatchState) -> int:
        """Prompt tokens of whole (one-chunk) prompts prefilled together this iteration."""
        if not batch.running:
            return self.max_prefill_tokens
        steps = max(1, len(self.waiting) // QUEUE_PER_BUDGET_STEP)
        return min(self.max_prefill_tokens, self.chunk_tokens(batch) * steps)

    def admit(self, batch: BatchState) -> Admission:
        with self._cond:
            return self._admit(batch)

    def _admit(self, batch: BatchState) -> Admission:
        """FIFO admission (lock held): whole short prompts up to the prefill budget, and a long
        prompt as the chunked prefill (one at a time), while rows and blocks last."""
        admission = Admission()
        chunk = self.chunk_tokens(batch)
        budget = self.prefill_budget(batch)
        bt = self.kv.block_tokens
        rows = batch.running + batch.chunking
        tokens = 0
        while self.waiting and rows < self.config.max_batch_size:
            seq = self.waiting[0]
            if seq.cancelled or seq.released:
                self.waiting.popleft()
                metrics.QUEUE_SIZE.dec()
                self._end(seq, FINISH_CANCELLED, None, None)
                continue
            ids = seq.prefill_ids
            hit, _ = self.kv.match(ids)
            n = len(ids) - len(hit) * bt
            long = n > chunk
            if long and (batch.chunking or admission.chunked is not None):
                break
            if not long and admission.group and tokens + n > budget:
                break
            table = self.kv.allocate(ids, reserve=rows)
            if table is None:
                break
            self.waiting.popleft()
            metrics.QUEUE_SIZE.dec()
            seq.blocks = table
            seq.prefilled = seq.length = table.cached_tokens
            rows += 1
            if long:
                admission.chunked = seq
            else:
                admission.group.append(seq)
                tokens += n
        return admission
