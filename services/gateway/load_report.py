"""One replica's load as the gateway keeps it: the one type a LoadReport becomes on its way in
(`ReplicaReport.from_message`), read by admission's book (`admission/load.py`) and by a routed
model's replica choice (`replicas.py`) alike."""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmesh.v1 import inference_pb2


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's latest report (LoadReport as plain data), and when it came. `replica` is
    the replica's own name (host:pid: it changes when the replica restarts)."""

    replica: str = ""
    running: int = 0
    max_running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    block_tokens: int = 0
    waiting_prompt_tokens: int = 0
    step_seconds: float | None = None
    prefill_tokens_per_second: float | None = None
    prefix_hit_rate: float = 0.0
    received_at: float = 0.0
    # The prefix blocks it holds (kept only where a replica is chosen by them: a routed model).
    prefix_hashes: frozenset[int] = frozenset()
    # Batch work's share of running, waiting and waiting_prompt_tokens (see `for_interactive`).
    running_batch: int = 0
    waiting_batch: int = 0
    waiting_batch_prompt_tokens: int = 0

    @classmethod
    def from_message(cls, message: inference_pb2.LoadReport, now: float, prefix_hashes: bool = False) -> ReplicaReport:
        m = message
        return cls(
            replica=m.replica,
            running=m.running,
            max_running=m.max_running,
            waiting=m.waiting,
            kv_blocks_free=m.kv_blocks_free,
            kv_blocks_total=m.kv_blocks_total,
            block_tokens=m.block_tokens,
            waiting_prompt_tokens=m.waiting_prompt_tokens,
            step_seconds=m.step_seconds or None,
            prefill_tokens_per_second=m.prefill_tokens_per_second or None,
            prefix_hit_rate=m.prefix_hit_rate,
            received_at=now,
            prefix_hashes=frozenset(m.prefix_hashes) if prefix_hashes else frozenset(),
            running_batch=m.running_batch,
            waiting_batch=m.waiting_batch,
            waiting_batch_prompt_tokens=m.waiting_batch_prompt_tokens,
        )

    def for_interactive(self) -> ReplicaReport:
        """The replica as an interactive request finds it: batch work waiting is behind it, and
        the rows batch work runs in are its to take (the engine preempts them)."""
        if not (self.running_batch or self.waiting_batch):
            return self
        return replace(
            self,
            running=max(0, self.running - self.running_batch),
            waiting=max(0, self.waiting - self.waiting_batch),
            waiting_prompt_tokens=max(0, self.waiting_prompt_tokens - self.waiting_batch_prompt_tokens),
            running_batch=0,
            waiting_batch=0,
            waiting_batch_prompt_tokens=0,
        )

    @property
    def occupied(self) -> int:
        return self.running + self.waiting
