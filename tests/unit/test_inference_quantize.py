"""Quantized weights in the engine's own Llama forward (int8 and int4), the fused float32 path's
greedy tokens against transformers' unfused forward, and the quality guard's refusal of a
quantization that drifts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from llmesh.models import verify
from llmesh.testing import build_tiny_model
from services.inference.engine import LoadedModel, quality
from services.inference.engine.llama import LlamaDecoder
from services.inference.engine.quality import QualityError
from services.inference.engine.quantize import (
    QUANT_MAX_ROWS,
    QuantizedLinear,
    QuantizedWeight,
    auto_quantization,
    source_bits,
)
from services.inference.engine.runner import ModelRunner

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog.", "Tell me about the sea " * 3]
BLOCK = 4


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return build_tiny_model(tmp_path, name="tiny", version="v1", seed=5)


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of every prompt: one prefill of all rows, then `steps` decode steps."""
    per_row = runner.kv.num_blocks // len(prompts)
    tables = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(len(prompts))]
    with torch.inference_mode():
        first = runner.prefill([(p, 0, t) for p, t in zip(prompts, tables, strict=True)]).argmax(-1).tolist()
        seqs = [[*p, t] for p, t in zip(prompts, first, strict=True)]
        for _ in range(steps):
            rows = [(s[-1], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
            logits = runner.step_logits(rows)
            for row, seq in enumerate(seqs):
                seq.append(int(logits[row].argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_fused_float32_tokens_are_bit_identical_to_the_unfused_forward(
    model: str, tiny: Path, models_dir: Path
) -> None:
    """The own forward (fused q/k/v and gate/up, LM head over the decode rows only) chooses
    exactly the tokens transformers' forward (separate projections) chooses, in float32."""
    path = tiny if model == "tiny" else models_dir / "smollm2" / "v1"
    loaded = LoadedModel(verify(path), "cpu", "float32")
    prompts = [loaded.encode(t) for t in PROMPTS]
    own = ModelRunner(loaded, 3 * 12 + 1, BLOCK, 48, (1, 2, 4), cuda_graphs=False)
    assert own.fast is not None
    plain = ModelRunner(loaded, 3 * 12 + 1, BLOCK, 48, (1, 2, 4), cuda_graphs=False, fast_decode=False)
    assert plain.fast is None
    assert greedy(own, prompts, 12) == greedy(plain, prompts, 12)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weight_matches_its_dequantized_matmul(method: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    quantized = QuantizedWeight(weight, method)
    x = torch.randn(3, 128)
    y = quantized(x)
    assert y.dtype == torch.float32 and y.shape == (3, 96)
    # Within the rounding of the weights (int8: 1/254 of a row's range; int4: 1/30 of a group's).
    exact = x @ weight.T
    error = (y - exact).abs().max() / exact.abs().max()
    assert error < (0.03 if method == "int8" else 0.12), error
    assert quantized.nbytes < weight.numel() * (1.1 if method == "int8" else 0.65)


def test_int4_recovers_four_bit_groups_exactly() -> None:
    """Weights that are already 4-bit groups of 32 (as SmolLM2's, from its Q4_1 GGUF) come back
    as the same values: int4 serves the shipped file's numbers, not a second rounding."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (64, 128)).float()
    q[:, ::32] = 0.0  # every group reaches its min and max, as Q4_1's quantizer makes them
    q[:, 1::32] = 15.0
    step = torch.rand(64, 4).repeat_interleave(32, 1) * 0.01 + 0.001
    low = torch.randn(64, 4).repeat_interleave(32, 1) * 0.05
    weight = q * step + low
    x = torch.eye(128)
    recovered = QuantizedWeight(weight, "int4")(x).T  # [64, 128]: the weight as the kernel sees it
    # bf16 arithmetic in the kernel: the recovered values within bf16's rounding of the weight.
    torch.testing.assert_close(recovered, weight, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_models_run_the_own_forward_and_agree_with_bf16(method: str, tiny: Path) -> None:
    """No transformers fallback: the own forward serves the quantized model, one stream's calls
    go through the quantized kernel, batched ones through the served dtype's matmul, and the
    logits follow plain bfloat16's."""
    plain = LoadedModel(verify(tiny), "cpu", "bfloat16")
    loaded = LoadedModel(verify(tiny), "cpu", "bfloat16", method)
    assert loaded.dtype_name == f"bfloat16+{method}"
    assert loaded.quality is not None and loaded.quality.passes, loaded.quality
    runner = ModelRunner(loaded, 3 * 12 + 1, BLOCK, 48, (1, 2, 4), cuda_graphs=False)
    assert isinstance(runner.fast, LlamaDecoder) and runner.fast.quantize == method
    assert runner.fast.quant_max_rows == QUANT_MAX_ROWS[method]
    _, qkv, _, _, _, _ = runner.fast.layers[0]
    assert qkv.quantized is not None and qkv.quantized.method == method
    reference = ModelRunner(plain, 3 * 12 + 1, BLOCK, 48, (1, 2, 4), cuda_graphs=False)
    prompts = [loaded.encode(t) for t in PROMPTS]
    tables = [[1, 2, 3, 4, 5]]
    with torch.inference_mode():
        quantized = runner.prefill([(prompts[1], 0, tables[0])]).float()
        expected = reference.prefill([(prompts[1], 0, tables[0])]).float()
        row = [(int(expected.argmax()), len(prompts[1]), tables[0])]
        step = runner.step_logits(row)[:1].float()
        plain_step = reference.step_logits(row)[:1].float()
    bound = 0.99 if method == "int8" else 0.95
    for got, want in ((quantized, expected), (step, plain_step)):
        assert not torch.equal(got, want)  # one row's calls did go through the quantized kernel
        cosine = torch.nn.functional.cosine_similarity(got, want).item()
        assert cosine > bound, cosine


def test_the_guard_measures_quantized_arithmetic_through_the_own_forward(tiny: Path) -> None:
    seen: list[float] = []
    real = LlamaDecoder.__init__

    def recording(self: LlamaDecoder, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        seen.append(self.quant_max_rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaDecoder, "__init__", recording)
        loaded = LoadedModel(verify(tiny), "cpu", "bfloat16", "int8")
    assert loaded.quality is not None and 0.0 < loaded.quality.agreement <= 1.0
    # The float32 reference (no quantization), then the int8 model with every call quantized.
    assert seen[-1] == math.inf


def test_the_guard_refuses_a_quantization_that_drifts(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = QuantizedWeight.__init__

    def drifting(self: QuantizedWeight, weight: torch.Tensor, method: str) -> None:
        real(self, weight, method)
        self.scales = self.scales * 3.0  # a broken scale, as a wrong kernel convention would give

    monkeypatch.setattr(QuantizedWeight, "__init__", drifting)
    with pytest.raises(QualityError, match=r"refusing bfloat16 with int4 weights on cpu: .* LLMESH_QUANTIZE=int4"):
        LoadedModel(verify(tiny), "cpu", "bfloat16", "int4")
    check = quality.stored(tiny, "cpu/bfloat16/int4", verify(tiny).digest)
    assert check is not None and not check.passes


def test_quantize_model_replaces_every_linear(tiny: Path) -> None:
    model = quality.load_weights(verify(tiny), torch.device("cpu"), torch.bfloat16)
    quality.convert(model, torch.bfloat16, "int4")
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert layers and all(isinstance(m, QuantizedLinear) for m in layers)
    # The LM head in int8 (an embedding above 4 bits in GGUF files), every projection in int4.
    assert [m.method for m in layers if m is not model.get_output_embeddings()] == ["int4"] * (len(layers) - 1)
    assert model.get_output_embeddings().method == "int8"


def four_bit_source(path: Path) -> Path:
    """Marks a model's manifest as converted from a Q4_1 GGUF (as `llmesh models prepare` marks
    SmolLM2's): only the manifest's source changes, so the files still verify."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["source"] = {"file": "model.Q4_1.gguf", "conversion": "gguf Q4_1 -> float32"}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize(
    ("conversion", "bits"),
    [("gguf Q4_1 -> float32", 4), ("gguf Q4_K -> float32", 4), ("gguf IQ4_XS -> float32", 4), ("gguf Q8_0 -> f32", 8)],
)
def test_source_bits_reads_the_manifests_conversion(conversion: str, bits: int) -> None:
    assert source_bits({"source": {"conversion": conversion}}) == bits


def test_auto_quantizes_only_weights_shipped_in_four_bits() -> None:
    cpu = torch.device("cpu")
    assert auto_quantization({"source": {"conversion": "gguf Q4_1 -> float32"}}, cpu) == "int4"
    assert auto_quantization({"source": {"conversion": "gguf Q8_0 -> float32"}}, cpu) == "none"
    assert auto_quantization({"source": {"generator": "llmesh.testing"}}, cpu) == "none"
    assert auto_quantization({}, cpu) == "none"
    assert auto_quantization({"source": {"conversion": "gguf Q4_1 -> float32"}}, torch.device("meta")) == "none"


def test_auto_serves_int4_for_a_four_bit_source_and_plain_weights_otherwise(tiny: Path, tmp_path: Path) -> None:
    plain = LoadedModel(verify(tiny), "cpu", "bfloat16", "auto")
    assert (plain.quantize, plain.dtype_name) == ("none", "bfloat16")
    shipped = four_bit_source(build_tiny_model(tmp_path / "q4", name="tiny", version="v1", seed=5))
    quantized = LoadedModel(verify(shipped), "cpu", "bfloat16", "auto")
    assert (quantized.quantize, quantized.dtype_name) == ("int4", "bfloat16+int4")
    assert quantized.quality is not None and quantized.quality.quantize == "int4" and quantized.quality.passes
    runner = ModelRunner(quantized, 13, BLOCK, 48, (1,), cuda_graphs=False)
    assert runner.fast is not None and runner.fast.quantize == "int4"


def test_auto_drops_a_quantization_the_guard_refuses_and_still_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = QuantizedWeight.__init__

    def drifting(self: QuantizedWeight, weight: torch.Tensor, method: str) -> None:
        real(self, weight, method)
        self.scales = self.scales * 3.0

    monkeypatch.setattr(QuantizedWeight, "__init__", drifting)
    shipped = four_bit_source(build_tiny_model(tmp_path, name="tiny", version="v1", seed=5))
    with caplog.at_level("WARNING", logger="llmesh.inference.quality"):
        loaded = LoadedModel(verify(shipped), "cpu", "bfloat16", "auto")
    assert (loaded.quantize, loaded.dtype_name) == ("none", "bfloat16")
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    assert "LLMESH_QUANTIZE=auto serves it unquantized" in caplog.text


def test_the_served_quantization_is_a_metric_while_the_engine_is_loaded(tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    from services.inference.engine import Engine, EngineConfig

    shipped = four_bit_source(build_tiny_model(tmp_path, name="tiny", version="v1", seed=5))
    labels = {"model": "tiny-random-llama-5", "version": "v1", "dtype": "bfloat16", "quantization": "int4"}
    before = REGISTRY.get_sample_value("llmesh_inference_model_served", labels) or 0.0
    engine = Engine(LoadedModel(verify(shipped), "cpu", "bfloat16", "auto"), EngineConfig(max_batch_size=2))
    try:
        assert REGISTRY.get_sample_value("llmesh_inference_model_served", labels) == before + 1
    finally:
        engine.close()
    assert REGISTRY.get_sample_value("llmesh_inference_model_served", labels) == before
