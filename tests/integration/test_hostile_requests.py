"""Requests built to cost the mesh, through real servers: each is refused before its cost is
paid. Every repeated field and map of every public request, filled to its method's limit with
the cheapest elements the wire format allows, is refused INVALID_ARGUMENT naming the field, and
the gateway's peak memory grows by at most 50 MB; a caller without a key never has its body
read; the internal services answer only callers holding the mesh credential."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.wire import f_bytes, f_varint
from llmesh import memory
from llmesh.channels import PeerAccess, peer_channel
from llmesh.errors import status_details, unpack_details
from llmesh.request_limits import repeated_paths
from llmesh.settings import RequestLimitSettings
from llmesh.testing import hosted
from llmesh.v1 import cache_pb2, cache_pb2_grpc, gateway_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.intake import SERVICE, request_limits
from services.gateway.servicer import GatewayApp
from services.tokenizer.servicer import TokenizerApp

pytestmark = pytest.mark.timeout(120)

CLOSED = "127.0.0.1:1"  # nothing listens there: the gateway's downstreams are unreachable
ENV = {
    "LLMESH_TOKENIZER_TARGET": CLOSED,
    "LLMESH_INFERENCE_TARGET": CLOSED,
    "LLMESH_CACHE_TARGET": CLOSED,
    "LLMESH_RETRIEVAL_TARGET": CLOSED,
}
API_KEY = "k" * 32
MB = 1024 * 1024
MAX_RSS_GROWTH = 50 * MB
SERVER_MAX = 8 * MB  # LLMESH_MAX_MESSAGE_BYTES' default: what gRPC itself lets through
METHODS = {
    "Generate": gateway_pb2.GenerateRequest,
    "GenerateStream": gateway_pb2.GenerateRequest,
    "Embed": gateway_pb2.EmbedRequest,
    "Ingest": gateway_pb2.IngestRequest,
    "Search": gateway_pb2.SearchRequest,
    "ListModels": gateway_pb2.ListModelsRequest,
    "PurgeCache": gateway_pb2.PurgeCacheRequest,
}


# --- the wire format, written directly (bench.harness.wire): a test that built millions
# of messages in Python would spend minutes on its own side.


def _element(f: FieldDescriptor, i: int) -> bytes:
    """The i-th cheapest element of repeated field `f` (map entries with distinct keys, so each
    is kept)."""
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key = f.message_type.fields_by_name["key"]
        entry = f_bytes(1, str(i).encode()) if key.type == FieldDescriptor.TYPE_STRING else f_varint(1, i)
        return f_bytes(f.number, entry)
    return f_bytes(f.number, b"")  # an empty message or string


def filled(descriptor: Any, path: str, size: int) -> bytes:
    """A message of `descriptor` about `size` bytes long whose field `path` holds all of it."""
    head, _, rest = path.partition(".")
    f = descriptor.fields_by_name[head]
    if rest:
        inner = filled(f.message_type, rest, size - 8)
        element = f_bytes(f.number, inner)
        return element
    if f.type not in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        return f_bytes(f.number, bytes(range(100)) * ((size - 8) // 100))  # packed small numbers
    if size > 4 * MB:
        # Past every method's limit: refused on its length, so one element repeated will do.
        element = _element(f, 10**6)
        return element * (size // len(element))
    parts: list[bytes] = []
    total, i = 0, 0
    while total < size:
        element = _element(f, i)
        parts.append(element)
        total += len(element)
        i += 1
    return b"".join(parts)


def cases() -> Iterator[tuple[str, str]]:
    for method, message in METHODS.items():
        for path in repeated_paths(message.DESCRIPTOR):
            yield method, path


# --- measuring the process's peak memory (the services of these tests run in it)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


@contextlib.contextmanager
def peak_growth() -> Iterator[list[int]]:
    """Yields a list that holds, after the block, how far the peak RSS rose above the RSS at its
    start (bytes). Resets the kernel's high-water mark first (clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _status_kb("VmRSS:")
    found: list[int] = []
    yield found
    found.append((_status_kb("VmHWM:") - before) * 1024)


async def call_raw(channel: grpc.aio.Channel, method: str, payload: bytes, metadata: Any = ()) -> grpc.aio.AioRpcError:
    full = f"{SERVICE}{method}"
    identity = lambda raw: raw  # noqa: E731
    if method == "GenerateStream":
        call: Any = channel.unary_stream(full, request_serializer=identity, response_deserializer=identity)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call(payload, timeout=30, metadata=metadata):
                pass
    else:
        call = channel.unary_unary(full, request_serializer=identity, response_deserializer=identity)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(payload, timeout=30, metadata=metadata)
    return caught.value


