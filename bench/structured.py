"""Structured answers benchmark: what constrained decoding costs on the builtin engine, whether every
answer is valid, and the same load on vLLM's CPU build with its structured output, side by side.

On SmolLM2 through the mesh (tokenizer, inference, gateway; cache and retrieval off), in one run:

* unconstrained_tok_s / json_schema_tok_s   32 concurrent streams of 64 new tokens, free text
                      and under a JSON Schema with two free strings; output tokens / wall time
                      of the wave. Both waves generate 64 tokens per stream: EOS is ignored, and
                      every token that holds a double quote gets a logit_bias of -100 (QUOTE_BIAS,
                      in both waves), the way ignore_eos handles EOS: the JSON wave's answer then
                      does not close its first string early (the grammar still allows the quote;
                      the builtin engine closes the value along its shortest path as the budget
                      runs out, so the answer stays valid JSON; vLLM cuts it at the budget).
                      Without it the JSON answers close after ~27 tokens, and that wave measures
                      the prefill of the requests that follow more than decoding (the 0.58x of
                      an earlier run, vLLM's 0.57x alike).
* natural_*           the same two waves without the bias (EOS still ignored in the free wave):
                      what an unbiased JSON answer costs as it comes (ends early, shorter waves)
* *_mean_tokens       output tokens per answer of every wave, to read the rates by
* *_stream_tok_s      mean decode rate of a stream (tokens after its first over the time after)
* ttft_*_p50_s        time to first token of each wave
* compile_cold_ms / compile_cached_ms   llguidance grammar compile per schema (median over the
                      schemas of bench/schemas.py), cold (fresh library) and from the LRU
* schemas_valid / schemas_total   replies over the schemas of bench/schemas.py, at max_tokens 48
                      and 128 (no bias), that parse and validate (refused: a schema whose shortest
                      answer does not fit the budget, refused up front, never answered)
* vllm_*              the same waves (same bias, same prompts) and schemas straight to vLLM's
                      /v1/completions with `response_format` json_schema (its structured output)

Target (`passes`): json_schema_tok_s >= 0.8 x unconstrained_tok_s; schemas_valid == answered.

Each wave runs ROUNDS times (free and JSON back to back); its figure is its best round, every
round's tok_s kept (`*_tok_s_rounds`, and the paired ratios `*_ratio_rounds`).

Run: `.venv/bin/python -m bench.structured` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import httpx
import jsonschema
from tokenizers import Tokenizer

from bench.backends import retry_delay
from bench.common import machine, print_table, write_result
from bench.mesh import bench_mesh
from bench.schemas import SCHEMAS
from llmesh.testing import VLLM_MODEL_NAME, VllmServer, real_models_dir
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

STREAMS = 32
NEW_TOKENS = 64
BUDGETS = (48, 128)
# Rounds of the waves; each wave's best round is its figure (a shared 2-core machine's load
# comes and goes).
ROUNDS = 2
CLOSED = "127.0.0.1:1"
MESH_SERVICES = ("tokenizer", "inference", "gateway")
# The schema replies go out this many at a time (a client's worth of concurrency), retried after
# the delay a shed or an open breaker names, as a client should.
SCHEMA_CONCURRENCY = 16
RETRIED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
QUESTION = "Write a short note about the sea, number {i}."
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "note": {"type": "string"}},
    "required": ["title", "note"],
}


METHOD = (
    "32 concurrent streams of 64 new tokens per wave, greedy, EOS ignored; in the headline waves "
    "every token holding a double quote has logit_bias -100 (both waves, both engines), so the JSON "
    "answer's free string does not close early and every stream generates its 64 tokens (the "
    "builtin engine closes the JSON along its shortest path at the budget; vLLM cuts it there); "
    "natural_*: the same waves without the bias; tok_s = output tokens / wave wall time"
)
BIAS = -100.0


def quote_bias(tokenizer: Tokenizer) -> dict[int, float]:
    """QUOTE_BIAS: a bias of -100 on every token whose text holds a double quote."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return {t: BIAS for t in range(vocab) if '"' in tokenizer.decode([t], skip_special_tokens=False)}


