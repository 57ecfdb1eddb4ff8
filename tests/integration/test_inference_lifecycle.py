"""Model lifecycle over gRPC: admin auth, refusing a tampered version, switching under load."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from llmesh.models import verify
from llmesh.server import ServiceHost
from llmesh.testing import build_tiny_model, eventually, hosted
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.servicer import InferenceApp

TOKEN = "test-admin-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    """A private models dir (the switch repoints `current`): tiny v1, v2 (other weights) and a
    tampered copy of v2 whose weights no longer match its manifest."""
    root = tmp_path_factory.mktemp("models")
    build_tiny_model(root, name="tiny", version="v1", seed=0)
    build_tiny_model(root, name="tiny", version="v2", seed=1)
    shutil.copytree(root / "tiny" / "v2", root / "tiny" / "v3-tampered")
    weights = root / "tiny" / "v3-tampered" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    return root


@pytest.fixture(scope="module")
async def host(versions: Path) -> AsyncIterator[ServiceHost]:
    env = {
        "LLMESH_INFERENCE_MODEL": "tiny",
        "LLMESH_MODELS_DIR": str(versions),
        "LLMESH_DEVICE": "cpu",
        "LLMESH_ADMIN_TOKEN": TOKEN,
        "LLMESH_MAX_BATCH_SIZE": "8",
    }
    async with hosted("inference", InferenceApp, env=env) as h:
        yield h


@pytest.fixture(scope="module")
async def stub(host: ServiceHost) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def request(text: str, n: int = 12) -> inference_pb2.InferenceRequest:
    return inference_pb2.InferenceRequest(
        text=text, sampling=common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True)
    )


async def generate(
    stub: inference_pb2_grpc.InferenceStub, text: str, n: int = 12
) -> tuple[list[int], inference_pb2.InferenceResponse]:
    messages = [m async for m in stub.Generate(request(text, n), timeout=30)]
    return [i for m in messages for i in m.token_ids], messages[-1]


@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", TOKEN),), grpc.StatusCode.UNAUTHENTICATED),  # not a Bearer header
    ],
)
async def test_load_model_needs_the_admin_token(
    stub: inference_pb2_grpc.InferenceStub, metadata: tuple[tuple[str, str], ...], code: grpc.StatusCode
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.LoadModel(inference_pb2.LoadModelRequest(version="v2"), metadata=metadata)
    assert info.value.code() == code
    assert (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())).version == "v1"


@pytest.mark.parametrize(
    ("version", "code"),
    [
        ("../tiny/v2", grpc.StatusCode.INVALID_ARGUMENT),
        ("current", grpc.StatusCode.INVALID_ARGUMENT),
        ("v9", grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_load_model_bad_versions(
    stub: inference_pb2_grpc.InferenceStub, version: str, code: grpc.StatusCode
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.LoadModel(inference_pb2.LoadModelRequest(version=version), metadata=AUTH)
    assert info.value.code() == code


async def test_tampered_version_is_refused_and_the_old_keeps_serving(
    stub: inference_pb2_grpc.InferenceStub, versions: Path
) -> None:
    before = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    tokens_before, _ = await generate(stub, "Hello")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.LoadModel(inference_pb2.LoadModelRequest(version="v3-tampered"), metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sha256 mismatch" in (info.value.details() or "")
    after = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert (after.version, after.sha256) == (before.version, before.sha256)
    assert os.readlink(versions / "tiny" / "current") == before.version
    assert (await generate(stub, "Hello"))[0] == tokens_before


async def test_switch_under_a_steady_stream_loses_no_request(
    stub: inference_pb2_grpc.InferenceStub, host: ServiceHost, versions: Path
) -> None:
    v1_tokens, _ = await generate(stub, "Hello")
    results: list[tuple[list[int], inference_pb2.InferenceResponse]] = []
    switched = asyncio.Event()
    flowing = asyncio.Event()  # every client has had an answer and asked again
    after_switch = 0
    n_clients = 4

    async def client(i: int) -> None:
        nonlocal after_switch
        while after_switch < 12:
            results.append(await generate(stub, "Hello" if i % 2 == 0 else f"Request {i}", 16))
            if len(results) >= n_clients:
                flowing.set()
            if switched.is_set():
                after_switch += 1

    clients = [asyncio.create_task(client(i)) for i in range(n_clients)]
    await asyncio.wait_for(flowing.wait(), 30)
    info = await stub.LoadModel(inference_pb2.LoadModelRequest(version="v2"), metadata=AUTH)
    switched.set()
    await asyncio.gather(*clients)

    v2 = verify(versions / "tiny" / "v2")
    assert (info.version, info.sha256, info.model_id) == ("v2", v2.digest, v2.model_id)
    assert all(last.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(tokens) == 16 for tokens, last in results)
    # Requests ran on both engines (batch ids carry the version), none failed.
    engines = {last.batch_id.split(".")[0] for _, last in results}
    assert engines == {"v1", "v2"}

    got = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert (got.version, got.sha256) == ("v2", v2.digest)
    assert os.readlink(versions / "tiny" / "current") == "v2"
    v2_tokens, last = await generate(stub, "Hello")
    assert last.batch_id.startswith("v2.") and v2_tokens != v1_tokens  # other weights answer now
    # The old engine drains and is released.
    manager = host.app.manager.get()  # type: ignore[attr-defined]
    await eventually(lambda: not manager.draining, 10.0, message="the old engine was never released")
