"""`python -m bench.cache`: is the answer cache accurate, and is a hit cheap?

1. Accuracy: the labelled question pairs (bench/data/cache_pairs.jsonl) through the real
   MiniLM embeddings and the near-hit guard: precision/recall at the chosen threshold and the
   curve over thresholds (bench.cache_eval).
2. Latency through the running gateway (five processes, real models), one client at a time:
   exact hit, semantic hit, miss (a real generation).
3. Throughput with 64 concurrent clients: exact hits through the gateway over gRPC and over
   its OpenAI-compatible HTTP API (aiohttp keep-alive clients), and in the same run the same
   load generator against a bare grpc.aio relay -> echo pair of processes (what the framework
   itself manages for two hops on this machine).
Writes bench/results/cache.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc

from bench import cache_eval
from bench.common import machine, percentile, print_table, write_result
from bench.load import closed_loop, http_closed_loop
from bench.mesh import bench_mesh
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "What is the largest planet in the solar system?",
    "What language is spoken in Brazil?",
    "How many days are there in a week?",
]
PARAPHRASES = [
    "what's the capital city of France?",
    "How many legs do spiders have?",
    "What colour is the sky on a clear day?",
    "Who is the author of Romeo and Juliet?",
]


def request(prompt: str, use_cache: bool = True) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        use_cache=use_cache,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=32),
    )


async def timed(stub: gateway_pb2_grpc.GatewayStub, req: gateway_pb2.GenerateRequest) -> tuple[float, Any]:
    started = time.perf_counter()
    reply = await stub.Generate(req, timeout=120)
    return time.perf_counter() - started, reply


async def latencies(target: str, repeats: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        misses = []
        for q in QUESTIONS:  # each first ask is a miss: a real generation, then stored
            seconds, reply = await timed(stub, request(q))
            assert not reply.cache.hit
            misses.append(seconds)
        exact, semantic, semantic_tiers = [], [], []
        for _ in range(repeats):
            for q in QUESTIONS:
                seconds, reply = await timed(stub, request(q))
                assert reply.cache.hit and reply.cache.tier == common_pb2.CACHE_TIER_EXACT
                exact.append(seconds)
        for _ in range(max(1, repeats // 4)):
            for p in PARAPHRASES:
                seconds, reply = await timed(stub, request(p))
                semantic_tiers.append(reply.cache.tier)
                if reply.cache.tier == common_pb2.CACHE_TIER_SEMANTIC:
                    semantic.append(seconds)
    return {
        "exact_hit_p50_ms": percentile(exact, 0.5) * 1000,
        "exact_hit_p99_ms": percentile(exact, 0.99) * 1000,
        "semantic_hit_p50_ms": percentile(semantic, 0.5) * 1000 if semantic else None,
        "semantic_hits": len(semantic),
        "semantic_asks": len(semantic_tiers),
        "miss_p50_ms": percentile(misses, 0.5) * 1000,
    }


def start_echo_chain() -> tuple[list[subprocess.Popen[str]], str]:
    def spawn(*args: str) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen([sys.executable, "-m", "bench.echo_chain", *args], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        return proc, int(proc.stdout.readline())

    echo, echo_port = spawn("echo", "0")
    relay, relay_port = spawn("relay", "0", f"127.0.0.1:{echo_port}")
    return [relay, echo], f"127.0.0.1:{relay_port}"


def chat_body(model: str, prompt: str) -> dict[str, Any]:
    """The OpenAI-API twin of `request(prompt)`: same prompt, sampling and tenant, so the same
    cache entry answers both."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "llmesh": {"use_retrieval": False},
    }


def check_http_hit(base_url: str) -> str:
    """The served model's id, after checking that the HTTP API answers a cached question from the cache."""
    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps(chat_body(model, QUESTIONS[0])).encode()
    post = urllib.request.Request(f"{base_url}/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(post, timeout=30) as reply:
        cache = json.load(reply)["llmesh"]["cache"]
    assert cache["hit"] and cache["tier"] == "exact", cache
    return str(model)


async def throughput(gateway: str, http_base: str, chain: str, clients: int, seconds: float) -> dict[str, Any]:
    def hit(i: int) -> gateway_pb2.GenerateRequest:
        return request(QUESTIONS[i % len(QUESTIONS)])

    model = check_http_hit(http_base)

    def http_hit(i: int) -> dict[str, Any]:
        return chat_body(model, QUESTIONS[i % len(QUESTIONS)])

    # Alternate short rounds so every target sees the same machine load.
    ok = {"gateway": 0, "http": 0, "chain": 0}
    spent = {"gateway": 0.0, "http": 0.0, "chain": 0.0}
    errors: dict[str, int] = {}
    rounds = 3
    for _ in range(rounds):
        measured = {
            "gateway": await closed_loop(gateway, hit, clients, seconds / rounds),
            "http": await http_closed_loop(f"{http_base}/chat/completions", http_hit, clients, seconds / rounds),
            "chain": await closed_loop(chain, hit, clients, seconds / rounds),
        }
        for name, load in measured.items():
            ok[name] += load.ok
            spent[name] += load.seconds
            for k, v in load.errors.items():
                errors[f"{name}: {k}"] = errors.get(f"{name}: {k}", 0) + v
    return {
        "exact_hit_rps": ok["gateway"] / spent["gateway"],
        "http_exact_hit_rps": ok["http"] / spent["http"],
        "echo_chain_rps": ok["chain"] / spent["chain"],
        "load_errors": errors,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args(argv)

    accuracy = cache_eval.run()
    result: dict[str, Any] = {
        "semantic_threshold": accuracy["threshold"],
        "semantic_precision": accuracy["semantic_precision"],
        "semantic_recall": accuracy["semantic_recall"],
        "pairs": accuracy["pairs"],
        "curve": accuracy["curve"],
    }
    env = {"LLMESH_SEMANTIC_THRESHOLD": str(accuracy["threshold"])}
    with bench_mesh(env) as mesh:
        target = mesh.target("gateway")
        result.update(asyncio.run(latencies(target, args.repeats)))
        procs, chain = start_echo_chain()
        try:
            http_base = mesh.procs["gateway"].http_base_url()
            result.update(asyncio.run(throughput(target, http_base, chain, args.clients, args.seconds)))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    result["miss_over_exact_hit"] = result["miss_p50_ms"] / result["exact_hit_p50_ms"]
    result["exact_hit_rps_over_echo_chain"] = result["exact_hit_rps"] / result["echo_chain_rps"]
    result["http_over_grpc_exact_hit_rps"] = result["http_exact_hit_rps"] / result["exact_hit_rps"]
    semantic_p50 = result["semantic_hit_p50_ms"]
    result["passes"] = {
        "semantic_precision>=0.97": result["semantic_precision"] >= 0.97,
        "semantic_recall>=0.6": result["semantic_recall"] >= 0.6,
        "exact_hit_p50_ms<=5": result["exact_hit_p50_ms"] <= 5,
        "semantic_hit_p50_ms<=30": semantic_p50 is not None and semantic_p50 <= 30,
        "miss/exact_hit>=50": result["miss_over_exact_hit"] >= 50,
        "exact_hit_rps>=0.6*echo_chain_rps": result["exact_hit_rps_over_echo_chain"] >= 0.6,
        "http_exact_hit_rps>=0.5*exact_hit_rps": result["http_over_grpc_exact_hit_rps"] >= 0.5,
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if k not in ("curve", "passes", "machine")}, "bench.cache")
    print_table(result["passes"], "targets")
    print(f"wrote {write_result('cache', result)}")


if __name__ == "__main__":
    main()
