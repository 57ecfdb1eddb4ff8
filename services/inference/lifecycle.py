"""Model lifecycle: the engine being served, and atomic switches to another prepared version.

A switch verifies the version's manifest, loads and warms a second engine on the side, then
swaps which engine new requests go to. Requests already submitted finish on the old engine,
which is closed (and its weights released) once it has drained. Only then is the model's
`current` pointer moved. Any failure before the swap leaves the old version serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
from pathlib import Path

import torch

from llmesh import errors
from llmesh.models import ModelError, point_current, resolve, verify
from services.inference.engine import Engine, EngineConfig, ModelDescription, RequestStream
from services.inference.engine.decoding import SamplingParams
from services.inference.engine.load import EngineLoad

log = logging.getLogger("llmesh.inference.lifecycle")

VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Longest an old engine may take to finish its in-flight requests before it is closed anyway.
DRAIN_TIMEOUT_S = 600.0


class ModelManager:
    def __init__(self, models_path: Path, model_setting: str, config: EngineConfig, device: str = "auto") -> None:
        self.models_path = models_path
        self.model_setting = model_setting
        self.config = config
        self.device = device
        self._engine: Engine | None = None
        self._switch = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self._draining: set[Engine] = set()
        self.root: Path | None = None

    # Blocking: run in a thread.
    def load_initial(self) -> Engine:
        try:
            verified = verify(resolve(self.models_path, self.model_setting))
        except ModelError as exc:
            raise errors.FailedPrecondition(f"inference: {exc}", reason="MODEL_INVALID") from exc
        self.root = verified.path.parent
        self._engine = Engine.boot(verified, self.config, self.device)
        log.info("serving %s %s (%s)", verified.model_id, verified.version, verified.digest[:12])
        return self._engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise errors.Unavailable("inference: no model loaded", reason="WARMING_UP", retry_after=1.0)
        return self._engine

    @property
    def description(self) -> ModelDescription:
        return self.engine.description

    # The InferenceBackend interface (services.inference.backend).
    @property
    def encoder(self) -> Engine:
        return self.engine

    @property
    def serving(self) -> bool:
        # An engine whose worker died closed itself: NOT_SERVING until a restart or a switch.
        return self._engine is not None and not self._engine.closed

    def load(self) -> EngineLoad | None:
        """The serving engine's load (None before one serves)."""
        return self._engine.load() if self._engine is not None else None

    async def start(self) -> None:
        await asyncio.to_thread(self.load_initial)

    async def prepare(self, params: SamplingParams) -> None:
        await self.engine.prepare(params)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str = "", priority: int = 0
    ) -> RequestStream:
        """Binds the request to the engine serving now; it finishes there even if a switch happens."""
        return self.engine.submit(prompt_ids, params, request_id, priority)

    async def load_version(self, version: str) -> ModelDescription:
        if not VERSION_NAME.match(version) or version == "current":
            raise errors.InvalidArgument([("version", "must be a version directory name such as v2")])
        async with self._switch:
            old = self.engine
            assert self.root is not None
            target = self.root / version
            if not target.is_dir():
                raise errors.NotFound(
                    f"inference: no model version {version!r} under {self.root.name}", reason="VERSION_NOT_FOUND"
                )
            try:
                verified = await asyncio.to_thread(verify, target)
            except ModelError as exc:
                log.error("refusing model version %s: %s", version, exc)
                raise errors.FailedPrecondition(f"inference: {exc}", reason="MODEL_VERIFICATION_FAILED") from exc
            try:
                new = await asyncio.to_thread(Engine.boot, verified, self.config, self.device)
            except Exception as exc:
                log.exception("loading model version %s failed", version)
                raise errors.FailedPrecondition(
                    f"inference: model version {version} failed to load or warm up: {exc}", reason="MODEL_LOAD_FAILED"
                ) from exc
            self._engine = new  # the switch: new requests go to the new engine from here on
            self._draining.add(old)
            task = asyncio.create_task(self._retire(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            log.info(
                "switched to %s %s (%s); draining %s",
                verified.model_id,
                verified.version,
                verified.digest[:12],
                old.description.version,
            )
            try:
                await asyncio.to_thread(point_current, self.root, version)
            except OSError:
                # Serving has switched; only a restart would go back to the old version.
                log.exception("switched to %s but could not repoint %s/current", version, self.root)
            return new.description

    async def _retire(self, engine: Engine) -> None:
        drained = await asyncio.to_thread(engine.drain, DRAIN_TIMEOUT_S)
        if not drained:
            log.warning("engine %s did not drain in %.0fs; closing it", engine.tag, DRAIN_TIMEOUT_S)
        await asyncio.to_thread(engine.close, "the model version was replaced")
        self._draining.discard(engine)
        log.info("released model version %s", engine.description.version)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the old weights' memory back to the device

    @property
    def draining(self) -> int:
        """Old engines still finishing their requests after a switch."""
        return len(self._draining)

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        engines = [*self._draining, *([self._engine] if self._engine is not None else [])]
        self._engine = None
        self._draining.clear()
        for engine in engines:
            await asyncio.to_thread(engine.close, "the service is stopping")
