#!/usr/bin/env python3
"""CUDA smoke test of the inference engine (services/inference/engine/), no gRPC.

Builds a random-weight Llama on SmolLM2's real tokenizer (scripts/cuda_smoke_assets/), prepares
it like a real model (safetensors + manifest), loads it through ModelManager/Engine.boot exactly
as the inference service does (LLMESH_DEVICE=cuda: bfloat16), and checks:

* 32 concurrent greedy requests (different prompt lengths and max_new_tokens; most at once,
  the rest joining a running batch) all finish with the expected token count (or an EOS stop);
* every generated token is, step by step, the argmax of a clean single-sequence forward of
  prompt + tokens so far (teacher forcing), up to numerical noise: a token that differs must be
  a near tie, i.e. its float32 logit gap to the reference argmax is within 3x the largest
  |engine dtype - float32| logit difference at that position (a KV-cache surgery bug gives gaps
  far above that);
* batch invariance: probe prompts run alone give the same greedy tokens when batched with the
  others (exact, or diverging at a near tie as above: bfloat16 kernels differ by batch shape,
  and the code documents no tolerance);
* on CUDA, the same probes on a float32 engine (TF32 off) must agree alone vs batched;
* OOM halving: (a) a real torch.OutOfMemoryError from the CUDA allocator (an impossible
  allocation inside a decoder layer, once in a prefill and once in a decode step) must be
  answered by halving with nothing lost; (b) a natural OOM: the process's CUDA memory is capped
  (torch.cuda.set_per_process_memory_fraction, process-local) below what one prefill group of
  16 prompts needs, and the engine must halve the group until it fits;
* throughput (generated tokens/s), peak CUDA memory, device, versions.

Writes DIR/cuda_smoke.json and prints a table; exit status 0 when every check passed, 1 when
one failed, 2 when the run could not get that far (import error, crash: see "fatal").

    python3 scripts/cuda_smoke.py --out DIR                       # CUDA, bfloat16
    python scripts/cuda_smoke.py --out DIR --device cpu --dtype float32   # local run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
ASSETS = Path(__file__).resolve().parent / "cuda_smoke_assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEXT = (
    "The harbour was quiet in the early morning, and the fishing boats rocked gently against "
    "the pier while gulls circled overhead. Maria checked the nets one more time, counting the "
    "knots her grandfather had taught her to tie. Continuous batching lets a server admit new "
    "requests between decode steps instead of waiting for the whole batch to finish; the KV "
    "cache of each sequence is kept, padded on the left, and rows leave as soon as they are done. "
    "Größe, café, naïve, 東京, 🌍 and ∑ x² are here so that byte-level BPE splits characters. "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "In 1969 the first message on ARPANET was 'lo' because the system crashed after two letters. "
)


# --------------------------------------------------------------------------- results


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {"checks": [], "logged_warnings": []}
        self.started = time.perf_counter()

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        mark = "PASS" if ok else "FAIL"
        print(f"[{mark}] {name}: {_short(detail)}", flush=True)
        return bool(ok)

    def skip(self, name: str, why: str) -> None:
        self.data["checks"].append({"name": name, "ok": None, "detail": f"skipped: {why}"})
        print(f"[SKIP] {name}: {why}", flush=True)

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.data["checks"] if c["ok"] is False]

    def write(self) -> Path:
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "cuda_smoke.json"
        path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        return path


def _short(detail: Any, limit: int = 160) -> str:
    text = detail if isinstance(detail, str) else json.dumps(detail, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class WarningLog(logging.Handler):
    """Keeps WARNING+ records (transformers deprecations, engine 'inference step failed')."""

    def __init__(self, sink: list[dict[str, str]]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.sink) < 200:
            entry = {"logger": record.name, "level": record.levelname, "msg": record.getMessage()[:500]}
            if record.exc_info:
                entry["exc"] = "".join(traceback.format_exception(*record.exc_info))[-3000:]
            self.sink.append(entry)


def versions() -> dict[str, str]:
    found = {}
    for dist in (
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "numpy",
        "grpcio",
        "protobuf",
        "googleapis-common-protos",
        "prometheus-client",
        "opentelemetry-api",
        "opentelemetry-sdk",
        "opentelemetry-semantic-conventions",
        "huggingface-hub",
    ):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "missing"
    return found


# --------------------------------------------------------------------------- model


def build_model(models_dir: Path, args: argparse.Namespace, device: str) -> Path:
    """A random-weight Llama on the real SmolLM2 tokenizer, prepared like llmesh.testing.build_tiny_model
    (float32 safetensors without the tied lm_head, config, tokenizer files, manifest, `current`)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmesh import models

    root = models_dir / "smoke"
    target = root / "v1"
    target.mkdir(parents=True)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=args.init_range,
    )
    torch.manual_seed(args.seed)
    with torch.device(device):  # random init on the GPU is much faster than on the CPU
        model = LlamaForCausalLM(config).eval()
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(target)
    for name in TOKENIZER_FILES:
        shutil.copy2(ASSETS / name, target / name)
    models.write_manifest(target, f"smoke-random-llama-{args.seed}", {"generator": "scripts/cuda_smoke.py"})
    models.point_current(root, "v1")
    del model, state
    gc.collect()
    return target


