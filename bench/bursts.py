"""Bursts and mixed load on a warm, idle mesh with default admission settings.

    python -m bench.bursts [--model smollm2|tiny] [--mixed-seconds 20] [--overload-seconds 15] [--no-openai]

The five services as processes (bench.reliability's mesh: its own Redis, ingested documents),
the builtin engine, then, in one run:

* bursts     3 bursts each of 16 x 256 tokens, 32 x 64 and (the engine's batch room, as
             WatchLoad reports it) x 64, every request at once, EOS ignored, one burst after the
             other has ended: `burst_sheds` (RESOURCE_EXHAUSTED) in total; target 0.
* mixed      cached questions at full speed (4 closed-loop clients, primed) alone, then beside
             3 RAG clients and 3 plain clients (half of them streamed; 96-token answers), then
             alone again: `mixed_generation_sheds` (the RAG and plain clients' sheds; target 0)
             and `mixed_cached_rps_ratio` (cached answers per second beside the generation
             clients over the mean of the two runs alone; target >= 0.8). The full measurement
             runs 3 minutes; the default here is --mixed-seconds 20 per run to keep the run short.
* overload   plain requests arriving open loop (Poisson) at 4 x the rate the engine completed
             the full-batch bursts at, each with a 30 s deadline: `overload_shed_p99_ms` (time to
             a shed reply; target <= 50) and `overload_deadline_exceeded` (target 0).
* openai     (unless --no-openai) the bursts again with the inference service on the openai
             backend in front of vLLM's CPU build (.venv-vllm, the prepared SmolLM2):
             `openai_burst_sheds` (target 0).

Writes bench/results/bursts.json (with "passes") and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc

from bench.common import RESULTS_DIR, machine, percentile, print_table, write_result
from bench.harness.load import CACHED_QUESTIONS, FAQ, TENANT, Load, Outcome
from bench.reliability import Reliability, engine_rows
from llmesh.testing import VllmServer
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

BURST_PROMPT = "Tell me a long story about a lighthouse keeper and the sea, with many details."
MIXED_TOKENS = 96
OVERLOAD = 4.0
INFERENCE_NICE = 10


def burst_request(tokens: int, index: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=f"{BURST_PROMPT} (reader {index})",
        use_cache=False,
        use_retrieval=False,
        tenant=TENANT,
        sampling=common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True),
    )


class Bursts(Reliability):
    """bench.reliability's mesh and load clients, default admission settings."""

    def __init__(self, args: argparse.Namespace, inference_nice: int = INFERENCE_NICE) -> None:
        super().__init__(args)
        # Default admission and breaker settings: the reliability suite's shorter window and
        # breaker wait are its own.
        for name in ("LLMESH_ADMISSION_WINDOW_SECONDS", "LLMESH_ADMISSION_TENANT_SHARE", "LLMESH_BREAKER_WAIT_SECONDS"):
            self.mesh.base_env.pop(name, None)
        # On these shared cores the model's compute runs below the rest of the mesh, as it would on
        # cores of its own: the cached answers measure admission, not CPU contention.
        self.mesh.service_env.setdefault("inference", {})["LLMESH_NICE"] = str(inference_nice)

    async def start(self) -> None:
        if self.vllm is not None:
            self.vllm.start()
            await asyncio.to_thread(self.vllm.wait_ready)
        await asyncio.to_thread(self.start_redis)
        await asyncio.to_thread(self.mesh.start)
        self.remember_ports()
        self.load = Load(self.gateway_target(), MIXED_TOKENS)
        await self.ingest()

    async def stop(self) -> None:
        if self.load is not None:
            await self.load.close()
        await asyncio.to_thread(self.mesh.stop)
        self.kill_redis()
        if self.vllm is not None:
            self.vllm.stop()

    async def bursts(self, rows: int) -> dict[str, Any]:
        assert self.load is not None
        stub = gateway_pb2_grpc.GatewayStub(self.load.channels[0])
        # Warm: one request through every hop first (a warm, idle mesh).
        await stub.Generate(burst_request(8, -1), timeout=120)
        shapes = [(16, 256), (32, 64), (rows, 64)]
        out: dict[str, Any] = {"engine_rows": rows, "bursts": []}
        sheds = errors = 0
        for count, tokens in shapes:
            for round_ in range(3):
                started = time.perf_counter()
                replies = await asyncio.gather(
                    *(stub.Generate(burst_request(tokens, round_ * 1000 + i), timeout=300) for i in range(count)),
                    return_exceptions=True,
                )
                shed = sum(
                    isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    for r in replies
                )
                failed = sum(isinstance(r, BaseException) for r in replies) - shed
                codes = Counter(
                    (r.code().name if isinstance(r, grpc.aio.AioRpcError) else type(r).__name__)
                    for r in replies
                    if isinstance(r, BaseException)
                )
                sheds += shed
                errors += failed
                seconds = time.perf_counter() - started
                tokens_out = sum(r.usage.output_tokens for r in replies if not isinstance(r, BaseException))
                out["bursts"].append(
                    {
                        "requests": count,
                        "max_new_tokens": tokens,
                        "shed": shed,
                        "errors": failed,
                        "error_codes": dict(codes),
                        "seconds": round(seconds, 2),
                        "tok_s": round(tokens_out / seconds, 1),
                    }
                )
                print(f"burst {count} x {tokens}: {shed} shed, {dict(codes)} errors, {seconds:.1f}s", flush=True)
        out["burst_sheds"] = sheds
        out["burst_errors"] = errors
        return out

    async def prime_cached(self) -> None:
        assert self.load is not None
        stub = gateway_pb2_grpc.GatewayStub(self.load.channels[0])
        sampling = common_pb2.SamplingParams(max_new_tokens=MIXED_TOKENS)
        for question in CACHED_QUESTIONS:
            for _ in range(20):
                request = gateway_pb2.GenerateRequest(prompt=question, sampling=sampling, collection=FAQ, tenant=TENANT)
                try:
                    if (await stub.Generate(request, timeout=120)).cache.hit:
                        break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.5)

    async def mixed(self, seconds: float) -> dict[str, Any]:
        assert self.load is not None
        await self.prime_cached()
        await self.prime()  # RAG answers cached too (the RAG clients ask with use_cache=False)
        cached_only = {"cached": 1.0}
        mix = {"cached": 1.0, "rag": 1.0, "plain": 1.0}  # pinned: clients 0,3,6,9 cached; 1,4,7 rag; 2,5,8 plain

        async def run(clients: int, kinds: dict[str, float]) -> tuple[list[Outcome], float]:
            return await self.load.for_seconds(clients, seconds, mix=kinds, deadline=60.0, pinned=True)  # type: ignore[union-attr]

        def cached_rps(outcomes: Sequence[Outcome], elapsed: float) -> float:
            return sum(o.ok and o.kind == "cached" for o in outcomes) / max(elapsed, 1e-9)

        alone_before = await run(4, cached_only)
        together, together_s = await run(10, mix)
        alone_after = await run(4, cached_only)
        alone = (cached_rps(*alone_before) + cached_rps(*alone_after)) / 2
        beside = cached_rps(together, together_s)
        generation = [o for o in together if o.kind in ("rag", "plain")]
        return {
            "seconds_per_run": seconds,
            "cached_rps_alone": round(alone, 1),
            "cached_rps_beside_generation": round(beside, 1),
            "mixed_cached_rps_ratio": round(beside / alone, 3) if alone else None,
            "generation_requests": len(generation),
            "generation_ok": sum(o.ok for o in generation),
            "mixed_generation_sheds": sum(o.shed for o in generation),
            "mixed_generation_errors": sum(o.error for o in generation),
            "by_kind_ok": {k: sum(o.ok and o.kind == k for o in together) for k in mix},
        }

    async def overload(self, capacity_rps: float, seconds: float) -> dict[str, Any]:
        """Open loop: plain requests arriving (Poisson) at OVERLOAD x the rate the engine
        completed them in the bursts, each with a 30 s deadline."""
        assert self.load is not None
        rate = OVERLOAD * capacity_rps
        print(f"overload: {rate:.1f} requests/s for {seconds:.0f}s", flush=True)
        rng = random.Random(11)
        tasks: list[asyncio.Task[Outcome]] = []
        started = time.perf_counter()
        next_at = started
        while next_at - started < seconds:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process's own clock, not synchronisation
            request = self.load.request("plain", rng)
            tasks.append(asyncio.create_task(self.load.call("plain", request, False, 30.0, len(tasks))))
            next_at += rng.expovariate(rate)
        outcomes = list(await asyncio.gather(*tasks))
        elapsed = time.perf_counter() - started
        sheds = [o for o in outcomes if o.shed]
        return {
            "offered_requests_per_s": round(rate, 2),
            "capacity_requests_per_s": round(capacity_rps, 2),
            "offered_over_capacity": OVERLOAD,
            "requests": len(outcomes),
            "seconds": round(elapsed, 1),
            "ok": sum(o.ok for o in outcomes),
            "shed": len(sheds),
            "shed_without_retry_info": sum(not o.retry_info for o in sheds),
            "overload_shed_p99_ms": round(percentile([o.latency for o in sheds], 0.99) * 1000, 1) if sheds else None,
            "overload_deadline_exceeded": sum(o.code == "DEADLINE_EXCEEDED" for o in outcomes),
            "lost": sum(o.code == "LOST" for o in outcomes),
            "ok_p50_s": round(percentile([o.latency for o in outcomes if o.ok], 0.5), 3),
        }


