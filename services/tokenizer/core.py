"""Tokenizer domain logic on the Rust `tokenizers` library (thread-safe, no gRPC here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding, Tokenizer

from llmesh import chunking
from llmesh.chat_template import ROLES, TemplateRefused, load_template
from llmesh.errors import Cancelled, DeadlineExceeded, InvalidArgument, NotFound
from llmesh.v1 import common_pb2

# Windows made between two looks at whether the call was cancelled or ran out of time.
CHUNK_BATCH = 512


@dataclass(frozen=True)
class Chunk:
    text: str
    token_start: int
    token_count: int
    char_start: int
    char_end: int


class TokenizerCore:
    def __init__(
        self,
        model_dir: Path,
        max_text_bytes: int,
        max_chunks: int = chunking.DEFAULT_MAX_CHUNKS_PER_DOCUMENT,
        tool_format: str = "",
    ) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_text_bytes = max_text_bytes
        self.max_chunks = max_chunks
        self.template = load_template(model_dir, tool_format)

    def _check_text(self, text: str, field: str) -> None:
        if len(text.encode("utf-8", "surrogatepass")) > self.max_text_bytes:
            raise InvalidArgument([(field, f"longer than {self.max_text_bytes} bytes")])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self._check_text(text, "text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        bad = [i for i in ids if i >= self.vocab_size]
        if bad:
            raise InvalidArgument([("ids", f"token id {bad[0]} outside the vocabulary (size {self.vocab_size})")])
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def count(self, texts: list[str]) -> list[int]:
        for i, text in enumerate(texts):
            self._check_text(text, f"texts[{i}]")
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def chat_template(
        self,
        messages: Sequence[common_pb2.ChatMessage],
        add_generation_prompt: bool,
        tools: Sequence[common_pb2.Tool] = (),
    ) -> str:
        """The model's own template over the turns as they are (tool turns and tool calls
        included), and the functions the model may call (`ChatTemplate.render`)."""
        if not messages:
            raise InvalidArgument([("messages", "at least one message is required")])
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise InvalidArgument([(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")])
            self._check_text(message.content, f"messages[{i}].content")
        try:
            return self.template.render(messages, add_generation_prompt, tools)
        except TemplateRefused as exc:  # e.g. the template's own raise_exception: roles out of order
            raise InvalidArgument([("messages", f"the model's chat template refused them: {exc}")]) from exc

    def chunk(
        self,
        text: str,
        chunk_tokens: int,
        overlap_tokens: int,
        max_chunks: int = 0,
        stop: threading.Event | None = None,
        deadline: float = float("inf"),
    ) -> tuple[list[Chunk], int]:
        """Windows of at most chunk_tokens tokens; each starts overlap_tokens before the previous
        one ends. Chunk text is the exact slice of the input between token offsets.

        More than `max_chunks` windows (0, or above this tokenizer's own ceiling: that ceiling) is
        refused from the token count, before any window is made. Windows are made CHUNK_BATCH at
        a time; between batches a set `stop` (the call was cancelled) or a passed `deadline`
        (time.monotonic()) ends the work."""
        violations = chunking.window_violations(chunk_tokens, overlap_tokens)
        if violations:
            raise InvalidArgument(violations)
        self._check_text(text, "text")
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        total = len(encoding)
        count = chunking.chunk_count(total, chunk_tokens, overlap_tokens)
        limit = min(max_chunks, self.max_chunks) if max_chunks else self.max_chunks
        step = chunk_tokens - overlap_tokens
        if count > limit:
            raise InvalidArgument(
                [("text", f"makes {count} chunks ({total} tokens, a window every {step}); at most {limit}")]
            )
        chunks: list[Chunk] = []
        for first in range(0, count, CHUNK_BATCH):
            if stop is not None and stop.is_set():
                raise Cancelled("chunking cancelled by the caller")
            if time.monotonic() >= deadline:
                raise DeadlineExceeded("chunking ran past the caller's deadline")
            for index in range(first, min(first + CHUNK_BATCH, count)):
                start = index * step
                end = min(start + chunk_tokens, total)
                char_start, char_end = _chars(encoding, start)[0], _chars(encoding, end - 1)[1]
                chunks.append(Chunk(text[char_start:char_end], start, end - start, char_start, char_end))
        return chunks, total


def _chars(encoding: Encoding, token: int) -> tuple[int, int]:
    """A token's character offsets, without the whole offsets list (a tuple per token: 100 MB
    for a 1 MiB text of one-byte tokens)."""
    found = encoding.token_to_chars(token)
    return found if found is not None else encoding.offsets[token]


class Tokenizers:
    """The tokenizers of several models by name; a request naming none gets the default (the
    first). An unknown name is NotFound, naming the model and the ones served."""

    def __init__(self, cores: dict[str, TokenizerCore]) -> None:
        if not cores:
            raise ValueError("at least one tokenizer is required")
        self.cores = cores
        self.default = next(iter(cores))

    def get(self, model: str) -> TokenizerCore:
        found = self.cores.get(model or self.default)
        if found is None:
            raise NotFound(
                f"no tokenizer for model {model!r}; this service has {', '.join(self.cores)}",
                reason="MODEL_NOT_FOUND",
                metadata={"model": model},
            )
        return found
