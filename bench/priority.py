"""Priority benchmark, in process on the builtin engine (SmolLM2-135M-Instruct, the real prepared
weights, float32, one torch thread): interactive time to first token beside a batch backlog sent
as batch priority (1, the gateway's `batch` lane) and, for comparison, as interactive work
(priority 0: every row alike, as the engine treated them before it had priorities).

Figures, each in seconds and in engine steps (decode steps between the submission and the first
token: what the wait costs whatever the machine's load, which on a shared 2-core machine moves
the seconds a lot):

* interactive_ttft_*_alone              sequential interactive requests (4 new tokens) on an idle engine
* interactive_ttft_*_with_batch         the same while 2 x max_batch_size batch requests (48 new
                                        tokens) fill every row and queue behind them, as priority 1
* interactive_ttft_*_with_batch_no_priority  the same, the backlog sent as priority 0
* preemptions_priority                  batch rows preempted for the interactive requests

`--ab OLD_TREE` adds a throughput A/B of the engine's step: the same closed batch (32 streams,
64 new tokens, bench.batching's prompts) run in a subprocess from another source tree (the code
before a change, `git archive`d) and from this one, alternated, reporting tokens per second and
tokens per CPU-second of the process (the second holds better on a loaded machine).

Run: `.venv/bin/python -m bench.priority [--ab DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from prometheus_client import REGISTRY

from bench.batching import build_prompts
from bench.common import machine, print_table, write_result
from llmesh.models import verify
from llmesh.testing import real_models_dir
from services.inference.engine import Engine, EngineConfig
from services.inference.engine.decoding import SamplingParams
from services.inference.engine.sequence import PRIORITY_BATCH, PRIORITY_INTERACTIVE

MAX_BATCH_SIZE = 8
BACKLOG = 2 * MAX_BATCH_SIZE
BATCH_NEW_TOKENS = 48
INTERACTIVE_REQUESTS = 4
INTERACTIVE_NEW_TOKENS = 4
ROOT = Path(__file__).resolve().parent.parent


async def interactive_ttfts(engine: Engine, prompts: list[list[int]]) -> list[tuple[float, int]]:
    """(seconds, engine steps) to the first token of each interactive request, one at a time."""
    out = []
    for ids in prompts[:INTERACTIVE_REQUESTS]:
        sent, steps = time.perf_counter(), engine.steps
        first: tuple[float, int] | None = None
        params = SamplingParams(max_new_tokens=INTERACTIVE_NEW_TOKENS, ignore_eos=True)
        async for event in engine.submit(ids, params, priority=PRIORITY_INTERACTIVE):
            if first is None and event.token_ids:
                first = (time.perf_counter() - sent, engine.steps - steps)
        assert first is not None
        out.append(first)
    return out


async def phase(
    engine: Engine, interactive: list[list[int]], batch: list[list[int]], priority: int | None
) -> dict[str, Any]:
    backlog: list[asyncio.Task[None]] = []
    started: list[int] = []
    full = asyncio.Event()  # every row holds a batch line (each runs far longer than the measurement)

    async def batch_line(i: int) -> None:
        params = SamplingParams(max_new_tokens=BATCH_NEW_TOKENS, ignore_eos=True)
        async for _ in engine.submit(batch[i % len(batch)], params, priority=priority or 0):
            if i not in started:
                started.append(i)
                if len(started) >= MAX_BATCH_SIZE:
                    full.set()

    if priority is not None:
        backlog = [asyncio.create_task(batch_line(i)) for i in range(BACKLOG)]
        await full.wait()
    ttfts = await interactive_ttfts(engine, interactive)
    await asyncio.gather(*backlog)
    seconds = [s for s, _ in ttfts]
    steps = [n for _, n in ttfts]
    return {
        "ttft_s_median": statistics.median(seconds),
        "ttft_s_max": max(seconds),
        "ttft_steps_median": statistics.median(steps),
        "ttft_steps_max": max(steps),
    }


def preempted() -> float:
    return REGISTRY.get_sample_value("llmesh_inference_preemptions_total", {"reason": "priority"}) or 0.0


def priority_run() -> dict[str, Any]:
    torch.set_num_threads(1)
    model_dir = real_models_dir() / "smollm2" / "current"
    interactive = build_prompts(model_dir, count=INTERACTIVE_REQUESTS)
    batch = build_prompts(model_dir, "Summarise the following for a report.", 16)
    config = EngineConfig(max_batch_size=MAX_BATCH_SIZE, dtype="float32", max_queue=4 * BACKLOG, queue_timeout_s=3600.0)
    engine = Engine.boot(verify(model_dir), config, "cpu")
    try:
        alone = asyncio.run(phase(engine, interactive, batch, None))
        before = preempted()
        with_batch = asyncio.run(phase(engine, interactive, batch, PRIORITY_BATCH))
        preemptions = preempted() - before
        no_priority = asyncio.run(phase(engine, interactive, batch, PRIORITY_INTERACTIVE))
    finally:
        engine.close()
    result: dict[str, Any] = {"max_batch_size": MAX_BATCH_SIZE, "backlog": BACKLOG, "preemptions_priority": preemptions}
    for name, figures in (("alone", alone), ("with_batch", with_batch), ("with_batch_no_priority", no_priority)):
        for key, value in figures.items():
            result[f"interactive_{key}_{name}"] = value
    result["passes"] = {
        # With priority an interactive request waits at most for the step under way and its own prefill.
        "ttft_steps_with_batch_le_2": result["interactive_ttft_steps_max_with_batch"] <= 2,
        # Without priority the first interactive request waits behind the whole backlog.
        "ttft_steps_with_batch_lt_no_priority": result["interactive_ttft_steps_max_with_batch"]
        < result["interactive_ttft_steps_max_with_batch_no_priority"],
    }
    return result


#: One arm of the A/B, run with `python -c` from a source tree (the old one has the engine's
#: decoding module outside the engine package).
AB_ARM = """
import asyncio, json, os, sys, time
import torch
torch.set_num_threads(1)
from bench.batching import build_prompts
from llmesh.models import verify
from llmesh.testing import real_models_dir
from services.inference.engine import Engine, EngineConfig
try:
    from services.inference.engine.decoding import SamplingParams
