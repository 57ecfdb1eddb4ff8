"""A request inside the engine: its state (`SequenceState`), where its events go (`Sink`), and
the events themselves (`GenerationEvent`, with the tokens' log probabilities when asked).

Who owns which field: the engine core's worker thread the batch fields (blocks, generated,
length...), the output processor (output.py) decoder / stopper / finished / emitted and the
timing of the tokens; `cancelled` (set by the asyncio front) and `stop_hit` (set by the output
processor) are flags the worker reads.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace

from services.inference.engine.decoding import IncrementalDecoder, ResolvedParams, StopMatcher
from services.inference.engine.kv_manager import BlockTable

if TYPE_CHECKING:
    from services.inference.engine.grammar import RowGrammar


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and the likeliest alternatives at its position."""

    token_id: int
    token: str
    logprob: float
    bytes: bytes
    top: tuple[TopLogprob, ...] = ()


@dataclass
class GenerationEvent:
    """One streamed message: tokens and text produced since the last one; the last event has
    finish_reason and usage set. `logprobs`: one per token id, when the request asked."""

    token_ids: list[int]
    text: str
    batch_id: str = ""
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Without token_ids: how many tokens the text stands for (0: one per event with text).
    tokens: int = 0
    #: The first event, when the request asked: one per prompt token (the first scores 0).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: The last event: prompt tokens the prefix cache held (not computed).
    cached_input_tokens: int = 0


class Sink:
    """Where a sequence's events go: an asyncio queue on its loop, or a plain list (warm-up)."""

    __slots__ = ("items", "loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerationEvent | BaseException] | None = asyncio.Queue() if loop else None
        self.items: list[GenerationEvent | BaseException] = []


_seq_ids = itertools.count(1)

#: Request priorities (InferenceRequest.priority): a higher number waits, and yields its row.
PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 1


@dataclass(eq=False)
class SequenceState:
    """One request inside the engine (see the module docstring for who owns which field)."""

    prompt_ids: list[int]
    params: ResolvedParams
    request_id: str
    sink: Sink
    decoder: IncrementalDecoder
    stopper: StopMatcher
    seed: int
    enqueued_at: float
    #: When the sequence (re)entered the waiting queue; the queue timeout counts from here.
    queued_since: float = 0.0
    internal: bool = False
    #: PRIORITY_INTERACTIVE, PRIORITY_BATCH...: who the scheduler serves first (scheduler.py).
    priority: int = PRIORITY_INTERACTIVE
    span: trace.Span | None = None
    span_ctx: otel_context.Context | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    stop_hit: bool = False
    #: The worker is done with it (its blocks are released; no more tokens will be sent).
    released: bool = False
    #: The emitter sent its last event.
    finished: bool = False
    prompt_counted: bool = False
    batch_id: str = ""
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    decode_span: trace.Span | None = None
    #: Worker: the KV blocks it holds (None while it holds none), tokens in the cache, and
    #: prompt tokens in the cache so far (reused from the prefix cache or prefilled).
    blocks: BlockTable | None = None
    length: int = 0
    prefilled: int = 0
    prefill_started_ns: int = 0
    #: Tokens emitted to the client so far (emitter).
    emitted: int = 0
    #: Worker: the row's grammar when its answer has a response format (engine/grammar.py).
    grammar: RowGrammar | None = None
    #: Worker: prompt tokens its first admission found in the prefix cache (usage reports them).
    cached_prompt_tokens: int | None = None
    #: Worker -> emitter: the prompt's scores (params.prompt_logprobs), gathered over its chunks:
    #: (token id, log probability, likeliest alternatives) for every prompt token after the first.
    prompt_scores: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def prefill_ids(self) -> list[int]:
        # After an OOM requeue the tokens generated so far are prefilled again with the prompt.
        return self.prompt_ids + self.generated


def to_int64(seed: int) -> int:
    """A 64-bit seed as the int64 the device hash takes (two's complement: all 64 bits kept)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed
