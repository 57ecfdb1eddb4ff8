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

It owns the queues: the waiting requests (in arrival order, requeued ones at the front), the
running batch and the long prompt being chunked. Only the engine core's worker thread calls it
(requests reach it through the core's inbox, engine_core.py), so it takes no lock; `load()`
snapshots of the queue lengths from other threads read them as they are.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from llmesh import errors
from services.inference.engine import metrics
from services.inference.engine.config import FINISH_CANCELLED, MIN_PREFILL_CHUNK, PREFILL_STALL_STEPS, EngineConfig
from services.inference.engine.kv_manager import BlockManager
from services.inference.engine.sequence import SequenceState

#: Waiting requests per extra step's worth of prefill budget.
QUEUE_PER_BUDGET_STEP = 2

#: end(seq, finish reason, failure, outcome): the engine core finishes a request.
EndRequest = Callable[[SequenceState, str | None, BaseException | None, str | None], None]


@dataclass
class Speeds:
    """Measured speeds (EWMA, the engine core's) that size prefill chunks while a batch decodes."""

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
        self.waiting: collections.deque[SequenceState] = collections.deque()
        #: The rows decoding, in the order they joined (batch row i is running[i]).
        self.running: list[SequenceState] = []
        #: The long prompt being prefilled chunk by chunk (one at a time), if any.
        self.chunking: SequenceState | None = None

    # ----------------------------------------------------------------- queues

    def add(self, seqs: list[SequenceState]) -> None:
        """New requests at the back of the waiting queue."""
        self.waiting.extend(seqs)
        metrics.QUEUE_SIZE.inc(len(seqs))

    def take_all(self) -> list[SequenceState]:
        """Empties the waiting queue (the engine closes)."""
        waiting, self.waiting = list(self.waiting), collections.deque()
        metrics.QUEUE_SIZE.dec(len(waiting))
        return waiting

    def requeue_front(self, seqs: list[SequenceState], now: float) -> None:
        for seq in seqs:
            seq.queued_since = now
        self.waiting.extendleft(reversed(seqs))
        metrics.QUEUE_SIZE.inc(len(seqs))

    @property
    def busy(self) -> bool:
        """Something waits, runs or is being chunked."""
        return bool(self.waiting or self.running or self.chunking is not None)

    @property
    def batch_rows(self) -> int:
        return len(self.running) + (self.chunking is not None)

    def holding(self) -> list[SequenceState]:
        """The sequences in the batch: the running rows and the one being chunked."""
        return [*self.running, *([self.chunking] if self.chunking is not None else [])]

    def join(self, seqs: list[SequenceState]) -> None:
        self.running.extend(seqs)
        metrics.BATCH_SIZE.inc(len(seqs))

    def start_chunking(self, seq: SequenceState) -> None:
        self.chunking = seq

    def chunk_finished(self) -> None:
        self.chunking = None

    def leave(self, seq: SequenceState) -> bool:
        """Takes `seq` out of the batch; True when it was a running row (the membership changed)."""
        if self.chunking is seq:
            self.chunking = None
        if seq in self.running:
            self.running.remove(seq)
            metrics.BATCH_SIZE.dec()
            return True
        return False

    def preemption_victim(self) -> SequenceState | None:
        """Who gives its blocks back when the pool runs out: the prompt being chunked, then the
        newest running row (None when only one row runs: it cannot be helped)."""
        if self.chunking is not None:
            return self.chunking
        if len(self.running) > 1:
            return self.running[-1]
        return None

    def expire(self, now: float) -> None:
        """Drops cancelled and timed-out requests from the queue."""
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

    # ----------------------------------------------------------------- the step plan

    def chunk_tokens(self, speeds: Speeds) -> int:
        """Prompt tokens that take about one decode step (see the module docstring)."""
        if not self.running:
            return self.max_prefill_tokens
        if speeds.prefill_tok_s is None or speeds.step_s is None:
            return min(self.max_prefill_tokens, 256)
        step = int(speeds.prefill_tok_s * speeds.step_s * PREFILL_STALL_STEPS)
        return max(MIN_PREFILL_CHUNK, min(self.max_prefill_tokens, step))

    def prefill_budget(self, speeds: Speeds) -> int:
        """Prompt tokens of whole (one-chunk) prompts prefilled together this iteration."""
        if not self.running:
            return self.max_prefill_tokens
        steps = max(1, len(self.waiting) // QUEUE_PER_BUDGET_STEP)
        return min(self.max_prefill_tokens, self.chunk_tokens(speeds) * steps)

    def admit(self, speeds: Speeds) -> Admission:
        """FIFO admission: whole short prompts up to the prefill budget, and a long prompt as the
        chunked prefill (one at a time), while rows and blocks last."""
        admission = Admission()
        chunk = self.chunk_tokens(speeds)
        budget = self.prefill_budget(speeds)
        bt = self.kv.block_tokens
        chunking = self.chunking is not None
        rows = self.batch_rows
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
            if long and (chunking or admission.chunked is not None):
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
