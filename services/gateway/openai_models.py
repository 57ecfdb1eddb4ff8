"""Request bodies of the OpenAI-compatible HTTP API, validated by pydantic, and their translation
into the gateway's GenerateRequest. No HTTP here.

Types and shapes are checked here; values (temperature range, prompt size, stop sequences) are
checked once, by the gateway's own validation, so both APIs accept and refuse the same requests.
Parameters llmesh does not implement are refused with a 400 naming them, never ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmesh.errors import InvalidArgument
from llmesh.v1 import common_pb2, gateway_pb2

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# Bounds on every list and map a body holds, checked while the body is validated (pydantic stops
# at the first element past one): a body is refused before its elements cost their parsed size.
# Beside the gateway's own counts (services/gateway/plan.py), which say the same on gRPC.
MAX_LIST = 256
MAX_TOOLS = 64
MAX_STOP = 4
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 16
MAX_METADATA = 16
MAX_EMBED_INPUTS = 256
# OpenAI's "developer" turn is the system turn of models that know no such role.
ROLE_OF = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Strict(BaseModel):
    # An unknown parameter is a 400 naming it, as OpenAI's API answers.
    model_config = ConfigDict(extra="forbid")


class LlmeshOptions(Strict):
    """The `llmesh` extension object of a request body (`extra_body={"llmesh": {...}}` in the
    openai client): the gateway's own knobs."""

    collection: str = ""
    use_retrieval: bool | None = None
    use_cache: bool | None = None
    top_k: int = Field(default=0, ge=0, le=UINT32_MAX)
    tenant: str = ""
    lane: str = ""


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCallParam(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_LIST)] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(default=None, max_length=MAX_TOOLS)
    # Sent back by clients that echo an assistant message as they received it.
    refusal: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def turn(self) -> common_pb2.ChatMessage:
        """The gateway's turn: the same role (developer: system), content, name and tool fields."""
        return common_pb2.ChatMessage(
            role=ROLE_OF[self.role],
            content=self.text(),
            name=self.name or "",
            tool_call_id=self.tool_call_id or "",
            tool_calls=[
                common_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in self.tool_calls or ()
            ],
        )


class JsonSchemaFormat(Strict):
    name: str = ""
    description: str | None = None
    # OpenAI calls it `schema`; `schema_` here because pydantic's BaseModel has a `schema`.
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef

    def proto(self) -> common_pb2.Tool:
        f = self.function
        parameters = json.dumps(f.parameters, sort_keys=True, separators=(",", ":")) if f.parameters else ""
        return common_pb2.Tool(
            name=f.name, description=f.description or "", parameters=parameters, strict=bool(f.strict)
        )


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(Strict):
    """OpenAI's `response_format`, and llmesh's own `regex` and `choice` (as vLLM offers them)."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    choices: list[str] | None = Field(default=None, max_length=MAX_TOOLS)

    def proto(self) -> common_pb2.ResponseFormat:
        form = common_pb2.ResponseFormat(type=self.type, regex=self.regex or "", choices=self.choices or [])
        if self.json_schema is not None:
            form.json_schema = json.dumps(self.json_schema.schema_, sort_keys=True, separators=(",", ":"))
            form.name = self.json_schema.name
            form.strict = bool(self.json_schema.strict)
        elif self.type == "json_schema":
            form.json_schema = ""  # the gateway names the missing schema
        return form


class Sampling(Strict):
    """Parameters chat and plain completions share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    llmesh: LlmeshOptions = Field(default_factory=lambda: LlmeshOptions())
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions, accepted as it accepts them.
    top_k: int | None = Field(default=None, ge=-1, le=UINT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    # Independent answers (GenerateRequest.n; at most 16, checked by the gateway).
    n: int | None = Field(default=None, ge=1, le=UINT32_MAX)

    def unsupported(self) -> list[tuple[str, str]]:
        bad = []
        for token in self.logit_bias or {}:
            if not token.isdigit() or int(token) > UINT32_MAX:
                bad.append(("logit_bias", f"keys are token ids, not {token!r}"))
                break
        for token_id in self.stop_token_ids or ():
            if not 0 <= token_id <= UINT32_MAX:
                bad.append(("stop_token_ids", "token ids are non-negative"))
                break
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "only allowed with stream=true"))
        return bad

    def generate_request(
        self,
        prompt: str,
        system_prompt: str,
        tenant: str,
        max_tokens: int | None,
        messages: list[common_pb2.ChatMessage] | None = None,
    ) -> gateway_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(
            max_new_tokens=max_tokens or 0,
            temperature=0.0 if self.temperature is None else self.temperature,
            top_p=0.0 if self.top_p is None else self.top_p,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
        )
        if self.seed is not None:
            sampling.seed = self.seed
        sampling.top_k = max(0, self.top_k or 0)  # vLLM's -1 is off, as 0 is
        sampling.min_p = self.min_p or 0.0
        sampling.repetition_penalty = self.repetition_penalty or 0.0
        sampling.presence_penalty = self.presence_penalty or 0.0
        sampling.frequency_penalty = self.frequency_penalty or 0.0
        sampling.stop_token_ids.extend(self.stop_token_ids or ())
        for token, bias in (self.logit_bias or {}).items():
            if token.isdigit() and int(token) <= UINT32_MAX:
                sampling.logit_bias[int(token)] = bias
        request = gateway_pb2.GenerateRequest(
            prompt=prompt,
            system_prompt=system_prompt,
            sampling=sampling,
            n=self.n or 0,
            top_k=self.llmesh.top_k,
            collection=self.llmesh.collection,
            tenant=tenant,
            lane=self.llmesh.lane,
            # `model` routes: one of the gateway's models by name (checked against /v1/models first).
            model=self.model,
            messages=messages or [],
        )
        if self.llmesh.use_cache is not None:
            request.use_cache = self.llmesh.use_cache
        if self.llmesh.use_retrieval is not None:
            request.use_retrieval = self.llmesh.use_retrieval
        return request

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_LIST)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    # Refused unless unset: llmesh has no audio, predictions or legacy functions.
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # At most one call is made: "allowed" in parallel, never more than one.
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(default=None, max_length=MAX_TOOLS)
    function_call: Any = None
    modalities: list[Literal["text"]] | None = Field(default=None, max_length=MAX_STOP)
    audio: Any = None
    prediction: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name) is not None:
                bad.append((name, "is not supported"))
        if self.stream and self.tools and self.tool_choice not in (None, "none"):
            bad.append(("stream", "a tool call is answered whole: stream=false with tool_choice"))
        if self.store:
            bad.append(("store", "is not supported"))
        return bad

    def to_generate(self, tenant: str) -> gateway_pb2.GenerateRequest:
        """The messages as the gateway's turns, one for one and in order (a developer message is
        a system turn); the gateway checks the conversation and the model's template renders it."""
        bad = self.unsupported()
        if bad:
            raise InvalidArgument(bad)
        max_tokens = self.max_completion_tokens or self.max_tokens
        request = self.generate_request("", "", tenant, max_tokens, [m.turn() for m in self.messages])
        request.sampling.logprobs = bool(self.logprobs)
        request.sampling.top_logprobs = self.top_logprobs or 0
        if self.response_format is not None and self.response_format.type != "text":
            request.response_format.CopyFrom(self.response_format.proto())
        request.tools.extend(t.proto() for t in self.tools or ())
        if isinstance(self.tool_choice, NamedToolChoice):
            request.tool_choice.CopyFrom(
                common_pb2.ToolChoice(mode="function", function=self.tool_choice.function.name)
            )
        elif self.tool_choice is not None:
            request.tool_choice.mode = self.tool_choice
        return request


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[str], Field(max_length=MAX_LIST)]
    # The legacy form: the k likeliest alternatives at each position (0: the tokens' own only).
    logprobs: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    # Refused unless unset or off.
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            bad.append(("prompt", "exactly one prompt per request"))
        if self.echo:
            bad.append(("echo", "is not supported"))
        if self.best_of not in (None, 1):
            bad.append(("best_of", "only best_of=1 is supported"))
        if self.suffix:
            bad.append(("suffix", "is not supported"))
        return bad

    def to_generate(self, tenant: str) -> gateway_pb2.GenerateRequest:
        """The prompt is answered as one user message (the served models are chat models)."""
        bad = self.unsupported()
        if bad:
            raise InvalidArgument(bad)
        prompt = self.prompt[0] if isinstance(self.prompt, list) else self.prompt
        request = self.generate_request(prompt, "", tenant, self.max_tokens)
        if self.logprobs is not None:
            request.sampling.logprobs = True
            request.sampling.top_logprobs = self.logprobs
        return request


