"""Prefix caching benchmark: the builtin engine's time to first token when the prompt starts with
text it has seen, side by side in one run with vLLM's CPU build (prefix caching on).

The same chat-templated token ids go to both (SmolLM2-135M-Instruct, greedy, answer cache not in
the path: the inference service is called directly over gRPC, vLLM over /v1/completions):

* first_ttft_s           the first request with a ~800-token system prompt (after a warm-up
                         request of other text)
* repeat_ttft_p50_s      that system prompt again, a different short question each time
* fresh_ttft_p50_s       a different system prompt of the same length each time (nothing shared
                         beyond the chat template's first tokens)
* *_no_prefix            the same two on the builtin engine with LLMESH_PREFIX_CACHING=0
* vllm_first_ttft_s, vllm_repeat_ttft_p50_s, vllm_fresh_ttft_p50_s  the same on vLLM
* turn1_ttft_s .. turn8_ttft_s  an 8-turn conversation on the builtin engine: each turn's prompt
                         is the whole conversation so far (system prompt, earlier questions and
                         the engine's own answers, 32 tokens each)
* max_concurrent_64tok, max_concurrent_64tok_slots  computed from the engine's default KV pool
                         (LLMESH_MAX_BATCH_TOTAL_TOKENS=0 on CPU: max batch x (max prompt + max
                         new tokens) tokens): how many requests of bench.batching's chat prompts
                         with 64-token answers its blocks hold, against the slots of the same
                         memory before blocks (one slot of max prompt + max new tokens each)

Targets (`passes`): repeat <= 0.25 x fresh; repeat <= vLLM's repeat; turn 8 <= 1.5 x turn 1;
max_concurrent_64tok >= 2 x max_concurrent_64tok_slots.

vLLM runs with --enforce-eager (its torch.compile step takes minutes on 2 cores and changes a
prefill's speed little). Run: `.venv/bin/python -m bench.prefix` (about 5 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc
import httpx

from bench.backends import direct_one
from bench.batching import build_prompts
from bench.common import machine, print_table, write_result
from llmesh.supervisor import Mesh
from llmesh.testing import VllmServer, real_models_dir
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

REPEATS = 8
TURNS = 8
ANSWER_TOKENS = 32
QUESTIONS = [
    "When does the first ferry leave?",
    "Is the north pier open today?",
    "Where can I park a trailer?",
    "Who do I call about a lost bag?",
    "Can I bring a dog on board?",
    "How early should I arrive?",
    "Are there lockers at the terminal?",
    "What if the crossing is cancelled?",
    "Do you sell tickets on board?",
    "Is there a discount for students?",
]


def system_prompt(office: str, tokens_wanted: int, count_tokens: Any) -> str:
    """About `tokens_wanted` tokens of house rules for one office (its name first, so two
    offices' prompts share nothing after the chat template's first tokens)."""
    rules = [f"You are the assistant of the {office} harbour office."]
    k = 0
    while count_tokens(" ".join(rules)) < tokens_wanted:
        k += 1
        rules.append(
            f"Rule {k} of the {office} office: answer visitors briefly, name the pier and the time "
            f"when you know them, and send questions about tickets, luggage or pets to desk {k % 7 + 1}."
        )
    return " ".join(rules)


class Chat:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


async def builtin_ttft(stub: inference_pb2_grpc.InferenceStub, ids: list[int], max_new: int = 4) -> tuple[float, str]:
    """TTFT of one streamed request through the inference service, and its text."""
    request = inference_pb2.InferenceRequest(
        token_ids=inference_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
    )
    sent = time.perf_counter()
    first = None
    text = ""
    async for message in stub.Generate(request, timeout=600):
        if message.token_ids and first is None:
            first = time.perf_counter()
        text += message.text
    assert first is not None
    return first - sent, text


async def builtin_phase(
    target: str, chat: Chat, systems: list[str], conversation_system: str | None
) -> dict[str, float]:
    out: dict[str, float] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await builtin_ttft(stub, chat.ids([{"role": "user", "content": "Hello there!"}]))  # warm-up
        shared = systems[0]
        out["first_ttft_s"], _ = await builtin_ttft(stub, chat.ids(_messages(shared, QUESTIONS[0])))
        repeats = [
            (await builtin_ttft(stub, chat.ids(_messages(shared, QUESTIONS[1 + i % 9]))))[0] for i in range(REPEATS)
        ]
        fresh = [(await builtin_ttft(stub, chat.ids(_messages(s, QUESTIONS[0]))))[0] for s in systems[1:]]
        out["repeat_ttft_p50_s"] = statistics.median(repeats)
        out["fresh_ttft_p50_s"] = statistics.median(fresh)
        if conversation_system is not None:
            # A system prompt of its own: turn 1 reuses nothing the earlier phases cached.
            messages = [{"role": "system", "content": conversation_system}]
            for turn in range(TURNS):
                messages.append({"role": "user", "content": QUESTIONS[turn]})
                ttft, answer = await builtin_ttft(stub, chat.ids(messages), ANSWER_TOKENS)
                out[f"turn{turn + 1}_ttft_s"] = ttft
                messages.append({"role": "assistant", "content": answer})
            out["turn8_prompt_tokens"] = len(chat.ids(messages[:-1]))
    return out


async def vllm_phase(base_url: str, chat: Chat, systems: list[str]) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=600) as client:

        async def ttft(ids: list[int]) -> float:
            record = await direct_one(client, base_url, ids, 4)
            assert record.first is not None
            return record.first - record.sent

        await ttft(chat.ids([{"role": "user", "content": "Hello there!"}]))
        shared = systems[0]
        first = await ttft(chat.ids(_messages(shared, QUESTIONS[0])))
        repeats = [await ttft(chat.ids(_messages(shared, QUESTIONS[1 + i % 9]))) for i in range(REPEATS)]
        fresh = [await ttft(chat.ids(_messages(s, QUESTIONS[0]))) for s in systems[1:]]
    return {
        "vllm_first_ttft_s": first,
        "vllm_repeat_ttft_p50_s": statistics.median(repeats),
        "vllm_fresh_ttft_p50_s": statistics.median(fresh),
    }


def _messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def concurrency(model_dir: Path) -> dict[str, float]:
    """Requests with 64-token answers the default CPU pool holds, in blocks and in slots."""
    from llmesh.settings import load as load_settings
    from services.inference.engine.config import EngineConfig

    config = EngineConfig.from_settings(load_settings("inference", {}))
    seq = config.max_prompt_tokens + config.max_new_tokens
    pool = config.max_batch_size * seq  # the CPU default, as EngineConfig.kv_tokens derives it
    prompts = build_prompts(model_dir)
    per_request = statistics.mean(math.ceil((len(p) + 64) / config.block_tokens) for p in prompts)
    return {
        "kv_pool_tokens": pool,
        "chat_prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
        "max_concurrent_64tok": int(pool // config.block_tokens // per_request),
        "max_concurrent_64tok_slots": pool // seq,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM (its start takes minutes)")
    parser.add_argument("--system-tokens", type=int, default=800)
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    models = real_models_dir()
    model_dir = models / "smollm2" / "current"
    chat = Chat(model_dir)
    systems = [system_prompt(f"Office-{i}", args.system_tokens, chat.count) for i in range(REPEATS + 2)]
    result: dict[str, Any] = {
        "system_prompt_tokens": len(chat.ids(_messages(systems[0], QUESTIONS[0]))),
        "repeats": REPEATS,
    }
    loads: dict[str, float] = {}
    env = {"LLMESH_MODELS_DIR": str(models), "LLMESH_INFERENCE_MODEL": "smollm2", "LLMESH_NICE": "0"}
    with Mesh(services=("inference",), env=env) as mesh:
        conversation = system_prompt("Conversation", args.system_tokens, chat.count)
        result.update(asyncio.run(builtin_phase(mesh.target("inference"), chat, systems, conversation)))
    loads["builtin"] = round(os.getloadavg()[0], 2)
    print_table(result, "builtin engine, prefix caching on")
    with Mesh(services=("inference",), env={**env, "LLMESH_PREFIX_CACHING": "0"}) as mesh:
        off = asyncio.run(builtin_phase(mesh.target("inference"), chat, systems, None))
    loads["builtin_no_prefix"] = round(os.getloadavg()[0], 2)
    for key in ("first_ttft_s", "repeat_ttft_p50_s", "fresh_ttft_p50_s"):
        result[f"{key.removesuffix('_s')}_no_prefix_s"] = off[key]
    if not args.no_vllm:
        if not VllmServer.available():
            raise SystemExit("bench.prefix needs vLLM's CPU build: run `make vllm` first (or --no-vllm)")
        with tempfile.TemporaryDirectory(prefix="llmesh-bench-prefix-") as tmp:
            vllm = VllmServer(
                model_dir.resolve(), Path(tmp) / "vllm.log", eager=True, extra_args=("--enable-prefix-caching",)
            )
            vllm.start()
            try:
                vllm.wait_ready()
                result.update(asyncio.run(vllm_phase(vllm.base_url, chat, systems)))
            finally:
                vllm.stop()
        loads["vllm"] = round(os.getloadavg()[0], 2)
    result.update(concurrency(model_dir))
    result["repeat_over_fresh"] = result["repeat_ttft_p50_s"] / result["fresh_ttft_p50_s"]
    result["turn8_over_turn1"] = result["turn8_ttft_s"] / result["turn1_ttft_s"]
    passes = {
        "repeat_le_0.25x_fresh": result["repeat_over_fresh"] <= 0.25,
        "turn8_le_1.5x_turn1": result["turn8_over_turn1"] <= 1.5,
        "blocks_hold_2x_slots": result["max_concurrent_64tok"] >= 2 * result["max_concurrent_64tok_slots"],
    }
    if "vllm_repeat_ttft_p50_s" in result:
        passes["repeat_le_vllm_repeat"] = result["repeat_ttft_p50_s"] <= result["vllm_repeat_ttft_p50_s"]
    result["passes"] = passes
    result["machine"] = {**machine(), "load_average_1m_after_phase": loads}
    result["bench_seconds"] = time.perf_counter() - begun
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "prefix benchmark")
    print_table(passes, "targets")
    print(f"\nwrote {write_result('prefix', result)}")


if __name__ == "__main__":
    main()
