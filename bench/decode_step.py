"""Where a decode step goes, and A/B of the engine's forwards in one process, on the real SmolLM2.

Arms, all over the same KV blocks and the same sequences, alternating (ABBA...) step by step:

* transformers   transformers' forward (separate q/k/v and gate/up projections)
* own            the engine's own Llama forward (engine/llama.py: fused projections, LM head
                 over the decode rows only)
* own_int8       the own forward on int8 weights (services/inference/engine/quantize.py)
* own_int4       the own forward on int4 weights (the LM head int8)

at one row (one stream decoding) and at 32 rows (bench.batching's 32 chat prompts). The
quantized arms use the quantized kernel for calls of at most QUANT_MAX_ROWS rows, as served.

`--profile`: the torch profiler over a few steps of each arm and batch size, split into matmuls
(with the weight bytes they read per step and so their effective GB/s), attention (the KV
writes and gathers, scaled-dot-product attention), norms/rotary/activation (the elementwise
rest), sampling (the greedy choice) and Python/dispatch (the step's wall time no op accounts
for).

`--kernels`: the matmul kernels alone on SmolLM2's projection shapes (f32, bf16, int8, int4) at
1, 4 and 32 rows: what QUANT_MAX_ROWS is chosen from.

Ratios measured side by side are what this is for: the machine is shared and noisy, so the
load average is kept with them. Writes bench/results/decode_step.json.

Run: `.venv/bin/python -m bench.decode_step [--steps 12] [--profile] [--kernels]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.batching import build_prompts
from bench.common import machine, print_table, write_result
from llmesh.models import verify
from llmesh.testing import real_models_dir

NO_SAMPLING: tuple[list[int], list[float], list[float], list[int], list[int]] = ([], [], [], [], [])
ARMS = ("transformers", "own", "own_int8", "own_int4")

#: Profiler op names by part of the step (self CPU time; anything else is "other ops").
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm")
ATTENTION_OPS = ("scaled_dot_product", "aten::index_copy", "aten::index", "aten::_softmax", "aten::where")
ELEMENTWISE_OPS = ("rms_norm", "aten::mul", "aten::add", "aten::cat", "aten::neg", "silu", "aten::rsqrt", "aten::pow")
ELEMENTWISE_OPS += ("aten::mean", "aten::embedding", "aten::copy_", "aten::_to_copy", "aten::slice", "aten::view")
SAMPLING_OPS = ("aten::argmax", "aten::max", "aten::topk", "aten::sort", "aten::softmax", "aten::multinomial")


def part_of(op: str) -> str:
    if any(op.startswith(name) for name in MATMUL_OPS) or "linear" in op:
        return "matmul"
    if any(name in op for name in ATTENTION_OPS):
        return "attention"
    if any(name in op for name in SAMPLING_OPS):
        return "sampling"
    if any(name in op for name in ELEMENTWISE_OPS):
        return "norms_rotary_elementwise"
    return "other_ops"


def weight_bytes(decoder: Any, rows: int) -> int:
    """Bytes of the weights one decode step of `rows` rows reads (the projections and the LM
    head; the embedding reads one row per token), as the kernel that serves them holds them."""
    total = 0
    for linear in [item for layer in decoder.layers for item in layer[1:] if hasattr(item, "quantized")] + [
        decoder.lm_head
    ]:
        if linear.quantized is not None and rows <= decoder.quant_max_rows:
            total += linear.quantized.nbytes
        elif linear.weight is not None:
            total += linear.weight.numel() * linear.weight.element_size()
        else:
            total += linear.packed.numel() * linear.packed.element_size()
    return total


def main(argv: Sequence[str] | None = None) -> None:
    from services.inference.engine import LoadedModel, quality
    from services.inference.engine.llama import LlamaDecoder
    from services.inference.engine.runner import ModelRunner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="decode steps per arm and batch size")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--profile", action="store_true", help="the per-part breakdown of a step")
    parser.add_argument("--kernels", action="store_true", help="the matmul kernels alone")
    args = parser.parse_args(argv)
    begun = time.perf_counter()

    model_dir = real_models_dir() / "smollm2" / "v1"
    prompts = build_prompts(model_dir)
    verified = verify(model_dir)
    loaded = LoadedModel(verified, "cpu", args.dtype)
    rows_n = len(prompts)
    block = 16
    per_row = 2048 // block
    runner = ModelRunner(loaded, rows_n * per_row + 1, block, 2048, tuple(range(1, rows_n + 1)), cuda_graphs=False)
    tables = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows_n)]
    own = runner.fast
    if own is None:
        raise SystemExit("the own forward does not support this model here")
    forwards: dict[str, Any] = {"transformers": None, "own": own}
    for method in ("int8", "int4"):
        # The same weights quantized as LLMESH_QUANTIZE does (without the guard, measured apart).
        hf = quality.convert(quality.load_weights(verified, loaded.device, loaded.dtype), loaded.dtype, method)
        forwards[f"own_{method}"] = LlamaDecoder(hf, runner.kv, rows_n, per_row * block)
    result: dict[str, Any] = {
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "packed_weights": own.pack,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
    }
    print(f"dtype {loaded.dtype}, packed weights {own.pack}, {torch.get_num_threads()} threads")

    with torch.inference_mode():
        first = runner.prefill([(p, 0, t) for p, t in zip(prompts, tables, strict=True)]).argmax(-1).tolist()
        for rows in (1, rows_n):
            tokens = first[:rows]
            lengths = [len(p) for p in prompts[:rows]]
            times: dict[str, list[float]] = {name: [] for name in forwards}

            def step(name: str, rows: int = rows, lengths: list[int] = lengths) -> float:
                nonlocal tokens
                runner.fast = forwards[name]
                batch = [(tokens[i], lengths[i], tables[i]) for i in range(rows)]
                started = time.perf_counter()
                tokens = runner.decode(batch, NO_SAMPLING)
                spent = time.perf_counter() - started
                lengths[:] = [n + 1 for n in lengths]
                return spent

            for name in forwards:  # warm-up
                step(name)
            for i in range(args.steps):
                for name in list(forwards)[:: 1 if i % 2 == 0 else -1]:
                    times[name].append(step(name))
            medians = {name: statistics.median(spent) for name, spent in times.items()}
            figures = {f"{name}_ms": round(ms * 1e3, 2) for name, ms in medians.items()}
            figures.update({f"{name}_tok_s": round(rows / ms, 1) for name, ms in medians.items()})
            figures.update({f"{name}_vs_transformers": medians["transformers"] / ms for name, ms in medians.items()})
            result[f"step_{rows}"] = figures
            print_table(figures, f"decode step, {rows} row(s), median of {args.steps}")
            if args.profile:
                result[f"profile_{rows}"] = {
                    name: profile_steps(step, name, 3, weight_bytes(forwards[name], rows) if forwards[name] else 0)
                    for name in forwards
                }
                for name, parts in result[f"profile_{rows}"].items():
                    print_table(parts, f"profile, {rows} row(s), {name} (ms per step)")
    if args.kernels:
        result["kernels"] = kernels()
    result["machine"] = machine()
    result["bench_seconds"] = round(time.perf_counter() - begun, 1)
    print(f"\nwrote {write_result('decode_step', result)}")


def profile_steps(step: Any, name: str, count: int, bytes_per_step: int) -> dict[str, float]:
    """ms per step in each part (self CPU time of the ops), and the matmuls' effective GB/s."""
    from torch.profiler import ProfilerActivity, profile

    wall = 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(count):
            wall += step(name)
    parts: dict[str, float] = {}
    for event in prof.key_averages():
        part = part_of(event.key)
        parts[part] = parts.get(part, 0.0) + event.self_cpu_time_total / 1e3 / count
    step_ms = 1e3 * wall / count
    out = {"step_ms": round(step_ms, 2), **{k: round(v, 2) for k, v in sorted(parts.items())}}
    out["python_dispatch_ms"] = round(max(0.0, step_ms - sum(parts.values())), 2)
    if bytes_per_step and parts.get("matmul"):
        out["weight_mb_per_step"] = round(bytes_per_step / 1e6, 1)
        out["matmul_gb_s"] = round(bytes_per_step / (parts["matmul"] / 1e3) / 1e9, 1)
    return out


