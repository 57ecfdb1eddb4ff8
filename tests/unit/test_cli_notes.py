"""`llmesh ask` says on stderr how an answer was made: from the cache, or degraded."""

from __future__ import annotations

from llmesh.cli import answer_notes
from llmesh.v1 import common_pb2, gateway_pb2


def response(**fields: object) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(text="Paris.", **fields)  # type: ignore[arg-type]


def test_a_plain_answer_has_no_note() -> None:
    assert answer_notes(response()) == []


def test_cache_hits_say_which_tier() -> None:
    exact = response(cache=gateway_pb2.CacheInfo(hit=True, tier=common_pb2.CACHE_TIER_EXACT, similarity=1.0))
    near = response(cache=gateway_pb2.CacheInfo(hit=True, tier=common_pb2.CACHE_TIER_SEMANTIC, similarity=0.913))
    assert answer_notes(exact) == ["served from the cache (exact match)"]
    assert answer_notes(near) == ["served from the cache (semantic match, similarity 0.91)"]


def test_each_degradation_gets_a_note() -> None:
    degraded = response(
        degradations=["cache_unavailable", "retrieval_unavailable", "max_new_tokens_capped", "something_new"],
        usage=common_pb2.Usage(input_tokens=12, output_tokens=16),
    )
    notes = answer_notes(degraded)
    assert len(notes) == 4
    assert notes[0].startswith("no cache:")
    assert notes[1].startswith("no context:")
    assert notes[2].startswith("tokens capped:") and "16 tokens generated" in notes[2]
    assert notes[3] == "degraded: something_new"
