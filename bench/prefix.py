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

* rag_rps, rag_ttft_p50_s, rag_ttft_p95_s (and *_no_prefix: a second mesh with
                         LLMESH_PREFIX_CACHING=0 up beside the first, the two measured in
                         alternating --rag-round-seconds rounds): RAG through the whole
                         mesh (gateway gRPC GenerateStream, answer cache off so every request
                         generates): 32 closed-loop clients over 50 questions about 4 ingested
                         documents (top_k 4), 16-token answers, --rag-seconds each;
                         rag_prefix_hit_rate* is the engine's prompt tokens served from the prefix
                         cache over those looked up in the measured window (its Prometheus counters)

Targets (`passes`): repeat <= 0.25 x fresh; repeat <= vLLM's repeat; turn 8 <= 1.5 x turn 1;
max_concurrent_64tok >= 2 x max_concurrent_64tok_slots; rag_rps >= 1.3 x rag_rps_no_prefix.

`--only rag` runs the RAG loop alone and keeps the other figures of bench/results/prefix.json.

vLLM runs with --enforce-eager (its torch.compile step takes minutes on 2 cores and changes a
prefill's speed little). Run: `.venv/bin/python -m bench.prefix` (about 10 minutes; the RAG loop
alone, two meshes started and 2 x 40 s measured, about 6).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc
import httpx

from bench.backends import direct_one
from bench.batching import build_prompts
from bench.common import RESULTS_DIR, machine, print_table, write_result
from bench.mesh import BENCH_REDIS_DB, bench_mesh
from llmesh.supervisor import Mesh
from llmesh.testing import VllmServer, real_models_dir
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc

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

    settings = load_settings("inference", {})
    config = EngineConfig.from_settings(settings.engine, settings.generation)
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


# --- RAG through the mesh ---------------------------------------------------------------------

RAG_COLLECTION = "prefix-bench"
RAG_TENANT = "bench"
RAG_TOP_K = 4
RAG_CLIENTS = 32
RAG_ANSWER_TOKENS = 16
# Four handbooks, each a run of facts: a question names one fact, so retrieval finds that fact's
# chunk and its neighbours (4 documents x ~4 chunks of LLMESH_CHUNK_TOKENS each).
RAG_PLACES = ("Vellmora lighthouse", "Quorrin ferry", "Teshla bakery", "Marrowind railway")
RAG_FACTS = (
    ("opening hour", "{n} in the morning"),
    ("closing hour", "{n} in the evening"),
    ("manager", "Ilse Varga the {n}th"),
    ("founding year", "the year 18{n}"),
    ("colour of the roof", "shade number {n} of green"),
    ("number of staff", "{n} people"),
    ("nearest town", "Dask-{n}"),
    ("telephone desk", "desk {n}"),
    ("ticket price", "{n} silver coins"),
    ("lost property office", "room {n}"),
    ("winter schedule", "{n} days a week"),
    ("mascot", "a heron called Pip-{n}"),
    ("emergency contact", "warden {n}"),
)


def rag_documents() -> list[common_pb2.Document]:
    docs = []
    for d, place in enumerate(RAG_PLACES):
        sentences = []
        for f, (fact, value) in enumerate(RAG_FACTS):
            n = 3 + (7 * d + 5 * f) % 17
            sentences.append(
                f"The {fact} of the {place} is {value.format(n=n)}. Visitors who ask about the {fact} "
                f"of the {place} are told this at the front desk, and it is printed on the notice board."
            )
        docs.append(common_pb2.Document(id=place.split()[0].lower(), text=" ".join(sentences)))
    return docs


def rag_questions() -> list[str]:
    """50 questions, spread over the four documents."""
    every = [f"What is the {fact} of the {place}?" for place in RAG_PLACES for fact, _ in RAG_FACTS]
    return every[:50]


