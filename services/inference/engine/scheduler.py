"""The scheduler: the queues, who runs each step, and what a step's tokens do to the requests.
It knows no Engine and no forward: each step it returns a frozen `StepPlan` (which prompts are
prefilled over which token ranges, which rows decode, which rows it preempted to make room), the
engine core has the plan executed (executor.py, over runner.py) and hands the `StepOutput` back
to `update`, which appends the tokens, runs the stop checks (`stop_reason`, the one place a row
ends on a token id) and finishes, joins or requeues the rows. What the emitter must hear (rows
that joined, the step's tokens, requests that ended) goes through the `StepEvents` the engine
core gives it.

Priority. Each request has one (0 interactive, 1 batch; a higher number waits). The waiting queue
is ordered by priority, first come first served within one, requeued requests at the front of
theirs. When the request at the head cannot have a batch row or the KV blocks of its prompt, and
a row of a higher number holds them, the newest such row is preempted: requeued, its blocks
freed (the full ones stay in the prefix cache until the pool needs them, kv_manager.py), and it
resumes later by prefilling again what of its prompt and tokens is no longer cached. So an
interactive request's first token never waits for batch work to finish; when the KV pool runs
out mid-decode, the victim is likewise the newest row of the highest number.

Admission is in priority order while the batch has a free row and the KV pool has the blocks of
the request's uncached prompt tokens, keeping one block per running row for it to grow into (a
row that still finds the pool empty at its next token is preempted, `make_room`). A prompt's
cached prefix is not prefilled again, so the work a prompt costs is its uncached tokens. Prefill
work per iteration is sized so running rows are not stalled much and arrivals are still
prefilled as fast as they come:

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

An iteration (`begin`, then `schedule` until it returns None) runs up to three forwards in order:
the admitted whole prompts; then either one mixed forward (the decode rows and the long prompt's
next chunk) or the chunk alone followed by the decode rows (the rows prefilled this iteration
decode in it too). With LLMESH_MIX_PROMPTS=1, where the engine can mix and no long prompt is
being chunked, whole prompts that arrive while rows decode go in the decode rows' forward instead
(one forward: the weights are read once, and the rows never wait on a prefill of its own; the new
prompts' first tokens come out of that longer forward, later).

Only the engine core's worker thread calls it (requests reach it through the core's inbox,
engine_core.py), so it takes no lock; `load()` snapshots of the queue lengths from other threads
read them as they are.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from llmesh import errors
from services.inference.engine import metrics
from services.inference.engine.config import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    MIN_PREFILL_CHUNK,
    PREFILL_STALL_STEPS,
    EngineConfig,
)
from services.inference.engine.kv_manager import BlockManager
from services.inference.engine.messages import TokenItem
from services.inference.engine.sequence import PRIORITY_INTERACTIVE, SequenceState

if TYPE_CHECKING:
    from services.inference.engine.sampling import PromptScore, Scores

log = logging.getLogger("llmesh.inference.engine")

#: Waiting requests per extra step's worth of prefill budget.
QUEUE_PER_BUDGET_STEP = 2

#: How long after interactive work was last seen batch work stays held to its rows beside
#: interactive work: a closed-loop client's next request comes a moment after its last answer, and
#: batch rows admitted in that gap would only be preempted again when it arrives.
INTERACTIVE_HOLD_S = 1.0

#: Why a row was preempted (the label of llmesh_inference_preemptions).
PREEMPTED_FOR_BLOCKS = "kv_blocks"
PREEMPTED_FOR_PRIORITY = "priority"


class StepEvents(Protocol):
    """What the scheduler tells the engine core, in the order it happens (the core turns them
    into the emitter's messages and the batch's spans)."""

    def joined(self, group: list[SequenceState], started_ns: int, tokens: int, padded: int) -> None:
        """`group`'s prompts are complete and their rows joined the running batch."""

    def tokens(self, items: list[TokenItem]) -> None:
        """One forward's tokens, in batch-row order."""

    def ended(self, seq: SequenceState, reason: str | None, failure: BaseException | None, outcome: str | None) -> None:
        """The worker is done with `seq` for a reason not seen in a token."""


