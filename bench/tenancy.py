"""`python -m bench.cache --tenancy`: what running llmesh as a shared service costs a cache hit.

One mesh (five processes, real models) and two gateways over the same cache, side by side, both
with the admission window on the shared Redis and both authenticating the same API key (the
callers send it to both): `off` has it from LLMESH_API_KEYS, no limits, usage counters off; `on`
has it from the keys file with per-key limits (rpm, tpm, tpd; enforced cluster-wide through that
Redis) and the per-tenant usage counters on. The same exact-hit load, in alternating rounds,
over gRPC and over the HTTP API. Target: on >= 0.9 x off. Writes bench/results/cache_tenancy.json.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from bench.cache_questions import QUESTIONS, chat_body
from bench.common import machine, print_table, write_result
from bench.load import closed_loop, http_closed_loop
from bench.mesh import bench_mesh
from llmesh import keys_file
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

TENANT = "bench"
# Limits no run reaches, so every request pays for being checked and counted, none is refused.
LIMITS = {"rpm": 1_000_000_000, "tpm": 1_000_000_000_000, "tpd": 1_000_000_000_000}


def request(prompt: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt, tenant=TENANT, use_retrieval=False, sampling=common_pb2.SamplingParams(max_new_tokens=32)
    )


async def fill(target: str, key: str) -> None:
    """Each question asked until it is a hit (a miss generates and stores it in the background)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = (("authorization", f"Bearer {key}"),)
        for q in QUESTIONS:
            for _ in range(100):
                if (await stub.Generate(request(q), timeout=300, metadata=metadata)).cache.hit:
                    break
                await asyncio.sleep(0.1)


async def check_hits(targets: dict[str, str], metadata: dict[str, Any]) -> None:
    for name, target in targets.items():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for q in QUESTIONS:
                reply = await stub.Generate(request(q), timeout=60, metadata=metadata[name])
                assert reply.cache.hit, f"the {name} gateway missed the cache"


def served_model(base_url: str, key: str) -> str:
    listing = urllib.request.Request(f"{base_url}/models", headers={"authorization": f"Bearer {key}"})
    with urllib.request.urlopen(listing, timeout=30) as reply:
        return str(json.load(reply)["data"][0]["id"])


async def measure(targets: dict[str, str], http: dict[str, str], key: str, clients: int, seconds: float) -> dict:
    metadata: dict[str, Any] = {name: (("authorization", f"Bearer {key}"),) for name in ("off", "on")}
    headers: dict[str, Any] = {name: {"authorization": f"Bearer {key}"} for name in ("off", "on")}
    await check_hits(targets, metadata)
    model = await asyncio.to_thread(served_model, http["off"], key)

    def hit(i: int) -> gateway_pb2.GenerateRequest:
        return request(QUESTIONS[i % len(QUESTIONS)])

    def http_hit(i: int) -> dict[str, Any]:
        body = chat_body(model, QUESTIONS[i % len(QUESTIONS)])
        body["llmesh"]["tenant"] = TENANT
        return body

    ok: dict[str, int] = {}
    spent: dict[str, float] = {}
    errors: dict[str, int] = {}
    rounds = 8
    for i in range(rounds):
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):  # each goes first as often
            grpc_load = await closed_loop(targets[name], hit, clients, seconds / rounds, metadata=metadata[name])
            http_load = await http_closed_loop(
                f"{http[name]}/chat/completions", http_hit, clients, seconds / rounds, headers[name]
            )
            for api, load in (("grpc", grpc_load), ("http", http_load)):
                ok[f"{api}_{name}"] = ok.get(f"{api}_{name}", 0) + load.ok
                spent[f"{api}_{name}"] = spent.get(f"{api}_{name}", 0.0) + load.seconds
                for k, v in load.errors.items():
                    errors[f"{api}_{name}: {k}"] = errors.get(f"{api}_{name}: {k}", 0) + v
    rps = {f"{k}_exact_hit_rps": ok[k] / spent[k] for k in ok}
    return {**rps, "load_errors": errors}


def main(clients: int = 64, seconds: float = 15.0) -> None:
    result: dict[str, Any] = {"machine_at_start": machine()}
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-tenancy-") as tmp:
        path = Path(tmp) / "keys.json"
        _, key = keys_file.create(path, TENANT, name="bench", rpm=LIMITS["rpm"], tpm=LIMITS["tpm"], tpd=LIMITS["tpd"])
        # off: the same key, authenticated, without limits; no usage counters.
        with bench_mesh({"LLMESH_USAGE_METRICS": "false", "LLMESH_API_KEYS": f"{key}={TENANT}"}) as mesh:
            shared = mesh.base_env["LLMESH_REDIS_URL"].rpartition("/")[0] + "/13"
            # The cache filled through a gateway that is then replaced: the two measured start
            # alike (neither has generated, so neither has learned a throughput to admit by).
            asyncio.run(fill(mesh.target("gateway"), key))
            mesh.stop_one("gateway")
            mesh.start_one("gateway", extra_env={"LLMESH_ADMISSION_REDIS_URL": shared})
            mesh.start_one(
                "gateway/tenancy",
                module="gateway",
                extra_env={
                    "LLMESH_ADMISSION_REDIS_URL": shared,
                    "LLMESH_API_KEYS": "",
                    "LLMESH_API_KEYS_FILE": str(path),
                    "LLMESH_USAGE_METRICS": "true",
                },
            )
            targets = {"off": mesh.target("gateway"), "on": mesh.target("gateway/tenancy")}
            http = {
                "off": mesh.procs["gateway"].http_base_url(),
                "on": mesh.procs["gateway/tenancy"].http_base_url(),
            }
            result.update(asyncio.run(measure(targets, http, key, clients, seconds)))
    result["grpc_on_over_off"] = result["grpc_on_exact_hit_rps"] / result["grpc_off_exact_hit_rps"]
    result["http_on_over_off"] = result["http_on_exact_hit_rps"] / result["http_off_exact_hit_rps"]
    result["passes"] = {
        "grpc_exact_hit_rps_on>=0.9*off": result["grpc_on_over_off"] >= 0.9,
        "http_exact_hit_rps_on>=0.9*off": result["http_on_over_off"] >= 0.9,
    }
    result["limits"] = LIMITS
    result["arms"] = {
        "off": "API key from LLMESH_API_KEYS (authenticated, no limits), LLMESH_USAGE_METRICS=false",
        "on": "the same key from LLMESH_API_KEYS_FILE with rpm/tpm/tpd limits (cluster-wide via Redis), usage on",
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if k not in ("passes", "machine", "machine_at_start")}, "tenancy")
    print_table(result["passes"], "targets")
    print(f"wrote {write_result('cache_tenancy', result)}")
