"""n answers, log probabilities and embeddings through the real gateway, over gRPC and over HTTP
with the official `openai` client, on real servers: tokenizer, tiny-model inference, the cache on
real Redis, and the real retrieval service (MiniLM, embedded Qdrant) for Embed."""

from __future__ import annotations

import base64
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import redis
from prometheus_client import REGISTRY

from llmesh import keys_file
from llmesh.errors import status_details, unpack_details
from llmesh.server import ServiceHost
from llmesh.testing import eventually, hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.peers import Deadline
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.retrieval.servicer import RetrievalApp
from services.tokenizer.servicer import TokenizerApp

MODEL = "tiny-random-llama-0"
EMBEDDER = "all-MiniLM-L6-v2"
KEY = "test-key-choices-0123456789abcdef"
ACME_KEY = "test-key-choices-acme-0123456789"
AUTH = (("authorization", f"Bearer {KEY}"),)
NO_RAG = {"llmesh": {"use_retrieval": False}}


@dataclass
class Mesh:
    gateway: ServiceHost
    inference: ServiceHost
    stub: gateway_pb2_grpc.GatewayStub
    # Keys (from a keys file) limited to the chat model, and to the embedding model.
    chat_only_key: str
    embed_only_key: str

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.app.http.port}/v1"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
async def mesh(
    models_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> AsyncIterator[Mesh]:
    prefix = f"llmesh-choices:{uuid.uuid4().hex[:8]}:"
    keys = tmp_path_factory.mktemp("choices-keys") / "keys.json"
    _, chat_only = keys_file.create(keys, "acme", models=(MODEL,))
    _, embed_only = keys_file.create(keys, "acme", models=(EMBEDDER,))
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("choices")),
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_REDIS_URL": module_redis_url,
        "QDRANT_URL": "",
    }
    try:
        async with hosted("tokenizer", TokenizerApp, env) as tok:
            env = {**env, "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}"}
            async with (
                hosted("inference", InferenceApp, env) as inf,
                hosted("cache", lambda s: CacheApp(s, semantic=False, key_prefix=prefix), env) as cache,
                hosted("retrieval", lambda s: RetrievalApp(s, version_prefix=prefix), env) as rag,
            ):
                gateway_env = {
                    **env,
                    "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                    "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                    "LLMESH_RETRIEVAL_TARGET": f"127.0.0.1:{rag.port}",
                    "LLMESH_API_KEYS": f"{KEY}=*;{ACME_KEY}=acme",
                    "LLMESH_API_KEYS_FILE": str(keys),
                }
                async with hosted("gateway", GatewayApp, gateway_env) as gw:
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
                        yield Mesh(gw, inf, gateway_pb2_grpc.GatewayStub(channel), chat_only, embed_only)
    finally:
        client = redis.Redis.from_url(module_redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="module")
async def client(mesh: Mesh) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=mesh.http_base, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def violations(err: grpc.aio.AioRpcError) -> list[str]:
    details = unpack_details(status_details(err.trailing_metadata()))
    return [v.field for v in details["bad_request"].field_violations]


def ask(question: str, **kw: object) -> gateway_pb2.GenerateRequest:
    sampling = kw.pop("sampling", common_pb2.SamplingParams(max_new_tokens=8))
    return gateway_pb2.GenerateRequest(prompt=question, use_retrieval=False, sampling=sampling, **kw)  # type: ignore[arg-type]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


# ----- gRPC: n answers


async def test_n_answers_differ_by_seed_are_reproducible_and_never_cached(mesh: Mesh) -> None:
    sampling = common_pb2.SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, logprobs=True)
    request = ask(f"Tell me something ({uuid.uuid4().hex[:6]}).", n=3, sampling=sampling)
    first = await mesh.stub.Generate(request, metadata=AUTH, timeout=60)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert first.text == first.choices[0].text and first.finish_reason == first.choices[0].finish_reason
    assert list(first.logprobs) == list(first.choices[0].logprobs)
    assert len({c.text for c in first.choices}) == 3  # seed, seed + 1, seed + 2
    # usage counts every answer: each token generated has its log probability.
    assert first.usage.output_tokens == sum(len(c.logprobs) for c in first.choices)
    assert first.usage.input_tokens > 0 and first.usage.input_tokens % 3 == 0
    again = await mesh.stub.Generate(request, metadata=AUTH, timeout=60)
    assert not again.cache.hit and [c.text for c in again.choices] == [c.text for c in first.choices]
    # One answer with the same seed is the first of the n.
    one = await mesh.stub.Generate(ask(request.prompt, sampling=sampling, use_cache=False), metadata=AUTH, timeout=60)
    assert one.text == first.choices[0].text and not one.choices


