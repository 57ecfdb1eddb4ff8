"""HTTP side of the gateway: the OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`) on Starlette with pydantic request models, served by uvicorn in the gateway's own
event loop.

A thin adapter, as the gRPC servicer is: the same `Gateway.generate` pipeline (cache, RAG,
admission, breakers, deadlines, tenants) answers both. Typed errors become OpenAI-shaped JSON
bodies with the HTTP status of their code (`llmesh.errors.HTTP_STATUS`), here in one place.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import re
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import uvicorn
from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmesh.errors import HTTP_STATUS, InvalidArgument, LlmeshError, NotFound, retry_after_of
from llmesh.rpc_tracing import start_server_span
from llmesh.server import lifecycle
from llmesh.settings import GatewayServiceSettings
from llmesh.tool_calls import CallDelta
from llmesh.v1 import common_pb2, gateway_pb2
from services.gateway import metrics
from services.gateway.auth import ApiKeys, Caller, KeyRing
from services.gateway.core import Delta, Final, Gateway, ModelChoice, server_timing
from services.gateway.deadline import Deadline
from services.gateway.embeddings import same_model
from services.gateway.intake import KeyGate
from services.gateway.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    Sampling,
    param_name,
)

log = logging.getLogger("llmesh.gateway.http")

CHAT, COMPLETIONS, MODELS, MODEL = "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}"
EMBEDDINGS = "/v1/embeddings"
FILES, BATCHES = "/v1/files", "/v1/batches"  # the Batch API's (services/gateway/batches/api.py)
RESPONSES, RESPONSE, MESSAGES = "/v1/responses", "/v1/responses/{response_id}", "/v1/messages"
ROUTES = frozenset({CHAT, COMPLETIONS, MODELS, EMBEDDINGS, FILES, BATCHES, RESPONSES, MESSAGES})
# An API's own error body, by route: (status, OpenAI's error body) -> the body that API sends.
ErrorShape = Callable[[int, dict[str, Any]], dict[str, Any]]
FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE = b"data: [DONE]\n\n"


def _json(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    return Response(_json(error_body(status, message, param, code)), status, headers, "application/json")


def from_llmesh_error(exc: LlmeshError, prompt_param: str) -> Response:
    """The one mapping of typed errors to the API's answers: status by gRPC code, an OpenAI error
    body (param: the first bad field, as the caller names it), Retry-After when the error says."""
    status = HTTP_STATUS.get(exc.code, 500)
    if status >= 500 and status != 503 and status != 504:
        log.error("HTTP request failed: %s", exc.message)
    param = None
    if isinstance(exc, InvalidArgument) and exc.violations and exc.violations[0][0]:
        param = param_name(exc.violations[0][0], prompt_param)
    headers = {k: v for k, v in exc.extra_trailing if isinstance(v, str)}
    retry_after = retry_after_of(exc)
    if retry_after is not None and status in (429, 503):
        headers["retry-after"] = str(max(1, math.ceil(retry_after)))
        headers["retry-after-ms"] = str(max(1, math.ceil(retry_after * 1000)))
    return error_response(status, exc.message, param, (exc.reason or exc.code.name).lower(), headers)


def authorization_of(headers: Any) -> str | None:
    """The caller's key as an `authorization` value: the header itself, or Anthropic's `x-api-key`
    (what its clients send) as a bearer token."""
    authorization = headers.get("authorization")
    if authorization is None and headers.get("x-api-key"):
        return f"Bearer {headers.get('x-api-key')}"
    return authorization


def reshaped(response: Response, path: str, shapes: dict[str, ErrorShape]) -> Response:
    """An error response in the shape of the API its route belongs to (OpenAI's unless listed)."""
    shape = next((f for route, f in shapes.items() if path == route or path.startswith(route + "/")), None)
    if shape is None or response.status_code < 400 or not response.body:
        return response
    body = shape(response.status_code, json.loads(bytes(response.body)))
    headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
    return Response(_json(body), response.status_code, headers, "application/json")


def _prompt_param(request: Request) -> str:
    path = request.url.path
    return "messages" if path == CHAT else "input" if path == EMBEDDINGS else "prompt"


def _validation_response(exc: ValidationError) -> Response:
    """Pydantic's findings as one 400 naming the parameters, as OpenAI's API answers."""
    problems: list[tuple[str, str]] = []
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ())]
        # A union (e.g. content: str | list[part]) reports each alternative: keep the parameter.
        param = ".".join(p for p in loc if not p.startswith(("str", "list[", "function-")))
        if error.get("type") == "extra_forbidden":
            text = f"unrecognized request argument supplied: {param}"
        elif error.get("type") == "json_invalid":
            param, text = "", f"the body is not valid JSON: {error.get('msg', '')}"
        else:
            text = f"{param}: {error.get('msg', 'invalid')}" if param else str(error.get("msg", "invalid"))
        if text not in (t for _, t in problems):
            problems.append((param, text))
    message = "; ".join(t for _, t in problems[:10]) or "invalid request"
    return error_response(400, message, problems[0][0] if problems and problems[0][0] else None, "invalid_request")


