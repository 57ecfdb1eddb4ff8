"""Priority benchmark: interactive time to first token beside a batch backlog on the builtin
engine, with the backlog sent as batch priority (InferenceRequest.priority = 1, the gateway's
`batch` lane) and, for comparison, as interactive work (priority 0: every row alike, as the
engine treated them before it had priorities).

SmolLM2-135M-Instruct (the real prepared weights), one inference service started as a separate
process (llmesh.supervisor.Mesh) with LLMESH_MAX_BATCH_SIZE=16:

* interactive_ttft_p50_s / _p95_s_alone       4 closed-loop interactive clients (chat prompts,
                                               16 new tokens), nothing else running
* interactive_ttft_p95_s_with_batch            the same 4 clients beside 32 closed-loop batch
                                               clients (128 new tokens each) sent as priority 1:
                                               they fill every row and queue behind them
* interactive_ttft_p95_s_with_batch_no_priority  the same, the backlog sent as priority 0
* batch_tok_s_with_interactive                 the batch clients' tokens/s meanwhile (priority 1)
* preemptions_priority                         batch rows the engine preempted for the
                                               interactive ones (llmesh_inference_preemptions_total)

Target (the `passes` entry): interactive_ttft_p95_s_with_batch <= 1.5 x the alone figure plus
one decode step of the full batch, and below the no-priority figure.

`--ab OLD_TREE` adds bench.batching's closed loop (32 clients, 64 new tokens) against a service
run from another source tree (say the code before a change, `git archive`d) and from this one,
alternated in one run: mesh_tok_s_ab.{old,new} and their ratio.

Run: `.venv/bin/python -m bench.priority` (about 3 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.batching import build_prompts, mesh_fixed
from bench.common import machine, percentile, print_table, write_result
from llmesh.supervisor import Mesh
from llmesh.testing import real_models_dir
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

INTERACTIVE_CLIENTS = 4
INTERACTIVE_NEW_TOKENS = 16
BATCH_CLIENTS = 32
BATCH_NEW_TOKENS = 128
MAX_BATCH_SIZE = 16


class Loop:
    """Closed-loop clients of one kind: each sends its next request when the last one ended."""

    def __init__(self, stub: Any, prompts: list[list[int]], max_new: int, priority: int) -> None:
        self.stub = stub
        self.prompts = prompts
        self.max_new = max_new
        self.priority = priority
        #: (sent, first token) of each request; (time, tokens) of each message with tokens.
        self.ttfts: list[tuple[float, float]] = []
        self.arrivals: list[tuple[float, int]] = []
        self.stop = False

    async def client(self, i: int) -> None:
        ids = self.prompts[i % len(self.prompts)]
        while not self.stop:
            request = inference_pb2.InferenceRequest(
                token_ids=inference_pb2.TokenIds(ids=ids),
                sampling=common_pb2.SamplingParams(max_new_tokens=self.max_new, ignore_eos=True),
                priority=self.priority,
            )
            sent = time.perf_counter()
            first = None
            async for message in self.stub.Generate(request, timeout=600):
                if message.token_ids:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        self.ttfts.append((sent, now))
                    self.arrivals.append((now, len(message.token_ids)))

    def start(self, clients: int) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self.client(i)) for i in range(clients)]

    def ttft(self, lo: float, hi: float, q: float) -> float:
        return percentile([first - sent for sent, first in self.ttfts if lo <= sent and first < hi], q)

    def tok_s(self, lo: float, hi: float) -> float:
        return sum(n for t, n in self.arrivals if lo <= t < hi) / (hi - lo)


async def stop(loops: Sequence[Loop], tasks: list[asyncio.Task[None]]) -> None:
    for loop in loops:
        loop.stop = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def preemptions(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llmesh_inference_preemptions_total" and sample.labels.get("reason") == "priority":
                return sample.value
    return 0.0


async def phase(
    target: str, interactive: list[list[int]], batch: list[list[int]], batch_priority: int | None, args: Any
) -> dict[str, float]:
    """The interactive clients alone (batch_priority None) or beside the batch backlog."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        tasks: list[asyncio.Task[None]] = []
        loops: list[Loop] = []
        if batch_priority is not None:
            backlog = Loop(stub, batch, BATCH_NEW_TOKENS, batch_priority)
            loops.append(backlog)
            tasks += backlog.start(BATCH_CLIENTS)
            await asyncio.sleep(args.settle)  # the backlog fills every row and queues
        users = Loop(stub, interactive, INTERACTIVE_NEW_TOKENS, 0)
        loops.append(users)
        tasks += users.start(INTERACTIVE_CLIENTS)
        await asyncio.sleep(2.0)  # the interactive clients' first requests, then measure
        lo = time.perf_counter()
        await asyncio.sleep(args.measure)
        hi = time.perf_counter()
        await stop(loops, tasks)
        result = {
            "ttft_p50_s": users.ttft(lo, hi, 0.5),
            "ttft_p95_s": users.ttft(lo, hi, 0.95),
            "interactive_requests": len([1 for sent, first in users.ttfts if lo <= sent and first < hi]),
        }
        if batch_priority is not None:
            result["batch_tok_s"] = loops[0].tok_s(lo, hi)
            gaps = [b[0] - a[0] for a, b in zip(loops[0].arrivals, loops[0].arrivals[1:], strict=False)]
            result["step_s"] = statistics.median(gaps) if gaps else 0.0
        return result


