"""The gateway's memory of requests the cache answered lately (admission's hint)."""

from __future__ import annotations

from llmesh.v1 import cache_pb2, common_pb2
from services.gateway.recent_hits import RecentHits, request_key


def scope(**kw: object) -> cache_pb2.CacheScope:
    fields: dict[str, object] = {"model": "m@1", "tenant": "t", "sampling": common_pb2.SamplingParams(max_new_tokens=8)}
    fields.update(kw)
    return cache_pb2.CacheScope(**fields)  # type: ignore[arg-type]


def test_the_key_covers_prompt_and_every_part_of_the_scope() -> None:
    base = request_key("What is the refund window?", scope())
    assert base == request_key("What is the refund window?", scope())
    assert base != request_key("What is the refund window", scope())
    assert base != request_key("What is the refund window?", scope(tenant="u"))
    assert base != request_key("What is the refund window?", scope(collection="docs", collection_version=2))
    assert base != request_key(
        "What is the refund window?", scope(sampling=common_pb2.SamplingParams(max_new_tokens=9))
    )


def test_a_hit_is_remembered_until_a_miss_or_its_age_runs_out() -> None:
    now = [0.0]
    hits = RecentHits(max_age=10.0, clock=lambda: now[0])
    key = request_key("q", scope())
    assert key not in hits
    hits.hit(key)
    assert key in hits
    hits.missed(key)
    assert key not in hits
    hits.hit(key)
    now[0] = 10.5
    assert key not in hits and len(hits) == 0


def test_the_memory_keeps_the_newest_entries() -> None:
    hits = RecentHits(max_entries=3)
    keys = [request_key(f"q{i}", scope()) for i in range(4)]
    for key in keys[:3]:
        hits.hit(key)
    hits.hit(keys[0])  # seen again: now the newest
    hits.hit(keys[3])
    assert len(hits) == 3
    assert keys[1] not in hits
    assert all(k in hits for k in (keys[0], keys[2], keys[3]))
