"""The gateway's request pipeline: cache -> retrieval -> prompt -> count -> inference -> cache.

Works on protobuf messages as plain data and on `Peers` for the downstream calls; it knows
nothing of the gateway's own gRPC server. Every optional hop degrades instead of failing:
no cache when the cache is down, no context when retrieval is down, and the response lists
what was left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from llmesh.chat_template import ChatTemplate, TemplateRefused
from llmesh.errors import InvalidArgument, LlmeshError, NotFound, PermissionDenied, ResourceExhausted, Unavailable
from llmesh.metrics import trace_exemplar
from llmesh.telemetry import current_trace_id
from llmesh.v1 import cache_pb2, common_pb2, gateway_pb2, inference_pb2, retrieval_pb2
from services.gateway import metrics
from services.gateway.admission import (
    INTERACTIVE,
    REASON_DEADLINE,
    Admission,
    AdmissionController,
    Ask,
    Hold,
    LoadBook,
    RedisWeightWindow,
    RequestTooHeavy,
    Ticket,
    WeightWindow,
)
from services.gateway.auth import Caller
from services.gateway.breaker import BreakerOpen, State
from services.gateway.embeddings import Embeddings
from services.gateway.limits import KeyLimitExceeded
from services.gateway.peers import (
    BREAKER_FAILURE_CODES,
    CallerDeadline,
    Deadline,
    PeerCallError,
    Peers,
    inference_peer,
)
from services.gateway.recent_hits import RecentHits, request_key
from services.gateway.shape import answer_shape, cache_scope, semantic_allowed
from services.gateway.usage import UsageMeter

# A downstream that failed, or whose breaker is open: optional hops degrade on these.
DOWNSTREAM_ERRORS = (PeerCallError, BreakerOpen)

log = logging.getLogger("llmesh.gateway")

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
MODEL_INFO_TTL_S = 30.0
# Retrieval searches with at most this much question (RetrievalSearchRequest.query); a longer one
# is answered without context.
RETRIEVAL_MAX_QUERY_BYTES = 16 * 1024
# Cache stores run after the final message, in the background; past this many the rest are skipped.
MAX_BACKGROUND_STORES = 64
# A request that would be shed on a miss waits for the cache only this long: a refusal is fast
# whatever state the cache is in (frozen, or its breaker still deciding).
SHED_RISK_LOOKUP_S = 0.02
# ...unless the cache answered that request lately and keeps answering other lookups (busy, not
# frozen): then it waits up to this long in all, so a refusal stays fast...
KNOWN_HIT_WAIT_S = 0.05
# ...checking every this long that the cache answered something within the last this long.
CACHE_ALIVE_S = 0.01
# After the cache failed or answered degraded, requests decide admission before looking it up
# for this long.
CACHE_SUSPECT_S = 1.0
# Background calls (version refresh, cache store) have no caller: a deadline well past any hop
# budget, so the budget bounds them and its timeout counts against the hop.
BACKGROUND_DEADLINE_S = 30.0
CACHEABLE_FINISH = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_TOOL_CALLS,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP_SEQUENCE,
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


@dataclass
class Plan:
    """What one request will do, after validation and defaults."""

    # The question: the one-turn prompt, or a conversation's last user turn (what retrieval
    # searches with and the cache keys on).
    prompt: str
    system_prompt: str
    sampling: common_pb2.SamplingParams
    use_cache: bool
    use_retrieval: bool
    top_k: int
    collection: str
    tenant: str
    lane: str = INTERACTIVE
    # The model asked for ("" = the default); resolved to a route by `Gateway.route`.
    model: str = ""
    degradations: list[str] = field(default_factory=list)
    # The predicted weight reserved from the precheck until the exact admission.
    hold: Hold | None = None
    # The admitted reservation: progress reported as tokens arrive, finished on every exit path.
    ticket: Ticket | None = None
    # issue 26: the prompt-length predictor of the model the request goes to (one per model).
    predictor: InputTokenPredictor | None = None
    # Milliseconds spent per hop, returned to the caller as `server-timing` metadata.
    timings: dict[str, float] = field(default_factory=dict)
    # issue 29: tokens spent so far, counted for a request that ends without its final message.
    spent: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    # What shapes the answer besides the scope's own fields (services/gateway/shape.py), and
    # whether a similar earlier question may answer it (the cache's semantic tier).
    shape: bytes = b""
    semantic: bool = True
    # The conversation as given (empty for the one-turn shorthand: system_prompt + prompt).
    turns: tuple[common_pb2.ChatMessage, ...] = ()
    response_format: common_pb2.ResponseFormat = field(default_factory=common_pb2.ResponseFormat)
    # A tool call is the answer: the function named ("" with tool_mode "required": one of them).
    tool_mode: str = ""
    tool_function: str = ""
    # Independent answers to generate (GenerateRequest.n; 1 when unset). n > 1 is never cached.
    n: int = 1

    def text_bytes(self) -> int:
        """Bytes of the text the model is given before retrieval (every turn, or the question and
        the effective system prompt)."""
        if self.turns:
            return sum(len(t.content.encode("utf-8", "surrogatepass")) for t in self.turns) + (
                0 if self.turns[0].role == "system" else len(DEFAULT_SYSTEM_PROMPT)
            )
        return len(self.prompt.encode()) + len((self.system_prompt or DEFAULT_SYSTEM_PROMPT).encode())

    @contextlib.contextmanager
    def timed(self, hop: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[hop] = self.timings.get(hop, 0.0) + (time.perf_counter() - started) * 1000

    def degrade(self, what: str) -> None:
        if what not in self.degradations:
            self.degradations.append(what)
            metrics.DEGRADED.labels(what).inc()


@dataclass
class Delta:
    text: str
    # The answer it belongs to (n > 1) and its tokens' log probabilities (SamplingParams.logprobs).
    index: int = 0
    logprobs: Sequence[common_pb2.TokenLogprob] = ()


@dataclass
class Answer:
    """One of a request's n answers while it is generated."""

    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    generated: int = 0
    finished: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def total_usage(answers: Sequence[Answer], input_tokens: int) -> common_pb2.Usage:
    """The request's usage: every answer's as inference reported it (n > 1: the prompt was
    processed once per answer), `input_tokens` for an answer that never reported any."""
    usage = common_pb2.Usage()
    for answer in answers:
        usage.input_tokens += answer.usage.input_tokens if answer.finished else input_tokens
        usage.output_tokens += answer.usage.output_tokens
        usage.cached_input_tokens += answer.usage.cached_input_tokens
        usage.cached_output_tokens += answer.usage.cached_output_tokens
    return usage


@dataclass
class Final:
    response: gateway_pb2.GenerateResponse
    timings: dict[str, float] = field(default_factory=dict)


