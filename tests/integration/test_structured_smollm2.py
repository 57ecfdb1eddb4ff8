"""On SmolLM2 through the mesh (tokenizer, the builtin engine, gateway): every json_schema and
json_object reply parses and validates, over the schemas of bench/schemas.py, at max_tokens 48
(a schema whose shortest answer needs more than that is refused up front, never answered)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import jsonschema

from bench.schemas import SCHEMAS
from llmesh.testing import hosted
from llmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.servicer import GatewayApp
from services.inference.servicer import InferenceApp
from services.tokenizer.servicer import TokenizerApp

CLOSED = "127.0.0.1:1"
BUDGET = 48


def ask(question: str, form: common_pb2.ResponseFormat) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=question,
        use_cache=False,
        use_retrieval=False,
        sampling=common_pb2.SamplingParams(max_new_tokens=BUDGET),
        response_format=form,
    )


async def test_every_structured_reply_of_smollm2_parses_and_validates(models_dir: Path, tmp_path: Path) -> None:
    env = {"LLMESH_MODELS_DIR": str(models_dir), "LLMESH_DATA_DIR": str(tmp_path), "LLMESH_INFERENCE_MODEL": "smollm2"}
    async with hosted("tokenizer", TokenizerApp, env) as tok, hosted("inference", InferenceApp, env) as inf:
        gateway_env = {
            **env,
            "LLMESH_TOKENIZER_TARGET": f"127.0.0.1:{tok.port}",
            "LLMESH_INFERENCE_TARGET": f"127.0.0.1:{inf.port}",
            "LLMESH_CACHE_TARGET": CLOSED,
            "LLMESH_RETRIEVAL_TARGET": CLOSED,
            "LLMESH_ADMISSION_ADAPTIVE": "false",
        }
        async with (
            hosted("gateway", GatewayApp, gateway_env) as gw,
            grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch,
        ):
            stub = gateway_pb2_grpc.GatewayStub(ch)

            lanes = asyncio.Semaphore(8)  # a client's worth of concurrency: no queue timeouts on 2 cores

            async def one(question: str, schema: dict | None) -> str:
                async with lanes:
                    return await ask_one(question, schema)

            async def ask_one(question: str, schema: dict | None) -> str:
                form = (
                    common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(schema))
                    if schema is not None
                    else common_pb2.ResponseFormat(type="json_object")
                )
                try:
                    reply = await stub.Generate(ask(question, form), timeout=300)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
                    assert "sampling.max_new_tokens" in (err.details() or "")
                    return "refused"
                value = json.loads(reply.text)  # every answer parses...
                if schema is None:
                    assert isinstance(value, dict), reply.text
                else:
                    jsonschema.validate(value, schema)  # ...and validates
                return "valid"

            outcomes = await asyncio.gather(*(one(q, s) for q, s in SCHEMAS), *(one(q, None) for q, _ in SCHEMAS[:6]))
    assert len(SCHEMAS) >= 20
    assert outcomes.count("valid") >= len(outcomes) - 2  # at most the two largest do not fit 48 tokens
