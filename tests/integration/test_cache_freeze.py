"""A frozen cache never costs a caller its deadline: the mesh as processes (tokenizer, tiny-model
inference, cache, gateway), 16 closed-loop clients asking a cached question, the cache process
SIGSTOPped for a few seconds, several runs. Every call of a client with a 10 s deadline is
answered or shed (RESOURCE_EXHAUSTED), never DEADLINE_EXCEEDED, while clients with deadlines
shorter than the cache hop's budget share the same lookup batches."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.supervisor import Mesh
from llmesh.testing import eventually
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUNS = 3
LONG_CLIENTS, SHORT_CLIENTS = 12, 4
LONG_DEADLINE_S, SHORT_DEADLINE_S = 10.0, 0.2
#: How long the cache stays frozen: well past the cache hop's budget and the long deadline's share.
FREEZE_S = 3.0
#: Calls each phase waits for: the load is flowing before the freeze, and goes on after the thaw.
ANSWERED_BEFORE, ANSWERED_AFTER = 2 * LONG_CLIENTS, 2 * LONG_CLIENTS
QUESTIONS = [f"Cached question {i}: what is {i} times {i}?" for i in range(4)]


@pytest.fixture(scope="module")
def mesh(
    models_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> Iterator[Mesh]:
    tenant_db = module_redis_url  # a database of this module's own, flushed for it
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("freeze-data")),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_TOKENIZER_MODEL": "tiny",
        "LLMESH_REDIS_URL": tenant_db,
        "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1",
        "LLMESH_LOG_LEVEL": "WARNING",
        "QDRANT_URL": "",
    }
    with Mesh(env=env, services=("tokenizer", "inference", "cache", "gateway")) as running:
        yield running


def request(i: int, tenant: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=QUESTIONS[i % len(QUESTIONS)],
        tenant=tenant,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=4),
    )


async def served_from_cache(stub: gateway_pb2_grpc.GatewayStub, tenant: str) -> bool:
    return bool((await stub.Generate(request(0, tenant), timeout=60)).cache.hit)


async def load_with_a_freeze(target: str, cache_pid: int, tenant: str) -> tuple[Counter[str], Counter[str]]:
    """Codes of the long- and the short-deadline clients' calls, through one freeze."""
    long_codes: Counter[str] = Counter()
    short_codes: Counter[str] = Counter()
    ended = asyncio.Condition()  # notified as each call ends
    stop = asyncio.Event()
    channels = [grpc.aio.insecure_channel(target) for _ in range(4)]
    stubs = [gateway_pb2_grpc.GatewayStub(c) for c in channels]

    async def client(i: int, deadline: float, codes: Counter[str]) -> None:
        n = 0
        while not stop.is_set():
            try:
                await stubs[i % len(stubs)].Generate(request(i + n, tenant), timeout=deadline)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] += 1
            async with ended:
                ended.notify_all()
            n += 1

    async def calls_end(n: int) -> None:
        """Until `n` more long-deadline calls have ended."""
        target = long_codes.total() + n
        async with ended:
            await asyncio.wait_for(ended.wait_for(lambda: long_codes.total() >= target), 60)

    tasks = [asyncio.create_task(client(i, LONG_DEADLINE_S, long_codes)) for i in range(LONG_CLIENTS)]
    tasks += [asyncio.create_task(client(i, SHORT_DEADLINE_S, short_codes)) for i in range(SHORT_CLIENTS)]
    frozen = False
    try:
        await calls_end(ANSWERED_BEFORE)  # the freeze comes under load
        os.kill(cache_pid, signal.SIGSTOP)
        frozen = True
        await asyncio.sleep(FREEZE_S)  # simulated work: an outage of the cache this long
        os.kill(cache_pid, signal.SIGCONT)
        frozen = False
        await calls_end(ANSWERED_AFTER)  # and the thaw too
        stop.set()
        # Calls in flight end within their deadline.
        await asyncio.wait_for(asyncio.gather(*tasks), LONG_DEADLINE_S + 5)
    finally:
        if frozen:
            os.kill(cache_pid, signal.SIGCONT)
        stop.set()
        for task in tasks:
            task.cancel()
        for channel in channels:
            await channel.close()
    return long_codes, short_codes


async def test_a_frozen_cache_costs_no_caller_its_deadline(mesh: Mesh) -> None:
    target = mesh.target("gateway")
    cache_pid = mesh.procs["cache"].proc.pid
    for run in range(RUNS):
        tenant = f"freeze-{uuid.uuid4().hex[:6]}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for i in range(len(QUESTIONS)):  # cached before the load
                await stub.Generate(request(i, tenant), timeout=60)
            cached = functools.partial(served_from_cache, stub, tenant)
            await eventually(cached, 30.0, message="the answer was never cached")
        long_codes, short_codes = await load_with_a_freeze(target, cache_pid, tenant)
        assert long_codes["OK"] > 0 and short_codes, (run, long_codes, short_codes)
        assert long_codes["DEADLINE_EXCEEDED"] == 0, f"run {run}: {dict(long_codes)} (short: {dict(short_codes)})"
        assert set(long_codes) <= {"OK", "RESOURCE_EXHAUSTED"}, f"run {run}: {dict(long_codes)}"