def capacity_rps(bursts: dict[str, Any]) -> float:
    """Requests per second the engine completed in its fastest full-batch burst of 64 tokens."""
    full = [b for b in bursts["bursts"] if b["max_new_tokens"] == 64 and not b["errors"]]
    return max((b["requests"] / b["seconds"] for b in full), default=1.0)


def bench_args(model: str, backend: str) -> argparse.Namespace:
    return argparse.Namespace(model=model, backend=backend, gateway_nice=-5, client_nice=0, new_tokens=MIXED_TOKENS)


async def builtin_run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bursts(bench_args(args.model, "builtin"), args.inference_nice)
    try:
        await bench.start()
        rows = await engine_rows(bench.mesh.target("inference")) or 32
        result: dict[str, Any] = {"bursts": await bench.bursts(rows)}
        print("mixed load", flush=True)
        result["mixed"] = await bench.mixed(args.mixed_seconds)
        result["overload"] = await bench.overload(capacity_rps(result["bursts"]), args.overload_seconds)
        return result
    finally:
        await bench.stop()
        bench.cleanup()


async def openai_run(inference_nice: int) -> dict[str, Any]:
    bench = Bursts(bench_args("smollm2", "openai"), inference_nice)
    try:
        await bench.start()
        # vLLM does not report its batch room (max_num_seqs); 32 is what bench.backends offers it.
        return await bench.bursts(await engine_rows(bench.mesh.target("inference")) or 32)
    finally:
        await bench.stop()
        bench.cleanup()


