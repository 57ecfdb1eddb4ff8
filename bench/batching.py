"""Continuous batching benchmark: the inference service against transformers baselines.

Same 32 chat prompts (SmolLM2-135M-Instruct, the real prepared weights), 64 new tokens each
with EOS ignored, greedy, side by side in one run:

* dtype                  the dtype the service serves in (ModelInfo.dtype: LLMESH_DTYPE, by
                         default picked by hardware, see llmesh/hardware.py)
* sequential_tok_s       one `model.generate` per request, one after another (a few requests),
                         in the served dtype
* offline_batch_tok_s    one `model.generate` over all 32 prompts as a left-padded batch, in the
                         served dtype
* sequential_fp32_tok_s, offline_batch_fp32_tok_s  the same two in float32 (the old ceilings:
                         what plain transformers does without the hardware's dtype)
* hf_continuous_batching_tok_s  transformers' own manager (`model.generate_batch`), extra column
* mesh_tok_s             32 concurrent streaming gRPC clients in closed loop against the
                         inference service started as a separate process (llmesh.supervisor.Mesh)
* ttft_idle_s            time to first token of a lone request on the idle service
* ttft_p50_s/ttft_p95_s  time to first token in the closed loop, after warm-up
* decode_step_s          median gap between two tokens of a stream in the closed loop (one
                         full-batch decode step)
* mixed_tok_s            the closed loop with max_new_tokens drawn from 8..128 per request
* sequential_mesh_tok_s  one client through the service, 64 new tokens, one request after
                         another (the single-stream figure beside vLLM's in bench.backends)
* mesh_tok_s_no_prefix   mesh_tok_s again on a service started with LLMESH_PREFIX_CACHING=0
                         (the prompts share the chat template's first tokens only)
* short_rps              requests/s of 16 closed-loop clients sending short requests: the
                         gateway's chat prompt (its default system prompt + a question), 8 new
                         tokens, EOS ignored (classification/extraction calls look like this);
                         with short_ttft_p50_s and short_latency_p50_s
* offline_short_rps      the ceiling for that load: plain transformers, the same 16 prompts as
                         one left-padded batch of 8 new tokens, repeated

Closed loop: each client sends its next request as soon as the previous one finished. The
clients start two decode steps apart (each once the previous one is decoding), which spreads
their arrivals over about one request's duration, as independent users would; 32 requests
arriving in the same instant would make the last one's first token wait for the prefill of
all 32 prompts whatever the scheduler does. Measured once every client is decoding.

Targets (the `passes` entries): mesh_tok_s >= 0.95 x mesh_tok_s_no_prefix (what the prefix
cache costs when nothing is shared); mesh_tok_s >= 0.8 x offline_batch_tok_s and >= 6 x
sequential_tok_s; mesh_tok_s >= 1.6 x offline_batch_fp32_tok_s; sequential_tok_s >= 1.6 x
sequential_fp32_tok_s (what the served dtype buys on this hardware); ttft_p95_s <= 3 x
ttft_idle_s + decode_step_s; short_rps >= 0.7 x offline_short_rps.

Run: `.venv/bin/python -m bench.batching` (about 4-5 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import math
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc

from bench.common import machine, percentile, print_table, write_result
from llmesh.supervisor import Mesh
from llmesh.testing import real_models_dir
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

CLIENTS = 32
NEW_TOKENS = 64
SEQUENTIAL_REQUESTS = 3
SHORT_CLIENTS = 16
SHORT_NEW_TOKENS = 8
OFFLINE_SHORT_REPEATS = 3

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Give me three tips for better sleep.",
    "What is a prime number?",
    "How do vaccines work?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "What causes the seasons on Earth?",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
    "Suggest a name for a pet turtle.",
    "How do I boil an egg?",
    "What is machine learning?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the primary colors?",
    "How many legs does a spider have?",
    "What is the speed of light?",
    "Explain gravity to a child.",
    "What is the tallest mountain in the world?",
    "How do plants drink water?",
    "Give me a fun fact about octopuses.",
    "What does a compiler do?",
    "How do bees make honey?",
    "What is the boiling point of water?",
    "Name three renewable energy sources.",
    "Why do cats purr?",
    "What is an atom made of?",
    "How does the internet work?",
    "What is the largest ocean?",
    "Describe a rainbow.",
    "What is democracy?",
    "How do magnets work?",
]


def build_prompts(model_dir: Path, system: str | None = None, count: int = CLIENTS) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for question in QUESTIONS[:count]:
        messages = [{"role": "user", "content": question}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


# --------------------------------------------------------------------------- transformers baselines


class Baselines:
    """transformers' generate on the same weights, in this process."""

    def __init__(self, model_dir: Path, prompts: list[list[int]], dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.prompts = prompts
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, use_safetensors=True, dtype=getattr(torch, dtype)
        ).eval()
        self.pad = int(self.model.config.pad_token_id or 0)
        self.greedy = {
            "do_sample": False,
            "max_new_tokens": NEW_TOKENS,
            "min_new_tokens": NEW_TOKENS,
            "pad_token_id": self.pad,
        }
        with torch.inference_mode():  # first-call allocations, not timed
            self.model.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=4, pad_token_id=self.pad)

    def sequential(self) -> float:
        torch = self.torch
        started = time.perf_counter()
        produced = 0
        with torch.inference_mode():
            for ids in self.prompts[:SEQUENTIAL_REQUESTS]:
                mask = torch.ones(1, len(ids), dtype=torch.long)
                out = self.model.generate(torch.tensor([ids]), attention_mask=mask, **self.greedy)
                produced += out.shape[1] - len(ids)
        return produced / (time.perf_counter() - started)

    def offline_batch(self) -> float:
        torch = self.torch
        width = max(len(p) for p in self.prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in self.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in self.prompts])
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, **self.greedy)
        return (out.shape[1] - width) * len(self.prompts) / (time.perf_counter() - started)

    def offline_short(self, prompts: list[list[int]]) -> float:
        """Requests/s of the short load as one left-padded batch of SHORT_NEW_TOKENS, repeated."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        short = {**self.greedy, "max_new_tokens": SHORT_NEW_TOKENS, "min_new_tokens": SHORT_NEW_TOKENS}
        started = time.perf_counter()
        with torch.inference_mode():
            for _ in range(OFFLINE_SHORT_REPEATS):
                self.model.generate(ids, attention_mask=mask, **short)
        return len(prompts) * OFFLINE_SHORT_REPEATS / (time.perf_counter() - started)

    def continuous_batching(self) -> float:
        """transformers' own continuous-batching manager (switches the model's attention
        implementation: run it last)."""
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=-1,
            pad_token_id=self.pad,
        )
        started = time.perf_counter()
        outputs = self.model.generate_batch(self.prompts, generation_config=config)
        return sum(len(o.generated_tokens) for o in outputs.values()) / (time.perf_counter() - started)


# --------------------------------------------------------------------------- the mesh


@dataclass
class Record:
    sent: float
    first: float | None = None
    done: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)


def request_for(ids: list[int], max_new: int) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        token_ids=inference_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
    )


async def one(
    stub: inference_pb2_grpc.InferenceStub,
    ids: list[int],
    max_new: int,
    decoding: asyncio.Event | None = None,
    records: list[Record] | None = None,
) -> Record:
    """One streamed request; `decoding` is set once its second token arrived. The record is
    appended to `records` at once, so a request still running when measuring stops counts."""
    record = Record(time.perf_counter())
    if records is not None:
        records.append(record)
    async for message in stub.Generate(request_for(ids, max_new), timeout=600):
        now = time.perf_counter()
        if message.token_ids:
            if record.first is None:
                record.first = now
            record.arrivals.append((now, len(message.token_ids)))
            if decoding is not None and len(record.arrivals) >= 2:
                decoding.set()
    record.done = time.perf_counter()
    if decoding is not None:
        decoding.set()
    return record


#: One streamed request of a closed loop: (prompt, max_new, decoding, records) -> its Record.
Runner = Callable[[Any, int, "asyncio.Event | None", "list[Record] | None"], Awaitable[Record]]


async def closed_loop(
    run: Runner,
    prompts: Sequence[Any],
    max_new: Callable[[random.Random], int],
    measure_s: float,
    settle_s: float = 5.0,
    warmup_limit_s: float = 300.0,
) -> dict[str, float]:
    """Each client sends its next request when the previous one finished. Client i starts once
    client i-1 is decoding (two tokens in): starts two decode steps apart spread the arrivals
    over about one request's duration, as independent users would. Measured: `measure_s`
    seconds, from `settle_s` after every client is decoding."""
    records: list[Record] = []
    decoding = [asyncio.Event() for _ in prompts]
    stop_at = [math.inf]

    async def client(i: int) -> None:
        rng = random.Random(i)
        if i:
            await decoding[i - 1].wait()
        await run(prompts[i], max_new(rng), decoding[i], records)
        while time.perf_counter() < stop_at[0]:
            await run(prompts[i], max_new(rng), None, records)

    tasks = [asyncio.create_task(client(i)) for i in range(len(prompts))]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in decoding)), warmup_limit_s)
    except TimeoutError:
        print(f"warning: not every client was decoding after {warmup_limit_s:.0f}s; measuring anyway", flush=True)
    await asyncio.sleep(settle_s)
    lo = time.perf_counter()
    hi = stop_at[0] = lo + measure_s
    await asyncio.sleep(measure_s)
    for task in tasks:
        task.cancel()  # in-flight calls are cancelled: the service frees their rows
    await asyncio.gather(*tasks, return_exceptions=True)
    tokens = sum(n for r in records for t, n in r.arrivals if lo <= t < hi)
    ttfts = [r.first - r.sent for r in records if r.sent >= lo and r.first is not None and r.first < hi]
    gaps = [b[0] - a[0] for r in records for a, b in zip(r.arrivals, r.arrivals[1:], strict=False) if lo <= a[0] < hi]
    return {
        "tok_s": tokens / (hi - lo),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_samples": len(ttfts),
        "step_s": statistics.median(gaps) if gaps else math.nan,
        "requests": len([r for r in records if r.done is not None and lo <= r.done < hi]),
    }


async def mesh_fixed(target: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Idle time to first token, then the closed loop with 64 new tokens per request."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
        await one(stub, prompts[0], 8)  # connection and first-call warm-up
        idle = [(await one(stub, prompts[i], 1)) for i in range(5)]
        ttft_idle = statistics.median(r.first - r.sent for r in idle if r.first is not None)
        fixed = await closed_loop(functools.partial(one, stub), prompts, lambda rng: NEW_TOKENS, args.measure)
    return {
        "model": f"{info.model_id} {info.version} ({info.device}, {info.dtype})",
        "max_batch_size": info.max_batch_size,
        "mesh_tok_s": fixed["tok_s"],
        "ttft_idle_s": ttft_idle,
        "ttft_p50_s": fixed["ttft_p50_s"],
        "ttft_p95_s": fixed["ttft_p95_s"],
        "decode_step_s": fixed["step_s"],
        "closed_loop_requests": fixed["requests"],
        "ttft_samples": fixed["ttft_samples"],
    }


async def mesh_sequential(target: str, prompts: list[list[int]], requests: int = 4) -> float:
    """One client, NEW_TOKENS new tokens per request, one request after another: tokens/s."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await one(stub, prompts[0], 8)
        started = time.perf_counter()
        produced = 0
        for ids in prompts[:requests]:
            record = await one(stub, ids, NEW_TOKENS)
            produced += sum(n for _, n in record.arrivals)
    return produced / (time.perf_counter() - started)


