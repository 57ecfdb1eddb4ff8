"""Batch API benchmark: a batch of short chat lines through the gateway on the builtin engine
(SmolLM2-135M-Instruct, the real prepared weights), alone and beside interactive traffic, and
across a gateway killed mid-batch. The mesh is started as `make run` starts it (`llmesh up`: the
five services with their default settings, the embedded cache and state Redis servers, a
supervisor that restarts a service that dies), on free ports and a private data dir. One run,
side by side:

* batch_tok_s_alone         completion tokens/s of a batch of `--lines` short chat lines (distinct
                            questions, the answer cache and retrieval off so every line is
                            generated), from the upload of its file to its completion, nothing
                            else running
* closed_loop_32_tok_s      bench.batching's closed loop of 32 streams (64 new tokens, EOS
                            ignored) straight on the inference service, the same run and engine:
                            what the engine does flat out. Measured right before and right after
                            the batch alone and averaged (on a shared machine the load drifts)
* interactive_ttft_p95_s_alone     time to first token of 4 closed-loop streaming chat clients
                            (HTTP, the openai wire format) on the idle mesh
* interactive_ttft_p95_s_with_batch  the same 4 clients while a batch of `--beside-lines` runs
                            beside them (the two arms alternate: alone, with, alone, with; the
                            batch is cancelled after its arm). Only first tokens that came while
                            the batch was still running count (interactive_rounds_cut_short: arms
                            it did not outlast); batch_lines_during_interactive says how many
                            batch lines the engine ran meanwhile
* lost_lines, duplicate_lines      a batch whose gateway is killed (SIGKILL) mid-batch and started
                            again by the supervisor, as `llmesh up` does: lines missing from the
                            output and error files, and lines in them more than once

A refused interactive request (interactive_errors_*) has no time to first token: it is counted,
never dropped silently, and the interactive target fails if one came with the batch.

Targets (the `passes` entries): interactive_ttft_p95_s_with_batch <= 1.2 x
interactive_ttft_p95_s_alone, none refused; batch_tok_s_alone >= 0.8 x closed_loop_32_tok_s; lost_lines == 0
and duplicate_lines == 0 with the kill landing mid-batch. The interactive target needs the
engine to preempt batch rows for interactive ones (a batch row waits behind an interactive one);
docs/batch.md.

Run: `.venv/bin/python -m bench.batch` (2,000 lines; the sizes run are recorded in the result).
A smoke run: `--lines 60 --beside-lines 40 --restart-lines 30 --interactive-seconds 5 --rounds 1
--measure 5 --name batch_smoke`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import math
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc
import openai

from bench.batching import QUESTIONS, build_prompts, closed_loop, one
from bench.common import machine, percentile, print_table, write_result
from llmesh.models import resolve
from llmesh.redis_server import up_state_default
from llmesh.settings import load
from llmesh.supervisor import Mesh, ServiceProcess, Supervision
from llmesh.testing import free_port, real_models_dir
from llmesh.v1 import inference_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
LINE_TOKENS = 32
INTERACTIVE_CLIENTS = 4
INTERACTIVE_TOKENS = 16
TOPICS = ["rivers", "stars", "bread", "trains", "music", "forests", "glass", "clocks", "bees", "maps"]
ENDED = ("completed", "failed", "cancelled", "expired")
POLL_S = 0.2


class UpMesh(Mesh):
    """The mesh `llmesh up` runs (supervised: a dead service is started again), telling when a
    restarted process serves."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.restarted = threading.Event()

    def on_restarted(self, sp: ServiceProcess) -> None:
        self.restarted.set()


@contextlib.contextmanager
def up_mesh() -> Iterator[UpMesh]:
    """Every service with its default settings and the environment `llmesh up` adds (the
    embedded state Redis), as `make run` starts them; free ports and a private data dir, so
    that it runs beside a mesh of `make run`. No LLMESH_MESH_TOKEN: the closed loop calls the
    inference service straight."""
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-batch-") as data:
        env = {
            "LLMESH_DATA_DIR": data,
            "LLMESH_MODELS_DIR": str(real_models_dir()),
            "LLMESH_EMBEDDED_REDIS_PORT": str(free_port()),
            "LLMESH_EMBEDDED_REDIS_STATE_PORT": str(free_port()),
            "LLMESH_LOG_LEVEL": os.environ.get("LLMESH_LOG_LEVEL", "WARNING"),
        }
        for var in ("LLMESH_REDIS_URL", "LLMESH_ADMISSION_REDIS_URL", "LLMESH_STATE_REDIS_URL"):
            # A Redis named in the caller's environment would not be the default mesh (the
            # services inherit this process's environment).
            os.environ.pop(var, None)
        env.update(up_state_default({**os.environ, **env}))
        # The services' warnings (LLMESH_LOG_LEVEL) shown as they come: a breaker opening, a
        # line refused, say why a figure is what it is.
        mesh = UpMesh(env=env, supervision=Supervision(metrics_port=None), echo_logs=True)
        with mesh:
            yield mesh


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
        if found.status in ENDED:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {found.status} after {limit_s:.0f}s")
        await asyncio.sleep(POLL_S)


