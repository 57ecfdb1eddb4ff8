"""How many rows batch lines may take, from the engines' own load reports: a share of each
replica's rows less what runs there, none on a replica where anything waits, and None (pace by
admission alone) when no engine reports."""

from __future__ import annotations

from llmesh.testing import FakeClock
from services.gateway.admission import LoadBook, ReplicaReport
from services.gateway.batches.runner import engine_room


def report(replica: str, running: int, waiting: int, received_at: float, max_running: int = 32) -> ReplicaReport:
    return ReplicaReport(
        replica=replica,
        running=running,
        max_running=max_running,
        waiting=waiting,
        kv_blocks_free=100,
        kv_blocks_total=100,
        block_tokens=16,
        waiting_prompt_tokens=0,
        step_seconds=0.02,
        prefill_tokens_per_second=None,
        prefix_hit_rate=0.0,
        received_at=received_at,
    )


def test_batch_lines_fill_a_share_of_the_rows_and_leave_a_replica_where_work_waits() -> None:
    clock = FakeClock()
    loads = LoadBook(clock)
    assert engine_room(loads, [""]) is None  # nothing reported: admission alone paces the runner
    loads.model("").update(report("a", running=4, waiting=0, received_at=clock()))
    assert engine_room(loads, [""], share=0.75) == 24 - 4
    loads.model("").update(report("b", running=30, waiting=0, received_at=clock()))
    assert engine_room(loads, [""], share=0.75) == 20  # b is past its share: nothing more there
    loads.model("").update(report("a", running=32, waiting=3, received_at=clock()))
    assert engine_room(loads, [""], share=0.75) == 0  # interactive work queues: batch work leaves it
    clock.advance(60)
    assert engine_room(loads, [""]) is None  # stale reports say nothing
