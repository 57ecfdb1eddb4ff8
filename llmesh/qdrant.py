"""The one way services open Qdrant: a Qdrant server (QDRANT_URL, QDRANT_API_KEY) or, when no URL
is set, embedded local mode under `$LLMESH_DATA_DIR/qdrant-<service>`.

Calls run on worker threads through `QdrantHandle.run`, never on the event loop. Embedded mode
is a single-process store (it takes a file lock on its folder) and is not thread-safe, so its
calls go through one thread; a server client gets a few.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from qdrant_client import QdrantClient
from qdrant_client.http.exceptions import ResponseHandlingException

from llmesh.settings import Settings

log = logging.getLogger("llmesh.qdrant")
T = TypeVar("T")

SERVER_TIMEOUT_SECONDS = 10
SERVER_WORKERS = 4


class QdrantHandle:
    """A Qdrant client plus the threads its blocking calls run on."""

    def __init__(self, client: QdrantClient, executor: ThreadPoolExecutor, local_path: Path | None) -> None:
        self.client = client
        self._executor = executor
        #: Folder of the embedded store; None for a Qdrant server.
        self.local_path = local_path
        #: False from a call that got no reply (refused, timed out) until a call gets one.
        self.reachable = True

    @property
    def local(self) -> bool:
        return self.local_path is not None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        except ResponseHandlingException:  # the client's wrapper for "no reply from the server"
            self.reachable = False
            raise
        self.reachable = True
        return result

    def close(self) -> None:
        try:
            self._executor.submit(self.client.close).result(timeout=10)
        except Exception:  # closing is best effort
            log.warning("closing the Qdrant client failed", exc_info=True)
        self._executor.shutdown(wait=False, cancel_futures=True)


def local_path(settings: Settings, service: str) -> Path:
    return settings.data_path / f"qdrant-{service}"


def open_client(settings: Settings, service: str) -> QdrantHandle:
    """Blocking: opens the server client or the embedded store (created when missing)."""
    url = settings.qdrant_url
    if url:
        client = QdrantClient(url=url, api_key=settings.qdrant_api_key or None, timeout=SERVER_TIMEOUT_SECONDS)
        return QdrantHandle(client, ThreadPoolExecutor(SERVER_WORKERS, thread_name_prefix="qdrant"), None)
    path = local_path(settings, service)
    path.mkdir(parents=True, exist_ok=True)
    executor = ThreadPoolExecutor(1, thread_name_prefix="qdrant-local")
    try:
        # Created on its own thread: every later call runs there too.
        client = executor.submit(QdrantClient, path=str(path)).result()
    except RuntimeError as exc:
        executor.shutdown(wait=False)
        raise RuntimeError(
            f"embedded Qdrant at {path} is in use by another process ({exc}); only one process may "
            "open it: give each replica its own LLMESH_DATA_DIR or set QDRANT_URL to a Qdrant server"
        ) from exc
    log.info("embedded Qdrant at %s", path)
    return QdrantHandle(client, executor, path)
