"""Batch API benchmark: a batch of short chat lines through the gateway on the builtin engine
(SmolLM2-135M-Instruct, the real prepared weights), alone and beside interactive traffic, and
across a gateway killed mid-batch. One run, side by side:

* batch_tok_s_alone         completion tokens/s of a batch of `--lines` short chat lines (distinct
                            questions, the answer cache off so every line is generated), from
                            the job's creation to its completion, nothing else running
* closed_loop_32_tok_s      bench.batching's closed loop of 32 streams (64 new tokens, EOS
                            ignored) straight on the inference service, the same run and engine:
                            what the engine does flat out
* interactive_ttft_p95_s_alone     time to first token of 4 closed-loop streaming chat clients
                            (HTTP, the openai wire format) on the idle mesh
* interactive_ttft_p95_s_with_batch  the same 4 clients while a batch runs beside them
                            (the two arms alternate: alone, with, alone, with)
* lost_lines, duplicate_lines      a batch whose gateway is killed (SIGKILL) mid-batch and started
                            again: lines missing from the output file, and lines in it more than once

Targets (the `passes` entries): interactive_ttft_p95_s_with_batch <= 1.2 x
interactive_ttft_p95_s_alone; batch_tok_s_alone >= 0.8 x closed_loop_32_tok_s; lost_lines == 0
and duplicate_lines == 0. The interactive target needs the engine to preempt batch rows for
interactive ones (a batch row waits behind an interactive one); docs/batch.md.

Run: `.venv/bin/python -m bench.batch [--lines 2000]` (the lines run is recorded in the result).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc
import openai

from bench.batching import QUESTIONS, build_prompts, closed_loop, one
from bench.common import machine, percentile, print_table, write_result
from bench.mesh import bench_mesh
from llmesh.models import resolve
from llmesh.testing import real_models_dir
from llmesh.v1 import inference_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
LINE_TOKENS = 32
INTERACTIVE_CLIENTS = 4
INTERACTIVE_TOKENS = 16
TOPICS = ["rivers", "stars", "bread", "trains", "music", "forests", "glass", "clocks", "bees", "maps"]


def batch_lines(count: int, tag: str) -> bytes:
    """`count` short chat lines, each a question of its own (no answer cache hit, no shared answer)."""
    out = []
    for i in range(count):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} ({TOPICS[i % len(TOPICS)]}, {tag} {i})"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": LINE_TOKENS,
            "llmesh": {"use_retrieval": False, "use_cache": False},
        }
        out.append(
            json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(out) + "\n").encode()


async def submit(client: openai.AsyncOpenAI, count: int, tag: str) -> Any:
    uploaded = await client.files.create(file=(f"{tag}.jsonl", io.BytesIO(batch_lines(count, tag))), purpose="batch")
    return await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def wait_ended(client: openai.AsyncOpenAI, batch_id: str, limit_s: float) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        found = await client.batches.retrieve(batch_id)
        if found.status in ("completed", "failed", "cancelled", "expired"):
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {found.status} after {limit_s:.0f}s")
        await asyncio.sleep(0.2)


async def output_lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


async def batch_alone(base_url: str, lines: int) -> dict[str, Any]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        started = time.perf_counter()
        batch = await submit(client, lines, "alone")
        done = await wait_ended(client, batch.id, limit_s=3600)
        elapsed = time.perf_counter() - started
        output = await output_lines(client, done.output_file_id)
    tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)
    return {
        "batch_tok_s_alone": tokens / elapsed,
        "batch_lines_s_alone": len(output) / elapsed,
        "batch_seconds_alone": elapsed,
        "batch_lines_ok_alone": len(output),
    }


async def interactive(base_url: str, seconds: float, tag: str) -> list[float]:
    """TTFTs of INTERACTIVE_CLIENTS closed-loop streaming chat clients over `seconds`."""
    ttfts: list[float] = []
    stop_at = time.monotonic() + seconds

    async def client_loop(c: int) -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
            n = 0
            while time.monotonic() < stop_at:
                question = f"{QUESTIONS[(c * 7 + n) % len(QUESTIONS)]} ({tag} {c}-{n})"
                sent = time.perf_counter()
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=INTERACTIVE_TOKENS,
                    stream=True,
                    extra_body={"llmesh": {"use_retrieval": False, "use_cache": False}},
                )
                first = None
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter()
                if first is not None:
                    ttfts.append(first - sent)
                n += 1

    await asyncio.gather(*(client_loop(c) for c in range(INTERACTIVE_CLIENTS)))
    return ttfts


async def interactive_arms(base_url: str, lines: int, seconds: float, rounds: int) -> dict[str, Any]:
    alone: list[float] = []
    beside: list[float] = []
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        await interactive(base_url, 3, "warm")
        for r in range(rounds):
            alone += await interactive(base_url, seconds, f"alone{r}")
            batch = await submit(client, lines, f"beside{r}")
            # Measured once the batch is running (its first lines done): the engines hold batch rows.
            while True:
                found = await client.batches.retrieve(batch.id)
                if found.request_counts and found.request_counts.completed >= 4:
                    break
                await asyncio.sleep(0.1)
            beside += await interactive(base_url, seconds, f"with{r}")
            still = await client.batches.retrieve(batch.id)
            await client.batches.cancel(batch.id)
            await wait_ended(client, batch.id, limit_s=600)
            if still.status != "in_progress":
                print(f"warning: round {r}: the batch had ended ({still.status}) before the interactive arm did")
    return {
        "interactive_ttft_p95_s_alone": percentile(alone, 0.95),
        "interactive_ttft_p50_s_alone": percentile(alone, 0.5),
        "interactive_ttft_p95_s_with_batch": percentile(beside, 0.95),
        "interactive_ttft_p50_s_with_batch": percentile(beside, 0.5),
        "interactive_samples_alone": len(alone),
        "interactive_samples_with_batch": len(beside),
    }


async def restart(mesh: Any, lines: int, gateway_env: dict[str, str]) -> dict[str, Any]:
    base_url = mesh.procs["gateway"].http_base_url()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        batch = await submit(client, lines, "restart")
        while True:
            found = await client.batches.retrieve(batch.id)
            if found.request_counts and found.request_counts.completed >= lines // 3:
                break
            await asyncio.sleep(0.1)
    done_at_kill = found.request_counts.completed
    await asyncio.to_thread(mesh.stop_one, "gateway", 30.0, signal.SIGKILL)
    await asyncio.to_thread(mesh.start_one, "gateway", 180.0, gateway_env)
    base_url = mesh.procs["gateway"].http_base_url()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        done = await wait_ended(client, batch.id, limit_s=3600)
        output = await output_lines(client, done.output_file_id)
        errors = await output_lines(client, done.error_file_id)
    seen = Counter(o["custom_id"] for o in output + errors)
    expected = {f"restart-{i}" for i in range(lines)}
    return {
        "restart_lines": lines,
        "restart_done_at_kill": done_at_kill,
        "restart_status": done.status,
        "lost_lines": len(expected - set(seen)),
        "duplicate_lines": sum(n - 1 for n in seen.values() if n > 1),
        "restart_error_lines": len(errors),
    }


async def closed_loop_32(target: str, measure_s: float, warmup_s: float) -> float:
    prompts = build_prompts(resolve(real_models_dir(), "smollm2"))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await one(stub, prompts[0], 8)
        result = await closed_loop(
            functools.partial(one, stub), prompts, lambda rng: 64, measure_s, warmup_limit_s=warmup_s
        )
    return float(result["tok_s"])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=2000, help="lines of the batch run alone")
    parser.add_argument("--beside-lines", type=int, default=400, help="lines of each batch beside interactive load")
    parser.add_argument("--restart-lines", type=int, default=200)
    parser.add_argument("--interactive-seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", type=float, default=20.0, help="seconds of the 32-stream closed loop")
    parser.add_argument(
        "--warmup", type=float, default=300.0, help="most seconds the closed loop's clients take to start"
    )
    args = parser.parse_args(argv)
    # Default admission (a batch lane at half the budget), short leases so a killed gateway's lines
    # come back within seconds.
    gateway_env = {"LLMESH_BATCH_LEASE_SECONDS": "3", "LLMESH_RETRIEVAL_TARGET": "127.0.0.1:1"}
    env = {"LLMESH_ADMISSION_BUDGET": "2e7", "LLMESH_ADMISSION_TENANT_SHARE": "1"}
    with bench_mesh(env, services=("tokenizer", "inference", "cache")) as mesh:
        gateway_env["LLMESH_ADMISSION_REDIS_URL"] = mesh.base_env["LLMESH_REDIS_URL"]
        mesh.start_one("gateway", 180.0, gateway_env)
        base_url = mesh.procs["gateway"].http_base_url()
        result: dict[str, Any] = {
            "lines": args.lines,
            "beside_lines": args.beside_lines,
            "line_max_tokens": LINE_TOKENS,
            "load_average_at_start": os.getloadavg()[0],
        }
        result["closed_loop_32_tok_s"] = asyncio.run(
            closed_loop_32(mesh.target("inference"), args.measure, args.warmup)
        )
        result.update(asyncio.run(batch_alone(base_url, args.lines)))
        arms = interactive_arms(base_url, args.beside_lines, args.interactive_seconds, args.rounds)
        result.update(asyncio.run(arms))
        result.update(asyncio.run(restart(mesh, args.restart_lines, gateway_env)))
    result["passes"] = {
        "interactive_ttft_with_batch_within_1_2x": result["interactive_ttft_p95_s_with_batch"]
        <= 1.2 * result["interactive_ttft_p95_s_alone"],
        "batch_tok_s_at_least_0_8x_closed_loop": result["batch_tok_s_alone"] >= 0.8 * result["closed_loop_32_tok_s"],
        "no_lost_lines": result["lost_lines"] == 0,
        "no_duplicate_lines": result["duplicate_lines"] == 0,
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if k != "machine"}, "bench.batch")
    print(f"wrote {write_result('batch', result)}")


if __name__ == "__main__":
    main()
