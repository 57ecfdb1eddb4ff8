"""Admission from the engines' load reports: the predicted wait, the decision and its
fallback, on a fake clock."""

from __future__ import annotations

import pytest

from llmesh.errors import ResourceExhausted
from llmesh.testing import FakeClock
from llmesh.v1 import inference_pb2
from services.gateway.admission import (
    REASON_DEADLINE,
    REASON_IN_FLIGHT,
    REASON_QUEUE_WAIT,
    AdmissionConfig,
    AdmissionController,
    Ask,
    LoadBook,
    WeightWindow,
)
from services.gateway.admission.load import STALE_S


def report(**fields: object) -> inference_pb2.LoadReport:
    base: dict[str, object] = dict(
        replica="r1",
        reported=True,
        max_running=4,
        kv_blocks_free=4,
        kv_blocks_total=4,
        block_tokens=1024,
        step_seconds=0.02,
        prefill_tokens_per_second=10000.0,
    )
    base.update(fields)
    return inference_pb2.LoadReport(**base)  # type: ignore[arg-type]


def controller(clock: FakeClock, initial: float = 1000.0) -> tuple[AdmissionController, LoadBook]:
    config = AdmissionConfig(budget=1e9, tenant_share=1.0, adaptive=True, initial_in_flight=initial)
    book = LoadBook(clock)
    return AdmissionController(WeightWindow(config, clock=clock), book, target_seconds=3.0, clock=clock), book


ASK = Ask("t", "interactive", "m@1", "", 256)


async def test_free_rows_admit_what_the_learned_limit_would_shed() -> None:
    clock = FakeClock()
    admission, book = controller(clock, initial=1000.0)  # room for fewer than one 100 x 256 request
    book.update("", report(running=1))
    admitted = [await admission.admit(ASK, 100, None, 30.0) for _ in range(3)]  # 3 free rows
    assert all(a.ticket is not None for a in admitted)
    # The fourth finds the rows taken by what this gateway sent since the report: it queues
    # behind one request (about 64 tokens x 20 ms / 4 rows), well within the target.
    fourth = admission.predicted_wait(ASK, 100)
    assert fourth is not None and 0 < fourth.seconds < 3.0
    # Without reports (stale: a frozen replica) the learned limit decides again.
    clock.advance(STALE_S + 0.1)
    with pytest.raises(ResourceExhausted) as shed:
        await admission.admit(ASK, 100, None, 30.0)
    assert shed.value.reason == REASON_IN_FLIGHT


async def test_a_queue_past_the_target_is_shed_at_once_with_retry_info() -> None:
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    book.update("", report(running=4, waiting=400, kv_blocks_free=0))
    hold, refusal = admission.reserve(ASK, 100, 30.0)
    assert hold is None and refusal is not None and refusal.reason == REASON_QUEUE_WAIT
    assert refusal.retry_after > 0
    # A short queue is admitted, unless its answer could not be done before the deadline.
    book.update("", report(running=4, waiting=1, kv_blocks_free=0))
    hold, refusal = admission.reserve(ASK, 100, 30.0)
    assert refusal is None and hold is not None
    hold.release()
    hold, refusal = admission.reserve(ASK, 100, 1.0)  # 256 tokens x 20 ms > 1 s
    assert refusal is not None and refusal.reason == REASON_DEADLINE


async def test_room_means_no_shed_whatever_the_deadline() -> None:
    clock = FakeClock()
    admission, book = controller(clock)
    book.update("", report(running=0))
    _hold, refusal = admission.reserve(ASK, 100, 0.5)
    assert refusal is None


async def test_a_request_waiting_for_its_cache_lookup_holds_no_generation_weight() -> None:
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    book.update("", report(running=0))
    hold, refusal = admission.reserve(ASK, 100, 30.0, waiting_for_cache=True)
    assert refusal is None and hold is None
    assert admission.window.held() == 0  # type: ignore[attr-defined]
    # On the fallback (no reports) it holds its prediction, so it is not refused after the wait.
    book.models[""].drop()
    hold, refusal = admission.reserve(ASK, 100, 30.0, waiting_for_cache=True)
    assert refusal is None and hold is not None and hold.weight == 100 * 256
    hold.release()


