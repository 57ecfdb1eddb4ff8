"""The Batch API through the real gateway: tokenizer, tiny-model inference, the cache on real
Redis, the real retrieval service (MiniLM) for embedding lines, and the jobs in the state Redis
(an embedded valkey). Called with the official `openai` client (`files.create`, `batches.create`)
and over gRPC."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import redis

from llmesh.server import ServiceHost
from llmesh.testing import eventually, hosted
from llmesh.v1 import batches_pb2, batches_pb2_grpc
from services.cache.servicer import CacheApp
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.retrieval.servicer import RetrievalApp
from services.tokenizer.servicer import TokenizerApp

MODEL = "tiny-random-llama-0"
EMBEDDER = "all-MiniLM-L6-v2"
KEY = "test-key-batches-all-0123456789ab"
ACME_KEY = "test-key-batches-acme-0123456789"
NO_RAG = {"use_retrieval": False}


@pytest.fixture(scope="module")
async def backends(
    models_dir: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_redis_url: str
) -> AsyncIterator[dict[str, str]]:
    prefix = f"llmesh-batches:{uuid.uuid4().hex[:8]}:"
    env = {
        "LLMESH_MODELS_DIR": str(models_dir),
        "LLMESH_DATA_DIR": str(tmp_path_factory.mktemp("batches")),
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
                yield {
                    **env,
                    "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
                    "LLMESH_CACHE_TARGET": f"127.0.0.1:{cache.port}",
                    "LLMESH_RETRIEVAL_TARGET": f"127.0.0.1:{rag.port}",
                    "LLMESH_API_KEYS": f"{KEY}=*;{ACME_KEY}=acme",
                    # The jobs' store (the admission window stays per process, as on `llmesh up`).
                    "LLMESH_STATE_REDIS_URL": module_redis_url,
                }
    finally:
        client = redis.Redis.from_url(module_redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="module")
async def gateway(backends: dict[str, str]) -> AsyncIterator[ServiceHost]:
    async with hosted("gateway", GatewayApp, backends) as gw:
        yield gw


def base_url(gw: ServiceHost) -> str:
    return f"http://127.0.0.1:{gw.app.http.port}/v1"  # type: ignore[attr-defined]


def client_of(gw: ServiceHost, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(gw), api_key=key, max_retries=0, timeout=60)


def chat_line(custom_id: str, text: str, max_tokens: int = 6, use_cache: bool = True) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "llmesh": {**NO_RAG, "use_cache": use_cache},
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion_line(custom_id: str, text: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": text, "max_tokens": 6, "llmesh": NO_RAG}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def embedding_line(custom_id: str, text: str) -> dict[str, Any]:
    body = {"model": EMBEDDER, "input": text, "encoding_format": "float"}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


async def submit(client: openai.AsyncOpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions") -> Any:
    uploaded = await client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    return await client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata={"job": "test"},
    )


async def ended(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 240.0) -> Any:
    async def check() -> Any:
        found = await client.batches.retrieve(batch_id)
        return found if found.status in ("completed", "cancelled", "failed", "expired") else None

    return await eventually(check, timeout=timeout, interval=0.2)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


async def test_mixed_batch_of_50_lines_completes_with_every_custom_id(gateway: ServiceHost) -> None:
    lines: list[dict[str, Any]] = []
    for i in range(50):
        kind = i % 3
        text = f"Say something about the number {i}."
        make = chat_line if kind == 0 else completion_line if kind == 1 else embedding_line
        lines.append(make(f"req-{i}", text))
    async with client_of(gateway) as client:
        batch = await submit(client, lines)
        assert batch.object == "batch" and batch.status in ("validating", "in_progress")
        assert batch.request_counts is not None and batch.request_counts.total == 50
        assert batch.metadata == {"job": "test"} and batch.completion_window == "24h"
        done = await ended(client, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (50, 0)
        assert done.error_file_id is None and done.completed_at and done.in_progress_at
        output = await lines_of(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(50))
        by_id = {o["custom_id"]: o for o in output}
        for i in range(50):
            line = by_id[f"req-{i}"]
            assert line["error"] is None and line["response"]["status_code"] == 200
            assert line["id"].startswith("batch_req-") and line["response"]["request_id"] == line["id"]
            body = line["response"]["body"]
            expected = ("chat.completion", "text_completion", "list")[i % 3]
            assert body["object"] == expected, body
            if i % 3 == 2:
                assert len(body["data"][0]["embedding"]) == 384
            else:
                assert body["usage"]["prompt_tokens"] > 0
        output_file = await client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
        assert output_file.purpose == "batch_output"
        listed = await client.batches.list(limit=100)
        assert done.id in [b.id for b in listed.data]


async def test_malformed_lines_go_to_the_error_file_and_the_others_complete(gateway: ServiceHost) -> None:
    lines: list[Any] = [chat_line(f"ok-{i}", f"Count to {i}.") for i in range(4)]
    lines.insert(1, "{this is not json")
    lines.insert(3, {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"})
    bad_field = chat_line("bad-field", "hello")
    bad_field["body"]["temperature"] = "hot"
    lines.append(bad_field)
    async with client_of(gateway) as client:
        batch = await submit(client, lines)
        done = await ended(client, batch.id)
        assert done.status == "completed"
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 4, 3)
        output = await lines_of(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in output) == [f"ok-{i}" for i in range(4)]
        errors = await lines_of(client, done.error_file_id)
        assert len(errors) == 3
        by_id = {e["custom_id"]: e for e in errors}
        assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["error"]["line"] == 2
        assert by_id["no-body"]["error"]["code"] == "invalid_request"
        # A line the endpoint itself refuses carries the endpoint's own answer, as OpenAI's does.
        refused = by_id["bad-field"]["response"]
        assert refused["status_code"] == 400 and refused["body"]["error"]["type"] == "invalid_request_error"
        assert "temperature" in refused["body"]["error"]["message"]


def own_store(backends: dict[str, str], redis_url: str, **settings: str) -> dict[str, str]:
    """A gateway's settings with a state Redis of the test's own: the module's gateway, which works
    on every job of its store as any replica does, takes no part."""
    return {**backends, "LLMESH_STATE_REDIS_URL": redis_url, **settings}


async def test_cancel_stops_the_remaining_lines(backends: dict[str, str], redis_url: str) -> None:
    env = own_store(backends, redis_url, LLMESH_BATCH_CONCURRENCY="1")
    async with hosted("gateway", GatewayApp, env) as gw, client_of(gw) as client:
        lines = [chat_line(f"c-{i}", f"Write a long story number {i}.", 32, use_cache=False) for i in range(300)]
        batch = await submit(client, lines)

        async def some_done() -> bool:
            found = await client.batches.retrieve(batch.id)
            return found.request_counts is not None and found.request_counts.completed >= 2

        await eventually(some_done, timeout=120, interval=0.1)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = await ended(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        assert done.request_counts is not None
        assert 2 <= done.request_counts.completed < 300
        output = await lines_of(client, done.output_file_id)
        assert len(output) == done.request_counts.completed
        # Nothing runs after the cancel took effect.
        assert not gw.app.batch_runner.running  # type: ignore[attr-defined]


async def test_a_gateway_killed_mid_batch_and_started_again_runs_every_line_once(
    backends: dict[str, str], redis_url: str
) -> None:
    # Short leases: the lines the dead gateway held are claimed again soon after.
    env = own_store(backends, redis_url, LLMESH_BATCH_CONCURRENCY="4", LLMESH_BATCH_LEASE_SECONDS="2")
    total = 40
    lines = [chat_line(f"k-{i}", f"Tell me about rivers, part {i}.", 16, use_cache=False) for i in range(total)]
    async with hosted("gateway", GatewayApp, env) as first, client_of(first) as client:
        batch = await submit(client, lines)
        runner = first.app.batch_runner  # type: ignore[attr-defined]

        async def midway() -> bool:
            found = await client.batches.retrieve(batch.id)
            # Lines in flight when it dies.
            return found.request_counts is not None and found.request_counts.completed >= 3 and bool(runner.running)

        await eventually(midway, timeout=120, interval=0.05)
        held = len(runner.running)
        # As a crash: the lines running are dropped and their claims are left to expire.
        await asyncio.wait_for(runner.stop(release=False), 60)
    assert held > 0
    async with hosted("gateway", GatewayApp, env) as second, client_of(second) as client:
        done = await ended(client, batch.id)
        assert done.status == "completed"
        assert done.request_counts is not None and done.request_counts.completed == total
        output = await lines_of(client, done.output_file_id)
        ids = [o["custom_id"] for o in output]
        assert len(ids) == total and sorted(set(ids)) == sorted(f"k-{i}" for i in range(total))


async def test_another_tenants_key_cannot_read_the_batch_or_its_files(gateway: ServiceHost) -> None:
    async with client_of(gateway) as owner, client_of(gateway, ACME_KEY) as other:
        batch = await submit(owner, [chat_line("t-1", "Hello there.")])
        done = await ended(owner, batch.id)
        assert done.output_file_id
        for call in (
            other.batches.retrieve(batch.id),
            other.batches.cancel(batch.id),
            other.files.retrieve(batch.input_file_id),
            other.files.content(batch.input_file_id),
            other.files.content(done.output_file_id),
            other.files.delete(done.output_file_id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        assert batch.id not in [b.id for b in (await other.batches.list()).data]
        with pytest.raises(openai.NotFoundError):  # another tenant's file cannot start a job either
            await other.batches.create(
                input_file_id=batch.input_file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        # The owner still reads them all.
        assert (await owner.files.content(done.output_file_id)).text


async def test_limits_and_bad_requests_answer_in_openais_error_shape(backends: dict[str, str], redis_url: str) -> None:
    limits = {"LLMESH_BATCH_MAX_LINES": "3", "LLMESH_BATCH_MAX_IN_FLIGHT": "1", "LLMESH_BATCH_CONCURRENCY": "1"}
    env = own_store(backends, redis_url, **limits)
    async with hosted("gateway", GatewayApp, env) as gw, client_of(gw, ACME_KEY) as client:
        with pytest.raises(openai.BadRequestError, match="more than 3 lines"):
            await client.files.create(
                file=("x.jsonl", io.BytesIO(jsonl([chat_line(f"l-{i}", "hi") for i in range(4)]))), purpose="batch"
            )
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client.files.create(file=("x.jsonl", io.BytesIO(jsonl([chat_line("a", "hi")]))), purpose="fine-tune")
        uploaded = await client.files.create(
            file=("x.jsonl", io.BytesIO(jsonl([chat_line("a", "hi")]))), purpose="batch"
        )
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await client.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/chat/completions",
                completion_window="1h",  # type: ignore[arg-type]
            )
        slow = [chat_line(f"s-{i}", f"Story {i}.", 32, use_cache=False) for i in range(3)]
        first = await submit(client, slow)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert refused.value.response.headers["retry-after"]
        await client.batches.cancel(first.id)
        await ended(client, first.id)
        # Deleted files are gone.
        deleted = await client.files.delete(uploaded.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(uploaded.id)


async def test_without_a_state_redis_the_batch_api_answers_503_naming_the_setting(
    backends: dict[str, str],
) -> None:
    env = {k: v for k, v in backends.items() if k != "LLMESH_STATE_REDIS_URL"}
    async with hosted("gateway", GatewayApp, env) as gw, client_of(gw) as client:
        with pytest.raises(openai.InternalServerError, match="LLMESH_STATE_REDIS_URL") as refused:
            await client.files.create(file=("x.jsonl", io.BytesIO(jsonl([chat_line("a", "hi")]))), purpose="batch")
        assert refused.value.status_code == 503


async def test_the_same_calls_on_grpc(gateway: ServiceHost) -> None:
    auth = (("authorization", f"Bearer {ACME_KEY}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = batches_pb2_grpc.BatchesStub(channel)
        uploaded = await stub.CreateFile(
            batches_pb2.CreateFileRequest(
                filename="in.jsonl", purpose="batch", content=jsonl([chat_line("g-1", "Hi"), chat_line("g-2", "Yo")])
            ),
            metadata=auth,
        )
        batch = await stub.CreateBatch(
            batches_pb2.CreateBatchRequest(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
            metadata=auth,
        )
        assert batch.request_counts.total == 2 and batch.created_at > 0

        async def completed() -> batches_pb2.Batch | None:
            found = await stub.GetBatch(batches_pb2.BatchRequest(batch_id=batch.id), metadata=auth)
            return found if found.status == "completed" else None

        done = await eventually(completed, timeout=120, interval=0.2)
        content = await stub.GetFileContent(batches_pb2.FileRequest(file_id=done.output_file_id), metadata=auth)
        assert sorted(json.loads(line)["custom_id"] for line in content.content.splitlines()) == ["g-1", "g-2"]
        listed = await stub.ListBatches(batches_pb2.ListBatchesRequest(limit=1), metadata=auth)
        assert [b.id for b in listed.data] == [batch.id] or listed.has_more
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetBatch(
                batches_pb2.BatchRequest(batch_id=batch.id), metadata=(("authorization", f"Bearer {KEY}"),)
            )
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as unauthenticated:
            await stub.GetBatch(batches_pb2.BatchRequest(batch_id=batch.id))
        assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_cli_submits_follows_and_reads_a_batch(
    gateway: ServiceHost, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmesh import cli

    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl([chat_line("cli-1", "Hi there."), completion_line("cli-2", "Once upon")]))
    common = ["--target", f"127.0.0.1:{gateway.port}", "--api-key", ACME_KEY, "--json"]
    # The CLI blocks on its calls: it runs beside the gateway's event loop, as a separate process would.
    code = await asyncio.to_thread(cli.main, ["batch", "submit", str(source), "--wait", "--every", "0.1", *common])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    submitted = json.loads(captured.out)
    assert submitted["status"] == "completed" and submitted["request_counts"]["completed"] == "2"
    assert "[##############################] 2/2 completed" in captured.err  # the progress bar, done
    out = tmp_path / "out.jsonl"
    code = await asyncio.to_thread(cli.main, ["batch", "results", submitted["id"], "-o", str(out), *common])
    assert code == 0
    assert sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines()) == ["cli-1", "cli-2"]
    code = await asyncio.to_thread(cli.main, ["batch", "status", "batch-missing", *common])
    assert code == 3 and json.loads(capsys.readouterr().out)["error"] == "NOT_FOUND"


async def test_each_line_is_a_trace_of_its_own_linked_to_the_batch_and_counted(
    gateway: ServiceHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import DEFAULT_ON
    from prometheus_client import REGISTRY

    from llmesh.spans import LeanTracerProvider
    from services.gateway.batches import runner

    provider = LeanTracerProvider(resource=Resource.create({"service.name": "unit"}), sampler=DEFAULT_ON)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(runner, "tracer", provider.get_tracer("llmesh.gateway.batch"))
    ok_before = REGISTRY.get_sample_value("llmesh_gateway_batch_lines_total", {"outcome": "ok"}) or 0.0
    trace_id = uuid.uuid4().hex
    async with client_of(gateway) as client:
        uploaded = await client.files.create(
            file=("in.jsonl", io.BytesIO(jsonl([chat_line("s-1", "One."), chat_line("s-2", "Two.")]))),
            purpose="batch",
        )
        batch = await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"},
        )
        assert (await ended(client, batch.id)).status == "completed"
    provider.force_flush()
    lines = [s for s in exporter.get_finished_spans() if s.name == "batch line"]
    assert sorted(s.attributes["llmesh.batch.custom_id"] for s in lines) == ["s-1", "s-2"]  # type: ignore[index]
    for span in lines:
        assert span.attributes["llmesh.batch.id"] == batch.id  # type: ignore[index]
        assert span.context.trace_id != int(trace_id, 16)  # a trace of its own...
        assert trace_id in [format(link.context.trace_id, "032x") for link in span.links]  # ...linked to the job's
    assert REGISTRY.get_sample_value("llmesh_gateway_batch_lines_total", {"outcome": "ok"}) == ok_before + 2
    provider.shutdown()
