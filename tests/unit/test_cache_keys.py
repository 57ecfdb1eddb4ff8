"""Cache keys: normalization and what is (and is not) part of the scope."""

from __future__ import annotations

from services.cache.keys import Sampling, Scope, entry_key, normalize_prompt


def test_normalization_is_nfkc_casefolded_collapsed_and_strips_trailing_punctuation() -> None:
    assert normalize_prompt("  What   is\tthe CAPITAL of France?!  ") == "what is the capital of france"
    assert normalize_prompt("\uff28\uff25\uff2c\uff2c\uff2f  Stra\u00dfe\u2026") == "hello strasse"
    assert normalize_prompt("C++?") == "c++"  # symbols are not punctuation
    assert normalize_prompt("Why? Because.") == "why? because"  # only trailing punctuation goes


def _key(prompt: str = "q", **scope: object) -> str:
    return entry_key(normalize_prompt(prompt), Scope(**{"model": "m", **scope}))  # type: ignore[arg-type]


def test_every_scope_field_changes_the_key() -> None:
    base = _key()
    assert _key("Q?") == base
    variants = [
        _key("other"),
        _key(model="other"),
        _key(tenant="t2"),
        _key(collection="kb"),
        _key(collection="kb", collection_version=1),
        _key(sampling=Sampling(max_new_tokens=10)),
        _key(sampling=Sampling(temperature=0.7)),
        _key(sampling=Sampling(stop=("\n",))),
        _key(sampling=Sampling(ignore_eos=True)),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_greedy_ignores_top_p_and_seed_but_sampling_does_not() -> None:
    assert _key(sampling=Sampling(top_p=0.5, seed=3)) == _key(sampling=Sampling())
    sampled = Sampling(temperature=0.7, top_p=0.9, seed=1)
    assert _key(sampling=sampled) != _key(sampling=Sampling(temperature=0.7, top_p=0.9, seed=2))
    assert _key(sampling=sampled) != _key(sampling=Sampling(temperature=0.7, top_p=0.9))
    assert _key(sampling=sampled) != _key(sampling=Sampling(temperature=0.8, top_p=0.9, seed=1))
    # float32 round trips and equivalent spellings give one key
    assert _key(sampling=Sampling(temperature=0.699999988079071)) == _key(sampling=Sampling(temperature=0.7))
    assert _key(sampling=Sampling(temperature=1.0, top_p=0.0)) == _key(sampling=Sampling(temperature=1.0, top_p=1.0))
    assert _key(sampling=Sampling(stop=("a", "b"))) == _key(sampling=Sampling(stop=("b", "a", "a")))