def passes(result: dict[str, Any]) -> dict[str, bool]:
    out = {
        "burst_sheds_zero": result["burst_sheds"] == 0,
        "mixed_generation_sheds_zero": result["mixed_generation_sheds"] == 0,
        "mixed_cached_rps_ratio_ge_0_8": (result["mixed_cached_rps_ratio"] or 0) >= 0.8,
        "overload_shed_p99_le_50ms": result["overload_shed_p99_ms"] is not None
        and result["overload_shed_p99_ms"] <= 50,
        "overload_no_deadline_exceeded": result["overload_deadline_exceeded"] == 0,
    }
    if result.get("openai_burst_sheds") is not None:
        out["openai_burst_sheds_zero"] = result["openai_burst_sheds"] == 0
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="builtin engine's model: smollm2 (default) or tiny")
    parser.add_argument("--mixed-seconds", type=float, default=20.0, help="each mixed-load run (a full run: 180)")
    parser.add_argument("--overload-seconds", type=float, default=15.0)
    parser.add_argument("--no-openai", action="store_true", help="skip the openai backend (vLLM CPU) bursts")
    parser.add_argument(
        "--keep-openai", action="store_true", help="with --no-openai: keep the openai figures of the last run"
    )
    parser.add_argument(
        "--inference-nice", type=int, default=INFERENCE_NICE, help="niceness of the inference process (default 10)"
    )
    args = parser.parse_args(argv)
    random.seed(0)
    builtin = asyncio.run(builtin_run(args))
    result: dict[str, Any] = {
        "model": args.model,
        "burst_sheds": builtin["bursts"]["burst_sheds"],
        "mixed_generation_sheds": builtin["mixed"]["mixed_generation_sheds"],
        "mixed_cached_rps_ratio": builtin["mixed"]["mixed_cached_rps_ratio"],
        "overload_shed_p99_ms": builtin["overload"]["overload_shed_p99_ms"],
        "overload_deadline_exceeded": builtin["overload"]["overload_deadline_exceeded"],
        "openai_burst_sheds": None,
        "builtin": builtin,
    }
    if not args.no_openai and VllmServer.available():
        openai = asyncio.run(openai_run(args.inference_nice))
        openai["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result["openai_burst_sheds"] = openai["burst_sheds"]
        result["openai"] = openai
    elif args.keep_openai and (RESULTS_DIR / "bursts.json").exists():
        # The openai figures of the previous run (vLLM's start takes minutes), dated as they were.
        previous = json.loads((RESULTS_DIR / "bursts.json").read_text())
        if previous.get("openai"):
            previous["openai"].setdefault("measured_at", previous.get("generated_at"))
            result["openai"] = previous["openai"]
            result["openai_burst_sheds"] = previous["openai"]["burst_sheds"]
    result["passes"] = passes(result)
    result["config"] = {
        "mixed_seconds": args.mixed_seconds,
        "overload_seconds": args.overload_seconds,
        "inference_nice": args.inference_nice,
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "bursts")
    print_table(result["passes"], "passes")
    print(f"wrote {write_result('bursts', result)}")


if __name__ == "__main__":
    main()