async def test_answers_lengths_and_what_reports_show_keep_the_estimate() -> None:
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    book.update("", report(running=0))
    admission_ = await admission.admit(ASK, 10, None, 30.0)
    load = book.model("")
    assert load.pending == 1
    clock.advance(0.1)
    book.update("", report(running=1, kv_blocks_free=3))  # the engine shows it: no longer pending
    assert load.pending == 0
    assert admission_.ticket is not None
    admission_.ticket.progress(200)
    admission_.ticket.finish()
    assert load.mean_output_tokens > 64  # learned from the answer's 200 tokens
    book.update("", inference_pb2.LoadReport(replica="r1", reported=False))
    assert admission.predicted_wait(ASK, 10) is None


async def test_the_pace_streams_really_had_outweighs_a_faster_reported_step() -> None:
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    book.update("", report(running=0))
    admitted = await admission.admit(ASK, 10, None, 30.0)
    assert admitted.ticket is not None
    clock.advance(0.5)  # queue and prefill: not the pace
    admitted.ticket.progress(1)
    clock.advance(1.0)
    admitted.ticket.progress(10)  # ten tokens in a second: 0.1 s each, where the engine says 0.02
    admitted.ticket.finish()
    load = book.model("")
    assert load.seconds_per_token is not None and abs(load.seconds_per_token - 0.1) < 1e-9
    book.update("", report(running=4, waiting=3, kv_blocks_free=0))
    wait = admission.predicted_wait(ASK, 10)
    assert wait is not None and abs(wait.service_seconds - (10 / 10000 + 256 * 0.1)) < 1e-6


async def test_a_server_that_does_not_tell_its_batch_room_has_room_while_it_queues_nothing() -> None:
    # vLLM reports running and waiting, not max_num_seqs: a burst is not a queue until it queues.
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    vllm = dict(max_running=0, kv_blocks_total=1000, kv_blocks_free=1000, block_tokens=16)
    book.update("", report(running=0, **vllm))
    for _ in range(16):
        hold, refusal = admission.reserve(ASK, 100, 30.0)
        assert refusal is None and hold is not None
        hold.release()
        await admission.admit(ASK, 100, None, 30.0)
    book.update("", report(running=16, waiting=200, **vllm))
    _, refusal = admission.reserve(ASK, 100, 30.0)
    assert refusal is not None and refusal.reason == REASON_QUEUE_WAIT


async def test_requests_on_their_way_hold_their_place_in_the_queue() -> None:
    # Checked before their hops (retrieval, tokenizer), they reach the engine later: requests
    # checked meanwhile queue behind them, not beside them in the same free rows.
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    book.update("", report(running=0))
    holds = []
    for _ in range(4):
        hold, refusal = admission.reserve(ASK, 100, 30.0)
        assert refusal is None and hold is not None
        holds.append(hold)
    fifth = admission.predicted_wait(ASK, 100)
    assert fifth is not None and fifth.seconds > 0
    for hold in holds:
        hold.release()
    assert book.model("").reserved == 0
    free = admission.predicted_wait(ASK, 100)
    assert free is not None and free.seconds == 0


def test_a_new_replica_reporting_keeps_what_is_pending_on_the_others() -> None:
    from services.gateway.admission.load import ModelLoad, ReplicaReport

    clock = FakeClock()
    load = ModelLoad(clock)
    load.update(ReplicaReport.from_message(report(replica="r1"), clock()))
    clock.advance(0.1)
    for _ in range(5):
        load.dispatched()
    # r2 appears (a scale-up): r1 has not reported since, so what went there is still on its way.
    clock.advance(0.1)
    load.update(ReplicaReport.from_message(report(replica="r2", running=1), clock()))
    assert load.pending == 5


async def test_requests_that_never_reached_the_engine_stop_counting_at_its_next_report() -> None:
    # An inference that was killed: every request sent while it was down failed on its way, and
    # its restarted engine reports an empty batch. Nothing of them may stay pending (the old
    # arithmetic of arrivals kept them all, and shed every request after the restart).
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    book.update("", report(running=0))
    sent = 0
    with pytest.raises(ResourceExhausted) as shed:
        while sent < 1000:
            admitted = await admission.admit(ASK, 10, None, 30.0)
            assert admitted.ticket is not None
            admitted.ticket.finish()  # failed on its way: UNAVAILABLE
            sent += 1
    # All sent, none shown by a report yet: a queue past the target, so the next one is shed.
    assert shed.value.reason == REASON_QUEUE_WAIT and sent > 4
    clock.advance(0.2)
    book.update("", inference_pb2.LoadReport(replica="r1", reported=False))  # the stream broke
    clock.advance(1.0)
    book.update("", report(running=0))  # the restarted replica's first report
    assert book.model("").pending == 0
    free = admission.predicted_wait(ASK, 10)
    assert free is not None and free.seconds == 0
    _, refusal = admission.reserve(ASK, 10, 30.0)
    assert refusal is None


