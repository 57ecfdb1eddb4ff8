"""Cache keys: normalization and what is (and is not) part of the scope."""

from __future__ import annotations

from llmesh.v1 import cache_pb2, common_pb2
from services.cache.keys import Scope, canonical_scope, embedding_text, entry_key, normalize_prompt


def test_normalization_keeps_everything_that_can_change_the_answer() -> None:
    # Only surrounding whitespace and one final "?" or "." go (and canonically equal code points).
    assert normalize_prompt("  What is the capital of France?  ") == "What is the capital of France"
    assert normalize_prompt("What is the capital of France.") == normalize_prompt("What is the capital of France")
    assert normalize_prompt("Cafe\u0301") == normalize_prompt("Caf\u00e9")  # NFC: one character either way
    different = [
        ("Is this balanced: (()", "Is this balanced: (())"),
        ('Fix this JSON: {"a": [1, 2]}', 'Fix this JSON: {"a": [1, 2]'),
        ("def f():\n    return 1", "def f():\n  return 1"),
        ("a  b", "a b"),
        ("What is US", "What is us"),
        ("C++?", "C"),
        ("Why?!", "Why"),
        ('Say "hi"', "Say hi"),
        ("x\u00b2", "x2"),  # NFKC would fold the superscript: not done
    ]
    for a, b in different:
        assert normalize_prompt(a) != normalize_prompt(b), (a, b)


def test_the_embedding_text_folds_what_the_uncased_embedder_ignores() -> None:
    assert embedding_text("  What   is\tthe CAPITAL of France?!  ") == "what is the capital of france"


def _scope(**fields: object) -> cache_pb2.CacheScope:
    sampling = fields.pop("sampling", None)
    scope = cache_pb2.CacheScope(**{"model": "m", **fields})  # type: ignore[arg-type]
    if sampling is not None:
        scope.sampling.CopyFrom(sampling)  # type: ignore[arg-type]
    return scope


def _key(prompt: str = "q", **fields: object) -> str:
    return entry_key(normalize_prompt(prompt), Scope.of(_scope(**fields)))


def S(**kw: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)  # type: ignore[arg-type]


def test_every_scope_field_changes_the_key() -> None:
    base = _key()
    assert _key("q?") == base
    variants = [
        _key("Q"),
        _key("other"),
        _key(model="other"),
        _key(tenant="t2"),
        _key(collection="kb"),
        _key(collection="kb", collection_version=1),
        _key(collection="kb", retrieval_top_k=3),
        _key(collection="kb", retrieval_min_score=0.3),
        _key(shape=b"\x12\x05hello"),
        _key(sampling=S(max_new_tokens=10)),
        _key(sampling=S(temperature=0.7)),
        _key(sampling=S(stop=["\n"])),
        _key(sampling=S(ignore_eos=True)),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_a_field_the_cache_does_not_know_still_changes_the_key() -> None:
    # A newer caller's field (here: an unknown field 99 in the sampling message) is not ignored.
    plain = _scope(sampling=S(max_new_tokens=4))
    extended = cache_pb2.CacheScope()
    extended.MergeFromString(plain.SerializeToString() + b"\x2a\x03\x98\x06\x01")  # sampling: field 99 = 1
    assert extended.sampling.max_new_tokens == 4  # the known fields as they were, field 99 kept unknown
    assert Scope.of(plain).raw != Scope.of(extended).raw
    assert entry_key("q", Scope.of(plain)) != entry_key("q", Scope.of(extended))


def test_greedy_ignores_top_p_and_seed_but_sampling_does_not() -> None:
    assert _key(sampling=S(top_p=0.5, seed=3)) == _key(sampling=S())
    sampled = S(temperature=0.7, top_p=0.9, seed=1)
    assert _key(sampling=sampled) != _key(sampling=S(temperature=0.7, top_p=0.9, seed=2))
    assert _key(sampling=sampled) != _key(sampling=S(temperature=0.7, top_p=0.9))
    assert _key(sampling=sampled) != _key(sampling=S(temperature=0.8, top_p=0.9, seed=1))
    assert _key(sampling=S(temperature=1.0, top_p=0.0)) == _key(sampling=S(temperature=1.0, top_p=1.0))
    assert _key(sampling=S(stop=["a", "b"])) == _key(sampling=S(stop=["b", "a", "a"]))


def test_an_answer_without_context_has_no_retrieval_settings() -> None:
    assert canonical_scope(_scope(collection_version=3, retrieval_top_k=4)) == canonical_scope(_scope())
    assert _key(collection_version=3, retrieval_top_k=4) == _key()
