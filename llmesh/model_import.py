"""`llmesh models import`: a team's own Hugging Face model under the models dir.

SOURCE is a local model directory or, where a hub is reachable, a hub id. The import checks
what llmesh can load safely before copying anything (safetensors only, no remote code, an
architecture transformers knows, a tokenizer the tokenizer service reads, a chat template for
a causal LM), copies and hashes each file in one pass, writes the manifest and points
`current` at the new version. The layout is the one `llmesh.models` prepares and verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmesh.models import (
    CAUSAL_LM,
    EMBEDDING,
    PICKLE_SUFFIXES,
    UNLISTED,
    ModelError,
    point_current,
    write_manifest,
)

KINDS = (CAUSAL_LM, EMBEDDING)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SHARD_INDEX = "model.safetensors.index.json"
# Weights of other frameworks and formats we never load; skipped when copying.
FOREIGN_WEIGHTS = (".h5", ".msgpack", ".onnx", ".gguf", ".ot", ".tflite", ".mlmodel")
# What a hub download fetches: safetensors and the small text files around them, nothing else.
HUB_PATTERNS = [
    "*.safetensors",
    SHARD_INDEX,
    "*.json",
    "*.jinja",
    "*.txt",
    "*.model",
    "1_Pooling/*",
    "2_Normalize/*",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_VERSION = re.compile(r"^[A-Za-z0-9][\w.-]{0,63}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
COPY_BLOCK = 1 << 20

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ImportedModel:
    name: str
    version: str
    path: Path
    kind: str
    architecture: str
    files: int
    bytes: int


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: unreadable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def _refuse_remote_code(source: Path) -> None:
    for name in ("config.json", "tokenizer_config.json"):
        path = source / name
        if path.is_file() and "auto_map" in _read_json(path):
            raise ModelError(
                f"{path}: has an auto_map, so loading it needs trust_remote_code; "
                "llmesh never runs code that ships with a model"
            )
    code = sorted(p.name for p in source.glob("*.py"))
    if code:
        raise ModelError(f"{source}: ships Python code {code}; llmesh never runs code that ships with a model")


def check_architecture(config: dict[str, Any], kind: str, where: Path) -> str:
    """The model_type must be one transformers loads natively for that kind."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    model_type = str(config.get("model_type", ""))
    architecture = ",".join(config.get("architectures") or []) or model_type
    known = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if kind == CAUSAL_LM else MODEL_MAPPING_NAMES
    if not model_type:
        raise ModelError(f"{where}/config.json: no model_type, so transformers cannot load it")
    if model_type not in known:
        what = "a causal LM" if kind == CAUSAL_LM else "an embedding model"
        raise ModelError(
            f"{where}: architecture {architecture} (model_type {model_type!r}) "
            f"cannot be loaded by transformers as {what}"
        )
    return architecture


def check_inside(source: Path, rel: str, where: str) -> None:
    """A file to copy must be a regular file of SOURCE itself: a symlink, or a path that resolves
    outside it, would copy another file of this machine into the models dir (and a name that
    leads outside would also be written outside the staging folder). `source` is resolved."""
    path = source / rel
    if path.is_symlink():
        raise ModelError(
            f"{where}: {rel!r} is a symbolic link; the import copies regular files of the model directory "
            "only (copy the model with its links followed, e.g. `cp -rL`, and import the copy)"
        )
    if not path.resolve().is_relative_to(source):
        raise ModelError(f"{where}: {rel!r} resolves outside the model directory {source}")


def check_shard_name(shard: object, index: Path) -> str:
    """A shard of the index is a plain safetensors file name beside the index, as a sharded
    `save_pretrained` writes it ("model-00001-of-00002.safetensors"): never a path."""
    name = str(shard)
    if (
        not isinstance(shard, str)
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name in ("", ".", "..")
        or Path(name).is_absolute()
        or not name.endswith(".safetensors")
    ):
        raise ModelError(
            f"{index}: weight_map names shard {name!r}; a shard must be a plain *.safetensors file name "
            "in the model directory (no path)"
        )
    return name


def weight_files(source: Path) -> list[str]:
    """The safetensors files to serve: every shard of the index, or the single file(s)."""
    index = source / SHARD_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index}: no weight_map")
        shards = sorted({check_shard_name(shard, index) for shard in weight_map.values()})
        for shard in shards:
            check_inside(source, shard, str(index))
        missing = [s for s in shards if not (source / s).is_file()]
        if missing:
            raise ModelError(f"{index}: shards listed but missing: {missing}")
        return [SHARD_INDEX, *shards]
    safetensors = sorted(str(p.relative_to(source)) for p in source.rglob("*.safetensors"))
    if safetensors:
        return safetensors
    pickles = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ModelError(
            f"{source}: pickle-only weights {pickles}; llmesh loads safetensors only "
            "(convert them with safetensors' save_file where the weights are trusted)"
        )
    raise ModelError(f"{source}: no weights (*.safetensors)")


