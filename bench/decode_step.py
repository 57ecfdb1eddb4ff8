"""A/B of the engine's forwards in one process: the own Llama forward (services/inference/
engine/llama.py) against transformers' forward over the same KV blocks, on the real SmolLM2.

The 32 chat prompts of bench.batching are prefilled into 32 rows of blocks; then decode steps of all 32
rows alternate between the two forwards (ABBA order, each step continuing the same sequences),
and prefills of one and of two prompts (the closed loop's arrivals) alternate the same way.
Ratios measured side by side are what this is for: the machine is shared and noisy, so the
load average is printed with them.

Run: `.venv/bin/python -m bench.decode_step [--steps 12] [--dtype auto]` (about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.batching import build_prompts
from llmesh.models import verify
from llmesh.testing import real_models_dir

NO_SAMPLING: tuple[list[int], list[float], list[float], list[int], list[int]] = ([], [], [], [], [])


def main(argv: Sequence[str] | None = None) -> None:
    from services.inference.engine import LoadedModel
    from services.inference.engine.runner import ModelRunner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="decode steps per forward")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of 3 steps each")
    args = parser.parse_args(argv)

    model_dir = real_models_dir() / "smollm2" / "v1"
    prompts = build_prompts(model_dir)
    loaded = LoadedModel(verify(model_dir), "cpu", args.dtype)
    rows_n = len(prompts)
    block = 16
    per_row = 2048 // block
    runner = ModelRunner(loaded, rows_n * per_row + 1, block, 2048, tuple(range(1, rows_n + 1)), cuda_graphs=False)
    tables = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows_n)]
    own = runner.fast
    if own is None:
        raise SystemExit("the own forward does not support this model here")
    forwards = {"transformers": None, "own": own}
    print(f"dtype {loaded.dtype}, packed weights {own.pack}, {torch.get_num_threads()} threads")
    times: dict[str, list[float]] = {name: [] for name in forwards}

    with torch.inference_mode():
        tokens = runner.prefill([(p, 0, t) for p, t in zip(prompts, tables, strict=True)]).argmax(-1).tolist()
        lengths = [len(p) for p in prompts]

        def step(name: str) -> None:
            nonlocal tokens
            runner.fast = forwards[name]
            rows = [(tokens[i], lengths[i], tables[i]) for i in range(rows_n)]
            started = time.perf_counter()
            tokens = runner.decode(rows, NO_SAMPLING)
            times[name].append(time.perf_counter() - started)
            lengths[:] = [n + 1 for n in lengths]

        def alternate(run: Callable[[str], None], count: int) -> None:
            for name in forwards:  # warm-up
                run(name)
                times[name].clear()
            for i in range(count):
                for name in list(forwards)[:: 1 if i % 2 == 0 else -1]:
                    run(name)

        alternate(step, args.steps)
        report("decode step, 32 rows", times, f"width {max(lengths)}")
        for group in (1, 2):
            for spent in times.values():
                spent.clear()

            def prefill(name: str, group: int = group) -> None:
                runner.fast = forwards[name]
                started = time.perf_counter()
                runner.prefill([(p, 0, t) for p, t in zip(prompts[:group], tables, strict=False)])
                times[name].append(time.perf_counter() - started)

            alternate(prefill, args.steps)
            report(f"prefill of {group} prompt(s)", times, f"{len(prompts[0])} tokens each")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name in forwards:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        step(name)
                print(f"--- {name}: 3 decode steps")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(f"load average {os.getloadavg()[0]:.2f}")


def report(what: str, times: dict[str, list[float]], note: str) -> None:
    base = statistics.median(times["transformers"])
    own = statistics.median(times["own"])
    print(
        f"{what} ({note}): transformers {base * 1e3:.1f} ms (min {min(times['transformers']) * 1e3:.1f}), "
        f"own {own * 1e3:.1f} ms (min {min(times['own']) * 1e3:.1f}), {base / own:.2f}x"
    )


if __name__ == "__main__":
    main()
