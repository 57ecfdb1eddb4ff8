"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) over the
gateway's chat request path.

A request is translated into the gateway's GenerateRequest, turn for turn (instructions: the
system turn; input messages, function calls and their outputs: user, assistant and tool turns;
`text.format`: the response format; function tools and `tool_choice`: the tool plumbing), and
answered by `Gateway.generate` as a chat completion is: the same cache (every shaping field is in
the translated request, so in the key), retrieval, admission, limits, usage and trace.

`store` (the default) keeps the response and its conversation per tenant (response_store);
`previous_response_id` gives a next request that conversation as its earlier turns (the earlier
request's instructions do not carry over, as OpenAI documents). Streaming sends the documented
events, each with its `sequence_number`. Fields llmesh does not implement are a 400 naming them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from llmesh.errors import InvalidArgument, LlmeshError, NotFound
from llmesh.v1 import common_pb2, gateway_pb2
from services.gateway.core import Delta, Final, server_timing
from services.gateway.openai_http import (
    RESPONSE,
    RESPONSES,
    SSE_HEADERS,
    OpenAiApi,
    authorization_of,
    from_llmesh_error,
)
from services.gateway.openai_models import (
    MAX_LIST,
    MAX_METADATA,
    MAX_TOOLS,
    UINT32_MAX,
    LlmeshOptions,
    Strict,
)
from services.gateway.response_store import ResponseStore, StoredResponse

ROLE_OF = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Gateway field paths -> the Responses API's own parameter names.
PARAMS = {
    "sampling.max_new_tokens": "max_output_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "prompt": "input",
    "messages": "input",
    "system_prompt": "instructions",
    "response_format": "text.format",
    "tool_choice.mode": "tool_choice",
    "tool_choice.function": "tool_choice",
    "top_k": "llmesh.top_k",
    "collection": "llmesh.collection",
    "tenant": "llmesh.tenant",
    "lane": "llmesh.lane",
}
MAX_PARTS = 64


def api_param(field_path: str) -> str:
    base = field_path.split("[", 1)[0]
    return PARAMS.get(base, PARAMS.get(field_path.split(".", 1)[0], field_path))


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    # What the API returned with an output part, sent back as it came.
    annotations: list[Any] | None = Field(default=None, max_length=MAX_LIST)
    logprobs: list[Any] | None = Field(default=None, max_length=UINT32_MAX)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[InputText], Field(max_length=MAX_PARTS)]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def proto(self) -> common_pb2.Tool:
        parameters = json.dumps(self.parameters, sort_keys=True, separators=(",", ":")) if self.parameters else ""
        return common_pb2.Tool(
            name=self.name, description=self.description or "", parameters=parameters, strict=bool(self.strict)
        )


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def proto(self) -> common_pb2.ResponseFormat:
        form = common_pb2.ResponseFormat(type=self.type, name=self.name or "", strict=bool(self.strict))
        if self.schema_ is not None:
            form.json_schema = json.dumps(self.schema_, sort_keys=True, separators=(",", ":"))
        return form

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(Strict):
    format: TextFormat | None = None
    # "medium" is what every text is; others are a model's knob llmesh's models do not have.
    verbosity: Literal["medium"] | None = None


