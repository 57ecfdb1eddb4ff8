"""Routing over a model's replicas, on a fake clock: the pick by predicted wait, prefix
affinity bounded by load, outlier ejection and return, the retry budget, and the replica set
following DNS."""

from __future__ import annotations

import random

import pytest

from llmesh.prefix_hash import block_hashes
from llmesh.retry_budget import RetryBudget
from services.gateway.load_report import ReplicaReport
from services.gateway.replicas import (
    AFFINITY_HIT,
    AFFINITY_MISS,
    AFFINITY_NONE,
    AFFINITY_OVERLOADED,
    Choice,
    Replica,
    ReplicaSet,
    RoutingConfig,
)
from services.gateway.routing import ReplicaRouter, dns_name, replica_targets, routed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replica_set(n: int = 3, **config: object) -> tuple[ReplicaSet, Clock, list[Replica]]:
    clock = Clock()
    rs = ReplicaSet("m", RoutingConfig(**config), clock=clock, rng=random.Random(1))  # type: ignore[arg-type]
    rs.set_addresses([f"10.0.0.{i}:50053" for i in range(n)])
    return rs, clock, list(rs.replicas.values())


def report(rs: ReplicaSet, r: Replica, running: int = 0, waiting: int = 0, rows: int = 4, **extra: object) -> None:
    rs.reported(r, ReplicaReport(running=running, waiting=waiting, max_running=rows, step_seconds=0.01, **extra))  # type: ignore[arg-type]


def busy(rs: ReplicaSet, r: Replica, count: int, tokens: int, started: bool = True) -> list:  # type: ignore[type-arg]
    flights = [rs.start(Choice(r, AFFINITY_NONE), tokens) for _ in range(count)]
    if started:
        for f in flights:
            rs.progress(f, 1)
    return flights


def test_pick_avoids_the_replica_whose_rows_free_last() -> None:
    rs, _clock, (a, b, c) = replica_set()
    for r in (a, b, c):
        report(rs, r)
    busy(rs, a, 4, 512)  # all its rows on long answers
    busy(rs, b, 4, 16)  # all its rows, but they end soon
    busy(rs, c, 4, 64)
    assert [rs.pick().replica for _ in range(5)] == [b] * 5  # type: ignore[union-attr]
    # With a free row anywhere, that replica starts it at once.
    rs.finish(a.flights[0], False)
    assert rs.pick().replica is a  # type: ignore[union-attr]


def test_stale_reports_fall_back_to_two_random_choices_by_occupancy() -> None:
    rs, _clock, (a, b, c) = replica_set()
    busy(rs, a, 5, 16)
    busy(rs, b, 5, 16)
    # No reports at all: two of three sampled, the emptier of the two; c is never the worse one.
    picks = [rs.pick().replica for _ in range(30)]  # type: ignore[union-attr]
    assert c in picks and all(p is c or p in (a, b) for p in picks)
    assert picks.count(c) >= 15  # c wins whenever it is sampled (2 of 3 samples hold it)


def test_round_robin_ignores_load() -> None:
    rs, _clock, (a, b, c) = replica_set(pick="round_robin")
    for r in (a, b, c):
        report(rs, r)
    busy(rs, a, 4, 512)
    assert {rs.pick().replica.address for _ in range(3)} == {a.address, b.address, c.address}  # type: ignore[union-attr]


def test_affinity_sends_a_prefix_where_it_is_held_bounded_by_load() -> None:
    rs, _clock, (a, b, c) = replica_set(affinity_min_tokens=32)
    for r in (a, b, c):
        report(rs, r, rows=32, block_tokens=16)
    turn1 = list(range(40))  # 2 full blocks
    turn2 = [*turn1, *range(100, 140)]
    h1, h2 = block_hashes(turn1, 16), block_hashes(turn2, 16)
    first = rs.pick(h1)
    assert first is not None and first.affinity == AFFINITY_NONE
    rs.finish(rs.start(first, 16, h1), False)  # turn 1 answered there (and remembered)
    holder = first.replica
    second = rs.pick(h2)
    assert second is not None and second.replica is holder and second.affinity == AFFINITY_HIT
    assert second.matched_tokens == 32
    # The holder loaded above 1.25 x the mean (with the new request): the prefix yields.
    others = [r for r in (a, b, c) if r is not holder]
    busy(rs, holder, 4, 16)
    busy(rs, others[0], 2, 16)
    busy(rs, others[1], 2, 16)
    # holder: 5 in flight, mean (5+2+2+1)/3 = 3.33: 6 > 1.25 x 3.33 = 4.17
    third = rs.pick(h2)
    assert third is not None and third.replica is not holder and third.affinity == AFFINITY_OVERLOADED
    # Within the bound, it goes back to the holder.
    busy(rs, others[0], 2, 16)
    busy(rs, others[1], 2, 16)  # holder 5, others 4, 4: mean 14/3 = 4.67; 6 <= 5.83
    again = rs.pick(h2)
    assert again is not None and again.replica is holder and again.affinity == AFFINITY_HIT


