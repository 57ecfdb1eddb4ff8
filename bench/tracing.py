"""`python -m bench.tracing`: what tracing costs. Two meshes side by side in one run, one
exporting every span over OTLP/gRPC to a receiver on loopback, one with tracing off
(OTEL_SDK_DISABLED), driven alternately by the same client; gateway p50 latency compared for
cache hits (where overhead shows most) and for generations. Writes bench/results/tracing.json.
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


async def measure(targets: dict[str, str], rounds: int, generations: int) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {name: {"hit": [], "generate": []} for name in targets}
    channels = {name: grpc.aio.insecure_channel(t) for name, t in targets.items()}
    stubs = {name: gateway_pb2_grpc.GatewayStub(c) for name, c in channels.items()}
    for stub in stubs.values():  # warm: fill each mesh's cache
        for p in PROMPTS:
            await stub.Generate(request(p, True), timeout=120)
    for i in range(rounds):
        order = list(stubs.items()) if i % 2 == 0 else list(reversed(stubs.items()))
        for name, stub in order:
            for p in PROMPTS:
                started = time.perf_counter()
                await stub.Generate(request(p, True), timeout=60)
                samples[name]["hit"].append(time.perf_counter() - started)
        if i < generations:
            for name, stub in order:
                started = time.perf_counter()
                await stub.Generate(request(PROMPTS[i % len(PROMPTS)], False), timeout=120)
                samples[name]["generate"].append(time.perf_counter() - started)
    for channel in channels.values():
        await channel.close()
    return samples


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--generations", type=int, default=12)
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
            measure({"on": on.target("gateway"), "off": off.target("gateway")}, args.rounds, args.generations)
        )
    receiver.close()
    p50 = {
        f"{kind}_p50_ms_{name}": percentile(samples[name][kind], 0.5) * 1000
        for name in ("on", "off")
        for kind in ("hit", "generate")
    }
    result: dict[str, Any] = {
        **p50,
        "overhead_ratio": p50["hit_p50_ms_on"] / p50["hit_p50_ms_off"],
        "generate_overhead_ratio": p50["generate_p50_ms_on"] / p50["generate_p50_ms_off"],
        "spans_received": receiver.count,
        "model": args.model,
    }
    result["passes"] = {"overhead_ratio<=1.10": result["overhead_ratio"] <= 1.10}
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if k not in ("passes", "machine")}, "bench.tracing")
    print_table(result["passes"], "targets")
    print(f"wrote {write_result('tracing', result)}")


if __name__ == "__main__":
    main()