def kernels(repeats: int = 20) -> dict[str, dict[str, float]]:
    """Microseconds (best of `repeats`, arms interleaved) of SmolLM2's projections summed, per
    kernel and row count."""
    from services.inference.engine.quantize import QuantizedWeight

    shapes = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]
    out: dict[str, dict[str, float]] = {}
    torch.manual_seed(0)
    for rows in (1, 4, 32):
        best: dict[str, float] = {}
        for o, i in shapes:
            w32 = torch.randn(o, i) * 0.02
            wb = w32.bfloat16()
            q8, q4 = QuantizedWeight(wb, "int8"), QuantizedWeight(wb, "int4")
            x32 = torch.randn(rows, i)
            xb = x32.bfloat16()
            arms = {
                "f32": lambda x32=x32, w32=w32: torch.nn.functional.linear(x32, w32),
                "bf16": lambda xb=xb, wb=wb: torch.nn.functional.linear(xb, wb),
                "int8": lambda xb=xb, q8=q8: q8(xb),
                "int4": lambda xb=xb, q4=q4: q4(xb),
            }
            shape_best = dict.fromkeys(arms, float("inf"))
            for _ in range(repeats):
                for name, call in arms.items():
                    started = time.perf_counter()
                    call()
                    shape_best[name] = min(shape_best[name], time.perf_counter() - started)
            for name, spent in shape_best.items():
                best[name] = best.get(name, 0.0) + spent * 30  # 30 layers
        out[f"rows_{rows}"] = {f"{name}_us_per_step": round(us * 1e6) for name, us in best.items()}
        print_table(out[f"rows_{rows}"], f"projection matmuls of one step (30 layers), {rows} row(s)")
    return out


if __name__ == "__main__":
    main()
