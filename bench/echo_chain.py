"""The framework's own limit for two hops: a bare grpc.aio relay in front of a bare echo server,
each its own process, serving the gateway's Generate method so one load generator drives both.

    python -m bench.echo_chain echo 0        # prints the bound port
    python -m bench.echo_chain relay 0 127.0.0.1:PORT
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from llmesh.v1 import gateway_pb2

METHOD = "/llmesh.v1.Gateway/Generate"


async def serve(kind: str, port: int, target: str | None) -> None:
    server = grpc.aio.server()
    if kind == "echo":

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            prompt = gateway_pb2.GenerateRequest.FromString(request).prompt
            return gateway_pb2.GenerateResponse(text=prompt).SerializeToString()

    else:
        channel = grpc.aio.insecure_channel(target or "")
        forward = channel.unary_unary(METHOD)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await forward(request)

    handler = grpc.method_handlers_generic_handler(
        "llmesh.v1.Gateway", {"Generate": grpc.unary_unary_rpc_method_handler(handle)}
    )
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(bound, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None))