def count_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        for key in fh.keys():
            total += math.prod(fh.get_slice(key).get_shape())
    return total


class Reference:
    """Clean single-sequence forwards (no padding, no batch, no KV surgery) of the same weights:
    float32 ("hi") and, when the engine runs in a lower precision, that precision ("lo")."""

    def __init__(self, path: Path, device: Any, engine_dtype: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        def load(dtype: Any) -> Any:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, use_safetensors=True, local_files_only=True, trust_remote_code=False
            )
            return model.to(device).eval()

        self.device = device
        self.hi = load(torch.float32)
        self.lo = None if engine_dtype == torch.float32 else load(engine_dtype)

    def logits(self, model: Any, ids: list[int], keep: int) -> Any:
        import torch

        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            out = model(input_ids=x, use_cache=False, logits_to_keep=keep)
            return out.logits[0, -keep:].float()

    def analyze(self, prompt: list[int], tokens: list[int]) -> dict[str, Any]:
        """Teacher-forced check of every generated token (see the module docstring)."""
        import torch

        if not tokens:
            return {"steps": 0, "exact": 0, "near_tie": 0, "mismatch": []}
        ids = prompt + tokens[:-1]
        keep = len(tokens)
        hi = self.logits(self.hi, ids, keep)
        if self.lo is not None:
            noise = (self.logits(self.lo, ids, keep) - hi).abs().amax(dim=-1)
        else:
            noise = torch.zeros(keep, device=hi.device)
        scale = hi.abs().amax(dim=-1)
        tol = 3.0 * noise + 1e-4 * scale + 1e-5
        got = torch.tensor(tokens, device=hi.device)
        best = hi.argmax(dim=-1)
        gap = hi.gather(1, best[:, None])[:, 0] - hi.gather(1, got[:, None])[:, 0]
        exact = int((best == got).sum())
        near = ((best != got) & (gap <= tol)).nonzero().flatten().tolist()
        bad = ((best != got) & (gap > tol)).nonzero().flatten().tolist()
        result = {
            "steps": keep,
            "exact": exact,
            "near_tie": len(near),
            "mismatch": [
                {"pos": p, "engine": tokens[p], "reference": int(best[p]), "gap": float(gap[p]), "tol": float(tol[p])}
                for p in bad[:5]
            ],
            "max_noise": float(noise.max()),
            "max_near_tie_gap": float(gap[near].max()) if near else 0.0,
        }
        return result

    def divergence(self, prompt: list[int], a: list[int], b: list[int]) -> dict[str, Any]:
        """Where two greedy outputs of one prompt first differ, and whether that is a near tie."""
        n = min(len(a), len(b))
        j = next((i for i in range(n) if a[i] != b[i]), None)
        if j is None:
            same = len(a) == len(b)
            return {"equal": same, "diverge_at": None if same else n, "near_tie": same}
        ids = prompt + a[:j]
        hi = self.logits(self.hi, ids, 1)[0]
        noise = float((self.logits(self.lo, ids, 1)[0] - hi).abs().max()) if self.lo is not None else 0.0
        tol = 3.0 * noise + 1e-4 * float(hi.abs().max()) + 1e-5
        gap = abs(float(hi[a[j]] - hi[b[j]]))
        return {"equal": False, "diverge_at": j, "of": n, "gap": gap, "tol": tol, "near_tie": gap <= tol}


# --------------------------------------------------------------------------- requests


async def run_request(manager: Any, ids: list[int], params: Any, request_id: str) -> dict[str, Any]:
    """Submits and streams one request the way the servicer's Generate does."""
    started = time.perf_counter()
    tokens: list[int] = []
    text = ""
    last = None
    first = None
    try:
        stream = manager.submit(ids, params, request_id)
        try:
            async for event in stream:
                if first is None:
                    first = time.perf_counter() - started
                tokens += event.token_ids
                text += event.text
                last = event
        finally:
            stream.cancel()
    except Exception as exc:
        cause = exc.__cause__
        return {
            "id": request_id,
            "error": f"{type(exc).__name__}: {exc}",
            "cause": f"{type(cause).__name__}: {cause}" if cause is not None else None,
            "tokens": tokens,
        }
    return {
        "id": request_id,
        "tokens": tokens,
        "text": text,
        "finish": last.finish_reason if last else None,
        "input_tokens": last.input_tokens if last else 0,
        "output_tokens": last.output_tokens if last else 0,
        "batch_id": last.batch_id if last else "",
        "ttft_s": first,
        "duration_s": time.perf_counter() - started,
    }


