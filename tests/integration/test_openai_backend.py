"""The inference service on LLMESH_INFERENCE_BACKEND=openai against a real vLLM (CPU build)
serving SmolLM2, and the gateway on top of it: streaming, cancellation, deadlines, rejected
parameters, health, a mismatched tokenizer, a replica failing before the first token (retried on
vLLM), a killed and a restarted backend.

vLLM starts once per session (the `vllm` fixture, about two minutes on two cores); the test that
kills and restarts it runs last."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmesh import errors, telemetry
from llmesh.models import verify
from llmesh.server import ServiceHost
from llmesh.testing import REPO_ROOT, VLLM_MODEL_NAME, OtlpReceiver, VllmServer, eventually, hosted, service_settings
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, inference_pb2, inference_pb2_grpc
from services.gateway.servicer import GatewayApp
from services.inference import metrics
from services.inference.engine import FINISH_LENGTH
from services.inference.engine.decoding import SamplingParams
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
LONG = 1500  # new tokens: half a minute or more of generation on this machine
CLOSED = "127.0.0.1:1"


def backend_env(vllm: VllmServer, models_dir: Path, **extra: str) -> dict[str, str]:
    return {
        "LLMESH_INFERENCE_BACKEND": "openai",
        "LLMESH_BACKEND_URLS": vllm.base_url,
        "LLMESH_BACKEND_MODEL": VLLM_MODEL_NAME,
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_INFERENCE_MODEL": "smollm2",
        "LLMESH_MAX_NEW_TOKENS": "1800",
        "LLMESH_BACKEND_HEALTH_INTERVAL_SECONDS": "0.5",
        **extra,
    }


@pytest.fixture(scope="module")
async def inference(vllm: VllmServer, models_dir: Path) -> AsyncIterator[ServiceHost]:
    async with hosted("inference", InferenceApp, backend_env(vllm, models_dir)) as host:
        yield host


@pytest.fixture(scope="module")
async def channel(inference: ServiceHost) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{inference.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.aio.Channel) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(channel)


def backend_of(host: ServiceHost) -> OpenAIBackend:
    backend = host.app.manager.get()  # type: ignore[attr-defined]
    assert isinstance(backend, OpenAIBackend)
    return backend


def request(max_new_tokens: int, **sampling: object) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        text=PROMPT, sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    )


async def running_in_vllm(vllm: VllmServer) -> float:
    return await asyncio.to_thread(vllm.running_requests)


async def health_of(channel: grpc.aio.Channel) -> int:
    answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(answer.status)


async def test_streams_the_backends_answer_in_pieces(
    stub: inference_pb2_grpc.InferenceStub, inference: ServiceHost, vllm: VllmServer
) -> None:
    messages = [m async for m in stub.Generate(request(24, ignore_eos=True), timeout=120)]
    pieces = [m.text for m in messages if m.text]
    assert len(pieces) >= 5, "the answer must arrive as it is generated, not in one piece"
    last = messages[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.output_tokens == 24
    assert last.usage.input_tokens == len(backend_of(inference).encoder.encode(PROMPT))
    # The same answer vLLM gives its own clients for the same prompt (greedy decoding).
    async with httpx.AsyncClient() as client:
        direct = await client.post(
            f"{vllm.base_url}/completions",
            json={"model": VLLM_MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
    assert "".join(pieces) == direct.json()["choices"][0]["text"]


async def test_response_formats_pass_through_to_vllms_structured_output(stub: inference_pb2_grpc.InferenceStub) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    forms = {
        "json_schema": common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(schema)),
        "choice": common_pb2.ResponseFormat(type="choice", choices=["yes", "no"]),
        "regex": common_pb2.ResponseFormat(type="regex", regex="[0-9]{3}"),
    }
    answers = {}
    for kind, form in forms.items():
        message = request(48)
        message.response_format.CopyFrom(form)
        answers[kind] = "".join([m.text async for m in stub.Generate(message, timeout=120)])
    assert isinstance(json.loads(answers["json_schema"])["city"], str)
    assert answers["choice"] in ("yes", "no")
    assert len(answers["regex"]) == 3 and answers["regex"].isdigit()


async def test_usage_and_genai_span_come_from_the_backends_counts_and_vllm_continues_the_trace(
    stub: inference_pb2_grpc.InferenceStub, vllm: VllmServer
) -> None:
    exporter = InMemorySpanExporter()
    telemetry.setup_tracing("inference").add_span_processor(SimpleSpanProcessor(exporter))
    messages = [m async for m in stub.Generate(request(6, stop=["Paris"]), timeout=120)]

    async def ended() -> bool:  # the span ends once the handler returns, just after the last message
        return any(s.name == "inference.generate" for s in exporter.get_finished_spans())

    await eventually(ended, 5, interval=0.2, message="the inference span ended")
    spans = [s for s in exporter.get_finished_spans() if s.name == "inference.generate"]
    assert len(spans) == 1
    attributes = dict(spans[0].attributes or {})
    assert attributes["gen_ai.request.model"] == VLLM_MODEL_NAME
    assert attributes["gen_ai.usage.input_tokens"] == messages[-1].usage.input_tokens
    assert attributes["gen_ai.usage.output_tokens"] == messages[-1].usage.output_tokens > 0
    assert str(attributes["llmesh.inference.backend"]).startswith("vllm")
    # The traceparent went to vLLM in the HTTP headers: its own request span joins our trace.
    trace_id = format(spans[0].context.trace_id, "032x")
    traces: OtlpReceiver = vllm.traces  # type: ignore[attr-defined]

    async def continued() -> bool:
        return bool(traces.trace(trace_id))

    await eventually(continued, 30, interval=0.2, message="vLLM exported a span in our trace")
    ours = format(spans[0].context.span_id, "016x")
    assert any(s["parent_span_id"] == ours for s in traces.trace(trace_id)), traces.trace(trace_id)


async def test_model_info_names_the_backend_model_and_our_tokenizer(
    stub: inference_pb2_grpc.InferenceStub, channel: grpc.aio.Channel, models_dir: Path
) -> None:
    info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
    ours = verify((models_dir / "smollm2" / "current").resolve()).manifest["files"]["tokenizer.json"]
    assert info.model_id == VLLM_MODEL_NAME
    assert info.sha256 == ours
    assert info.version.startswith("vllm")
    assert info.max_context_tokens == 2048  # vLLM's --max-model-len, as /v1/models reports it
    assert await health_of(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_cancel_frees_the_backend_sequence(
    stub: inference_pb2_grpc.InferenceStub, inference: ServiceHost, vllm: VllmServer
) -> None:
    call = stub.Generate(request(LONG, ignore_eos=True), timeout=300)
    first = await call.read()
    assert isinstance(first, inference_pb2.InferenceResponse) and first.text

    async def generating() -> bool:
        return await running_in_vllm(vllm) >= 1

    await eventually(generating, 10, interval=0.2, message="vLLM reports the sequence running")

    async def reported() -> bool:  # the load scrape reads it too, on vLLM's filtered /metrics/
        load = backend_of(inference).load()
        return load is not None and load.running >= 1 and load.kv_blocks_total > 0

    await eventually(reported, 5, interval=0.2, message="the backend's load shows the sequence")
    assert backend_of(inference).replicas[0].metrics_path.startswith("/metrics/?name[]=")
    call.cancel()

    async def freed() -> bool:
        return await running_in_vllm(vllm) == 0 and backend_of(inference).replicas[0].in_flight == 0

    # LONG tokens take half a minute and more: only an abort frees the sequence this soon.
    await eventually(freed, 5, interval=0.2, message="vLLM freed the cancelled sequence")


async def test_deadline_shorter_than_the_generation(
    stub: inference_pb2_grpc.InferenceStub, inference: ServiceHost, vllm: VllmServer
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as expired:
        async for _ in stub.Generate(request(LONG, ignore_eos=True), timeout=2.0):
            pass
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def closed() -> bool:
        return backend_of(inference).replicas[0].in_flight == 0 and await running_in_vllm(vllm) == 0

    await eventually(closed, 5, interval=0.2, message="the HTTP stream closed and vLLM freed the sequence")


async def test_a_parameter_the_backend_rejects_is_invalid_argument_naming_it(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    # Our proto allows any uint64 seed; vLLM takes a signed 64-bit one and answers 400.
    with pytest.raises(grpc.aio.AioRpcError) as rejected:
        async for _ in stub.Generate(request(4, seed=2**64 - 1, temperature=0.7), timeout=60):
            pass
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = errors.unpack_details(errors.status_details(rejected.value.trailing_metadata()))
    fields = [v.field for v in details["bad_request"].field_violations]  # type: ignore[attr-defined]
    assert fields == ["sampling.seed"]


async def test_logprobs_come_back_per_token_from_vllm(
    stub: inference_pb2_grpc.InferenceStub, inference: ServiceHost, vllm: VllmServer
) -> None:
    asked = request(8, ignore_eos=True, logprobs=True, top_logprobs=3)
    messages = [m async for m in stub.Generate(asked, timeout=120)]
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    entries = [e for m in messages for e in m.logprobs]
    ids = [i for m in messages for i in m.token_ids]
    assert len(entries) == 8 and [e.token_id for e in entries] == ids
    text = "".join(m.text for m in messages)
    tokenizer = backend_of(inference).tokenizer
    assert tokenizer.tokenizer.decode(ids) == text  # the text skips special tokens (ignore_eos: EOS)
    assert b"".join(e.bytes for e in entries).decode() == tokenizer.decode(ids)
    for entry in entries:
        assert len(entry.top) == 3
        values = [t.logprob for t in entry.top]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the likeliest (vLLM orders tokens that tie as its topk does).
        assert entry.top[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.token_id in {t.token_id for t in entry.top if t.logprob == entry.top[0].logprob}
    # The same values vLLM gives its own clients.
    async with httpx.AsyncClient() as client:
        direct = await client.post(
            f"{vllm.base_url}/completions",
            json={
                "model": VLLM_MODEL_NAME,
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
            },
            timeout=120,
        )
    theirs = direct.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert [e.logprob for e in entries] == pytest.approx(theirs, abs=1e-3)
    with pytest.raises(grpc.aio.AioRpcError) as rejected:
        async for _ in stub.Generate(request(4, logprobs=True, top_logprobs=21), timeout=60):
            pass
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_vllms_fields_and_prompt_scores_come_through_the_backend(
    stub: inference_pb2_grpc.InferenceStub, inference: ServiceHost, vllm: VllmServer
) -> None:
    # The prompt read and scored, nothing generated: vLLM's own prompt_logprobs, token for token.
    scored = [m async for m in stub.Generate(request(1, prompt_only=True, prompt_logprobs=1), timeout=120)]
    entries = [e for m in scored for e in m.prompt_logprobs]
    ids = backend_of(inference).tokenizer.encode(PROMPT)
    assert [e.token_id for e in entries] == ids and entries[0].logprob == 0.0
    assert scored[-1].usage.output_tokens == 0 and not any(m.token_ids for m in scored)
    async with httpx.AsyncClient() as client:
        direct = await client.post(
            f"{vllm.base_url}/completions",
            json={"model": VLLM_MODEL_NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1},
            timeout=120,
        )
    theirs = direct.json()["choices"][0]["prompt_logprobs"]
    assert [e.logprob for e in entries[1:]] == pytest.approx(
        [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], theirs[1:], strict=True)], abs=1e-3
    )
    # ignore_eos and min_tokens reach vLLM: the answer runs to max_new_tokens past its EOS.
    held = [m async for m in stub.Generate(request(24, min_new_tokens=24), timeout=120)]
    assert held[-1].usage.output_tokens == 24


async def test_a_mismatched_tokenizer_is_refused_at_start(vllm: VllmServer, models_dir: Path) -> None:
    env = backend_env(vllm, models_dir, LLMESH_INFERENCE_MODEL="minilm")  # a BERT WordPiece tokenizer
    app = InferenceApp(service_settings("inference", env))
    with pytest.raises(errors.FailedPrecondition) as refused:
        await app.start()
    assert refused.value.reason == "TOKENIZER_MISMATCH"
    assert not app.manager.ready
    # As a process: the service stops with the message instead of serving.
    child = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.inference"],
        env={**os.environ, **env, "LLMESH_LISTEN": "127.0.0.1:0", "LLMESH_METRICS_PORT": "0"},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert child.returncode != 0
    assert "different tokenizers" in child.stderr


async def test_openai_client_n_and_logprobs_through_the_gateway_on_vllm(
    inference: ServiceHost, models_dir: Path
) -> None:
    """n=2 (two backend requests, seeds offset) and logprobs (forwarded to vLLM) with the official
    openai client against the gateway's HTTP API on the openai backend."""
    import openai

    env = {"LLMESH_MODELS_DIR": str(models_dir)}
    async with hosted("tokenizer", TokenizerApp, env) as tok:
        gateway_env = {
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inference.port}",
            "LLMESH_CACHE_TARGET": CLOSED,
            "LLMESH_RETRIEVAL_TARGET": CLOSED,
        }
        async with hosted("gateway", GatewayApp, gateway_env) as gw:
            base = f"http://127.0.0.1:{gw.app.http.port}/v1"  # type: ignore[attr-defined]
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as client:
                listed = [m.id async for m in client.models.list()]
                model = listed[0]
                messages = [{"role": "user", "content": "Name a colour."}]
                two = await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    n=2,
                    temperature=1.0,
                    seed=1,
                    max_tokens=12,  # type: ignore[arg-type]
                )
                assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)
                assert two.choices[0].message.content != two.choices[1].message.content
                scored = await client.chat.completions.create(
                    model=model,
                    messages=messages,
                    logprobs=True,
                    top_logprobs=3,
                    max_tokens=8,  # type: ignore[arg-type]
                )
                content = scored.choices[0].logprobs.content  # type: ignore[union-attr]
                assert content and scored.usage is not None and len(content) == scored.usage.completion_tokens
                # Every token generated, the end-of-turn token vLLM stops on included.
                assert "".join(e.token for e in content).startswith(scored.choices[0].message.content or "-")
                for entry in content:
                    assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
                    assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest


class FailingReplica:
    """A second "replica" on a loopback port: it lists the model on /models (so the backend counts
    it healthy) and fails every /completions before any token, with a 503 as an overloaded vLLM
    answers, or by dropping the connection once the headers are out (a server that died)."""

    def __init__(self) -> None:
        self.mode = "503"
        self.failed = 0
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}/v1"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": VLLM_MODEL_NAME, "object": "model", "owned_by": "vllm", "max_model_len": 2048}
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.failed += 1
        if self.mode == "503":
            error = {"object": "error", "message": "engine overloaded", "type": "ServiceUnavailable", "code": 503}
            return web.json_response(error, status=503)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        assert request.transport is not None
        request.transport.close()
        return response


async def test_a_replica_failing_before_the_first_token_is_retried_on_vllm(vllm: VllmServer, models_dir: Path) -> None:
    """Topology b: one backend in front of two replicas, the first of which fails every request
    before its first token; every request is answered in full by vLLM, the other replica."""
    failing = FailingReplica()
    url = await failing.start()
    config = BackendConfig(urls=(url, vllm.base_url), model=VLLM_MODEL_NAME)
    backend = OpenAIBackend(config, LocalTokenizer.load(models_dir, "smollm2"))
    try:
        assert await backend.check_health()
        broken, real = backend.replicas
        assert broken.healthy and real.healthy, "both list the model"
        prompt = backend.encoder.encode(PROMPT)
        counted = {reason: metrics.BACKEND_RETRIES.labels(reason)._value.get() for reason in metrics.RETRY_REASONS}
        texts = []
        for mode in ("503", "drop", "503", "drop"):
            failing.mode = mode
            # With none in flight the turn decides among equals: it starts at the failing replica.
            backend._turn = itertools.count()
            events = [e async for e in backend.submit(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))]
            assert events[-1].finish_reason == FINISH_LENGTH and events[-1].output_tokens == 6
            texts.append("".join(e.text for e in events))
        assert failing.failed == 4, "every request went to the failing replica first"
        assert backend.budget.retries == 4
        assert texts[0] and len(set(texts)) == 1, "greedy: vLLM's same answer each time"
        assert metrics.BACKEND_RETRIES.labels("unavailable")._value.get() == counted["unavailable"] + 2
        assert metrics.BACKEND_RETRIES.labels("stream_broken")._value.get() == counted["stream_broken"] + 2
        assert (broken.in_flight, real.in_flight) == (0, 0)
    finally:
        await backend.close()
        await failing.stop()