class BodyTooLarge(Exception):
    """The body read so far passed its route's limit: the rest is never read."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes")
        self.limit = limit


@dataclass(frozen=True)
class BodyLimits:
    """Largest body of each route, in bytes: generation, embeddings, anything else, and a batch
    input file's upload (0: as anything else)."""

    generate: int
    embed: int
    other: int
    files: int = 0

    def of(self, path: str) -> int:
        if path in (CHAT, COMPLETIONS, RESPONSES, MESSAGES):
            return self.generate
        if path == FILES and self.files:
            return self.files
        return self.embed if path == EMBEDDINGS else self.other


def too_large(limit: int) -> Response:
    return error_response(413, f"request body larger than {limit} bytes", None, "request_too_large")


class ObservedHttp:
    """Pure ASGI middleware around the API: the request's SERVER span (continuing the caller's
    `traceparent`), `x-request-id` and `x-trace-id` on every response, request metrics by route
    and status, the API key checked before any of the body is read (401), and the route's body
    limit applied while the body is read (413): a body is never read past its limit."""

    def __init__(
        self,
        app: ASGIApp,
        limits: BodyLimits,
        authenticate: Callable[[str | None], object],
        refused: Callable[[str | None], None] | None = None,
        error_shapes: dict[str, ErrorShape] | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.authenticate = authenticate
        # Told of each API request refused as invalid (400, 413), by its `authorization`.
        self.refused = refused
        self.error_shapes = error_shapes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method, path = scope["method"], scope["path"]
        route = (
            path
            if path in ROUTES
            else MODEL
            if path.startswith("/v1/models/")
            else RESPONSE
            if path.startswith("/v1/responses/")
            else "other"
        )
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        request_id = next((v for k, v in headers if k == "x-request-id" and REQUEST_ID_RE.match(v)), uuid.uuid4().hex)
        scope.setdefault("state", {})["request_id"] = request_id
        attributes: dict[str, Any] = {"http.request.method": method, "http.route": route, "url.path": path}
        if scope.get("client"):
            attributes["client.address"], attributes["client.port"] = scope["client"][0], scope["client"][1]
        span, token = start_server_span(f"{method} {route}", headers, attributes)
        span_context = span.get_span_context()
        extra = [(b"x-request-id", request_id.encode())]
        if span_context.is_valid:
            extra.append((b"x-trace-id", f"{span_context.trace_id:032x}".encode()))
        status = 500

        async def send_with_ids(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            refusal = self._refusal(path, headers)
            if refusal is not None:
                await refusal(scope, receive, send_with_ids)
            else:
                await self.app(scope, self._counted(receive, self.limits.of(path)), send_with_ids)
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            otel_context.detach(token)
            span.end()
            label = method if method in ("GET", "POST", "HEAD", "OPTIONS") else "other"  # bounded label values
            metrics.HTTP_REQUESTS.labels(route, label, str(status)).inc()
            metrics.HTTP_DURATION.labels(route).observe(time.perf_counter() - started)
            if status in (400, 413) and self.refused is not None and path.startswith("/v1/"):
                self.refused(authorization_of(dict(headers)))

    def _refusal(self, path: str, headers: Sequence[tuple[str, str]]) -> Response | None:
        """The answer to a request refused on its headers alone: no known key (keys on), or a
        declared length past the route's limit. None: read it."""
        if path.startswith("/v1/"):
            try:
                self.authenticate(authorization_of(dict(headers)))
            except LlmeshError as exc:
                return reshaped(from_llmesh_error(exc, ""), path, self.error_shapes)
        limit = self.limits.of(path)
        length = next((v for k, v in headers if k == "content-length"), None)
        if length is not None and length.isdigit() and int(length) > limit:
            return reshaped(too_large(limit), path, self.error_shapes)
        return None

    @staticmethod
    def _counted(receive: Receive, limit: int) -> Receive:
        """`receive` that raises BodyTooLarge as soon as the body read passes `limit`."""
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    raise BodyTooLarge(limit)
            return message

        return counted


class OpenAiApi:
    """The API's routes over one Gateway."""

    def __init__(
        self,
        gateway: Gateway,
        api_keys: ApiKeys | KeyRing,
        default_deadline: float,
        extra_routes: Sequence[Route] = (),
    ) -> None:
        self.gateway = gateway
        self.api_keys = api_keys
        self.default_deadline = default_deadline
        self.extra_routes = list(extra_routes)  # other APIs on the same server (the Batch API's)

    def app(
        self,
        limits: BodyLimits,
        gate: KeyGate | None = None,
        more_routes: Sequence[Route] = (),
        error_shapes: dict[str, ErrorShape] | None = None,
    ) -> ASGIApp:
        """The routes, `more_routes` (other APIs over the same gateway) and their error shapes."""
        # Plain Starlette routes with pydantic models parsing the body straight from JSON: a
        # framework's dependency injection and its own telemetry would cost more per cache hit
        # than the rest of the HTTP path (the span and metrics here are llmesh's own).
        routes = [
            Route(CHAT, self.chat_completions, methods=["POST"]),
            Route(COMPLETIONS, self.completions, methods=["POST"]),
            Route(EMBEDDINGS, self.embeddings, methods=["POST"]),
            Route(MODELS, self.list_models, methods=["GET"]),
            Route(MODEL, self.get_model, methods=["GET"]),
            *self.extra_routes,
            *more_routes,
        ]
        shapes = error_shapes or {}

        async def on_llmesh_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, LlmeshError)
            return reshaped(from_llmesh_error(exc, _prompt_param(request)), request.url.path, shapes)

        async def on_invalid(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, ValidationError)
            return reshaped(_validation_response(exc), request.url.path, shapes)

        async def on_http(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            answer = error_response(exc.status_code, str(exc.detail), None, None, dict(exc.headers or {}))
            return reshaped(answer, request.url.path, shapes)

        async def on_gone(request: Request, exc: Exception) -> Response:
            return Response(b"", 499)  # nginx's "client closed request": never sent, only logged

        async def on_too_large(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, BodyTooLarge)
            return reshaped(too_large(exc.limit), request.url.path, shapes)

        handlers = {
            LlmeshError: on_llmesh_error,
            ValidationError: on_invalid,
            HTTPException: on_http,
            ClientGone: on_gone,
            BodyTooLarge: on_too_large,
        }
        starlette = Starlette(routes=routes, exception_handlers=handlers)
        if gate is None:
            return ObservedHttp(starlette, limits, self.api_keys.authenticate, error_shapes=shapes)
        # The gRPC methods' gate: the key, then its budget of invalid calls, before the body.
        return ObservedHttp(starlette, limits, gate.admit_http, gate.refused_http, shapes)

    def _authenticated(self, request: Request) -> None:
        # Before the body is parsed: a bad key is a 401 whatever the body says.
        self.api_keys.authenticate(request.headers.get("authorization"))

    async def chat_completions(self, request: Request) -> Response:
        self._authenticated(request)
        body = ChatCompletionRequest.model_validate_json(await request.body())
        return await self.complete(request, body, body.to_generate, chat=True)

    async def completions(self, request: Request) -> Response:
        self._authenticated(request)
        body = CompletionRequest.model_validate_json(await request.body())
        if len(body.prompts()) > 1:
            return await self.complete_batch(request, body)
        return await self.complete(request, body, body.to_generate, chat=False)

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings: float lists, or base64 of the little-endian float32 values (what the
        openai client asks for by default)."""
        self._authenticated(request)
        body = EmbeddingRequest.model_validate_json(await request.body())
        caller = self.api_keys.caller(request.headers.get("authorization"), body.llmesh.tenant)
        embed = body.to_embed(caller.tenant)
        found = await self.gateway.embed(embed, Deadline.after(self.default_deadline), caller)
        return Response(_json(embeddings_answer(body, found)), 200, media_type="application/json")

    async def list_models(self, request: Request) -> Response:
        self._authenticated(request)
        deadline = Deadline.after(self.default_deadline)
        served = await self.gateway.served_models(deadline)
        dtypes = await self.gateway.served_dtypes(deadline)
        cards = [model_card(m, dtypes.get(m, "")) for m in served]
        embedder = await self.gateway.embedding_model(deadline)
        if embedder:  # the embedding model, for /v1/embeddings (while retrieval can say its name)
            cards.append(model_card(embedder))
        body = {"object": "list", "data": cards}
        return Response(_json(body), 200, media_type="application/json")

    async def get_model(self, request: Request) -> Response:
        self._authenticated(request)
        model = request.path_params["model"]
        deadline = Deadline.after(self.default_deadline)
        if model != await self.gateway.embedding_model(deadline):
            await self.check_model(model, deadline)
        return Response(_json(model_card(model)), 200, media_type="application/json")

    async def check_model(self, model: str, deadline: Deadline) -> ModelChoice:
        """The model a request names, resolved once: the request goes on with this resolution
        (`Gateway.generate`'s `choice`), never resolved again. A model not served (or none
        named) is NotFound, naming the models that are."""
        if model:
            with contextlib.suppress(NotFound):
                return await self.gateway.resolve(model, deadline)
        served = await self.gateway.served_models(deadline)
        raise NotFound(
            f"The model {model!r} does not exist; this gateway serves {', '.join(served)}",
            reason="MODEL_NOT_FOUND",
        )

    async def complete_batch(self, request: Request, body: CompletionRequest) -> Response:
        """Several prompts in one completions request, answered whole: each is its own request
        through the gateway (all at once), and the answer lists every prompt's choices in order
        (prompt i's choice j at index i * n + j, as OpenAI numbers them), usage summed."""
        bad = body.unsupported()
        if bad:
            raise InvalidArgument(bad)
        deadline = Deadline.after(self.default_deadline)
        caller = self.api_keys.caller(request.headers.get("authorization"), body.llmesh.tenant)
        parts = [body.model_copy(update={"prompt": prompt}) for prompt in body.prompts()]
        generates = [part.to_generate(caller.tenant) for part in parts]
        choice = await self.check_model(body.model, deadline)
        streams = [
            cast(AsyncGenerator[Delta | Final, None], self.gateway.generate(g, deadline, caller, choice))
            for g in generates
        ]
        finals = await self._whole_all(request, streams)
        n = max(1, body.n or 1)
        choices: list[dict[str, Any]] = []
        totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        cached = 0
        answers = []
        for i, (part, generate, final) in enumerate(zip(parts, generates, finals, strict=True)):
            whole = self._answer(request, part, generate, chat=False).whole(final.response)
            for choice in whole["choices"]:
                choices.append({**choice, "index": i * n + choice["index"]})
            for name in totals:
                totals[name] += whole["usage"][name]
            cached += whole["usage"]["prompt_tokens_details"]["cached_tokens"]
            answers.append(whole)
        usage = {**totals, "prompt_tokens_details": {"cached_tokens": cached}}
        merged = {**answers[0], "choices": choices, "usage": usage}
        merged["llmesh"] = {**answers[0]["llmesh"], "batch": [a["llmesh"] for a in answers]}
        timings = server_timing({k: max(f.timings.get(k, 0.0) for f in finals) for k in finals[0].timings})
        return Response(_json(merged), 200, {"server-timing": timings}, "application/json")

    def _answer(self, request: Request, body: Sampling, generate: gateway_pb2.GenerateRequest, chat: bool) -> Answer:
        """The shape the answer to `body` is written in."""
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:
            prompt = body.prompt_value()
            echo = prompt if isinstance(prompt, str) else ""  # token ids: the scored tokens' text
        return Answer(
            f"{'chatcmpl' if chat else 'cmpl'}-{request.state.request_id}",
            body.model,
            chat,
            # The legacy `logprobs` asked for with max_tokens 0 scores no generated token: still a list.
            logprobs=generate.sampling.logprobs or (isinstance(body, CompletionRequest) and body.logprobs is not None),
            n=generate.n,
            echo=echo,
            prompt_logprobs=body.prompt_logprobs is not None,
        )

    async def complete(self, request: Request, body: Sampling, translate: Any, chat: bool) -> Response:
        deadline = Deadline.after(self.default_deadline)
        caller = self.api_keys.caller(request.headers.get("authorization"), body.llmesh.tenant)
        generate: gateway_pb2.GenerateRequest = translate(caller.tenant)
        choice = await self.check_model(body.model, deadline)
        answer = self._answer(request, body, generate, chat)
        # An async generator: closed (the pipeline cancelled) when the caller goes away mid-stream.
        events = cast(AsyncGenerator[Delta | Final, None], self.gateway.generate(generate, deadline, caller, choice))
        if not body.stream:
            final = await self._whole(request, events)
            headers = {"server-timing": server_timing(final.timings)}
            return Response(_json(answer.whole(final.response)), 200, headers, "application/json")
        # The first event comes before any byte is sent: a refusal (shed, bad field) is a status.
        try:
            first = await anext(events)
        except StopAsyncIteration:
            raise LlmeshError("the pipeline ended without an answer") from None
        stream = answer.stream(first, events, body.include_usage, _prompt_param(request))
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    async def generation(
        self, request: Request, generate: gateway_pb2.GenerateRequest, caller: Caller
    ) -> AsyncGenerator[Delta | Final, None]:
        """The gateway's events for a request another API translated (the model checked first)."""
        choice = await self.check_model(generate.model, Deadline.after(self.default_deadline))
        deadline = Deadline.after(self.default_deadline)
        return cast(AsyncGenerator[Delta | Final, None], self.gateway.generate(generate, deadline, caller, choice))

    async def whole(self, request: Request, events: AsyncGenerator[Delta | Final, None]) -> Final:
        """The final event of a non-streaming answer (the client going away cancels it)."""
        return await self._whole(request, events)

    async def _whole(self, request: Request, events: AsyncGenerator[Delta | Final, None]) -> Final:
        """The final event of a non-streaming answer; a client that disconnects meanwhile cancels
        the generation (its engine row and its admission weight are freed at once, as a stream's
        are), instead of the answer being made for no one."""
        return (await self._whole_all(request, [events]))[0]

    async def _whole_all(self, request: Request, streams: Sequence[AsyncGenerator[Delta | Final, None]]) -> list[Final]:
        """`_whole` of several answers at once (a batch of prompts): the first failure fails the
        request, and a disconnect cancels every one of them."""

        async def last(events: AsyncGenerator[Delta | Final, None]) -> Final:
            final = None
            async for event in events:
                if isinstance(event, Final):
                    final = event
            if final is None:
                raise LlmeshError("the pipeline ended without an answer")
            return final

        async def every() -> list[Final]:
            tasks = [asyncio.ensure_future(last(events)) for events in streams]
            try:
                return list(await asyncio.gather(*tasks))
            finally:  # one failed, or all are cancelled: none goes on for no one
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        answer = asyncio.ensure_future(every())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
                for events in streams:
                    await events.aclose()
        if answer.cancelled():
            metrics.HTTP_DISCONNECTS.inc()
            raise ClientGone
        return answer.result()


class ClientGone(Exception):
    """The client went away before its answer: nothing is sent."""


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        continue


def embeddings_answer(body: EmbeddingRequest, found: gateway_pb2.EmbedResponse) -> dict[str, Any]:
    """OpenAI's embeddings answer: float lists, or base64 of the little-endian float32 values."""

    def encoded(values: Sequence[float]) -> Any:
        if body.encoding_format == "base64":
            return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
        return list(values)

    tokens = found.usage.input_tokens
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": e.index, "embedding": encoded(e.values)} for e in found.embeddings],
        "model": body.model if same_model(body.model, found.model) else found.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "llmesh": {"trace_id": found.trace_id},
    }


def model_card(model: str, dtype: str = "") -> dict[str, Any]:
    """OpenAI's model object; `llmesh.dtype`: what the model is served in, with its weight
    quantization ("bfloat16+int4"), where its inference reports it."""
    card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "llmesh"}
    if dtype:
        card["llmesh"] = {"dtype": dtype}
    return card


def usage_of(response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    """OpenAI's usage: prompt tokens including those served from the cache (`cached_tokens`, as
    OpenAI reports prompt caching), completion tokens generated (0 for a cached answer).
    `cached_tokens` also counts the prompt tokens the engine reused from its prefix cache."""
    u = response.usage
    prompt, completion = u.input_tokens + u.cached_input_tokens, u.output_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # Served from a cache instead of computed: the answer cache's, or the engine's prefix cache's.
        "prompt_tokens_details": {"cached_tokens": u.cached_input_tokens + u.prefix_cached_input_tokens},
    }


def extension_of(response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
    """What llmesh adds to an answer: the cache outcome, the sources, what was left out."""
    cache = response.cache
    return {
        "cache": {
            "hit": cache.hit,
            "tier": common_pb2.CacheTier.Name(cache.tier).removeprefix("CACHE_TIER_").lower() if cache.hit else None,
            "similarity": round(cache.similarity, 4) if cache.hit else None,
        },
        "sources": [
            {"document_id": s.document_id, "chunk_index": s.chunk_index, "score": round(s.score, 4)}
            for s in response.sources
        ],
        "degradations": list(response.degradations),
        "trace_id": response.trace_id,
        "model_key": response.model,
        # What a client bills on: tokens processed and generated, and those the cache saved.
        "usage": {
            "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens,
            "saved_tokens": response.usage.cached_input_tokens + response.usage.cached_output_tokens,
        },
    }


def chat_logprobs(entries: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.bytes),
                "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[common_pb2.TokenLogprob], offset: int = 0, unscored: int = 0
) -> dict[str, Any]:
    """The legacy completions' `logprobs`: tokens, token_logprobs, top_logprobs (token -> logprob)
    and text_offset (each token's character offset in the text, from `offset`). The first
    `unscored` entries have no log probability (an echoed prompt's first token): null."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [None if i < unscored else e.logprob for i, e in enumerate(entries)],
        "top_logprobs": [None if i < unscored else {t.token: t.logprob for t in e.top} for i, e in enumerate(entries)],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(entries: Sequence[common_pb2.TokenLogprob]) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first prompt token (nothing predicts it), then per
    token {token id: {logprob, rank, decoded_token}} for it and its likeliest alternatives (rank:
    1 for the likeliest; null for the prompt's own token when it is not among them)."""
    if not entries:
        return None
    out: list[dict[str, Any] | None] = [None]
    for e in entries[1:]:
        scored: dict[str, Any] = {}
        ranks = {t.token_id: i + 1 for i, t in enumerate(e.top)}
        scored[str(e.token_id)] = {"logprob": e.logprob, "rank": ranks.get(e.token_id), "decoded_token": e.token}
        for t in e.top:
            scored.setdefault(
                str(t.token_id), {"logprob": t.logprob, "rank": ranks[t.token_id], "decoded_token": t.token}
            )
        out.append(scored)
    return out


def prompt_text(entries: Sequence[common_pb2.TokenLogprob]) -> str:
    """The text of scored prompt tokens (their exact bytes, joined, then decoded)."""
    return b"".join(e.bytes for e in entries).decode("utf-8", "replace")


# A streamed call's arguments go out in pieces of at most this many characters, as OpenAI's do.
ARGUMENTS_PIECE = 32


def call_deltas(call: CallDelta) -> list[dict[str, Any]]:
    """A completed tool call as OpenAI streams one: a delta with its index, id, type and name
    (arguments ""), then its arguments in pieces."""
    head = {"index": call.index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    deltas = [{"tool_calls": [head]}]
    for at in range(0, len(call.arguments), ARGUMENTS_PIECE):
        piece = call.arguments[at : at + ARGUMENTS_PIECE]
        deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]})
    return deltas