async def test_n_greedy_answers_are_identical_as_vllm_gives_them(mesh: Mesh) -> None:
    answer = await mesh.stub.Generate(ask(f"Greedy ({uuid.uuid4().hex[:6]})?", n=2), metadata=AUTH, timeout=60)
    assert len(answer.choices) == 2 and answer.choices[0].text == answer.choices[1].text


async def test_bad_n_and_logprobs_fields_are_named(mesh: Mesh) -> None:
    cases = [
        (ask("q", n=17), ["n"]),
        (ask("q", sampling=common_pb2.SamplingParams(logprobs=True, top_logprobs=21)), ["sampling.top_logprobs"]),
        (ask("q", sampling=common_pb2.SamplingParams(top_logprobs=3)), ["sampling.top_logprobs"]),
    ]
    for request, fields in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await mesh.stub.Generate(request, metadata=AUTH, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violations(caught.value) == fields


async def test_streamed_n_answers_come_by_index_with_their_logprobs(mesh: Mesh) -> None:
    sampling = common_pb2.SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    texts: dict[int, str] = {0: "", 1: ""}
    counted: dict[int, int] = {0: 0, 1: 0}
    final = None
    async for message in mesh.stub.GenerateStream(ask("Stream two.", n=2, sampling=sampling), metadata=AUTH):
        if message.HasField("final"):
            final = message.final
        else:
            texts[message.index] += message.delta
            counted[message.index] += len(message.logprobs)
            assert all(len(e.top) == 2 for e in message.logprobs)
    assert final is not None and [c.text for c in final.choices] == [texts[0], texts[1]]
    assert [len(c.logprobs) for c in final.choices] == [counted[0], counted[1]]


async def test_a_cancelled_n_stream_frees_every_row_and_its_weight(mesh: Mesh) -> None:
    engine = mesh.inference.app.manager.get().engine  # type: ignore[attr-defined]
    gateway = mesh.gateway.app.gateway  # type: ignore[attr-defined]
    sampling = common_pb2.SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)
    call = mesh.stub.GenerateStream(ask(f"Forever ({uuid.uuid4().hex[:6]})", n=3, sampling=sampling), metadata=AUTH)
    await call.read()  # the first delta: every stream has started
    await eventually(lambda: engine.running_count == 3, 20.0)
    model = gateway.routes[""].learned[1]
    assert gateway.window.in_flight(model) > 0
    call.cancel()
    await eventually(lambda: engine.running_count == 0 and gateway.window.in_flight(model) == 0, 20.0)


# ----- gRPC: log probabilities and the cache


async def test_logprobs_are_per_token_and_a_cached_answer_never_drops_them(mesh: Mesh) -> None:
    question = f"What is two plus two ({uuid.uuid4().hex[:6]})?"
    plain = await mesh.stub.Generate(ask(question), metadata=AUTH, timeout=60)
    assert not plain.logprobs
    await mesh.gateway.app.gateway.settle()  # type: ignore[attr-defined]
    assert (await mesh.stub.Generate(ask(question), metadata=AUTH, timeout=60)).cache.hit
    sampling = common_pb2.SamplingParams(max_new_tokens=8, logprobs=True, top_logprobs=3)
    scored = await mesh.stub.Generate(ask(question, sampling=sampling), metadata=AUTH, timeout=60)
    assert not scored.cache.hit and scored.text == plain.text  # greedy: the same answer, generated
    assert len(scored.logprobs) == scored.usage.output_tokens > 0
    assert "".join(e.token for e in scored.logprobs) == scored.text or all(e.bytes for e in scored.logprobs)
    for entry in scored.logprobs:
        assert entry.logprob <= 0 and len(entry.top) == 3
        assert entry.token_id == entry.top[0].token_id  # greedy: the likeliest
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
    await mesh.gateway.app.gateway.settle()  # type: ignore[attr-defined]
    again = await mesh.stub.Generate(ask(question, sampling=sampling), metadata=AUTH, timeout=60)
    assert not again.cache.hit and len(again.logprobs) == len(scored.logprobs)


