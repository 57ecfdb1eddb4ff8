"""Text side of generation: request validation, incremental detokenization and stop strings.

Pure Python over a `tokenizers.Tokenizer`; no torch and no gRPC here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tokenizers import Tokenizer

from llmesh.errors import InvalidArgument

MAX_STOP_STRINGS = 4
MAX_STOP_BYTES = 64
MAX_TEMPERATURE = 2.0
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class ResponseFormatSpec:
    """The form an answer must take (`ResponseFormat` of the proto, as plain data)."""

    kind: str  # "json_object", "json_schema", "regex", "choice" or "grammar"
    schema: str = ""
    strict: bool = False
    name: str = ""
    regex: str = ""
    choices: tuple[str, ...] = ()
    # kind "grammar": a Lark grammar in llguidance's dialect (the gateway's automatic tool choice).
    grammar: str = ""

    def cache_key(self) -> str:
        """What the compiled grammar depends on (not the schema's name)."""
        return json.dumps([self.kind, self.schema, self.regex, list(self.choices), self.grammar])


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters as a request states them (0 means "default" where the proto says so)."""

    max_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    response_format: ResponseFormatSpec | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Return each generated token's log probability, and the `top_logprobs` likeliest (0-20).
    logprobs: bool = False
    top_logprobs: int = 0
    #: EOS, stop token ids and stop strings are held off until this many tokens are generated.
    min_new_tokens: int = 0
    keep_special_tokens: bool = False
    #: The stop string that matched stays in the text.
    include_stop_str: bool = False
    #: Score every prompt token, with this many alternatives (None: not asked).
    prompt_logprobs: int | None = None
    #: Generate nothing: the prompt is only prefilled (and scored).
    prompt_only: bool = False


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_new_tokens: int
    default_max_new_tokens: int
    max_context_tokens: int
    vocab_size: int


@dataclass(frozen=True)
class ResolvedParams:
    """Validated parameters with every default applied."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    top_k: int = 0
    min_p: float = 0.0
    # 1.0 = off.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    min_new_tokens: int = 0
    keep_special_tokens: bool = False
    include_stop_str: bool = False
    prompt_logprobs: int | None = None
    prompt_only: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or biases change this row's logits before it chooses."""
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty or self.logit_bias
        )


