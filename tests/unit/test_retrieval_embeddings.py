"""The shared MiniLM loader (llmesh.embeddings) on the real model."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest

from llmesh import embeddings
from llmesh.embeddings import Embedder
from llmesh.models import ModelError


@pytest.fixture(scope="module")
def embedder(models_dir: Path) -> Embedder:
    return Embedder.load(models_dir, "minilm")


def test_encode_is_normalized_float32(embedder: Embedder) -> None:
    vectors = embedder.encode(["How do I reset my password?", "What's the way to reset my password", "volcanoes"])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32 and embedder.dimension == 384
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > 0.9 > 0.3 > vectors[0] @ vectors[2]
    assert embedder.encode([]).shape == (0, 384)


async def test_concurrent_callers_share_passes_and_get_their_own_rows(embedder: Embedder) -> None:
    texts = [f"question number {i} about caching" for i in range(20)]
    results = await asyncio.gather(*(embedder.aencode([t]) for t in texts), embedder.aencode(texts[:3]))
    expected = embedder.encode(texts)
    for i, got in enumerate(results[:20]):
        assert got.shape == (1, 384) and np.allclose(got[0], expected[i], atol=1e-5)
    assert np.allclose(results[20], expected[:3], atol=1e-5)


def test_tampered_model_is_refused(models_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "minilm"
    shutil.copytree((models_dir / "minilm" / "current").resolve(), copy)
    (copy / "config.json").write_text("{}")
    with pytest.raises(ModelError):
        Embedder.load(tmp_path, str(copy))


def test_auto_dtype_follows_the_cpu() -> None:
    from llmesh import hardware

    expected = "bfloat16" if hardware.cpu_native_bf16().native else "float32"
    assert embeddings.resolve_dtype("auto") == expected
    assert embeddings.resolve_dtype("float32") == "float32"


def test_bf16_vectors_match_float32(models_dir: Path) -> None:
    fp32 = Embedder.load(models_dir, "minilm", dtype="float32")
    bf16 = Embedder.load(models_dir, "minilm", dtype="bfloat16")
    assert (fp32.dtype, bf16.dtype) == ("float32", "bfloat16")
    texts = ["How do I reset my password?", "Invoices are due within thirty days of delivery.", "volcanoes"]
    a, b = fp32.encode(texts), bf16.encode(texts)
    assert b.dtype == np.float32 and np.allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-4)
    assert (a * b).sum(axis=1).min() > embeddings.BF16_MIN_COSINE


def test_bf16_that_drifts_is_refused(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No cosine reaches 1.01: every bf16 model "drifts", so the loader must serve float32.
    monkeypatch.setattr(embeddings, "BF16_MIN_COSINE", 1.01)
    monkeypatch.setattr(embeddings, "_models", {})
    embedder = Embedder.load(models_dir, "minilm", dtype="bfloat16")
    assert embedder.dtype == "float32"
    assert str(next(embedder.model.parameters()).dtype) == "torch.float32"  # type: ignore[attr-defined]
