"""The engine core's inbox (engine_core.Inbox): the only way into the worker from other threads.
Submissions and wake-ups in one queue; closed, the queue bound and the idle flag under its lock."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from llmesh import errors
from services.inference.engine.engine_core import Inbox


def request(tokens: int = 3) -> Any:
    return SimpleNamespace(prompt_ids=list(range(tokens)))


def test_submissions_arrive_in_order_and_wake_ups_carry_none() -> None:
    inbox = Inbox(max_queue=8, scheduled=lambda: 0, retry_after=lambda: 1.0)
    first, second = request(2), request(5)
    inbox.submit(first, free_rows=0)
    inbox.wake()
    inbox.submit(second, free_rows=0)
    assert (inbox.pending, inbox.pending_tokens) == (2, 7)
    assert inbox.receive(None) == [first, second]
    assert inbox.receive(None) == []  # nothing there: no wait
    inbox.taken([first, second])
    assert (inbox.pending, inbox.pending_tokens) == (0, 0)


def test_the_bound_counts_what_is_pending_and_what_the_scheduler_holds() -> None:
    scheduled = [1]
    inbox = Inbox(max_queue=2, scheduled=lambda: scheduled[0], retry_after=lambda: 2.5)
    inbox.submit(request(), free_rows=0)
    with pytest.raises(errors.ResourceExhausted) as full:
        inbox.submit(request(), free_rows=0)
    assert full.value.reason == "QUEUE_FULL" and full.value.retry_after == 2.5
    inbox.submit(request(), free_rows=1)  # a free row: the next iteration admits it
    # Moved to the scheduler: counted there, not twice.
    arrived = inbox.receive(None)
    scheduled[0] += len(arrived)
    inbox.taken(arrived)
    with pytest.raises(errors.ResourceExhausted):
        inbox.submit(request(), free_rows=0)


def test_a_closed_inbox_refuses_and_wakes_the_worker() -> None:
    inbox = Inbox(max_queue=8, scheduled=lambda: 0, retry_after=lambda: 1.0)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(inbox.receive(30.0)))
    waiter.start()
    started = time.monotonic()
    inbox.close()
    waiter.join(10)
    assert got == [[]] and time.monotonic() - started < 10  # woken by the close, not the timeout
    with pytest.raises(errors.Unavailable):
        inbox.submit(request(), free_rows=4)
    assert inbox.pending == 0


def test_idle_is_cleared_by_a_submission_and_set_only_while_none_is_pending() -> None:
    inbox = Inbox(max_queue=8, scheduled=lambda: 0, retry_after=lambda: 1.0)
    assert inbox.idle.is_set()
    seq = request()
    inbox.submit(seq, free_rows=0)
    assert not inbox.idle.is_set()
    inbox.settle(busy=False)  # the worker has not taken it yet: still busy
    assert not inbox.idle.is_set()
    inbox.taken(inbox.receive(None))
    inbox.settle(busy=True)  # in the scheduler's queue now
    assert not inbox.idle.is_set()
    inbox.settle(busy=False)
    assert inbox.idle.is_set()