@dataclass
class Speeds:
    """Measured speeds (EWMA, the engine core's) that size prefill chunks while a batch decodes."""

    prefill_tok_s: float | None = None
    step_s: float | None = None


@dataclass
class Admission:
    """Who joins the batch this iteration (their blocks allocated), picked by `admit`."""

    #: Whole prompts prefilled together this iteration.
    group: list[SequenceState] = field(default_factory=list)
    #: A long prompt to prefill chunk by chunk from now on, if one was admitted.
    chunked: SequenceState | None = None
    #: Rows of a higher priority number preempted to make room for these.
    preempted: list[SequenceState] = field(default_factory=list)
    #: An interactive request is among them (batch prompts then wait for the next iteration).
    interactive: bool = False


# ----------------------------------------------------------------- the step contract


@dataclass(frozen=True, slots=True)
class PromptRange:
    """Tokens [start, end) of `seq`'s prompt (with the tokens it generated before a preemption,
    `prefill_ids`) to prefill into its block table."""

    seq: SequenceState
    start: int
    end: int

    @property
    def ids(self) -> list[int]:
        return self.seq.prefill_ids[self.start : self.end]

    @property
    def blocks(self) -> list[int]:
        assert self.seq.blocks is not None
        return self.seq.blocks.blocks

    @property
    def completes(self) -> bool:
        """The range ends the prompt: its last logits choose the row's next token."""
        return self.end == len(self.seq.prefill_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One forward's work, as the scheduler decided it."""

    #: Whole prompts (each to its end) prefilled together; output row i is prefills[i].
    prefills: tuple[PromptRange, ...] = ()
    #: The next chunk of the long prompt being prefilled.
    chunk: PromptRange | None = None
    #: The running rows, one token each (batch row i is decodes[i]), at their own positions.
    decodes: tuple[SequenceState, ...] = ()
    #: The chunk, or the whole prompts, ride in the decode rows' forward (else the plan has
    #: only one kind of work).
    mixed: bool = False
    #: Rows the scheduler requeued while planning this step (the KV pool ran out).
    preempted: tuple[SequenceState, ...] = ()

    @property
    def resumed(self) -> tuple[SequenceState, ...]:
        """Prefilled rows that ran before (preempted): what they generated is recomputed too."""
        rows = [r.seq for r in self.prefills] + ([self.chunk.seq] if self.chunk is not None else [])
        return tuple(s for s in rows if s.generated)

    def decode_rows(self) -> list[tuple[int, int, list[int]]]:
        """(input token, its position, block table) of each decode row."""
        return [(s.generated[-1], s.length, s.blocks.blocks) for s in self.decodes if s.blocks is not None]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a plan's forward chose: a token per prefilled prompt, for the chunk when it completed
    its prompt, and per decode row, with the log probabilities of the rows that asked."""

    prefill_tokens: tuple[int, ...] = ()
    prefill_scores: Scores | None = None
    chunk_token: int | None = None
    chunk_scores: Scores | None = None
    decode_tokens: tuple[int, ...] = ()
    decode_scores: Scores | None = None
    #: When the prefill forward started (wall clock, for the prefill spans).
    started_ns: int = 0
    #: The scores of the prompt tokens this forward read, of the rows that asked (prompt_logprobs).
    prompt_scores: tuple[tuple[SequenceState, tuple[PromptScore, ...]], ...] = ()


def oom_failure() -> errors.ResourceExhausted:
    return errors.ResourceExhausted("inference: out of device memory", retry_after=1.0)


class Scheduler:
    #: The iteration's phases: the admitted prompts, the mixed step, the chunk alone, the decode.
    _PREFILL, _MIXED, _CHUNK, _DECODE, _DONE = range(5)

    def __init__(
        self,
        config: EngineConfig,
        kv: BlockManager,
        max_prefill_tokens: int,
        eos_ids: Collection[int],
        can_mix: bool,
        events: StepEvents,
        retry_after: Callable[[], float],
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = frozenset(eos_ids)
        self.can_mix = can_mix
        self.events = events
        self._retry_after = retry_after
        self.waiting: collections.deque[SequenceState] = collections.deque()
        #: The rows decoding, in the order they joined (batch row i is running[i]).
        self.running: list[SequenceState] = []
        #: The long prompt being prefilled chunk by chunk (one at a time), if any.
        self.chunking: SequenceState | None = None
        #: A running row left or joined since the engine core last started a batch segment.
        self.membership_changed = False
        #: Rows requeued to give their room to others (KV blocks or priority).
        self.preemptions = 0
        #: When an interactive (priority 0) request last waited or ran (monotonic seconds).
        self.interactive_seen = -INTERACTIVE_HOLD_S
        self._phase = self._DONE
        self._admitted: list[SequenceState] = []

    # ----------------------------------------------------------------- queues

    def add(self, seqs: list[SequenceState]) -> None:
        """New requests at the back of their priority in the waiting queue."""
        self.waiting.extend(seqs)
        metrics.QUEUE_SIZE.inc(len(seqs))
        self._order_waiting(seqs)

    def take_all(self) -> list[SequenceState]:
        """Empties the waiting queue (the engine closes)."""
        waiting, self.waiting = list(self.waiting), collections.deque()
        metrics.QUEUE_SIZE.dec(len(waiting))
        return waiting

    def requeue_front(self, seqs: list[SequenceState], now: float) -> None:
        """`seqs` at the front of their priority in the waiting queue."""
        for seq in seqs:
            seq.queued_since = now
        self.waiting.extendleft(reversed(seqs))
        metrics.QUEUE_SIZE.inc(len(seqs))
        self._order_waiting(seqs)

    def _order_waiting(self, moved: list[SequenceState]) -> None:
        """Priority order, kept stable (arrival order, requeued first, within a priority). One
        priority throughout, the common case, costs a scan."""
        if len({s.priority for s in moved}) <= 1 and all(
            a.priority <= b.priority for a, b in itertools.pairwise(self.waiting)
        ):
            return
        self.waiting = collections.deque(sorted(self.waiting, key=lambda s: s.priority))

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

    def _join(self, seqs: list[SequenceState]) -> None:
        self.running.extend(seqs)
        metrics.BATCH_SIZE.inc(len(seqs))

    def _leave(self, seq: SequenceState) -> None:
        if self.chunking is seq:
            self.chunking = None
        if seq in self.running:
            self.running.remove(seq)
            metrics.BATCH_SIZE.dec()
            self.membership_changed = True

    def expire(self, now: float) -> None:
        """Drops cancelled and timed-out requests from the queue."""
        if not self.waiting:
            return
        timeout = self.config.queue_timeout_s
        keep: collections.deque[SequenceState] = collections.deque()
        for seq in self.waiting:
            if seq.cancelled:
                metrics.QUEUE_SIZE.dec()
                self.end(seq, FINISH_CANCELLED, None, None)
            elif now - seq.queued_since > timeout:
                metrics.QUEUE_SIZE.dec()
                failure = errors.ResourceExhausted(
                    f"no batch row within {timeout:g}s (LLMESH_QUEUE_TIMEOUT_SECONDS)",
                    retry_after=self._retry_after(),
                    reason="QUEUE_TIMEOUT",
                )
                self.end(seq, None, failure, "queue_timeout")
            else:
                keep.append(seq)
        self.waiting = keep

    # ----------------------------------------------------------------- a request's end

    def end(self, seq: SequenceState, reason: str | None, failure: BaseException | None, outcome: str | None) -> None:
        """The worker is done with `seq`: its blocks released, the emitter told."""
        self.release(seq)
        if seq.released:
            return
        seq.released = True
        self.events.ended(seq, reason, failure, outcome)

    def release(self, seq: SequenceState) -> None:
        """Takes `seq` out of the batch and gives its blocks back (the full ones it registered
        stay in the prefix cache)."""
        self._leave(seq)
        if seq.blocks is not None:
            self.kv.free(seq.blocks)
            seq.blocks = None

    def reset_batch(self) -> None:
        """After a failed step: the batch is gone. Its blocks are released; blocks registered
        in the prefix cache stay valid (a step only writes positions past a row's registered
        blocks, and never into a shared block)."""
        for seq in self.holding():
            self.release(seq)

    def requeue(self, seqs: list[SequenceState], reason: str | None = None) -> None:
        """`seqs` give their blocks back and wait again at the front of their priority; they
        resume by prefilling what of their tokens is no longer cached. `reason`: a preemption's."""
        again: list[SequenceState] = []
        for seq in seqs:
            self.release(seq)
            seq.length = seq.prefilled = 0
            seq.prefill_started_ns = 0
            if seq.stop_hit:  # its last event is sent: nothing more to compute
                seq.released = True
            elif seq.cancelled:
                self.end(seq, FINISH_CANCELLED, None, None)
            else:
                again.append(seq)
            if reason is not None:
                self.preemptions += 1
                metrics.PREEMPTIONS.labels(reason).inc()
        if again:
            self.requeue_front(again, time.monotonic())

    # ----------------------------------------------------------------- admission

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
        """Admission in priority order: whole short prompts up to the prefill budget, and a long
        prompt as the chunked prefill (one at a time), while rows and blocks last, taking them
        from rows of a higher priority number when the head of the queue needs them."""
        admission = Admission()
        batch_cap = self._batch_cap(admission)
        chunk = self.chunk_tokens(speeds)
        budget = self.prefill_budget(speeds)
        bt = self.kv.block_tokens
        chunking = self.chunking is not None
        rows = self.batch_rows
        batch_rows = sum(1 for s in self.holding() if s.priority > PRIORITY_INTERACTIVE)
        tokens = 0
        while self.waiting:
            seq = self.waiting[0]
            if seq.priority > PRIORITY_INTERACTIVE and (batch_rows >= batch_cap or admission.interactive):
                # The queue is in priority order: only batch work is left. Its prompts wait for the
                # next iteration rather than lengthen an interactive prompt's forward.
                break
            if rows >= self.config.max_batch_size:
                if self._preempt_for(seq, admission):
                    chunking = self.chunking is not None
                    rows -= 1
                    continue
                break
            if seq.cancelled or seq.released:
                self.waiting.popleft()
                metrics.QUEUE_SIZE.dec()
                self.end(seq, FINISH_CANCELLED, None, None)
                continue
            ids = seq.prefill_ids
            # Scoring the prompt needs the logits of every prompt position: nothing is reused.
            reuse = seq.params.prompt_logprobs is None
            hit, _ = self.kv.match(ids) if reuse else ([], [])
            n = len(ids) - len(hit) * bt
            long = n > chunk
            if long and (chunking or admission.chunked is not None):
                if chunking and self._preempt_chunking_for(seq, admission):
                    chunking = False
                    rows -= 1
                    continue
                break
            if not long and admission.group and tokens + n > budget:
                break
            table = self.kv.allocate(ids, reserve=rows, reuse=reuse)
            if table is None:
                if self._preempt_for(seq, admission):
                    chunking = self.chunking is not None
                    rows -= 1
                    continue
                break
            self.waiting.popleft()
            metrics.QUEUE_SIZE.dec()
            seq.blocks = table
            seq.prefilled = seq.length = table.cached_tokens
            if seq.cached_prompt_tokens is None:  # the first admission's: a requeue's is no prompt reuse
                seq.cached_prompt_tokens = min(table.cached_tokens, len(seq.prompt_ids))
            rows += 1
            batch_rows += seq.priority > PRIORITY_INTERACTIVE
            admission.interactive |= seq.priority == PRIORITY_INTERACTIVE
            if long:
                admission.chunked = seq
            else:
                admission.group.append(seq)
                tokens += n
        return admission

    def _batch_cap(self, admission: Admission) -> int | float:
        """Rows batch work may hold now: every row, unless interactive work waits or runs or did
        within INTERACTIVE_HOLD_S; then `batch_rows_beside_interactive`, the newest batch rows past
        it preempted. On a CPU each row lengthens every step, the interactive ones' too."""
        now = time.monotonic()
        # The queue is in priority order: its head says whether interactive work waits.
        waits = bool(self.waiting) and self.waiting[0].priority == PRIORITY_INTERACTIVE
        if waits or any(s.priority == PRIORITY_INTERACTIVE for s in self.holding()):
            self.interactive_seen = now
        if now - self.interactive_seen >= INTERACTIVE_HOLD_S:
            return float("inf")
        cap = self.config.batch_rows_beside_interactive
        # holding() lists the rows in the order they joined, the prompt being chunked last: the
        # victims past the cap are that prompt (its prefill is the longest step), then the newest.
        batch = [s for s in self.holding() if s.priority > PRIORITY_INTERACTIVE]
        if len(batch) > cap:
            victims = batch[cap:]
            log.info("preempting %d batch rows beside interactive work", len(victims))
            admission.preempted.extend(victims)
            self.requeue(victims, PREEMPTED_FOR_PRIORITY)
        return cap

    def _preempt_for(self, seq: SequenceState, admission: Admission) -> bool:
        """Requeues the newest row (or the prompt being chunked) of the highest priority number
        above `seq`'s, so `seq` can have its row and blocks; False when no row is below it."""
        below = [s for s in self.holding() if s.priority > seq.priority]
        if not below:
            return False
        worst = max(s.priority for s in below)
        victim = [s for s in below if s.priority == worst][-1]
        log.info("preempting a priority %d row for a priority %d request", victim.priority, seq.priority)
        admission.preempted.append(victim)
        self.requeue([victim], PREEMPTED_FOR_PRIORITY)
        return True

    def _preempt_chunking_for(self, seq: SequenceState, admission: Admission) -> bool:
        """The long prompt being chunked yields its turn to a long prompt of a lower number."""
        chunking = self.chunking
        if chunking is None or chunking.priority <= seq.priority:
            return False
        admission.preempted.append(chunking)
        self.requeue([chunking], PREEMPTED_FOR_PRIORITY)
        return True

    # ----------------------------------------------------------------- the step plan

    def begin(self, admission: Admission) -> None:
        """Starts an iteration with what `admit` picked: rows that ended since the last one
        leave, the long prompt (if admitted) starts chunking."""
        for seq in self.holding():
            if seq.cancelled:
                self.end(seq, FINISH_CANCELLED, None, None)
            elif seq.stop_hit:  # the emitter already sent the last event
                seq.released = True
                self.release(seq)
        if admission.chunked is not None:
            self.chunking = admission.chunked
        self._admitted = list(admission.group)
        self._phase = self._PREFILL

    def schedule(self, speeds: Speeds) -> StepPlan | None:
        """The iteration's next forward, or None when the iteration is done."""
        if self._phase == self._PREFILL:
            self._phase = self._MIXED
            group, self._admitted = self._admitted, []
            if group:
                prompts = tuple(PromptRange(s, s.prefilled, len(s.prefill_ids)) for s in group)
                # Mixing (LLMESH_MIX_PROMPTS): prompts that arrive while rows decode ride in their
                # forward, the weights read once for both. A scored prompt needs every position's
                # logits: it is prefilled on its own.
                scored = any(s.params.prompt_logprobs is not None for s in group)
                if self.config.mix_prompts and self.running and self.can_mix and self.chunking is None and not scored:
                    preempted = self.make_room()
                    if self.running:
                        self._phase = self._DONE
                        return StepPlan(prefills=prompts, decodes=tuple(self.running), mixed=True, preempted=preempted)
                return StepPlan(prefills=prompts)
        if self._phase == self._MIXED:
            self._phase = self._CHUNK
            # A prompt being scored is chunked on its own: its chunks' every logit is needed.
            scored = self.chunking is not None and self.chunking.params.prompt_logprobs is not None
            if self.chunking is not None and not scored and self.running and self.can_mix:
                preempted = self.make_room()
                if self.chunking is not None and self.running:
                    self._phase = self._DONE
                    chunk = self._next_chunk(self.chunking, speeds)
                    return StepPlan(chunk=chunk, decodes=tuple(self.running), mixed=True, preempted=preempted)
                # Preemption emptied one side: the plain path.
        if self._phase == self._CHUNK:
            self._phase = self._DECODE
            if self.chunking is not None:
                return StepPlan(chunk=self._next_chunk(self.chunking, speeds))
        if self._phase == self._DECODE:
            self._phase = self._DONE
            preempted = self.make_room()
            if self.running:
                return StepPlan(decodes=tuple(self.running), preempted=preempted)
        return None

    def _next_chunk(self, seq: SequenceState, speeds: Speeds) -> PromptRange:
        start = seq.prefilled
        n = min(self.chunk_tokens(speeds), len(seq.prefill_ids) - start)
        if not seq.prefill_started_ns:
            seq.prefill_started_ns = time.time_ns()
        return PromptRange(seq, start, start + n)

    def make_room(self) -> tuple[SequenceState, ...]:
        """Every running row gets a block for its next token; when the pool runs out, the newest
        row of the highest priority number (the long prompt being chunked first among equals) is
        preempted until the rest fit. Returns the preempted rows."""
        running = self.running
        preempted: list[SequenceState] = []
        i = 0
        while i < len(running):
            seq = running[i]
            assert seq.blocks is not None
            if self.kv.grow(seq.blocks, seq.length + 1):
                i += 1
                continue
            victim = self.preemption_victim()
            if victim is None:  # one row longer than the pool: validation keeps requests below its size
                self.end(seq, None, oom_failure(), "error")
                continue
            if victim is self.chunking:
                log.info("KV blocks exhausted; the prompt being prefilled waits")
            else:
                log.info("KV blocks exhausted; preempting the newest running sequence")
                if running.index(victim) < i:  # a row already given room: the next one shifts down
                    i -= 1
            preempted.append(victim)
            self.requeue([victim], PREEMPTED_FOR_BLOCKS)
        return tuple(preempted)

    def preemption_victim(self) -> SequenceState | None:
        """Who gives its blocks back when the pool runs out: among the prompt being chunked and
        the running rows (when more than one runs: a single row cannot be helped), the highest
        priority number, and among equals the prompt being chunked, then the newest row."""
        candidates = list(self.running) if len(self.running) > 1 else []
        if self.chunking is not None:
            candidates.append(self.chunking)
        if not candidates:
            return None
        worst = max(s.priority for s in candidates)
        return [s for s in candidates if s.priority == worst][-1]

    # ----------------------------------------------------------------- out of device memory

    def out_of_memory(self, plan: StepPlan) -> StepPlan | None:
        """The forward of `plan` ran out of device memory: what to retry now (less), or None
        (what was not done waits for the next iteration, or failed)."""
        if plan.mixed and plan.prefills:
            self.requeue([r.seq for r in plan.prefills])  # the prompts wait; the rows decode next
            return None
        if plan.mixed:
            if len(self.running) > 1:
                self._halve_running()
            elif self.chunking is not None:
                self.requeue([self.chunking])  # the prompt waits; the row decodes alone next
            return None
        if plan.prefills:
            group = [r.seq for r in plan.prefills]
            if len(group) > 1:
                half = len(group) // 2
                log.warning("out of device memory in prefill; prefilling %d of %d now", half, len(group))
                self.requeue(group[half:])
                return dataclasses.replace(plan, prefills=plan.prefills[:half])
            if self.running:
                self._halve_running()
                return plan
            self.end(group[0], None, oom_failure(), "error")
            return None
        if plan.chunk is not None:
            if self.running:
                self._halve_running()  # the chunk is retried next iteration
            else:
                self.end(plan.chunk.seq, None, oom_failure(), "error")
            return None
        # A decode step: layers that ran before the failure wrote this step's token; harmless,
        # the positions did not advance, so the retry writes the same place again.
        if len(self.running) > 1:
            self._halve_running()
            return StepPlan(decodes=tuple(self.running)) if self.running else None
        if self.running:
            self.end(self.running[0], None, oom_failure(), "error")
        return None

    def _halve_running(self) -> None:
        """Requeues the newest half of the running rows."""
        running = self.running
        moved = running[len(running) // 2 :]
        log.warning("out of device memory; requeueing %d of %d running sequences", len(moved), len(running))
        self.requeue(list(moved))

    # ----------------------------------------------------------------- applying a step's output

    def update(self, plan: StepPlan, output: StepOutput) -> None:
        """Applies what `plan`'s forward chose: the prompts' cached lengths, the rows that join,
        each row's token and its stop check, the rows that end."""
        for seq, scores in output.prompt_scores:
            seq.prompt_scores += scores
        if plan.prefills:
            group = [r.seq for r in plan.prefills]
            computed = [r.end - r.start for r in plan.prefills]
            for r in plan.prefills:
                r.seq.length = r.seq.prefilled = r.end
                self._register(r.seq)
            self._join_batch(group, output.started_ns, sum(computed), max(computed) * len(group))
            self._accept(list(zip(group, output.prefill_tokens, strict=True)), output.prefill_scores)
        if plan.chunk is not None:
            seq = plan.chunk.seq
            seq.prefilled = seq.length = plan.chunk.end
            self._register(seq)
            if plan.chunk.completes:
                assert output.chunk_token is not None
                self.chunking = None
                n = len(seq.prefill_ids)
                self._join_batch([seq], seq.prefill_started_ns, n, n)
                self._accept([(seq, output.chunk_token)], output.chunk_scores)
        if plan.decodes:
            bt = self.kv.block_tokens
            for seq in plan.decodes:
                seq.length += 1
                if seq.length % bt == 0:
                    self._register(seq)
            self._accept(list(zip(plan.decodes, output.decode_tokens, strict=True)), output.decode_scores)

    def _join_batch(self, group: list[SequenceState], started_ns: int, tokens: int, padded: int) -> None:
        self._join(group)
        self.membership_changed = True
        self.events.joined(group, started_ns, tokens, padded)

    def _register(self, seq: SequenceState) -> None:
        """Puts the full blocks of what `seq` has in the cache into the prefix cache."""
        if seq.blocks is not None:
            self.kv.register(seq.blocks, seq.prefill_ids[: seq.length])

    def _accept(self, pairs: list[tuple[SequenceState, int]], scores: Scores | None) -> None:
        """Per-row bookkeeping after a forward (pairs[i] is batch row i): the grammar's say on
        the token, the stop check, finished rows leave at once; the tokens and the log
        probabilities of the rows that asked go to the emitter in one message."""
        items: list[TokenItem] = []
        for row, (seq, chosen) in enumerate(pairs):
            if seq.params.prompt_only:  # the prompt is read: its chosen token is no one's
                items.append(TokenItem(seq, -1, FINISH_LENGTH, None))
                seq.released = True
                self.release(seq)
                continue
            token = chosen
            if seq.grammar is not None:  # the grammar may put the row on its closing path
                token = seq.grammar.take(token, seq.params.max_new_tokens - len(seq.generated) - 1)
            score = scores.get(row, token) if scores is not None else None
            seq.generated.append(token)
            reason = self.stop_reason(seq, token)
            items.append(TokenItem(seq, token, reason, score))
            if reason is not None:
                seq.released = True
                self.release(seq)
        self.events.tokens(items)

    def stop_reason(self, seq: SequenceState, token: int) -> str | None:
        """Whether `token` (just appended to `seq.generated`) ends the row, and why: the one
        place a row ends on its token ids (stop strings are text: the emitter finds them).
        A request's own rules on ending (ignore_eos here; a minimum length would go here too,
        before the EOS and stop-id checks) apply only in this method."""
        params = seq.params
        # A complete structured answer ends with the EOS its grammar then allows (ignore_eos or not).
        if token in self.eos_ids and (not params.ignore_eos or seq.grammar is not None):
            return FINISH_STOP
        if token in params.stop_token_ids:
            return FINISH_STOP  # like EOS: the stop token is not part of the text
        if len(seq.generated) >= params.max_new_tokens:
            return FINISH_LENGTH
        return None
