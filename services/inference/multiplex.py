"""Inference.GenerateMany: many generations over one gRPC stream, the outputs of an
engine step going out together.

A Generate call per request costs a gRPC message per token on both sides of the hop, and at 32
streams of a CPU engine that was most of what the mesh added to the engine's own CPU. Here the
gateway keeps one stream per replica and starts each request on it; every generation runs as it
would under Generate (the same backend stream, deadline, trace, cancellation and status), and
what they produce is queued and sent as one message: after the first update the sender waits for
the rest of the engine step, until every generation that is decoding has an update queued
(LINGER_MAX_S at most: the builtin engine hands a step's tokens over at once, an OpenAI-compatible
server writes its streams one after the other within a few milliseconds), and updates that arrive
while a message is being written go in the next. A lone request waits for nothing.

This is the servicer side (messages in and out); `services.inference.servicer` owns the
generations themselves (`generate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from llmesh import errors, rpc_tracing
from llmesh.errors import STATUS_DETAILS_KEY
from llmesh.server import MethodMeter, status_of
from llmesh.v1 import inference_pb2
from services.inference import metrics

log = logging.getLogger("llmesh.inference")

#: What each generation is, to traces and metrics: a Generate call.
GENERATE_METHOD = "/llmesh.v1.Inference/Generate"
_GENERATE_SPAN = rpc_tracing.ServerMethod(GENERATE_METHOD)
_GENERATE_METER = MethodMeter("server_stream", "llmesh.v1.Inference", "Generate")
#: After the first update of a message, the sender waits for the rest of the step: until every
#: running generation has an update queued, LINGER_MAX_S at most. An OpenAI-compatible server
#: writes a step's streams one after the other (vLLM's CPU build took 1-3 ms for 32 here); the
#: builtin engine hands a step over in one loop turn.
LINGER_MAX_S = 0.003
#: A generation refused because the service is draining: its caller retries elsewhere.
DRAINING_RETRY_S = 0.1

Generate = Callable[[inference_pb2.InferenceRequest], AsyncIterator[inference_pb2.InferenceResponse]]


class GenerationSession:
    """The generations of one GenerateMany stream: started and cancelled by the requests read
    (`read`), their updates sent in batches (`responses`). Draining (`drain`): new starts are
    refused UNAVAILABLE and the stream ends once the running ones have finished."""

    def __init__(self, generate: Generate, context: grpc.aio.ServicerContext) -> None:
        self._generate = generate
        self._context = context
        self._running: dict[int, asyncio.Task[None]] = {}
        self._pending: list[inference_pb2.GenerationUpdate] = []
        self._pending_ids: set[int] = set()  # the generations with an update in _pending
        self._decoding: set[int] = set()  # running generations that have produced a token
        self._wake = asyncio.Event()
        self._read_all = False  # the caller half-closed: no more starts
        self._draining = False

    # --- requests --------------------------------------------------------------------------------
    async def read(self, requests: AsyncIterator[inference_pb2.GenerateManyRequest]) -> None:
        try:
            async for request in requests:
                action = request.WhichOneof("action")
                if action == "start":
                    self.start(request.start)
                elif action == "cancel":
                    self.cancel(request.cancel)
        finally:
            self._read_all = True
            self._wake.set()

    def start(self, start: inference_pb2.GenerationStart) -> None:
        if start.id in self._running:
            self._fail(start.id, errors.InvalidArgument([("start.id", f"generation {start.id} is already running")]))
            return
        if self._draining:
            self._fail(
                start.id,
                errors.Unavailable("inference is draining", reason="DRAINING", retry_after=DRAINING_RETRY_S),
            )
            return
        task = asyncio.get_running_loop().create_task(self._run(start))
        self._running[start.id] = task

    def cancel(self, generation: int) -> None:
        task = self._running.get(generation)
        if task is not None:
            task.cancel()

    def drain(self) -> None:
        self._draining = True
        self._wake.set()

    def close(self) -> None:
        """The stream is gone: every generation still running stops (freeing its engine row)."""
        for task in self._running.values():
            task.cancel()

    # --- generations -----------------------------------------------------------------------------
    async def _run(self, start: inference_pb2.GenerationStart) -> None:
        generation = start.id
        _GENERATE_METER.started()
        began = time.perf_counter()
        span = rpc_tracing.ServerSpan(_GENERATE_SPAN, self._context, list(start.metadata.items()))
        code = grpc.StatusCode.OK
        failure: BaseException | None = None
        timeout = asyncio.timeout(start.timeout_seconds if start.timeout_seconds > 0 else None)
        try:
            async with timeout:
                async for response in self._generate(start.request):
                    self._decoding.add(generation)
                    self._queue(inference_pb2.GenerationUpdate(id=generation, response=response))
        except asyncio.CancelledError as exc:
            code, failure = grpc.StatusCode.CANCELLED, exc  # the caller's cancel, or the stream went
            raise
        except Exception as exc:
            failure = exc
            if timeout.expired():
                exc = errors.DeadlineExceeded("inference: the generation's deadline ran out")
            code = self._fail(generation, exc)
        finally:
            del self._running[generation]
            self._decoding.discard(generation)
            _GENERATE_METER.handled(code, time.perf_counter() - began)
            span.finish(code, failure)
            if not self._running:
                self._wake.set()  # a draining or half-closed stream may end now

    def _fail(self, generation: int, exc: BaseException) -> grpc.StatusCode:
        code, message, trailing = status_of(exc, GENERATE_METHOD)
        details = next((v for k, v in trailing if k == STATUS_DETAILS_KEY and isinstance(v, bytes)), b"")
        update = inference_pb2.GenerationUpdate(
            id=generation, status_code=code.value[0], status_message=message, status_details=details
        )
        self._queue(update)
        return code

    def _queue(self, update: inference_pb2.GenerationUpdate) -> None:
        self._pending.append(update)
        self._pending_ids.add(update.id)
        self._wake.set()

    # --- responses -------------------------------------------------------------------------------
    async def responses(self) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        yield inference_pb2.GenerateManyResponse()  # the stream is open
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._pending:
                await self._linger(loop.time() + LINGER_MAX_S)
                batch, self._pending = self._pending, []
                self._pending_ids.clear()
                metrics.MULTIPLEX_BATCH_UPDATES.observe(len(batch))
                yield inference_pb2.GenerateManyResponse(updates=batch)
            if (self._read_all or self._draining) and not self._running and not self._pending:
                return

    async def _linger(self, until: float) -> None:
        """Holds the message while the rest of the engine step's outputs may come: until every
        decoding generation has an update in it (one still waiting for its first token holds
        nothing up), or `until`."""
        loop = asyncio.get_running_loop()
        while not self._decoding <= self._pending_ids:
            left = until - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            try:
                async with asyncio.timeout(left):
                    await self._wake.wait()
            except TimeoutError:
                return


class Multiplexer:
    """The open GenerateMany sessions of a service, so draining reaches them all."""

    def __init__(self, generate: Generate) -> None:
        self._generate = generate
        self._sessions: set[GenerationSession] = set()
        self._draining = False

    async def serve(
        self, requests: AsyncIterator[inference_pb2.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        session = GenerationSession(self._generate, context)
        if self._draining:
            session.drain()
        self._sessions.add(session)
        reader = asyncio.get_running_loop().create_task(session.read(requests))
        try:
            async for response in session.responses():
                yield response
        finally:
            self._sessions.discard(session)
            reader.cancel()
            session.close()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    def drain(self) -> None:
        """New generations are refused (their callers retry elsewhere); each stream ends once its
        running generations have finished, so the server's drain is not held for its grace."""
        self._draining = True
        for session in self._sessions:
            session.drain()