def chat_template_source(source: Path, override: Path | None) -> str | None:
    if override is not None:
        try:
            return override.read_text()
        except OSError as exc:
            raise ModelError(f"--chat-template {override}: {exc}") from exc
    template_file = source / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text()
    config_file = source / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = _read_json(config_file).get("chat_template")
    if isinstance(template, list):  # named templates: the default one is the chat template
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def check_chat_template(template: str, where: str) -> None:
    """Renders a two-turn conversation in the same sandbox the tokenizer service uses."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    try:
        rendered = env.from_string(template).render(
            messages=[{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}],
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    except TemplateError as exc:
        raise ModelError(f"{where}: the chat template does not render ({exc})") from exc
    if "ping" not in rendered:
        raise ModelError(f"{where}: the chat template drops the messages")


def check_tokenizer(source: Path) -> None:
    from tokenizers import Tokenizer

    path = source / "tokenizer.json"
    if not path.is_file():
        raise ModelError(
            f"{source}: no tokenizer.json; the tokenizer service reads fast tokenizers only "
            "(save one with transformers' AutoTokenizer.save_pretrained)"
        )
    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelError(f"{path}: unreadable tokenizer ({exc})") from exc


def files_to_copy(source: Path, weights: list[str]) -> list[str]:
    """Weights plus every other file, less pickles, foreign weights, code and hidden files."""
    keep = set(weights)
    for path in source.rglob("*"):
        rel = path.relative_to(source)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_symlink():
            check_inside(source, str(rel), str(source))  # refuses it, naming the link
        if not path.is_file():
            continue
        name = path.name
        if name in UNLISTED or name.endswith(PICKLE_SUFFIXES + FOREIGN_WEIGHTS) or name.endswith(".safetensors"):
            continue
        keep.add(str(rel))
    for kept in keep:
        check_inside(source, kept, str(source))
    return sorted(keep)


def _copy_hashed(src: Path, dst: Path, progress: Progress | None) -> str:
    digest = hashlib.sha256()
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as fin, dst.open("wb") as fout:
        for block in iter(lambda: fin.read(COPY_BLOCK), b""):
            digest.update(block)
            fout.write(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def next_version(model_root: Path) -> str:
    taken = {p.name for p in model_root.iterdir()} if model_root.is_dir() else set()
    n = 1
    while f"v{n}" in taken:
        n += 1
    return f"v{n}"


def is_hub_id(source: str) -> bool:
    return not Path(source).exists() and bool(_HUB_ID.match(source))


def download_from_hub(repo_id: str, revision: str | None, into: Path) -> dict[str, Any]:
    """Fetches safetensors and tokenizer files only; returns the manifest's source record."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ModelError(
            f"{repo_id!r} looks like a hub id, but downloads are off (HF_HUB_OFFLINE=1); "
            "pass a local model directory, or run with HF_HUB_OFFLINE=0 where a hub is reachable"
        )
    from huggingface_hub import HfApi, snapshot_download

    try:
        sha = HfApi().model_info(repo_id, revision=revision).sha
        snapshot_download(repo_id, revision=sha, local_dir=into, allow_patterns=HUB_PATTERNS)
    except Exception as exc:
        raise ModelError(f"{repo_id}: download failed ({exc})") from exc
    return {"type": "hub", "repo": repo_id, "revision": sha, "requested_revision": revision or "main"}


def import_model(
    source: str,
    models_dir: Path,
    name: str,
    version: str | None = None,
    kind: str = CAUSAL_LM,
    chat_template: Path | None = None,
    revision: str | None = None,
    progress: Callable[[int], Progress] | None = None,
) -> ImportedModel:
    """Imports SOURCE as `<models_dir>/<name>/<version>/` and points `current` at it.
    `progress(total_bytes)` returns a callback fed the bytes copied."""
    if kind not in KINDS:
        raise ModelError(f"--kind must be one of {', '.join(KINDS)}")
    if not _NAME.match(name):
        raise ModelError(f"--name {name!r}: use lowercase letters, digits, '.', '_' and '-'")
    if version is not None and not _VERSION.match(version):
        raise ModelError(f"--version {version!r}: use letters, digits, '.', '_' and '-'")
    model_root = models_dir / name
    model_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".import-", dir=model_root) as scratch:
        if is_hub_id(source):
            src = Path(scratch) / "download"
            record = download_from_hub(source, revision, src)
        else:
            src = Path(source).resolve()
            if not src.is_dir():
                raise ModelError(f"{source}: no such model directory (or hub id)")
            record = {"type": "directory", "path": str(src)}
        return _import_directory(src, record, model_root, name, version, kind, chat_template, progress)


def _import_directory(
    src: Path,
    record: dict[str, Any],
    model_root: Path,
    name: str,
    version: str | None,
    kind: str,
    chat_template: Path | None,
    progress: Callable[[int], Progress] | None,
) -> ImportedModel:
    if not (src / "config.json").is_file():
        raise ModelError(f"{src}: no config.json; not a Hugging Face model directory")
    _refuse_remote_code(src)
    config = _read_json(src / "config.json")
    architecture = check_architecture(config, kind, src)
    weights = weight_files(src)
    check_tokenizer(src)
    template = None
    if kind == CAUSAL_LM:
        template = chat_template_source(src, chat_template)
        if template is None:
            raise ModelError(
                f"{src}: the tokenizer has no chat template (tokenizer_config.json chat_template or "
                f"{CHAT_TEMPLATE_FILE}); pass --chat-template FILE"
            )
        check_chat_template(template, str(chat_template or src))

    version = version or next_version(model_root)
    target = model_root / version
    if target.exists():
        raise ModelError(f"{target} already exists; versions are immutable, pick another --version")
    copy = files_to_copy(src, weights)
    if template is not None and chat_template is not None:
        copy = [f for f in copy if f != CHAT_TEMPLATE_FILE]
    total = sum((src / rel).stat().st_size for rel in copy)
    advance = progress(total) if progress is not None else None
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=model_root))
    try:
        hashes = {rel: _copy_hashed(src / rel, staging / rel, advance) for rel in copy}
        if template is not None and chat_template is not None:
            (staging / CHAT_TEMPLATE_FILE).write_text(template)
            record = {**record, "chat_template": str(chat_template)}
        model_id = str(config.get("_name_or_path") or record.get("repo") or src.name)
        write_manifest(staging, model_id, {**record, "architecture": architecture}, kind=kind, hashes=hashes)
        staging.chmod(0o755)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    point_current(model_root, version)
    return ImportedModel(name, version, target, kind, architecture, len(copy), total)
