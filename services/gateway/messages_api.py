"""Anthropic's Messages API (`POST /v1/messages`) over the gateway's chat request path.

A request is translated into the gateway's GenerateRequest: `system` (a string or text blocks) is
the system turn; each message's text blocks are its turn, an assistant's `tool_use` blocks its
tool calls, a user's `tool_result` blocks tool turns; `tools` (input_schema) and `tool_choice`
(auto, any, tool, none) the tool plumbing; `stop_sequences`, `max_tokens` (required),
`temperature`, `top_p` and `top_k` the sampling. `Gateway.generate` answers it as a chat
completion: the same cache (every shaping field is in the key), retrieval, admission, limits,
usage and trace. Streaming sends Anthropic's events; every error has Anthropic's shape
({"type": "error", "error": {"type", "message"}}), and the key may come as `x-api-key`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from llmesh.errors import InvalidArgument, LlmeshError
from llmesh.v1 import common_pb2, gateway_pb2
from services.gateway.core import Delta, Final, server_timing
from services.gateway.openai_http import (
    MESSAGES,
    SSE_HEADERS,
    ErrorShape,
    OpenAiApi,
    authorization_of,
    from_llmesh_error,
)
from services.gateway.openai_models import MAX_LIST, MAX_TOOLS, UINT32_MAX, LlmeshOptions, Strict

MAX_BLOCKS = 64
MAX_STOP_SEQUENCES = 16  # the gateway's own count decides; this bounds the body
# Anthropic's error types by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
STOP_REASONS = {
    common_pb2.FINISH_REASON_STOP: "end_turn",
    common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    common_pb2.FINISH_REASON_LENGTH: "max_tokens",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_use",
}
# Gateway field paths -> the Messages API's own parameter names.
PARAMS = {
    "sampling.max_new_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.stop": "stop_sequences",
    "prompt": "messages",
    "system_prompt": "system",
    "tool_choice.mode": "tool_choice",
    "tool_choice.function": "tool_choice.name",
    "top_k": "llmesh.top_k",
    "collection": "llmesh.collection",
    "tenant": "llmesh.tenant",
    "lane": "llmesh.lane",
}


def api_param(field_path: str) -> str:
    base = field_path.split("[", 1)[0]
    if base in PARAMS:
        return PARAMS[base]
    if base.startswith("tools") or base.startswith("messages"):
        return field_path.replace(".parameters", ".input_schema")
    return field_path


def anthropic_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped error body in Anthropic's shape (the message names the field)."""
    error = body.get("error", {})
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.get("message", "")}}


class CacheControl(Strict):
    # A prompt-caching hint: llmesh reuses a prompt's prefix whenever it can, marked or not.
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_BLOCKS)]

    def turns(self, index: int) -> list[common_pb2.ChatMessage]:
        if isinstance(self.content, str):
            return [common_pb2.ChatMessage(role=self.role, content=self.content)]
        bad = []
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        uses = [b for b in self.content if isinstance(b, ToolUseBlock)]
        results = [b for b in self.content if isinstance(b, ToolResultBlock)]
        if self.role == "user" and uses:
            bad.append((f"messages[{index}].content", "tool_use blocks belong to assistant messages"))
        if self.role == "assistant" and results:
            bad.append((f"messages[{index}].content", "tool_result blocks belong to user messages"))
        if bad:
            raise InvalidArgument(bad)
        if self.role == "assistant":
            calls = [
                common_pb2.ToolCall(id=u.id, name=u.name, arguments=json.dumps(u.input, separators=(",", ":")))
                for u in uses
            ]
            return [common_pb2.ChatMessage(role="assistant", content=text, tool_calls=calls)]
        turns = [common_pb2.ChatMessage(role="tool", content=r.text(), tool_call_id=r.tool_use_id) for r in results]
        if text or not results:
            turns.append(common_pb2.ChatMessage(role="user", content=text))
        return turns


class ToolDef(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    def proto(self) -> common_pb2.Tool:
        parameters = json.dumps(self.input_schema, sort_keys=True, separators=(",", ":"))
        return common_pb2.Tool(name=self.name, description=self.description or "", parameters=parameters)


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    # llmesh's constrained calls are one call per answer: a single call is what it makes anyway.
    disable_parallel_tool_use: bool | None = None


class RequestMetadata(Strict):
    user_id: str | None = Field(default=None, max_length=256)


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    messages: list[Message] = Field(min_length=1, max_length=MAX_LIST)
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    metadata: RequestMetadata | None = None
    llmesh: LlmeshOptions = Field(default_factory=lambda: LlmeshOptions())

    def system_text(self) -> str:
        if self.system is None:
            return ""
        return self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)

    def to_generate(self, tenant: str) -> gateway_pb2.GenerateRequest:
        turns = [common_pb2.ChatMessage(role="system", content=self.system_text())] if self.system else []
        for index, message in enumerate(self.messages):
            turns.extend(message.turns(index))
        choice = self.tool_choice
        if choice is not None and (choice.type == "tool") != bool(choice.name):
            raise InvalidArgument([("tool_choice.name", "names the tool exactly when type is 'tool'")])
        sampling = common_pb2.SamplingParams(
            max_new_tokens=self.max_tokens,
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=0.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=self.stop_sequences or [],
        )
        options = self.llmesh
        request = gateway_pb2.GenerateRequest(
            sampling=sampling,
            top_k=options.top_k,
            collection=options.collection,
            tenant=tenant,
            lane=options.lane,
            model=self.model,
            messages=turns,
        )
        if options.use_cache is not None:
            request.use_cache = options.use_cache
        if options.use_retrieval is not None:
            request.use_retrieval = options.use_retrieval
        request.tools.extend(t.proto() for t in self.tools or ())
        if choice is not None:
            if choice.type == "tool":
                request.tool_choice.CopyFrom(common_pb2.ToolChoice(mode="function", function=choice.name or ""))
            else:
                request.tool_choice.mode = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        return request

    @property
    def tools_in_play(self) -> bool:
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type != "none")