def server_timing(timings: dict[str, float]) -> str:
    """The W3C Server-Timing form: `cache;dur=0.8, inference;dur=412.3`."""
    return ", ".join(f"{hop};dur={ms:.1f}" for hop, ms in timings.items())


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
    names = [t.name for t in tools]
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
    elif mode == "auto":
        # The served models' templates and this gateway have no documented tool-call parser:
        # the model cannot decide by itself, so the caller says which call (or none) it wants.
        bad.append(("tool_choice", "'auto' is not supported by the served models; use 'required' or name a function"))
    if mode in ("required", "function") and request.HasField("response_format"):
        bad.append(("response_format", "a tool call is the answer's form: set tool_choice or response_format"))
    return mode if mode in ("required", "function") else ""


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


def as_tool_calls(plan: Plan, response: gateway_pb2.GenerateResponse) -> None:
    """A tool-call answer's text (the arguments, or {"name", "arguments"}) as its tool_calls; the
    text is then empty and finish_reason says tool_calls (length still says length)."""
    if not plan.tool_mode or not response.text:
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


def one_turn_form(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
    """The request with a conversation that is only a question (one user turn, after at most
    one system turn, neither naming a speaker) written in the one-turn shorthand (`prompt`,
    `system_prompt`): both spellings of one question are one request (one cache entry, one
    rendering). Anything else is returned as it is."""
    turns = request.messages
    if not turns or not all(_plain_turn(t) for t in turns):
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
    size = 0
    call_ids: set[str] = set()
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        size += len(turn.content.encode("utf-8", "surrogatepass"))
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


def validate(request: gateway_pb2.GenerateRequest, config: GatewayConfig) -> Plan:
    """Checks every field and fills defaults; all problems are reported at once."""
    bad: list[tuple[str, str]] = []
    request = canonical_request(request)
    if request.HasField("response_format"):
        _check_response_format(request.response_format, bad)
    tool_mode = _check_tools(request, bad)
    if request.messages:
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
    use_cache = (request.use_cache if request.HasField("use_cache") else True) and n == 1 and not sampling.logprobs
    return Plan(
        prompt=prompt,
        system_prompt=request.system_prompt,
        shape=answer_shape(request, request.system_prompt or DEFAULT_SYSTEM_PROMPT),
        semantic=semantic_allowed(request),
        sampling=sampling,
        use_cache=use_cache,
        use_retrieval=request.use_retrieval if request.HasField("use_retrieval") else True,
        top_k=request.top_k or config.default_top_k,
        collection=request.collection or config.default_collection,
        tenant=request.tenant or "default",
        lane=request.lane or INTERACTIVE,
        model=request.model,
        turns=tuple(request.messages),
        response_format=tool_format(request, tool_mode) if tool_mode else request.response_format,
        tool_mode=tool_mode,
        tool_function=request.tool_choice.function if tool_mode == "function" else "",
        n=n,
    )


def from_cache(
    plan: Plan, hit: cache_pb2.CacheLookupResponse, model: str, answered_by: str = ""
) -> tuple[Delta, Final]:
    """The events of a cache hit; it carries what this request degraded (how it reached the
    scope it was answered under, e.g. without retrieval). Its usage bills nothing processed or
    generated: the cached answer's tokens were saved (issue 29)."""
    if plan.hold is not None:
        plan.hold.release()
    answer = hit.answer
    saved = common_pb2.Usage(
        cached_input_tokens=answer.usage.input_tokens + answer.usage.cached_input_tokens,
        cached_output_tokens=answer.usage.output_tokens + answer.usage.cached_output_tokens,
    )
    response = gateway_pb2.GenerateResponse(
        text=answer.text,
        finish_reason=answer.finish_reason,
        usage=saved,
        cache=gateway_pb2.CacheInfo(hit=True, tier=hit.tier, similarity=hit.similarity),
        sources=answer.sources,
        trace_id=current_trace_id(),
        model=model,
        degradations=plan.degradations,
        answered_by=answered_by,
    )
    as_tool_calls(plan, response)
    return Delta(answer.text), Final(response, plan.timings)


def render_chatml(messages: list[common_pb2.ChatMessage]) -> str:
    """ChatML: the last resort while the tokenizer is down and the model's own template is not
    known here (see `Gateway._render_locally`)."""
    body = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


CONSERVATIVE_TOKENS_PER_BYTE = 1 / 3


def estimate_tokens(text: str) -> int:
    """A conservative local token estimate (BPE averages ~4 bytes a token on English; 3 errs high)."""
    return max(1, math.ceil(len(text.encode("utf-8")) * CONSERVATIVE_TOKENS_PER_BYTE))


def build_messages(plan: Plan, sources: list[common_pb2.ScoredChunk]) -> list[common_pb2.ChatMessage]:
    """The turns the model's template renders. The one rule for retrieved context: it is
    appended to the first turn, the system turn, after the system prompt. A conversation without
    a system turn, like a prompt without a system prompt, gets the default one
    (DEFAULT_SYSTEM_PROMPT). Every other turn is given as it is, in order."""
    if plan.turns:
        turns = [copy_turn(t) for t in plan.turns]
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


def copy_turn(turn: common_pb2.ChatMessage) -> common_pb2.ChatMessage:
    copied = common_pb2.ChatMessage()
    copied.CopyFrom(turn)
    return copied


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


def _worth_a_fallback(exc: BaseException) -> bool:
    """issue 29: an alias's next model is tried when this one is unavailable or shed, not when
    the request itself is wrong (those errors would be the same on any model)."""
    if isinstance(exc, KeyLimitExceeded):
        return False
    if isinstance(exc, PeerCallError):
        return exc.code in BREAKER_FAILURE_CODES or exc.code.name == "RESOURCE_EXHAUSTED"
    return isinstance(exc, (Unavailable, ResourceExhausted))


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieves a background call's outcome (no "exception was never retrieved" warnings)."""
    if not task.cancelled():
        task.exception()


def _ema(old: float, new: float, alpha: float) -> float:
    return old + alpha * (new - old)


@dataclass
class KnownVersion:
    """A collection's version as last learned from retrieval."""

    info: retrieval_pb2.CollectionInfo
    learned_at: float
    # The last refresh failed: answers grounded in this version are marked degraded.
    unconfirmed: bool = False
    refreshing: asyncio.Task[None] | None = None


class CollectionVersions:
    """Collection versions off the hit path: learned once, trusted for `ttl` seconds, then served
    while a single background refresh asks retrieval again (stale-while-revalidate). An ingest
    through this gateway forgets the entry, so the next request learns the new version at once;
    other replicas learn it within `ttl`. While retrieval is down the last known version is kept
    (marked unconfirmed, and asked again on every request until retrieval answers), so cached
    answers for it still serve."""

    MAX_ENTRIES = 4096

    def __init__(self, peers: Peers, ttl: float) -> None:
        self.peers = peers
        self.ttl = ttl
        self.known: dict[tuple[str, str], KnownVersion] = {}

    async def get(self, collection: str, tenant: str, deadline: Deadline) -> KnownVersion:
        """The known version (refreshed in the background when older than ttl); the first time,
        retrieval is asked in the request's path and its errors are raised."""
        key = (tenant, collection)
        known = self.known.get(key)
        if known is None:
            info = await self.peers.collection_info(collection, tenant, deadline)
            if len(self.known) >= self.MAX_ENTRIES:
                self.known.pop(next(iter(self.known)))
            known = self.known[key] = KnownVersion(info, time.monotonic())
            return known
        # An unconfirmed version is asked again at once (one call at a time): retrieval's return
        # is noticed on the next request, not a TTL later.
        stale = known.unconfirmed or time.monotonic() - known.learned_at >= self.ttl
        if stale and known.refreshing is None:
            known.refreshing = asyncio.get_running_loop().create_task(self._refresh(key, known))
        return known

    async def _refresh(self, key: tuple[str, str], known: KnownVersion) -> None:
        tenant, collection = key
        try:
            # No caller waits: the hop's own budget bounds the call, and its timeout is a verdict.
            info = await self.peers.collection_info(collection, tenant, Deadline.after(BACKGROUND_DEADLINE_S))
        except (*DOWNSTREAM_ERRORS, LlmeshError) as exc:
            known.unconfirmed = True
            log.warning("collection version refresh failed, keeping version %d: %s", known.info.version, exc.message)
        else:
            known.info, known.unconfirmed = info, False
        finally:
            known.learned_at = time.monotonic()
            known.refreshing = None

    def forget(self, collection: str, tenant: str) -> None:
        self.known.pop((tenant, collection), None)

    def observe(self, collection: str, tenant: str, version: int) -> None:
        """A newer version seen elsewhere (the cache's lookup, a search): trusted from now on."""
        known = self.known.get((tenant, collection))
        if known is not None and version > known.info.version:
            info = retrieval_pb2.CollectionInfo()
            info.CopyFrom(known.info)
            info.version = version
            known.info, known.learned_at, known.unconfirmed = info, time.monotonic(), False


def model_key_of(info: inference_pb2.ModelInfo) -> str:
    """`model_id@sha256[:16]/dtype` ("SmolLM2-135M-Instruct@0123456789abcdef/bfloat16"); the
    dtype is left out where the backend does not report one (the openai backend)."""
    key = f"{info.model_id}@{info.sha256[:16]}"
    return f"{key}/{info.dtype}" if info.dtype else key


@dataclass
class ModelRoute:
    """One model the gateway routes to: its name (requests' `model`), its inference peer in
    `Peers` (own channel and circuit breaker: `inference_peer(name)`), the tokenizer it asks for,
    and its model key as last learned from its inference. Admission is per model through the
    model key (`WeightWindow.capacity(key)`: its own in-flight limit, learned from its own
    tokens). The name "" is the one model of a deployment that lists none (LLMESH_MODELS empty):
    its public name is the id its inference reports, and the tokenizer's default serves it."""

    name: str
    # (when learned, model key)
    learned: tuple[float, str] | None = None

    @property
    def tokenizer(self) -> str:
        return self.name

    def expire(self) -> None:
        """The next `model_key` asks inference again (the learned key serves if it fails)."""
        if self.learned is not None:
            self.learned = (-math.inf, self.learned[1])

    def expired(self) -> bool:
        return self.learned is not None and self.learned[0] == -math.inf

    def public_name(self) -> str | None:
        """The name clients see and route by; for the unnamed model, None until learned."""
        if self.name:
            return self.name
        return self.learned[1].rpartition("@")[0] if self.learned is not None else None


class Gateway:
    def __init__(
        self,
        peers: Peers,
        config: GatewayConfig,
        window: WeightWindow | RedisWeightWindow,
        models: Sequence[str] = ("",),
        default_model: str = "",
        aliases: Mapping[str, Sequence[str]] | None = None,
        usage: UsageMeter | None = None,
        loads: LoadBook | None = None,
        local_templates: Mapping[str, ChatTemplate] | None = None,
    ) -> None:
        self.peers = peers
        # Chat templates by tokenizer name (a route's `tokenizer`): learned from the tokenizer
        # service, and those read from the models folder at start (for while it is away).
        self.templates: dict[str, ChatTemplate] = {}
        self.local_templates = dict(local_templates or {})
        self._learning: dict[str, asyncio.Task[None]] = {}
        self.config = config
        self.window = window
        # issue 26: admission from the engines' own load (`loads`, fed by WatchLoad), the window
        # and the learned limit as its fallback, behind one controller.
        self.admission = AdmissionController(window, loads)
        metrics.ADMISSION_BUDGET.set(window.config.budget)
        self.routes = {name: ModelRoute(name) for name in models}
        if default_model not in self.routes:
            raise ValueError(f"default model {default_model!r} is not one of {list(self.routes)}")
        self.default_model = default_model
        # --- issue 29: model aliases (an ordered list of models, the next serving when one cannot).
        self.aliases = {name: tuple(chain) for name, chain in (aliases or {}).items()}
        for alias, chain in self.aliases.items():
            if alias in self.routes or not chain or any(not m or m not in self.routes for m in chain):
                raise ValueError(f"alias {alias!r}: must not be a model's name and must list served models")
        self.usage = usage or UsageMeter()
        # --- end issue 29
        self.embeddings = Embeddings(peers, self.usage)
        # One per model (a tokenizer's rate is wrong for another); "" serves until a model is known.
        self.predictors: dict[str, InputTokenPredictor] = {}
        self.predictor = self.predictor_for("")
        self.versions = CollectionVersions(peers, config.version_ttl)
        self.recent_hits = RecentHits()
        self._background: set[asyncio.Task[None]] = set()
        self.stores_skipped = 0
        self._cache_slow_until = 0.0
        self._cache_answered_at = 0.0

    def predictor_for(self, model: str) -> InputTokenPredictor:
        found = self.predictors.get(model)
        if found is None:
            found = self.predictors[model] = InputTokenPredictor()
        return found

    async def model_key(self, deadline: Deadline, model: str = "") -> str:
        """Model id + weights digest + dtype of one model (a route name; "" = the default): new
        weights, or the same weights served in another dtype (or quantization), never serve
        answers cached from the old ones. A named model's key starts with its name, so
        one model's cached answers never serve another, even on the same weights."""
        route = self.routes[model or self.default_model]
        now = time.monotonic()
        if route.learned is None or now - route.learned[0] > MODEL_INFO_TTL_S:
            try:
                info = await self.peers.model_info(deadline, route.name)
            except DOWNSTREAM_ERRORS:
                if route.learned is None:
                    raise
                return route.learned[1]  # inference down: cached answers for the last known weights still serve
            prefix = f"{route.name}:" if route.name else ""
            route.learned = (now, f"{prefix}{model_key_of(info)}")
        return route.learned[1]

    async def route(self, model: str, deadline: Deadline) -> ModelRoute:
        """The route of the model a request names ("" = the default); NotFound naming the model
        and the ones served."""
        if not model:
            return self.routes[self.default_model]
        found = self.routes.get(model)
        if found is not None and found.name:
            return found
        unnamed = self.routes.get("")
        if unnamed is not None:
            # The one model of a deployment that names none answers to the id it reports.
            await self.model_key(deadline, "")
            if unnamed.public_name() == model:
                return unnamed
        raise NotFound(
            f"model {model!r} is not served here; this gateway serves {', '.join(await self.served_models(deadline))}",
            reason="MODEL_NOT_FOUND",
            metadata={"model": model},
        )

    async def served_models(self, deadline: Deadline) -> list[str]:
        """Names of the models this gateway answers with, the default first: the one list every
        API shows. The unnamed model of a one-model deployment shows the id its inference reports."""
        names: list[str] = []
        for route in sorted(self.routes.values(), key=lambda r: r.name != self.default_model):
            if not route.name:
                await self.model_key(deadline, "")
            name = route.public_name()
            if name is not None:
                names.append(name)
        return [*names, *self.aliases]  # issue 29: an alias is asked for by name as a model is

    def _label(self, model: str) -> str:
        """The metrics label of a request's model: a served model's name (a bounded set), never
        the caller's text ("unknown" for a name not served)."""
        if model in self.aliases:
            return model  # issue 29: an alias's name is a configured, bounded label value
        route = self.routes.get(model) if model else self.routes[self.default_model]
        if route is None and "" in self.routes and self.routes[""].public_name() == model:
            route = self.routes[""]
        if route is None:
            return "unknown"
        # The unnamed model of a one-model deployment: a label that does not change once its id is learned.
        return route.name or "default"

    async def list_models(self, deadline: Deadline) -> gateway_pb2.ListModelsResponse:
        """Every model with its key and whether its inference answers now: each is asked for its
        model info (all at once, with the model-info budget each, through its breaker); one that
        fails or whose breaker is open is listed unavailable, with the key last learned."""

        async def entry(route: ModelRoute) -> gateway_pb2.ModelEntry:
            available = True
            try:
                route.expire()  # asked again now; on failure the last key is kept, still expired
                key = await self.model_key(deadline, route.name)
            except DOWNSTREAM_ERRORS:
                key, available = "", False
            else:
                available = route.learned is not None and not route.expired()
            return gateway_pb2.ModelEntry(
                name=route.public_name() or "",
                default=route.name == self.default_model,
                key=key,
                available=available,
            )

        ordered = sorted(self.routes.values(), key=lambda r: r.name != self.default_model)
        embedder = asyncio.ensure_future(self.embedding_model(deadline))
        entries = list(await asyncio.gather(*(entry(r) for r in ordered)))
        by_name = {e.name: e for e in entries}
        for alias, chain in self.aliases.items():  # issue 29: available while one of its models is
            available = any(by_name[m].available for m in chain if m in by_name)
            entries.append(gateway_pb2.ModelEntry(name=alias, available=available, alias_of=chain))
        name = await embedder
        if name:  # the embedding model, for Embed (while retrieval can say its name): last, no key
            entries.append(gateway_pb2.ModelEntry(name=name, available=True))
        return gateway_pb2.ListModelsResponse(models=entries)

    async def embedding_model(self, deadline: Deadline) -> str:
        """The mesh's embedding model's name, the one Embed and /v1/embeddings embed with ("" while
        retrieval cannot say it): learned from retrieval's answers (services/gateway/embeddings.py)."""
        return await self.embeddings.model_name(deadline)

    async def _retrieval_scope(self, plan: Plan, deadline: Deadline) -> tuple[str, int]:
        """(collection, version) the answer will be grounded in, or ("", 0) without retrieval.
        While retrieval is down, the last known version: a cached answer for it still serves."""
        if not plan.use_retrieval:
            return "", 0
        if len(plan.prompt.encode("utf-8", "surrogatepass")) > RETRIEVAL_MAX_QUERY_BYTES:
            # Retrieval cannot search with it: answered (and cached) without context, and says so.
            plan.degrade("retrieval_query_too_long")
            plan.use_retrieval = False
            return "", 0
        try:
            known = await self.versions.get(plan.collection, plan.tenant, deadline)
        except DOWNSTREAM_ERRORS as exc:
            log.warning("retrieval unavailable, answering without context: %s", exc.message)
            plan.degrade("retrieval_unavailable")
            plan.use_retrieval = False
            return "", 0
        info = known.info
        if not info.exists or info.points == 0:
            plan.use_retrieval = False
            return "", 0
        if known.unconfirmed or self.peers.breakers["retrieval"].state.value == "open":
            plan.degrade("retrieval_unavailable")
        return plan.collection, info.version

    def _scope(self, plan: Plan, model: str, collection: str, version: int) -> cache_pb2.CacheScope:
        """The cache scope of the plan as it stands, with the retrieval it uses (services/gateway/shape.py)."""
        return cache_scope(
            model=model,
            tenant=plan.tenant,
            sampling=plan.sampling,
            shape=plan.shape,
            collection=collection,
            version=version,
            top_k=plan.top_k,
            min_score=self.config.min_context_score,
        )

    async def _lookup(
        self,
        plan: Plan,
        scope: cache_pb2.CacheScope,
        deadline: Deadline,
        wait: float | None = None,
        key: bytes | None = None,
    ) -> cache_pb2.CacheLookupResponse | None:
        """A hit, or None (a miss, or the cache unavailable). `wait`: give up on the cache after
        this long (the request is shed on a miss, so it only waits as long as a refusal may take),
        or up to KNOWN_HIT_WAIT_S while the cache keeps answering other lookups, when
        the cache answered this request (`key`) lately: it will almost surely be served, not shed.

        The wait, queueing behind other lookups included, never exceeds the lookup's hop budget.
        The call itself is not cancelled when the request stops waiting: it runs to its own budget
        in the background, so the cache's breaker hears how it ended (a frozen cache is cut off
        even when every request gives up on it early)."""
        # Attributes go on the request span: the client span of the RPC already times the hop.
        span = trace.get_current_span()
        budget = self.peers.budgets.cache_lookup
        patience = KNOWN_HIT_WAIT_S if key is not None and key in self.recent_hits else 0.0
        asked_at = time.monotonic()
        lookup = asyncio.ensure_future(
            self.peers.cache_lookup(
                cache_pb2.CacheLookupRequest(prompt=plan.prompt, scope=scope, allow_semantic=plan.semantic), deadline
            )
        )
        lookup.add_done_callback(_consume)
        lookup.add_done_callback(self._cache_heard)
        try:
            try:
                found = await asyncio.wait_for(asyncio.shield(lookup), budget if wait is None else min(wait, budget))
            except TimeoutError:
                if wait is None or wait >= budget:
                    raise
                found = await self._wait_while_cache_answers(lookup, asked_at + min(patience, budget))
        except TimeoutError:
            if wait is not None and wait < budget:
                return None  # the request decides without the cache; the lookup goes on
            self._cache_slow_until = time.monotonic() + CACHE_SUSPECT_S
            log.warning("cache lookup took its whole budget (%.3fs)", budget)
            plan.degrade("cache_unavailable")
            return None
        except DOWNSTREAM_ERRORS as exc:
            self._cache_slow_until = time.monotonic() + CACHE_SUSPECT_S
            log.warning("cache unavailable: %s", exc.message)
            plan.degrade("cache_unavailable")
            return None
        except CallerDeadline:
            if deadline.remaining() <= 0:
                raise
            # Not this request's deadline (the cache hop can never cost a caller its own): no cache.
            plan.degrade("cache_unavailable")
            return None
        if found.degraded:
            self._cache_slow_until = time.monotonic() + CACHE_SUSPECT_S
            plan.degrade("cache_unavailable")
        if scope.collection and found.collection_version:
            self.versions.observe(scope.collection, scope.tenant, found.collection_version)
        if key is not None:
            if found.hit:
                self.recent_hits.hit(key)
            else:
                self.recent_hits.missed(key)
        span.set_attribute("llmesh.cache.hit", found.hit)
        if found.hit:
            span.set_attribute("llmesh.cache.tier", common_pb2.CacheTier.Name(found.tier))
            span.set_attribute("llmesh.cache.similarity", found.similarity)
        return found if found.hit else None

    async def _retrieve(
        self, plan: Plan, collection: str, deadline: Deadline
    ) -> tuple[list[common_pb2.ScoredChunk], int] | None:
        """The context and the collection version the search read it at ([], 0 without a
        collection); None when the search failed or ran out of its budget (degraded)."""
        if not collection:
            return [], 0
        span = trace.get_current_span()
        try:
            found = await self.peers.search(
                retrieval_pb2.RetrievalSearchRequest(
                    query=plan.prompt,
                    collection=collection,
                    tenant=plan.tenant,
                    top_k=plan.top_k,
                    score_threshold=self.config.min_context_score,
                ),
                deadline,
            )
        except DOWNSTREAM_ERRORS as exc:
            log.warning("retrieval search failed, answering without context: %s", exc.message)
            plan.degrade("retrieval_unavailable")
            return None
        span.set_attribute("llmesh.retrieval.document_ids", [c.document_id for c in found.results])
        span.set_attribute("llmesh.retrieval.scores", [round(c.score, 4) for c in found.results])
        if found.collection_version:
            self.versions.observe(collection, plan.tenant, found.collection_version)
        return list(found.results), found.collection_version

    async def generate(
        self, request: gateway_pb2.GenerateRequest, deadline: Deadline, caller: Caller | None = None
    ) -> AsyncIterator[Delta | Final]:
        """Streams text deltas, then one Final with the whole response; records the outcome.
        `caller`: the API key and tenant it comes from (its limits and usage; None: anonymous)."""
        started = time.perf_counter()
        tier = "none"
        outcome = "error"
        label = self._label(request.model)
        response: gateway_pb2.GenerateResponse | None = None
        error: BaseException | None = None
        attempts: list[Plan] = []
        try:
            # issue 29: the key's models, then its own limits, before any work.
            requested = request.model or self.default_model
            if caller is not None and requested and not caller.key.allows(requested):
                raise PermissionDenied(
                    f"API key {caller.key_id} may not use model {requested!r}",
                    reason="MODEL_NOT_ALLOWED",
                    metadata={"model": requested},
                )
            await self.usage.admit(caller)
            async for event in self._generate(request, deadline, attempts):
                if isinstance(event, Final):
                    tier = (
                        "none"
                        if not event.response.cache.hit
                        else ("exact" if event.response.cache.tier == common_pb2.CACHE_TIER_EXACT else "semantic")
                    )
                    outcome = "ok"
                    response = event.response
                    label = self._label(response.answered_by) if response.answered_by else label
                yield event
        except LlmeshError as exc:
            outcome = exc.code.name.lower()
            error = exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            elapsed = time.perf_counter() - started
            metrics.REQUESTS.labels(outcome, tier, label).inc()
            if outcome == "ok":
                metrics.REQUEST_DURATION.labels(tier, label).observe(elapsed, trace_exemplar())
            # issue 29: usage per tenant and model, the key's tokens, one access-log line per request.
            # A request that ended early (cancelled, failed mid-stream) is billed what it spent.
            if response is None and any(p.spent.input_tokens for p in attempts):
                spent = common_pb2.Usage(
                    input_tokens=sum(p.spent.input_tokens for p in attempts),
                    output_tokens=sum(p.spent.output_tokens for p in attempts),
                )
                response = gateway_pb2.GenerateResponse(usage=spent, trace_id=current_trace_id())
            self.usage.finish(caller, request.tenant or "default", label, outcome, tier, response, error, elapsed)

    async def _generate(
        self, request: gateway_pb2.GenerateRequest, deadline: Deadline, attempts: list[Plan] | None = None
    ) -> AsyncIterator[Delta | Final]:
        attempts = [] if attempts is None else attempts
        # --- issue 29: an alias tries its models in order (model_fallback).
        chain = self.aliases.get(request.model)
        if chain is None:
            attempts.append(validate(request, self.config))
            async for event in self._attempt(attempts[-1], deadline):
                yield event
            return
        for i, name in enumerate(chain):
            last = i == len(chain) - 1
            if not last and self.peers.breakers[inference_peer(name)].state is State.OPEN:
                log.info("alias %s: %s unavailable (breaker open), trying the next model", request.model, name)
                continue
            plan = validate(request, self.config)
            plan.model = name
            attempts.append(plan)
            if name != chain[0]:
                plan.degrade("model_fallback")
            answered = False
            try:
                async for event in self._attempt(plan, deadline):
                    answered = True
                    yield event
                return
            except (Unavailable, PeerCallError, ResourceExhausted) as exc:
                if answered or last or not _worth_a_fallback(exc):
                    raise
                log.info("alias %s: %s could not answer (%s), trying the next model", request.model, name, exc)
        # --- end issue 29

    async def _attempt(self, plan: Plan, deadline: Deadline) -> AsyncIterator[Delta | Final]:
        started = time.perf_counter()
        try:
            async for event in self._pipeline(plan, deadline):
                yield event
        except ResourceExhausted as exc:
            # A shed caller sees where the time went before the refusal, as a served one does.
            total = (time.perf_counter() - started) * 1000
            exc.extra_trailing.append(("server-timing", server_timing({**plan.timings, "total": total})))
            raise
        finally:
            # Every exit path: what was held or reserved and not generated goes back.
            if plan.hold is not None:
                plan.hold.release()
            if plan.ticket is not None:
                plan.ticket.finish()

    async def _pipeline(self, plan: Plan, deadline: Deadline) -> AsyncIterator[Delta | Final]:
        if plan.lane not in self.window.lanes:
            raise InvalidArgument([("lane", f"must be one of {', '.join(self.window.lanes)}")])
        span = trace.get_current_span()
        span.set_attribute("llmesh.tenant", plan.tenant)
        span.set_attribute("gen_ai.request.max_tokens", plan.sampling.max_new_tokens)
        span.set_attribute("gen_ai.request.temperature", plan.sampling.temperature)
        if plan.n > 1:
            span.set_attribute("gen_ai.request.choice.count", plan.n)
        if self.config.log_prompts:
            span.set_attribute("llmesh.prompt", plan.prompt)
        with plan.timed("model"):
            route = await self.route(plan.model, deadline)
            model = await self.model_key(deadline, route.name)
        plan.predictor = self.predictor_for(route.name)
        span.set_attribute("gen_ai.request.model", route.public_name() or model)
        span.set_attribute("llmesh.model_key", model)
        if not plan.use_cache:
            # No cache hit is possible: shed before any other downstream call.
            with plan.timed("admission"):
                self._precheck(plan, model, deadline, route.name)
        with plan.timed("retrieval"):
            collection, version = await self._retrieval_scope(plan, deadline)
        scope = self._scope(plan, model, collection, version)
        if plan.use_cache:
            # Admission is decided before the lookup, as if it missed: a request that fits holds
            # its predicted weight now (given back on a hit), so it is never refused after waiting
            # for the cache. One that would be shed waits for the cache only SHED_RISK_LOOKUP_S (a
            # hit costs nothing, so it is still served), and not at all while the cache is failing.
            with plan.timed("admission"):
                refusal = self._reserve(plan, model, deadline, route.name, waiting_for_cache=True)
            if refusal is not None and self._cache_suspect():
                self._shed(refusal, "shed_early")
                raise refusal
            # A request the cache answered lately will almost surely be answered again (it costs
            # the model nothing): it waits longer, while the cache is answering (see `_lookup`).
            wait = SHED_RISK_LOOKUP_S if refusal is not None else None
            with plan.timed("cache"):
                hit = await self._lookup(plan, scope, deadline, wait, request_key(plan.prompt, scope))
            if hit is not None:
                for event in from_cache(plan, hit, model, route.public_name() or ""):
                    yield event
                return
            # Missed, and it did not fit before the lookup: shed before the expensive hops
            # (retrieval search, tokenizer) unless room opened meanwhile.
            if refusal is not None:
                with plan.timed("admission"):
                    self._precheck(plan, model, deadline, route.name)
        # --- cache scope: the answer is stored under the retrieval it really had -----------------
        if "retrieval_unavailable" in plan.degradations and collection:
            # Only a cached answer could use the last known version: generate without context.
            sources: list[common_pb2.ScoredChunk] = []
            collection, version = "", 0
        else:
            with plan.timed("retrieval"):
                retrieved = await self._retrieve(plan, collection, deadline)
            # A failed or timed-out search: no context, so the RAG scope is not this answer's.
            sources, version = retrieved if retrieved is not None else ([], 0)
            collection = collection if retrieved is not None else ""
        if not collection and scope.collection:
            plan.use_retrieval = False
            scope = self._scope(plan, model, "", 0)
            if plan.use_cache:
                # An answer made without context earlier serves, and says what it lacks.
                with plan.timed("cache"):
                    hit = await self._lookup(plan, scope, deadline)
                if hit is not None:
                    for event in from_cache(plan, hit, model, route.public_name() or ""):
                        yield event
                    return
        # --- end of the cache scope ------------------------------------------------------------
        with plan.timed("tokenizer"):
            prompt, input_tokens = await self._render(plan, sources, deadline, route.tokenizer)
            # Over the prompt limit: the retrieved chunks go first (the lowest-scored first), and
            # only a prompt over it without any context is refused.
            while input_tokens > self.config.max_prompt_tokens and sources:
                sources = sources[:-1]
                plan.degrade("context_trimmed")
                prompt, input_tokens = await self._render(plan, sources, deadline, route.tokenizer)
        if "tokenizer_estimate" not in plan.degradations:
            (plan.predictor or self.predictor).observe(plan, input_tokens, context_bytes(sources))
        if input_tokens > self.config.max_prompt_tokens:
            raise InvalidArgument(
                [
                    (
                        "messages" if plan.turns else "prompt",
                        f"{input_tokens} tokens rendered; the limit is {self.config.max_prompt_tokens}",
                    )
                ]
            )
        with plan.timed("admission"):
            admission = await self._admit(plan, input_tokens, model, deadline, route.name)
        plan.ticket = admission.ticket
        if admission.degraded:
            capped = (admission.max_new_tokens or 0) // plan.n  # the cap is over all n answers
            plan.sampling.max_new_tokens = max(1, capped) if admission.max_new_tokens else plan.sampling.max_new_tokens
            plan.degrade("max_new_tokens_capped")
        answers = [Answer(i) for i in range(plan.n)]
        with plan.timed("inference"):
            async for delta in self._infer(plan, prompt, input_tokens, answers, deadline, route.name):
                yield delta
        usage = total_usage(answers, input_tokens)
        span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
        first = answers[0]
        text, finish = first.text, first.finish
        response = gateway_pb2.GenerateResponse(
            text=text,
            finish_reason=finish,
            usage=usage,
            cache=gateway_pb2.CacheInfo(hit=False),
            sources=sources,
            trace_id=current_trace_id(),
            model=model,
            degradations=plan.degradations,
            answered_by=route.public_name() or "",
            logprobs=first.logprobs,
        )
        if plan.ticket is not None:
            plan.ticket.finish()  # the weight not generated goes back before the caller hears
        # Stored under the scope the answer really had: the version its context was read at, and
        # a capped max_new_tokens (the answer of a request that asks for that many). Not stored:
        # a prompt rendered by the fallback template (the tokenizer was away). The store runs
        # after, in the background: the caller's answer never waits for it.
        if plan.use_cache and finish in CACHEABLE_FINISH and text and "tokenizer_estimate" not in plan.degradations:
            self._store_later(plan, self._scope(plan, model, collection, version or scope.collection_version), response)
        if plan.tool_mode:  # stored as generated (the call's text); answered as a tool call
            stored, response = response, gateway_pb2.GenerateResponse()
            response.CopyFrom(stored)
            as_tool_calls(plan, response)
        if plan.n > 1:
            for answer in answers:
                choice = gateway_pb2.GenerateResponse(
                    text=answer.text, finish_reason=answer.finish, logprobs=answer.logprobs
                )
                as_tool_calls(plan, choice)
                response.choices.add(
                    index=answer.index,
                    text=choice.text,
                    finish_reason=choice.finish_reason,
                    tool_calls=choice.tool_calls,
                    logprobs=choice.logprobs,
                )
            if response.tool_calls:  # the first answer's call, under the same id in both places
                del response.tool_calls[:]
                response.tool_calls.extend(response.choices[0].tool_calls)
        yield Final(response, plan.timings)

    async def _infer(
        self,
        plan: Plan,
        prompt: list[int] | str,
        input_tokens: int,
        answers: list[Answer],
        deadline: Deadline,
        route: str,
    ) -> AsyncIterator[Delta]:
        """Runs the answers' inference streams (n at once for n > 1: seeds offset by the answer's
        index when a seed is given, so seeded answers differ and stay reproducible) and yields
        their deltas as they come; each answer's text, log probabilities, finish and usage are
        kept in `answers`. Leaving early (the caller cancelled or went away, a stream failed)
        cancels every stream still running."""
        form = plan.response_format if plan.response_format.type else None
        generated = 0

        def take(answer: Answer, message: inference_pb2.InferenceResponse) -> Delta | None:
            nonlocal generated
            # Tokens as they come (a backend that sends text only: a message is a token); the
            # final usage settles the count.
            step = len(message.token_ids) or (1 if message.text else 0)
            if message.finish_reason and message.usage.output_tokens:
                step = max(step, message.usage.output_tokens - answer.generated)
            answer.generated += step
            generated += step
            # issue 29: what the request spent once inference answered, billed if it ends early.
            plan.spent.input_tokens, plan.spent.output_tokens = input_tokens, generated
            if plan.ticket is not None:
                plan.ticket.progress(step)
            if message.text:
                answer.pieces.append(message.text)
            answer.logprobs.extend(message.logprobs)
            if message.finish_reason:
                answer.finish = message.finish_reason
                answer.usage = message.usage
                answer.finished = True
            if message.text or message.logprobs:
                return Delta(message.text, answer.index, message.logprobs)
            return None

        def sampling_of(answer: Answer) -> common_pb2.SamplingParams:
            if answer.index == 0 or not plan.sampling.HasField("seed"):
                return plan.sampling
            offset = common_pb2.SamplingParams()
            offset.CopyFrom(plan.sampling)
            offset.seed = (plan.sampling.seed + answer.index) % (1 << 64)
            return offset

        def stream(answer: Answer) -> AsyncIterator[inference_pb2.InferenceResponse]:
            return self.peers.generate(prompt, sampling_of(answer), uuid.uuid4().hex, deadline, route, form)

        if len(answers) == 1:
            async for message in stream(answers[0]):
                delta = take(answers[0], message)
                if delta is not None:
                    yield delta
            return
        queue: asyncio.Queue[tuple[Answer, inference_pb2.InferenceResponse | BaseException | None]] = asyncio.Queue()

        async def pump(answer: Answer) -> None:
            try:
                async for message in stream(answer):
                    queue.put_nowait((answer, message))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait((answer, exc))
            else:
                queue.put_nowait((answer, None))

        pumps = [asyncio.ensure_future(pump(answer)) for answer in answers]
        try:
            running = len(pumps)
            while running:
                answer, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    delta = take(answer, item)
                    if delta is not None:
                        yield delta
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _render(
        self, plan: Plan, sources: list[common_pb2.ScoredChunk], deadline: Deadline, tokenizer: str = ""
    ) -> tuple[list[int] | str, int]:
        """The prompt as token ids and its exact length (`tokenizer`: whose, "" = the tokenizer
        service's default). While the tokenizer is down: the text rendered here with that
        model's own template (learned from the tokenizer while it answered, else read from the
        model's folder at start), and a local estimate (inference tokenizes the text itself)."""
        messages = build_messages(plan, sources)
        try:
            rendered = await self.peers.chat_template(messages, deadline, tokenizer)
        except DOWNSTREAM_ERRORS as exc:
            if isinstance(exc, PeerCallError) and exc.code not in BREAKER_FAILURE_CODES:
                raise
            log.warning("tokenizer unavailable, rendering and estimating tokens locally: %s", exc.message)
            plan.degrade("tokenizer_estimate")
            text = self._render_locally(plan, messages, tokenizer)
            return text, (plan.predictor or self.predictor).estimate(plan, context_bytes(sources), text)
        self._learn_template(tokenizer)
        return list(rendered.ids), len(rendered.ids)

    def _render_locally(self, plan: Plan, messages: list[common_pb2.ChatMessage], tokenizer: str) -> str:
        template = self.templates.get(tokenizer) or self.local_templates.get(tokenizer)
        if template is None:
            # Neither learned nor on this host: ChatML, the template most chat models use, and
            # the response says the model's own was not known.
            plan.degrade("chat_template_unknown")
            return render_chatml(messages)
        try:
            return template.render(messages)
        except TemplateRefused as exc:
            raise InvalidArgument([("messages", f"the model's chat template refused them: {exc}")]) from exc

    def _learn_template(self, tokenizer: str) -> None:
        """Asks the tokenizer, once per model in the background, for the chat template the
        gateway renders with while the tokenizer is away."""
        if tokenizer in self.templates or tokenizer in self._learning:
            return

        async def learn() -> None:
            try:
                found = await self.peers.get_chat_template(Deadline.after(BACKGROUND_DEADLINE_S), tokenizer)
                self.templates[tokenizer] = ChatTemplate(found.template, dict(found.special_tokens))
            except (*DOWNSTREAM_ERRORS, LlmeshError, ValueError) as exc:
                log.warning("could not learn the chat template of %r: %s", tokenizer, exc)
            finally:
                self._learning.pop(tokenizer, None)

        task = asyncio.get_running_loop().create_task(learn())
        self._learning[tokenizer] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _wait_while_cache_answers(
        self, lookup: asyncio.Future[cache_pb2.CacheLookupResponse], until: float
    ) -> cache_pb2.CacheLookupResponse:
        """Waits for `lookup` in steps of CACHE_ALIVE_S, each only while the cache answered some
        other lookup in full within the last step (it is busy, not frozen: this answer is likely
        on its way; lookups go out in batches), until `until`; raises TimeoutError when it stops."""
        while True:
            now = time.monotonic()
            if now >= until or now - self._cache_answered_at > CACHE_ALIVE_S:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(lookup), min(CACHE_ALIVE_S, until - now))
            except TimeoutError:
                continue

    def _cache_heard(self, lookup: asyncio.Future[Any]) -> None:
        """Notes when the cache last answered a lookup in full (not degraded): the liveness a
        patient request waits on."""
        if not lookup.cancelled() and lookup.exception() is None and not lookup.result().degraded:
            self._cache_answered_at = time.monotonic()

    def _cache_suspect(self) -> bool:
        """The cache failed, ran out of budget or answered degraded in the last CACHE_SUSPECT_S,
        or its breaker is not closed."""
        return time.monotonic() < self._cache_slow_until or self.peers.breakers["cache"].state.value != "closed"

    def _ask(self, plan: Plan, model: str, route: str) -> Ask:
        # n answers weigh n times one: n x max_new_tokens tokens to generate over the prompt.
        return Ask(plan.tenant, plan.lane, model, route, plan.sampling.max_new_tokens * plan.n)

    def _reserve(
        self, plan: Plan, model: str, deadline: Deadline, route: str = "", waiting_for_cache: bool = False
    ) -> ResourceExhausted | None:
        """The precheck without raising: None when the request may go on to its hops (it may then
        hold its prediction until its exact weight is admitted); else the refusal. Decided by
        `AdmissionController.reserve`: the engines' reported load, or the fallback."""
        predicted = (plan.predictor or self.predictor).predict(plan)
        if plan.hold is not None:
            plan.hold.release()
            plan.hold = None
        hold, refusal = self.admission.reserve(
            self._ask(plan, model, route), predicted, deadline.remaining(), waiting_for_cache=waiting_for_cache
        )
        plan.hold = hold
        if refusal is not None:
            trace.get_current_span().set_attribute("llmesh.admission.predicted_input_tokens", predicted)
        return refusal

    def _precheck(self, plan: Plan, model: str, deadline: Deadline, route: str = "") -> None:
        """Sheds before the expensive hops (retrieval search, tokenizer) when the request's
        predicted weight does not fit or could not start or finish in time (see `_reserve`)."""
        refusal = self._reserve(plan, model, deadline, route)
        if refusal is not None:
            self._shed(refusal, "shed_early")
            raise refusal

    def _shed(self, exc: ResourceExhausted, decision: str) -> None:
        metrics.SHED.labels(exc.reason).inc()
        span = trace.get_current_span()
        span.set_attribute("llmesh.admission.decision", decision)
        span.set_attribute("llmesh.admission.reason", exc.reason)
        span.set_attribute("llmesh.admission.retry_after_s", exc.retry_after)

    async def _admit(self, plan: Plan, input_tokens: int, model: str, deadline: Deadline, route: str = "") -> Admission:
        span = trace.get_current_span()
        capacity = self.admission.capacity(model)
        try:
            # The exact weight replaces the prediction this request has held since its precheck.
            admission = await self.admission.admit(
                self._ask(plan, model, route), input_tokens, plan.hold, deadline.remaining()
            )
        except RequestTooHeavy as exc:
            self._shed(exc, "refused_too_heavy")
            raise InvalidArgument(
                [
                    (
                        "sampling.max_new_tokens",
                        f"{input_tokens} input tokens x {plan.sampling.max_new_tokens} new tokens"
                        f"{f' x n={plan.n}' if plan.n > 1 else ''} exceeds the largest admissible "
                        f"weight ({exc.metadata.get('max_weight', '?')})",
                    )
                ]
            ) from exc
        except ResourceExhausted as exc:
            self._shed(exc, "shed_deadline" if exc.reason == REASON_DEADLINE else "shed")
            raise
        metrics.ADMISSION_WEIGHT.set(admission.occupancy)
        metrics.ADMISSION_IN_FLIGHT_LIMIT.set(capacity.limit())
        metrics.ADMISSION_IN_FLIGHT.set(capacity.in_flight)
        metrics.ADMISSION_THROUGHPUT.set(capacity.throughput)
        span.set_attribute("llmesh.admission.in_flight_limit", capacity.limit())
        span.set_attribute("llmesh.admission.decision", "capped" if admission.degraded else "admitted")
        span.set_attribute("llmesh.admission.weight", admission.weight)
        span.set_attribute("llmesh.admission.occupancy", admission.occupancy)
        span.set_attribute("llmesh.admission.budget", admission.budget)
        return admission

    def _store_later(self, plan: Plan, scope: cache_pb2.CacheScope, response: gateway_pb2.GenerateResponse) -> None:
        """Stores the answer in the background, with the store hop's own budget (the caller's
        deadline no longer matters: the caller has its answer)."""
        if len(self._background) >= MAX_BACKGROUND_STORES:
            self.stores_skipped += 1
            metrics.DEGRADED.labels("cache_store_skipped").inc()
            return
        task = asyncio.get_running_loop().create_task(
            self._store(plan, scope, response, Deadline.after(BACKGROUND_DEADLINE_S))
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settle(self) -> None:
        """Waits for background stores (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _store(
        self, plan: Plan, scope: cache_pb2.CacheScope, response: gateway_pb2.GenerateResponse, deadline: Deadline
    ) -> None:
        answer = cache_pb2.CachedAnswer(
            text=response.text,
            finish_reason=response.finish_reason,
            usage=response.usage,
            sources=response.sources,
        )
        try:
            await self.peers.cache_store(
                cache_pb2.CacheStoreRequest(prompt=plan.prompt, scope=scope, answer=answer), deadline
            )
        except (*DOWNSTREAM_ERRORS, LlmeshError) as exc:
            log.warning("cache store failed: %s", exc.message)

    async def ingest(self, request: gateway_pb2.IngestRequest, deadline: Deadline) -> gateway_pb2.IngestResponse:
        upsert = retrieval_pb2.UpsertRequest(
            collection=request.collection or self.config.default_collection,
            tenant=request.tenant or "default",
            documents=request.documents,
            chunk_tokens=request.chunk_tokens,
            overlap_tokens=request.overlap_tokens,
        )
        last = retrieval_pb2.UpsertProgress()
        try:
            async for progress in self.peers.upsert(upsert, deadline):
                last = progress
        finally:
            # The next request learns the new version (whatever happened: a part may have landed).
            self.versions.forget(upsert.collection, upsert.tenant)
        if not last.done:
            raise LlmeshError("ingest ended before it was done")
        return gateway_pb2.IngestResponse(
            documents=last.documents_done,
            chunks=last.chunks_done,
            collection_version=last.collection_version,
            trace_id=current_trace_id(),
        )

    async def purge_cache(
        self, request: gateway_pb2.PurgeCacheRequest, deadline: Deadline
    ) -> gateway_pb2.PurgeCacheResponse:
        """Removes one tenant's cached answers: all, a collection's, or a model's (the answers of the
        model key the name serves now; entries of earlier weights can never serve again anyway)."""
        bad = []
        if not request.tenant:
            bad.append(("tenant", "required"))
        elif not NAME_RE.match(request.tenant):
            bad.append(("tenant", "letters, digits, '_', '.', '-' only, at most 64 characters"))
        if request.collection and request.model:
            bad.append(("model", "set collection or model, not both"))
        if request.collection and not NAME_RE.match(request.collection):
            bad.append(("collection", "letters, digits, '_', '.', '-' only, at most 64 characters"))
        if bad:
            raise InvalidArgument(bad)
        invalidate = cache_pb2.InvalidateRequest(tenant=request.tenant)
        if request.collection:
            invalidate.collection = request.collection
        elif request.model:
            route = await self.route(request.model, deadline)
            invalidate.model = await self.model_key(deadline, route.name)
        else:
            invalidate.all = True
        try:
            done = await self.peers.cache_invalidate(invalidate, deadline)
        except PeerCallError as exc:
            raise exc.cause from exc
        return gateway_pb2.PurgeCacheResponse(removed=done.removed, trace_id=current_trace_id())

    async def embed(
        self, request: gateway_pb2.EmbedRequest, deadline: Deadline, caller: Caller | None = None
    ) -> gateway_pb2.EmbedResponse:
        """Embeddings of `request.inputs` with the mesh's embedding model (services/gateway/embeddings.py)."""
        tenant_ok = not request.tenant or bool(NAME_RE.match(request.tenant))
        return await self.embeddings.embed(request, deadline, caller, tenant_ok)

    async def search(self, request: gateway_pb2.SearchRequest, deadline: Deadline) -> gateway_pb2.SearchResponse:
        if not request.query.strip():
            raise InvalidArgument([("query", "must not be empty")])
        found = await self.peers.search(
            retrieval_pb2.RetrievalSearchRequest(
                query=request.query,
                collection=request.collection or self.config.default_collection,
                tenant=request.tenant or "default",
                top_k=request.top_k,
                score_threshold=request.score_threshold,
                filter=request.filter,
            ),
            deadline,
            optional=False,
        )
        return gateway_pb2.SearchResponse(results=found.results, trace_id=current_trace_id())
