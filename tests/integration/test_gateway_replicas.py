"""A model's replicas behind the gateway, on real gRPC servers on port 0: a Generate
that fails before its first token is retried once on another replica, never after it; a replica
that goes away is ejected and its requests served by the others, and it rejoins once it is back."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from llmesh.testing import hosted
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.gateway.peers import Deadline, PeerCallError, Peers
from services.gateway.replicas import RoutingConfig
from services.inference.servicer import InferenceApp


class Fake(inference_pb2_grpc.InferenceServicer):
    """`mode`: "ok" answers two tokens, "fail" fails before any, "fail_after" fails after one."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls = 0

    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return inference_pb2.ModelInfo(model_id="fake", sha256="0" * 64)

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.mode == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake failure")
        yield inference_pb2.InferenceResponse(token_ids=[1], text="a")
        if self.mode == "fail_after":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake failure after a token")
        usage = common_pb2.Usage(output_tokens=2)
        yield inference_pb2.InferenceResponse(
            token_ids=[2], text="b", finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=usage
        )


async def serve(fake: Fake) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def routed_peers(replicas: list[str], config: RoutingConfig) -> Peers:
    target = "|".join(replicas)
    targets = {name: replicas[0] for name in ("tokenizer", "cache", "retrieval")} | {"inference": target}
    return Peers(targets, 4 * 1024 * 1024, probe_seconds=0, routing=config)


async def texts(stream: AsyncIterator[inference_pb2.InferenceResponse]) -> str:
    return "".join([m.text async for m in stream])


def ask(peers: Peers, tokens: int = 2) -> AsyncIterator[inference_pb2.InferenceResponse]:
    sampling = common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    return peers.generate([1, 2, 3], sampling, "r", Deadline.after(30))


async def test_a_failure_before_the_first_token_is_retried_on_another_replica_and_none_after() -> None:
    bad, good = Fake("fail"), Fake("ok")
    (s1, a1), (s2, a2) = await serve(bad), await serve(good)
    peers = routed_peers([a1, a2], RoutingConfig(pick="round_robin", eject_consecutive_failures=100))
    await peers.start()
    try:
        for _ in range(6):
            assert await texts(ask(peers)) == "ab"  # every request answered, half of them on a retry
        assert bad.calls == 3 and good.calls == 6
        assert peers.routers[""].set.budget.retries == 3
        # After the first token: the failure is the caller's, and no other replica is asked.
        bad.mode = good.mode = "fail_after"
        calls = bad.calls + good.calls
        with pytest.raises(PeerCallError, match="after a token"):
            await texts(ask(peers))
        assert bad.calls + good.calls == calls + 1
    finally:
        await peers.close()
        await s1.stop(None)
        await s2.stop(None)


async def test_failures_eject_a_replica_and_the_retry_budget_bounds_retries() -> None:
    bad, good = Fake("fail"), Fake("ok")
    (s1, a1), (s2, a2) = await serve(bad), await serve(good)
    peers = routed_peers([a1, a2], RoutingConfig(pick="round_robin", eject_consecutive_failures=2))
    await peers.start()
    router = peers.routers[""]
    try:
        for _ in range(10):
            assert await texts(ask(peers)) == "ab"
        assert bad.calls == 2  # two failures in a row, then it is out
        assert router.set.replicas[a1].ejected and not router.set.replicas[a2].ejected
    finally:
        await peers.close()
        await s1.stop(None)
        await s2.stop(None)
    # The budget: with retries spent, a failure is the caller's.
    bad2, bad3 = Fake("fail"), Fake("fail")
    (s3, a3), (s4, a4) = await serve(bad2), await serve(bad3)
    peers = routed_peers([a3, a4], RoutingConfig(eject_consecutive_failures=100, retry_budget_burst=1))
    await peers.start()
    try:
        for _ in range(3):
            with pytest.raises(PeerCallError):
                await texts(ask(peers))
        assert bad2.calls + bad3.calls == 4  # one retry (the burst), then none: 0.1 a request earned
    finally:
        await peers.close()
        await s3.stop(None)
        await s4.stop(None)


async def test_a_replica_that_goes_away_is_ejected_and_rejoins(models_dir: Path, tiny_model: Path) -> None:
    env = {"LLMESH_MODELS_DIR": str(models_dir), "LLMESH_INFERENCE_MODEL": "tiny", "LLMESH_MAX_BATCH_SIZE": "4"}
    async with hosted("inference", InferenceApp, env) as one, hosted("inference", InferenceApp, env) as two:
        three = contextlib.AsyncExitStack()
        host = await three.enter_async_context(hosted("inference", InferenceApp, env))
        addresses = [f"127.0.0.1:{h.port}" for h in (one, two, host)]
        peers = routed_peers(addresses, RoutingConfig())
        await peers.start()
        router = peers.routers[""]
        try:
            await router.wait_for(lambda rs: all(r.load is not None for r in rs.replicas.values()), 30)
            for _ in range(6):
                assert await texts(ask(peers, 4))
            gone = router.set.replicas[addresses[2]]
            await three.aclose()
            # Stopped: ejected (its health check and load stream fail); the others serve.
            await router.wait_for(lambda rs: gone.ejected, 10)
            for _ in range(6):
                assert await texts(ask(peers, 4))
            assert not gone.flights
            # Back on the same port: it rejoins once its backoff is over and its health passes.
            port = addresses[2].rpartition(":")[2]
            async with hosted("inference", InferenceApp, {**env, "LLMESH_LISTEN": f"127.0.0.1:{port}"}):
                await router.wait_for(lambda rs: not gone.ejected and gone.load is not None, 30)
                assert not any(r.ejected for r in router.set.replicas.values())
        finally:
            await peers.close()
            await three.aclose()
