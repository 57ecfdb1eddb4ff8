"""Python client for the llmesh gateway.

    from llmesh.client import Mesh
    with Mesh("127.0.0.1:50051") as mesh:
        print(mesh.ask("What is the capital of France?").text)

`AsyncMesh` is the asyncio client; `Mesh` runs the same calls on an event loop of its own.
Errors arrive as `MeshError` subclasses carrying the gRPC status details (retry-after, bad
fields). Other languages use the protos directly.

A shed call (RESOURCE_EXHAUSTED, or UNAVAILABLE with retry info: an open breaker) is retried
after the delay the mesh asked for, jittered, at most `retries` times within the call's timeout
(`RetryPolicy`); a generation that already streamed tokens is never retried. And the client
throttles itself when most of its recent calls were shed (`AdaptiveThrottle`, client-side
adaptive throttling from Google's SRE book): it refuses locally with probability
max(0, (requests - K x accepts) / (requests + 1)), so a crowd of clients cannot turn sheds into
a storm of retries.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from llmesh.channels import service_config
from llmesh.errors import RETRY_PUSHBACK_KEY, status_details, unpack_details
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


class MeshError(Exception):
    """A call failed; `code` is the gRPC status, the rest comes from its details."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        retry_after: float | None = None,
        reason: str = "",
        field_violations: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.reason = reason
        self.field_violations = field_violations or []


class InvalidRequestError(MeshError):
    """INVALID_ARGUMENT: fix the request (see field_violations)."""


class OverloadedError(MeshError):
    """RESOURCE_EXHAUSTED: retry after `retry_after` seconds."""


class UnavailableError(MeshError):
    """UNAVAILABLE: the mesh (or a part it needs) is down; retry later."""


class AuthError(MeshError):
    """UNAUTHENTICATED or PERMISSION_DENIED."""


class DeadlineError(MeshError):
    """DEADLINE_EXCEEDED."""


_ERROR_TYPES = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.PERMISSION_DENIED: AuthError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineError,
}


def to_mesh_error(err: grpc.RpcError) -> MeshError:
    code = err.code()  # type: ignore[attr-defined]
    message = err.details() or code.name  # type: ignore[attr-defined]
    trailing = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    details = unpack_details(status_details(trailing))
    retry_after: float | None = None
    retry = details.get("retry_info")
    if retry is not None:
        delay = retry.retry_delay  # type: ignore[attr-defined]
        retry_after = delay.seconds + delay.nanos / 1e9
    else:
        pushback = dict(trailing).get(RETRY_PUSHBACK_KEY)
        if pushback:
            retry_after = int(pushback) / 1000
    bad = details.get("bad_request")
    violations = [(v.field, v.description) for v in bad.field_violations] if bad is not None else []  # type: ignore[attr-defined]
    info = details.get("error_info")
    reason = info.reason if info is not None else ""  # type: ignore[attr-defined]
    cls = _ERROR_TYPES.get(code, MeshError)
    return cls(code, message, retry_after=retry_after, reason=reason, field_violations=violations)


T = TypeVar("T")
#: Reason of a call the client refused itself (AdaptiveThrottle).
REASON_CLIENT_THROTTLED = "CLIENT_THROTTLED"


