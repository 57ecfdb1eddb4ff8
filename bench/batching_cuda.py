"""GPU benchmark of the builtin engine: KV slots, bucketed CUDA graphs, against transformers'
own continuous-batching manager and a static-cache compiled `generate` (the ceiling).

A random-weight model with SmolLM2-135M-Instruct's exact config (shapes decide speed, so no
model files are needed; the tokenizer is scripts/cuda_smoke_assets/), EOS ignored, greedy, the
engine in this process (no gRPC). Side by side in one run:

* tok_s_<N>              N concurrent streams (1, 32, 128, 256), each NEW_TOKENS new tokens,
                         submitted at once: generated tokens / wall time (prefill included)
* decode_step_ms_<R>     one decode step of R running rows (32, 128), the runner alone
* graph_replay_matches_eager   a captured bucket's replay gives the eager step's tokens (CUDA)
* hf_manager_tok_s_<C>   transformers' continuous-batching manager (`generate_batch`, paged
                         attention, CUDA graphs) on the same prompts, C = 128 streams
* static_compiled_tok_s_<C>    `generate` with a static cache and torch.compile
                         (mode="reduce-overhead"), one batch of C: the ceiling

Targets on CUDA (`passes`): tok_s_128 >= 0.8 x static_compiled_tok_s_128 and >= 1.5 x
hf_manager_tok_s_128; decode_step_ms_32 <= 3.

Run: `python -m bench.batching_cuda` (about 5 minutes with warm-up on one GPU; writes
bench/results/batching_cuda.json). `--tiny` runs a 2-layer model at small sizes on any device
(the test suite runs it on CPU so the benchmark keeps working without a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.common import machine, print_table, write_result

ASSETS = Path(__file__).resolve().parent.parent / "scripts" / "cuda_smoke_assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

#: SmolLM2-135M-Instruct's config.json, the fields that decide shapes and numerics.
SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TINY = {**SMOLLM2_135M, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY["num_key_value_heads"] = 2
TINY["max_position_embeddings"] = 256  # a static cache is sized to it

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Give me three tips for better sleep.",
    "What is a prime number?",
    "How do vaccines work?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "What causes the seasons on Earth?",
]


def build_model(root: Path, config_kwargs: dict[str, Any], device: torch.device) -> Path:
    """Random weights, prepared like a real model (safetensors + manifest)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmesh import models

    target = root / "random" / "v1"
    target.mkdir(parents=True)
    config = LlamaConfig(**config_kwargs, initializer_range=0.1)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copy2(ASSETS / name, target / name)
    models.write_manifest(target, "random-smollm2-135m-shapes", {"generator": "bench/batching_cuda.py"})
    del model, state
    gc.collect()
    return target


