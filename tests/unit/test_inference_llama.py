"""The own Llama forward (engine/llama.py) against transformers' forward, in float32: a fresh
prefill of rows of different lengths, then decode steps with a hole among the slots (a padding
row), two steps (the second reads the KV columns the first wrote), and a chunked prefill, on
the tiny random-weight model and on SmolLM2-135M."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmesh.models import verify
from services.inference.engine import LoadedModel
from services.inference.engine.llama import LlamaDecoder, supported
from services.inference.engine.runner import ModelRunner

TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog.", "Tell me about the sea " * 4]
SLOTS = [0, 1, 3]  # slot 2 is a hole: a padding row in every step


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def loaded(request: pytest.FixtureRequest, tiny_model: Path, models_dir: Path) -> LoadedModel:
    path = tiny_model if request.param == "tiny" else models_dir / "smollm2" / "v1"
    return LoadedModel(verify(path), "cpu", "float32")


def full_forward(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Plain transformers, the whole sequence, no cache: the last position's logits."""
    return loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]


def test_decode_logits_equal_the_transformers_forward(loaded: LoadedModel) -> None:
    assert supported(loaded.model, torch.device("cpu")) is None
    runner = ModelRunner(loaded, 4, 96, (1, 2, 4), cuda_graphs=False)
    assert isinstance(runner.fast, LlamaDecoder) and not runner.fast.pack  # float32: plain matmuls
    prompts = [loaded.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    with torch.inference_mode():
        prefilled = runner.prefill_fresh(SLOTS, prompts, loaded.pad_id)
        for row, prompt in enumerate(prompts):  # right-padded together, causal
            torch.testing.assert_close(prefilled[row], full_forward(loaded, prompt), atol=2e-4, rtol=1e-4)
        first = prefilled.argmax(-1).tolist()
        seqs = [[*p, t] for p, t in zip(prompts, first, strict=True)]
        for _ in range(2):
            rows = [(slot, seq[-1], len(seq) - 1) for slot, seq in zip(SLOTS, seqs, strict=True)]
            logits, top = runner.step_logits(rows)
            assert top == 4 and logits.shape == (4, loaded.vocab_size)
            for slot, seq in zip(SLOTS, seqs, strict=True):
                torch.testing.assert_close(logits[slot], full_forward(loaded, seq), atol=2e-4, rtol=1e-4)
            # The same step through transformers' forward over the same slots: the same numbers.
            fast, runner.fast = runner.fast, None
            try:
                reference, _ = runner.step_logits(rows)
            finally:
                runner.fast = fast
            torch.testing.assert_close(logits[SLOTS], reference[SLOTS], atol=2e-5, rtol=1e-5)
            for slot, seq in zip(SLOTS, seqs, strict=True):
                seq.append(int(logits[slot].argmax()))


def test_chunked_prefill_equals_the_transformers_forward(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, 2, 96, (1, 2), cuda_graphs=False)
    assert runner.fast is not None
    ids = loaded.encode(TEXTS[2] + TEXTS[1])
    with torch.inference_mode():
        runner.prefill_fresh([0], [ids[:1]], loaded.pad_id)  # slot 0 busy beside
        for start, end in ((0, 7), (7, 20), (20, len(ids))):
            logits = runner.prefill_chunk(1, ids[start:end], start)
            torch.testing.assert_close(logits[0], full_forward(loaded, ids[:end]), atol=2e-4, rtol=1e-4)


def test_the_transformers_prefill_keeps_its_weights(loaded: LoadedModel) -> None:
    """float32 (no packing): the fused q/k/v and gate/up weights are the HF modules' weights
    (views, one copy)."""
    layer = loaded.model.model.layers[0]
    before = full_forward(loaded, loaded.encode(TEXTS[1]))
    runner = ModelRunner(loaded, 2, 64, (1, 2), cuda_graphs=False)
    assert runner.fast is not None
    _, qkv, _, _, gate_up, _ = runner.fast.layers[0]
    assert layer.self_attn.q_proj.weight.untyped_storage().data_ptr() == qkv.weight.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(full_forward(loaded, loaded.encode(TEXTS[1])), before, atol=0, rtol=0)


def test_packed_bfloat16_follows_float32(tiny_model: Path) -> None:
    """bf16 with oneDNN-prepacked weights (where the CPU has them): the same greedy tokens as
    the plain bf16 matmuls on the same slots, and logits close to them."""
    loaded = LoadedModel(verify(tiny_model), "cpu", "bfloat16")
    runner = ModelRunner(loaded, 4, 64, (1, 2, 4), cuda_graphs=False)
    assert runner.fast is not None
    plain = LlamaDecoder(loaded.model, runner.kv, 4, pack=False)
    prompts = [loaded.encode(t) for t in TEXTS]
    with torch.inference_mode():
        first = runner.prefill_fresh(SLOTS, prompts, loaded.pad_id).argmax(-1).tolist()
        rows = [(slot, t, len(p)) for slot, t, p in zip(SLOTS, first, prompts, strict=True)]
        packed_logits, _ = runner.step_logits(rows)
        runner.fast = plain
        plain_logits, _ = runner.step_logits(rows)
    torch.testing.assert_close(packed_logits[SLOTS].float(), plain_logits[SLOTS].float(), atol=0.1, rtol=0.05)