class Answer:
    """One answer in the OpenAI shapes: a whole completion, or its chunks."""

    def __init__(
        self,
        answer_id: str,
        model: str,
        chat: bool,
        logprobs: bool = False,
        n: int = 1,
        echo: str | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        self.id = answer_id
        self.model = model
        self.chat = chat
        self.logprobs = logprobs  # the request asked for them: `logprobs` is then never null
        self.n = max(1, n)
        # Completions' echo: the prompt's text ("" for a token-id prompt: its scored tokens' text).
        self.echo = echo
        # vLLM's `prompt_logprobs` was asked for: returned in its shape.
        self.prompt_logprobs = prompt_logprobs
        self.offsets: dict[int, int] = {}  # completions streamed: each answer's text length so far
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._delta_head: tuple[str, bytes] | None = None  # (model, the bytes every delta chunk starts with)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(
        self,
        text: str | None,
        finish: str | None,
        first: bool = False,
        index: int = 0,
        logprobs: Sequence[common_pb2.TokenLogprob] = (),
    ) -> dict[str, Any]:
        if not self.chat:
            found = completion_logprobs(logprobs, self.offsets.get(index, 0)) if self.logprobs else None
            self.offsets[index] = self.offsets.get(index, 0) + len(text or "")
            return {"index": index, "text": text or "", "logprobs": found, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
        if text and not first:
            delta["content"] = text
        found = chat_logprobs(logprobs) if self.logprobs and logprobs else None
        return {"index": index, "delta": delta, "logprobs": found, "finish_reason": finish}

    def _whole_choice(
        self,
        index: int,
        text: str,
        finish_reason: int,
        tool_calls: Sequence[common_pb2.ToolCall],
        logprobs: Sequence[common_pb2.TokenLogprob],
        prompt: Sequence[common_pb2.TokenLogprob] = (),
    ) -> dict[str, Any]:
        finish = FINISH_REASONS.get(finish_reason, "stop")  # type: ignore[call-overload]
        if not self.chat:
            found = None
            if self.echo is not None:
                echoed = self.echo or prompt_text(prompt)
                if self.logprobs:
                    found = completion_logprobs([*prompt, *logprobs], unscored=1 if prompt else 0)
                text = echoed + text
            elif self.logprobs:
                found = completion_logprobs(logprobs)
            choice = {"index": index, "text": text, "logprobs": found, "finish_reason": finish}
            if self.prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
            return choice
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in tool_calls
            ]
        found = chat_logprobs(logprobs) if self.logprobs else None
        return {"index": index, "message": message, "logprobs": found, "finish_reason": finish}

    def whole(self, response: gateway_pb2.GenerateResponse) -> dict[str, Any]:
        prompt = response.prompt_logprobs
        if response.choices:  # n > 1: every answer by index
            choices = [
                self._whole_choice(c.index, c.text, c.finish_reason, c.tool_calls, c.logprobs, prompt)
                for c in response.choices
            ]
        else:
            choices = [
                self._whole_choice(
                    0, response.text, response.finish_reason, response.tool_calls, response.logprobs, prompt
                )
            ]
        body = {**self._envelope(self.object, choices), "usage": usage_of(response), "llmesh": extension_of(response)}
        if self.chat and self.prompt_logprobs:
            body["prompt_logprobs"] = vllm_prompt_logprobs(prompt)  # vLLM's place for chat
        if response.answered_by:
            body["model"] = response.answered_by  # for an alias: the model that answered
        return body

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + _json({**self._envelope(obj, choices), **extra}) + b"\n\n"

    def _delta_chunk(self, text: str, index: int, usage_null: bool) -> bytes:
        """`_chunk([_choice(text, None, index=index)], usage=None if usage_null)`, the same bytes,
        for the chunk sent per token: only the text is encoded, the rest is written once."""
        if self._delta_head is None or self._delta_head[0] != self.model:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            envelope = _json(self._envelope(obj, []))
            self._delta_head = (self.model, b"data: " + envelope[: -len(b"[]}")] + b'[{"index":')
        if self.chat:
            choice = b',"delta":{"content":' + _json(text) + b'},"logprobs":null,"finish_reason":null}]'
        else:
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
            choice = b',"text":' + _json(text) + b',"logprobs":null,"finish_reason":null}]'
        tail = b',"usage":null}\n\n' if usage_null else b"}\n\n"
        return b"".join((self._delta_head[1], str(index).encode(), choice, tail))

    async def stream(
        self,
        first: Delta | Final,
        events: AsyncGenerator[Delta | Final, None],
        include_usage: bool,
        prompt_param: str,
    ) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per text delta, a last chunk with the finish reason, a
        usage chunk (empty choices) when asked for, then `[DONE]`. An error after the first byte
        is an `error` event, as OpenAI's API sends."""
        usage = {"usage": None} if include_usage else {}
        try:
            if self.chat:
                for index in range(self.n):
                    yield self._chunk([self._choice("", None, first=True, index=index)], **usage)
            elif self.echo:  # a text prompt (CompletionRequest refuses the others streamed)
                for index in range(self.n):
                    yield self._chunk([self._choice(self.echo, None, index=index)], **usage)
            event: Delta | Final | None = first
            while event is not None:
                if isinstance(event, Delta):
                    if event.text and not self.logprobs:
                        yield self._delta_chunk(event.text, event.index, include_usage)
                    elif event.text or (self.logprobs and event.logprobs):
                        choice = self._choice(event.text, None, index=event.index, logprobs=event.logprobs)
                        yield self._chunk([choice], **usage)
                    for call in event.tool_calls:
                        for delta in call_deltas(call):
                            yield self._chunk(
                                [{"index": event.index, "delta": delta, "logprobs": None, "finish_reason": None}],
                                **usage,
                            )
                else:
                    response = event.response
                    self.model = response.answered_by or self.model  # for an alias: the model that answered
                    ends = [(c.index, c.finish_reason) for c in response.choices] or [(0, response.finish_reason)]
                    for index, reason in ends:
                        choice = self._choice(None, FINISH_REASONS.get(reason, "stop"), index=index)
                        if index == ends[-1][0]:
                            yield self._chunk([choice], **usage, llmesh=extension_of(response))
                        else:
                            yield self._chunk([choice], **usage)
                    if include_usage:
                        yield self._chunk([], usage=usage_of(response))
                event = await anext(events, None)
            yield DONE
        except LlmeshError as exc:
            error = from_llmesh_error(exc, prompt_param)
            yield b"data: " + bytes(error.body) + b"\n\n"
        finally:
            await events.aclose()


