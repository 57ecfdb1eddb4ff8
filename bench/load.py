"""A closed-loop load generator: N concurrent clients, each sending its next request when the
last one ends, for a fixed time; the same generator drives every target compared in a run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmesh.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass
class LoadResult:
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0


async def closed_loop(
    target: str,
    make_request: Callable[[int], gateway_pb2.GenerateRequest],
    clients: int,
    seconds: float,
    channels: int = 4,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> LoadResult:
    result = LoadResult()
    pool = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    stubs = [gateway_pb2_grpc.GatewayStub(c) for c in pool]
    stop_at = time.perf_counter() + seconds

    async def client(i: int) -> None:
        stub = stubs[i % len(stubs)]
        n = 0
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                await stub.Generate(make_request(i * 1_000_003 + n), timeout=30, metadata=metadata)
                result.ok += 1
                result.latencies.append(time.perf_counter() - started)
            except grpc.aio.AioRpcError as err:
                result.errors[err.code().name] = result.errors.get(err.code().name, 0) + 1
            n += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    result.seconds = time.perf_counter() - started
    for channel in pool:
        await channel.close()
    return result


async def http_closed_loop(
    url: str,
    make_body: Callable[[int], dict[str, Any]],
    clients: int,
    seconds: float,
    headers: dict[str, str] | None = None,
) -> LoadResult:
    """The same closed loop against an HTTP JSON endpoint (the gateway's OpenAI-compatible API),
    over keep-alive connections, one per client (aiohttp: the cheapest Python HTTP client, so
    the client costs about what grpc.aio's does)."""
    import aiohttp

    result = LoadResult()
    stop_at = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:

        async def client(i: int) -> None:
            n = 0
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    async with session.post(url, json=make_body(i * 1_000_003 + n)) as reply:
                        await reply.read()
                        if reply.status == 200:
                            result.ok += 1
                            result.latencies.append(time.perf_counter() - started)
                        else:
                            key = f"HTTP {reply.status}"
                            result.errors[key] = result.errors.get(key, 0) + 1
                except (TimeoutError, aiohttp.ClientError) as err:
                    result.errors[type(err).__name__] = result.errors.get(type(err).__name__, 0) + 1
                n += 1

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        result.seconds = time.perf_counter() - started
    return result
