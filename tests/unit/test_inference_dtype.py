"""Dtype by hardware, the perplexity guard at load, and the dtype in the gateway's cache keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from llmesh import hardware
from llmesh.models import QUALITY_FILE, verify
from llmesh.testing import build_tiny_model
from llmesh.v1 import inference_pb2
from services.cache.keys import Scope, entry_key, normalize_prompt
from services.gateway.core import model_key_of
from services.inference.engine import Engine, EngineConfig, LoadedModel, quality
from services.inference.engine.decoding import SamplingParams
from services.inference.engine.quality import QualityError
from services.inference.engine.quantize import QuantizedLinear

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- hardware


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert hardware.cpu_flags(cpuinfo) == frozenset({"fpu", "sse2", "avx512f", "avx512_bf16"})
    assert hardware.cpu_flags(tmp_path / "missing") == frozenset()


def test_torch_and_the_kernel_agree_on_native_bf16() -> None:
    """Both detection paths on the real machine: torch's capability check and /proc/cpuinfo."""
    flags = hardware.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    found = hardware.cpu_native_bf16()
    assert found.native == any(f in flags for f in hardware.BF16_CPU_FLAGS), found


def test_the_hardware_rule_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "cpu_native_bf16", lambda: hardware.CpuBf16(True, "avx512_bf16 (test)"))
    auto = hardware.choose_dtype(CPU)
    assert (auto.dtype, auto.explicit) == (torch.bfloat16, False)
    assert "native bf16" in auto.reason
    monkeypatch.setattr(hardware, "cpu_native_bf16", lambda: hardware.CpuBf16(False, "none (test)"))
    assert hardware.choose_dtype(CPU).dtype == torch.float32
    forced = hardware.choose_dtype(CPU, "bfloat16")
    assert (forced.dtype, forced.explicit, forced.reason) == (torch.bfloat16, True, "LLMESH_DTYPE=bfloat16")
    with pytest.raises(ValueError, match="int4"):
        hardware.choose_dtype(CPU, "int4")


# --------------------------------------------------------------------------- the guard


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A private tiny model (quality.json is written into its version folder)."""
    return build_tiny_model(tmp_path, name="tiny", version="v1", seed=3)


@pytest.fixture
def drift(monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted model drifts: its final norm is scaled, as a broken cast or kernel would."""
    real = quality.convert

    def drifting(model: Any, dtype: torch.dtype, quantize: str) -> Any:
        model = real(model, dtype, quantize)
        with torch.no_grad():
            model.model.norm.weight.mul_(4.0)
        return model

    monkeypatch.setattr(quality, "convert", drifting)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the guard's forwards."""
    calls: list[int] = []
    real = quality.score

    def counting(model: Any, ids: list[int], device: torch.device, forward: Any = None) -> tuple[float, torch.Tensor]:
        calls.append(len(ids))
        return real(model, ids, device, forward)

    monkeypatch.setattr(quality, "score", counting)
    return calls


def _stored(directory: Path) -> dict[str, Any]:
    checks: dict[str, Any] = json.loads((directory / QUALITY_FILE).read_text())["checks"]
    return checks


@pytest.mark.usefixtures("drift")
def test_the_guard_refuses_an_explicit_dtype_that_drifts(tiny: Path) -> None:
    with pytest.raises(QualityError, match=r"refusing bfloat16 on cpu: perplexity .* LLMESH_DTYPE=bfloat16") as err:
        LoadedModel(verify(tiny), "cpu", "bfloat16")
    assert "the guard allows +2%" in str(err.value)
    check = _stored(tiny)["cpu/bfloat16/none"]
    assert check["perplexity"] > 1.02 * check["reference_perplexity"]
    assert check["digest"] == verify(tiny).digest  # the version still verifies with quality.json beside it


