"""Tokenizer domain logic on the Rust `tokenizers` library (thread-safe, no gRPC here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmesh.errors import InvalidArgument, NotFound

MAX_CHUNK_TOKENS = 8192
ROLES = ("system", "user", "assistant")


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
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        template_file = model_dir / "chat_template.jinja"
        source = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if not source:
            raise ValueError(f"{model_dir}: the tokenizer has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        self.template = env.from_string(source)
        self.special = {k: config.get(k, "") for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

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

    def chat_template(self, messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
        if not messages:
            raise InvalidArgument([("messages", "at least one message is required")])
        for i, (role, content) in enumerate(messages):
            if role not in ROLES:
                raise InvalidArgument([(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")])
            self._check_text(content, f"messages[{i}].content")
        return self.template.render(
            messages=[{"role": r, "content": c} for r, c in messages],
            add_generation_prompt=add_generation_prompt,
            **self.special,
        )

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