async def wait_completed(client: openai.AsyncOpenAI, batch_id: str, lines: int, limit_s: float = 600) -> Any:
    """The job once `lines` of its lines are done (RuntimeError if it ended before)."""
    deadline = time.monotonic() + limit_s
    while True:
        found = await client.batches.retrieve(batch_id)
        if found.request_counts and found.request_counts.completed >= lines:
            return found
        if found.status in ENDED:
            raise RuntimeError(f"batch {batch_id} {found.status} before {lines} lines were done: {found}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id}: fewer than {lines} lines done after {limit_s:.0f}s")
        await asyncio.sleep(POLL_S)


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
        errors = await output_lines(client, done.error_file_id)
    ok = [o for o in output if o["response"]["status_code"] == 200]
    tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in ok)
    return {
        "batch_status_alone": done.status,
        "batch_tok_s_alone": tokens / elapsed,
        "batch_lines_s_alone": len(ok) / elapsed,
        "batch_seconds_alone": elapsed,
        "batch_lines_ok_alone": len(ok),
        "batch_lines_failed_alone": len(output) - len(ok) + len(errors),
        "batch_completion_tokens_per_line": tokens / len(ok) if ok else math.nan,
    }


@dataclass
class Arm:
    """What INTERACTIVE_CLIENTS closed-loop clients saw over one arm."""

    #: (first token at, time to first token) per answered request.
    ttfts: list[tuple[float, float]] = field(default_factory=list)
    #: "status: message" per refused or failed request (no TTFT: counted apart, never dropped).
    errors: list[str] = field(default_factory=list)


async def interactive(base_url: str, seconds: float, tag: str) -> Arm:
    """INTERACTIVE_CLIENTS closed-loop streaming chat clients over `seconds`. A refused request
    is recorded; its client waits out the refusal's retry-after (at most the arm's end)."""
    arm = Arm()
    stop_at = time.monotonic() + seconds

    async def client_loop(c: int) -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
            n = 0
            while time.monotonic() < stop_at:
                question = f"{QUESTIONS[(c * 7 + n) % len(QUESTIONS)]} ({tag} {c}-{n})"
                n += 1
                sent = time.perf_counter()
                first = None
                try:
                    stream = await client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": question}],
                        max_tokens=INTERACTIVE_TOKENS,
                        stream=True,
                        extra_body={"llmesh": {"use_retrieval": False, "use_cache": False}},
                    )
                    async for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter()
                except openai.APIStatusError as exc:
                    arm.errors.append(f"{exc.status_code}: {exc.message}")
                    retry = float(exc.response.headers.get("retry-after") or 0)
                    await asyncio.sleep(max(0.0, min(retry, stop_at - time.monotonic())))
                    continue
                except openai.APIError as exc:
                    arm.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if first is not None:
                    arm.ttfts.append((first, first - sent))

    await asyncio.gather(*(client_loop(c) for c in range(INTERACTIVE_CLIENTS)))
    return arm


async def watch(client: openai.AsyncOpenAI, batch_id: str, seen: dict[str, float], stop: asyncio.Event) -> None:
    """Polls the job: `running_until` (the last time it was seen in progress), `completed`."""
    while not stop.is_set():
        found = await client.batches.retrieve(batch_id)
        if found.status != "in_progress":
            return
        seen["running_until"] = time.perf_counter()
        seen["completed"] = found.request_counts.completed if found.request_counts else 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)


async def interactive_arms(base_url: str, lines: int, seconds: float, rounds: int) -> dict[str, Any]:
    alone: list[float] = []
    beside: list[float] = []
    errors_alone: list[str] = []
    errors_beside: list[str] = []
    during = 0
    cut_short = 0
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        await interactive(base_url, 3, "warm")
        for r in range(rounds):
            arm = await interactive(base_url, seconds, f"alone{r}")
            alone += [ttft for _, ttft in arm.ttfts]
            errors_alone += arm.errors
            batch = await submit(client, lines, f"beside{r}")
            # Measured once the batch is running (its first lines done): the engines hold batch rows.
            started = await wait_completed(client, batch.id, min(4, lines))
            seen = {"running_until": time.perf_counter(), "completed": float(started.request_counts.completed)}
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(client, batch.id, seen, stop))
            arm = await interactive(base_url, seconds, f"with{r}")
            stop.set()
            await watcher
            # Only first tokens that came while the batch was still running count.
            kept = [ttft for at, ttft in arm.ttfts if at <= seen["running_until"]]
            if len(kept) < len(arm.ttfts):
                cut_short += 1
                print(
                    f"warning: round {r}: the batch ended before the interactive arm did; {len(kept)} of "
                    f"{len(arm.ttfts)} samples kept (a larger --beside-lines keeps it running)"
                )
            beside += kept
            errors_beside += arm.errors
            during += int(seen["completed"] - started.request_counts.completed)
            await client.batches.cancel(batch.id)
            await wait_ended(client, batch.id, limit_s=600)
    return {
        "interactive_ttft_p95_s_alone": percentile(alone, 0.95),
        "interactive_ttft_p50_s_alone": percentile(alone, 0.5),
        "interactive_ttft_p95_s_with_batch": percentile(beside, 0.95),
        "interactive_ttft_p50_s_with_batch": percentile(beside, 0.5),
        "interactive_samples_alone": len(alone),
        "interactive_samples_with_batch": len(beside),
        "batch_lines_during_interactive": during,
        "interactive_rounds_cut_short": cut_short,
        "interactive_errors_alone": len(errors_alone),
        "interactive_errors_with_batch": len(errors_beside),
        "interactive_error_examples": sorted(Counter(errors_alone + errors_beside).most_common(3)),
    }