async def ab_loop(target: str, prompts: list[list[int]], args: Any) -> float:
    return float((await mesh_fixed(target, prompts, argparse.Namespace(measure=args.measure)))["mesh_tok_s"])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=float, default=20.0, help="measured seconds of each phase")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds the backlog runs before measuring")
    parser.add_argument("--ab", type=Path, default=None, help="another source tree to compare mesh_tok_s against")
    parser.add_argument("--ab-rounds", type=int, default=2)
    args = parser.parse_args(argv)
    models = real_models_dir()
    model_dir = models / "smollm2" / "current"
    interactive = build_prompts(model_dir, count=INTERACTIVE_CLIENTS)
    batch = build_prompts(model_dir, "Summarise the following for a report.", BATCH_CLIENTS)
    env = {
        "LLMESH_MODELS_DIR": str(models),
        "LLMESH_INFERENCE_MODEL": "smollm2",
        "LLMESH_MAX_BATCH_SIZE": str(MAX_BATCH_SIZE),
    }
    result: dict[str, Any] = {
        "max_batch_size": MAX_BATCH_SIZE,
        "interactive_clients": INTERACTIVE_CLIENTS,
        "batch_clients": BATCH_CLIENTS,
        "machine_before": machine(),
    }
    with Mesh(services=("inference",), env=env) as mesh:
        target = mesh.target("inference")
        metrics_url = f"http://127.0.0.1:{mesh.procs['inference'].metrics_port}/metrics"
        alone = asyncio.run(phase(target, interactive, batch, None, args))
        before = preemptions(metrics_url)
        with_batch = asyncio.run(phase(target, interactive, batch, 1, args))
        result["preemptions_priority"] = preemptions(metrics_url) - before
        no_priority = asyncio.run(phase(target, interactive, batch, 0, args))
    result.update(
        {
            "interactive_ttft_p50_s_alone": alone["ttft_p50_s"],
            "interactive_ttft_p95_s_alone": alone["ttft_p95_s"],
            "interactive_ttft_p50_s_with_batch": with_batch["ttft_p50_s"],
            "interactive_ttft_p95_s_with_batch": with_batch["ttft_p95_s"],
            "interactive_ttft_p50_s_with_batch_no_priority": no_priority["ttft_p50_s"],
            "interactive_ttft_p95_s_with_batch_no_priority": no_priority["ttft_p95_s"],
            "batch_tok_s_with_interactive": with_batch["batch_tok_s"],
            "batch_tok_s_with_interactive_no_priority": no_priority["batch_tok_s"],
            "batch_step_s": with_batch["step_s"],
            "interactive_requests": {
                "alone": alone["interactive_requests"],
                "with_batch": with_batch["interactive_requests"],
                "no_priority": no_priority["interactive_requests"],
            },
        }
    )
    bound = 1.5 * result["interactive_ttft_p95_s_alone"] + result["batch_step_s"]
    result["interactive_ttft_p95_bound_s"] = bound
    result["passes"] = {
        "ttft_p95_with_batch_le_1.5x_alone_plus_step": result["interactive_ttft_p95_s_with_batch"] <= bound,
        "ttft_p95_with_batch_lt_no_priority": result["interactive_ttft_p95_s_with_batch"]
        < result["interactive_ttft_p95_s_with_batch_no_priority"],
    }
    if args.ab is not None:
        prompts = build_prompts(model_dir)
        ab: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.ab_rounds):
            for arm, path in (("old", args.ab), ("new", Path(__file__).resolve().parent.parent)):
                ab_env = {**env, "LLMESH_MAX_BATCH_SIZE": "32", "PYTHONPATH": str(path)}
                with Mesh(services=("inference",), env=ab_env, cwd=path) as mesh:
                    ab[arm].append(asyncio.run(ab_loop(mesh.target("inference"), prompts, args)))
        result["mesh_tok_s_ab"] = {
            "old": statistics.mean(ab["old"]),
            "new": statistics.mean(ab["new"]),
            "old_runs": ab["old"],
            "new_runs": ab["new"],
            "new_over_old": statistics.mean(ab["new"]) / statistics.mean(ab["old"]),
        }
    result["machine_after"] = machine()
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "priority")
    print(write_result("priority", result))


if __name__ == "__main__":
    main()