def test_the_guard_measures_the_forward_that_serves(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The own Llama forward (engine/llama.py) serves on CPU, not transformers' forward: a fault
    # in it alone (here: its bfloat16 prefill drifts) must fail the guard.
    from services.inference.engine import llama

    real = llama.LlamaDecoder.prefill

    def drifting(self: llama.LlamaDecoder, *args: Any) -> torch.Tensor:
        hidden = real(self, *args)
        return hidden * 4.0 if hidden.dtype == torch.bfloat16 else hidden

    monkeypatch.setattr(llama.LlamaDecoder, "prefill", drifting)
    with pytest.raises(QualityError, match=r"refusing bfloat16 on cpu"):
        LoadedModel(verify(tiny), "cpu", "bfloat16")


@pytest.mark.usefixtures("drift")
def test_an_automatic_dtype_that_drifts_falls_back_to_float32(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(hardware, "cpu_native_bf16", lambda: hardware.CpuBf16(True, "avx512_bf16 (test)"))
    with caplog.at_level(logging.WARNING, logger="llmesh.inference.quality"):
        loaded = LoadedModel(verify(tiny), "cpu", "auto")
    assert (loaded.dtype, loaded.dtype_name) == (torch.float32, "float32")
    assert next(p for p in loaded.model.parameters()).dtype == torch.float32
    assert loaded.quality is not None and not loaded.quality.passes
    assert "refusing bfloat16" in caplog.text and "serving float32 instead" in caplog.text


def test_a_stored_check_is_reused_and_a_new_digest_measures_again(tiny: Path, counted: list[int]) -> None:
    first = LoadedModel(verify(tiny), "cpu", "bfloat16")
    assert first.dtype_name == "bfloat16" and first.quality is not None and first.quality.passes
    assert len(counted) == 2  # float32 reference + bfloat16
    assert next(p for p in first.model.parameters()).dtype == torch.bfloat16
    second = LoadedModel(verify(tiny), "cpu", "bfloat16")
    assert len(counted) == 2  # read from quality.json, not measured
    assert second.quality == first.quality
    # Another text or other weights (digest) invalidate the stored check.
    path = tiny / QUALITY_FILE
    data = json.loads(path.read_text())
    data["checks"]["cpu/bfloat16/none"]["digest"] = "0" * 64
    path.write_text(json.dumps(data))
    LoadedModel(verify(tiny), "cpu", "bfloat16")
    assert len(counted) == 4


def test_float32_needs_no_check(tiny: Path, counted: list[int]) -> None:
    loaded = LoadedModel(verify(tiny), "cpu", "float32")
    assert (loaded.dtype_name, loaded.quality, counted) == ("float32", None, [])
    assert not (tiny / QUALITY_FILE).exists()


def test_the_real_smollm2_passes_in_bfloat16_plain_and_with_int8_weights(models_dir: Path) -> None:
    """Measured, not read from a stored check: float32 reference, bf16, and bf16 with int8
    weights (every call through the int8 kernel) on the fixed text."""
    verified = verify(models_dir / "smollm2" / "current")
    from tokenizers import Tokenizer

    ids = quality.text_ids(Tokenizer.from_file(str(verified.path / "tokenizer.json")), 1024)
    assert len(ids) >= 300
    checks = {}
    for quantize in ("none", "int8"):
        model = quality.load_weights(verified, CPU, torch.float32)
        converted, checks[quantize] = quality.measure(model, ids, CPU, torch.bfloat16, quantize, verified.digest)
        assert checks[quantize].passes, checks[quantize].describe()
        assert 5.0 < checks[quantize].reference_perplexity < 50.0  # a real model on plain English
    layers = [m for m in converted.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert layers and all(isinstance(m, QuantizedLinear) for m in layers)
    # The int8 check measured int8 arithmetic, not the bf16 weights it keeps for long calls.
    assert checks["int8"].perplexity != checks["none"].perplexity


async def test_int8_weights_serve_through_the_engine(tiny: Path) -> None:
    loaded = LoadedModel(verify(tiny), "cpu", "bfloat16", "int8")
    assert loaded.quality is not None and loaded.quality.key == "cpu/bfloat16/int8", loaded.quality
    engine = Engine(loaded, EngineConfig(max_batch_size=4, max_prompt_tokens=64, max_new_tokens=16))
    assert engine.description.dtype == "bfloat16+int8"  # ModelInfo.dtype, and so the gateway's cache key
    engine.start()
    try:
        tokens: list[int] = []
        async for event in engine.submit(
            engine.encode("Tell me about the sea"), SamplingParams(max_new_tokens=8, ignore_eos=True)
        ):
            tokens += event.token_ids
        assert len(tokens) == 8
    finally:
        engine.close()


# --------------------------------------------------------------------------- cache keys


def test_cache_keys_differ_per_dtype() -> None:
    info = inference_pb2.ModelInfo(model_id="SmolLM2-135M-Instruct", sha256="ab" * 32, dtype="float32")
    keys = {}
    for dtype in ("float32", "bfloat16", "bfloat16+int8"):
        info.dtype = dtype
        keys[dtype] = model_key_of(info)
    assert keys["bfloat16"] == f"SmolLM2-135M-Instruct@{'ab' * 8}/bfloat16"
    entries = {entry_key(normalize_prompt("What is a prime?"), Scope.make(model=key)) for key in keys.values()}
    assert len(entries) == 3
    info.dtype = ""  # a backend that reports no dtype (openai): the key it always had
    assert model_key_of(info) == f"SmolLM2-135M-Instruct@{'ab' * 8}"


def test_an_import_leaves_the_source_quality_checks_behind(tiny: Path) -> None:
    """quality.json belongs to the host that measured it, not to the model: never copied, never
    listed in a manifest."""
    from llmesh.model_import import files_to_copy

    LoadedModel(verify(tiny), "cpu", "bfloat16")
    assert (tiny / QUALITY_FILE).is_file()
    assert QUALITY_FILE not in files_to_copy(tiny, ["model.safetensors"])
