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

import numpy as np

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

_models: dict[tuple[str, str], object] = {}
_models_lock = threading.Lock()
_torch_threads = 0  # torch's own thread count, read before anything changes it


def _load_model(verified: VerifiedModel) -> object:
    """One SentenceTransformer per verified model per process (services hosted side by side in
    one process, as in the tests, share the read-only weights)."""
    global _torch_threads
    key = (str(verified.path), verified.digest)
    with _models_lock:
        model = _models.get(key)
        if model is None:
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
            _models[key] = model
        return model


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
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
    )
    _pending: list[_Pending] = field(default_factory=list)
    _draining: bool = False
    _drainer: asyncio.Task[None] | None = None

    @classmethod
    def load(cls, models_dir: Path, name: str, batch_size: int = DEFAULT_BATCH_SIZE) -> Embedder:
        """Verifies and loads `name` (a folder under models_dir, a name/version or a path). Blocking."""
        verified = verify(resolve(models_dir, name))
        model = _load_model(verified)
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension  # type: ignore[attr-defined]
        dim = int(get_dim())
        log.info("embedding model %s (%s) loaded, dimension %d", verified.model_id, verified.version, dim)
        return cls(model=model, verified=verified, batch_size=batch_size, dimension=dim)

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
        vectors = self.model.encode(  # type: ignore[attr-defined]
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

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
