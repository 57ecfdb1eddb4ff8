"""KV blocks and the model runner on the tiny real model: rows whose blocks interleave in the
pool, chunked prefill, a prefill continuing a cached prefix and bucket padding in the decode
step give the same logits as the plain path, in fp32 and bf16; stale and NaN contents of
reused blocks are never read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmesh.models import verify
from services.inference.engine import LoadedModel
from services.inference.engine.kv_manager import NULL_BLOCK, BlockManager
from services.inference.engine.runner import ModelRunner

NO_SAMPLING: tuple[list[int], list[float], list[float], list[int], list[int]] = ([], [], [], [], [])
BLOCK = 4


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


def interleaved_tables(runner: ModelRunner, rows: int, tokens: int) -> list[list[int]]:
    kv = BlockManager(runner.kv.num_blocks, runner.block_tokens, prefix_caching=False)
    tables = [kv.allocate([0]) for _ in range(rows)]
    for _ in range(-(-tokens // runner.block_tokens) - 1):
        for t in tables:
            assert t is not None and kv.grow(t, len(t.blocks) * runner.block_tokens + 1)
    return [t.blocks for t in tables if t is not None]


def greedy_run(runner: ModelRunner, ps: list[list[int]], tables: list[list[int]], steps: int) -> list[list[int]]:
    with torch.inference_mode():
        first = runner.prefill([(p, 0, t) for p, t in zip(ps, tables, strict=True)]).argmax(-1).tolist()
        got = [[t] for t in first]
        lengths = [len(p) for p in ps]
        for _ in range(steps - 1):
            rows = [(g[-1], n, t) for g, n, t in zip(got, lengths, tables, strict=True)]
            tokens = runner.decode(rows, NO_SAMPLING)
            assert len(tokens) == len(rows)
            for i, token in enumerate(tokens):
                got[i].append(token)
                lengths[i] += 1
    return got


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_interleaved_blocks_and_padding_follow_the_reference(
    loaded: LoadedModel, loaded_bf16: LoadedModel, dtype: str
) -> None:
    model = loaded if dtype == "fp32" else loaded_bf16
    ps = prompts(model)
    steps = 8
    expected = [reference_greedy(model, p, steps) for p in ps]
    # Buckets 1/2/8: 4 rows run in a bucket of 8 (4 padding rows every step).
    runner = ModelRunner(model, 64, BLOCK, 64, (1, 2, 8), cuda_graphs=False)
    got = greedy_run(runner, ps, interleaved_tables(runner, 4, 48), steps)
    if dtype == "fp32":
        assert got == expected
    else:  # bf16 rounding differs between a cached and an uncached forward: the start must agree
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        assert all(0 <= t < model.vocab_size for g in got for t in g)


def test_chunked_and_cached_prefills_write_the_same_blocks_as_a_whole_prefill(loaded: LoadedModel) -> None:
    prompt = loaded.encode("Tell me about the sea, the sky and everything in between, " * 3)
    assert len(prompt) > 34
    whole = ModelRunner(loaded, 64, BLOCK, 128, (1, 2), cuda_graphs=False)
    chunked = ModelRunner(loaded, 64, BLOCK, 128, (1, 2), cuda_graphs=False)
    (table,) = interleaved_tables(whole, 1, len(prompt))
    with torch.inference_mode():
        expected = whole.prefill([(prompt, 0, table)])[0]
        for start in range(0, len(prompt), 17):
            logits = chunked.prefill([(prompt[start : start + 17], start, table)])[0]
        # A prompt continuing a cached prefix of 5 blocks: only the rest is computed.
        cached = 5 * BLOCK
        continued = whole.prefill([(prompt[cached:], cached, table)])[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(continued, expected, rtol=1e-4, atol=1e-4)
    n = len(prompt)
    for layer in range(len(whole.kv.keys)):
        for i in range(-(-n // BLOCK)):
            used = min(BLOCK, n - i * BLOCK)
            for a, b in zip(whole.kv.block(layer, table[i]), chunked.kv.block(layer, table[i]), strict=True):
                torch.testing.assert_close(a[:used], b[:used], rtol=1e-4, atol=1e-5)


def test_padding_rows_write_only_the_scratch_token(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, 32, BLOCK, 32, (4,), cuda_graphs=False)
    prompt = loaded.encode("Hello there")
    a, b = interleaved_tables(runner, 2, 16)
    for buf in runner.kv.keys:
        buf.zero_()  # the CPU pool starts uninitialised (NaN != NaN would read as a write)
    with torch.inference_mode():
        runner.prefill([(prompt, 0, a), (prompt, 0, b)])
        before = [k.clone() for k in runner.kv.keys]
        # One row in a bucket of 4: three padding rows.
        runner.decode([(5, len(prompt), a)], NO_SAMPLING)
    written = a[len(prompt) // BLOCK] * BLOCK + len(prompt) % BLOCK
    for k, old in zip(runner.kv.keys, before, strict=True):
        changed = (k != old).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert set(changed) <= {written, runner.kv.scratch}
        assert not k[NULL_BLOCK * BLOCK].any()  # what masked columns read stays zero


def test_nan_left_in_reused_blocks_is_never_read(loaded: LoadedModel) -> None:
    # A block's earlier owner may leave anything in it (NaN from an overflowing forward): a
    # masked column multiplied by a zero weight is still NaN, so it must not be read at all.
    ps = prompts(loaded)
    runner = ModelRunner(loaded, 64, BLOCK, 64, (1, 2, 4), cuda_graphs=False)
    tables = interleaved_tables(runner, 4, 48)
    clean = greedy_run(runner, ps, tables, 6)
    for buf in (*runner.kv.keys, *runner.kv.values):
        buf[BLOCK:].fill_(float("nan"))  # every block but the null block
    assert greedy_run(runner, ps, tables, 6) == clean


def test_a_mixed_step_equals_a_decode_step_and_its_prompts_apart(loaded: LoadedModel) -> None:
    """Decode rows, a long prompt's next chunk and a whole fresh prompt in one forward give the
    logits and write the keys that the decode step and each prefill give apart."""
    ps = prompts(loaded)
    long_prompt = loaded.encode("Tell me about the sea, the sky and everything in between, " * 3)
    fresh = loaded.encode("What is a prime number?")
    apart = ModelRunner(loaded, 160, BLOCK, 96, (1, 2, 4), cuda_graphs=False)
    mixed = ModelRunner(loaded, 160, BLOCK, 96, (1, 2, 4), cuda_graphs=False)
    assert mixed.can_mix
    tables = interleaved_tables(apart, 6, 64)
    rows_tables, chunk_table, fresh_table = tables[:4], tables[4], tables[5]
    with torch.inference_mode():
        for runner in (apart, mixed):
            runner.prefill([(p, 0, t) for p, t in zip(ps, rows_tables, strict=True)])
            runner.prefill([(long_prompt[:20], 0, chunk_table)])
        rows = [(5 + i, len(p), t) for i, (p, t) in enumerate(zip(ps, rows_tables, strict=True))]
        chunks = [(long_prompt[20:37], 20, chunk_table), (fresh, 0, fresh_table)]
        decode_expected = apart.step_logits(rows)[:4]
        chunk_expected = torch.cat([apart.prefill([chunk]) for chunk in chunks])
        decode_got, chunk_got = mixed.mixed(rows, chunks)
        # Prompts alone (no row decoding) mix too.
        alone = ModelRunner(loaded, 160, BLOCK, 96, (1, 2, 4), cuda_graphs=False)
        _, alone_got = alone.mixed([], [(fresh, 0, fresh_table)])
    torch.testing.assert_close(decode_got, decode_expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunk_got, chunk_expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alone_got, chunk_expected[1:], rtol=1e-4, atol=1e-4)
    written = [len(p) + 1 for p in ps] + [37, len(fresh)]
    for a, b in zip(apart.kv.keys, mixed.kv.keys, strict=True):  # the same tokens written
        for t, n in zip([*rows_tables, chunk_table, fresh_table], written, strict=True):
            rows_of = torch.tensor([block * BLOCK + i for block in t for i in range(BLOCK)][:n])
            torch.testing.assert_close(a[rows_of], b[rows_of], rtol=1e-4, atol=1e-5)
