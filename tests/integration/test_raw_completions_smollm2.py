"""Raw completions and vLLM's fields through the real gateway on SmolLM2 (tokenizer, the builtin
engine in float32, gateway; the official `openai` client over HTTP, and gRPC): the prompt is the
model's whole input (no chat template), `echo` with `logprobs` scores every prompt token after the
first as a direct transformers forward does (what lm-evaluation-harness computes log-likelihoods
with), `max_tokens` 0 only reads the prompt, `ignore_eos` and `min_tokens` hold off the end,
and `cached_tokens` reports the prompt tokens the engine's prefix cache held, counted apart in
the tenant's usage under the model's real name."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch
from prometheus_client import REGISTRY
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from llmesh.server import ServiceHost
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

CLOSED = "127.0.0.1:1"
MODEL = "SmolLM2-135M-Instruct"
SIX_WORDS = "Describe Paris in many sentences."
SCORED = "The capital of France is Paris, and the capital of Italy is Rome."
NO_CACHE = {"llmesh": {"use_cache": False}}


@pytest.fixture(scope="module")
def smollm2(models_dir: Path) -> Path:
    return models_dir / "smollm2" / "current"


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2 / "tokenizer.json"))


@pytest.fixture(scope="module")
async def gateway(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServiceHost]:
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("raw-data")),
        "LLMESH_INFERENCE_MODEL": "smollm2",
        "LLMESH_DTYPE": "float32",
    }
    async with hosted("tokenizer", TokenizerApp, env) as tok, hosted("inference", InferenceApp, env) as inf:
        gateway_env = {
            **env,
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
            "LLMESH_CACHE_TARGET": CLOSED,
            "LLMESH_RETRIEVAL_TARGET": CLOSED,
            "LLMESH_ADMISSION_ADAPTIVE": "false",
        }
        async with hosted("gateway", GatewayApp, gateway_env) as gw:
            yield gw


def base_url(gw: ServiceHost) -> str:
    return f"http://127.0.0.1:{gw.app.http.port}/v1"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
async def client(gateway: ServiceHost) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url(gateway), api_key="none", max_retries=0, timeout=300) as c:
        yield c


async def test_the_prompt_is_the_models_whole_input_as_text_or_token_ids(
    client: openai.AsyncOpenAI, tokenizer: Tokenizer, gateway: ServiceHost
) -> None:
    ids = tokenizer.encode(SIX_WORDS, add_special_tokens=True).ids
    assert len(ids) == 6  # SmolLM2 adds no BOS to a text
    by_text = await client.completions.create(model=MODEL, prompt=SIX_WORDS, max_tokens=8, extra_body=NO_CACHE)
    assert by_text.usage is not None and by_text.usage.prompt_tokens == len(ids)
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, extra_body=NO_CACHE)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text  # greedy: the same input, the same answer
    # gRPC: the same raw mode on GenerateRequest.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply = await stub.Generate(
            gateway_pb2.GenerateRequest(
                prompt=SIX_WORDS, raw=True, use_cache=False, sampling=common_pb2.SamplingParams(max_new_tokens=8)
            ),
            timeout=300,
        )
        templated = await stub.Generate(
            gateway_pb2.GenerateRequest(
                prompt=SIX_WORDS, use_cache=False, sampling=common_pb2.SamplingParams(max_new_tokens=8)
            ),
            timeout=300,
        )
    assert reply.usage.input_tokens == len(ids) and reply.text == by_text.choices[0].text
    assert templated.usage.input_tokens > 20  # a chat request still gets the template
    # A batch of prompts: each prompt's choice in order, usage summed.
    batch = await client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=8, extra_body=NO_CACHE)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [by_text.choices[0].text] * 2
    assert batch.usage is not None and batch.usage.prompt_tokens == 2 * len(ids)
    # Echo streamed: the prompt first, then the answer.
    stream = await client.completions.create(
        model=MODEL, prompt=SIX_WORDS, max_tokens=8, echo=True, stream=True, extra_body=NO_CACHE
    )
    pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert pieces[0] == SIX_WORDS and "".join(pieces) == SIX_WORDS + by_text.choices[0].text


async def test_echo_with_logprobs_scores_every_prompt_token_after_the_first_as_transformers_does(
    client: openai.AsyncOpenAI, tokenizer: Tokenizer, smollm2: Path
) -> None:
    ids = tokenizer.encode(SCORED, add_special_tokens=True).ids
    scored = await client.completions.create(model=MODEL, prompt=SCORED, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == SCORED and choice.finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == SCORED and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = lp.token_logprobs[1:]
    assert all(isinstance(v, float) and v <= 0 for v in got)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        dist = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(dist[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-2  # type: ignore[operator]
    # With generation: the prompt, then the answer; the prompt's scores, then the answer's.
    both = await client.completions.create(model=MODEL, prompt=SCORED, max_tokens=4, echo=True, logprobs=0)
    text = both.choices[0].text
    assert text.startswith(SCORED) and len(text) > len(SCORED)
    entries = both.choices[0].logprobs
    assert entries is not None and entries.token_logprobs is not None
    assert len(entries.token_logprobs) == len(ids) + 4 and entries.token_logprobs[0] is None
    assert entries.token_logprobs[1 : len(ids)] == pytest.approx(got, abs=1e-4)


async def test_vllms_prompt_logprobs_field_in_its_shape(client: openai.AsyncOpenAI, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(SIX_WORDS, add_special_tokens=True).ids
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=SIX_WORDS, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    body: dict[str, Any] = raw.http_response.json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for token, entry in zip(ids[1:], scored[1:], strict=True):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0
        assert any(e["rank"] == 1 for e in entry.values())


async def test_ignore_eos_gives_max_tokens_and_min_tokens_holds_off_the_stop(client: openai.AsyncOpenAI) -> None:
    long = await client.completions.create(
        model=MODEL, prompt=SIX_WORDS, max_tokens=64, extra_body={"ignore_eos": True, **NO_CACHE}
    )
    assert long.usage is not None and long.usage.completion_tokens == 64
    assert long.choices[0].finish_reason == "length"
    # The answer's first word as a stop string: it ends the answer at once, unless held off.
    first = await client.completions.create(model=MODEL, prompt=SIX_WORDS, max_tokens=4, extra_body=NO_CACHE)
    stop = first.choices[0].text.strip()[:3]
    assert stop
    stopped = await client.completions.create(
        model=MODEL, prompt=SIX_WORDS, max_tokens=16, stop=[stop], extra_body=NO_CACHE
    )
    held = await client.completions.create(
        model=MODEL, prompt=SIX_WORDS, max_tokens=16, stop=[stop], extra_body={"min_tokens": 8, **NO_CACHE}
    )
    assert stopped.usage is not None and held.usage is not None
    assert stopped.usage.completion_tokens < 8 <= held.usage.completion_tokens


async def test_cached_tokens_count_the_shared_prefix_and_the_counters_split_it(
    client: openai.AsyncOpenAI, tokenizer: Tokenizer
) -> None:
    shared = " ".join(f"Rule {i}: answer politely, cite sources and keep it short." for i in range(50))
    assert len(tokenizer.encode(shared).ids) > 550
    labels = {"tenant": "default", "model": MODEL}

    def counted(name: str) -> float:
        return REGISTRY.get_sample_value(f"llmesh_gateway_tenant_{name}_total", labels) or 0.0

    before = {n: counted(n) for n in ("input_tokens", "cached_input_tokens", "uncached_input_tokens")}
    first = await client.completions.create(
        model=MODEL, prompt=f"{shared}\nQuestion: what is rule 3?", max_tokens=2, extra_body=NO_CACHE
    )
    second = await client.completions.create(
        model=MODEL, prompt=f"{shared}\nQuestion: what is rule 7?", max_tokens=2, extra_body=NO_CACHE
    )
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert reused is not None and 500 < reused < second.usage.prompt_tokens
    after = {n: counted(n) for n in before}
    total = first.usage.prompt_tokens + second.usage.prompt_tokens
    assert after["input_tokens"] - before["input_tokens"] == total
    assert after["cached_input_tokens"] - before["cached_input_tokens"] == reused
    assert after["uncached_input_tokens"] - before["uncached_input_tokens"] == total - reused


async def test_vllm_fields_are_implemented_and_fim_is_refused_naming_suffix(
    client: openai.AsyncOpenAI, gateway: ServiceHost
) -> None:
    picked = await client.completions.create(
        model=MODEL,
        prompt="The best season is",
        max_tokens=8,
        extra_body={"guided_choice": ["winter", "summer"], **NO_CACHE},
    )
    assert picked.choices[0].text in ("winter", "summer")
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        extra_body={"skip_special_tokens": False, "ignore_eos": True, "prompt_logprobs": 0, **NO_CACHE},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    async with httpx.AsyncClient(base_url=base_url(gateway), timeout=300) as http:
        answer = await http.post(
            "/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 1,
                "prompt_logprobs": 0,
            },
        )
        assert answer.status_code == 200 and answer.json()["prompt_logprobs"][0] is None
        refused = await http.post("/completions", json={"model": MODEL, "prompt": "def f(", "suffix": "return x"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"
