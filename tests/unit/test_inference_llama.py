"""The own Llama forward (engine/llama.py) against transformers' forward, in float32: a fresh
prefill of rows of different lengths, then decode steps with a padding row (3 rows in a bucket
of 4), two steps (the second reads the KV the first wrote), and a chunked prefill, over
interleaved KV blocks, on the tiny random-weight model and on SmolLM2-135M."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmesh.models import verify
from services.inference.engine import LoadedModel
from services.inference.engine.kv_manager import BlockManager
from services.inference.engine.llama import LlamaDecoder, supported
from services.inference.engine.runner import ModelRunner

TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog.", "Tell me about the sea " * 4]
BLOCK = 4  # small blocks: every row spans several, interleaved with the others'


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def loaded(request: pytest.FixtureRequest, tiny_model: Path, models_dir: Path) -> LoadedModel:
    path = tiny_model if request.param == "tiny" else models_dir / "smollm2" / "v1"
    return LoadedModel(verify(path), "cpu", "float32")


def full_forward(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Plain transformers, the whole sequence, no cache: the last position's logits."""
    return loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]


def interleaved_tables(runner: ModelRunner, rows: int, tokens: int) -> list[list[int]]:
    """Block tables for `rows` sequences of up to `tokens` tokens, taken turn by turn from the
    pool, so neighbouring blocks belong to different rows."""
    kv = BlockManager(runner.kv.num_blocks, runner.block_tokens, prefix_caching=False)
    tables = [kv.allocate([0]) for _ in range(rows)]
    for _ in range(-(-tokens // runner.block_tokens) - 1):
        for t in tables:
            assert t is not None and kv.grow(t, len(t.blocks) * runner.block_tokens + 1)
    return [t.blocks for t in tables if t is not None]


def test_decode_logits_equal_the_transformers_forward(loaded: LoadedModel) -> None:
    assert supported(loaded.model, torch.device("cpu")) is None
    runner = ModelRunner(loaded, 80, BLOCK, 96, (1, 2, 4), cuda_graphs=False)
    assert isinstance(runner.fast, LlamaDecoder) and not runner.fast.pack  # float32: plain matmuls
    prompts = [loaded.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    tables = interleaved_tables(runner, len(prompts), 64)
    with torch.inference_mode():
        prefilled = runner.prefill([(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        for row, prompt in enumerate(prompts):  # right-padded together, causal
            torch.testing.assert_close(prefilled[row], full_forward(loaded, prompt), atol=2e-4, rtol=1e-4)
        first = prefilled.argmax(-1).tolist()
        seqs = [[*p, t] for p, t in zip(prompts, first, strict=True)]
        for _ in range(2):
            rows = [(seq[-1], len(seq) - 1, t) for seq, t in zip(seqs, tables, strict=True)]
            logits = runner.step_logits(rows)
            assert logits.shape == (4, loaded.vocab_size)  # bucket 4: one padding row
            for row, seq in enumerate(seqs):
                torch.testing.assert_close(logits[row], full_forward(loaded, seq), atol=2e-4, rtol=1e-4)
            # The same step through transformers' forward over the same blocks: the same numbers.
            fast, runner.fast = runner.fast, None
            try:
                reference = runner.step_logits(rows)
            finally:
                runner.fast = fast
            torch.testing.assert_close(logits[:3], reference[:3], atol=2e-5, rtol=1e-5)
            for row, seq in enumerate(seqs):
                seq.append(int(logits[row].argmax()))


def test_chunked_prefill_equals_the_transformers_forward(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, 80, BLOCK, 96, (1, 2), cuda_graphs=False)
    assert runner.fast is not None
    ids = loaded.encode(TEXTS[2] + TEXTS[1])
    busy, table = interleaved_tables(runner, 2, len(ids))
    with torch.inference_mode():
        runner.prefill([(ids[:1], 0, busy)])  # another row's blocks beside
        for start, end in ((0, 7), (7, 20), (20, len(ids))):
            logits = runner.prefill([(ids[start:end], start, table)])
            torch.testing.assert_close(logits[0], full_forward(loaded, ids[:end]), atol=2e-4, rtol=1e-4)


def test_the_transformers_prefill_keeps_its_weights(loaded: LoadedModel) -> None:
    """float32 (no packing): the fused q/k/v and gate/up weights are the HF modules' weights
    (views, one copy)."""
    layer = loaded.model.model.layers[0]
    before = full_forward(loaded, loaded.encode(TEXTS[1]))
    runner = ModelRunner(loaded, 16, BLOCK, 64, (1, 2), cuda_graphs=False)
    assert runner.fast is not None
    _, qkv, _, _, gate_up, _ = runner.fast.layers[0]
    assert layer.self_attn.q_proj.weight.untyped_storage().data_ptr() == qkv.weight.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(full_forward(loaded, loaded.encode(TEXTS[1])), before, atol=0, rtol=0)


def test_packed_bfloat16_follows_float32(tiny_model: Path) -> None:
    """bf16 with oneDNN-prepacked weights (where the CPU has them): the same greedy tokens as
    the plain bf16 matmuls on the same blocks, and logits close to them."""
    loaded = LoadedModel(verify(tiny_model), "cpu", "bfloat16")
    runner = ModelRunner(loaded, 80, BLOCK, 64, (1, 2, 4), cuda_graphs=False)
    assert runner.fast is not None
    plain = LlamaDecoder(loaded.model, runner.kv, 4, 64, pack=False)
    prompts = [loaded.encode(t) for t in TEXTS]
    tables = interleaved_tables(runner, len(prompts), 48)
    with torch.inference_mode():
        first = runner.prefill([(p, 0, t) for p, t in zip(prompts, tables, strict=True)]).argmax(-1).tolist()
        rows = [(t, len(p), table) for t, p, table in zip(first, prompts, tables, strict=True)]
        packed_logits = runner.step_logits(rows)
        runner.fast = plain
        plain_logits = runner.step_logits(rows)
    torch.testing.assert_close(packed_logits[:3].float(), plain_logits[:3].float(), atol=0.1, rtol=0.05)
