"""Inference backends benchmark: what the mesh costs in front of vLLM, on each front door.

The mesh is started as the README starts it (`llmesh up` with LLMESH_INFERENCE_BACKEND=openai and
LLMESH_BACKEND_URLS): all five services, every setting at its default (the inference service's
niceness, admission, log level INFO, a mesh token), only its ports ephemeral. The same 32 chat
questions, 64 new tokens each (greedy, EOS as the model says, so every path makes the same
tokens), 32 concurrent streams in closed loop (bench.batching's loop: clients start two tokens
apart, measured once all decode), alternating, with the clients of bench.streams:

* direct       clients straight to vLLM's OpenAI API (`/v1/completions`, streamed), with the
               exact prompt tokens the gateway sends
* mesh_http    the same questions through the gateway's `/v1/completions` (SSE), cache and
               retrieval off per request (`llmesh` extension)
* mesh_grpc    the same through the gateway's `GenerateStream`
* builtin_mesh_http / builtin_mesh_grpc  the same mesh on the builtin engine (vLLM stopped)
* *_sheds      requests refused for load (429/503, RESOURCE_EXHAUSTED), each retried after
               its delay as a client should
* ttft_*_p50_s / _p95_s  time to first token of each, in the closed loop

Loops alternate, `--rounds` of each and a last direct one (D H G D H G D), each figure the mean
over its loops: the load on a shared machine drifts. Backend: vLLM's CPU build (`make vllm`,
.venv-vllm) on the prepared SmolLM2.

Targets (the `passes` entries): openai_mesh_vs_direct_http and openai_mesh_vs_direct_grpc >= 0.95
with no sheds; each front door's TTFT p50 within 25 ms of direct.

* cpu_s_per_1k_tokens  CPU seconds (user + system, children included) each process spent per
                      1000 tokens streamed, over each loop: what every hop costs per token

Run: `.venv/bin/python -m bench.backends` (about 15 minutes on 2 CPU cores, vLLM's start included).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import httpx
from httpx_sse import EventSource

from bench import streams
from bench.batching import CLIENTS, NEW_TOKENS, QUESTIONS, Record
from bench.common import machine, print_table, write_result
from bench.mesh import bench_mesh
from bench.streams import retry_delay
from llmesh.server import MESH_TOKEN_HEADER
from llmesh.settings import DECLARED
from llmesh.testing import VLLM_MODEL_NAME, VllmServer, real_models_dir
from llmesh.v1 import common_pb2, gateway_pb2, tokenizer_pb2, tokenizer_pb2_grpc

__all__ = ["direct_one", "retry_delay"]

#: What `llmesh up` starts.
README_SERVICES = ("tokenizer", "inference", "cache", "retrieval", "gateway")
#: Settings bench.mesh changes for its own runs, put back to the defaults a user gets.
BENCH_ONLY = ("LLMESH_LOG_LEVEL", "LLMESH_ADMISSION_BUDGET", "LLMESH_ADMISSION_TENANT_SHARE")
#: Per request on the HTTP API: no cache, no retrieval (the gRPC requests say the same).
NO_CACHE = {"llmesh": {"use_cache": False, "use_retrieval": False}}
#: Tokens the streams of a loop produced (usage), for direct_one's callers.
TOKENS = [0]
FRONT_DOORS = ("http", "grpc")


def readme_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment `llmesh up` gives its services: every setting at its default, a mesh token."""
    defaults = {s.env: s.default for s in DECLARED if s.env in BENCH_ONLY}
    return {**defaults, "LLMESH_MESH_TOKEN": secrets.token_urlsafe(32), **extra}


def ask(question: str, max_new: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=question,
        use_cache=False,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
    )


async def direct_one(
    client: httpx.AsyncClient,
    base_url: str,
    ids: list[int],
    max_new: int,
    decoding: asyncio.Event | None = None,
    records: list[Record] | None = None,
) -> Record:
    """One streamed completion straight from vLLM with EOS ignored (bench.prefix's client)."""
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
    streams.spread(record, produced)
    TOKENS[0] += produced
    record.done = time.perf_counter()
    if decoding is not None:
        decoding.set()
    return record


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