class RagArm:
    """One mesh's side of the RAG loop: its gateway channel, and what its measured rounds saw."""

    def __init__(self, target: str, metrics_port: int, system: str, max_new: int) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.metrics_port = metrics_port
        self.system = system
        self.sampling = common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        self.ttfts: list[float] = []
        self.prompt_tokens: list[int] = []
        self.sources: list[int] = []
        self.seconds = 0.0
        self.query_tokens = 0.0
        self.hit_tokens = 0.0
        self.chunks = 0

    async def ingest(self) -> None:
        ingested = await self.stub.Ingest(
            gateway_pb2.IngestRequest(collection=RAG_COLLECTION, tenant=RAG_TENANT, documents=rag_documents()),
            timeout=300,
        )
        self.chunks = ingested.chunks

    async def one(self, question: str) -> tuple[float, int, int]:
        """(TTFT, prompt tokens, sources) of one streamed answer; a shed try is retried, the
        clock restarting with the admitted try."""
        request = gateway_pb2.GenerateRequest(
            prompt=question,
            system_prompt=self.system,
            sampling=self.sampling,
            use_cache=False,
            top_k=RAG_TOP_K,
            collection=RAG_COLLECTION,
            tenant=RAG_TENANT,
        )
        while True:
            sent = time.perf_counter()
            first = None
            final = None
            try:
                async for message in self.stub.GenerateStream(request, timeout=300):
                    if message.HasField("delta") and first is None:
                        first = time.perf_counter()
                    if message.HasField("final"):
                        final = message.final
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                await asyncio.sleep(0.05)
                continue
            assert final is not None and not final.cache.hit
            return (first or time.perf_counter()) - sent, final.usage.input_tokens, len(final.sources)

    async def round(self, clients: int, seconds: float, start: int) -> None:
        """`clients` closed-loop clients for `seconds`, asking the questions in turn from `start`;
        answers finished within the round are counted (the round lasts until the last one ends,
        so no work is carried into the other arm's round)."""
        questions = rag_questions()
        before = prefix_counters(self.metrics_port)
        begun = time.perf_counter()
        stop_at = begun + seconds

        async def client(k: int) -> None:
            i = start + k
            while time.perf_counter() < stop_at:
                ttft, tokens, found = await self.one(questions[i % len(questions)])
                if time.perf_counter() <= stop_at:
                    self.ttfts.append(ttft)
                    self.prompt_tokens.append(tokens)
                    self.sources.append(found)
                i += clients

        await asyncio.gather(*(client(k) for k in range(clients)))
        self.seconds += seconds
        after = prefix_counters(self.metrics_port)
        self.query_tokens += after["query"] - before["query"]
        self.hit_tokens += after["hit"] - before["hit"]

    def figures(self) -> dict[str, float]:
        ttfts = sorted(self.ttfts)
        return {
            "rps": len(ttfts) / self.seconds,
            "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "requests": len(ttfts),
            "prompt_tokens_mean": statistics.mean(self.prompt_tokens),
            "sources_mean": statistics.mean(self.sources),
            "prefix_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "chunks": self.chunks,
        }