def request(
    question: str,
    max_new: int,
    schema: dict[str, Any] | None,
    ignore_eos: bool,
    bias: dict[int, float] | None = None,
) -> gateway_pb2.GenerateRequest:
    r = gateway_pb2.GenerateRequest(
        prompt=question,
        use_cache=False,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos, logit_bias=bias or {}),
    )
    if schema is not None:
        r.response_format.CopyFrom(common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(schema)))
    return r


async def mesh_wave(target: str, schema: dict[str, Any] | None, bias: dict[int, float] | None = None) -> dict[str, Any]:
    """STREAMS concurrent streams through the gateway; tok/s over the wave and TTFT p50."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def one(i: int) -> tuple[float, int, float]:
            for attempt in range(8):  # a shed or an open breaker: retried after its delay
                try:
                    return await one_try(i)
                except grpc.aio.AioRpcError as err:
                    if err.code() not in RETRIED or attempt == 7:
                        raise
                    await asyncio.sleep(retry_delay(err, 1.0))
            raise AssertionError("unreachable")

        async def one_try(i: int) -> tuple[float, int, float]:
            started = time.perf_counter()
            first = 0.0
            produced = 0
            ask = request(QUESTION.format(i=i), NEW_TOKENS, schema, True, bias)
            async for event in stub.GenerateStream(ask, timeout=600):
                if event.delta and not first:
                    first = time.perf_counter() - started
                if event.HasField("final"):
                    produced = event.final.usage.output_tokens
            return first, produced, time.perf_counter() - started

        await one(0)  # warm: the grammar compiled, the model's first batch shapes seen
        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
        wall = time.perf_counter() - started
    return _wave(results, wall)


async def mesh_schemas(target: str) -> dict[str, int]:
    """Every schema at every budget, all at once; answered replies that parse and validate."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        lanes = asyncio.Semaphore(SCHEMA_CONCURRENCY)

        async def one(question: str, schema: dict[str, Any], budget: int) -> str:
            async with lanes:
                for attempt in range(8):
                    try:
                        reply = await stub.Generate(request(question, budget, schema, False), timeout=600)
                        break
                    except grpc.aio.AioRpcError as err:
                        if err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in (err.details() or ""):
                            return "refused"
                        if err.code() not in RETRIED or attempt == 7:
                            raise
                        await asyncio.sleep(retry_delay(err, 1.0))
            return "valid" if _valid(reply.text, schema) else "invalid"

        outcomes = await asyncio.gather(*(one(q, s, b) for q, s in SCHEMAS for b in BUDGETS))
    return _tally(outcomes)