def judge(result: dict[str, Any], prompt: list[int], params: Any, decode: Any) -> str | None:
    """None if the request finished as expected, else why not."""
    if "error" in result:
        return f"{result['error']} (cause: {result['cause']})"
    n = len(result["tokens"])
    if result["input_tokens"] != len(prompt):
        return f"usage.input_tokens {result['input_tokens']} != prompt {len(prompt)}"
    if result["finish"] == "length":
        if n != params.max_new_tokens or result["output_tokens"] != n:
            return f"length finish with {n} tokens (usage {result['output_tokens']}), expected {params.max_new_tokens}"
    elif result["finish"] == "stop" and not params.ignore_eos:
        if result["output_tokens"] != n + 1 or n + 1 > params.max_new_tokens:
            return f"stop finish with {n} streamed tokens, usage {result['output_tokens']}"
    else:
        return f"unexpected finish {result['finish']!r}"
    if result["text"] != decode(result["tokens"]):
        return "streamed text differs from decode(token_ids)"
    return None


def eos_completed(result: dict[str, Any], eos: int) -> list[int]:
    """The tokens the engine generated (an EOS stop is not streamed as a token)."""
    return result["tokens"] + ([eos] if result.get("finish") == "stop" else [])


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


@contextlib.contextmanager
def forced_dtype(device: str, dtype: Any) -> Any:
    """Makes LoadedModel pick (device, dtype) when that is not what the service would pick."""
    from services.inference.engine import model as engine_mod

    original = engine_mod.pick_device
    if original(device) == (engine_mod.torch.device(device), dtype):
        yield False
        return
    engine_mod.pick_device = lambda preference, *_: (engine_mod.torch.device(device), dtype)
    try:
        yield True
    finally:
        engine_mod.pick_device = original


async def load_manager(models_dir: Path, device: str, dtype: Any, env_extra: dict[str, str] | None = None) -> Any:
    """ModelManager + load_initial, as InferenceApp.start does (settings from LLMESH_* values)."""
    from llmesh.settings import load
    from services.inference.engine import EngineConfig
    from services.inference.lifecycle import ModelManager

    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_INFERENCE_MODEL": "smoke",
        "LLMESH_DEVICE": device,
        **(env_extra or {}),
    }
    settings = load("inference", env)
    manager = ModelManager(settings.models_path, settings.inference_model, EngineConfig.from_settings(settings), device)
    with forced_dtype(device, dtype):
        await asyncio.to_thread(manager.load_initial)
    return manager


def make_prompts(encode: Any, lengths: list[int]) -> list[list[int]]:
    base = encode(TEXT)
    corpus: list[int] = []
    while len(corpus) < max(lengths) + 64 * len(lengths):
        corpus += base
    # Different offsets: no two prompts share a prefix.
    return [corpus[(37 * i) % len(base) : (37 * i) % len(base) + n] for i, n in enumerate(lengths)]


def first_wave(n: int) -> int:
    """Requests of the batch phase submitted at once; the others join the running batch one by one."""
    return max(1, int(n * 0.6))


def geometric(lo: int, hi: int, n: int) -> list[int]:
    return [max(1, round(lo * (hi / lo) ** (i / max(1, n - 1)))) for i in range(n)]


# --------------------------------------------------------------------------- phases


