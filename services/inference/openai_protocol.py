"""The OpenAI completions API as the openai backend speaks it: request bodies from our sampling
parameters, streamed chunks into GenerationEvents, HTTP failures into typed errors.

Pure functions (no I/O), so each mapping is tested on its own; `openai_backend` does the HTTP.
"""

from __future__ import annotations

import dataclasses
import email.utils
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmesh import errors
from services.inference.engine import FINISH_LENGTH, FINISH_STOP, FINISH_STOP_SEQUENCE, TokenLogprob, TopLogprob
from services.inference.engine.decoding import ResolvedParams, ResponseFormatSpec

#: Our request field for each OpenAI parameter, so a rejected parameter names the field the caller set.
FIELD_OF_PARAM = {
    "max_tokens": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "seed": "sampling.seed",
    "stop": "sampling.stop",
    **{
        name: f"sampling.{name}"
        for name in (
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "stop_token_ids",
            "logit_bias",
        )
    },
    "logprobs": "sampling.top_logprobs",
    "top_logprobs": "sampling.top_logprobs",
    "ignore_eos": "sampling.ignore_eos",
    "min_tokens": "sampling.min_new_tokens",
    "prompt_logprobs": "sampling.prompt_logprobs",
    "prompt": "input",
}
DEFAULT_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 300.0


def format_fields(form: ResponseFormatSpec) -> dict[str, Any]:
    """A response format as vLLM's /v1/completions takes it: OpenAI's `response_format` for JSON,
    its `structured_outputs` for a regex or a choice (SGLang and TGI name theirs differently)."""
    if form.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if form.kind == "json_schema":
        schema = {"name": form.name or "answer", "schema": json.loads(form.schema), "strict": form.strict}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    if form.kind == "regex":
        return {"structured_outputs": {"regex": form.regex}}
    if form.kind == "grammar":
        # Automatic tool choice on a template without tools: a Lark grammar in llguidance's
        # dialect, which vLLM's guidance backend compiles as it is (`%llguidance {}` marks it so).
        return {"structured_outputs": {"grammar": "%llguidance {}\n" + form.grammar}}
    return {"structured_outputs": {"choice": list(form.choices)}}


