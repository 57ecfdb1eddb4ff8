"""What one request asks for: the `Plan`, built once from the request by `validate` (every field
checked, all problems reported at once, defaults filled, equal requests spelled one way) and
frozen plain data after: its protobuf parts are kept as their wire bytes, and each read of
`sampling`, `turns`, `tools` or `response_format` is a fresh message, so no holder can change
the plan through one. A narrower plan is derived, never made in place (`Plan.with_max_new_tokens`,
`Plan.without_retrieval`, `Plan.for_model`). Also what is computed from a plan alone: the model's
turns (`build_messages`), a tool call's answer (`as_tool_calls`) and the prompt-length prediction
(`InputTokenPredictor`). The request's own changing state is `pipeline.RequestState`'s."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmesh import tool_calls
from llmesh.errors import InvalidArgument
from llmesh.v1 import common_pb2, gateway_pb2
from services.gateway.admission import INTERACTIVE
from services.gateway.shape import answer_shape, semantic_allowed

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_TOP_K = 20
MAX_STOP_SEQUENCES = 4
MAX_STOP_BYTES = 64
MAX_SAMPLING_TOP_K = 1 << 20
MAX_STOP_TOKEN_IDS = 16
MAX_LOGIT_BIAS = 300
MAX_MODEL_BYTES = 256
MAX_TURNS = 256
TURN_ROLES = ("system", "user", "assistant", "tool")
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "choice")
MAX_SCHEMA_BYTES = 64 * 1024
MAX_CHOICES = 64
MAX_TOOLS = 64
# Tool calls in one assistant turn of a conversation.
MAX_TOOL_CALLS = 64
# GenerateRequest.n (OpenAI's n) and SamplingParams.top_logprobs (OpenAI's top_logprobs).
MAX_N = 16
MAX_TOP_LOGPROBS = 20
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_MODES = ("none", "auto", "required", "function")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and accurately."
CONTEXT_INSTRUCTION = (
    "Use the following context to answer the question. If the context does not contain the answer, "
    "answer from general knowledge.\n\nContext:\n"
)


@dataclass(frozen=True)
class GatewayConfig:
    default_collection: str
    default_top_k: int
    min_context_score: float
    max_prompt_bytes: int
    max_prompt_tokens: int
    max_new_tokens: int
    default_max_new_tokens: int
    log_prompts: bool = False
    # How long a learned collection version is trusted before it is refreshed (in the background).
    version_ttl: float = 2.0
    cache_store_budget: float = 2.0


def _wire(message: Any) -> bytes:
    return bytes(message.SerializeToString(deterministic=True))


@dataclass(frozen=True)
class Plan:
    """What one request will do, after validation and defaults (frozen plain data: see the
    module; hashable, and equal for equal asks)."""

    # The question: the one-turn prompt, or a conversation's last user turn (what retrieval
    # searches with and the cache keys on).
    prompt: str
    system_prompt: str
    # common_pb2.SamplingParams, as its (deterministic) wire bytes: read it as `sampling`.
    sampling_wire: bytes
    use_cache: bool
    use_retrieval: bool
    top_k: int
    collection: str
    tenant: str
    lane: str = INTERACTIVE
    # The model asked for ("" = the default); resolved to a route by `Gateway.route`.
    model: str = ""
    # What shapes the answer besides the scope's own fields (services/gateway/shape.py), and
    # whether a similar earlier question may answer it (the cache's semantic tier).
    shape: bytes = b""
    semantic: bool = True
    # The conversation as given (empty for the one-turn shorthand: system_prompt + prompt), each
    # turn a ChatMessage's wire bytes: read them as `turns`.
    turns_wire: tuple[bytes, ...] = ()
    # common_pb2.ResponseFormat's wire bytes: read it as `response_format`.
    response_format_wire: bytes = b""
    # A tool call is the answer: the function named ("" with tool_mode "required": one of them);
    # "auto": the model answers in text or calls `tools` (rendered with the turns).
    tool_mode: str = ""
    tool_function: str = ""
    # Each a common_pb2.Tool's wire bytes: read them as `tools`.
    tools_wire: tuple[bytes, ...] = ()
    # Independent answers to generate (GenerateRequest.n; 1 when unset). n > 1 is never cached.
    n: int = 1
    # A raw completion (GenerateRequest.raw): the prompt, or its token ids, is the model's whole
    # input (no template, no system prompt).
    raw: bool = False
    prompt_token_ids: tuple[int, ...] = ()

    @property
    def sampling(self) -> common_pb2.SamplingParams:
        """The sampling asked for (a fresh message: changing it changes no plan)."""
        return common_pb2.SamplingParams.FromString(self.sampling_wire)

    @property
    def turns(self) -> tuple[common_pb2.ChatMessage, ...]:
        return tuple(common_pb2.ChatMessage.FromString(turn) for turn in self.turns_wire)

    @property
    def tools(self) -> tuple[common_pb2.Tool, ...]:
        return tuple(common_pb2.Tool.FromString(tool) for tool in self.tools_wire)

    @property
    def response_format(self) -> common_pb2.ResponseFormat:
        return common_pb2.ResponseFormat.FromString(self.response_format_wire)

    def text_bytes(self) -> int:
        """Bytes of the text the model is given before retrieval (every turn, or the question and
        the effective system prompt)."""
        if self.raw:  # no system prompt; token ids weigh about four bytes each
            return len(self.prompt.encode()) + 4 * len(self.prompt_token_ids)
        turns = self.turns
        if turns:
            return sum(turn_bytes(t) for t in turns) + (0 if turns[0].role == "system" else len(DEFAULT_SYSTEM_PROMPT))
        return len(self.prompt.encode()) + len((self.system_prompt or DEFAULT_SYSTEM_PROMPT).encode())

    def grammar_tokens(self) -> int:
        """What the answer's constraint weighs, in prompt tokens: its schema, pattern or choices
        (a tool call's schema included) are compiled and walked at every step as a prompt of
        their size would be (bytes / 4). Counted in the admission weight beside the prompt."""
        form = self.response_format
        size = len(form.json_schema) + len(form.regex) + sum(len(c) for c in form.choices)
        if self.tool_mode == "auto":  # the calls' grammar holds every tool's parameters
            size += sum(len(t.parameters) + len(t.name) for t in self.tools)
        return size // 4

    def with_max_new_tokens(self, max_new_tokens: int) -> Plan:
        """The plan with another max_new_tokens (admission capped it)."""
        sampling = self.sampling
        sampling.max_new_tokens = max_new_tokens
        return dataclasses.replace(self, sampling_wire=_wire(sampling))

    def for_model(self, model: str) -> Plan:
        """The plan for one model of an alias (each tries the same ask on its own model)."""
        return dataclasses.replace(self, model=model)

    def without_retrieval(self) -> Plan:
        return self if not self.use_retrieval else dataclasses.replace(self, use_retrieval=False)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def turn_bytes(turn: common_pb2.ChatMessage) -> int:
    """What one turn gives the model in bytes: its text, its speaker's name, the call it answers
    and the calls it made (names, ids, arguments). All of it is rendered by the template."""
    size = _utf8_len(turn.content) + _utf8_len(turn.name) + _utf8_len(turn.tool_call_id)
    for call in turn.tool_calls:
        size += _utf8_len(call.id) + _utf8_len(call.name) + _utf8_len(call.arguments)
    return size


def _plain_turn(message: common_pb2.ChatMessage) -> bool:
    return not (message.name or message.tool_call_id or message.tool_calls)


def canonical_request(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """One spelling per request: a conversation that is only a question as the one-turn
    shorthand (`one_turn_form`), and a "text" response format as none (free text either way)."""
    request = one_turn_form(request)
    form = request.response_format
    if (
        request.HasField("response_format")
        and {f.name for f, _ in form.ListFields()} <= {"type"}
        and form.type in ("", "text")
    ):
        plain = gateway_pb2.GenerateRequest()
        plain.CopyFrom(request)
        plain.ClearField("response_format")
        return plain
    return request


def _check_response_format(form: common_pb2.ResponseFormat, bad: list[tuple[str, str]]) -> None:
    """The shapes a response format must have; whether the grammar library can compile it is the
    engine's to say (INVALID_ARGUMENT naming response_format.json_schema or .regex)."""
    where = "response_format"
    if form.type not in RESPONSE_FORMATS:
        bad.append((f"{where}.type", f"must be one of {', '.join(RESPONSE_FORMATS)}"))
        return
    given = {f.name for f, _ in form.ListFields()} - {"type"}
    allowed = {"json_schema": {"json_schema", "strict", "name"}, "regex": {"regex"}, "choice": {"choices"}}
    for name in sorted(given - allowed.get(form.type, set())):
        bad.append((f"{where}.{name}", f"not used with type {form.type!r}"))
    if form.type == "json_schema":
        if len(form.json_schema.encode()) > MAX_SCHEMA_BYTES:
            bad.append((f"{where}.json_schema", f"longer than {MAX_SCHEMA_BYTES} bytes"))
        else:
            try:
                schema = json.loads(form.json_schema)
            except ValueError as exc:
                bad.append((f"{where}.json_schema", f"not JSON: {exc}"))
            else:
                if not isinstance(schema, (dict, bool)):
                    bad.append((f"{where}.json_schema", "must be a JSON Schema (an object)"))
    elif form.type == "regex":
        if not form.regex or len(form.regex.encode()) > MAX_SCHEMA_BYTES:
            bad.append((f"{where}.regex", f"must be 1..{MAX_SCHEMA_BYTES} bytes"))
    elif form.type == "choice":
        if not 1 <= len(form.choices) <= MAX_CHOICES:
            bad.append((f"{where}.choices", f"1..{MAX_CHOICES} choices"))
        for i, choice in enumerate(form.choices):
            if not choice or len(choice.encode()) > MAX_STOP_BYTES * 16:
                bad.append((f"{where}.choices[{i}]", f"must be 1..{MAX_STOP_BYTES * 16} bytes"))


def _check_tools(request: gateway_pb2.GenerateRequest, bad: list[tuple[str, str]]) -> str:
    """Checks tools and tool_choice; returns the effective mode ("" without tools or with "none")."""
    tools, choice = request.tools, request.tool_choice
    if len(tools) > MAX_TOOLS:
        bad.append(("tools", f"at most {MAX_TOOLS} tools"))
        return ""  # counted before walked: nothing of the rest is looked at
    names = [t.name for t in tools]
    # The tools are the schemas a call decodes under (one grammar of them all for "required"), and
    # the template renders every description: they are held to one schema's size together.
    schema_bytes = sum(_utf8_len(t.parameters) + _utf8_len(t.description) for t in tools)
    if schema_bytes > MAX_SCHEMA_BYTES:
        bad.append(("tools", f"parameters and descriptions longer than {MAX_SCHEMA_BYTES} bytes in all"))
        return ""
    for i, tool in enumerate(tools):
        if not TOOL_NAME_RE.match(tool.name):
            bad.append((f"tools[{i}].name", "1-64 letters, digits, '_' or '-'"))
        elif names.index(tool.name) != i:
            bad.append((f"tools[{i}].name", "two tools have this name"))
        if tool.parameters:
            try:
                parameters = json.loads(tool.parameters)
            except ValueError as exc:
                bad.append((f"tools[{i}].parameters", f"not JSON: {exc}"))
            else:
                if not isinstance(parameters, dict):
                    bad.append((f"tools[{i}].parameters", "must be a JSON Schema (an object)"))
    mode = choice.mode or ("auto" if tools else "")
    if not request.HasField("tool_choice") and not tools:
        return ""
    if mode not in TOOL_MODES:
        bad.append(("tool_choice.mode", f"must be one of {', '.join(TOOL_MODES)}"))
        return ""
    if not tools and mode != "none":
        bad.append(("tool_choice", "needs tools"))
    elif mode == "function" and choice.function not in names:
        bad.append(("tool_choice.function", "must name one of the tools"))
    elif mode != "function" and choice.function:
        bad.append(("tool_choice.function", "only with mode 'function'"))
    if mode in ("required", "function") and request.HasField("response_format"):
        bad.append(("response_format", "a tool call is the answer's form: set tool_choice or response_format"))
    elif mode == "auto" and request.HasField("response_format"):
        bad.append(("response_format", "with tool_choice 'auto' the answer is text or calls: set one of them"))
    return mode if mode in ("required", "function", "auto") else ""


def tool_format(request: gateway_pb2.GenerateRequest, mode: str) -> common_pb2.ResponseFormat:
    """The constraint a tool call decodes under: the named function's parameter schema, or for
    "required" one object {"name": <a tool>, "arguments": <its parameters>}."""

    def parameters(tool: common_pb2.Tool) -> Any:
        return json.loads(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}

    if mode == "function":
        tool = next(t for t in request.tools if t.name == request.tool_choice.function)
        schema = parameters(tool)
    else:
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": parameters(t)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in request.tools
            ]
        }
    return common_pb2.ResponseFormat(type="json_schema", json_schema=json.dumps(schema), strict=True)


