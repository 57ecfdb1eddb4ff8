"""KV slots and the model runner on the tiny real model: chunked prefill, holes and bucket
padding in the decode step give the same logits as the plain path, in fp32 and bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmesh.models import verify
from services.inference.engine import LoadedModel
from services.inference.engine.runner import ModelRunner

NO_SAMPLING: tuple[list[int], list[float], list[float], list[int], list[int]] = ([], [], [], [], [])


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return LoadedModel(verify(tiny_model), "cpu")


@pytest.fixture(scope="module")
def loaded_bf16(tiny_model: Path) -> LoadedModel:
    model = LoadedModel(verify(tiny_model), "cpu")
    model.model.to(torch.bfloat16)
    model.dtype = torch.bfloat16
    return model


def reference_greedy(loaded: LoadedModel, prompt: list[int], steps: int) -> list[int]:
    """Plain transformers: full forward over the whole sequence each step, no cache at all."""
    ids = list(prompt)
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
    return out


def prompts(loaded: LoadedModel) -> list[list[int]]:
    texts = ["Hi", "The quick brown fox jumps over the lazy dog.", "Tell me about the sea " * 4, "é 🌍 ok?"]
    return [loaded.encode(t) for t in texts]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_slots_with_holes_and_padding_follow_the_reference(
    loaded: LoadedModel, loaded_bf16: LoadedModel, dtype: str
) -> None:
    model = loaded if dtype == "fp32" else loaded_bf16
    ps = prompts(model)
    steps = 8
    expected = [reference_greedy(model, p, steps) for p in ps]
    # 8 slots, buckets 1/2/4/8; the prompts sit in slots 1, 3, 4, 6 (holes in between, so
    # every step runs padding rows), prefilled together.
    runner = ModelRunner(model, 8, 64, (1, 2, 4, 8), cuda_graphs=False)
    slots = [1, 3, 4, 6]
    with torch.inference_mode():
        first = torch.argmax(runner.prefill_fresh(slots, ps, model.pad_id), dim=-1).tolist()
        got = [[t] for t in first]
        lengths = [len(p) for p in ps]
        for _ in range(steps - 1):
            rows = [(s, g[-1], n) for s, g, n in zip(slots, got, lengths, strict=True)]
            tokens = runner.decode(rows, NO_SAMPLING)
            assert len(tokens) == max(slots) + 1
            for i, s in enumerate(slots):
                got[i].append(tokens[s])
                lengths[i] += 1
    if dtype == "fp32":
        assert got == expected
    else:  # bf16 rounding differs between a cached and an uncached forward: the start must agree
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        assert all(0 <= t < model.vocab_size for g in got for t in g)


def test_chunked_prefill_writes_the_same_cache_as_a_whole_prefill(loaded: LoadedModel) -> None:
    prompt = loaded.encode("Tell me about the sea, the sky and everything in between, " * 3)
    assert len(prompt) > 34
    whole = ModelRunner(loaded, 2, 128, (1, 2), cuda_graphs=False)
    chunked = ModelRunner(loaded, 2, 128, (1, 2), cuda_graphs=False)
    with torch.inference_mode():
        expected = whole.prefill_fresh([1], [prompt], loaded.pad_id)[0]
        for start in range(0, len(prompt), 17):
            logits = chunked.prefill_chunk(1, prompt[start : start + 17], start)[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    n = len(prompt)
    for a, b in zip(whole.kv.keys + whole.kv.values, chunked.kv.keys + chunked.kv.values, strict=True):
        torch.testing.assert_close(a[1, :, :n], b[1, :, :n], rtol=1e-4, atol=1e-5)


def test_padding_rows_never_write_a_column_a_sequence_reads(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, 4, 32, (4,), cuda_graphs=False)
    prompt = loaded.encode("Hello there")
    with torch.inference_mode():
        runner.prefill_fresh([0, 2], [prompt, prompt], loaded.pad_id)
        before = [k[2].clone() for k in runner.kv.keys]
        # Slot 2 is still "prefilling" (not in the step): it is a padding row of bucket 4.
        runner.decode([(0, 5, len(prompt))], NO_SAMPLING)
    for k, old in zip(runner.kv.keys, before, strict=True):
        torch.testing.assert_close(k[2, :, : runner.kv.scratch], old[:, : runner.kv.scratch])