async def test_consecutive_streams_reuse_one_connection(
    vllm: VllmServer, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream read to the end of its body ([DONE], then the chunked encoding's end) gives its
    connection back to the pool: the next request opens none (before, each opened its own)."""
    import httpcore

    opened: list[object] = []
    create = httpcore.AsyncConnectionPool.create_connection

    def counting(self: httpcore.AsyncConnectionPool, origin: httpcore.Origin) -> object:
        opened.append(origin)
        return create(self, origin)

    monkeypatch.setattr(httpcore.AsyncConnectionPool, "create_connection", counting)
    backend = OpenAIBackend(
        BackendConfig(urls=(vllm.base_url,), model=VLLM_MODEL_NAME), LocalTokenizer.load(models_dir, "smollm2")
    )
    try:
        assert await backend.check_health()  # /models: the first connection
        prompt = backend.encoder.encode(PROMPT)
        for _ in range(3):
            events = [e async for e in backend.submit(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))]
            assert events[-1].finish_reason == FINISH_LENGTH
        assert len(opened) == 1
    finally:
        await backend.close()


async def test_gateway_on_the_openai_backend_then_backend_killed_and_restarted(
    inference: ServiceHost, channel: grpc.aio.Channel, vllm: VllmServer, models_dir: Path
) -> None:
    env = {"LLMESH_MODELS_DIR": str(models_dir)}
    async with hosted("tokenizer", TokenizerApp, env) as tok:
        gateway_env = {
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inference.port}",
            "LLMESH_CACHE_TARGET": CLOSED,
            "LLMESH_RETRIEVAL_TARGET": CLOSED,
            "LLMESH_BREAKER_WINDOW": "3",
            "LLMESH_BREAKER_MINIMUM_CALLS": "3",
            "LLMESH_BREAKER_WAIT_SECONDS": "2",
            "LLMESH_MAX_NEW_TOKENS": "1800",
        }
        async with (
            hosted("gateway", GatewayApp, gateway_env) as gw,
            grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as gw_channel,
        ):
            gateway = gateway_pb2_grpc.GatewayStub(gw_channel)

            def ask(max_new_tokens: int) -> gateway_pb2.GenerateRequest:
                return gateway_pb2.GenerateRequest(
                    prompt="What is the capital of France?",
                    sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                )

            # A whole request through the mesh on vLLM.
            reply = await gateway.Generate(ask(12), timeout=120)
            assert reply.text and reply.usage.output_tokens == 12
            assert reply.model.startswith(VLLM_MODEL_NAME)

            # vLLM killed mid-stream: the caller gets UNAVAILABLE, not a hang or a cut answer.
            stream = gateway.GenerateStream(ask(LONG), timeout=120)
            async for event in stream:
                if event.WhichOneof("event") == "delta":
                    break
            vllm.kill()
            with pytest.raises(grpc.aio.AioRpcError) as broken:
                async for _ in stream:
                    pass
            assert broken.value.code() == grpc.StatusCode.UNAVAILABLE

            async def not_serving() -> bool:
                return await health_of(channel) == health_pb2.HealthCheckResponse.NOT_SERVING

            await eventually(not_serving, 10, interval=0.2, message="inference NOT_SERVING once vLLM is gone")
            breaker = gw.app.peers.breakers["inference"]  # type: ignore[attr-defined]
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as down:
                    await gateway.Generate(ask(4), timeout=30)
                assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            assert breaker.state.value == "open"

            # Restarted on the same port: SERVING again, and the gateway answers once more.
            vllm.start()
            await asyncio.to_thread(vllm.wait_ready)

            async def serving() -> bool:
                return await health_of(channel) == health_pb2.HealthCheckResponse.SERVING

            await eventually(serving, 15, interval=0.2, message="inference SERVING again after vLLM restarted")

            async def answers() -> bool:
                try:
                    again = await gateway.Generate(ask(4), timeout=60)
                except grpc.aio.AioRpcError:
                    return False
                return again.usage.output_tokens == 4

            await eventually(answers, 30, interval=0.2, message="the gateway answers through the restarted backend")
