"""Inference backends benchmark: what the mesh costs in front of vLLM, and vLLM against the builtin engine.

Same 32 chat questions, 64 new tokens each with EOS ignored, greedy, 32 concurrent streams in
closed loop (bench.batching's loop: clients start two tokens apart, measured once all decode),
side by side in one run:

* direct_tok_s        clients straight to vLLM's OpenAI API (`/v1/completions`, streamed), with
                      the exact prompt tokens the gateway sends
* mesh_tok_s          the same load through the gateway (cache and retrieval off) with the
                      inference service on LLMESH_INFERENCE_BACKEND=openai in front of that vLLM
* builtin_mesh_tok_s  the same load through the gateway on the builtin engine (vLLM stopped)
* *_sheds             requests the gateway shed (RESOURCE_EXHAUSTED), each retried after its
                      RetryInfo delay as a client should
* ttft_*_p50_s / _p95_s  time to first token of each, in the closed loop

* mesh_per_request_tok_s  the mesh with LLMESH_INFERENCE_MULTIPLEX=false: a Generate call (a gRPC
                      message per token) per request instead of the GenerateMany stream

Direct and mesh loops alternate, `--rounds` of each and a last direct one (D M D M D), each
figure the mean over its loops: the load on a shared machine drifts, and one closed loop's rate
differs from the next by several per cent. Backend: vLLM's CPU build (`make vllm`, .venv-vllm)
on the prepared SmolLM2.

Targets (the `passes` entries): mesh_tok_s >= 0.95 x direct_tok_s with 0 sheds; mesh
TTFT p50 within 15 ms of direct.

* cpu_s_per_1k_tokens  CPU seconds (user + system, children included) each process spent per
                      1000 tokens streamed, over each loop: what every hop costs per token

Run: `.venv/bin/python -m bench.backends` (about 10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import httpx
from httpx_sse import EventSource

from bench.batching import CLIENTS, NEW_TOKENS, QUESTIONS, Record, closed_loop
from bench.common import machine, print_table, write_result
from bench.mesh import bench_mesh
from llmesh.errors import status_details, unpack_details
from llmesh.testing import VLLM_MODEL_NAME, VllmServer, real_models_dir
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

MESH_SERVICES = ("tokenizer", "inference", "gateway")
CLOSED = "127.0.0.1:1"  # cache and retrieval are not started: every request turns both off


def ask(question: str, max_new: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=question,
        use_cache=False,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
    )


def _rescale(record: Record, produced: int) -> None:
    """Counts the tokens a stream really produced (usage), spread over the pieces that carried them."""
    if record.arrivals and produced:
        each = produced / len(record.arrivals)
        record.arrivals = [(t, each) for t, _ in record.arrivals]  # type: ignore[misc]


async def direct_one(
    client: httpx.AsyncClient,
    base_url: str,
    ids: list[int],
    max_new: int,
    decoding: asyncio.Event | None = None,
    records: list[Record] | None = None,
) -> Record:
    record = Record(time.perf_counter())
    if records is not None:
        records.append(record)
    body = {
        "model": VLLM_MODEL_NAME,
        "prompt": ids,
        "max_tokens": max_new,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    produced = 0
    async with client.stream("POST", f"{base_url}/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"vLLM answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for event in EventSource(response).aiter_sse():
            if event.data == "[DONE]":
                continue  # read on to the body's end: the connection goes back to the pool
            chunk = event.json()
            now = time.perf_counter()
            if any(c.get("text") for c in chunk.get("choices") or ()):
                if record.first is None:
                    record.first = now
                record.arrivals.append((now, 1))
                if decoding is not None and len(record.arrivals) >= 2:
                    decoding.set()
            if chunk.get("usage"):
                produced = int(chunk["usage"]["completion_tokens"])
    _rescale(record, produced)
    TOKENS[0] += produced
    record.done = time.perf_counter()
    if decoding is not None:
        decoding.set()
    return record


async def mesh_one(
    stub: gateway_pb2_grpc.GatewayStub,
    question: str,
    max_new: int,
    decoding: asyncio.Event | None = None,
    records: list[Record] | None = None,
) -> Record:
    # A shed request (RESOURCE_EXHAUSTED) is retried after the RetryInfo delay, as a client
    # should; sheds are counted, and the record's clock starts with the try that was admitted.
    while True:
        try:
            return await _mesh_try(stub, question, max_new, decoding, records)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            SHEDS[0] += 1
            await asyncio.sleep(retry_delay(err))


#: Requests the gateway shed during the mesh loops (retried by mesh_one).
SHEDS = [0]
#: Tokens the streams of a loop produced (usage), for the CPU cost per token.
TOKENS = [0]


def cpu_seconds(pids: dict[str, tuple[int, bool]]) -> dict[str, float]:
    """User + system CPU seconds of each process, with its descendants where asked (vLLM's
    engine core and worker are children of its API server)."""
    import psutil

    out: dict[str, float] = {}
    for name, (pid, tree) in pids.items():
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)] if tree else [root]
        except psutil.Error:
            continue
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        out[name] = total
    return out


def service_pids(mesh: Any) -> dict[str, tuple[int, bool]]:
    return {name: (sp.proc.pid, True) for name, sp in mesh.procs.items()}


def measured(pids: dict[str, tuple[int, bool]], loop: Any) -> tuple[dict[str, float], dict[str, float]]:
    """A loop's figures and each process's CPU seconds per 1000 tokens over it."""
    before = cpu_seconds(pids)
    figures = asyncio.run(loop)
    return figures, cpu_per_1k(before, cpu_seconds(pids), TOKENS[0])


def cpu_per_1k(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    return {name: round(1000 * (after[name] - before[name]) / tokens, 3) for name in after if name in before and tokens}


def retry_delay(err: grpc.aio.AioRpcError, default: float = 0.5) -> float:
    """The RetryInfo delay of a refusal, `default` where it carries none."""
    retry = unpack_details(status_details(err.trailing_metadata())).get("retry_info")
    if retry is None:
        return default
    return float(retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9)  # type: ignore[attr-defined]


async def _mesh_try(
    stub: gateway_pb2_grpc.GatewayStub,
    question: str,
    max_new: int,
    decoding: asyncio.Event | None,
    records: list[Record] | None,
) -> Record:
    record = Record(time.perf_counter())
    produced = 0
    stream = stub.GenerateStream(ask(question, max_new), timeout=600)
    first = await anext(aiter(stream), None)  # a refusal comes before anything else
    if records is not None:
        records.append(record)
    events = [] if first is None else [first]
    async for event in _chain(events, stream):
        now = time.perf_counter()
        if event.delta:
            if record.first is None:
                record.first = now
            record.arrivals.append((now, 1))
            if decoding is not None and len(record.arrivals) >= 2:
                decoding.set()
        elif event.HasField("final"):
            produced = event.final.usage.output_tokens
    _rescale(record, produced)
    TOKENS[0] += produced
    record.done = time.perf_counter()
    if decoding is not None:
        decoding.set()
    return record


async def rendered_prompts(tokenizer_target: str) -> list[list[int]]:
    """The token ids the gateway sends for each question (its messages, our chat template)."""
    from services.gateway.core import GatewayConfig, build_messages, validate

    config = GatewayConfig("docs", 4, 0.25, 32768, 1536, 512, 128)
    async with grpc.aio.insecure_channel(tokenizer_target) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        out = []
        for question in QUESTIONS[:CLIENTS]:
            messages = build_messages(validate(ask(question, NEW_TOKENS), config), [])
            rendered = await stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(messages=messages, add_generation_prompt=True, tokenize=True)
            )
            assert rendered.ids, "the tokenizer service returned no token ids"
            out.append(list(rendered.ids))
    return out


async def _chain(first: list[Any], rest: Any) -> Any:
    for item in first:
        yield item
    async for item in rest:
        yield item


def _figures(loop: dict[str, float], prefix: str) -> dict[str, float]:
    return {
        f"{prefix}_tok_s": loop["tok_s"],
        f"ttft_{prefix}_p50_s": loop["ttft_p50_s"],
        f"ttft_{prefix}_p95_s": loop["ttft_p95_s"],
        f"{prefix}_requests": loop["requests"],
        **({f"{prefix}_sheds": loop["sheds"]} if "sheds" in loop else {}),
    }


async def direct_loop(base_url: str, prompts: list[list[int]], measure_s: float) -> dict[str, float]:
    limits = httpx.Limits(max_connections=2 * CLIENTS, max_keepalive_connections=2 * CLIENTS)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=5.0)) as client:
        run = functools.partial(direct_one, client, base_url)
        await run(prompts[0], 8)  # connections and first-call warm-up
        TOKENS[0] = 0
        return await closed_loop(run, prompts, lambda rng: NEW_TOKENS, measure_s)


async def mesh_loop(gateway_target: str, measure_s: float) -> dict[str, float]:
    async with grpc.aio.insecure_channel(gateway_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        run = functools.partial(mesh_one, stub)
        await run(QUESTIONS[0], 8)
        SHEDS[0] = 0
        TOKENS[0] = 0
        loop = await closed_loop(run, QUESTIONS[:CLIENTS], lambda rng: NEW_TOKENS, measure_s)
        return {**loop, "sheds": SHEDS[0]}


def _others() -> list[str]:
    """What else ran on the machine (shared with other work): the busiest processes not ours."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "pcpu,args", "--sort=-pcpu", "--no-headers"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [" ".join(line.split())[:120] for line in out.splitlines()[:10]]