async def restart(mesh: UpMesh, lines: int, lease_s: float) -> dict[str, Any]:
    """A batch whose gateway is SIGKILLed once a third of its lines are done; the supervisor
    starts it again (on the same ports), and its runner takes up the dead one's lines once
    their leases ran out."""
    base_url = mesh.procs["gateway"].http_base_url()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        batch = await submit(client, lines, "restart")
        found = await wait_completed(client, batch.id, max(1, lines // 3))
        done_at_kill = found.request_counts.completed
    mesh.restarted.clear()
    killed = mesh.procs["gateway"].proc
    killed.send_signal(signal.SIGKILL)
    await asyncio.to_thread(killed.wait, 30)
    if not await asyncio.to_thread(mesh.restarted.wait, 300):
        raise RuntimeError("the supervisor did not start the gateway again")
    restarted_at = time.perf_counter()
    # A new client: the old one's connections died with the gateway (the port is the same).
    base_url = mesh.procs["gateway"].http_base_url()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        done = await wait_ended(client, batch.id, limit_s=3600)
        ended_after = time.perf_counter() - restarted_at
        output = await output_lines(client, done.output_file_id)
        errors = await output_lines(client, done.error_file_id)
    seen = Counter(o["custom_id"] for o in output + errors)
    expected = {f"restart-{i}" for i in range(lines)}
    return {
        "restart_lines": lines,
        "restart_done_at_kill": done_at_kill,
        "restart_killed_mid_batch": done_at_kill < lines,
        "restart_status": done.status,
        "restart_lease_s": lease_s,
        "restart_seconds_to_end_after_restart": ended_after,
        "lost_lines": len(expected - set(seen)),
        "duplicate_lines": sum(n - 1 for n in seen.values() if n > 1),
        "unexpected_lines": len(set(seen) - expected),
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
    parser.add_argument(
        "--beside-lines",
        type=int,
        default=1000,
        help="lines of each batch beside interactive load: enough to outlast the arm (it is cancelled after it)",
    )
    parser.add_argument("--restart-lines", type=int, default=200)
    parser.add_argument("--interactive-seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", type=float, default=20.0, help="seconds of each 32-stream closed loop")
    parser.add_argument(
        "--warmup", type=float, default=300.0, help="most seconds the closed loop's clients take to start"
    )
    parser.add_argument("--name", default="batch", help="bench/results/NAME.json (another name for a smoke run)")
    args = parser.parse_args(argv)
    with up_mesh() as mesh:
        base_url = mesh.procs["gateway"].http_base_url()
        result: dict[str, Any] = {
            "lines": args.lines,
            "beside_lines": args.beside_lines,
            "line_max_tokens": LINE_TOKENS,
            "load_average_at_start": os.getloadavg()[0],
            "state_redis": "embedded" if mesh.redis_state is not None else "none",
        }
        loop = functools.partial(closed_loop_32, mesh.target("inference"), args.measure, args.warmup)
        before = asyncio.run(loop())
        result.update(asyncio.run(batch_alone(base_url, args.lines)))
        after = asyncio.run(loop())
        result["closed_loop_32_tok_s"] = (before + after) / 2
        result["closed_loop_32_tok_s_runs"] = [round(before, 2), round(after, 2)]
        arms = interactive_arms(base_url, args.beside_lines, args.interactive_seconds, args.rounds)
        result.update(asyncio.run(arms))
        lease_s = load("gateway", mesh.base_env).batch.lease_seconds
        result.update(asyncio.run(restart(mesh, args.restart_lines, lease_s)))
    result["passes"] = {
        # A refused interactive request has no TTFT: the target holds only if there were none.
        "interactive_ttft_with_batch_within_1_2x": result["interactive_ttft_p95_s_with_batch"]
        <= 1.2 * result["interactive_ttft_p95_s_alone"]
        and result["interactive_errors_with_batch"] == 0,
        "batch_tok_s_at_least_0_8x_closed_loop": result["batch_tok_s_alone"] >= 0.8 * result["closed_loop_32_tok_s"],
        "no_lost_lines": result["lost_lines"] == 0 and result["restart_killed_mid_batch"],
        "no_duplicate_lines": result["duplicate_lines"] == 0 and result["restart_killed_mid_batch"],
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if k != "machine"}, "bench.batch")
    print(f"wrote {write_result(args.name, result)}")


if __name__ == "__main__":
    main()
