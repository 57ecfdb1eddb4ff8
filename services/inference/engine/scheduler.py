"""The waiting queue and admission: which requests join the batch this iteration, and how many
prompt tokens are prefilled before the next decode step.

Admission is FIFO into free KV slots. Prefill work per iteration is sized so running rows are
not stalled much and arrivals are still prefilled as fast as they come:

* a step's worth of prefill, `chunk_tokens`, is the prompt tokens that take about one decode
  step (measured prefill tokens/s x measured step time), at least MIN_PREFILL_CHUNK (128: a
  chat request's prompt is prefilled whole, with the other arrivals, not chunk by chunk). A prompt
  longer than that is prefilled in chunks of that size, one chunk per iteration between decode
  steps, so a long prompt stalls the running rows for about one step at a time;
* prompts that fit one chunk are prefilled whole, together, up to a budget that grows with the
  queue: one step's worth per four waiting requests (at least one step's worth), so under a
  churning closed loop of short requests the queue is emptied as fast as it fills instead of
  one step's worth per iteration;
* with no batch running nobody is stalled: up to `max_prefill_tokens` per iteration.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

from llmesh import errors
from services.inference import metrics
from services.inference.engine.config import FINISH_CANCELLED, MIN_PREFILL_CHUNK, PREFILL_STALL_STEPS
from services.inference.engine.stream import SequenceState

if TYPE_CHECKING:
    from collections.abc import Callable

    from services.inference.engine.core import Engine

#: Waiting requests per extra step's worth of prefill budget.
QUEUE_PER_BUDGET_STEP = 2


class Scheduler:
    def __init__(self, engine: Engine, slots: int) -> None:
        self.engine = engine
        self.config = engine.config
        self._cond = threading.Condition()
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self._closing = False
        self.closed = False

    # ----------------------------------------------------------------- event loop side

    def submit(self, seq: SequenceState, free_slots: int, retry_after: Callable[[], float]) -> None:
        with self._cond:
            if self.closed:
                raise errors.Unavailable("inference: the model is being unloaded", retry_after=1.0)
            # Requests the next iteration admits into free slots are not "waiting for a slot".
            if len(self.waiting) >= self.config.max_queue + free_slots:
                raise errors.ResourceExhausted(
                    f"inference queue is full ({self.config.max_queue} waiting, LLMESH_MAX_QUEUE)",
                    retry_after=retry_after(),
                    reason="QUEUE_FULL",
                )
            self.waiting.append(seq)
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
            metrics.QUEUE_SIZE.inc(len(seqs))

    def next_work(self) -> list[SequenceState] | None:
        """Blocks until there is something to do; returns the group to prefill (maybe empty),
        or None when the engine closes."""
        engine = self.engine
        with self._cond:
            while True:
                now = time.monotonic()
                self._expire(now)
                if self._closing:
                    return None
                if engine._running or engine._chunking is not None:
                    return self.admit()
                if self.waiting:
                    # Empty batch: give requests arriving together a moment to share a prefill.
                    left = self.waiting[0].enqueued_at + self.config.batch_wait_s - now
                    if left > 0 and len(self.waiting) < self.config.max_batch_size:
                        self._cond.wait(left)
                        continue
                    return self.admit()
                engine.mark_idle()
                self._cond.wait(1.0)

    def _expire(self, now: float) -> None:
        """Drops cancelled and timed-out requests from the queue (lock held; the emitter does
        the rest)."""
        if not self.waiting:
            return
        timeout = self.config.queue_timeout_s
        keep: collections.deque[SequenceState] = collections.deque()
        for seq in self.waiting:
            if seq.cancelled:
                metrics.QUEUE_SIZE.dec()
                self.engine._end(seq, FINISH_CANCELLED, None, None)
            elif now - seq.queued_since > timeout:
                metrics.QUEUE_SIZE.dec()
                failure = errors.ResourceExhausted(
                    f"no batch slot within {timeout:g}s (LLMESH_QUEUE_TIMEOUT_SECONDS)",
                    retry_after=self.engine._retry_after(),
                    reason="QUEUE_TIMEOUT",
                )
                self.engine._end(seq, None, failure, "queue_timeout")
            else:
                keep.append(seq)
        self.waiting = keep

    def chunk_tokens(self) -> int:
        """Prompt tokens that take about one decode step (see the module docstring)."""
        engine = self.engine
        if not engine._running:
            return engine.max_prefill_tokens
        if engine.prefill_tok_s is None or engine.step_s is None:
            return min(engine.max_prefill_tokens, 256)
        step = int(engine.prefill_tok_s * engine.step_s * PREFILL_STALL_STEPS)
        return max(MIN_PREFILL_CHUNK, min(engine.max_prefill_tokens, step))

    def prefill_budget(self) -> int:
        """Prompt tokens of whole (one-chunk) prompts prefilled together this iteration."""
        engine = self.engine
        chunk = self.chunk_tokens()
        if not engine._running:
            return engine.max_prefill_tokens
        steps = max(1, len(self.waiting) // QUEUE_PER_BUDGET_STEP)
        return min(engine.max_prefill_tokens, chunk * steps)

    def admit(self) -> list[SequenceState]:
        """FIFO admission into free slots: whole short prompts up to the prefill budget, and a
        long prompt as the chunked prefill (one at a time)."""
        engine = self.engine
        group: list[SequenceState] = []
        with self._cond:
            chunk = self.chunk_tokens()
            budget = self.prefill_budget()
            tokens = 0
            while self.waiting and engine._free:
                seq = self.waiting[0]
                if seq.cancelled or seq.released:
                    self.waiting.popleft()
                    metrics.QUEUE_SIZE.dec()
                    engine._end(seq, FINISH_CANCELLED, None, None)
                    continue
                n = len(seq.prefill_ids)
                if n > chunk:
                    if engine._chunking is not None:
                        break
                    self.waiting.popleft()
                    metrics.QUEUE_SIZE.dec()
                    engine._take_slot(seq)
                    engine._chunking = seq
                    continue
                if group and tokens + n > budget:
                    break
                self.waiting.popleft()
                metrics.QUEUE_SIZE.dec()
                engine._take_slot(seq)
                group.append(seq)
                tokens += n
        return group