def test_affinity_follows_the_engines_reported_prefix_hashes() -> None:
    rs, _clock, (a, b, c) = replica_set()
    prompt = list(range(64))
    hashes = block_hashes(prompt, 16)
    for r in (a, b):
        report(rs, r, rows=32, block_tokens=16)
    report(rs, c, rows=32, block_tokens=16, prefix_hashes=frozenset(hashes[:3]))
    choice = rs.pick(hashes)
    assert choice is not None and choice.replica is c and choice.matched_tokens == 48
    # Round robin goes where it goes: mostly where the prefix is not.
    rr, _, replicas = replica_set(pick="round_robin")
    report(rr, replicas[2], rows=32, block_tokens=16, prefix_hashes=frozenset(hashes))
    outcomes = [rr.pick(hashes).affinity for _ in range(3)]  # type: ignore[union-attr]
    assert sorted(outcomes) == [AFFINITY_HIT, AFFINITY_MISS, AFFINITY_MISS]


def test_consecutive_failures_eject_with_a_growing_backoff_and_health_brings_it_back() -> None:
    rs, clock, (a, _b, _c) = replica_set(eject_consecutive_failures=3, eject_base_seconds=1.0)
    ejected: list[str] = []
    rs.on_eject = lambda r, reason: ejected.append(reason)
    for _ in range(3):
        f = rs.start(Choice(a, AFFINITY_NONE), 8)
        rs.finish(f, True)
    assert a.ejected and ejected == ["failures"]
    assert all(rs.pick().replica is not a for _ in range(10))  # type: ignore[union-attr]
    clock.now += 0.5
    rs.health(a, True)
    assert a.ejected  # its backoff (1 s) is not over
    clock.now += 0.6
    rs.health(a, False)
    rs.tick()
    assert a.ejected  # over, but its health check fails
    rs.health(a, True)
    assert not a.ejected  # over and passing: back
    # Ejected again soon after: twice as long.
    for _ in range(3):
        rs.finish(rs.start(Choice(a, AFFINITY_NONE), 8), True)
    assert a.ejected and a.ejected_until == pytest.approx(clock.now + 2.0)


def test_never_more_than_the_share_is_ejected_and_never_the_only_replica() -> None:
    rs, _clock, (a, b, c) = replica_set(max_ejected_share=0.5)
    assert rs.eject(a, "failures")
    assert not rs.eject(b, "failures")  # 1 of 3 is the most (50%)
    assert [r.ejected for r in (a, b, c)] == [True, False, False]
    alone, _, (only,) = replica_set(1)
    assert not alone.eject(only, "failures")


def test_a_stalled_replica_is_ejected_and_its_requests_cut() -> None:
    rs, clock, (a, b, _c) = replica_set(stall_seconds=0.75)
    report(rs, a)
    report(rs, b)
    cut: list[bool] = []
    waiting = rs.start(Choice(a, AFFINITY_NONE), 16, cancel=cut.append)
    answering = rs.start(Choice(a, AFFINITY_NONE), 16, cancel=cut.append)
    rs.progress(answering, 1)
    clock.now += 0.5
    report(rs, b)  # b keeps reporting; a has gone silent (frozen)
    rs.tick()
    assert not a.ejected
    clock.now += 0.3
    report(rs, b)
    rs.tick()
    assert a.ejected and not b.ejected
    # The one without a first token may be retried elsewhere; the one past it may not.
    assert cut == [True, False] and waiting in a.flights
    # SIGCONT: it answers again once its backoff is over.
    clock.now += 1.0
    report(rs, a)
    rs.tick()
    assert not a.ejected


def test_retry_budget_is_a_share_of_requests() -> None:
    budget = RetryBudget(0.1, 2)
    assert budget.spend() and budget.spend() and not budget.spend()
    for _ in range(10):
        budget.earn()
    assert budget.spend() and not budget.spend()
    assert (budget.retries, budget.refused) == (3, 2)


