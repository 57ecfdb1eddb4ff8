"""The shared MiniLM loader (llmesh.embeddings) on the real model."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest

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