def resolve_params(params: SamplingParams, prompt_ids: list[int], limits: Limits) -> ResolvedParams:
    """Checks a request against the limits; raises InvalidArgument naming every violation and limit."""
    bad: list[tuple[str, str]] = []
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        bad.append(("input", "the prompt is empty"))
    elif n_prompt > limits.max_prompt_tokens:
        bad.append(
            (
                "input",
                f"the prompt has {n_prompt} tokens; the limit is {limits.max_prompt_tokens} (LLMESH_MAX_PROMPT_TOKENS)",
            )
        )
    out_of_vocab = next((t for t in prompt_ids if not 0 <= t < limits.vocab_size), None)
    if out_of_vocab is not None:
        bad.append(("token_ids.ids", f"token id {out_of_vocab} is outside the vocabulary (size {limits.vocab_size})"))

    temperature = float(params.temperature)
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        bad.append(("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}]"))
    top_p = float(params.top_p)
    if not (math.isfinite(top_p) and 0.0 <= top_p <= 1.0):
        bad.append(("sampling.top_p", "must be in [0, 1] (0 means 1, no nucleus filtering)"))
    top_p = 1.0 if top_p == 0.0 else top_p

    max_new = int(params.max_new_tokens)
    room = limits.max_context_tokens - n_prompt
    if params.prompt_only:
        max_new = 0  # the prompt is read, nothing is generated
        if n_prompt > limits.max_context_tokens:
            bad.append(("input", f"the prompt is longer than the model context of {limits.max_context_tokens} tokens"))
    elif max_new < 0:
        bad.append(("sampling.max_new_tokens", "must be >= 0"))
    elif max_new > limits.max_new_tokens:
        bad.append(("sampling.max_new_tokens", f"must be at most {limits.max_new_tokens} (LLMESH_MAX_NEW_TOKENS)"))
    elif max_new == 0:
        # The server default is trimmed to the room the context leaves; an explicit value is not.
        max_new = min(limits.default_max_new_tokens, room)
        if max_new < 1 and n_prompt:
            bad.append(("input", f"the prompt fills the model context of {limits.max_context_tokens} tokens"))
    elif n_prompt and n_prompt + max_new > limits.max_context_tokens:
        bad.append(
            (
                "sampling.max_new_tokens",
                f"prompt ({n_prompt}) + max_new_tokens ({max_new}) exceeds the model "
                f"context of {limits.max_context_tokens} tokens",
            )
        )

    stop = tuple(params.stop)
    if len(stop) > MAX_STOP_STRINGS:
        bad.append(("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
    for i, s in enumerate(stop):
        if not s:
            bad.append((f"sampling.stop[{i}]", "must not be empty"))
        elif len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
            bad.append((f"sampling.stop[{i}]", f"longer than {MAX_STOP_BYTES} bytes"))
    _check_adjustments(params, limits, bad)
    if params.min_new_tokens < 0 or (not params.prompt_only and params.min_new_tokens > max(max_new, 1)):
        bad.append(("sampling.min_new_tokens", "must be in [0, max_new_tokens]"))
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= MAX_TOP_LOGPROBS:
        bad.append(("sampling.prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"))
    if bad:
        raise InvalidArgument(bad)
    return ResolvedParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        seed=params.seed,
        stop=stop,
        ignore_eos=bool(params.ignore_eos),
        top_k=int(params.top_k),
        min_p=float(params.min_p),
        repetition_penalty=float(params.repetition_penalty) or 1.0,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        stop_token_ids=frozenset(params.stop_token_ids),
        logit_bias=tuple(sorted(params.logit_bias)),
        logprobs=bool(params.logprobs),
        top_logprobs=int(params.top_logprobs),
        min_new_tokens=0 if params.prompt_only else int(params.min_new_tokens),
        keep_special_tokens=bool(params.keep_special_tokens),
        include_stop_str=bool(params.include_stop_str),
        prompt_logprobs=params.prompt_logprobs,
        prompt_only=bool(params.prompt_only),
    )


MAX_STOP_TOKEN_IDS = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300


def _check_adjustments(params: SamplingParams, limits: Limits, bad: list[tuple[str, str]]) -> None:
    """top_k, min_p, the penalties, stop token ids and logit_bias (OpenAI's and vLLM's ranges)."""
    if not 0 <= params.top_k <= limits.vocab_size:
        bad.append(("sampling.top_k", f"must be in [0, {limits.vocab_size}] (0: off)"))
    if not (math.isfinite(params.min_p) and 0.0 <= params.min_p <= 1.0):
        bad.append(("sampling.min_p", "must be in [0, 1] (0: off)"))
    if not (math.isfinite(params.repetition_penalty) and 0.0 <= params.repetition_penalty <= 2.0):
        bad.append(("sampling.repetition_penalty", "must be in (0, 2] (0 or 1: off)"))
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            bad.append((f"sampling.{name}", "must be in [-2, 2]"))
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad.append(("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}"))
    if any(not 0 <= t < limits.vocab_size for t in params.stop_token_ids):
        bad.append(("sampling.stop_token_ids", f"token ids are below the vocabulary size {limits.vocab_size}"))
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        bad.append(("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"))
    elif params.top_logprobs and not params.logprobs:
        bad.append(("sampling.top_logprobs", "needs sampling.logprobs set to true"))
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        bad.append(("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} tokens"))
    for token, bias in params.logit_bias:
        if not 0 <= token < limits.vocab_size:
            bad.append(("sampling.logit_bias", f"token id {token} is outside the vocabulary"))
            break
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            bad.append(("sampling.logit_bias", "each bias must be in [-100, 100]"))
            break


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenPieces:
    """Each token's exact bytes and its text on its own (OpenAI's logprobs `token` and `bytes`):
    a token holding part of a UTF-8 character shows U+FFFD in the text, its bytes are exact.
    Byte-level BPE tokens map back through the byte alphabet, byte-fallback tokens (<0xNN>) are
    their byte, added (special) tokens their content, any other token what it decodes to.
    Cached per id; one per tokenizer (not thread-safe: its owner's thread only)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self._table = _byte_level_table()
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token."""
        found = self._cache.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = self._cache[token_id] = (raw.decode("utf-8", "replace"), raw)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._table for c in piece):
            return bytes(self._table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", "surrogatepass")


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a
    prefix yields U+FFFD. The decoder keeps a window of already-emitted tokens, decodes the
    window with and without the new tokens, and emits the difference only when it does not
    end in U+FFFD (the prefix-diff approach of TGI and vLLM).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation), even if incomplete."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds stop strings in streamed text. Text that could be the start of a stop string is
    held back until it is known not to be one, so no text past a stop is ever returned."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = stops
        self._include = include_stop
        self._pending = ""

    def push(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched). Not `armed` (min_new_tokens not
        reached yet): the text passes and no stop string is looked for."""
        if not self._stops:
            return delta, False
        if not armed:
            text, self._pending = self._pending + delta, ""
            return text, False
        if not delta:
            return "", False
        buf = self._pending + delta
        hits = [(i, len(s)) for i, s in ((buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            at, size = min(hits)
            return buf[: at + size] if self._include else buf[:at], True
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text