def build_prompts(encode: Any, count: int) -> list[list[int]]:
    return [
        encode(f"<|im_start|>user\n{QUESTIONS[i % len(QUESTIONS)]} ({i})<|im_end|>\n<|im_start|>assistant\n")
        for i in range(count)
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- the engine


def run_engine(path: Path, args: argparse.Namespace, device: torch.device, result: dict[str, Any]) -> None:
    from llmesh.models import verify
    from services.inference.engine import Engine, EngineConfig, LoadedModel
    from services.inference.engine.decoding import SamplingParams

    top = max(args.streams)
    config = EngineConfig(
        max_batch_size=top,
        max_queue=top,
        max_prompt_tokens=64,
        max_new_tokens=args.new_tokens,
        default_max_new_tokens=args.new_tokens,
        max_batch_total_tokens=top * (64 + args.new_tokens),
    )
    loaded = LoadedModel(verify(path), device.type)
    result["dtype"] = str(loaded.dtype).removeprefix("torch.")
    started = time.perf_counter()
    engine = Engine(loaded, config, name="bench")
    engine.warm_up()
    result["engine_warm_up_s"] = time.perf_counter() - started
    result["cuda_graphs"] = len(engine.runner.graphs)
    engine.start()
    prompts = build_prompts(loaded.encode, top)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    async def streams(n: int) -> float:
        async def one(ids: list[int]) -> int:
            count = 0
            async for event in engine.submit(ids, params):
                count += len(event.token_ids)
            return count

        await asyncio.gather(*(one(p) for p in prompts[: min(n, 4)]))  # warm the path
        t0 = time.perf_counter()
        produced = await asyncio.gather(*(one(p) for p in prompts[:n]))
        return sum(produced) / (time.perf_counter() - t0)

    try:
        for n in args.streams:
            result[f"tok_s_{n}"] = asyncio.run(streams(n))
            print(f"  engine, {n} streams: {result[f'tok_s_{n}']:.1f} tok/s", flush=True)
        runner = engine.runner
        no_sampling: tuple[list[int], list[float], list[float], list[int], list[int]] = ([], [], [], [], [])
        with torch.inference_mode():
            for rows in args.step_rows:
                tables = [list(range(1 + r * 4, 5 + r * 4)) for r in range(rows)]  # 4 blocks each
                batch = [(5, 48, tables[r]) for r in range(rows)]
                for _ in range(3):
                    runner.decode(batch, no_sampling)
                times = []
                for _ in range(args.step_repeats):
                    t0 = time.perf_counter()
                    runner.decode(batch, no_sampling)  # ends in the step's one device-to-host copy
                    times.append(time.perf_counter() - t0)
                result[f"decode_step_ms_{rows}"] = 1000 * statistics.median(times)
            if runner.graphs:
                # The same inputs through the captured graph and through the eager step over the
                # same (full) width: the replay must give the eager step's tokens.
                rows = args.step_rows[0]
                tables = [list(range(1 + r * 4, 5 + r * 4)) for r in range(rows)]
                batch = [(7, 50, tables[r]) for r in range(rows)]
                replay_logits = runner.step_logits(batch)[:rows].float().clone()
                eager_logits = runner.step_logits(batch, eager_width=runner.max_blocks * runner.block_tokens)
                eager_logits = eager_logits[:rows].float()
                replayed = replay_logits.argmax(-1).tolist()
                eager = eager_logits.argmax(-1).tolist()
                result["graph_replay_matches_eager"] = replayed == eager
                result["graph_replay_max_logit_diff"] = float((replay_logits - eager_logits).abs().max())
    finally:
        engine.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- transformers ceilings


def load_hf(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, dtype=dtype, local_files_only=True)
    return model.to(device).eval()  # type: ignore[arg-type]


def hf_manager(
    path: Path, prompts: list[list[int]], args: argparse.Namespace, device: torch.device, dtype: Any
) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(path, device, dtype)
    gen = GenerationConfig(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=2,
    )
    if device.type == "cuda":
        cb = ContinuousBatchingConfig(use_cuda_graph=True)
    else:  # sized by hand: the automatic sizing reads device memory
        cb = ContinuousBatchingConfig(use_cuda_graph=False, page_size=32, num_blocks=64, max_batch_tokens=256)
    model.generate_batch(prompts[:4], generation_config=gen, continuous_batching_config=cb)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    sync(device)
    produced = sum(len(o.generated_tokens) for o in outputs.values())
    del model
    return produced / (time.perf_counter() - t0)


def static_compiled(
    path: Path, prompts: list[list[int]], args: argparse.Namespace, device: torch.device, dtype: Any
) -> float:
    model = load_hf(path, device, dtype)
    if device.type == "cuda":
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = {
        "attention_mask": mask,
        "do_sample": False,
        "max_new_tokens": args.new_tokens,
        "min_new_tokens": args.new_tokens,
        "pad_token_id": 2,
        "cache_implementation": "static",
    }
    with torch.inference_mode():
        for _ in range(2):  # compile and capture
            model.generate(ids, **kwargs)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        sync(device)
    elapsed = time.perf_counter() - t0
    del model
    return (out.shape[1] - width) * len(prompts) / elapsed


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model at small sizes (CI, any device)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="write here instead of bench/results/")
    parser.add_argument("--no-ceilings", action="store_true", help="skip the transformers columns")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny:
        args.streams, args.step_rows, args.ceiling, args.new_tokens, args.step_repeats = (1, 4, 8), (4, 8), 8, 8, 3
        config_kwargs = TINY
    else:
        args.streams, args.step_rows, args.ceiling, args.new_tokens, args.step_repeats = (
            (1, 32, 128, 256),
            (32, 128),
            128,
            128,
            50,
        )
        config_kwargs = SMOLLM2_135M
    begun = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": "random weights, SmolLM2-135M config" if not args.tiny else "random weights, tiny config",
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
    }
    workdir = Path(tempfile.mkdtemp(prefix="llmesh-bench-cuda-"))
    try:
        path = build_model(workdir, config_kwargs, device)
        run_engine(path, args, device, result)
        if not args.no_ceilings:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            prompts = build_prompts(lambda t: tokenizer.encode(t, add_special_tokens=False).ids, args.ceiling)
            dtype = getattr(torch, result["dtype"])
            for key, fn in (("hf_manager", hf_manager), ("static_compiled", static_compiled)):
                name = f"{key}_tok_s_{args.ceiling}"
                try:
                    result[name] = fn(path, prompts, args, device, dtype)
                except Exception as exc:  # recorded: a ceiling that cannot run on this setup
                    result[name] = None
                    result[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"  {name}: {result[name]}", flush=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    c = args.ceiling
    engine_c = result.get(f"tok_s_{c}")
    static_c, manager_c = result.get(f"static_compiled_tok_s_{c}"), result.get(f"hf_manager_tok_s_{c}")
    if engine_c and static_c:
        result[f"engine_vs_static_compiled_{c}"] = engine_c / static_c
    if engine_c and manager_c:
        result[f"engine_vs_hf_manager_{c}"] = engine_c / manager_c
    if device.type == "cuda" and not args.tiny:
        result["passes"] = {
            "tok_s_128_ge_0.8x_static_compiled": bool(static_c) and engine_c >= 0.8 * static_c,
            "tok_s_128_ge_1.5x_hf_manager": bool(manager_c) and engine_c >= 1.5 * manager_c,
            "decode_step_ms_32_le_3": result.get("decode_step_ms_32", math.inf) <= 3.0,
            "graph_replay_matches_eager": bool(result.get("graph_replay_matches_eager")),
        }
    result["machine"] = machine()
    result["bench_seconds"] = time.perf_counter() - begun
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "batching (GPU engine)")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"\nwrote {args.out}")
    else:
        print(f"\nwrote {write_result('batching_cuda', result)}")
    return result


if __name__ == "__main__":
    main()