def measured(
    pids: dict[str, tuple[int, bool]], loop: Coroutine[Any, Any, dict[str, float]]
) -> tuple[dict[str, float], dict[str, float]]:
    """A loop's figures and each process's CPU seconds per 1000 tokens over it (its warm-up included)."""
    before = cpu_seconds(pids)
    figures = asyncio.run(loop)
    return figures, cpu_per_1k(before, cpu_seconds(pids), int(figures["tokens"]))


def cpu_per_1k(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    return {name: round(1000 * (after[name] - before[name]) / tokens, 3) for name in after if name in before and tokens}


async def rendered_prompts(tokenizer_target: str, mesh_token: str = "") -> list[list[int]]:
    """The token ids the gateway sends for each question (its messages, our chat template)."""
    from services.gateway.core import GatewayConfig, build_messages, validate

    config = GatewayConfig("docs", 4, 0.25, 32768, 1536, 512, 128)
    metadata = ((MESH_TOKEN_HEADER, mesh_token),) if mesh_token else ()
    async with grpc.aio.insecure_channel(tokenizer_target) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        out = []
        for question in QUESTIONS[:CLIENTS]:
            messages = build_messages(validate(ask(question, NEW_TOKENS), config), [])
            rendered = await stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(messages=messages, add_generation_prompt=True, tokenize=True),
                metadata=metadata,
            )
            assert rendered.ids, "the tokenizer service returned no token ids"
            out.append(list(rendered.ids))
    return out


def _figures(loop: dict[str, float], prefix: str) -> dict[str, float]:
    return {
        f"{prefix}_tok_s": loop["tok_s"],
        f"ttft_{prefix}_p50_s": loop["ttft_p50_s"],
        f"ttft_{prefix}_p95_s": loop["ttft_p95_s"],
        f"{prefix}_requests": loop["requests"],
        f"{prefix}_tokens_per_answer": loop["tokens_per_answer"],
        f"{prefix}_sheds": loop["sheds"],
    }


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