def test_targets_and_dns_names() -> None:
    assert replica_targets("a:1|b:2") == ["a:1", "b:2"] and routed("a:1|b:2") and not routed("a:1")
    assert dns_name("dns:///inference.llmesh.svc:50053") == ("inference.llmesh.svc", 50053)
    assert dns_name("dns://8.8.8.8/inference:50053") == ("inference", 50053) and routed("dns:///x:1")
    assert dns_name("a:1") is None
    with pytest.raises(ValueError):
        dns_name("dns:///nowhere")


async def test_the_replicas_follow_dns_as_the_service_scales() -> None:
    answers = [["10.0.0.1:50053"], ["10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"], [], ["10.0.0.3:50053"]]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return answers.pop(0)

    router = ReplicaRouter("m", "dns:///inference.llmesh.svc:50053", 1 << 20, resolver=resolver)
    try:
        assert not router.set.replicas  # resolved on start / refresh, not at construction
        await router.refresh()
        assert list(router.set.replicas) == ["10.0.0.1:50053"]
        await router.refresh()  # scaled up to 3
        assert list(router.set.replicas) == ["10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"]
        assert set(router.channels) == set(router.set.replicas)
        await router.refresh()  # a lookup naming nothing keeps what was known
        assert len(router.set.replicas) == 3
        await router.refresh()  # scaled down to 1
        assert list(router.set.replicas) == ["10.0.0.3:50053"] and list(router.channels) == ["10.0.0.3:50053"]
        assert asked == [("inference.llmesh.svc", 50053)] * 4
    finally:
        await router.close()


def test_replica_settings() -> None:
    from llmesh.settings import SettingsError, load

    s = load("gateway", {"LLMESH_MODELS": "small=10.0.0.1:50053|10.0.0.2:50053,big=dns:///big.llmesh.svc:50053"})
    assert s.peers.models == {"small": "10.0.0.1:50053|10.0.0.2:50053", "big": "dns:///big.llmesh.svc:50053"}
    assert load("gateway", {"LLMESH_INFERENCE_TARGET": "a:1|b:2"}).peers.inference_target == "a:1|b:2"
    config = RoutingConfig.from_settings(load("gateway", {"LLMESH_ROUTING_PICK": "round_robin"}).routing)
    assert config.pick == "round_robin" and config.affinity and config.max_ejected_share == 0.5
    for bad in ("m=a:1|dns:///x:1", "m=a:1||b:2", "m=a:1|nowhere"):
        with pytest.raises(SettingsError):
            load("gateway", {"LLMESH_MODELS": bad})
    with pytest.raises(SettingsError):
        load("gateway", {"LLMESH_ROUTING_PICK": "random"})


def test_a_late_tick_of_our_own_is_no_stall_of_theirs() -> None:
    rs, clock, (a, b, _c) = replica_set(stall_seconds=0.75)
    report(rs, a)
    report(rs, b)
    rs.tick(periodic=True)
    clock.now += 2.0  # this process did not run for 2 s (its event loop lagged)
    rs.tick(periodic=True)
    assert not a.ejected and not b.ejected
    for _ in range(8):  # ticking on time again; b reports, a stays silent: a stall period later, out
        clock.now += 0.1
        report(rs, b)
        rs.tick(periodic=True)
    assert a.ejected and not b.ejected


def test_a_retry_goes_to_a_healthy_replica_not_tried_or_nowhere() -> None:
    rs, _clock, (a, b, c) = replica_set()
    rs.eject(a, "failures")
    assert rs.pick(exclude=[b]).replica is c  # type: ignore[union-attr]
    assert rs.pick(exclude=[b, c]) is None  # not the ejected one
    # A first attempt with every replica out still goes somewhere: the one ejected longest ago.
    for r in (b, c):
        r.ejected_until, r.ejected_at = 1e9, 200.0
    assert rs.pick().replica is a  # type: ignore[union-attr]


def test_capacity_is_the_healthy_replicas_rows() -> None:
    rs, clock, (a, b, c) = replica_set()
    for r in (a, b, c):
        report(rs, r, rows=8)
    assert rs.capacity() == 24
    rs.eject(c, "stalled")
    assert rs.capacity() == 16
    clock.now += 5  # every report stale: nothing to count on
    assert rs.capacity() == 0
