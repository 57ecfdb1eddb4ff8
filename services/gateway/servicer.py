"""gRPC side of the gateway: the public service, request deadlines, streaming."""

from __future__ import annotations

import grpc

from llmesh.channels import remaining_seconds
from llmesh.settings import Settings
from llmesh.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.core import Delta, Final, Gateway, GatewayConfig
from services.gateway.peers import Deadline, Peers


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, gateway: Gateway, default_deadline: float) -> None:
        self.gateway = gateway
        self.default_deadline = default_deadline

    def _deadline(self, context: grpc.aio.ServicerContext) -> Deadline:
        return Deadline.after(remaining_seconds(context, self.default_deadline))

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        final: gateway_pb2.GenerateResponse | None = None
        async for event in self.gateway.generate(request, self._deadline(context)):
            if isinstance(event, Final):
                final = event.response
        assert final is not None
        return final

    async def GenerateStream(self, request, context):  # type: ignore[no-untyped-def]
        async for event in self.gateway.generate(request, self._deadline(context)):
            if isinstance(event, Delta):
                if event.text:
                    yield gateway_pb2.GenerateStreamResponse(delta=event.text)
            else:
                yield gateway_pb2.GenerateStreamResponse(final=event.response)

    async def Ingest(self, request, context):  # type: ignore[no-untyped-def]
        return await self.gateway.ingest(request, self._deadline(context))

    async def Search(self, request, context):  # type: ignore[no-untyped-def]
        return await self.gateway.search(request, self._deadline(context))


class GatewayApp:
    service_names = (gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,)

    def __init__(self, settings: Settings) -> None:
        s = settings
        self.peers = Peers(
            s.tokenizer_target, s.inference_target, s.cache_target, s.retrieval_target, s.max_message_bytes
        )
        config = GatewayConfig(
            default_collection=s.default_collection,
            default_top_k=s.default_top_k,
            min_context_score=s.min_context_score,
            max_prompt_bytes=s.max_prompt_bytes,
            max_prompt_tokens=s.max_prompt_tokens,
            max_new_tokens=s.max_new_tokens,
            default_max_new_tokens=s.default_max_new_tokens,
            log_prompts=s.log_prompts,
        )
        self.gateway = Gateway(self.peers, config)
        self.servicer = GatewayServicer(self.gateway, s.default_deadline_seconds)

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self.peers.close()