def renamed(exc: InvalidArgument) -> InvalidArgument:
    """The gateway's refusal with the fields as this API names them."""
    return InvalidArgument([(api_param(f) if f else f, d) for f, d in exc.violations])


def usage_of(response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    """Anthropic's usage: input tokens processed, those read from a cache apart, output tokens."""
    u = response.usage
    return {
        "input_tokens": u.input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_input_tokens,
        "output_tokens": u.output_tokens,
    }


class MessageBuilder:
    def __init__(self, body: MessagesRequest, message_id: str) -> None:
        self.body = body
        self.id = message_id

    def stop_sequence(self, response: gateway_pb2.GenerateResponse) -> str | None:
        # The engine does not say which sequence stopped it: only a single one is certain.
        stops = self.body.stop_sequences or []
        if response.finish_reason == common_pb2.FINISH_REASON_STOP_SEQUENCE and len(stops) == 1:
            return stops[0]
        return None

    @staticmethod
    def content(response: gateway_pb2.GenerateResponse) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if response.text or not response.tool_calls:
            blocks.append({"type": "text", "text": response.text})
        for call in response.tool_calls:
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
        return blocks

    def envelope(self, content: list[dict[str, Any]], usage: dict[str, Any], response: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,
            "content": content,
            "stop_reason": None if response is None else STOP_REASONS.get(response.finish_reason, "end_turn"),
            "stop_sequence": None if response is None else self.stop_sequence(response),
            "usage": usage,
        }

    def whole(self, response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        answer = self.envelope(self.content(response), usage_of(response), response)
        answer["llmesh"] = {"trace_id": response.trace_id, "cache_hit": response.cache.hit}
        return answer


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


class MessagesApi:
    """The Messages API's route over the OpenAI API's gateway, keys and deadlines."""

    def __init__(self, api: OpenAiApi) -> None:
        self.api = api

    def routes(self) -> list[Route]:
        return [Route(MESSAGES, self.create, methods=["POST"])]

    def error_shapes(self) -> dict[str, ErrorShape]:
        return {MESSAGES: anthropic_error}

    async def create(self, request: Request) -> Response:
        authorization = authorization_of(request.headers)
        self.api.api_keys.authenticate(authorization)
        body = MessagesRequest.model_validate_json(await request.body())
        caller = self.api.api_keys.caller(authorization, body.llmesh.tenant)
        builder = MessageBuilder(body, f"msg_{request.state.request_id}")
        try:
            generate = body.to_generate(caller.tenant)
            events = await self.api.generation(request, generate, caller)
            if not body.stream:
                final = await self.api.whole(request, events)
                headers = {"server-timing": server_timing(final.timings)}
                answer = json.dumps(builder.whole(final.response), separators=(",", ":"), ensure_ascii=False)
                return Response(answer.encode(), 200, headers, "application/json")
            first = await anext(events)
        except InvalidArgument as exc:
            raise renamed(exc) from None
        except StopAsyncIteration:
            raise LlmeshError("the pipeline ended without an answer") from None
        stream = self._stream(body, builder, first, events)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    async def _stream(
        self,
        body: MessagesRequest,
        builder: MessageBuilder,
        first: Delta | Final,
        events: AsyncGenerator[Delta | Final, None],
    ) -> AsyncIterator[bytes]:
        """message_start, a content block per text or tool call (started, its deltas, stopped),
        message_delta with the stop reason and usage, message_stop. With tools in play the answer
        is sent once known (a call's form is known only at its end), still as those events."""
        try:
            usage = {"input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
            yield sse("message_start", {"message": builder.envelope([], usage, None)})
            opened = False
            event: Delta | Final | None = first
            while event is not None:
                if isinstance(event, Delta):
                    if event.text and not body.tools_in_play:
                        if not opened:
                            block = {"type": "text", "text": ""}
                            yield sse("content_block_start", {"index": 0, "content_block": block})
                            opened = True
                        yield sse(
                            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": event.text}}
                        )
                    event = await anext(events, None)
                    continue
                response = event.response
                index = 0
                if response.text and body.tools_in_play:
                    yield sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    yield sse(
                        "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": response.text}}
                    )
                    opened = True
                elif not opened and not response.tool_calls:
                    yield sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    opened = True
                if opened:
                    yield sse("content_block_stop", {"index": 0})
                    index = 1
                for call in response.tool_calls:
                    tool_use: dict[str, Any] = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                    yield sse("content_block_start", {"index": index, "content_block": tool_use})
                    delta = {"type": "input_json_delta", "partial_json": call.arguments}
                    yield sse("content_block_delta", {"index": index, "delta": delta})
                    yield sse("content_block_stop", {"index": index})
                    index += 1
                whole = builder.whole(response)
                stop = {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
                yield sse("message_delta", {"delta": stop, "usage": usage_of(response)})
                yield sse("message_stop", {})
                event = await anext(events, None)
        except LlmeshError as exc:
            if isinstance(exc, InvalidArgument):
                exc = renamed(exc)
            error = from_llmesh_error(exc, "messages")
            shaped = anthropic_error(error.status_code, json.loads(bytes(error.body)))
            yield sse("error", {"error": shaped["error"]})
        finally:
            await events.aclose()