async def phase_batch(
    rep: Report,
    manager: Any,
    ref: Reference,
    prompts: list[list[int]],
    params: list[Any],
    probes: list[int],
    args: argparse.Namespace,
    cuda: bool,
) -> None:
    import torch

    engine = manager.engine
    eos = min(engine.model.eos_ids)

    # Probes alone, one at a time.
    alone = {}
    for i in probes:
        alone[i] = await asyncio.wait_for(run_request(manager, prompts[i], params[i], f"alone-{i}"), args.phase_timeout)

    # The batch: most at once, the rest joining the running batch every couple of decode steps.
    at_once = first_wave(len(prompts))
    watch = {"max_running": 0, "samples": 0}

    async def watcher() -> None:
        while True:
            watch["max_running"] = max(watch["max_running"], engine.running_count)
            watch["samples"] += 1
            await asyncio.sleep(0.001)

    async def joiners(tasks: list[asyncio.Task[dict[str, Any]]]) -> None:
        for i in range(at_once, len(prompts)):
            mark = engine.steps
            deadline = time.monotonic() + 2.0
            while engine.steps < mark + 2 and time.monotonic() < deadline:  # noqa: ASYNC110 - polls the worker
                await asyncio.sleep(0.0005)
            tasks.append(asyncio.create_task(run_request(manager, prompts[i], params[i], f"req-{i}")))

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps0 = engine.steps
    gen0 = metric("llmesh_inference_generation_tokens_total")
    w = asyncio.create_task(watcher())
    started = time.perf_counter()
    tasks = [asyncio.create_task(run_request(manager, prompts[i], params[i], f"req-{i}")) for i in range(at_once)]
    await asyncio.wait_for(joiners(tasks), args.phase_timeout)
    results = await asyncio.wait_for(asyncio.gather(*tasks), args.phase_timeout)
    wall = time.perf_counter() - started
    w.cancel()
    if cuda:
        torch.cuda.synchronize()
    steps = engine.steps - steps0
    generated = sum(r.get("output_tokens", 0) for r in results)

    problems = {
        r["id"]: why for i, r in enumerate(results) if (why := judge(r, prompts[i], params[i], engine.model.decode))
    }
    finishes: dict[str, int] = {}
    for r in results:
        finishes[str(r.get("finish"))] = finishes.get(str(r.get("finish")), 0) + 1
    rep.check(
        f"batch: {len(prompts)} concurrent requests finish with the expected token counts",
        not problems,
        {"finish_reasons": finishes, "problems": problems} if problems else {"finish_reasons": finishes},
    )
    batch_ids = {r.get("batch_id") for r in results if "error" not in r}
    rep.check(
        "batch: requests really shared a running batch (several prefill groups, rows joined mid-batch)",
        watch["max_running"] > 1 and len(batch_ids) > 1,
        {"max_running_rows": watch["max_running"], "distinct_batch_ids": len(batch_ids)},
    )
    rep.check(
        "metrics: llmesh_inference_generation_tokens_total counted every streamed token",
        metric("llmesh_inference_generation_tokens_total") - gen0 == generated,
        {"delta": metric("llmesh_inference_generation_tokens_total") - gen0, "usage_sum": generated},
    )

    # Teacher-forced check of every request.
    per_request = {}
    total_steps = total_exact = total_near = 0
    bad = {}
    max_noise = max_gap = 0.0
    for i, r in enumerate(results):
        if "error" in r:
            continue
        a = ref.analyze(prompts[i], eos_completed(r, eos))
        per_request[r["id"]] = {k: a[k] for k in ("steps", "exact", "near_tie")}
        total_steps += a["steps"]
        total_exact += a["exact"]
        total_near += a["near_tie"]
        max_noise = max(max_noise, a.get("max_noise", 0.0))
        max_gap = max(max_gap, a.get("max_near_tie_gap", 0.0))
        if a["mismatch"]:
            bad[r["id"]] = a["mismatch"]
    near_rate = total_near / max(1, total_steps)
    rep.check(
        "consistency: every batched token is the clean single-sequence argmax (or a near tie)",
        not bad and total_steps > 0,
        {
            "steps": total_steps,
            "exact": total_exact,
            "near_tie": total_near,
            "max_lowp_noise": max_noise,
            "max_near_tie_gap": max_gap,
            **({"mismatches": bad} if bad else {}),
        },
    )
    rep.check(
        "consistency: near ties are rare (< 50% of steps; a systematic error would make them common)",
        near_rate < 0.5,
        {"near_tie_rate": round(near_rate, 4)},
    )

    # Batch invariance of the probes.
    inv = {}
    for i in probes:
        a, b = alone[i], results[i]
        if "error" in a or "error" in b:
            inv[f"req-{i}"] = {"error": a.get("error") or b.get("error")}
            continue
        inv[f"req-{i}"] = ref.divergence(prompts[i], a["tokens"], b["tokens"])
    exact = sum(1 for v in inv.values() if v.get("equal"))
    ok = all(v.get("near_tie") for v in inv.values())
    rep.check(
        f"batch invariance ({engine.description.dtype}): probes alone == batched (exact or diverging at a near tie)",
        ok,
        {"exact": f"{exact}/{len(inv)}", "probes": inv},
    )

    ttfts = sorted(r["ttft_s"] for r in results if r.get("ttft_s") is not None)
    rep.data["throughput"] = {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1) if wall else None,
        "decode_steps": steps,
        "mean_rows_per_step": round(generated / max(1, steps), 2),
        "ttft_s": {
            "min": round(ttfts[0], 4),
            "median": round(statistics.median(ttfts), 4),
            "max": round(ttfts[-1], 4),
        }
        if ttfts
        else None,
    }
    if cuda:
        rep.data.setdefault("memory", {})["batch_phase_peak_allocated_mib"] = round(
            torch.cuda.max_memory_allocated() / 2**20, 1
        )
    rep.data["requests"] = [
        {
            "id": r["id"],
            "prompt_tokens": len(prompts[i]),
            "max_new_tokens": params[i].max_new_tokens,
            "ignore_eos": params[i].ignore_eos,
            "finish": r.get("finish"),
            "output_tokens": r.get("output_tokens"),
            "batch_id": r.get("batch_id"),
            "error": r.get("error"),
            **per_request.get(r["id"], {}),
        }
        for i, r in enumerate(results)
    ]