def as_tool_calls(plan: Plan, response: gateway_pb2.GenerateResponse, tool_format: str = "hermes") -> None:
    """A tool-call answer's text (the arguments, or {"name", "arguments"}) as its tool_calls; the
    text is then empty and finish_reason says tool_calls (length still says length). "auto":
    the calls the text holds in the model's `tool_format`, the text outside them stays."""
    if not plan.tool_mode or not response.text:
        return
    if plan.tool_mode == "auto":
        text, calls = tool_calls.parse(response.text, tool_format, tool_calls.names_of(plan.tools))
        set_calls(
            response,
            text,
            [common_pb2.ToolCall(id=tool_calls.call_id(), name=c.name, arguments=c.arguments) for c in calls],
        )
        return
    name, arguments = plan.tool_function, response.text
    if plan.tool_mode == "required":
        try:
            call = json.loads(response.text)
            name, arguments = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            return  # not a call after all (cannot happen under the constraint): the text stays
    response.tool_calls.append(common_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments))
    response.text = ""
    if response.finish_reason != common_pb2.FINISH_REASON_LENGTH:
        response.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS


def set_calls(response: gateway_pb2.GenerateResponse, text: str, calls: Sequence[common_pb2.ToolCall]) -> None:
    """An automatic tool choice's answer: its text, its calls, and finish_reason tool_calls when
    it made any (length still says length)."""
    if not calls:
        return
    response.text = text
    response.tool_calls.extend(calls)
    if response.finish_reason != common_pb2.FINISH_REASON_LENGTH:
        response.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS


