"""Generate calls to one inference replica over Inference.GenerateMany streams.

`GenerationMux.generate(request, timeout)` is a drop-in for `stub.Generate(request,
timeout=timeout)`: what it returns iterates the responses, raises `grpc.aio.AioRpcError` with the
status (code, details, google.rpc details) a Generate call would end with, and `cancel()` makes
the iteration raise CancelledError, as grpc.aio's own calls do. So the breakers, retries,
outlier detection and deadline handling around it are the same for both. Underneath, every
generation to the replica shares one long-lived stream, and the replica sends what an engine step
produced for all of them as one message (services/inference/multiplex.py): a gRPC message per
engine step instead of one per token per request, on both sides of the hop.

* Each generation has its own client span (`llmesh.v1.Inference/Generate`, as a Generate call's),
  carried to the replica in its start message, and its own deadline: a local timer, and the
  replica's (`timeout_seconds`).
* A stream takes new generations for STREAM_ROTATE_S, then the next one opens and the old one is
  half-closed once its generations are done: the server's connection age (max_connection_age)
  then never ends a stream with generations still on it.
* A stream that fails (the replica died, the connection broke) fails every generation on it with
  its status; the next generation opens a new stream.
* A replica that does not implement GenerateMany (UNIMPLEMENTED: an older version) is asked with
  Generate calls from then on, the generations already waiting included.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from typing import Any

import grpc
from opentelemetry.trace import Span

from llmesh import rpc_tracing, tasks
from llmesh.errors import STATUS_DETAILS_KEY
from llmesh.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger("llmesh.gateway.multiplex")

GENERATE_METHOD = "/llmesh.v1.Inference/Generate"
#: A stream takes new generations this long (well under the server's 300 s connection age).
STREAM_ROTATE_S = 60.0
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_FINISHED = object()  # a call's end: it ended normally


def _rpc_error(code: grpc.StatusCode, details: str, status_details: bytes = b"") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((STATUS_DETAILS_KEY, status_details)) if status_details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


class MuxCall:
    """One generation on a GenerateMany stream, iterated and cancelled like a grpc.aio call."""

    __slots__ = (
        "_end",
        "_fallback",
        "_messages",
        "_span",
        "_stream",
        "_timer",
        "_waiter",
        "id",
        "request",
        "timeout_at",
    )

    def __init__(
        self, stream: _MuxStream, generation: int, request: inference_pb2.InferenceRequest, timeout: float | None
    ) -> None:
        self._stream = stream
        self.id = generation
        self.request = request
        self._messages: collections.deque[inference_pb2.InferenceResponse] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._end: Any = None  # _FINISHED, or the exception the iteration raises
        # (a Generate call, its iterator), once the replica turned out not to multiplex
        self._fallback: tuple[Any, Any] | None = None
        self._span: Span | None = None
        loop = asyncio.get_running_loop()
        self.timeout_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        if timeout is not None:
            self.timeout_at = loop.time() + timeout
            self._timer = loop.call_at(self.timeout_at, self._expire)

    def start_message(self) -> inference_pb2.GenerateManyRequest:
        span, headers = rpc_tracing.start_client_span(GENERATE_METHOD, {"llmesh.multiplexed": True})
        self._span = span
        start = inference_pb2.GenerationStart(id=self.id, request=self.request, metadata=dict(headers))
        if self.timeout_at is not None:
            start.timeout_seconds = max(0.001, self.timeout_at - asyncio.get_running_loop().time())
        return inference_pb2.GenerateManyRequest(start=start)

    # --- what the caller sees --------------------------------------------------------------------
    def __aiter__(self) -> MuxCall:
        return self

    async def __anext__(self) -> inference_pb2.InferenceResponse:
        if self._fallback is not None:
            return await self._fallback[1].__anext__()  # type: ignore[no-any-return]
        while not self._messages:
            end = self._end
            if end is _FINISHED:
                raise StopAsyncIteration
            if end is not None:
                raise end
            if self._fallback is not None:
                return await self._fallback[1].__anext__()  # type: ignore[no-any-return]
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self._messages.popleft()

    def cancel(self) -> bool:
        """Stops the generation (the replica frees its row); the iteration raises CancelledError."""
        if self._fallback is not None:
            return bool(self._fallback[0].cancel())
        if self._end is not None:
            return False
        self._stream.cancel(self.id)  # before _done: a retiring stream half-closes after its last call
        self._messages.clear()  # as a cancelled gRPC call: the next read raises, unread tokens or not
        self._done(asyncio.CancelledError(), grpc.StatusCode.CANCELLED)
        return True

    # --- what the stream delivers ----------------------------------------------------------------
    def deliver(self, update: inference_pb2.GenerationUpdate) -> None:
        if update.status_code:
            code = _CODES.get(update.status_code, grpc.StatusCode.UNKNOWN)
            self._done(_rpc_error(code, update.status_message, update.status_details), code)
            return
        self._messages.append(update.response)
        if update.response.finish_reason:
            self._done(_FINISHED, grpc.StatusCode.OK)
        else:
            self._wake()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        self._done(error, error.code())

    def fall_back(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        """The replica has no GenerateMany: this generation becomes a Generate call (whose own span
        follows this one's)."""
        if self._span is not None:
            self._span.set_attribute("llmesh.multiplex.fallback", True)
        self._close_span(grpc.StatusCode.OK)
        if self._end is not None:
            return
        timeout = None
        if self.timeout_at is not None:
            timeout = max(0.0, self.timeout_at - asyncio.get_running_loop().time())
        if self._timer is not None:
            self._timer.cancel()
        call = stub.Generate(self.request, timeout=timeout)
        self._fallback = (call, call.__aiter__())
        self._wake()

    def _expire(self) -> None:
        if self._end is None:
            self._stream.cancel(self.id)
            self._messages.clear()
            error = _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._done(error, grpc.StatusCode.DEADLINE_EXCEEDED)

    def _done(self, end: Any, code: grpc.StatusCode) -> None:
        if self._end is not None:
            return
        self._end = end
        if self._timer is not None:
            self._timer.cancel()
        self._stream.forget(self.id)
        self._close_span(code)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if isinstance(end, asyncio.CancelledError):
                waiter.cancel()
            else:
                waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close_span(self, code: grpc.StatusCode) -> None:
        if self._span is not None:
            rpc_tracing.end_client_span(self._span, code)
            self._span = None


class _MuxStream:
    """One GenerateMany stream and the generations on it. Nothing is written before the replica's
    first (empty) message says it multiplexes: a replica without GenerateMany answers UNIMPLEMENTED
    to the bare call, and the generations queued meanwhile become Generate calls."""

    def __init__(self, mux: GenerationMux) -> None:
        self.mux = mux
        loop = asyncio.get_running_loop()
        self.opened_at = loop.time()
        self.calls: dict[int, MuxCall] = {}
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[inference_pb2.GenerateManyRequest | None] = asyncio.Queue()
        self._open: asyncio.Future[None] = loop.create_future()
        self.retiring = False
        self.call = mux.stub.GenerateMany()
        self.reader = loop.create_task(self._read())
        self.writer = loop.create_task(self._write())

    def start(self, request: inference_pb2.InferenceRequest, timeout: float | None) -> MuxCall:
        call = MuxCall(self, next(self._ids), request, timeout)
        self.calls[call.id] = call
        self._outbox.put_nowait(call.start_message())
        return call

    def cancel(self, generation: int) -> None:
        self._outbox.put_nowait(inference_pb2.GenerateManyRequest(cancel=generation))

    def forget(self, generation: int) -> None:
        self.calls.pop(generation, None)
        if self.retiring and not self.calls:
            self._outbox.put_nowait(None)  # half-close: the replica ends the stream

    def retire(self) -> None:
        """Takes no new generations; half-closes once the running ones are done."""
        self.retiring = True
        if not self.calls:
            self._outbox.put_nowait(None)

    async def _write(self) -> None:
        try:
            await self._open
            while True:
                message = await self._outbox.get()
                if message is None:
                    await self.call.done_writing()
                    return
                await self.call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("GenerateMany stream: write stopped: %s", exc)  # the reader reports the end

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for batch in self.call:
                if not self._open.done():
                    self._open.set_result(None)
                for update in batch.updates:
                    call = self.calls.get(update.id)
                    if call is not None:
                        call.deliver(update)
        except grpc.aio.AioRpcError as err:
            error = err
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
        finally:
            self.mux.ended(self)
            if not self._open.done():
                self._open.cancel()
            self.writer.cancel()
            if error is not None and error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.mux.unsupported()
                for call in list(self.calls.values()):
                    call.fall_back(self.mux.stub)
            else:
                error = error or _rpc_error(grpc.StatusCode.UNAVAILABLE, "the replica ended the stream")
                for call in list(self.calls.values()):
                    call.fail(error)
            self.calls.clear()

    async def close(self) -> None:
        self.call.cancel()
        await tasks.stop(self.reader, self.writer)


class GenerationMux:
    """Generate calls to one replica, over one GenerateMany stream at a time."""

    def __init__(
        self, stub: inference_pb2_grpc.InferenceStub, enabled: bool = True, rotate_s: float = STREAM_ROTATE_S
    ) -> None:
        """`enabled` False (LLMESH_INFERENCE_MULTIPLEX=false): a Generate call per request."""
        self.stub = stub
        self.rotate_s = rotate_s
        self.supported = enabled  # until the replica answers UNIMPLEMENTED
        self._stream: _MuxStream | None = None
        self._streams: set[_MuxStream] = set()

    def generate(self, request: inference_pb2.InferenceRequest, timeout: float | None = None) -> Any:
        """A Generate call's stand-in (see the module)."""
        if not self.supported:
            return self.stub.Generate(request, timeout=timeout)
        stream = self._stream
        if stream is None or asyncio.get_running_loop().time() - stream.opened_at > self.rotate_s:
            if stream is not None:
                stream.retire()
            stream = self._stream = _MuxStream(self)
            self._streams.add(stream)
        return stream.start(request, timeout)

    def ended(self, stream: _MuxStream) -> None:
        self._streams.discard(stream)
        if self._stream is stream:
            self._stream = None

    def unsupported(self) -> None:
        if self.supported:
            log.info("inference replica has no GenerateMany: one Generate call per request")
        self.supported = False

    def retire(self) -> None:
        """The replica left: its stream takes no new generations and half-closes once those on it
        are done, so the channel's graceful close is not held by an idle stream."""
        if self._stream is not None:
            self._stream.retire()
            self._stream = None

    @property
    def generations(self) -> int:
        """Generations running over this mux's streams now."""
        return sum(len(s.calls) for s in self._streams)

    async def close(self) -> None:
        for stream in list(self._streams):
            await stream.close()
