"""The one sentence-embedding loader of the mesh (MiniLM), shared by the cache and retrieval.

Loading verifies the prepared model directory (manifest hashes, safetensors only) before
sentence-transformers reads it; remote code is never trusted. `encode` returns L2-normalized
float32 rows, so a dot product is the cosine similarity. `aencode` runs the encoding on one
dedicated worker thread (never on the event loop) and folds the texts of callers that arrive
while an encoding is running into the next one, so concurrent short lookups share a forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmesh.hardware import cpu_native_bf16
from llmesh.models import VerifiedModel, resolve, verify

log = logging.getLogger("llmesh.embeddings")

DEFAULT_BATCH_SIZE = 32
# Up to this many texts are encoded on one CPU thread: a short query gains little from more, and
# intra-op threads stall each other badly when the cores are busy with other work (on 2 shared
# cores: p50 12 ms on one thread against 31 ms, with 500 ms stalls, on two). Bigger batches use
# every thread torch has.
SINGLE_THREAD_TEXTS = 8
# Texts folded into one forward pass when several callers wait at once.
MAX_COALESCED_TEXTS = 64

_models: dict[tuple[str, str, str], tuple[object, str]] = {}
_models_lock = threading.Lock()
_torch_threads = 0  # torch's own thread count, read before anything changes it

# bf16 vectors must stay this close (cosine) to fp32's on the check sentences, else fp32 is served.
BF16_MIN_COSINE = 0.995
CHECK_SENTENCES = (
    "How do I reset my password?",
    "The quarterly report shows revenue grew eleven percent, driven by the cloud business.",
    "Kubernetes restarts a pod whose liveness probe fails three times in a row.",
    "Refunds are issued to the original payment method within five business days.",
    "What is the capital of Australia?",
    "Our on-call rotation hands over every Monday at nine in the morning, Berlin time.",
)


def resolve_dtype(requested: str) -> str:
    """The dtype an embedding model runs in: `requested`, or for auto bf16 where the CPU computes
    it natively (about 1.5x faster for MiniLM, same vectors to 1e-3) and fp32 elsewhere."""
    if requested != "auto":
        return requested
    return "bfloat16" if cpu_native_bf16().native else "float32"


def _to_dtype(model: Any, dtype: str) -> str:
    """Casts the float32 model to `dtype` if its vectors stay within BF16_MIN_COSINE of fp32's;
    returns the dtype served."""
    if dtype == "float32":
        return dtype
    import torch

    with torch.inference_mode():
        reference = _encode(model, CHECK_SENTENCES)
        model.to(getattr(torch, dtype))
        cosine = float((_encode(model, CHECK_SENTENCES) * reference).sum(dim=1).min())
    if cosine < BF16_MIN_COSINE:
        model.to(torch.float32)
        log.warning("embedding model in %s drifts from float32 (cosine %.4f); serving float32", dtype, cosine)
        return "float32"
    return dtype


def _encode(model: Any, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE) -> Any:
    """Unit-length float32 rows as a tensor; normalized in float32, whatever the model computes in."""
    import torch

    vectors = model.encode(list(texts), batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
    return torch.nn.functional.normalize(vectors.float(), dim=-1)


def _load_model(verified: VerifiedModel, dtype: str) -> tuple[object, str]:
    """One SentenceTransformer per verified model and dtype per process (services hosted side by
    side in one process, as in the tests, share the read-only weights), and the dtype it serves."""
    global _torch_threads
    key = (str(verified.path), verified.digest, dtype)
    with _models_lock:
        loaded = _models.get(key)
        if loaded is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            import torch
            from sentence_transformers import SentenceTransformer

            if not _torch_threads:
                _torch_threads = torch.get_num_threads()

            model = SentenceTransformer(
                str(verified.path),
                device="cpu",
                local_files_only=True,
                trust_remote_code=False,
                model_kwargs={"use_safetensors": True},
            )
            model.eval()
            loaded = _models[key] = (model, _to_dtype(model, dtype))
        return loaded


@dataclass
class _Pending:
    texts: list[str]
    future: asyncio.Future[np.ndarray]


@dataclass
class Embedder:
    """A verified sentence-embedding model. Build with `Embedder.load`."""

    model: object
    verified: VerifiedModel
    batch_size: int = DEFAULT_BATCH_SIZE
    dimension: int = 0
    #: The dtype the model computes in (float32 or bfloat16); vectors are float32 either way.
    dtype: str = "float32"
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
    )
    _pending: list[_Pending] = field(default_factory=list)
    _draining: bool = False
    _drainer: asyncio.Task[None] | None = None

    @classmethod
    def load(cls, models_dir: Path, name: str, batch_size: int = DEFAULT_BATCH_SIZE, dtype: str = "auto") -> Embedder:
        """Verifies and loads `name` (a folder under models_dir, a name/version or a path) in `dtype`
        (auto, float32 or bfloat16; see resolve_dtype). Blocking."""
        verified = verify(resolve(models_dir, name))
        model, served = _load_model(verified, resolve_dtype(dtype))
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension  # type: ignore[attr-defined]
        dim = int(get_dim())
        log.info("embedding model %s (%s) loaded, dimension %d, %s", verified.model_id, verified.version, dim, served)
        return cls(model=model, verified=verified, batch_size=batch_size, dimension=dim, dtype=served)

    @property
    def model_id(self) -> str:
        return self.verified.model_id

    @property
    def digest(self) -> str:
        """Identifies the exact weights: vectors of different digests are not comparable."""
        return self.verified.digest

    @property
    def max_seq_length(self) -> int:
        return int(getattr(self.model, "max_seq_length", 256))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Normalized float32 embeddings, shape (len(texts), dimension). Blocking (CPU-bound)."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        self._set_threads(1 if len(texts) <= SINGLE_THREAD_TEXTS else 0)
        vectors = _encode(self.model, texts, self.batch_size)
        return np.ascontiguousarray(vectors.cpu().numpy(), dtype=np.float32)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens the model reads of each text (its special tokens included, after its truncation
        at max_seq_length). Blocking."""
        if not texts:
            return []
        tokenizer = self.model.tokenizer  # type: ignore[attr-defined]
        ids = tokenizer(list(texts), truncation=True, max_length=self.max_seq_length)["input_ids"]
        return [len(row) for row in ids]

    async def acount_tokens(self, texts: Sequence[str]) -> list[int]:
        """`count_tokens` on the embedding thread (the tokenizer is not shared across threads)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.count_tokens, list(texts))

    @staticmethod
    def _set_threads(wanted: int) -> None:
        """`wanted` intra-op threads for the next encode (0: all of them); only embedding threads call it."""
        import torch

        wanted = wanted or _torch_threads
        if wanted and torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    async def aencode(self, texts: Sequence[str]) -> np.ndarray:
        """`encode` on the embedding thread; concurrent callers are coalesced into one pass."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        loop = asyncio.get_running_loop()
        pending = _Pending(list(texts), loop.create_future())
        self._pending.append(pending)
        if not self._draining:
            self._draining = True
            self._drainer = loop.create_task(self._drain())
        return await pending.future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch = [self._pending.pop(0)]
                size = len(batch[0].texts)
                while self._pending and size + len(self._pending[0].texts) <= MAX_COALESCED_TEXTS:
                    nxt = self._pending.pop(0)
                    batch.append(nxt)
                    size += len(nxt.texts)
                batch = [p for p in batch if not p.future.done()]  # callers that gave up
                if not batch:
                    continue
                texts = [t for p in batch for t in p.texts]
                try:
                    vectors = await loop.run_in_executor(self._executor, self.encode, texts)
                except Exception as exc:  # handed to every caller of this pass
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                start = 0
                for p in batch:
                    end = start + len(p.texts)
                    if not p.future.done():
                        p.future.set_result(vectors[start:end])
                    start = end
        finally:
            self._draining = False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