class AdaptiveThrottle:
    """Client-side adaptive throttling (Google SRE book, "Handling Overload"): over the last
    `window_s` the client counts its requests and the ones the mesh accepted (answered with
    anything but a shed); a new call is refused locally with probability
    max(0, (requests - k x accepts) / (requests + 1)). While the mesh accepts, nothing is refused;
    when it sheds most calls, the client stops sending most of them, and recovers as accepts
    return. A locally refused call counts as a request (so the rate keeps adapting)."""

    def __init__(
        self,
        k: float = 2.0,
        window_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.k = k
        self.window_s = window_s
        self.clock = clock
        self.rng = rng or random.Random()
        self._requests: deque[float] = deque()
        self._accepts: deque[float] = deque()
        self._lock = threading.Lock()

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        for series in (self._requests, self._accepts):
            while series and series[0] <= cutoff:
                series.popleft()

    def reject_probability(self) -> float:
        with self._lock:
            self._trim(self.clock())
            requests, accepts = len(self._requests), len(self._accepts)
        return max(0.0, (requests - self.k * accepts) / (requests + 1))

    def allow(self) -> bool:
        """Counts a request; False: refuse it locally."""
        p = self.reject_probability()
        with self._lock:
            self._requests.append(self.clock())
        return not (p > 0 and self.rng.random() < p)

    def accepted(self) -> None:
        with self._lock:
            self._accepts.append(self.clock())


@dataclass
class RetryPolicy:
    """Retries of a shed call: after the mesh's retry info x a jitter in [1, 1 + jitter) (no
    retry info: full jitter over an exponential backoff), at most `retries` times, never past the
    call's timeout."""

    retries: int = 2
    base_s: float = 0.1
    max_backoff_s: float = 5.0
    jitter: float = 0.5

    def delay(self, attempt: int, error: MeshError, rng: random.Random) -> float | None:
        """Seconds to wait before retry number `attempt` (1-based), or None: do not retry."""
        if attempt > self.retries or not retryable(error):
            return None
        if error.retry_after is not None and error.retry_after > 0:
            return min(self.max_backoff_s, error.retry_after) * rng.uniform(1.0, 1.0 + self.jitter)
        return rng.uniform(0.0, min(self.max_backoff_s, self.base_s * 2**attempt))


def retryable(error: MeshError) -> bool:
    """A shed: overload pushback (RESOURCE_EXHAUSTED with retry info) or a part of the mesh
    that said when to come back (UNAVAILABLE with retry info). A request too heavy ever to fit
    carries no retry info and is not retried; neither is one the client throttled itself."""
    if error.reason == REASON_CLIENT_THROTTLED:
        return False
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return error.retry_after is not None
    return error.code == grpc.StatusCode.UNAVAILABLE and error.retry_after is not None


class CallGuard:
    """One client's retries and throttle, shared by its calls (thread-safe)."""

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        throttle: AdaptiveThrottle | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.throttle = throttle
        self.clock = clock
        self.rng = rng or random.Random()

    def admit(self) -> None:
        """Raises OverloadedError when the throttle refuses the call locally."""
        if self.throttle is not None and not self.throttle.allow():
            raise OverloadedError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "refused by the client: most recent calls were shed (adaptive throttling)",
                retry_after=1.0,
                reason=REASON_CLIENT_THROTTLED,
            )

    def heard(self, error: MeshError | None) -> None:
        """The mesh answered (error None) or failed: a shed is not an accept."""
        if self.throttle is not None and (error is None or not retryable(error)):
            self.throttle.accepted()

    def next_delay(self, attempt: int, error: MeshError, deadline: float) -> float | None:
        delay = self.policy.delay(attempt, error, self.rng)
        if delay is None or self.clock() + delay >= deadline:
            return None
        return delay

    async def run_async(
        self,
        call: Callable[[float], Awaitable[T]],
        timeout: float,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> T:
        deadline = self.clock() + timeout
        attempt = 0
        while True:
            self.admit()
            try:
                result = await call(max(0.001, deadline - self.clock()))
            except MeshError as error:
                self.heard(error)
                attempt += 1
                delay = self.next_delay(attempt, error, deadline)
                if delay is None:
                    raise
                await sleep(delay)
                continue
            self.heard(None)
            return result


@dataclass
class ClientOptions:
    target: str = DEFAULT_TARGET
    api_key: str | None = None
    # TLS: the CA bundle to trust; client cert/key for mutual TLS.
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    timeout: float = 120.0
    options: list[tuple[str, Any]] = field(default_factory=list)
    # Retries of shed calls (0: none) and client-side adaptive throttling (see the module doc).
    retries: int = 2
    throttle: bool = True

    def guard(self) -> CallGuard:
        return CallGuard(RetryPolicy(retries=self.retries), AdaptiveThrottle() if self.throttle else None)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca_file:
            return None
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.service_config", _client_service_config()), ("grpc.enable_retries", 1), *self.options]


def _client_service_config() -> str:
    # The gateway's read-only calls are retried on UNAVAILABLE (Search); generation is not,
    # since a retry could run a second generation the caller pays for.
    import json

    config = json.loads(service_config())
    config["methodConfig"][0]["name"] = [{"service": "llmesh.v1.Gateway", "method": "Search"}]
    return json.dumps(config)


def generate_request(
    prompt: str,
    *,
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    seed: int | None = None,
    stop: Iterable[str] = (),
    use_cache: bool | None = None,
    use_retrieval: bool | None = None,
    top_k: int = 0,
    collection: str = "",
    tenant: str = "",
    system_prompt: str = "",
    model: str = "",
    n: int = 0,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> gateway_pb2.GenerateRequest:
    """`model`: one of the gateway's models by name (`list_models`); "" = its default. `n`:
    independent answers (in `choices`; never cached); `logprobs` / `top_logprobs`: each token's
    log probability and its likeliest alternatives (0-20)."""
    sampling = common_pb2.SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=list(stop),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    if seed is not None:
        sampling.seed = seed
    request = gateway_pb2.GenerateRequest(
        prompt=prompt,
        system_prompt=system_prompt,
        sampling=sampling,
        top_k=top_k,
        collection=collection,
        tenant=tenant,
        model=model,
        n=n,
    )
    if use_cache is not None:
        request.use_cache = use_cache
    if use_retrieval is not None:
        request.use_retrieval = use_retrieval
    return request


def documents(
    items: Iterable[tuple[str, str] | common_pb2.Document], metadata: Mapping[str, str] | None = None
) -> list[common_pb2.Document]:
    out = []
    for item in items:
        if isinstance(item, common_pb2.Document):
            out.append(item)
        else:
            doc_id, text = item
            out.append(common_pb2.Document(id=doc_id, text=text, metadata=dict(metadata or {})))
    return out


def ingest_request(
    docs: Iterable[tuple[str, str] | common_pb2.Document],
    *,
    collection: str = "",
    tenant: str = "",
    chunk_tokens: int = 0,
    overlap_tokens: int = 0,
) -> gateway_pb2.IngestRequest:
    return gateway_pb2.IngestRequest(
        collection=collection,
        tenant=tenant,
        documents=documents(docs),
        chunk_tokens=chunk_tokens,
        overlap_tokens=overlap_tokens,
    )


def search_request(
    query: str,
    *,
    collection: str = "",
    tenant: str = "",
    top_k: int = 0,
    score_threshold: float = 0.0,
    filter: Mapping[str, str] | None = None,
) -> gateway_pb2.SearchRequest:
    return gateway_pb2.SearchRequest(
        query=query,
        collection=collection,
        tenant=tenant,
        top_k=top_k,
        score_threshold=score_threshold,
        filter=dict(filter or {}),
    )


class Mesh:
    """Blocking client: the same calls as AsyncMesh, run on an event loop of its own (one daemon
    thread per client), so that retries, throttling and streaming are written once."""

    def __init__(self, target: str = DEFAULT_TARGET, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="llmesh-client", daemon=True)
        self._thread.start()
        self._closed = False
        # grpc.aio binds a channel to the loop it is made on: make it on the client's own.
        self._async: AsyncMesh = self._call(_made(target, kwargs))
        self.opts = self._async.opts
        self.guard = self._async.guard

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def ask(
        self, prompt: str, *, timeout: float | None = None, metadata: Iterable[tuple[str, str]] = (), **options: Any
    ) -> gateway_pb2.GenerateResponse:
        """`metadata` passes extra headers, e.g. a W3C `traceparent` to continue the caller's trace.
        A shed is retried as its retry info says (see the module doc)."""
        return self._call(self._async.ask(prompt, timeout=timeout, metadata=metadata, **options))

    def stream(
        self, prompt: str, *, timeout: float | None = None, **options: Any
    ) -> Iterator[gateway_pb2.GenerateStreamResponse]:
        """A shed before the first message is retried; nothing is retried once one came. Closing
        the iterator early cancels the call."""
        messages = self._async.stream(prompt, timeout=timeout, **options)
        try:
            while True:
                try:
                    yield self._call(anext(messages))
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._call(messages.aclose())

    def ingest(
        self,
        docs: Iterable[tuple[str, str] | common_pb2.Document],
        *,
        collection: str = "",
        tenant: str = "",
        chunk_tokens: int = 0,
        overlap_tokens: int = 0,
        timeout: float | None = None,
    ) -> gateway_pb2.IngestResponse:
        return self._call(
            self._async.ingest(
                docs,
                collection=collection,
                tenant=tenant,
                chunk_tokens=chunk_tokens,
                overlap_tokens=overlap_tokens,
                timeout=timeout,
            )
        )

    def search(
        self,
        query: str,
        *,
        collection: str = "",
        tenant: str = "",
        top_k: int = 0,
        score_threshold: float = 0.0,
        filter: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> gateway_pb2.SearchResponse:
        return self._call(
            self._async.search(
                query,
                collection=collection,
                tenant=tenant,
                top_k=top_k,
                score_threshold=score_threshold,
                filter=filter,
                timeout=timeout,
            )
        )

    def embed(
        self, texts: Iterable[str], *, model: str = "", tenant: str = "", timeout: float | None = None
    ) -> list[list[float]]:
        """Unit-length embeddings of `texts` (1-256, each at most 16 KiB), in order, with the mesh's
        embedding model (the one retrieval searches with); `embed_response` for usage and model."""
        return self._call(self._async.embed(texts, model=model, tenant=tenant, timeout=timeout))

    def embed_response(
        self, texts: Iterable[str], *, model: str = "", tenant: str = "", timeout: float | None = None
    ) -> gateway_pb2.EmbedResponse:
        return self._call(self._async.embed_response(texts, model=model, tenant=tenant, timeout=timeout))

    def list_models(self, *, timeout: float | None = None) -> list[gateway_pb2.ModelEntry]:
        """The models the gateway routes to (the default first), each with its key and whether
        its inference answers now."""
        return self._call(self._async.list_models(timeout=timeout))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._async.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _made(target: str, kwargs: dict[str, Any]) -> AsyncMesh:
    return AsyncMesh(target, **kwargs)


class AsyncMesh:
    """asyncio client; same calls as Mesh."""

    def __init__(self, target: str = DEFAULT_TARGET, **kwargs: Any) -> None:
        self.opts = ClientOptions(target=target, **kwargs)
        creds = self.opts.credentials()
        options = self.opts.channel_options()
        self.channel = (
            grpc.aio.secure_channel(target, creds, options) if creds else grpc.aio.insecure_channel(target, options)
        )
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.guard = self.opts.guard()

    def _kw(self, timeout: float | None, metadata: Iterable[tuple[str, str]] = ()) -> dict[str, Any]:
        return {"timeout": timeout or self.opts.timeout, "metadata": (*self.opts.metadata(), *metadata)}

    async def ask(
        self, prompt: str, *, timeout: float | None = None, metadata: Iterable[tuple[str, str]] = (), **options: Any
    ) -> gateway_pb2.GenerateResponse:
        request = generate_request(prompt, **options)
        headers = (*self.opts.metadata(), *metadata)

        async def once(left: float) -> gateway_pb2.GenerateResponse:
            try:
                return await self.stub.Generate(request, timeout=left, metadata=headers)
            except grpc.RpcError as err:
                raise to_mesh_error(err) from None

        return await self.guard.run_async(once, timeout or self.opts.timeout)

    async def stream(
        self, prompt: str, *, timeout: float | None = None, **options: Any
    ) -> AsyncGenerator[gateway_pb2.GenerateStreamResponse, None]:
        """A shed before the first message is retried; nothing is retried once one came."""
        request = generate_request(prompt, **options)
        guard = self.guard
        deadline = guard.clock() + (timeout or self.opts.timeout)
        attempt = 0
        while True:
            guard.admit()
            call = self.stub.GenerateStream(
                request, timeout=max(0.001, deadline - guard.clock()), metadata=self.opts.metadata()
            )
            started = False
            try:
                async for message in call:
                    if not started:
                        started = True
                        guard.heard(None)
                    yield message
                if not started:
                    guard.heard(None)
                return
            except grpc.RpcError as err:
                error = to_mesh_error(err)
                if started:
                    raise error from None
                guard.heard(error)
                attempt += 1
                delay = guard.next_delay(attempt, error, deadline)
                if delay is None:
                    raise error from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def ingest(
        self,
        docs: Iterable[tuple[str, str] | common_pb2.Document],
        *,
        collection: str = "",
        tenant: str = "",
        chunk_tokens: int = 0,
        overlap_tokens: int = 0,
        timeout: float | None = None,
    ) -> gateway_pb2.IngestResponse:
        request = ingest_request(
            docs, collection=collection, tenant=tenant, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens
        )
        try:
            return await self.stub.Ingest(request, **self._kw(timeout))
        except grpc.RpcError as err:
            raise to_mesh_error(err) from None

    async def search(
        self,
        query: str,
        *,
        collection: str = "",
        tenant: str = "",
        top_k: int = 0,
        score_threshold: float = 0.0,
        filter: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> gateway_pb2.SearchResponse:
        request = search_request(
            query, collection=collection, tenant=tenant, top_k=top_k, score_threshold=score_threshold, filter=filter
        )
        try:
            return await self.stub.Search(request, **self._kw(timeout))
        except grpc.RpcError as err:
            raise to_mesh_error(err) from None

    async def embed(
        self, texts: Iterable[str], *, model: str = "", tenant: str = "", timeout: float | None = None
    ) -> list[list[float]]:
        found = await self.embed_response(texts, model=model, tenant=tenant, timeout=timeout)
        return [list(e.values) for e in found.embeddings]

    async def embed_response(
        self, texts: Iterable[str], *, model: str = "", tenant: str = "", timeout: float | None = None
    ) -> gateway_pb2.EmbedResponse:
        request = gateway_pb2.EmbedRequest(inputs=list(texts), model=model, tenant=tenant)
        try:
            return await self.stub.Embed(request, **self._kw(timeout))
        except grpc.RpcError as err:
            raise to_mesh_error(err) from None

    async def list_models(self, *, timeout: float | None = None) -> list[gateway_pb2.ModelEntry]:
        try:
            return list((await self.stub.ListModels(gateway_pb2.ListModelsRequest(), **self._kw(timeout))).models)
        except grpc.RpcError as err:
            raise to_mesh_error(err) from None

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncMesh:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
