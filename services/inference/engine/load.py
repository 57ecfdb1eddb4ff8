"""What an engine reports of its own load: the signal the gateway admits and routes on.

The engine is the only one that knows whether it can start a request now (free rows, free KV,
its queue, how long a step takes); the gateway's guesses from throughput it happened to see are
a fallback for backends that report nothing. A snapshot is cheap (plain counters the worker
keeps), taken from any thread, and never blocks the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineLoad:
    """One snapshot of an engine's load, as `Engine.load()` returns it."""

    #: Sequences decoding or prefilling now.
    running: int
    #: The most sequences the engine runs at once (its batch room): `running` < this is a free row.
    max_running: int
    #: Requests accepted and waiting for a row (not yet prefilled).
    waiting: int
    #: KV memory in blocks of `block_tokens` tokens: free (including cached blocks no running
    #: sequence holds, which are evictable) and in all.
    kv_blocks_free: int
    kv_blocks_total: int
    block_tokens: int
    #: Prompt tokens accepted and not yet prefilled (the waiting requests' and the rest of a
    #: chunked prompt's).
    waiting_prompt_tokens: int = 0
    #: Recent seconds per decode step at the current batch size (EWMA), None before any.
    step_seconds: float | None = None
    #: Recent prefill speed in prompt tokens per second (EWMA), None before any.
    prefill_tokens_per_second: float | None = None
    #: Share of prompt tokens served from the prefix cache lately (0 without one).
    prefix_hit_rate: float = 0.0
    #: Hashes of the full prefix blocks cached now (the newest first, bounded), so a router can
    #: send a request where its prefix is; empty without a prefix cache.
    prefix_hashes: tuple[int, ...] = field(default=())
    #: Of `running`, `waiting` and `waiting_prompt_tokens`, the batch work's (priority above 0):
    #: what an interactive request preempts or goes ahead of.
    running_batch: int = 0
    waiting_batch: int = 0
    waiting_batch_prompt_tokens: int = 0

    @property
    def free_rows(self) -> int:
        return max(0, self.max_running - self.running)