class _CoalescedWrites:
    """A transport whose writes within one event-loop turn go out as one send: uvicorn writes a
    response's head and body separately, two system calls where one does (a fifth of the CPU
    time of a cached answer over HTTP)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self._pending.append(bytes(data))

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _CoalescingHttpTools(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, _CoalescedWrites(cast(asyncio.Transport, transport))))


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in the service's own event loop: signals stay the service's, which drains the
    HTTP API alongside the gRPC server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Serves an ASGI app on `listen` (host:port, port 0 picks one), TLS as the gRPC port has it."""

    def __init__(
        self, app: ASGIApp, listen: str, grace: float, cert: str = "", key: str = "", client_ca: str = ""
    ) -> None:
        host, _, port = listen.rpartition(":")
        self.config = uvicorn.Config(
            app,
            host=host.strip("[]"),
            port=int(port),
            lifespan="off",
            http=_CoalescingHttpTools,
            log_config=None,  # the service's JSON logging stays as it is
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=max(1, math.ceil(grace)),
            ssl_certfile=cert or None,
            ssl_keyfile=key or None,
            ssl_ca_certs=client_ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
        )
        self.server = _EmbeddedServer(self.config)
        self.port = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        socket = self.config.bind_socket()  # bound now: the port is known, early clients queue
        self.port = socket.getsockname()[1]
        self._task = asyncio.create_task(self.server.serve(sockets=[socket]))
        self._task.add_done_callback(self._ended)
        return self.port

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("HTTP API stopped: %s", task.exception())

    async def stop(self) -> None:
        """Stops accepting, lets requests in flight finish (up to the grace time), then returns."""
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._task = None