async def phase_injected_oom(
    rep: Report, manager: Any, ref: Reference, prompts: list[list[int]], args: argparse.Namespace, cuda: bool
) -> None:
    """(a) One OOM in a prefill of >= 2 rows and one in a decode step of >= 2 rows, raised inside
    decoder layer 1 (after layer 0 appended its KV column). On CUDA the error is the allocator's
    own: an allocation of twice the device memory."""
    import torch

    from services.inference.engine.decoding import SamplingParams

    engine = manager.engine
    eos = min(engine.model.eos_ids)
    params = SamplingParams(max_new_tokens=args.oom_new_tokens, ignore_eos=True)
    baseline = await asyncio.wait_for(
        asyncio.gather(*(run_request(manager, p, params, f"oom-base-{i}") for i, p in enumerate(prompts))),
        args.phase_timeout,
    )
    pending = {"prefill": 1, "decode": 1}
    raised: list[str] = []
    start_steps = engine.steps
    huge = 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else 0

    def fail_once(module: Any, hook_args: tuple[Any, ...], hook_kwargs: dict[str, Any]) -> None:
        hidden = hook_args[0] if hook_args else hook_kwargs["hidden_states"]
        kind = "decode" if hidden.shape[1] == 1 else "prefill"
        if hidden.shape[0] < 2 or pending[kind] <= 0 or (kind == "decode" and engine.steps < start_steps + 5):
            return
        pending[kind] -= 1
        if cuda:
            try:
                torch.empty(huge, dtype=torch.uint8, device=hidden.device)
            except torch.OutOfMemoryError as exc:
                raised.append(f"{kind}: {type(exc).__module__}.{type(exc).__qualname__}: {str(exc)[:120]}")
                raise
            raise RuntimeError("an allocation of twice the device memory succeeded")
        raised.append(f"{kind}: simulated torch.OutOfMemoryError (CPU run)")
        raise torch.OutOfMemoryError("injected (cpu): out of memory")

    layer = engine.model.model.model.layers[1 if len(engine.model.model.model.layers) > 1 else 0]
    handle = layer.register_forward_pre_hook(fail_once, with_kwargs=True)
    before = metric("llmesh_inference_oom_retries_total")
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(run_request(manager, p, params, f"oom-{i}") for i, p in enumerate(prompts))),
            args.phase_timeout,
        )
    finally:
        handle.remove()
    retries = metric("llmesh_inference_oom_retries_total") - before
    problems = {
        r["id"]: why for i, r in enumerate(results) if (why := judge(r, prompts[i], params, engine.model.decode))
    }
    consistency = {}
    for i, r in enumerate(results):
        if "error" not in r:
            a = ref.analyze(prompts[i], eos_completed(r, eos))
            if a["mismatch"]:
                consistency[r["id"]] = a["mismatch"]
    same = sum(1 for a, b in zip(baseline, results, strict=True) if a.get("tokens") == b.get("tokens"))
    is_cuda_oom = all("torch.OutOfMemoryError" in x or "OutOfMemoryError" in x for x in raised)
    rep.check(
        "oom (a): OOM inside a decoder layer (CUDA: the allocator's own) in prefill + decode is halved, nothing lost",
        pending == {"prefill": 0, "decode": 0} and retries == 2 and not problems and not consistency and is_cuda_oom,
        {
            "raised": raised,
            "oom_retries_delta": retries,
            "not_fired": {k: v for k, v in pending.items() if v},
            "same_tokens_as_without_oom": f"{same}/{len(prompts)}",
            **({"problems": problems} if problems else {}),
            **({"mismatches": consistency} if consistency else {}),
        },
    )


async def phase_natural_oom(
    rep: Report, manager: Any, ref: Reference, prompts: list[list[int]], args: argparse.Namespace
) -> None:
    """(b) Caps this process's CUDA memory below one prefill group's need; the engine must split
    the group until it fits. max_new_tokens=1: rows leave at their prefill, so only prefill
    memory matters and no OOM can land outside the guarded forward."""
    import torch

    from services.inference.engine.decoding import SamplingParams

    engine = manager.engine
    # An explicit index: set_per_process_memory_fraction refuses a bare torch.device("cuda").
    device = engine.model.device.index if engine.model.device.index is not None else torch.cuda.current_device()
    eos = min(engine.model.eos_ids)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def run_all(tag: str) -> Any:
        return asyncio.wait_for(
            asyncio.gather(*(run_request(manager, p, params, f"{tag}-{i}") for i, p in enumerate(prompts))),
            args.phase_timeout,
        )

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    calib = await run_all("oomcal")
    torch.cuda.synchronize()
    need = torch.cuda.max_memory_allocated(device) - base
    groups = len({r.get("batch_id") for r in calib})
    detail: dict[str, Any] = {"group_need_mib": round(need / 2**20, 1), "calibration_prefill_groups": groups}
    if need < 32 * 2**20:
        rep.skip("oom (b): natural OOM under a per-process memory cap", f"one prefill group needs only {detail}")
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    cap = reserved + int(0.4 * need)
    detail.update({"reserved_before_mib": round(reserved / 2**20, 1), "cap_mib": round(cap / 2**20, 1)})
    before = metric("llmesh_inference_oom_retries_total")
    try:
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        results = await run_all("oomcap")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    retries = metric("llmesh_inference_oom_retries_total") - before
    problems = {
        r["id"]: why for i, r in enumerate(results) if (why := judge(r, prompts[i], params, engine.model.decode))
    }
    consistency = {}
    for i, r in enumerate(results):
        if "error" not in r:
            a = ref.analyze(prompts[i], eos_completed(r, eos))
            if a["mismatch"]:
                consistency[r["id"]] = a["mismatch"]
    same = sum(1 for a, b in zip(calib, results, strict=True) if a.get("tokens") == b.get("tokens"))
    detail.update(
        {
            "oom_retries_delta": retries,
            "capped_prefill_groups": len({r.get("batch_id") for r in results}),
            "same_first_token": f"{same}/{len(prompts)}",
        }
    )
    if problems:
        detail["problems"] = problems
    if consistency:
        detail["mismatches"] = consistency
    rep.check(
        "oom (b): natural CUDA OOM under a per-process memory cap splits the prefill group, nothing lost",
        retries >= 1 and not problems and not consistency,
        detail,
    )