except ImportError:
    from services.inference.decoding import SamplingParams
model_dir = real_models_dir() / "smollm2" / "current"
prompts = build_prompts(model_dir)
engine = Engine.boot(verify(model_dir), EngineConfig(max_batch_size=32, dtype="float32"), "cpu")
async def one(ids):
    n = 0
    async for event in engine.submit(ids, SamplingParams(max_new_tokens=64, ignore_eos=True)):
        n += len(event.token_ids)
    return n
async def main():
    await one(prompts[0])
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens, time.perf_counter() - wall, time.process_time() - cpu
tokens, wall, cpu = asyncio.run(main())
engine.close()
print(json.dumps({"tokens": tokens, "tok_s": tokens / wall, "tok_per_cpu_s": tokens / cpu}))
"""


def ab_run(old: Path, rounds: int) -> dict[str, Any]:
    arms: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for _ in range(rounds):
        for arm, tree in (("old", old), ("new", ROOT)):
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
            out = subprocess.run(
                [sys.executable, "-c", AB_ARM], cwd=tree, env=env, capture_output=True, text=True, check=True
            )
            arms[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(arm, arms[arm][-1], flush=True)
    result: dict[str, Any] = {}
    for key in ("tok_s", "tok_per_cpu_s"):
        old_mean = statistics.mean(r[key] for r in arms["old"])
        new_mean = statistics.mean(r[key] for r in arms["new"])
        result[f"{key}_old"], result[f"{key}_new"] = old_mean, new_mean
        result[f"{key}_new_over_old"] = new_mean / old_mean
        result[f"{key}_runs"] = {arm: [round(r[key], 2) for r in runs] for arm, runs in arms.items()}
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ab", type=Path, default=None, help="another source tree to compare the step against")
    parser.add_argument("--ab-rounds", type=int, default=2)
    parser.add_argument("--ab-only", action="store_true", help="only the A/B (kept: the priority figures on file)")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"machine_before": machine()}
    if args.ab_only:
        from bench.common import RESULTS_DIR

        result = {**json.loads((RESULTS_DIR / "priority.json").read_text()), **result}
    else:
        result.update(priority_run())
    if args.ab is not None:
        result["step_ab"] = ab_run(args.ab, args.ab_rounds)
    result["machine_after"] = machine()
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "priority")
    print(write_result("priority", result))


if __name__ == "__main__":
    main()
