"""`python -m bench.tracing`: what tracing costs. Two meshes side by side in one run, one
exporting every span over OTLP/gRPC to a receiver on loopback, one with tracing off
(OTEL_SDK_DISABLED), driven alternately by the same client. Cache hits (where overhead shows
most) come from `--clients` concurrent closed-loop callers, each round on one mesh then the
other (the order alternates): p50, p99 and the rate of hits on each, plus the p50 of
generations. Writes bench/results/tracing.json.

Targets: hit p50 within 10%, hit p99 within 20% (`hit_p99_ratio <= 1.2`) and at least 95% of
the rate (`hit_rps_ratio >= 0.95`) with export on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import grpc

from bench.common import machine, percentile, print_table, write_result
from bench.mesh import bench_mesh
from llmesh.testing import OtlpReceiver
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = ["What is the capital of France?", "Name a primary color.", "What is two plus two?"]


def request(prompt: str, use_cache: bool) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, use_cache=use_cache, use_retrieval=False, sampling=common_pb2.SamplingParams(max_new_tokens=16)
    )


async def hits(
    stub: gateway_pb2_grpc.GatewayStub, clients: int, per_client: int, failures: list[str] | None = None
) -> tuple[list[float], float]:
    """`clients` callers, each sending `per_client` cached requests one after another: every
    latency, and the hits per second of the round. A call that fails is counted in `failures`."""
    latencies: list[float] = []

    async def caller(i: int) -> None:
        for n in range(per_client):
            started = time.perf_counter()
            try:
                await stub.Generate(request(PROMPTS[(i + n) % len(PROMPTS)], True), timeout=60)
            except grpc.aio.AioRpcError as err:
                if failures is None:
                    raise
                failures.append(err.code().name)
                continue
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(clients)))
    return latencies, len(latencies) / (time.perf_counter() - started)


async def measure(
    targets: dict[str, str], rounds: int, generations: int, clients: int, per_client: int
) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {name: {"hit": [], "rps": [], "generate": []} for name in targets}
    failed: dict[str, list[str]] = {name: [] for name in targets}
    channels = {name: grpc.aio.insecure_channel(t) for name, t in targets.items()}
    stubs = {name: gateway_pb2_grpc.GatewayStub(c) for name, c in channels.items()}
    for stub in stubs.values():  # warm: fill each mesh's cache, open every path once
        for p in PROMPTS:
            await stub.Generate(request(p, True), timeout=120)
        await hits(stub, clients, 10)
    for i in range(rounds):
        order = list(stubs.items()) if i % 2 == 0 else list(reversed(stubs.items()))
        for name, stub in order:
            latencies, rate = await hits(stub, clients, per_client, failed[name])
            samples[name]["hit"].extend(latencies)
            samples[name]["rps"].append(rate)
        if i < generations:
            for name, stub in order:
                started = time.perf_counter()
                await stub.Generate(request(PROMPTS[i % len(PROMPTS)], False), timeout=120)
                samples[name]["generate"].append(time.perf_counter() - started)
    for channel in channels.values():
        await channel.close()
    for name, codes in failed.items():
        samples[name]["failed"] = [float(len(codes))]
        if codes:
            print(f"{name}: {len(codes)} cached requests failed ({', '.join(sorted(set(codes)))})", flush=True)
    return samples


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds, each on both meshes (order alternating)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent callers of cached answers")
    parser.add_argument("--per-client", type=int, default=150, help="cached requests per caller per round")
    parser.add_argument("--generations", type=int, default=6)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)
    receiver = OtlpReceiver(keep_spans=False)  # stands in for Jaeger: receives, counts, keeps nothing
    common = {"LLMESH_INFERENCE_MODEL": args.model}
    traced = {
        **common,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    untraced = {**common, "OTEL_SDK_DISABLED": "true"}
    with contextlib.ExitStack() as stack:
        on = stack.enter_context(bench_mesh(traced, redis_db=10))
        off = stack.enter_context(bench_mesh(untraced, redis_db=11))
        samples = asyncio.run(
            measure(
                {"on": on.target("gateway"), "off": off.target("gateway")},
                args.rounds,
                args.generations,
                args.clients,
                args.per_client,
            )
        )
    receiver.close()
    result: dict[str, Any] = {}
    for name in ("on", "off"):
        s = samples[name]
        result[f"hit_p50_ms_{name}"] = percentile(s["hit"], 0.5) * 1000
        result[f"hit_p99_ms_{name}"] = percentile(s["hit"], 0.99) * 1000
        result[f"hit_rps_{name}"] = sum(s["rps"]) / len(s["rps"])
        result[f"generate_p50_ms_{name}"] = percentile(s["generate"], 0.5) * 1000
    result.update(
        {
            "overhead_ratio": result["hit_p50_ms_on"] / result["hit_p50_ms_off"],
            "hit_p99_ratio": result["hit_p99_ms_on"] / result["hit_p99_ms_off"],
            "hit_rps_ratio": result["hit_rps_on"] / result["hit_rps_off"],
            "generate_overhead_ratio": result["generate_p50_ms_on"] / result["generate_p50_ms_off"],
            "hit_rps_runs_on": [round(r, 1) for r in samples["on"]["rps"]],
            "hit_rps_runs_off": [round(r, 1) for r in samples["off"]["rps"]],
            "hits_per_mesh": len(samples["on"]["hit"]),
            "hit_failures_on": int(samples["on"]["failed"][0]),
            "hit_failures_off": int(samples["off"]["failed"][0]),
            "clients": args.clients,
            "spans_received": receiver.count,
            "model": args.model,
        }
    )
    result["passes"] = {
        "overhead_ratio<=1.10": result["overhead_ratio"] <= 1.10,
        "hit_p99_ratio<=1.2": result["hit_p99_ratio"] <= 1.2,
        "hit_rps_ratio>=0.95": result["hit_rps_ratio"] >= 0.95,
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if not isinstance(v, dict | list)}, "bench.tracing")
    print_table(result["passes"], "targets")
    print(f"wrote {write_result('tracing', result)}")


if __name__ == "__main__":
    main()