async def vllm_wave(
    base_url: str, prompts: list[list[int]], schema: dict[str, Any] | None, bias: dict[int, float] | None = None
) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(ids: list[int]) -> tuple[float, int, float]:
            body: dict[str, Any] = {
                "model": VLLM_MODEL_NAME,
                "prompt": ids,
                "max_tokens": NEW_TOKENS,
                "temperature": 0.0,
                "ignore_eos": schema is None,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if schema is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
            if bias:
                body["logit_bias"] = {str(t): b for t, b in bias.items()}
            started = time.perf_counter()
            first = 0.0
            produced = 0
            async with client.stream("POST", f"{base_url}/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if not first and any(c.get("text") for c in chunk.get("choices") or ()):
                        first = time.perf_counter() - started
                    if chunk.get("usage"):
                        produced = int(chunk["usage"]["completion_tokens"])
            return first, produced, time.perf_counter() - started

        await one(prompts[0])
        started = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
    return _wave(results, wall)


def _wave(results: Sequence[tuple[float, int, float]], wall: float) -> dict[str, Any]:
    """Output tokens over the wave's wall time; the mean decode rate of a stream (tokens after
    its first over the time after its first: the per-token cost, whatever the answer's length: a
    structured answer that closes early ends its stream early); TTFT p50; mean tokens."""
    rates = [(n - 1) / (done - first) for first, n, done in results if n > 1 and done > first]
    return {
        "tok_s": sum(n for _, n, _ in results) / wall,
        "stream_tok_s": statistics.mean(rates) if rates else 0.0,
        "ttft_p50_s": statistics.median(f for f, _, _ in results),
        "mean_tokens": statistics.mean(n for _, n, _ in results),
    }


async def vllm_schemas(base_url: str, prompts: dict[str, list[int]]) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(question: str, schema: dict[str, Any], budget: int) -> str:
            body = {
                "model": VLLM_MODEL_NAME,
                "prompt": prompts[question],
                "max_tokens": budget,
                "temperature": 0.0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            }
            response = await client.post(f"{base_url}/completions", json=body)
            if response.status_code != 200:
                return "refused"
            return "valid" if _valid(response.json()["choices"][0]["text"], schema) else "invalid"

        outcomes = await asyncio.gather(*(one(q, s, b) for q, s in SCHEMAS for b in BUDGETS))
    return _tally(outcomes)


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _tally(outcomes: Sequence[str]) -> dict[str, int]:
    return {k: sum(1 for o in outcomes if o == k) for k in ("valid", "invalid", "refused")} | {"total": len(outcomes)}


def compile_times(models: Path) -> dict[str, float]:
    from services.inference.engine.decoding import ResponseFormatSpec
    from services.inference.engine.grammar import Grammars

    tokenizer = Tokenizer.from_file(str(models / "smollm2" / "current" / "tokenizer.json"))
    grammars = Grammars(tokenizer, tokenizer.get_vocab_size(with_added_tokens=True), frozenset({2}))
    cold, cached = [], []
    for _, schema in SCHEMAS:
        spec = ResponseFormatSpec(kind="json_schema", schema=json.dumps(schema))
        started = time.perf_counter()
        grammars.row(spec, 256)
        cold.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        grammars.row(spec, 256)
        cached.append((time.perf_counter() - started) * 1000)
    return {"compile_cold_ms": statistics.median(cold), "compile_cached_ms": statistics.median(cached)}


async def rendered(tokenizer_target: str, questions: list[str]) -> list[list[int]]:
    """The token ids the gateway sends for each question (vLLM gets the very same prompts)."""
    from services.gateway.core import GatewayConfig, build_messages, validate

    config = GatewayConfig("docs", 4, 0.25, 32768, 1536, 512, 128)
    async with grpc.aio.insecure_channel(tokenizer_target) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        out = []
        for question in questions:
            messages = build_messages(validate(request(question, NEW_TOKENS, None, False), config), [])
            answer = await stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(messages=messages, add_generation_prompt=True, tokenize=True)
            )
            out.append(list(answer.ids))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's side")
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    models = real_models_dir()
    bias = quote_bias(Tokenizer.from_file(str(models / "smollm2" / "current" / "tokenizer.json")))
    result: dict[str, Any] = {
        "streams": STREAMS,
        "new_tokens": NEW_TOKENS,
        "budgets": list(BUDGETS),
        "method": METHOD,
        "quote_bias_tokens": len(bias),
    }
    result.update(compile_times(models))
    env = {
        "LLMESH_MODELS_DIR": str(models),
        "LLMESH_CACHE_TARGET": CLOSED,
        "LLMESH_RETRIEVAL_TARGET": CLOSED,
        "LLMESH_NICE": "0",
        "LLMESH_INFERENCE_MODEL": "smollm2",
        "LLMESH_MAX_BATCH_SIZE": str(STREAMS),
        # The waves measure decoding, not admission: no learned in-flight limit sheds them.
        "LLMESH_ADMISSION_ADAPTIVE": "false",
    }
    questions = [QUESTION.format(i=i) for i in range(STREAMS)]
    with bench_mesh(env, services=MESH_SERVICES) as mesh:
        gateway = mesh.target("gateway")
        waves = _rounds(lambda schema, b: asyncio.run(mesh_wave(gateway, schema, b)), bias)
        print_table(waves, "builtin waves")
        tally = asyncio.run(mesh_schemas(gateway))
        prompts = asyncio.run(rendered(mesh.target("tokenizer"), questions + [q for q, _ in SCHEMAS]))
    result |= _figures(waves, "")
    result |= {
        "schemas_valid": tally["valid"],
        "schemas_invalid": tally["invalid"],
        "schemas_refused": tally["refused"],
        "schemas_total": tally["total"],
        "schema_count": len(SCHEMAS),
    }
    if not args.no_vllm and VllmServer.available():
        with tempfile.TemporaryDirectory(prefix="llmesh-bench-structured-") as tmp:
            vllm = VllmServer((models / "smollm2" / "current").resolve(), Path(tmp) / "vllm.log")
            vllm.start()
            try:
                vllm.wait_ready()
                wave = prompts[:STREAMS]
                by_question = dict(zip([q for q, _ in SCHEMAS], prompts[STREAMS:], strict=True))
                url = vllm.base_url
                v_waves = _rounds(lambda schema, b: asyncio.run(vllm_wave(url, wave, schema, b)), bias)
                print_table(v_waves, "vLLM waves")
                v_tally = asyncio.run(vllm_schemas(url, by_question))
            finally:
                vllm.stop()
        result |= _figures(v_waves, "vllm_")
        result |= {
            "vllm_schemas_valid": v_tally["valid"],
            "vllm_schemas_invalid": v_tally["invalid"],
            "vllm_schemas_refused": v_tally["refused"],
        }
    result["passes"] = {
        "json_schema_at_least_0.8x": result["json_schema_tok_s"] >= 0.8 * result["unconstrained_tok_s"],
        "json_schema_stream_at_least_0.8x": (
            result["json_schema_stream_tok_s"] >= 0.8 * result["unconstrained_stream_tok_s"]
        ),
        "every_stream_64_tokens": result["json_schema_mean_tokens"]
        == NEW_TOKENS
        == result["unconstrained_mean_tokens"],
        "every_answer_valid": result["schemas_invalid"] == 0,
    }
    result["duration_s"] = time.perf_counter() - begun
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if not isinstance(v, dict | str)}, "structured answers")
    print(f"wrote {write_result('structured', result)}")