# Other APIs over the same gateway (Responses, Messages): their routes and error shapes.
MoreApis = Callable[[OpenAiApi], tuple[Sequence[Route], dict[str, ErrorShape]]]


def http_api(
    gateway: Gateway,
    api_keys: ApiKeys | KeyRing,
    settings: GatewayServiceSettings,
    gate: KeyGate | None = None,
    extra_routes: Sequence[Route] = (),
    more_apis: MoreApis | None = None,
) -> HttpServer | None:
    """The gateway's HTTP API per its settings; None when LLMESH_HTTP_LISTEN is empty."""
    listen, sizes, runtime = settings.http.listen, settings.request_limits, settings.runtime
    if not listen:
        return None
    # A batch input file's upload: the file's own limit and room for the multipart framing.
    files = settings.batch.max_file_bytes + 64 * 1024
    limits = BodyLimits(
        sizes.max_generate_request_bytes, sizes.max_embed_request_bytes, sizes.max_query_request_bytes, files
    )
    api = OpenAiApi(gateway, api_keys, settings.requests.default_deadline_seconds, extra_routes)
    routes, shapes = more_apis(api) if more_apis is not None else ((), {})
    app = api.app(limits, gate, routes, shapes)
    return HttpServer(app, listen, runtime.grace_seconds, runtime.tls_cert, runtime.tls_key, runtime.tls_client_ca)


def announce(port: int) -> None:
    # Machine-readable, whatever the log level: supervisors and tests read the port from it.
    lifecycle.info("http listening", extra={"fields": {"event": "http_listening", "http_port": port}})