def front_door_loop(door: str, mesh: Any, measure_s: float) -> Coroutine[Any, Any, dict[str, float]]:
    """The closed loop through the gateway's HTTP API or its gRPC port (cache and retrieval off)."""
    questions = QUESTIONS[:CLIENTS]
    if door == "http":
        base = mesh.procs["gateway"].http_base_url()
        model = httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]  # the default model's name
        return streams.http_loop(base, questions, NEW_TOKENS, measure_s, model=model, extra_body=NO_CACHE)
    return streams.grpc_loop(mesh.target("gateway"), questions, NEW_TOKENS, measure_s)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=float, default=30.0, help="measured seconds of each closed loop")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (direct, mesh HTTP, mesh gRPC), then direct")
    parser.add_argument("--no-builtin", action="store_true", help="skip the builtin engine's loops")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts in a minute)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the mesh (a variant to compare)")
    args = parser.parse_args(argv)
    if not VllmServer.available():
        raise SystemExit("bench.backends needs vLLM's CPU build: run `make vllm` first")

    begun = time.perf_counter()
    models = real_models_dir()
    extra = dict(item.split("=", 1) for item in args.env)
    result: dict[str, Any] = {
        "prompts": CLIENTS,
        "new_tokens": NEW_TOKENS,
        "clients": CLIENTS,
        "rounds": args.rounds,
        "mesh": f"as `llmesh up` starts it: {', '.join(README_SERVICES)}, settings at their defaults",
        "mesh_env_changed": sorted(extra),
    }
    loads: dict[str, float] = {}
    others: dict[str, list[str]] = {}
    cpu: dict[str, dict[str, float]] = {}
    runs: dict[str, list[dict[str, float]]] = {"direct": [], "mesh_http": [], "mesh_grpc": []}

    def phase(name: str, prefix: str, figures: dict[str, float], costs: dict[str, float], title: str) -> None:
        cpu[name] = costs
        loads[name], others[name] = round(os.getloadavg()[0], 2), _others()
        print_table(_figures(figures, prefix), title)

    with tempfile.TemporaryDirectory(prefix="llmesh-bench-vllm-") as tmp:
        vllm = VllmServer((models / "smollm2" / "current").resolve(), Path(tmp) / "vllm.log", eager=args.eager)
        vllm.start()
        try:
            started = time.perf_counter()
            vllm.wait_ready()
            result["backend_start_s"] = time.perf_counter() - started
            env = readme_env(
                {"LLMESH_INFERENCE_BACKEND": "openai", "LLMESH_BACKEND_URLS": vllm.base_url, **extra},
            )
            pids = {"bench_client": (os.getpid(), False), "vllm": (vllm.process.pid, True)}
            with bench_mesh(env, services=README_SERVICES) as mesh:
                prompts = asyncio.run(rendered_prompts(mesh.target("tokenizer"), env["LLMESH_MESH_TOKEN"]))
                info = httpx.get(f"{vllm.origin}/version", timeout=5).json()
                compiled = "eager" if args.eager else "compiled"
                result["backend"] = f"vLLM {info.get('version')} (CPU build, {vllm.dtype}, {compiled}, SmolLM2-135M)"
                print(f"{result['backend']}: ready in {result['backend_start_s']:.0f} s", flush=True)
                mesh_pids = {**pids, **service_pids(mesh)}

                def direct(name: str) -> None:
                    loop = streams.http_loop(vllm.base_url, prompts, NEW_TOKENS, args.measure, model=VLLM_MODEL_NAME)
                    run, costs = measured(pids, loop)
                    runs["direct"].append(run)
                    phase(name, "direct", run, costs, f"direct ({name})")

                for r in range(args.rounds):
                    direct(f"direct_{r + 1}")
                    for door in FRONT_DOORS:
                        run, costs = measured(mesh_pids, front_door_loop(door, mesh, args.measure))
                        runs[f"mesh_{door}"].append(run)
                        phase(f"mesh_{door}_{r + 1}", f"mesh_{door}", run, costs, f"mesh over {door}, round {r + 1}")
                direct(f"direct_{args.rounds + 1}")
        finally:
            vllm.stop()
    for prefix, loops in runs.items():
        result.update(_mean(loops, prefix))
        result[f"{prefix}_tok_s_runs"] = [round(d["tok_s"], 2) for d in loops]
    if not args.no_builtin:
        env = readme_env({"LLMESH_INFERENCE_MODEL": "smollm2", **extra})
        try:
            with bench_mesh(env, services=README_SERVICES) as mesh:
                builtin_pids = {"bench_client": (os.getpid(), False), **service_pids(mesh)}
                for door in FRONT_DOORS:
                    run, costs = measured(builtin_pids, front_door_loop(door, mesh, args.measure))
                    phase(f"builtin_mesh_{door}", f"builtin_mesh_{door}", run, costs, f"builtin engine over {door}")
                    result.update(_figures(run, f"builtin_mesh_{door}"))
        except Exception as exc:  # the openai figures above still count: keep them
            result["builtin_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"builtin engine loops failed: {result['builtin_error']}", flush=True)

    for door in FRONT_DOORS:
        result[f"openai_mesh_vs_direct_{door}"] = result[f"mesh_{door}_tok_s"] / result["direct_tok_s"]
        result[f"ttft_p50_mesh_{door}_minus_direct_ms"] = 1000 * (
            result[f"ttft_mesh_{door}_p50_s"] - result["ttft_direct_p50_s"]
        )
    result["cpu_s_per_1k_tokens"] = cpu
    result["passes"] = {
        **{f"openai_mesh_vs_direct_{d}>=0.95": result[f"openai_mesh_vs_direct_{d}"] >= 0.95 for d in FRONT_DOORS},
        **{f"mesh_{d}_no_sheds": result[f"mesh_{d}_sheds"] == 0 for d in FRONT_DOORS},
        **{
            f"ttft_p50_mesh_{d}_within_25ms_of_direct": result[f"ttft_p50_mesh_{d}_minus_direct_ms"] <= 25.0
            for d in FRONT_DOORS
        },
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