class ResponseRequest(Strict):
    model: str
    input: str | Annotated[list[InputItem], Field(max_length=MAX_LIST)] = ""
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    user: str | None = None
    # Only what llmesh does: the whole conversation is kept, never cut.
    truncation: Literal["disabled"] | None = None
    llmesh: LlmeshOptions = Field(default_factory=lambda: LlmeshOptions())

    def turns(self) -> list[common_pb2.ChatMessage]:
        """The input as the gateway's turns: consecutive function calls are one assistant turn
        (with the assistant message right before them, if there is one)."""
        if isinstance(self.input, str):
            return [common_pb2.ChatMessage(role="user", content=self.input)] if self.input else []
        turns: list[common_pb2.ChatMessage] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                turns.append(common_pb2.ChatMessage(role=ROLE_OF[item.role], content=item.text()))
            elif isinstance(item, FunctionCallItem):
                call = common_pb2.ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
                if not turns or turns[-1].role != "assistant":
                    turns.append(common_pb2.ChatMessage(role="assistant"))
                turns[-1].tool_calls.append(call)
            else:
                turns.append(common_pb2.ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        return turns

    def to_generate(
        self, tenant: str, earlier: list[common_pb2.ChatMessage]
    ) -> tuple[gateway_pb2.GenerateRequest, list[common_pb2.ChatMessage]]:
        """The gateway's request, and the conversation it continues (earlier turns, then this input)."""
        conversation = [*earlier, *self.turns()]
        if not conversation:
            raise InvalidArgument([("input", "is empty (and there is no previous response)")])
        system = [common_pb2.ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        sampling = common_pb2.SamplingParams(
            max_new_tokens=self.max_output_tokens or 0,
            # Unset: the gateway's default decoding, as chat's unset temperature.
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=0.0 if self.top_p is None else self.top_p,
        )
        options = self.llmesh
        request = gateway_pb2.GenerateRequest(
            sampling=sampling,
            top_k=options.top_k,
            collection=options.collection,
            tenant=tenant,
            lane=options.lane,
            model=self.model,
            messages=[*system, *conversation],
        )
        if options.use_cache is not None:
            request.use_cache = options.use_cache
        if options.use_retrieval is not None:
            request.use_retrieval = options.use_retrieval
        form = self.text.format if self.text is not None else None
        if form is not None and form.type != "text":
            request.response_format.CopyFrom(form.proto())
        request.tools.extend(t.proto() for t in self.tools or ())
        if isinstance(self.tool_choice, NamedFunctionChoice):
            request.tool_choice.CopyFrom(common_pb2.ToolChoice(mode="function", function=self.tool_choice.name))
        elif self.tool_choice is not None:
            request.tool_choice.mode = self.tool_choice
        return request, conversation

    @property
    def tools_in_play(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def turn_dict(turn: common_pb2.ChatMessage) -> dict[str, Any]:
    return {
        "role": turn.role,
        "content": turn.content,
        "tool_call_id": turn.tool_call_id,
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in turn.tool_calls],
    }


def turn_of(value: dict[str, Any]) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(
        role=value["role"],
        content=value.get("content", ""),
        tool_call_id=value.get("tool_call_id", ""),
        tool_calls=[common_pb2.ToolCall(**c) for c in value.get("tool_calls", ())],
    )


def renamed(exc: InvalidArgument) -> InvalidArgument:
    """The gateway's refusal with the fields as this API names them."""
    return InvalidArgument([(api_param(f) if f else f, d) for f, d in exc.violations])


class ResponseBuilder:
    """One response object and its events."""

    def __init__(self, body: ResponseRequest, response_id: str) -> None:
        self.body = body
        self.id = response_id
        self.created = int(time.time())
        self.sequence = 0

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        b = self.body
        form = b.text.format if b.text is not None and b.text.format is not None else None
        tool_choice: Any = b.tool_choice if b.tool_choice is not None else "auto"
        if isinstance(tool_choice, NamedFunctionChoice):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": b.model,
            "output": output,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "temperature": b.temperature,
            "text": {"format": form.echo() if form is not None else {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": b.user,
            "metadata": b.metadata or {},
        }

    @staticmethod
    def usage(response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        u = response.usage
        prompt = u.input_tokens + u.cached_input_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": u.cached_input_tokens},
            "output_tokens": u.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + u.output_tokens,
        }

    @staticmethod
    def status(response: gateway_pb2.GenerateResponse) -> str:
        return "incomplete" if response.finish_reason == common_pb2.FINISH_REASON_LENGTH else "completed"

    def output(self, response: gateway_pb2.GenerateResponse) -> list[dict[str, Any]]:
        if response.tool_calls:
            return [self.function_call(i, c) for i, c in enumerate(response.tool_calls)]
        return [self.message(response.text, "completed")]

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.text_part(text)]
        return {
            "id": f"msg_{self.id[5:]}",
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def function_call(self, index: int, call: common_pb2.ToolCall, arguments: str | None = None) -> dict[str, Any]:
        return {
            "id": f"fc_{self.id[5:]}_{index}",
            "type": "function_call",
            "status": "completed" if arguments is None else "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
        }

    def whole(self, response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        answer = self.envelope(self.status(response), self.output(response), self.usage(response))
        answer["llmesh"] = {"trace_id": response.trace_id, "cache_hit": response.cache.hit}
        return answer

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def text_events(self, index: int, opened: bool, delta: str) -> list[bytes]:
        item_id = f"msg_{self.id[5:]}"
        events = []
        if not opened:
            events.append(
                self.event("response.output_item.added", output_index=index, item=self.message(None, "in_progress"))
            )
            part = self.text_part("")
            events.append(
                self.event(
                    "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part
                )
            )
        if delta:
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            )
        return events

    def closing_events(self, response: gateway_pb2.GenerateResponse, opened: bool) -> list[bytes]:
        """What follows the last text delta: the item's ends, a function call's events, the end."""
        events = []
        if response.tool_calls:
            for index, call in enumerate(response.tool_calls):
                item = self.function_call(index, call, arguments="")
                events.append(self.event("response.output_item.added", output_index=index, item=item))
                args = {"item_id": item["id"], "output_index": index}
                events.append(self.event("response.function_call_arguments.delta", **args, delta=call.arguments))
                events.append(
                    self.event(
                        "response.function_call_arguments.done", **args, name=call.name, arguments=call.arguments
                    )
                )
                events.append(
                    self.event("response.output_item.done", output_index=index, item=self.function_call(index, call))
                )
        else:
            text = response.text
            events.extend(self.text_events(0, opened, ""))
            ids = {"item_id": f"msg_{self.id[5:]}", "output_index": 0, "content_index": 0}
            events.append(self.event("response.output_text.done", **ids, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **ids, part=self.text_part(text)))
            events.append(self.event("response.output_item.done", output_index=0, item=self.message(text, "completed")))
        whole = self.whole(response)
        kind = "response.completed" if whole["status"] == "completed" else "response.incomplete"
        events.append(self.event(kind, response=whole))
        return events


class ResponsesApi:
    """The Responses API's routes over the OpenAI API's gateway, keys and deadlines."""

    def __init__(self, api: OpenAiApi, store: ResponseStore) -> None:
        self.api = api
        self.store = store

    def routes(self) -> list[Route]:
        return [
            Route(RESPONSES, self.create, methods=["POST"]),
            Route(RESPONSE, self.retrieve, methods=["GET"]),
            Route(RESPONSE, self.delete, methods=["DELETE"]),
        ]

    def _tenant(self, request: Request, requested: str = "") -> Any:
        return self.api.api_keys.caller(authorization_of(request.headers), requested)

    async def retrieve(self, request: Request) -> Response:
        caller = self._tenant(request)
        found = await self.store.get(caller.tenant, request.path_params["response_id"])
        if found is None:
            raise NotFound(f"no response {request.path_params['response_id']!r}", reason="RESPONSE_NOT_FOUND")
        return Response(_json(found.response), 200, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        caller = self._tenant(request)
        response_id = request.path_params["response_id"]
        if not await self.store.delete(caller.tenant, response_id):
            raise NotFound(f"no response {response_id!r}", reason="RESPONSE_NOT_FOUND")
        return Response(_json({"id": response_id, "object": "response.deleted", "deleted": True}), 200)

    async def create(self, request: Request) -> Response:
        self.api.api_keys.authenticate(authorization_of(request.headers))
        body = ResponseRequest.model_validate_json(await request.body())
        caller = self._tenant(request, body.llmesh.tenant)
        earlier: list[common_pb2.ChatMessage] = []
        if body.previous_response_id:
            previous = await self.store.get(caller.tenant, body.previous_response_id)
            if previous is None:
                raise InvalidArgument([("previous_response_id", f"no stored response {body.previous_response_id!r}")])
            earlier = [turn_of(t) for t in previous.turns]
        try:
            generate, conversation = body.to_generate(caller.tenant, earlier)
        except InvalidArgument as exc:
            raise renamed(exc) from None
        builder = ResponseBuilder(body, f"resp_{uuid.uuid4().hex}")
        events = await self.api.generation(request, generate, caller)
        if not body.stream:
            try:
                final = await self.api.whole(request, events)
            except InvalidArgument as exc:
                raise renamed(exc) from None
            answer = builder.whole(final.response)
            await self._keep(body, caller.tenant, builder.id, answer, conversation, final.response)
            headers = {"server-timing": server_timing(final.timings)}
            return Response(_json(answer), 200, headers, "application/json")
        try:
            first = await anext(events)
        except InvalidArgument as exc:
            raise renamed(exc) from None
        except StopAsyncIteration:
            raise LlmeshError("the pipeline ended without an answer") from None
        stream = self._stream(body, builder, caller.tenant, conversation, first, events)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    async def _keep(
        self,
        body: ResponseRequest,
        tenant: str,
        response_id: str,
        answer: dict[str, Any],
        conversation: list[common_pb2.ChatMessage],
        response: gateway_pb2.GenerateResponse,
    ) -> None:
        if not body.store:
            return
        said = common_pb2.ChatMessage(role="assistant", content=response.text, tool_calls=response.tool_calls)
        turns = [turn_dict(t) for t in [*conversation, said]]
        await self.store.put(tenant, response_id, StoredResponse(answer, turns))

    async def _stream(
        self,
        body: ResponseRequest,
        builder: ResponseBuilder,
        tenant: str,
        conversation: list[common_pb2.ChatMessage],
        first: Delta | Final,
        events: AsyncGenerator[Delta | Final, None],
    ) -> AsyncIterator[bytes]:
        """The documented events; with tools in play the answer (a call or text) is sent whole
        once known, since a call's form is only known at its end."""
        try:
            started = builder.envelope("in_progress", [], None)
            yield builder.event("response.created", response=started)
            yield builder.event("response.in_progress", response=started)
            opened = False
            event: Delta | Final | None = first
            while event is not None:
                if isinstance(event, Delta):
                    if event.text and not body.tools_in_play:
                        for chunk in builder.text_events(0, opened, event.text):
                            yield chunk
                        opened = True
                else:
                    for chunk in builder.closing_events(event.response, opened):
                        yield chunk
                    await self._keep(
                        body, tenant, builder.id, builder.whole(event.response), conversation, event.response
                    )
                event = await anext(events, None)
        except LlmeshError as exc:
            if isinstance(exc, InvalidArgument):
                exc = renamed(exc)
            error = json.loads(bytes(from_llmesh_error(exc, "input").body))["error"]
            yield builder.event("error", code=error["code"], message=error["message"], param=error["param"])
        finally:
            await events.aclose()


def _json(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
