"""How one batch line runs: through the gateway's own request path (the answer cache, retrieval,
admission, the key's limits, usage) as the same request over HTTP would, on the `batch` admission
lane, and answered in the HTTP API's own shapes.

`LineEndpoints` maps each endpoint a batch may name to its handler; an endpoint added to the HTTP
API later registers its own (`register`), and batches accept it from then on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from llmesh.errors import InvalidArgument, LlmeshError, NotFound
from services.gateway.auth import Caller
from services.gateway.core import Final, Gateway
from services.gateway.deadline import Deadline
from services.gateway.openai_http import CHAT, COMPLETIONS, EMBEDDINGS, Answer, embeddings_answer
from services.gateway.openai_models import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

BATCH_LANE = "batch"

#: (body, caller, request id) -> the answer's JSON body; raises LlmeshError as the HTTP route would.
LineHandler = Callable[[Mapping[str, Any], Caller, str], Awaitable[dict[str, Any]]]


def invalid(exc: ValidationError) -> InvalidArgument:
    """Pydantic's findings as the violations of one InvalidArgument (the first names the field)."""
    violations = []
    for error in exc.errors()[:10]:
        field = ".".join(str(p) for p in error.get("loc", ()))
        if error.get("type") == "extra_forbidden":
            violations.append((field, "unrecognized request argument"))
        else:
            violations.append((field, str(error.get("msg", "invalid"))))
    return InvalidArgument(violations or [("body", "invalid")])


class LineEndpoints(Mapping[str, LineHandler]):
    """The endpoints a batch line may name, each with its handler, over one Gateway."""

    def __init__(self, gateway: Gateway, deadline_s: float) -> None:
        self.gateway = gateway
        self.deadline_s = deadline_s
        self.handlers: dict[str, LineHandler] = {
            CHAT: self.chat_completion,
            COMPLETIONS: self.completion,
            EMBEDDINGS: self.embedding,
        }

    def register(self, endpoint: str, handler: LineHandler) -> None:
        self.handlers[endpoint] = handler

    def __getitem__(self, endpoint: str) -> LineHandler:
        return self.handlers[endpoint]

    def __iter__(self) -> Iterator[str]:
        return iter(self.handlers)

    def __len__(self) -> int:
        return len(self.handlers)

    async def _check_model(self, model: str, deadline: Deadline) -> None:
        served = await self.gateway.served_models(deadline)
        if model not in served:
            raise NotFound(
                f"The model {model!r} does not exist; this gateway serves {', '.join(served)}",
                reason="MODEL_NOT_FOUND",
            )

    async def _generate(
        self, body: ChatCompletionRequest | CompletionRequest, caller: Caller, request_id: str, chat: bool
    ) -> dict[str, Any]:
        if body.stream:
            raise InvalidArgument([("stream", "a batch line is answered whole: stream must be false")])
        deadline = Deadline.after(self.deadline_s)
        generate = body.to_generate(caller.tenant)
        generate.lane = BATCH_LANE
        await self._check_model(body.model, deadline)
        answer = Answer(
            f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            body.model,
            chat,
            logprobs=generate.sampling.logprobs,
            n=generate.n,
        )
        final: Final | None = None
        async for event in self.gateway.generate(generate, deadline, caller):
            if isinstance(event, Final):
                final = event
        if final is None:
            raise LlmeshError("the pipeline ended without an answer")
        return answer.whole(final.response)

    async def chat_completion(self, raw: Mapping[str, Any], caller: Caller, request_id: str) -> dict[str, Any]:
        try:
            body = ChatCompletionRequest.model_validate(raw)
        except ValidationError as exc:
            raise invalid(exc) from None
        return await self._generate(body, caller, request_id, chat=True)

    async def completion(self, raw: Mapping[str, Any], caller: Caller, request_id: str) -> dict[str, Any]:
        try:
            body = CompletionRequest.model_validate(raw)
        except ValidationError as exc:
            raise invalid(exc) from None
        return await self._generate(body, caller, request_id, chat=False)

    async def embedding(self, raw: Mapping[str, Any], caller: Caller, request_id: str) -> dict[str, Any]:
        try:
            body = EmbeddingRequest.model_validate(raw)
        except ValidationError as exc:
            raise invalid(exc) from None
        found = await self.gateway.embed(body.to_embed(caller.tenant), Deadline.after(self.deadline_s), caller)
        return embeddings_answer(body, found)