async def mesh_mixed(target: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """The closed loop with max_new_tokens drawn from 8..128 per request."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        mixed = await closed_loop(functools.partial(one, stub), prompts, lambda rng: rng.randint(8, 128), args.measure)
    return {"mixed_tok_s": mixed["tok_s"], "mixed_ttft_p95_s": mixed["ttft_p95_s"]}


async def mesh_short(target: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """16 closed-loop clients, the gateway's chat prompt, SHORT_NEW_TOKENS new tokens."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        records: list[Record] = []

        async def run(ids: list[int], max_new: int, decoding: Any, into: Any) -> Record:
            record = await one(stub, ids, max_new, decoding, into)
            records.append(record)
            return record

        short = await closed_loop(run, prompts, lambda rng: SHORT_NEW_TOKENS, args.measure)
    done = [r for r in records if r.done is not None and r.first is not None]
    tail = done[len(done) // 3 :]  # past the staggered start
    return {
        "short_rps": short["requests"] / args.measure,
        "short_ttft_p50_s": short["ttft_p50_s"],
        "short_latency_p50_s": percentile([r.done - r.sent for r in tail if r.done is not None], 0.5),
    }


async def served_dtype(target: str) -> str:
    """The service's dtype without its quantization suffix ("bfloat16+int8" -> "bfloat16"):
    plain transformers runs the baselines in it."""
    async with grpc.aio.insecure_channel(target) as channel:
        info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(inference_pb2.GetModelInfoRequest())
    return info.dtype


def baseline_runs(runs: list[Baselines]) -> dict[str, float]:
    """sequential and offline batch in each dtype: the served dtype's under the plain keys,
    float32's under the _fp32 keys (measured once when the service runs float32)."""
    out: dict[str, float] = {}
    for baselines in runs:
        values = {"sequential_tok_s": baselines.sequential(), "offline_batch_tok_s": baselines.offline_batch()}
        if baselines.dtype == "float32":
            out.update({k.replace("_tok_s", "_fp32_tok_s"): v for k, v in values.items()})
        if baselines is runs[0]:
            out.update(values)
    return out


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=float, default=40.0, help="measured seconds of each closed loop")
    parser.add_argument("--no-hf-cb", action="store_true", help="skip transformers' continuous batching column")
    parser.add_argument(
        "--only-short",
        action="store_true",
        help="only short_rps against offline_short_rps (a few minutes; writes bench/results/batching_short.json)",
    )
    args = parser.parse_args(argv)
    if args.only_short:
        only_short(args)
        return

    begun = time.perf_counter()
    models = real_models_dir()
    model_dir = models / "smollm2" / "current"
    prompts = build_prompts(model_dir)
    from services.gateway.core import DEFAULT_SYSTEM_PROMPT

    short_prompts = build_prompts(model_dir, DEFAULT_SYSTEM_PROMPT, SHORT_CLIENTS)
    load_before = machine()
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"{NEW_TOKENS} new tokens each",
        flush=True,
    )

    result: dict[str, Any] = {"prompts": len(prompts), "new_tokens": NEW_TOKENS}
    env = {"LLMESH_MODELS_DIR": str(models), "LLMESH_INFERENCE_MODEL": "smollm2", "LLMESH_MAX_BATCH_SIZE": str(CLIENTS)}
    # The service idles (no CPU) while the baselines run. The baselines run right before and
    # right after the service's closed loop and are averaged: on a shared machine the load drifts.
    loads: dict[str, float] = {}
    with Mesh(services=("inference",), env=env) as mesh:
        target = mesh.target("inference")
        result["dtype"] = asyncio.run(served_dtype(target))
        base_dtype = result["dtype"].partition("+")[0]
        baselines = Baselines(model_dir, prompts, base_dtype)
        runs = [baselines] if base_dtype == "float32" else [baselines, Baselines(model_dir, prompts, "float32")]
        before = {**baseline_runs(runs), "offline_short_rps": baselines.offline_short(short_prompts)}
        loads["baselines_before"] = _load()
        print_table(before, "transformers baselines (before)")
        result.update(asyncio.run(mesh_fixed(target, prompts, args)))
        loads["mesh"] = _load()
        after = {**baseline_runs(runs), "offline_short_rps": baselines.offline_short(short_prompts)}
        loads["baselines_after"] = _load()
        print_table(after, "transformers baselines (after)")
        result.update(asyncio.run(mesh_mixed(target, prompts, args)))
        loads["mixed"] = _load()
        result.update(asyncio.run(mesh_short(target, short_prompts, args)))
        loads["short"] = _load()
        result["sequential_mesh_tok_s"] = asyncio.run(mesh_sequential(target, prompts))
    with Mesh(services=("inference",), env={**env, "LLMESH_PREFIX_CACHING": "0"}) as mesh:
        result["mesh_tok_s_no_prefix"] = asyncio.run(mesh_fixed(mesh.target("inference"), prompts, args))["mesh_tok_s"]
        loads["mesh_no_prefix"] = _load()
    for key in before:
        result[key] = (before[key] + after[key]) / 2
        result[f"{key}_runs"] = [round(before[key], 2), round(after[key], 2)]
    if not args.no_hf_cb:
        result["hf_continuous_batching_tok_s"] = baselines.continuous_batching()
    del baselines, runs
    gc.collect()

    result["mesh_vs_offline"] = result["mesh_tok_s"] / result["offline_batch_tok_s"]
    result["mesh_vs_sequential"] = result["mesh_tok_s"] / result["sequential_tok_s"]
    ttft_bound = 3 * result["ttft_idle_s"] + result["decode_step_s"]
    result["ttft_p95_bound_s"] = ttft_bound
    result["passes"] = {
        "mesh_ge_0.95x_no_prefix": result["mesh_tok_s"] >= 0.95 * result["mesh_tok_s_no_prefix"],
        "mesh_ge_0.8x_offline_batch": result["mesh_tok_s"] >= 0.8 * result["offline_batch_tok_s"],
        "mesh_ge_6x_sequential": result["mesh_tok_s"] >= 6 * result["sequential_tok_s"],
        "mesh_ge_1.6x_offline_batch_fp32": result["mesh_tok_s"] >= 1.6 * result["offline_batch_fp32_tok_s"],
        "sequential_ge_1.6x_sequential_fp32": result["sequential_tok_s"] >= 1.6 * result["sequential_fp32_tok_s"],
        "ttft_p95_le_3x_idle_plus_step": result["ttft_p95_s"] <= ttft_bound,
        "short_rps_ge_0.7x_offline_short": result["short_rps"] >= 0.7 * result["offline_short_rps"],
    }
    # 1-minute load averages after each phase: this process and the service add about 2-3.
    result["machine"] = {**load_before, "load_average_1m_after_phase": loads}
    result["bench_seconds"] = time.perf_counter() - begun
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "batching benchmark")
    print_table(result["passes"], "targets")
    path = write_result(
        "batching", {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
    )
    print(f"\nwrote {path}")


def only_short(args: argparse.Namespace) -> None:
    """short_rps and its ceiling alone, side by side (the ceiling before and after, averaged)."""
    from services.gateway.core import DEFAULT_SYSTEM_PROMPT

    models = real_models_dir()
    model_dir = models / "smollm2" / "current"
    short_prompts = build_prompts(model_dir, DEFAULT_SYSTEM_PROMPT, SHORT_CLIENTS)
    result: dict[str, Any] = {"machine": machine()}
    env = {"LLMESH_MODELS_DIR": str(models), "LLMESH_INFERENCE_MODEL": "smollm2", "LLMESH_MAX_BATCH_SIZE": str(CLIENTS)}
    with Mesh(services=("inference",), env=env) as mesh:
        result["dtype"] = asyncio.run(served_dtype(mesh.target("inference")))
        baselines = Baselines(model_dir, short_prompts, result["dtype"].partition("+")[0])
        runs = [baselines.offline_short(short_prompts)]
        result.update(asyncio.run(mesh_short(mesh.target("inference"), short_prompts, args)))
        result["load_average_1m_after_mesh"] = _load()
        runs.append(baselines.offline_short(short_prompts))
    result["offline_short_rps"] = sum(runs) / len(runs)
    result["offline_short_rps_runs"] = [round(r, 2) for r in runs]
    result["short_vs_offline"] = result["short_rps"] / result["offline_short_rps"]
    result["passes"] = {"short_rps_ge_0.7x_offline_short": result["short_vs_offline"] >= 0.7}
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "short requests")
    print(f"\nwrote {write_result('batching_short', result)}")


if __name__ == "__main__":
    main()
