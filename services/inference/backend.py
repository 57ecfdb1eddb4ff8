"""What the inference servicer asks of whoever generates: the builtin engine or a remote server.

Two implementations: `lifecycle.ModelManager` (the torch engine in this process, model switches)
and `openai_backend.OpenAIBackend` (a client of an OpenAI-compatible server such as vLLM).
Both take token ids validated against the same limits and stream `GenerationEvent`s; both raise
the typed errors of `llmesh.errors`. No gRPC here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from services.inference.engine import GenerationEvent, ModelDescription
from services.inference.engine.decoding import SamplingParams
from services.inference.engine.load import EngineLoad


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]:
        """Tokens of an already chat-templated prompt (no special tokens added)."""
        ...


class GenerationStream(Protocol):
    """One request's events; stopping early must call cancel(), which frees the sequence at once."""

    def __aiter__(self) -> AsyncIterator[GenerationEvent]: ...

    def cancel(self) -> None: ...


class InferenceBackend(Protocol):
    @property
    def encoder(self) -> Encoder:
        """The tokenizer prompts are counted and validated with (the model's own)."""
        ...

    @property
    def description(self) -> ModelDescription: ...

    @property
    def serving(self) -> bool:
        """False while the backend cannot generate (health reports NOT_SERVING)."""
        ...

    async def prepare(self, params: SamplingParams) -> None:
        """Whatever a request needs before `submit` that may take long (a response format's
        grammar, compiled off the event loop within a time limit); InvalidArgument naming the field."""
        ...

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str = "", priority: int = 0
    ) -> GenerationStream:
        """Validates at once (InvalidArgument, ResourceExhausted); errors while streaming come
        from iterating the stream. `priority`: InferenceRequest.priority (0 interactive, 1 batch)."""
        ...

    def load(self) -> EngineLoad | None:
        """The backend's load now (rows, queue, KV, step time), or None when it reports none:
        the signal the gateway admits and routes on (WatchLoad)."""
        ...

    async def load_version(self, version: str) -> ModelDescription: ...

    async def close(self) -> None: ...