class EmbeddingRequest(Strict):
    """`POST /v1/embeddings`: text inputs only (token-id inputs are refused: the embedding model's
    tokenizer is retrieval's, not the caller's)."""

    model: str
    input: (
        str
        | Annotated[list[str], Field(max_length=MAX_EMBED_INPUTS)]
        | Annotated[list[int], Field(max_length=MAX_LIST * 64)]
        | Annotated[list[Annotated[list[int], Field(max_length=MAX_LIST * 64)]], Field(max_length=MAX_EMBED_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    llmesh: LlmeshOptions = Field(default_factory=lambda: LlmeshOptions())

    def to_embed(self, tenant: str) -> gateway_pb2.EmbedRequest:
        bad = []
        texts: list[str] = []
        if isinstance(self.input, str):
            texts = [self.input]
        elif any(not isinstance(item, str) for item in self.input):
            bad.append(("input", "token-id inputs are not supported: send the text (a string or a list of strings)"))
        else:
            texts = [str(item) for item in self.input]
        if self.dimensions is not None:
            bad.append(("dimensions", "is not supported (the model's own dimension is returned)"))
        options = self.llmesh
        for name in ("collection", "use_retrieval", "use_cache", "top_k", "lane"):
            if name in options.model_fields_set:
                bad.append((f"llmesh.{name}", "does not apply to embeddings"))
        if bad:
            raise InvalidArgument(bad)
        return gateway_pb2.EmbedRequest(inputs=texts, model=self.model, tenant=tenant)


# Gateway field paths -> the request parameter a caller of this API knows them by.
PARAMS = {
    "sampling.max_new_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.stop": "stop",
    "sampling.seed": "seed",
    "sampling.top_k": "top_k",
    "sampling.min_p": "min_p",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.logit_bias": "logit_bias",
    "sampling.logprobs": "logprobs",
    "sampling.top_logprobs": "top_logprobs",
    "system_prompt": "messages",
    "inputs": "input",
    "tool_choice.mode": "tool_choice",
    "tool_choice.function": "tool_choice",
    "top_k": "llmesh.top_k",
    "collection": "llmesh.collection",
    "tenant": "llmesh.tenant",
    "lane": "llmesh.lane",
}


def param_name(field_path: str, prompt_param: str) -> str:
    """The API parameter of a gateway field path: "sampling.temperature" -> "temperature",
    "prompt" -> "messages" (chat) or "prompt"; "sampling.stop[1]" -> "stop"."""
    base = field_path.split("[", 1)[0]
    if base == "prompt":
        return prompt_param
    if base == "sampling.top_logprobs" and prompt_param == "prompt":
        return "logprobs"  # /v1/completions: `logprobs` is the number of alternatives
    return PARAMS.get(base, field_path)
