"""gRPC side of the tokenizer service: messages in, domain calls, messages out."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from llmesh.channels import remaining_seconds
from llmesh.models import resolve, verify
from llmesh.server import Readiness
from llmesh.settings import TokenizerServiceSettings
from llmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.core import TokenizerCore, Tokenizers

# Texts above this size are tokenized on a worker thread so the event loop keeps serving.
THREAD_THRESHOLD_BYTES = 16 * 1024


async def _run(fn, *args, size: int = 0):  # type: ignore[no-untyped-def]
    if size > THREAD_THRESHOLD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, tokenizers: Readiness[Tokenizers]) -> None:
        self._tokenizers = tokenizers

    def core(self, model: str) -> TokenizerCore:
        """The named model's tokenizer ("" = the default); NOT_FOUND for one not served."""
        return self._tokenizers.get().get(model)

    async def Encode(self, request, context):  # type: ignore[no-untyped-def]
        ids = await _run(
            self.core(request.model).encode, request.text, request.add_special_tokens, size=len(request.text)
        )
        return tokenizer_pb2.EncodeResponse(ids=ids)

    async def Decode(self, request, context):  # type: ignore[no-untyped-def]
        return tokenizer_pb2.DecodeResponse(
            text=self.core(request.model).decode(list(request.ids), request.skip_special_tokens)
        )

    async def Count(self, request, context):  # type: ignore[no-untyped-def]
        texts = list(request.texts)
        counts = await _run(self.core(request.model).count, texts, size=sum(len(t) for t in texts))
        return tokenizer_pb2.CountResponse(counts=counts, total=sum(counts))

    async def ApplyChatTemplate(self, request, context):  # type: ignore[no-untyped-def]
        core = self.core(request.model)
        text = core.chat_template(request.messages, request.add_generation_prompt, request.tools)
        ids = await _run(core.encode, text, False, size=len(text))
        return tokenizer_pb2.ApplyChatTemplateResponse(
            text=text,
            ids=ids if request.tokenize else [],
            token_count=len(ids),
            tool_format=core.template.tool_format,
            template_renders_tools=core.template.renders_tools,
        )

    async def GetChatTemplate(self, request, context):  # type: ignore[no-untyped-def]
        template = self.core(request.model).template
        return tokenizer_pb2.GetChatTemplateResponse(template=template.source, special_tokens=template.special)

    async def Chunk(self, request, context):  # type: ignore[no-untyped-def]
        # The windows are made on a worker thread, which a cancelled call cannot interrupt: it
        # looks at `stop` (and the deadline) between batches instead.
        stop = threading.Event()
        deadline = time.monotonic() + remaining_seconds(context, float("inf"))
        try:
            chunks, total = await _run(
                self.core(request.model).chunk,
                request.text,
                request.chunk_tokens,
                request.overlap_tokens,
                request.max_chunks,
                stop,
                deadline,
                size=len(request.text),
            )
        finally:
            stop.set()
        return tokenizer_pb2.ChunkResponse(
            chunks=[
                tokenizer_pb2.TextChunk(
                    text=c.text,
                    token_start=c.token_start,
                    token_count=c.token_count,
                    char_start=c.char_start,
                    char_end=c.char_end,
                )
                for c in chunks
            ],
            total_tokens=total,
        )


class TokenizerApp:
    service_names = (tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name,)

    def __init__(self, settings: TokenizerServiceSettings) -> None:
        self.settings = settings
        self.core: Readiness[Tokenizers] = Readiness()

    def register(self, server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(self.core), server)

    async def start(self) -> None:
        s = self.settings
        cores: dict[str, TokenizerCore] = {}
        for name in s.tokenizer.models or (s.tokenizer_model.model,):
            model = await asyncio.to_thread(verify, resolve(s.runtime.models_path, name))
            cores[name] = await asyncio.to_thread(
                TokenizerCore,
                model.path,
                s.tokenizer.max_text_bytes,
                s.chunk_limits.max_chunks_per_document,
                s.tokenizer_model.tool_call_format,
            )
        self.core.set(Tokenizers(cores))

    async def stop(self) -> None:
        return None