def completion_body(
    model: str,
    prompt: list[int] | str,
    params: ResolvedParams,
    *,
    stream: bool = True,
    response_format: ResponseFormatSpec | None = None,
) -> dict[str, Any]:
    """The /v1/completions request: parameters map one to one; usage comes with the last chunk."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.ignore_eos:
        body["ignore_eos"] = True  # vLLM, SGLang and llama.cpp extension
    # Every other sampling field the request carries (OpenAI's, and vLLM's extensions).
    if params.top_k:
        body["top_k"] = params.top_k
    if params.min_p:
        body["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if params.stop_token_ids:
        body["stop_token_ids"] = sorted(params.stop_token_ids)
    if params.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in params.logit_bias}
    if params.logprobs:
        # The completions API's `logprobs` is the number of alternatives (0: the chosen token's
        # only); vLLM names each token by its id, so text and bytes come from our tokenizer.
        body["logprobs"] = params.top_logprobs
        body["return_tokens_as_token_ids"] = True
    if params.min_new_tokens:
        body["min_tokens"] = params.min_new_tokens
    if params.keep_special_tokens:
        body["skip_special_tokens"] = False
    if params.include_stop_str:
        body["include_stop_str_in_output"] = True
    if params.prompt_logprobs is not None or params.prompt_only:
        # vLLM refuses prompt_logprobs on a stream; `echo` with `logprobs` streams the prompt's
        # tokens scored ahead of the answer (split off by `EchoSplitter`), and with max_tokens 0
        # only them.
        body["echo"] = True
        body["logprobs"] = max(params.prompt_logprobs or 0, params.top_logprobs if params.logprobs else 0)
        body["return_tokens_as_token_ids"] = True
        if params.prompt_only:
            body["max_tokens"] = 0
    if response_format is not None:
        body.update(format_fields(response_format))
    return body


#: One generated token's logprobs as a completions chunk carries them: (token, its logprob,
#: {token: logprob} of the likeliest and the chosen one).
RawLogprob = tuple[str, float | None, dict[str, float] | None]
#: A backend token string (vLLM's "token_id:N", else the token's text) as (id, text, bytes).
PieceOf = Callable[[str], tuple[int, str, bytes]]
#: What vLLM writes for a log probability of -inf.
LOGPROB_FLOOR = -9999.0


def token_logprobs(raw: tuple[RawLogprob, ...], top: int, piece_of: PieceOf) -> list[TokenLogprob]:
    """The chunk's tokens as TokenLogprobs: the `top` likeliest alternatives, likeliest first
    (the completions API lists the chosen token among them even where it is not one)."""
    out: list[TokenLogprob] = []
    for token, logprob, alternatives in raw:
        token_id, text, data = piece_of(token)
        ranked = sorted((alternatives or {}).items(), key=lambda item: -item[1])[:top]
        tops = []
        for other, value in ranked:
            other_id, other_text, other_bytes = piece_of(other)
            tops.append(TopLogprob(token_id=other_id, token=other_text, logprob=value, bytes=other_bytes))
        value = LOGPROB_FLOOR if logprob is None else float(logprob)
        out.append(TokenLogprob(token_id=token_id, token=text, logprob=value, bytes=data, top=tuple(tops)))
    return out


class SSEReader:
    """Server-sent events framing over raw bytes as they come off the socket: `feed` takes one
    read and returns the `data` of each event it completed (a line or an event may straddle
    reads). Lines end in LF, CRLF or CR; comments (keep-alives) and the fields other than
    `data` are skipped; the `[DONE]` sentinel sets `done` and ends the stream."""

    __slots__ = ("_after_cr", "_data", "_tail", "done")

    def __init__(self) -> None:
        self._tail = b""  # an unterminated line
        self._data: list[bytes] = []  # the `data` lines of the event being read
        self._after_cr = False  # the last read ended in CR: an LF opening the next is its CRLF
        self.done = False

    def feed(self, raw: bytes) -> list[bytes]:
        if self.done or not raw:
            return []
        if self._after_cr and raw[:1] == b"\n":
            raw = raw[1:]
        buf = self._tail + raw if self._tail else raw
        if b"\r" in buf:
            self._after_cr = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        else:
            self._after_cr = False
        lines = buf.split(b"\n")
        self._tail = lines.pop()
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if not line:  # a blank line ends the event
                if data:
                    payload = data[0] if len(data) == 1 else b"\n".join(data)
                    data.clear()
                    if payload == b"[DONE]":
                        self.done = True
                        break
                    out.append(payload)
            elif line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line == b"data":
                data.append(b"")
            # ":" comments (keep-alives), event/id/retry fields: nothing a completion needs
        return out


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one streamed chunk carries (or several merged: `merge_chunks`)."""

    text: str = ""
    finish_reason: str | None = None
    model: str = ""
    response_id: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: tuple[RawLogprob, ...] = ()
    token_ids: tuple[int, ...] = ()  # where the server sends them (vLLM's `return_token_ids`)
    #: usage.prompt_tokens_details.cached_tokens, where the server reports it.
    cached_tokens: int | None = None
    #: Tokens the chunk stands for: a server streams one chunk per token it samples, so merged
    #: chunks without ids stand for one each (0: a single chunk, as parsed).
    tokens: int = 0

    @property
    def generated(self) -> bool:
        """Whether it carries generated tokens (not only a finish reason or the usage)."""
        return bool(self.text or self.logprobs or self.token_ids)


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Chunks that arrived together as one: their text, token ids and logprobs in order; the
    finish reason, usage, model and id the latest that carries each."""
    if len(chunks) == 1:
        return chunks[0]
    finish: str | None = None
    model = response_id = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    logprobs: list[RawLogprob] = []
    token_ids: list[int] = []
    for chunk in chunks:
        if chunk.cached_tokens is not None:
            cached_tokens = chunk.cached_tokens
        finish = chunk.finish_reason or finish
        model = chunk.model or model
        response_id = chunk.response_id or response_id
        if chunk.prompt_tokens is not None:
            prompt_tokens = chunk.prompt_tokens
        if chunk.completion_tokens is not None:
            completion_tokens = chunk.completion_tokens
        logprobs += chunk.logprobs
        token_ids += chunk.token_ids
    return Chunk(
        tokens=sum(len(c.token_ids) or c.tokens or (1 if c.text or c.logprobs else 0) for c in chunks),
        text="".join(chunk.text for chunk in chunks),
        finish_reason=finish,
        model=model,
        response_id=response_id,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        logprobs=tuple(logprobs),
        token_ids=tuple(token_ids),
        cached_tokens=cached_tokens,
    )


def parse_chunk(data: str | bytes) -> Chunk:
    """One SSE `data:` payload of a streamed completion, its JSON parsed once; an error object
    raises its typed error."""
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise errors.Unavailable(f"inference backend sent an unreadable chunk: {data[:80]!r}") from exc
    if not isinstance(payload, dict):
        raise errors.Unavailable(f"inference backend sent an unexpected chunk: {data[:80]!r}")
    if "error" in payload or payload.get("object") == "error":
        detail = payload.get("error", payload)
        code = detail.get("code") if isinstance(detail, dict) else None
        status = code if isinstance(code, int) else 500
        raise error_for_status(status, {}, json.dumps(payload).encode())
    text = ""
    finish: str | None = None
    logprobs: list[RawLogprob] = []
    token_ids: list[int] = []
    for choice in payload.get("choices") or ():
        text += choice.get("text") or ""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            token_ids += ids
        scored = choice.get("logprobs")
        if isinstance(scored, dict):
            tokens = scored.get("tokens") or []
            values = scored.get("token_logprobs") or [None] * len(tokens)
            tops = scored.get("top_logprobs") or [None] * len(tokens)
            logprobs += zip(tokens, values, tops, strict=False)
        reason = choice.get("finish_reason")
        if reason:
            finish = finish_reason(reason, choice.get("stop_reason"))
    usage = payload.get("usage") or {}
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Chunk(
        cached_tokens=cached if isinstance(cached, int) else None,
        text=text,
        finish_reason=finish,
        model=str(payload.get("model") or ""),
        response_id=str(payload.get("id") or ""),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        logprobs=tuple(logprobs),
        token_ids=tuple(token_ids),
    )


class EchoSplitter:
    """Splits an echoed prompt off the head of a stream (what `completion_body` asks for to score
    a prompt): its first `tokens` logprob entries are the prompt's, and its text starts with the
    prompt's text, which is dropped."""

    def __init__(self, tokens: int, text: str) -> None:
        self.left = tokens
        self.text = text
        self.prompt: list[RawLogprob] = []

    def split(self, chunk: Chunk) -> Chunk:
        """The chunk less what of the prompt it still carries (kept in `prompt`)."""
        if self.left <= 0 and not self.text:
            return chunk
        taken = chunk.logprobs[: self.left]
        self.prompt += taken
        self.left -= len(taken)
        text = chunk.text
        cut = min(len(self.text), len(text))
        if text[:cut] == self.text[:cut]:
            text, self.text = text[cut:], self.text[cut:]
        else:  # the server decoded the prompt otherwise: nothing more of it is looked for
            self.text = ""
        ids = chunk.token_ids[len(taken) :] if chunk.token_ids else ()
        return dataclasses.replace(chunk, text=text, logprobs=chunk.logprobs[len(taken) :], token_ids=tuple(ids))