async def phase_fp32(
    rep: Report, models_dir: Path, path: Path, prompts: list[list[int]], params: list[Any], args: argparse.Namespace
) -> None:
    """A float32 engine on CUDA (TF32 off): batched probes must match their alone runs."""
    import torch

    manager = await load_manager(models_dir, "cuda", torch.float32)
    try:
        ref = Reference(path, manager.engine.model.device, torch.float32)
        alone = [
            await asyncio.wait_for(run_request(manager, p, q, f"fp32-alone-{i}"), args.phase_timeout)
            for i, (p, q) in enumerate(zip(prompts, params, strict=True))
        ]
        together = await asyncio.wait_for(
            asyncio.gather(
                *(run_request(manager, p, q, f"fp32-{i}") for i, (p, q) in enumerate(zip(prompts, params, strict=True)))
            ),
            args.phase_timeout,
        )
        inv = {}
        for i, (a, b) in enumerate(zip(alone, together, strict=True)):
            if "error" in a or "error" in b:
                inv[f"fp32-{i}"] = {"error": a.get("error") or b.get("error")}
            else:
                inv[f"fp32-{i}"] = ref.divergence(prompts[i], a["tokens"], b["tokens"])
        exact = sum(1 for v in inv.values() if v.get("equal"))
        rep.check(
            "batch invariance (float32 engine on CUDA, TF32 off): alone == batched",
            all(v.get("near_tie") for v in inv.values()),
            {
                "exact": f"{exact}/{len(inv)}",
                "dtype": manager.engine.description.dtype,
                **({"probes": inv} if exact < len(inv) else {}),
            },
        )
        eos = min(manager.engine.model.eos_ids)
        steps = same = 0
        bad = {}
        for i, r in enumerate(together):
            if "error" in r:
                bad[r["id"]] = r["error"]
                continue
            a = ref.analyze(prompts[i], eos_completed(r, eos))
            steps += a["steps"]
            same += a["exact"]
            if a["mismatch"]:
                bad[r["id"]] = a["mismatch"]
        rep.check(
            "consistency (float32 engine on CUDA): batched tokens == clean single-sequence argmax",
            not bad and steps > 0,
            {"steps": steps, "exact": same, **({"mismatches": bad} if bad else {})},
        )
        del ref
    finally:
        await manager.close()
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- main


