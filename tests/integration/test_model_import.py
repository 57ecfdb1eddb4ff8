"""`llmesh models import`: real model directories written by the test (the prepared SmolLM2
saved in bf16 as a plain Hugging Face directory, and a sharded save), every refusal, the
listing, verification, and the inference service serving an imported model."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from llmesh import cli, models
from llmesh.model_import import import_model
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.servicer import InferenceApp

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _save_hf_dir(source: Path, target: Path, **save_kwargs: object) -> Path:
    """The prepared SmolLM2 re-saved by transformers in bf16: a directory as a team would have
    it (no manifest), with the chat template inside tokenizer_config.json."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(target, **save_kwargs)  # type: ignore[arg-type]
    for name in TOKENIZER_FILES:
        shutil.copy2(source / name, target / name)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = (source / "chat_template.jinja").read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def smol_source(models_dir: Path) -> Path:
    return models.resolve(models_dir, models.SMOLLM2)


@pytest.fixture(scope="module")
def bf16_dir(smol_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_hf_dir(smol_source, tmp_path_factory.mktemp("smol-bf16"))


@pytest.fixture(scope="module")
def sharded_dir(smol_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_hf_dir(smol_source, tmp_path_factory.mktemp("smol-sharded"), max_shard_size="100MB")


@pytest.fixture(scope="module")
def imported_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def plain_tiny(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny model as a plain directory (no manifest), to be broken by each refusal test."""
    target = tmp_path / "plain"
    shutil.copytree(tiny_model, target, ignore=shutil.ignore_patterns(models.MANIFEST, models.QUALITY_FILE))
    return target


def test_bf16_directory_imports_and_verifies(bf16_dir: Path, imported_models: Path) -> None:
    assert not (bf16_dir / models.MANIFEST).exists()
    imported = import_model(str(bf16_dir), imported_models, "smol-bf16")
    assert (imported.name, imported.version, imported.kind) == ("smol-bf16", "v1", "causal-lm")
    info = models.verify(models.resolve(imported_models, "smol-bf16"))
    assert info.version == "v1"
    assert info.manifest["kind"] == "causal-lm"
    assert info.manifest["source"] == {
        "type": "directory",
        "path": str(bf16_dir.resolve()),
        "architecture": "LlamaForCausalLM",
    }
    # Copied byte for byte, and the hash taken while copying is the file's real hash.
    weights = "model.safetensors"
    assert info.manifest["files"][weights] == models.sha256_file(bf16_dir / weights)
    assert (info.path / weights).read_bytes() == (bf16_dir / weights).read_bytes()


def test_sharded_save_imports_every_shard(sharded_dir: Path, imported_models: Path) -> None:
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    first = import_model(str(sharded_dir), imported_models, "smol-sharded")
    second = import_model(str(sharded_dir), imported_models, "smol-sharded")
    assert (first.version, second.version) == ("v1", "v2")
    info = models.verify(models.resolve(imported_models, "smol-sharded"))
    assert info.version == "v2"
    assert set(shards) | {"model.safetensors.index.json"} <= set(info.manifest["files"])
    with pytest.raises(models.ModelError, match="already exists"):
        import_model(str(sharded_dir), imported_models, "smol-sharded", version="v1")


def test_pickle_only_weights_are_refused(plain_tiny: Path, tmp_path: Path) -> None:
    (plain_tiny / "model.safetensors").unlink()
    (plain_tiny / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(models.ModelError, match=r"pickle-only weights \['pytorch_model\.bin'\]"):
        import_model(str(plain_tiny), tmp_path / "models", "tiny")


def test_pickles_beside_safetensors_are_left_behind(plain_tiny: Path, tmp_path: Path) -> None:
    (plain_tiny / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    imported = import_model(str(plain_tiny), tmp_path / "models", "tiny")
    assert not (imported.path / "pytorch_model.bin").exists()
    assert models.verify(imported.path).version == "v1"


def test_remote_code_is_refused(plain_tiny: Path, tmp_path: Path) -> None:
    config = json.loads((plain_tiny / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomModel"}
    (plain_tiny / "config.json").write_text(json.dumps(config))
    with pytest.raises(models.ModelError, match=r"auto_map.*trust_remote_code"):
        import_model(str(plain_tiny), tmp_path / "models", "tiny")


def test_an_architecture_that_is_not_a_causal_lm_is_refused(plain_tiny: Path, tmp_path: Path) -> None:
    (plain_tiny / "config.json").write_text(
        json.dumps({"model_type": "distilbert", "architectures": ["DistilBertModel"], "dim": 64})
    )
    with pytest.raises(models.ModelError, match=r"DistilBertModel .*'distilbert'.* cannot be loaded .* as a causal LM"):
        import_model(str(plain_tiny), tmp_path / "models", "tiny")


def test_a_tokenizer_without_chat_template_needs_one_given(plain_tiny: Path, tmp_path: Path) -> None:
    template = (plain_tiny / "chat_template.jinja").read_text()
    (plain_tiny / "chat_template.jinja").unlink()
    with pytest.raises(models.ModelError, match=r"no chat template.*--chat-template FILE"):
        import_model(str(plain_tiny), tmp_path / "models", "tiny")
    template_file = tmp_path / "chatml.jinja"
    template_file.write_text(template)
    imported = import_model(str(plain_tiny), tmp_path / "models", "tiny", chat_template=template_file)
    assert (imported.path / "chat_template.jinja").read_text() == template
    assert models.verify(imported.path).manifest["source"]["chat_template"] == str(template_file)


def test_a_broken_chat_template_is_refused(plain_tiny: Path, tmp_path: Path) -> None:
    (plain_tiny / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(models.ModelError, match="chat template does not render"):
        import_model(str(plain_tiny), tmp_path / "models", "tiny")


def test_missing_shards_and_missing_tokenizer_are_named(sharded_dir: Path, plain_tiny: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(sharded_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[-1]
    (broken / lost).unlink()
    with pytest.raises(models.ModelError, match=f"shards listed but missing: \\['{lost}'\\]"):
        import_model(str(broken), tmp_path / "models", "broken")
    (plain_tiny / "tokenizer.json").unlink()
    with pytest.raises(models.ModelError, match=r"no tokenizer.json"):
        import_model(str(plain_tiny), tmp_path / "models", "tiny")


def _sharded_index(source: Path, shard: str) -> None:
    """Turns the plain tiny model into a "sharded" one whose index names `shard`."""
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))


def _written_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


@pytest.mark.parametrize("how", ["absolute", "climbs-to-root", "parent"])
def test_a_shard_named_by_a_path_is_refused_and_nothing_is_written(plain_tiny: Path, tmp_path: Path, how: str) -> None:
    # A file outside both the model and the models dir: a shard name that reaches it would have it
    # opened for writing as the staged copy of itself (emptied), or copied beside the staging folder.
    sentinel = tmp_path / "outside" / "victim.safetensors"
    sentinel.parent.mkdir()
    sentinel.write_bytes(b"precious")
    before = sentinel.stat().st_mtime_ns
    shard = {
        "absolute": str(sentinel),
        "climbs-to-root": "../" * 64 + str(sentinel).lstrip("/"),
        "parent": "../outside/victim.safetensors",
    }[how]
    _sharded_index(plain_tiny, shard)
    models_root = tmp_path / "models"
    with pytest.raises(models.ModelError, match=r"weight_map names shard .*plain \*\.safetensors file name"):
        import_model(str(plain_tiny), models_root, "tiny")
    assert sentinel.read_bytes() == b"precious" and sentinel.stat().st_mtime_ns == before
    assert _written_under(models_root) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "outside", "plain"]


@pytest.mark.parametrize("link", ["model.safetensors", "notes.md", "sub/notes.md", "sharded-shard"])
def test_a_symlink_to_a_file_outside_the_model_is_refused(plain_tiny: Path, tmp_path: Path, link: str) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes((plain_tiny / "model.safetensors").read_bytes())  # valid weights, but not the model's
    if link == "sharded-shard":
        _sharded_index(plain_tiny, "model-00001-of-00001.safetensors")
        link = "model-00001-of-00001.safetensors"
    target = plain_tiny / link
    target.parent.mkdir(exist_ok=True)
    target.unlink(missing_ok=True)
    target.symlink_to(secret)
    models_root = tmp_path / "models"
    with pytest.raises(models.ModelError, match=f"'{link}' is a symbolic link"):
        import_model(str(plain_tiny), models_root, "tiny")
    assert _written_under(models_root) == []


def test_a_symlinked_folder_leading_outside_is_refused(plain_tiny: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (plain_tiny / "1_Pooling").symlink_to(outside, target_is_directory=True)
    with pytest.raises(models.ModelError, match="1_Pooling"):
        import_model(str(plain_tiny), tmp_path / "models", "tiny")
    assert _written_under(tmp_path / "models") == []


def test_embedding_model_imports_with_its_kind(models_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "minilm"
    shutil.copytree(models.resolve(models_dir, models.MINILM), source, ignore=shutil.ignore_patterns(models.MANIFEST))
    imported = import_model(str(source), tmp_path / "models", "minilm-own", kind="embedding")
    info = models.verify(imported.path)
    assert info.manifest["kind"] == "embedding"
    assert "1_Pooling/config.json" in info.manifest["files"]


def test_a_hub_id_offline_says_how_to_proceed(tmp_path: Path) -> None:
    with pytest.raises(models.ModelError, match=r"looks like a hub id.*HF_HUB_OFFLINE=1"):
        import_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "models", "smol")


def test_cli_import_list_and_verify(
    plain_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "models"
    monkeypatch.setenv("LLMESH_MODELS_DIR", str(base))
    assert cli.main(["models", "import", str(plain_tiny), "--name", "team-model", "--version", "2026-11"]) == 0
    assert "imported team-model/2026-11 (causal-lm, llama, 5 files" in capsys.readouterr().out
    assert cli.main(["models", "list", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["name"] == "team-model"
    assert entry["version"] == "2026-11"
    assert entry["current"] is True
    assert entry["kind"] == "causal-lm"
    assert entry["bytes"] == sum(p.stat().st_size for p in plain_tiny.rglob("*") if p.is_file())
    assert entry["sha256"] == models.verify(base / "team-model" / "2026-11").digest
    assert cli.main(["models", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "VERSION", "CURRENT", "KIND", "SIZE", "SHA256", "MODEL"]
    assert table[1].split()[:4] == ["team-model", "2026-11", "*", "causal-lm"]
    assert cli.main(["models", "verify"]) == 0
    assert "ok  team-model/2026-11 (current)" in capsys.readouterr().out
    weights = base / "team-model" / "2026-11" / "model.safetensors"
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert cli.main(["models", "verify"]) == 1
    assert "BAD team-model/2026-11 (current): " in capsys.readouterr().err
    assert cli.main(["models", "import", str(tmp_path / "nowhere"), "--name", "x"]) == 2
    assert "no such model directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
async def served_import(bf16_dir: Path, imported_models: Path) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    import_model(str(bf16_dir), imported_models, "served-import", version="v1")
    env = {
        "LLMESH_INFERENCE_MODEL": "served-import",
        "LLMESH_MODELS_DIR": str(imported_models),
        "LLMESH_DEVICE": "cpu",
        "LLMESH_ADMIN_TOKEN": "",
    }
    async with hosted("inference", InferenceApp, env=env) as host:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            yield inference_pb2_grpc.InferenceStub(channel)


async def test_the_inference_service_serves_an_imported_model(
    served_import: inference_pb2_grpc.InferenceStub, smol_source: Path
) -> None:
    info = await served_import.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
    assert info.version == "v1"
    request = inference_pb2.InferenceRequest(
        text="<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        sampling=common_pb2.SamplingParams(max_new_tokens=8, temperature=0.0),
    )
    text = "".join([m.text async for m in served_import.Generate(request, timeout=60)])
    assert "Paris" in text