# ----- gRPC: Embed


async def test_embed_returns_unit_vectors_with_usage_and_is_metered(mesh: Mesh) -> None:
    labels = {"tenant": "acme", "model": EMBEDDER}
    before = REGISTRY.get_sample_value("llmesh_gateway_tenant_input_tokens_total", labels) or 0.0
    found = await mesh.stub.Embed(
        gateway_pb2.EmbedRequest(inputs=["The cat sat on the mat.", "A dog barked."], model=EMBEDDER, tenant="acme"),
        metadata=(("authorization", f"Bearer {ACME_KEY}"),),
        timeout=60,
    )
    assert found.model == EMBEDDER and [e.index for e in found.embeddings] == [0, 1]
    for e in found.embeddings:
        assert len(e.values) == 384 and math.isclose(sum(x * x for x in e.values), 1.0, abs_tol=1e-3)
    assert found.usage.input_tokens > 10 and found.usage.output_tokens == 0
    after = REGISTRY.get_sample_value("llmesh_gateway_tenant_input_tokens_total", labels) or 0.0
    assert after == before + found.usage.input_tokens


async def test_embed_refuses_bad_input_naming_the_field(mesh: Mesh) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.Embed(gateway_pb2.EmbedRequest(inputs=["fine", ""]), metadata=AUTH, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violations(caught.value) == ["inputs[1]"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.Embed(gateway_pb2.EmbedRequest(inputs=[]), metadata=AUTH, timeout=30)
    assert violations(caught.value) == ["inputs"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.Embed(gateway_pb2.EmbedRequest(inputs=["a"], tenant="bad tenant"), metadata=AUTH, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violations(caught.value) == ["tenant"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.Embed(gateway_pb2.EmbedRequest(inputs=["a"], model="no-such"), metadata=AUTH, timeout=30)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.Embed(gateway_pb2.EmbedRequest(inputs=["a"]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.Embed(
            gateway_pb2.EmbedRequest(inputs=["a"], tenant="beta"),
            metadata=(("authorization", f"Bearer {ACME_KEY}"),),
            timeout=30,
        )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_key_limited_to_models_embeds_only_when_it_names_the_embedding_model(mesh: Mesh) -> None:
    request = gateway_pb2.EmbedRequest(inputs=["a"], tenant="acme")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.Embed(request, metadata=(("authorization", f"Bearer {mesh.chat_only_key}"),), timeout=30)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    found = await mesh.stub.Embed(request, metadata=(("authorization", f"Bearer {mesh.embed_only_key}"),), timeout=30)
    assert len(found.embeddings) == 1


# ----- HTTP, the official openai client


async def test_openai_client_n_2_returns_two_choices(client: openai.AsyncOpenAI) -> None:
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=8,
        extra_body=NO_RAG,
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.message.content for c in answer.choices)
    assert answer.choices[0].message.content != answer.choices[1].message.content
    assert answer.usage is not None and answer.usage.completion_tokens <= 16


async def test_openai_client_logprobs_with_3_alternatives(client: openai.AsyncOpenAI) -> None:
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to three."}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=8,
        extra_body=NO_RAG,
    )
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and answer.usage is not None and len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes is not None and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to three."}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=8,
        stream=True,
        extra_body=NO_RAG,
    )
    streamed = [e async for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content or ()]
    assert [e.token for e in streamed] == [e.token for e in content]


async def test_openai_client_streams_n_choices_by_index(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        n=2,
        temperature=1.0,
        seed=5,
        max_tokens=6,
        stream=True,
        extra_body=NO_RAG,
    )
    texts = {0: "", 1: ""}
    finished = set()
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] and texts[1]


async def test_legacy_completions_logprobs(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(
        model=MODEL, prompt="Say hello.", logprobs=2, max_tokens=6, extra_body=NO_RAG
    )
    lp = answer.choices[0].logprobs
    assert lp is not None and lp.tokens and len(lp.tokens) == len(lp.token_logprobs or [])
    assert all(len(top) == 2 for top in lp.top_logprobs or [])
    assert lp.text_offset == sorted(lp.text_offset or [])


async def test_openai_client_embeddings_are_unit_vectors_and_similar_texts_score_higher(
    client: openai.AsyncOpenAI,
) -> None:
    texts = ["How do I reset my password?", "I forgot my password, how can I change it?", "Bananas are yellow."]
    found = await client.embeddings.create(model=EMBEDDER, input=texts)  # the client asks for base64
    assert found.model == EMBEDDER and len(found.data) == 3
    vectors = [d.embedding for d in found.data]
    assert all(len(v) == 384 and math.isclose(cosine(v, v), 1.0, abs_tol=1e-3) for v in vectors)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
    assert found.usage.prompt_tokens == found.usage.total_tokens > 10
    one = await client.embeddings.create(model=EMBEDDER, input=texts[0], encoding_format="float")
    assert cosine(one.data[0].embedding, vectors[0]) > 0.999
    assert EMBEDDER in [m.id async for m in client.models.list()]


async def test_grpc_list_models_lists_the_embedding_model_last(mesh: Mesh) -> None:
    gateway = mesh.gateway.app.gateway  # type: ignore[attr-defined]
    assert await gateway.embedding_model(Deadline.after(10)) == EMBEDDER
    listed = await mesh.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=AUTH, timeout=30)
    assert [m.name for m in listed.models] == [MODEL, EMBEDDER]
    embedder = listed.models[-1]
    assert (embedder.default, embedder.available, embedder.key, list(embedder.alias_of)) == (False, True, "", [])
    assert listed.models[0].default and listed.models[0].key


async def test_http_models_lists_the_embedding_model_from_the_gateway(mesh: Mesh) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=mesh.http_base, headers=headers, timeout=60) as http:
        listed = await http.get("/models")
        assert listed.status_code == 200, listed.text
        assert [m["id"] for m in listed.json()["data"]] == [MODEL, EMBEDDER]
        one = await http.get(f"/models/{EMBEDDER}")
        assert one.status_code == 200 and one.json()["id"] == EMBEDDER


async def test_http_embeddings_errors_and_base64(mesh: Mesh) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=mesh.http_base, headers=headers, timeout=60) as http:
        raw = await http.post("/embeddings", json={"model": EMBEDDER, "input": "hi", "encoding_format": "base64"})
        assert raw.status_code == 200
        vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
        assert vector.shape == (384,) and abs(float(vector @ vector) - 1.0) < 1e-3
        cases = [
            ({"model": "no-such-model", "input": "hi"}, 404, None, "model_not_found"),
            ({"model": EMBEDDER, "input": [1, 2, 3]}, 400, "input", None),
            ({"model": EMBEDDER, "input": ["ok", ""]}, 400, "input", None),
            ({"model": EMBEDDER, "input": []}, 400, "input", None),
            ({"model": EMBEDDER, "input": "hi", "dimensions": 8}, 400, "dimensions", None),
        ]
        for body, status, param, code in cases:
            answer = await http.post("/embeddings", json=body)
            assert answer.status_code == status, (body, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param, (body, error)
            if code:
                assert error["code"] == code
        messages = [{"role": "user", "content": "a"}]
        chat = await http.post("/chat/completions", json={"model": EMBEDDER, "messages": messages})
        assert chat.status_code == 404  # the embedding model does not chat


async def test_http_n_past_16_and_top_logprobs_alone_are_400s(mesh: Mesh) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    messages = [{"role": "user", "content": "a"}]
    async with httpx.AsyncClient(base_url=mesh.http_base, headers=headers, timeout=60) as http:
        for body, param in (
            ({"n": 17}, "n"),
            ({"top_logprobs": 3}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ):
            answer = await http.post("/chat/completions", json={"model": MODEL, "messages": messages, **body})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
        legacy = await http.post("/completions", json={"model": MODEL, "prompt": "a", "logprobs": 21})
        assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "logprobs"