def one_turn_form(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """The request with a conversation that is only a question (one user turn, after at most
    one system turn, neither naming a speaker) written in the one-turn shorthand (`prompt`,
    `system_prompt`): both spellings of one question are one request (one cache entry, one
    rendering). Anything else is returned as it is."""
    turns = request.messages
    if not turns or request.raw or not all(_plain_turn(t) for t in turns):
        return request
    roles = [t.role for t in turns]
    if roles not in (["user"], ["system", "user"]) or request.prompt or request.system_prompt:
        return request
    shorthand = gateway_pb2.GenerateRequest()
    shorthand.CopyFrom(request)
    shorthand.ClearField("messages")
    shorthand.prompt = turns[-1].content
    shorthand.system_prompt = turns[0].content if len(turns) == 2 else ""
    return shorthand


def _check_turns(request: gateway_pb2.GenerateRequest, config: GatewayConfig, bad: list[tuple[str, str]]) -> str:
    """Checks a conversation; returns its question (the last user turn's content)."""
    turns = request.messages
    if request.prompt:
        bad.append(("prompt", "set messages or prompt, not both"))
    if request.system_prompt:
        bad.append(("system_prompt", "with messages, give the system prompt as a turn with role 'system'"))
    if len(turns) > MAX_TURNS:
        bad.append(("messages", f"at most {MAX_TURNS} turns"))
        return ""  # counted before walked: no turn is looked at
    size = 0
    call_ids: set[str] = set()
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if len(turn.tool_calls) > MAX_TOOL_CALLS:
            bad.append((f"{where}.tool_calls", f"at most {MAX_TOOL_CALLS} tool calls"))
            return ""
        size += turn_bytes(turn)
        if turn.role not in TURN_ROLES:
            bad.append((f"{where}.role", f"must be one of {', '.join(TURN_ROLES)}"))
        if turn.tool_calls and turn.role != "assistant":
            bad.append((f"{where}.tool_calls", "only an assistant turn makes tool calls"))
        for j, call in enumerate(turn.tool_calls):
            if not call.name:
                bad.append((f"{where}.tool_calls[{j}].name", "must not be empty"))
            call_ids.add(call.id)
        if turn.role == "tool":
            if not turn.tool_call_id:
                bad.append((f"{where}.tool_call_id", "a tool turn names the tool call it answers"))
            elif turn.tool_call_id not in call_ids:
                bad.append((f"{where}.tool_call_id", "answers no tool call of an earlier assistant turn"))
        elif turn.tool_call_id:
            bad.append((f"{where}.tool_call_id", "only a tool turn answers a tool call"))
        if turn.role in ("system", "user") and not turn.content.strip():
            bad.append((f"{where}.content", "must not be empty"))
    if size > config.max_prompt_bytes:
        bad.append(("messages", f"longer than {config.max_prompt_bytes} bytes in all"))
    users = [t for t in turns if t.role == "user"]
    if not users:
        bad.append(("messages", "at least one turn with role 'user' is required"))
    elif turns[-1].role not in ("user", "tool"):
        bad.append(("messages", "the last turn must be the user's or a tool's (the model answers it)"))
    return users[-1].content if users else ""


def _check_raw(request: gateway_pb2.GenerateRequest, config: GatewayConfig, bad: list[tuple[str, str]]) -> None:
    """A raw completion: the prompt or its token ids, and nothing a template would render."""
    if not request.raw:
        if request.prompt_token_ids:
            bad.append(("prompt_token_ids", "only for a raw completion (raw: true)"))
        return
    for name in ("messages", "tools"):
        if len(getattr(request, name)):
            bad.append((name, "a raw completion has no template to render it: give the prompt as it is"))
    if request.system_prompt:
        bad.append(("system_prompt", "a raw completion has no system prompt: put it in the prompt"))
    if request.prompt and request.prompt_token_ids:
        bad.append(("prompt_token_ids", "set prompt or prompt_token_ids, not both"))
    elif not request.prompt and not request.prompt_token_ids:
        bad.append(("prompt", "must not be empty"))
    if len(request.prompt_token_ids) > config.max_prompt_tokens:
        bad.append(("prompt_token_ids", f"at most {config.max_prompt_tokens} tokens"))
    if request.prompt_token_ids and request.use_retrieval:
        bad.append(("use_retrieval", "retrieval searches with text: give the prompt as text"))


def validate(request: gateway_pb2.GenerateRequest, config: GatewayConfig) -> Plan:
    """Checks every field and fills defaults; all problems are reported at once."""
    bad: list[tuple[str, str]] = []
    request = canonical_request(request)
    if request.HasField("response_format"):
        _check_response_format(request.response_format, bad)
    tool_mode = _check_tools(request, bad)
    _check_raw(request, config, bad)
    if request.raw:
        prompt = request.prompt
        if len(prompt.encode("utf-8", "surrogatepass")) > config.max_prompt_bytes:
            bad.append(("prompt", f"longer than {config.max_prompt_bytes} bytes"))
    elif request.messages:
        prompt = _check_turns(request, config, bad)
    else:
        prompt = request.prompt
        if not prompt.strip():
            bad.append(("prompt", "must not be empty"))
        if len(prompt.encode("utf-8", "surrogatepass")) > config.max_prompt_bytes:
            bad.append(("prompt", f"longer than {config.max_prompt_bytes} bytes"))
    if len(request.system_prompt.encode("utf-8", "surrogatepass")) > config.max_prompt_bytes:
        bad.append(("system_prompt", f"longer than {config.max_prompt_bytes} bytes"))
    s = request.sampling
    if s.max_new_tokens > config.max_new_tokens:
        bad.append(("sampling.max_new_tokens", f"at most {config.max_new_tokens}"))
    if not (0.0 <= s.temperature <= 2.0) or math.isnan(s.temperature):
        bad.append(("sampling.temperature", "must be in [0, 2]"))
    if not (0.0 <= s.top_p <= 1.0) or math.isnan(s.top_p):
        bad.append(("sampling.top_p", "must be in [0, 1]"))
    if not (0.0 <= s.min_p <= 1.0) or math.isnan(s.min_p):
        bad.append(("sampling.min_p", "must be in [0, 1]"))
    if s.top_k > MAX_SAMPLING_TOP_K:
        bad.append(("sampling.top_k", f"at most {MAX_SAMPLING_TOP_K}"))
    if not (0.0 <= s.repetition_penalty <= 2.0) or math.isnan(s.repetition_penalty):
        bad.append(("sampling.repetition_penalty", "must be in (0, 2] (0 or 1: off)"))
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (-2.0 <= value <= 2.0) or math.isnan(value):
            bad.append((f"sampling.{name}", "must be in [-2, 2]"))
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad.append(("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}"))
    if len(s.logit_bias) > MAX_LOGIT_BIAS or any(not (-100.0 <= b <= 100.0) for b in s.logit_bias.values()):
        bad.append(("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, each bias in [-100, 100]"))
    if s.HasField("prompt_logprobs") and s.prompt_logprobs > MAX_TOP_LOGPROBS:
        bad.append(("sampling.prompt_logprobs", f"at most {MAX_TOP_LOGPROBS}"))
    if s.min_new_tokens > (s.max_new_tokens or config.default_max_new_tokens) and not s.prompt_only:
        bad.append(("sampling.min_new_tokens", "at most max_new_tokens"))
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        bad.append(("sampling.top_logprobs", f"at most {MAX_TOP_LOGPROBS}"))
    elif s.top_logprobs and not s.logprobs:
        bad.append(("sampling.top_logprobs", "needs sampling.logprobs"))
    if request.n > MAX_N:
        bad.append(("n", f"at most {MAX_N}"))
    if len(s.stop) > MAX_STOP_SEQUENCES:
        bad.append(("sampling.stop", f"at most {MAX_STOP_SEQUENCES} stop sequences"))
    for i, stop in enumerate(s.stop):
        if not stop or len(stop.encode()) > MAX_STOP_BYTES:
            bad.append((f"sampling.stop[{i}]", f"must be 1..{MAX_STOP_BYTES} bytes"))
    if len(request.model.encode("utf-8", "surrogatepass")) > MAX_MODEL_BYTES:
        bad.append(("model", f"longer than {MAX_MODEL_BYTES} bytes"))
    if request.top_k > MAX_TOP_K:
        bad.append(("top_k", f"at most {MAX_TOP_K}"))
    for name in ("collection", "tenant"):
        value = getattr(request, name)
        if value and not NAME_RE.match(value):
            bad.append((name, "letters, digits, '_', '.', '-' only, at most 64 characters"))
    if bad:
        raise InvalidArgument(bad)
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(s)
    if not sampling.max_new_tokens:
        sampling.max_new_tokens = config.default_max_new_tokens
    if sampling.temperature == 0.0:
        # Greedy: top_p, top_k, min_p and seed change nothing; clear them so equal requests share
        # a cache entry.
        sampling.top_p = 0.0
        sampling.top_k = 0
        sampling.min_p = 0.0
        sampling.ClearField("seed")
    if sampling.prompt_only:
        # Nothing is generated: one token's weight in admission, and no generation settings.
        sampling.max_new_tokens = 1
        sampling.min_new_tokens = 0
    if sampling.repetition_penalty == 1.0:
        sampling.repetition_penalty = 0.0  # 1 and 0 both mean off
    if len(sampling.stop_token_ids) > 1:
        ids = sorted(set(sampling.stop_token_ids))
        del sampling.stop_token_ids[:]
        sampling.stop_token_ids.extend(ids)
    for token in [t for t, b in sampling.logit_bias.items() if b == 0.0]:
        del sampling.logit_bias[token]  # a zero bias changes nothing
    n = max(1, request.n)
    # n > 1 or log probabilities: the answer cache is not used. A cached answer holds one text and
    # no log probabilities, so a hit could only return less than was asked for.
    scored = sampling.logprobs or sampling.HasField("prompt_logprobs") or sampling.prompt_only
    use_cache = (request.use_cache if request.HasField("use_cache") else True) and n == 1 and not scored
    # A raw prompt given as token ids has no text to key or store an answer under.
    use_cache = use_cache and not request.prompt_token_ids
    # A raw completion is the model's whole input: context only when the caller asks for it.
    use_retrieval = request.use_retrieval if request.HasField("use_retrieval") else not request.raw
    return Plan(
        prompt=prompt,
        system_prompt=request.system_prompt,
        shape=answer_shape(request, request.system_prompt or DEFAULT_SYSTEM_PROMPT),
        semantic=semantic_allowed(request),
        sampling_wire=_wire(sampling),
        use_cache=use_cache,
        use_retrieval=use_retrieval,
        top_k=request.top_k or config.default_top_k,
        collection=request.collection or config.default_collection,
        tenant=request.tenant or "default",
        lane=request.lane or INTERACTIVE,
        model=request.model,
        turns_wire=tuple(_wire(turn) for turn in request.messages),
        response_format_wire=_wire(tool_format(request, tool_mode) if tool_mode else request.response_format),
        tool_mode=tool_mode,
        tool_function=request.tool_choice.function if tool_mode == "function" else "",
        tools_wire=tuple(_wire(tool) for tool in request.tools) if tool_mode == "auto" else (),
        n=n,
        raw=request.raw,
        prompt_token_ids=tuple(request.prompt_token_ids),
    )


CONSERVATIVE_TOKENS_PER_BYTE = 1 / 3


def estimate_tokens(text: str) -> int:
    """A conservative local token estimate (BPE averages ~4 bytes a token on English; 3 errs high)."""
    return max(1, math.ceil(len(text.encode("utf-8")) * CONSERVATIVE_TOKENS_PER_BYTE))


def build_messages(plan: Plan, sources: list[common_pb2.ScoredChunk]) -> list[common_pb2.ChatMessage]:
    """The turns the model's template renders. The one rule for retrieved context: it is
    appended to the first turn, the system turn, after the system prompt. A conversation without
    a system turn, like a prompt without a system prompt, gets the default one
    (DEFAULT_SYSTEM_PROMPT). Every other turn is given as it is, in order."""
    if plan.turns_wire:
        turns = list(plan.turns)  # fresh messages
        if turns[0].role != "system":
            turns.insert(0, common_pb2.ChatMessage(role="system", content=DEFAULT_SYSTEM_PROMPT))
    else:
        turns = [
            common_pb2.ChatMessage(role="system", content=plan.system_prompt or DEFAULT_SYSTEM_PROMPT),
            common_pb2.ChatMessage(role="user", content=plan.prompt),
        ]
    if sources:
        context = "\n\n".join(f"[{i + 1}] {chunk.text.strip()}" for i, chunk in enumerate(sources))
        turns[0].content = f"{turns[0].content}\n\n{CONTEXT_INSTRUCTION}{context}"
    return turns


def raw_prompt(plan: Plan, sources: Sequence[common_pb2.ScoredChunk]) -> str:
    """A raw completion's text as the model reads it: the prompt as it is, after the retrieved
    context when the caller asked for retrieval."""
    if not sources:
        return plan.prompt
    context = "\n\n".join(f"[{i + 1}] {chunk.text.strip()}" for i, chunk in enumerate(sources))
    return f"{CONTEXT_INSTRUCTION}{context}\n\n{plan.prompt}"


class InputTokenPredictor:
    """Predicts a request's input tokens before retrieval and the tokenizer have run, from what
    earlier requests turned out to be: tokens per byte of prompt text (chat template included)
    and, per collection, the tokens its retrieved context adds. Never below bytes / 8, a bound no
    BPE tokenizer undercuts; until it has seen requests it predicts just that bound."""

    ALPHA = 0.1
    MAX_COLLECTIONS = 1024

    def __init__(self) -> None:
        self.tokens_per_byte = 0.0
        self.context_tokens: dict[str, float] = {}
        # Tokens per byte of retrieved context (the estimate while the tokenizer is away).
        self.context_tokens_per_byte = 0.0

    @staticmethod
    def text_bytes(plan: Plan) -> int:
        return plan.text_bytes()

    def predict(self, plan: Plan) -> int:
        size = self.text_bytes(plan)
        floor = max(1, size // 8)
        if not self.tokens_per_byte:
            return floor
        context = self.context_tokens.get(plan.collection, 0.0) if plan.use_retrieval else 0.0
        guess = size * self.tokens_per_byte + context
        return max(floor, int(guess))

    def estimate(self, plan: Plan, context_bytes: int, rendered: str) -> int:
        """Tokens of a rendered prompt while the tokenizer is away, on the same learned rates the
        prediction uses (the question's, the template's overhead folded in, and the retrieved
        context's, which a short question's rate overstates twofold), with a 10 % margin; the
        conservative `estimate_tokens` before anything was learned."""
        if not self.tokens_per_byte:
            return estimate_tokens(rendered)
        context_rate = self.context_tokens_per_byte or CONSERVATIVE_TOKENS_PER_BYTE
        guess = self.text_bytes(plan) * self.tokens_per_byte + context_bytes * context_rate
        return max(1, len(rendered.encode("utf-8")) // 8, math.ceil(guess * 1.1))

    def observe(self, plan: Plan, input_tokens: int, context_bytes: int = 0) -> None:
        """Learns from a request's exact token count; `context_bytes`: the retrieved context it held."""
        size = max(1, self.text_bytes(plan))
        if not context_bytes:
            rate = input_tokens / size
            self.tokens_per_byte = rate if not self.tokens_per_byte else _ema(self.tokens_per_byte, rate, self.ALPHA)
        elif self.tokens_per_byte:
            added = max(0.0, input_tokens - size * self.tokens_per_byte)
            known = self.context_tokens.get(plan.collection)
            if known is None and len(self.context_tokens) >= self.MAX_COLLECTIONS:
                self.context_tokens.pop(next(iter(self.context_tokens)))
            self.context_tokens[plan.collection] = added if known is None else _ema(known, added, self.ALPHA)
            rate = added / context_bytes
            self.context_tokens_per_byte = (
                rate if not self.context_tokens_per_byte else _ema(self.context_tokens_per_byte, rate, self.ALPHA)
            )


def context_bytes(sources: Sequence[common_pb2.ScoredChunk]) -> int:
    """What retrieved chunks add to a prompt's text, in bytes (their text and the instruction)."""
    if not sources:
        return 0
    return len(CONTEXT_INSTRUCTION) + sum(len(chunk.text.encode("utf-8")) + 6 for chunk in sources)


def _ema(old: float, new: float, alpha: float) -> float:
    return old + alpha * (new - old)