def finish_reason(reason: str, stop_reason: object) -> str:
    if reason == "length":
        return FINISH_LENGTH
    if reason == "stop":
        # vLLM and SGLang name the stop string that matched; EOS leaves it null (or a token id).
        return FINISH_STOP_SEQUENCE if isinstance(stop_reason, str) else FINISH_STOP
    if reason == "abort":
        raise errors.Unavailable("inference backend aborted the request", reason="BACKEND_ABORTED", retry_after=1.0)
    return FINISH_STOP


def retry_after_seconds(value: str | None, now: float | None = None) -> float:
    """`Retry-After` as delay-seconds or an HTTP date; absent or unreadable: one second."""
    if not value:
        return DEFAULT_RETRY_AFTER_S
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return DEFAULT_RETRY_AFTER_S
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return DEFAULT_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


def _error_message(body: bytes) -> tuple[str, str | None]:
    """(message, param) from an OpenAI error body: {"error": {...}} or vLLM's older flat form."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300], None
    detail = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(detail, str):
        return detail[:300], None
    if not isinstance(detail, dict):
        return str(payload)[:300], None
    message = str(detail.get("message") or detail.get("detail") or payload)
    param = detail.get("param")
    return message[:300], param if isinstance(param, str) and param else None


def field_for(message: str, param: str | None) -> str:
    if param:
        # vLLM names it by pydantic's location, e.g. "body.seed".
        name = param.rsplit(".", 1)[-1]
        return FIELD_OF_PARAM.get(name, f"sampling.{name}")
    lowered = message.lower()
    for name, field in FIELD_OF_PARAM.items():
        if name in lowered:
            return field
    return "sampling"


def error_for_status(status: int, headers: Any, body: bytes) -> errors.LlmeshError:
    """The typed error for a backend's HTTP error answer."""
    message, param = _error_message(body)
    retry = retry_after_seconds(headers.get("retry-after") if headers else None)
    if status == 429:
        return errors.ResourceExhausted(
            f"inference backend is overloaded: {message}", retry_after=retry, reason="BACKEND_OVERLOADED"
        )
    if status == 503:
        return errors.Unavailable(
            f"inference backend is unavailable: {message}", reason="BACKEND_UNAVAILABLE", retry_after=retry
        )
    if status in (400, 422):
        return errors.InvalidArgument([(field_for(message, param), f"rejected by the inference backend: {message}")])
    if status in (401, 403):
        return errors.FailedPrecondition(
            f"inference backend refused our credentials (LLMESH_BACKEND_API_KEY): {message}",
            reason="BACKEND_UNAUTHORIZED",
        )
    if status == 404:
        return errors.Unavailable(
            f"inference backend does not serve the model: {message}", reason="BACKEND_MODEL_MISSING", retry_after=retry
        )
    if status >= 500:
        return errors.Unavailable(f"inference backend failed ({status}): {message}", reason="BACKEND_ERROR")
    return errors.FailedPrecondition(f"inference backend answered {status}: {message}", reason="BACKEND_REJECTED")