def _rounds(
    run: Callable[[dict[str, Any] | None, dict[int, float] | None], dict[str, Any]], bias: dict[int, float]
) -> dict[str, dict[str, Any]]:
    """ROUNDS rounds of the four waves (free and JSON back to back, biased then natural: a pair
    shares the machine's load of the moment); each wave's best round (the least disturbed, by
    tok_s), with every round's tok_s."""
    arms: dict[str, tuple[dict[str, Any] | None, dict[int, float] | None]] = {
        "unconstrained": (None, bias),
        "json_schema": (LONG_SCHEMA, bias),
        "natural_unconstrained": (None, None),
        "natural_json_schema": (LONG_SCHEMA, None),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for _ in range(ROUNDS):
        for name, (schema, b) in arms.items():
            runs[name].append(run(schema, b))
    return {
        name: max(r, key=lambda w: w["tok_s"]) | {"tok_s_rounds": [w["tok_s"] for w in r]} for name, r in runs.items()
    }


def _figures(waves: dict[str, dict[str, Any]], prefix: str) -> dict[str, Any]:
    """The waves' figures as result fields (`prefix`: "" for the mesh, "vllm_"), with the JSON
    wave's rate over the free wave's, biased and natural."""
    out: dict[str, Any] = {}
    for name, wave in waves.items():
        natural = name.startswith("natural_")
        arm = name.removeprefix("natural_")
        lead = f"{prefix}natural_" if natural else prefix
        out[f"{lead}{arm}_tok_s"] = wave["tok_s"]
        out[f"{lead}{arm}_tok_s_rounds"] = wave["tok_s_rounds"]
        out[f"{lead}{arm}_stream_tok_s"] = wave["stream_tok_s"]
        out[f"{lead}{arm}_mean_tokens"] = wave["mean_tokens"]
        out[f"{lead}ttft_{arm}_p50_s"] = wave["ttft_p50_s"]
    for lead in (prefix, f"{prefix}natural_"):
        out[f"{lead}json_schema_ratio"] = out[f"{lead}json_schema_tok_s"] / out[f"{lead}unconstrained_tok_s"]
        # Each round's JSON wave over the free wave just before it.
        pairs = zip(out[f"{lead}json_schema_tok_s_rounds"], out[f"{lead}unconstrained_tok_s_rounds"], strict=True)
        out[f"{lead}json_schema_ratio_rounds"] = [j / f for j, f in pairs]
    return out


if __name__ == "__main__":
    main()