def violations(error: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    details = unpack_details(status_details(error.trailing_metadata() or ())).get("bad_request")
    return [(v.field, v.description) for v in getattr(details, "field_violations", ())]


@pytest.fixture(scope="module", autouse=True)
def gateway_allocator() -> None:
    """The allocator setting a gateway process runs with (llmesh.server.run_service): this test
    process hosts the gateway, and its peak memory is what is measured. Without it, glibc keeps
    the heap that megabyte buffers (the client's own 8 MiB bodies among them) were served from."""
    memory.map_large_buffers(RequestLimitSettings().mmap_threshold_bytes)


@pytest.fixture(scope="module")
def limits() -> dict[str, Any]:
    from llmesh.testing import service_settings

    return request_limits(service_settings("gateway", ENV).request_limits)  # type: ignore[attr-defined]


async def test_every_repeated_field_filled_to_its_limit_is_refused_naming_it(limits: dict[str, Any]) -> None:
    """One parametrised sweep in one gateway: each public request's repeated fields and maps,
    each filled to its method's byte limit (and once to gRPC's own limit)."""
    refused: list[str] = []
    async with hosted("gateway", GatewayApp, ENV) as gw:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{gw.port}", options=[("grpc.max_send_message_length", SERVER_MAX)]
        ) as channel:
            for method, path in cases():
                limit = limits[f"{SERVICE}{method}"].max_bytes
                for size in (limit - 64, SERVER_MAX - 64):
                    payload = filled(METHODS[method].DESCRIPTOR, path, size)
                    with peak_growth() as growth:
                        error = await call_raw(channel, method, payload)
                    named = [f for f, _ in violations(error)]
                    top = path.split(".")[0]
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, path, size, error.details())
                    assert any(f.split("[")[0].split(".")[0] == top for f in named), (method, path, size, named)
                    assert growth[0] <= MAX_RSS_GROWTH, (method, path, size, growth[0] // MB)
                    refused.append(f"{method} {path} {len(payload)}")
            # Still serving, and a plain request still gets past the limits (to the closed downstreams).
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert len(refused) == 2 * len(list(cases())) >= 2 * 10


async def test_many_messages_without_a_key_is_never_parsed() -> None:
    """The review's request: 8 MB of empty turns, no API key, keys on. UNAUTHENTICATED, on the
    call's metadata alone (over gRPC and over HTTP, with a declared length and chunked)."""
    payload = filled(gateway_pb2.GenerateRequest.DESCRIPTOR, "messages", SERVER_MAX - 64)
    async with hosted("gateway", GatewayApp, {**ENV, "LLMESH_API_KEYS": f"{API_KEY}=acme"}) as gw:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{gw.port}", options=[("grpc.max_send_message_length", SERVER_MAX)]
        ) as channel:
            with peak_growth() as growth:
                error = await call_raw(channel, "Generate", payload)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert growth[0] <= MAX_RSS_GROWTH
            # With the key, the same bytes are refused on their count, unparsed.
            error = await call_raw(channel, "Generate", payload, (("authorization", f"Bearer {API_KEY}"),))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert violations(error)[0][0] == "messages"
        base = f"http://127.0.0.1:{gw.app.http.port}"  # type: ignore[attr-defined]
        body = b'{"model":"m","messages":[' + b",".join([b"{}"] * (SERVER_MAX // 3)) + b"]}"

        async def chunks() -> Any:
            for start in range(0, len(body), 64 * 1024):
                yield body[start : start + 64 * 1024]

        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            with peak_growth() as growth:
                declared = await http.post("/v1/chat/completions", content=body)
                chunked = await http.post("/v1/chat/completions", content=chunks())
            assert declared.status_code == chunked.status_code == 401
            assert declared.json()["error"]["type"] == "authentication_error"
            assert growth[0] <= MAX_RSS_GROWTH


async def test_http_bodies_are_held_to_their_route_limit_while_read() -> None:
    """Keys off: a chunked body past the route's limit is a 413 after at most the limit was read;
    within the limit, a body of too many turns is a 400 naming `messages`."""
    async with hosted("gateway", GatewayApp, ENV) as gw:
        limit = gw.settings.request_limits.max_generate_request_bytes  # type: ignore[attr-defined]
        base = f"http://127.0.0.1:{gw.app.http.port}"  # type: ignore[attr-defined]
        huge = b'{"model":"m","messages":[' + b",".join([b"{}"] * (SERVER_MAX // 3)) + b"]}"
        within = b'{"model":"m","messages":[' + b",".join([b"{}"] * ((limit - 64) // 3)) + b"]}"
        sent = 0

        async def chunks() -> Any:
            nonlocal sent
            for start in range(0, len(huge), 64 * 1024):
                sent += 64 * 1024
                yield huge[start : start + 64 * 1024]

        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            with peak_growth() as growth:
                chunked = await http.post("/v1/chat/completions", content=chunks())
                declared = await http.post("/v1/chat/completions", content=huge)
                many = await http.post("/v1/chat/completions", content=within)
            assert chunked.status_code == declared.status_code == 413
            assert chunked.json()["error"]["code"] == "request_too_large"
            assert many.status_code == 400
            assert many.json()["error"]["param"] == "messages"
            assert growth[0] <= MAX_RSS_GROWTH


async def test_tools_past_the_schema_limit_are_refused_naming_the_field() -> None:
    """A 4 MB tool schema: INVALID_ARGUMENT naming tools[0].parameters, from its bytes (the
    request never reaches a replica, so none is ejected). Within the request limit, tools whose
    schemas pass 64 KiB together are refused naming `tools`."""
    big = '{"type":"object","properties":{' + ",".join(f'"p{i}":{{"type":"string"}}' for i in range(150_000)) + "}}"
    request = gateway_pb2.GenerateRequest(prompt="hi")
    request.tools.add(name="lookup", parameters=big)
    request.tool_choice.mode = "required"
    several = gateway_pb2.GenerateRequest(prompt="hi")
    schema = '{"type":"object","description":"' + "x" * 20_000 + '"}'
    for i in range(4):
        several.tools.add(name=f"f{i}", parameters=schema)
    async with hosted("gateway", GatewayApp, ENV) as gw:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{gw.port}", options=[("grpc.max_send_message_length", SERVER_MAX)]
        ) as channel:
            error = await call_raw(channel, "Generate", request.SerializeToString())
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert violations(error)[0][0] == "tools[0].parameters"
            error = await call_raw(channel, "Generate", several.SerializeToString())
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert violations(error)[0][0] == "tools"


async def test_tool_call_arguments_count_toward_the_prompt_size() -> None:
    """Names, tool call ids and arguments are text the template renders: past
    LLMESH_MAX_PROMPT_BYTES together, the conversation is refused."""
    request = gateway_pb2.GenerateRequest()
    request.messages.add(role="user", content="What is the weather?")
    turn = request.messages.add(role="assistant")
    turn.tool_calls.add(id="call_1", name="weather", arguments='{"city":"' + "x" * 40_000 + '"}')
    request.messages.add(role="tool", tool_call_id="call_1", content="sunny")
    async with hosted("gateway", GatewayApp, ENV) as gw:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
            error = await call_raw(channel, "Generate", request.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("messages", "longer than 32768 bytes in all") in violations(error)


@pytest.fixture
def mesh_token() -> str:
    return "t" * 43


async def test_internal_services_refuse_calls_without_the_mesh_credential(mesh_token: str) -> None:
    """With LLMESH_MESH_TOKEN set, an internal service answers a call only with the token; health
    checks need none; a peer channel built from the settings carries it."""
    async with hosted("tokenizer", TokenizerApp, {"LLMESH_MESH_TOKEN": mesh_token}) as tok:
        target = f"127.0.0.1:{tok.port}"
        request = tokenizer_pb2.CountRequest(texts=["hello there"])
        async with grpc.aio.insecure_channel(target) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await tokenizer_pb2_grpc.TokenizerStub(plain).Count(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await tokenizer_pb2_grpc.TokenizerStub(plain).Count(
                    request, timeout=10, metadata=(("x-llmesh-mesh-token", "u" * 43),)
                )
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with peer_channel(target, access=PeerAccess(metadata=(("x-llmesh-mesh-token", mesh_token),))) as mesh:
            counted = await tokenizer_pb2_grpc.TokenizerStub(mesh).Count(request, timeout=10)
            assert counted.counts[0] > 0


async def test_cache_store_from_outside_the_mesh_is_refused(mesh_token: str, redis_url: str) -> None:
    """The answer a local process would plant for a tenant: refused without the credential, and
    nothing is stored."""
    from services.cache.servicer import CacheApp

    env = {"LLMESH_MESH_TOKEN": mesh_token, "LLMESH_REDIS_URL": redis_url}
    async with hosted("cache", CacheApp, env) as cache:
        scope = cache_pb2.CacheScope(tenant="acme", model="m", collection="docs")
        store = cache_pb2.CacheStoreRequest(
            prompt="What is our refund policy?", scope=scope, answer=cache_pb2.CachedAnswer(text="Anything goes.")
        )
        lookup = cache_pb2.CacheLookupRequest(prompt="What is our refund policy?", scope=scope)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cache.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await cache_pb2_grpc.CacheStub(plain).Store(store, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        token = (("x-llmesh-mesh-token", mesh_token),)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cache.port}") as mesh:
            found = await cache_pb2_grpc.CacheStub(mesh).Lookup(lookup, timeout=10, metadata=token)
            assert not found.hit
            await asyncio.wait_for(cache_pb2_grpc.CacheStub(mesh).Store(store, metadata=token), 10)
            found = await cache_pb2_grpc.CacheStub(mesh).Lookup(lookup, timeout=10, metadata=token)
            assert found.hit


async def test_a_key_whose_calls_keep_being_refused_is_refused_on_its_headers() -> None:
    """A retry loop resending one oversized body: past LLMESH_INVALID_CALLS_PER_MINUTE refusals,
    the key's calls are RESOURCE_EXHAUSTED with retry info, decided on the headers (over gRPC and
    HTTP alike), while another key's calls are still judged on their own."""
    other = "o" * 32
    env = {**ENV, "LLMESH_API_KEYS": f"{API_KEY}=acme;{other}=globex", "LLMESH_INVALID_CALLS_PER_MINUTE": "3"}
    payload = filled(gateway_pb2.GenerateRequest.DESCRIPTOR, "messages", SERVER_MAX - 64)
    keyed = (("authorization", f"Bearer {API_KEY}"),)
    async with hosted("gateway", GatewayApp, env) as gw:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{gw.port}", options=[("grpc.max_send_message_length", SERVER_MAX)]
        ) as channel:
            codes = [(await call_raw(channel, "Generate", payload, keyed)).code() for _ in range(3)]
            assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
            with peak_growth() as growth:
                for _ in range(10):
                    error = await call_raw(channel, "Generate", payload, keyed)
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
                    # The client's own call, whose 8 MiB body the server never let it send, is
                    # freed by the cycle collector: collected here, so the peak is the gateway's.
                    gc.collect()
            retry = unpack_details(status_details(error.trailing_metadata() or ())).get("retry_info")
            assert retry is not None and 0 < retry.retry_delay.seconds <= 60
            assert growth[0] <= MAX_RSS_GROWTH
            error = await call_raw(channel, "Generate", payload, (("authorization", f"Bearer {other}"),))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        base = f"http://127.0.0.1:{gw.app.http.port}"  # type: ignore[attr-defined]
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            empty = {"model": "m", "messages": []}
            mine = {"authorization": f"Bearer {API_KEY}"}
            throttled = await http.post("/v1/chat/completions", json=empty, headers=mine)
            assert throttled.status_code == 429
            assert 0 < int(throttled.headers["retry-after"]) <= 60
            judged = await http.post("/v1/chat/completions", json=empty, headers={"authorization": f"Bearer {other}"})
            assert judged.status_code == 400


class CountingProxy:
    """A TCP relay in front of a server that counts the bytes a client got through to it:
    what the server's flow control let the client send."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent_to_server = 0
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for relay in self._relays:
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        for reader, writer, upstream in ((client_r, server_w, True), (server_r, client_w, False)):
            relay = asyncio.create_task(self._relay(reader, writer, upstream))
            self._relays.add(relay)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(64 * 1024):
                writer.write(data)
                await writer.drain()
                if upstream:
                    self.sent_to_server += len(data)
        writer.close()


async def test_a_call_refused_on_its_headers_is_not_let_send_its_body() -> None:
    """Refusing on the metadata is not enough if HTTP/2 flow control has already opened a window
    of megabytes: the gateway would still receive, and throw away, every byte of each refused
    call. The server grants a stream window only for the message it reads, so a refused 8 MiB
    call gets no further than the first window."""
    payload = filled(gateway_pb2.GenerateRequest.DESCRIPTOR, "messages", SERVER_MAX - 64)
    async with hosted("gateway", GatewayApp, {**ENV, "LLMESH_API_KEYS": f"{API_KEY}=acme"}) as gw:
        proxy = CountingProxy(gw.port)
        async with proxy as port:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", SERVER_MAX)]
            ) as channel:
                for _ in range(3):  # a first window, then the windows a bandwidth probe would grow
                    error = await call_raw(channel, "Generate", payload)
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert proxy.sent_to_server < MB, proxy.sent_to_server