def prefix_counters(port: int) -> dict[str, float]:
    """The engine's prefix-cache counters (prompt tokens looked up / served from the cache) from
    the inference service's Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {"query": 0.0, "hit": 0.0}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "llmesh_inference_prefix_query_tokens_total":
            out["query"] = float(value)
        elif name == "llmesh_inference_prefix_hit_tokens_total":
            out["hit"] = float(value)
    return out


def rag_phase(args: argparse.Namespace, chat: Chat) -> dict[str, Any]:
    """The RAG loop on two meshes up side by side, prefix caching on and off, in alternating
    rounds (on, off, off, on, ...) so that load from outside the run weighs on both alike."""
    system = system_prompt("Archive", args.rag_system_tokens, chat.count) if args.rag_system_tokens else ""
    rounds = max(1, round(args.rag_seconds / args.rag_round_seconds))
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        ports: dict[str, tuple[str, int]] = {}
        for suffix, caching in (("", "1"), ("_no_prefix", "0")):
            env = {
                "LLMESH_INFERENCE_MODEL": "smollm2",
                "LLMESH_NICE": "0",
                "LLMESH_PREFIX_CACHING": caching,
                "LLMESH_MAX_BATCH_SIZE": str(args.rag_clients),
                # 32 clients' prompts of ~900 tokens queue for seconds on 2 cores: a first
                # message that slow is the load asked for, not a failing service (the breaker's
                # default 5 s would open it and the loop would measure the breaker).
                "LLMESH_BREAKER_SLOW_CALL_SECONDS": "600",
            }
            mesh = stack.enter_context(bench_mesh(env, redis_db=BENCH_REDIS_DB + len(ports)))
            ports[suffix] = (mesh.target("gateway"), mesh.procs["inference"].metrics_port)

        async def run() -> dict[str, dict[str, float]]:
            arms = {s: RagArm(t, p, system, args.rag_tokens) for s, (t, p) in ports.items()}
            try:
                for arm in arms.values():
                    await arm.ingest()
                    await arm.one(rag_questions()[-1])  # warm-up: every hop loaded
                order = list(arms)
                for r in range(rounds):
                    for suffix in order if r % 2 == 0 else order[::-1]:
                        await arms[suffix].round(args.rag_clients, args.rag_seconds / rounds, r * args.rag_clients)
                        print(f"RAG round {r + 1}/{rounds}{suffix or ' (prefix caching on)'}", flush=True)
                return {s: arm.figures() for s, arm in arms.items()}
            finally:
                for arm in arms.values():
                    await arm.channel.close()

        figures = asyncio.run(run())
    for suffix, arm in figures.items():
        print_table(arm, f"RAG through the mesh, prefix caching {'off' if suffix else 'on'}")
        for key, value in arm.items():
            out[f"rag_{key}{suffix}"] = value
    out["rag_clients"] = args.rag_clients
    out["rag_seconds"] = args.rag_seconds
    out["rag_rounds"] = rounds
    out["rag_answer_tokens"] = args.rag_tokens
    out["rag_top_k"] = RAG_TOP_K
    out["rag_questions"] = len(rag_questions())
    out["rag_documents"] = len(RAG_PLACES)
    out["rag_system_prompt_tokens"] = chat.count(system) if system else 0
    out["rag_rps_over_no_prefix"] = out["rag_rps"] / out["rag_rps_no_prefix"]
    out["_loads"] = {"rag": round(os.getloadavg()[0], 2)}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM (its start takes minutes)")
    parser.add_argument("--system-tokens", type=int, default=800)
    parser.add_argument(
        "--only",
        choices=("rag", "engine"),
        help="run one part: rag (the RAG loop through the mesh; the other figures are kept from the "
        "results file) or engine (everything but the RAG loop)",
    )
    parser.add_argument("--rag-seconds", type=float, default=40.0, help="measured seconds of each RAG arm")
    parser.add_argument("--rag-round-seconds", type=float, default=10.0, help="seconds of one RAG round")
    parser.add_argument("--rag-clients", type=int, default=RAG_CLIENTS)
    parser.add_argument("--rag-tokens", type=int, default=RAG_ANSWER_TOKENS, help="tokens of each RAG answer")
    parser.add_argument(
        "--rag-system-tokens", type=int, default=0, help="system prompt of the RAG requests (0: the gateway's default)"
    )
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    models = real_models_dir()
    model_dir = models / "smollm2" / "current"
    chat = Chat(model_dir)
    result: dict[str, Any]
    loads: dict[str, float]
    if args.only == "rag":
        previous = RESULTS_DIR / "prefix.json"
        result = json.loads(previous.read_text()) if previous.exists() else {}
        result.pop("generated_at", None)
        loads = dict(result.get("machine", {}).get("load_average_1m_after_phase", {}))
    else:
        result, loads = engine_phases(args, models, model_dir, chat)
    if args.only != "engine":
        rag = rag_phase(args, chat)
        loads.update(rag.pop("_loads"))
        result.update(rag)
    passes = dict(result.get("passes", {}))
    if "rag_rps" in result:
        passes["rag_rps_ge_1.3x_no_prefix"] = result["rag_rps_over_no_prefix"] >= 1.3
    result["passes"] = passes
    result["machine"] = {**machine(), "load_average_1m_after_phase": loads}
    result["bench_seconds"] = time.perf_counter() - begun
    print_table({k: v for k, v in result.items() if not isinstance(v, dict)}, "prefix benchmark")
    print_table(passes, "targets")
    print(f"\nwrote {write_result('prefix', result)}")


def engine_phases(
    args: argparse.Namespace, models: Path, model_dir: Path, chat: Chat
) -> tuple[dict[str, Any], dict[str, float]]:
    """Everything but the RAG loop: the inference service alone, beside vLLM."""
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
    return result, loads


if __name__ == "__main__":
    main()