def _mean(runs: Sequence[dict[str, float]], prefix: str) -> dict[str, float]:
    """The loops' figures averaged (a loop's own p50 and p95, then their mean over the loops)."""
    figures = [_figures(run, prefix) for run in runs]
    return {k: sum(f[k] for f in figures) / len(figures) for k in figures[0]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=float, default=30.0, help="measured seconds of each closed loop")
    parser.add_argument("--rounds", type=int, default=2, help="mesh loops, each after a direct one (and one more last)")
    parser.add_argument("--no-builtin", action="store_true", help="skip the builtin engine's loop")
    parser.add_argument(
        "--no-per-request", action="store_true", help="skip the mesh loop with a Generate call per request"
    )
    args = parser.parse_args(argv)
    if not VllmServer.available():
        raise SystemExit("bench.backends needs vLLM's CPU build: run `make vllm` first")

    begun = time.perf_counter()
    models = real_models_dir()
    result: dict[str, Any] = {"prompts": CLIENTS, "new_tokens": NEW_TOKENS, "clients": CLIENTS, "rounds": args.rounds}
    loads: dict[str, float] = {}
    others: dict[str, list[str]] = {}
    cpu: dict[str, dict[str, float]] = {}
    # Every mesh process at niceness 0, like vLLM: the builtin engine's default of 5 would starve it
    # on a shared machine and make the comparison one of priorities, not engines.
    base = {
        "LLMESH_MODELS_DIR": str(models),
        "LLMESH_CACHE_TARGET": CLOSED,
        "LLMESH_RETRIEVAL_TARGET": CLOSED,
        "LLMESH_NICE": "0",
    }
    directs: list[dict[str, float]] = []
    meshes: list[dict[str, float]] = []
    per_request: dict[str, float] | None = None

    def phase(name: str, figures: dict[str, float], costs: dict[str, float], title: str, prefix: str) -> None:
        cpu[name] = costs
        loads[name], others[name] = round(os.getloadavg()[0], 2), _others()
        print_table(_figures(figures, prefix), title)

    with tempfile.TemporaryDirectory(prefix="llmesh-bench-vllm-") as tmp:
        vllm = VllmServer((models / "smollm2" / "current").resolve(), Path(tmp) / "vllm.log")
        vllm.start()
        try:
            started = time.perf_counter()
            vllm.wait_ready()
            result["backend_start_s"] = time.perf_counter() - started
            env = {
                **base,
                "LLMESH_INFERENCE_BACKEND": "openai",
                "LLMESH_BACKEND_URLS": vllm.base_url,
                "LLMESH_BACKEND_MODEL": VLLM_MODEL_NAME,
            }
            pids = {"bench_client": (os.getpid(), False), "vllm": (vllm.process.pid, True)}

            def direct(name: str) -> None:
                run, costs = measured(pids, direct_loop(vllm.base_url, prompts, args.measure))
                directs.append(run)
                phase(name, run, costs, f"direct ({name})", "direct")

            # Direct and mesh loops alternate (D M D M D): a shared machine's load drifts, and one
            # closed loop's rate varies by several per cent from the next.
            with bench_mesh(env, services=MESH_SERVICES) as mesh:
                prompts = asyncio.run(rendered_prompts(mesh.target("tokenizer")))
                info = httpx.get(f"{vllm.origin}/version", timeout=5).json()
                result["backend"] = f"vLLM {info.get('version')} (CPU build, {vllm.dtype}, SmolLM2-135M-Instruct)"
                print(f"{result['backend']}: ready in {result['backend_start_s']:.0f} s", flush=True)
                mesh_pids = {**pids, **service_pids(mesh)}
                for r in range(args.rounds):
                    direct(f"direct_{r + 1}")
                    run, costs = measured(mesh_pids, mesh_loop(mesh.target("gateway"), args.measure))
                    meshes.append(run)
                    phase(f"mesh_{r + 1}", run, costs, f"through the mesh (openai backend), round {r + 1}", "mesh")
                direct(f"direct_{args.rounds + 1}")
            if not args.no_per_request:
                # The same mesh with a Generate call (a gRPC message per token) per request, as
                # before GenerateMany: what multiplexing saves, in the same run.
                with bench_mesh({**env, "LLMESH_INFERENCE_MULTIPLEX": "false"}, services=MESH_SERVICES) as mesh:
                    run, costs = measured(
                        {**pids, **service_pids(mesh)}, mesh_loop(mesh.target("gateway"), args.measure)
                    )
                    per_request = run
                    phase("mesh_per_request", run, costs, "through the mesh, a Generate call per request", "mesh")
                direct(f"direct_{args.rounds + 2}")
        finally:
            vllm.stop()
    result.update(_mean(directs, "direct"))
    result["direct_tok_s_runs"] = [round(d["tok_s"], 2) for d in directs]
    result.update(_mean(meshes, "mesh"))
    result["mesh_sheds"] = sum(m["sheds"] for m in meshes)
    result["mesh_tok_s_runs"] = [round(m["tok_s"], 2) for m in meshes]
    if per_request is not None:
        result.update(_figures(per_request, "mesh_per_request"))
        result["mesh_per_request_vs_direct"] = result["mesh_per_request_tok_s"] / result["direct_tok_s"]
    if not args.no_builtin:
        env = {**base, "LLMESH_INFERENCE_MODEL": "smollm2", "LLMESH_MAX_BATCH_SIZE": str(CLIENTS)}
        with bench_mesh(env, services=MESH_SERVICES) as mesh:
            builtin_pids = {"bench_client": (os.getpid(), False), **service_pids(mesh)}
            builtin_run, costs = measured(builtin_pids, mesh_loop(mesh.target("gateway"), args.measure))
        phase("builtin_mesh", builtin_run, costs, "through the mesh (builtin engine)", "builtin_mesh")
        result.update(_figures(builtin_run, "builtin_mesh"))

    result["mesh_vs_direct"] = result["mesh_tok_s"] / result["direct_tok_s"]
    result["ttft_p50_mesh_minus_direct_ms"] = 1000 * (result["ttft_mesh_p50_s"] - result["ttft_direct_p50_s"])
    if "builtin_mesh_tok_s" in result:
        result["openai_vs_builtin_mesh"] = result["mesh_tok_s"] / result["builtin_mesh_tok_s"]
    result["cpu_s_per_1k_tokens"] = cpu
    result["passes"] = {
        "mesh_ge_0.95x_direct": result["mesh_tok_s"] >= 0.95 * result["direct_tok_s"],
        "mesh_no_sheds": result["mesh_sheds"] == 0,
        "mesh_ttft_p50_within_15ms_of_direct": result["ttft_p50_mesh_minus_direct_ms"] <= 15.0,
    }
    # Load averages after each phase and the busiest processes then: the machine is shared.
    result["machine"] = {**machine(), "load_average_1m_after_phase": loads, "busiest_processes": others}
    result["bench_seconds"] = time.perf_counter() - begun
    print_table({k: v for k, v in result.items() if not isinstance(v, dict | list)}, "backends benchmark")
    print_table(result["passes"], "targets")
    path = write_result(
        "backends", {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
