"""The messages that cross the engine's threads, typed: what the asyncio front puts in the engine
core's inbox (`Submit`, `Wake`), and what the core's worker hands the emitter thread (`Tokens`,
`Ended`, `Prefilled`, `Segment`, and the emitter's own `Sync` and `Stop`).

Each is put once and read once by the other side; the sequences they carry are shared state
whose fields have one owner each (sequence.py says which)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.inference.engine.sequence import SequenceState

if TYPE_CHECKING:
    from services.inference.engine.sampling import RowLogprobs


# ----------------------------------------------------------------- front -> core


@dataclass(frozen=True, slots=True)
class Submit:
    """A request, validated, for the scheduler's waiting queue."""

    seq: SequenceState


@dataclass(frozen=True, slots=True)
class Wake:
    """Look again: a request was cancelled, or the engine closes."""


# ----------------------------------------------------------------- core -> emitter


@dataclass(frozen=True, slots=True)
class TokenItem:
    """A row's token of one step; `reason` (FINISH_STOP, FINISH_LENGTH) when the scheduler's
    stop check ended the row with it; its log probabilities when the request asked."""

    seq: SequenceState
    token: int
    reason: str | None = None
    logprobs: RowLogprobs | None = None


@dataclass(frozen=True, slots=True)
class Tokens:
    """One step's tokens, in batch-row order; `now`: when the step ended (monotonic)."""

    now: float
    items: list[TokenItem]


@dataclass(frozen=True, slots=True)
class Ended:
    """The worker is done with `seq` for a reason not seen in a token: cancelled, failed, timed out."""

    seq: SequenceState
    reason: str | None
    failure: BaseException | None
    outcome: str | None


@dataclass(frozen=True, slots=True)
class Prefilled:
    """Prompts prefilled (and their rows joined the batch): the queue and prefill spans."""

    group: list[SequenceState]
    started_ns: int
    ended_ns: int
    tokens: int
    padded: int
    batch_id: str
    batch_size: int


@dataclass(frozen=True, slots=True)
class Segment:
    """The batch's membership changed: a new batch segment span (the previous one ends)."""

    segment_id: str
    seqs: list[SequenceState]
    reserved_tokens: int
    previous_steps: int


@dataclass(frozen=True, slots=True)
class Sync:
    """Set `done` once everything put before it is delivered."""

    done: threading.Event


@dataclass(frozen=True, slots=True)
class Stop:
    """The emitter thread ends (after what was put before)."""


#: What the emitter reads from its queue.
EmitterMessage = Tokens | Ended | Prefilled | Segment | Sync | Stop
