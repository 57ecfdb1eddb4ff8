"""Request bodies of the OpenAI-compatible HTTP API, validated by pydantic, and their translation
into the gateway's GenerateRequest. No HTTP here.

Types and shapes are checked here; values (temperature range, prompt size, stop sequences) are
checked once, by the gateway's own validation, so both APIs accept and refuse the same requests.
Parameters llmesh does not implement are refused with a 400 naming them, never ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

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
# Prompts of one completions request (each is its own request through the gateway).
MAX_PROMPTS = 16
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


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: one constraint, mapped onto llmesh's response formats."""

    # `json` in the body; `json_` here because pydantic's BaseModel has a `json`.
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_TOOLS)
    json_object: bool | None = None
    grammar: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


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
    # vLLM's (and SGLang's) generation fields, implemented as vLLM defines them.
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=UINT32_MAX)
    # vLLM's structured outputs, as the response formats llmesh has: the current field and the
    # older guided_* ones.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_TOOLS)
    guided_grammar: str | None = None

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
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad.append(("prompt_logprobs", "-1 (the whole vocabulary) is not supported: at most 20"))
        for name in ("guided_grammar",):
            if getattr(self, name) is not None:
                bad.append((name, "is not supported: use guided_json, guided_regex or guided_choice"))
        if self.structured_outputs is not None and self.structured_outputs.grammar is not None:
            bad.append(("structured_outputs.grammar", "is not supported: use json, regex or choice"))
        return bad

    def structured_format(self) -> tuple[str, common_pb2.ResponseFormat] | None:
        """vLLM's structured-output fields as a response format, with the field it came from
        (None when none is set); more than one constraint is an error naming the second."""
        found: list[tuple[str, common_pb2.ResponseFormat]] = []

        def schema_of(name: str, value: dict[str, Any] | bool | str) -> None:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
            found.append((name, common_pb2.ResponseFormat(type="json_schema", json_schema=text)))

        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                schema_of("structured_outputs.json", so.json_)
            if so.regex is not None:
                found.append(("structured_outputs.regex", common_pb2.ResponseFormat(type="regex", regex=so.regex)))
            if so.choice is not None:
                found.append(("structured_outputs.choice", common_pb2.ResponseFormat(type="choice", choices=so.choice)))
            if so.json_object:
                found.append(("structured_outputs.json_object", common_pb2.ResponseFormat(type="json_object")))
        if self.guided_json is not None:
            schema_of("guided_json", self.guided_json)
        if self.guided_regex is not None:
            found.append(("guided_regex", common_pb2.ResponseFormat(type="regex", regex=self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", common_pb2.ResponseFormat(type="choice", choices=self.guided_choice)))
        if len(found) > 1:
            raise InvalidArgument([(found[1][0], f"one constraint per request; {found[0][0]} is set too")])
        return found[0] if found else None

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
        sampling.ignore_eos = bool(self.ignore_eos)
        sampling.min_new_tokens = self.min_tokens or 0
        sampling.keep_special_tokens = self.skip_special_tokens is False
        sampling.include_stop_str = bool(self.include_stop_str_in_output)
        if self.prompt_logprobs is not None and self.prompt_logprobs >= 0:
            sampling.prompt_logprobs = self.prompt_logprobs  # vLLM's -1 (the whole vocabulary) is refused below
        structured = self.structured_format()
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
        if structured is not None:
            request.response_format.CopyFrom(structured[1])
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
    # With tool_choice "auto" the model may make several calls in one answer ("required" and a
    # named function: one).
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
            if request.HasField("response_format"):
                raise InvalidArgument(
                    [("response_format", "set response_format or a structured-output field, not both")]
                )
            request.response_format.CopyFrom(self.response_format.proto())
        request.tools.extend(t.proto() for t in self.tools or ())
        if isinstance(self.tool_choice, NamedToolChoice):
            request.tool_choice.CopyFrom(
                common_pb2.ToolChoice(mode="function", function=self.tool_choice.function.name)
            )
        elif self.tool_choice is not None:
            request.tool_choice.mode = self.tool_choice
        return request


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=UINT32_MAX)]], Field(min_length=1, max_length=MAX_LIST * 64)]


class CompletionRequest(Sampling):
    """OpenAI's legacy completions: a raw completion of the prompt as it is (no chat template),
    given as text, as token ids, or as a one-element list of either."""

    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(max_length=MAX_LIST)]
        | Annotated[list[TokenIds], Field(max_length=MAX_LIST)]
    )
    # 0 with echo: the prompt is only scored (lm-evaluation-harness's log-likelihood requests).
    max_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    # The legacy form: the k likeliest alternatives at each position (0: the tokens' own only).
    logprobs: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    # The answer starts with the prompt (and with logprobs, the prompt's tokens are scored too).
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of texts or of token-id lists)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return cast("list[str | list[int]]", list(self.prompt))
        return [cast("str | list[int]", self.prompt)]

    def prompt_value(self) -> str | list[int]:
        """The (first) prompt."""
        return self.prompts()[0]

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        batch = len(self.prompts())
        if batch > MAX_PROMPTS:
            bad.append(("prompt", f"at most {MAX_PROMPTS} prompts per request"))
        elif batch > 1 and self.stream:
            bad.append(("prompt", "a batch of prompts is answered whole: stream=false (or one prompt per request)"))
        if isinstance(self.prompt, list) and not self.prompt:
            bad.append(("prompt", "must not be empty"))
        if self.best_of not in (None, 1):
            bad.append(("best_of", "only best_of=1 is supported"))
        if self.suffix:
            bad.append(("suffix", "the served model has no fill-in-the-middle tokens"))
        if self.echo and self.stream and self.logprobs is not None:
            bad.append(("echo", "with logprobs, echo is answered whole: stream=false"))
        if self.echo and self.stream and not isinstance(self.prompt_value(), str):
            bad.append(("echo", "of a token-id prompt, echo is answered whole: stream=false"))
        return bad

    def to_generate(self, tenant: str) -> gateway_pb2.GenerateRequest:
        """A raw completion: the prompt as it is, no chat template (GenerateRequest.raw)."""
        bad = self.unsupported()
        if bad:
            raise InvalidArgument(bad)
        prompt = self.prompt_value()
        text = prompt if isinstance(prompt, str) else ""
        request = self.generate_request(text, "", tenant, self.max_tokens)
        request.raw = True
        if not isinstance(prompt, str):
            request.prompt_token_ids.extend(prompt)
        if self.max_tokens == 0:
            request.sampling.prompt_only = True
        if self.logprobs is not None:
            request.sampling.logprobs = not request.sampling.prompt_only
            request.sampling.top_logprobs = 0 if request.sampling.prompt_only else self.logprobs
        if self.echo and (self.logprobs is not None or not isinstance(prompt, str)):
            # The prompt's own tokens: their scores, and the text of a token-id prompt.
            wanted = self.logprobs or 0
            if not request.sampling.HasField("prompt_logprobs") or request.sampling.prompt_logprobs < wanted:
                request.sampling.prompt_logprobs = wanted
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
    "sampling.min_new_tokens": "min_tokens",
    "sampling.prompt_logprobs": "prompt_logprobs",
    "sampling.ignore_eos": "ignore_eos",
    "prompt_token_ids": "prompt",
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