async def test_a_burst_sent_between_two_reports_does_not_all_see_the_same_free_rows() -> None:
    clock = FakeClock()
    admission, book = controller(clock, initial=1e9)
    book.update("", report(running=0))  # 4 free rows
    for _ in range(4):
        await admission.admit(ASK, 10, None, 30.0)
    fifth = admission.predicted_wait(ASK, 10)
    assert fifth is not None and fifth.seconds > 0
    clock.advance(0.1)
    book.update("", report(running=4, kv_blocks_free=0))  # the engine shows the four: still full
    assert book.model("").pending == 0
    full = admission.predicted_wait(ASK, 10)
    assert full is not None and full.seconds > 0


class _SlowCapacity:
    """A learned limit whose drain estimate is fixed (the fallback's deadline check)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def drain_seconds(self, weight: float) -> float:
        return self.seconds


async def test_both_deadline_refusals_advise_one_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    # One formula whether the engines' reports or the measured throughput estimated the time:
    # the excess over the deadline, at least MIN_RETRY_S, at most one window, to the millisecond.
    clock = FakeClock()
    admission, book = controller(clock)
    window_s = admission.config.window_seconds
    book.update("", report(running=4, waiting=1, kv_blocks_free=0))
    wait = admission.predicted_wait(ASK, 100)
    assert wait is not None
    finish = wait.seconds + wait.service_seconds
    from_reports = []
    for left in (finish - 0.0001, finish - 1.25, 0.0):
        _hold, refusal = admission.reserve(ASK, 100, left)
        assert refusal is not None and refusal.reason == REASON_DEADLINE
        assert "then at the engine's step time" in str(refusal)
        from_reports.append(refusal.retry_after)
    clock.advance(STALE_S + 1)  # no fresh report: the fallback decides
    from_throughput = []
    for expected, left in ((10.0, 10.0 - 0.0001), (10.0, 10.0 - 1.25), (10.0 + window_s * 3, 0.0)):
        monkeypatch.setattr(admission, "capacity", lambda model, s=expected: _SlowCapacity(s))
        _hold, refusal = admission.reserve(ASK, 100, left)
        assert refusal is not None and refusal.reason == REASON_DEADLINE
        assert "at the measured throughput" in str(refusal)
        from_throughput.append(refusal.retry_after)
        with pytest.raises(ResourceExhausted) as shed:
            await admission.admit(ASK, 100, None, left)
        assert shed.value.retry_after == refusal.retry_after
    expected_advice = [0.05, 1.25, min(window_s, round(finish, 3))]
    assert from_reports == pytest.approx(expected_advice, abs=1e-3)
    assert from_throughput == pytest.approx([0.05, 1.25, window_s], abs=1e-3)


def test_an_interactive_request_goes_ahead_of_batch_work_a_batch_line_waits_behind() -> None:
    """Rows full of batch work and a queue of batch lines: an interactive request takes a batch
    row (the engine preempts it) and is admitted at once; another batch line would queue behind
    them all, past the target, and is refused."""
    clock = FakeClock()
    admission, book = controller(clock)
    book.update("", report(running=4, running_batch=4, waiting=400, waiting_batch=400, waiting_prompt_tokens=40000))
    interactive = admission.predicted_wait(ASK, 100)
    assert interactive is not None and interactive.seconds == 0
    batch_line = admission.predicted_wait(Ask("t", "batch", "m@1", "", 256), 100)
    assert batch_line is not None and batch_line.seconds > 3.0
    # Interactive work waiting is waited for by an interactive request too.
    book.update("", report(running=4, running_batch=2, waiting=6, waiting_batch=4, sequence=2))
    again = admission.predicted_wait(ASK, 100)
    assert again is not None and again.seconds > 0