async def main_async(rep: Report, args: argparse.Namespace) -> None:
    stage = rep.data["stage"] = {}

    def at(name: str) -> None:
        stage["current"] = name
        stage.setdefault("started_at_s", {})[name] = round(time.perf_counter() - rep.started, 2)
        print(f"-- [{time.perf_counter() - rep.started:6.1f}s] {name}", flush=True)

    at("import torch / transformers")
    import torch
    import transformers

    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype)
    env = rep.data["env"] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions(),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        env["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    except Exception as exc:
        env["matmul_allow_tf32"] = f"unreadable: {exc}"
    if cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        props = torch.cuda.get_device_properties(0)
        env.update(
            {
                "device_name": torch.cuda.get_device_name(0),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                "device_memory_gib": round(props.total_memory / 2**30, 1),
                "bf16_supported": torch.cuda.is_bf16_supported(),
            }
        )
    print(f"torch {torch.__version__} transformers {transformers.__version__} device {env.get('device_name', 'cpu')}")

    at("import services.inference (engine, lifecycle) and telemetry")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llmesh import telemetry
    from services.inference import engine as engine_mod
    from services.inference.engine.decoding import SamplingParams

    spans = InMemorySpanExporter()
    provider = telemetry.setup_tracing("inference", exporter=spans)

    at("KV blocks as this transformers' attention uses them (PagedKVCache.update in each layer)")
    from transformers import LlamaConfig

    name = "kv api: a Llama forward writes PagedKVCache blocks and attends over the gathered rows"
    try:
        probe_cfg = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        # 4 blocks of 4 tokens: two rows of 3 tokens in blocks 2 and 1, then one decode token each.
        cache = engine_mod.PagedKVCache(probe_cfg, 4, 4, torch.float32, torch.device("cpu"))
        k = torch.randn(2, 1, 3, 8)
        write = torch.tensor([8, 9, 10, 4, 5, 6])
        gather = torch.tensor([[8, 9, 10], [4, 5, 6]])
        cache.plan(write, gather)
        cache.update(k, k.clone(), 0)
        cache.plan(torch.tensor([11, 7]), torch.tensor([[8, 9, 10, 11], [4, 5, 6, 7]]))
        new = torch.randn(2, 1, 1, 8)
        keys, _ = cache.update(new, new.clone(), 0)
        kv_ok = (
            tuple(keys.shape) == (2, 1, 4, 8)
            and torch.equal(cache.keys[0][8:11, 0], k[0, 0])
            and torch.equal(keys[:, :, 3], new[:, :, 0])
        )
        rep.check(name, kv_ok, {"transformers": transformers.__version__})
    except Exception as exc:
        # Recorded; the engine run below shows what that breaks.
        rep.check(
            name,
            False,
            {
                "transformers": transformers.__version__,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            },
        )

    at("build random-weight model on the real SmolLM2 tokenizer")
    workdir = Path(tempfile.mkdtemp(prefix="llmesh-cuda-smoke-"))
    try:
        models_dir = workdir / "models"
        t0 = time.perf_counter()
        path = build_model(models_dir, args, args.device)
        rep.data["model"] = {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": 49152,
            "params": count_params(path),
            "build_s": round(time.perf_counter() - t0, 2),
        }

        at(f"load through ModelManager.load_initial (device={args.device}, dtype={args.dtype})")
        t0 = time.perf_counter()
        manager = await load_manager(models_dir, args.device, dtype)
        try:
            engine = manager.engine
            desc = engine.description
            rep.data["engine"] = {
                "load_and_warm_up_s": round(time.perf_counter() - t0, 2),
                "device": desc.device,
                "dtype": desc.dtype,
                "max_batch_size": desc.max_batch_size,
                "max_batch_total_tokens": engine.max_total_tokens,
                "max_prefill_tokens": engine.max_prefill_tokens,
                "kv_bytes_per_token": engine.model.kv_bytes_per_token,
                "dtype_forced": desc.dtype != str(engine_mod.pick_device(args.device)[1]).removeprefix("torch."),
            }
            rep.check(
                "engine: loaded and warmed up on the requested device and dtype",
                desc.device.startswith(args.device) and desc.dtype == args.dtype,
                rep.data["engine"],
            )

            at("reference models (clean single-sequence forwards)")
            ref = Reference(path, engine.model.device, dtype)

            at(f"batch: {args.requests} requests")
            n = args.requests
            lengths = geometric(3, args.max_prompt, n)
            order = [(7 * i) % n for i in range(n)]  # interleave short and long prompts
            lengths = [lengths[j] for j in order]
            prompts = make_prompts(engine.encode, lengths)
            new_tokens = [args.max_new, 16, args.max_new // 2, 48, 200, 8, 96, 32]
            params = [
                SamplingParams(
                    max_new_tokens=min(new_tokens[i % len(new_tokens)], args.max_new),
                    ignore_eos=(i % 4 != 3),
                )
                for i in range(n)
            ]
            probes = sorted({0, 1, min(n - 1, first_wave(n) + 1), n - 1})  # two at once, two joining later
            await phase_batch(rep, manager, ref, prompts, params, probes, args, cuda)

            at("spans")
            provider.force_flush()
            names = [s.name for s in spans.get_finished_spans()]
            generate = names.count("inference.generate")
            rep.check(
                "tracing: one inference.generate span per request, batch segments recorded",
                generate >= n + len(probes) and names.count("inference.batch") >= 1,
                {
                    "inference.generate": generate,
                    "inference.batch": names.count("inference.batch"),
                    "expected_generate_at_least": n + len(probes),
                },
            )

            if args.skip_oom:
                rep.skip("oom (a)", "--skip-oom")
                rep.skip("oom (b)", "--skip-oom")
            else:
                at("oom (a): OOM raised inside a decoder layer")
                oom_prompts = make_prompts(engine.encode, [5, 40, 120, 300, 17, 64, 9, 200][: max(2, min(8, n))])
                await phase_injected_oom(rep, manager, ref, oom_prompts, args, cuda)
                if cuda:
                    at("oom (b): natural OOM under a per-process memory cap")
                    width = min(512, args.max_prompt_cap)
                    count = max(2, engine.max_prefill_tokens // width)
                    count = min(count, desc.max_batch_size)
                    nat_prompts = make_prompts(engine.encode, [width] * count)
                    await phase_natural_oom(rep, manager, ref, nat_prompts, args)
                else:
                    rep.skip("oom (b): natural OOM under a per-process memory cap", "CUDA only")
            del ref
        finally:
            await manager.close()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()

        if cuda and dtype != torch.float32 and not args.skip_fp32:
            at("float32 engine on CUDA")
            fp32_prompts = [prompts[i] for i in probes] + make_prompts(engine.encode, [3, 77, 260, 700])
            fp32_params = [params[i] for i in probes] + [SamplingParams(max_new_tokens=64, ignore_eos=True)] * 4
            await phase_fp32(rep, models_dir, path, fp32_prompts, fp32_params, args)
        elif cuda:
            rep.skip("batch invariance (float32 engine on CUDA)", "--skip-fp32 or already float32")

        if cuda:
            rep.data.setdefault("memory", {}).update(
                {
                    "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                    "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1),
                    "note": "peak_allocated covers the phases since the last reset (fp32 engine, if run); "
                    "batch_phase_peak_allocated_mib is the main bfloat16 batch with its engine and reference models",
                }
            )
        stage["current"] = "finished"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            telemetry.shutdown_tracing()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for cuda_smoke.json")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32"),
        help="default: bfloat16 on cuda (what the service picks), float32 on cpu",
    )
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=None, help="longest prompt of the batch (tokens)")
    p.add_argument("--max-new", type=int, default=None, help="largest max_new_tokens of the batch")
    p.add_argument("--oom-new-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init-range",
        type=float,
        default=0.1,
        help="std of the random weights; 0.02 (the Llama default) gives near-uniform attention and a model "
        "that repeats one token, which would hide KV-cache errors",
    )
    p.add_argument("--phase-timeout", type=float, default=120.0)
    p.add_argument("--skip-oom", action="store_true")
    p.add_argument("--skip-fp32", action="store_true")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    defaults = {
        "dtype": "bfloat16" if gpu else "float32",
        "hidden": 512 if gpu else 128,
        "intermediate": 1536 if gpu else 256,
        "layers": 8 if gpu else 2,
        "heads": 8 if gpu else 4,
        "kv_heads": 4 if gpu else 2,
        "max_prompt": 1200 if gpu else 200,
        "max_new": 256 if gpu else 48,
        "oom_new_tokens": 32 if gpu else 16,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.max_prompt_cap = 1536  # LLMESH_MAX_PROMPT_TOKENS default
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rep = Report(args.out)
    rep.data["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    handler = WarningLog(rep.data["logged_warnings"])
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.WARNING)
    status = 0
    try:
        asyncio.run(main_async(rep, args))
    except BaseException as exc:
        rep.data["fatal"] = {
            "stage": rep.data.get("stage", {}).get("current"),
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-6000:],
        }
        print(f"FATAL at stage {rep.data['fatal']['stage']!r}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        worker = [w for w in rep.data["logged_warnings"] if "exc" in w]
        if worker:  # the engine worker's own traceback (e.g. a warm-up step that failed)
            print(f"engine worker error ({worker[0]['msg']}):\n{worker[0]['exc'][-1500:]}", flush=True)
        status = 2
    if not status and rep.failed:
        status = 1
    rep.data["ok"] = status == 0
    path = rep.write()

    print()
    print(f"{'check':<100} result")
    for c in rep.data["checks"]:
        mark = "skip" if c["ok"] is None else ("PASS" if c["ok"] else "FAIL")
        print(f"{c['name'][:99]:<100} {mark}")
    env = rep.data.get("env", {})
    tp = rep.data.get("throughput") or {}
    mem = rep.data.get("memory") or {}
    print()
    print(f"device     : {env.get('device_name', 'cpu')} (capability {env.get('capability', '-')})")
    print(
        f"versions   : torch {env.get('versions', {}).get('torch')} (cuda {env.get('torch_cuda')}), "
        f"transformers {env.get('versions', {}).get('transformers')}, python {env.get('python')}"
    )
    if tp:
        print(
            f"throughput : {tp['generated_tokens']} tokens in {tp['wall_s']} s = {tp['tokens_per_s']} tok/s "
            f"({tp['decode_steps']} decode steps, {tp['mean_rows_per_step']} rows/step)"
        )
    if mem:
        print(
            f"cuda memory: batch-phase peak {mem.get('batch_phase_peak_allocated_mib')} MiB, "
            f"run peak {mem.get('peak_allocated_mib')} MiB allocated"
        )
    if rep.data["logged_warnings"]:
        print(
            f"warnings   : {len(rep.data['logged_warnings'])} logged (see JSON), first: "
            f"{_short(rep.data['logged_warnings'][0]['msg'], 120)}"
        )
    print(
        f"result     : {'OK' if status == 0 else ('FAILED: ' + ', '.join(rep.failed) if status == 1 else 'FATAL')}"
        f" in {rep.data['elapsed_s']} s -> {path}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
