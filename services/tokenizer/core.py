"""Tokenizer domain logic on the Rust `tokenizers` library (thread-safe, no gRPC here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from llmesh.chat_template import ROLES, TemplateRefused, load_template
from llmesh.errors import InvalidArgument, NotFound
from llmesh.v1 import common_pb2

MAX_CHUNK_TOKENS = 8192


@dataclass(frozen=True)
class Chunk:
    text: str
    token_start: int
    token_count: int
    char_start: int
    char_end: int


class TokenizerCore:
    def __init__(self, model_dir: Path, max_text_bytes: int) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_text_bytes = max_text_bytes
        self.template = load_template(model_dir)

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

    def chat_template(self, messages: Sequence[common_pb2.ChatMessage], add_generation_prompt: bool) -> str:
        """The model's own template over the turns as they are (tool turns and tool calls included)."""
        if not messages:
            raise InvalidArgument([("messages", "at least one message is required")])
        for i, message in enumerate(messages):
            if message.role not in ROLES:
                raise InvalidArgument([(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")])
            self._check_text(message.content, f"messages[{i}].content")
        try:
            return self.template.render(messages, add_generation_prompt)
        except TemplateRefused as exc:  # e.g. the template's own raise_exception: roles out of order
            raise InvalidArgument([("messages", f"the model's chat template refused them: {exc}")]) from exc

    def chunk(self, text: str, chunk_tokens: int, overlap_tokens: int) -> tuple[list[Chunk], int]:
        """Windows of at most chunk_tokens tokens; each starts overlap_tokens before the previous
        one ends. Chunk text is the exact slice of the input between token offsets."""
        violations = []
        if not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
            violations.append(("chunk_tokens", f"must be in 1..{MAX_CHUNK_TOKENS}"))
        if overlap_tokens >= max(chunk_tokens, 1):
            violations.append(("overlap_tokens", "must be smaller than chunk_tokens"))
        if violations:
            raise InvalidArgument(violations)
        self._check_text(text, "text")
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        offsets = encoding.offsets
        total = len(offsets)
        chunks: list[Chunk] = []
        step = chunk_tokens - overlap_tokens
        start = 0
        while start < total:
            end = min(start + chunk_tokens, total)
            char_start, char_end = offsets[start][0], offsets[end - 1][1]
            chunks.append(Chunk(text[char_start:char_end], start, end - start, char_start, char_end))
            if end == total:
                break
            start += step
        return chunks, total


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
