"""Constrained decoding for the builtin engine: a response format (JSON object, JSON Schema, regex,
choice) as a grammar over the model's own tokens, on llguidance (chosen by measuring per-token
mask cost on this CPU against xgrammar and outlines-core: bench/results/structured.json).

One `RowGrammar` per constrained row: it gives the row's token mask before each step and takes
the chosen token after it. Rows with and without grammars share a batch; the mask only touches
its own row's logits (`sampling.choose`), so a row's tokens never depend on its neighbours. The
masks of a step's grammar rows are filled in one call across llguidance's threads
(`Grammars.fill_masks`), and applied to the logits only of the rows where they change the token
(the sampled rows, and greedy rows whose likeliest token the grammar does not allow).

**A structured answer is always complete.** After each token the row checks that its value can
still be closed within the tokens it has left, by a dry run of the closing path from the new
state: a deterministic walk that prefers the tokens that close (`"`, `]`, `}` and their runs),
then a token the grammar forces, then the shortest token it allows. When the chosen token would
leave no room to close, the row takes the closing path's token instead and follows that path to
the end: the value closes by the last token the budget allows (finish_reason stays `length` when
the budget, not the model, ended it). A format whose closing path from the start is longer than
the budget is refused before any work (`Grammars.row`). The dry run reads only the candidate
tokens' bits of each mask (the whole vocabulary only when no closer, comma or forced token fits).
It is rarely needed: after a token the last closing path is first checked again by consuming it
on a copy (no masks; after text inside a string it still closes: a quote, then the same tail),
and the row on its closing path follows the path so checked. Inside a string, far from the
budget's end, even that check runs only every CHECK_EVERY tokens.

Compiled grammars are kept in a small LRU (`Grammars.cache_size`, by the format's text): a
schema is compiled once, and each row gets a copy of the compiled matcher (microseconds).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance.torch
import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from llmesh.errors import InvalidArgument
from services.inference.engine.decoding import ResponseFormatSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

DEFAULT_CACHE_SIZE = 64
# JSON without free whitespace: a model cannot spend its budget on blank lines inside a value.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
CLOSERS = frozenset('"]}')
STRUCT_CLOSERS = frozenset("]}")
NUMBER_TAILS = (b"-", b".", b"e", b"E", b"+")
# Inside a JSON string, the closing path is checked every this many tokens, and on every token
# once fewer than its last length + TEXT_MARGIN tokens are left.
CHECK_EVERY = 16
TEXT_MARGIN = 8
# The closing path's shortest allowed token is looked for among this many shortest tokens first.
SHORTEST_HEAD = 1024


@dataclass
class GrammarStats:
    compiled: int = 0
    cache_hits: int = 0
    last_compile_s: float = 0.0


class Grammars:
    """The grammar library of one model: its tokenizer as llguidance sees it, and the compiled
    formats (LRU). Built once per engine (about a quarter of a second)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int], cache_size: int = DEFAULT_CACHE_SIZE
    ) -> None:
        n_vocab = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        self.tokenizer = LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=sorted(eos_ids))
        self.vocab_size = n_vocab
        self.eos = sorted(eos_ids)
        self.cache_size = cache_size
        self.stats = GrammarStats()
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: LLExecutor | None = None  # the batch mask fill's threads, on first use
        self.words = (n_vocab + 31) // 32
        # Token ids by the bytes they decode to: the closing path's preferences.
        pieces = [self.tokenizer.decode_bytes([t]) for t in range(n_vocab)]
        self.pieces = pieces
        # Outside a string, runs of `]` and `}` close; inside one, only a quote closes (a `]` is text).
        struct = [t for t, b in enumerate(pieces) if b and set(b.decode("latin-1")) <= STRUCT_CLOSERS]
        quoted = [t for t, b in enumerate(pieces) if b[:1] == b'"' and set(b[1:].decode("latin-1")) <= CLOSERS]
        self.struct_closers = np.array(sorted(struct, key=lambda t: -len(pieces[t])), dtype=np.int64)
        self.string_closers = np.array(sorted(quoted, key=lambda t: -len(pieces[t])), dtype=np.int64)
        plain = [
            t
            for t, b in enumerate(pieces)
            if b and not b.isspace() and not self.tokenizer.is_special_token(t) and t not in eos_ids
        ]
        # Shortest first; a number's sign, point and exponent last (each only makes it longer).
        self.shortest_first = np.array(
            sorted(plain, key=lambda t: (len(pieces[t]), pieces[t][:1] in NUMBER_TAILS, t)), dtype=np.int64
        )
        self.separators = np.array([t for t, b in enumerate(pieces) if b == b","], dtype=np.int64)
        self.eos_ids = np.array(self.eos, dtype=np.int64)

    @staticmethod
    def source(spec: ResponseFormatSpec) -> tuple[str, str]:
        """(llguidance grammar, the request field it comes from)."""
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', JSON_OPTIONS), "response_format.type"
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.schema)
            except ValueError as exc:
                raise InvalidArgument([("response_format.json_schema", f"not JSON: {exc}")]) from exc
            try:
                text = LLMatcher.grammar_from_json_schema(json.dumps(schema), JSON_OPTIONS)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise InvalidArgument([("response_format.json_schema", f"cannot compile: {exc}")]) from exc
            return text, "response_format.json_schema"
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex), "response_format.regex"
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in spec.choices)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}"), "response_format.choices"
        if spec.kind == "grammar":
            return LLMatcher.grammar_from_lark(spec.grammar), "tools"
        raise InvalidArgument([("response_format.type", f"unknown type {spec.kind!r}")])

    def holds(self, spec: ResponseFormatSpec) -> bool:
        """Whether the format's matcher is compiled already (`compiled` then costs microseconds)."""
        with self._lock:
            return spec.cache_key() in self._compiled

    @staticmethod
    def source_field(spec: ResponseFormatSpec) -> str:
        """The request field a format comes from (what a refusal names)."""
        return {
            "json_object": "response_format.type",
            "json_schema": "response_format.json_schema",
            "regex": "response_format.regex",
            "choice": "response_format.choices",
            "grammar": "tools",
        }.get(spec.kind, "response_format.type")

    def compiled(self, spec: ResponseFormatSpec) -> LLMatcher:
        """The compiled matcher of a format (from the LRU, or compiled now); InvalidArgument
        naming the field when the library cannot compile it."""
        key = spec.cache_key()
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                self.stats.cache_hits += 1
                return found
        started = time.perf_counter()
        grammar, field = self.source(spec)
        matcher = LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidArgument([(field, f"cannot compile: {matcher.get_error()}")])
        # The lexer is built lazily on the first mask: build it now, once, in the compiled copy.
        scratch = torch.zeros((1, self.words), dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(matcher, scratch, 0)
        if matcher.is_error():
            raise InvalidArgument([(field, f"cannot compile: {matcher.get_error()}")])
        self.stats.last_compile_s = time.perf_counter() - started
        with self._lock:
            self.stats.compiled += 1
            self._compiled[key] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def fill_masks(self, rows: list[RowGrammar], bitmask: torch.Tensor) -> None:
        """The masks of `rows` into `bitmask[i]` for rows[i]: the rows on their closing path one
        token each, the others in one call across llguidance's threads (no GIL held)."""
        computed = [(r.matcher, i) for i, r in enumerate(rows) if not r.closing]
        for i, r in enumerate(rows):
            if r.closing:
                r.fill_mask(bitmask, i)
        if len(computed) == 1:
            llguidance.torch.fill_next_token_bitmask(computed[0][0], bitmask, computed[0][1])
        elif computed:
            if self._executor is None:
                self._executor = LLExecutor()
            llguidance.torch.fill_next_token_bitmask_par(self._executor, computed, bitmask)

    def row(self, spec: ResponseFormatSpec, budget: int) -> RowGrammar:
        """A matcher for one row, refused (InvalidArgument naming sampling.max_new_tokens) when its
        closing path from the start is longer than the row's budget."""
        # A grammar's JSON (tool calls' arguments) closes as JSON does; its text alternative is
        # complete at every token (end of sequence is always allowed there).
        row = RowGrammar(self, self.compiled(spec).deep_copy(), spec.kind in ("json_object", "json_schema", "grammar"))
        row._path = row.closing_path(row.matcher, row.text_state, budget)
        row._last_distance = len(row._path or ())
        if row._path is None:
            raise InvalidArgument(
                [
                    (
                        "sampling.max_new_tokens",
                        f"{budget} tokens cannot hold the shortest answer of this response format; ask for more",
                    )
                ]
            )
        return row


class RowGrammar:
    """One row's grammar state; used by the engine's worker thread only."""

    def __init__(self, grammars: Grammars, matcher: LLMatcher, json_text: bool) -> None:
        self.grammars = grammars
        self.matcher = matcher
        # For JSON: whether the text so far ends inside a string (and after a backslash there).
        self.json_text = json_text
        self.text_state = (False, False)
        # On the closing path: every further token is the path's.
        self.closing = False
        self._bits = torch.zeros((1, grammars.words), dtype=torch.int32)
        self._words = self._bits[0].numpy().view(np.uint32)  # the same memory, as numpy reads it
        # The closing path's length at the last dry run, and tokens taken since without one.
        self._last_distance = 0
        self._unchecked = 0
        # That closing path's tokens (checked again, not walked again, after text), and on the
        # closing path the tokens still to take of it.
        self._path: list[int] | None = None
        self._plan: list[int] = []

    def _inside_text(self, token: int, state: tuple[bool, bool], left: int) -> bool:
        """The token is plain text inside a JSON string (no quote, no backslash; the string was
        open before it and is after), with room to spare: the closing path stays a quote away
        (a pattern or length bound moves it by a character or so, inside the margin). A dry run
        still happens every CHECK_EVERY tokens."""
        if not self.json_text or not (self.text_state[0] and state[0]) or self.text_state[1] or state[1]:
            return False
        piece = self.grammars.pieces[token]
        if b'"' in piece or b"\\" in piece:
            return False
        return self._unchecked < CHECK_EVERY and left > self._last_distance + TEXT_MARGIN

    @property
    def stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    def fill_mask(self, bitmask: torch.Tensor, index: int) -> None:
        """The row's allowed tokens into `bitmask[index]` (int32 words, bit t % 32 of word t // 32)."""
        if self.closing:
            token = self._closing_token()
            bitmask[index].zero_()
            if token is not None:
                bitmask[index, token >> 5] = _bit(token & 31)
            return
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, index)

    def _advance(self, state: tuple[bool, bool], token: int) -> tuple[bool, bool]:
        if not self.json_text:
            return state
        in_string, escaped = state
        for byte in self.grammars.pieces[token]:
            if escaped:
                escaped = False
            elif in_string and byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = not in_string
        return in_string, escaped

    def take(self, token: int, left: int) -> int:
        """Consumes the chosen token and returns the one the row really takes: `token`, or the
        closing path's token when `token` would leave no way to close within `left` more tokens."""
        if self.matcher.is_stopped():
            return token
        if not self.closing:
            state = self._advance(self.text_state, token)
            if self._inside_text(token, state, left):
                # Text inside a JSON string, far from the budget's end: it cannot move the
                # closing path (a quote still closes), so the dry run is skipped.
                self.matcher.consume_token(token)
                self.text_state = state
                self._unchecked += 1
                return token
            trial = self.matcher.deep_copy()
            if trial.consume_token(token) and not trial.is_error():
                path = self._replay(trial, left)
                if path is None:
                    path = self.closing_path(trial, state, left)
                if path is not None:
                    self.matcher, self.text_state = trial, state
                    self._path, self._last_distance, self._unchecked = path, len(path), 0
                    return token
            # No room left after `token`: the row follows its closing path from here.
            self.closing = True
            plan = self._replay(self.matcher, left + 1)
            if plan is None:
                plan = self.closing_path(self.matcher, self.text_state, left + 1) or []
            self._plan = list(plan)
            path_token = self._closing_token()
            if path_token is not None:  # None: nothing valid (cannot happen under the mask)
                token = path_token
        if self._plan:
            if self._plan[0] == token:
                self._plan.pop(0)
            else:  # not the plan's token (a mask was not applied): the greedy path from here on
                self._plan = []
        self.matcher.consume_token(token)
        self.text_state = self._advance(self.text_state, token)
        return token

    def _closing_token(self) -> int | None:
        """The next token on the closing path: the plan's, then (complete) end of sequence."""
        if self._plan:
            return self._plan[0]
        return self.path_token(self.matcher, self.text_state)

    def _replay(self, matcher: LLMatcher, cap: int) -> list[int] | None:
        """The last closing path again when it still closes the value from `matcher`'s state
        within `cap` tokens (it does after text inside a string: a quote, then the same tail),
        checked by consuming it on a copy: no mask is computed."""
        path = self._path
        if path is None or len(path) > cap:
            return None
        if not path:
            return path if matcher.is_accepting() or matcher.is_stopped() else None
        walker = matcher.deep_copy()
        if walker.try_consume_tokens(path) != len(path) or walker.is_error():
            return None
        return path if walker.is_accepting() or walker.is_stopped() else None

    def distance(self, matcher: LLMatcher, state: tuple[bool, bool], cap: int) -> int | None:
        """Tokens the closing path needs from `matcher`'s state to a complete value (0: complete
        now), or None when that is more than `cap`."""
        path = self.closing_path(matcher, state, cap)
        return None if path is None else len(path)

    def closing_path(self, matcher: LLMatcher, state: tuple[bool, bool], cap: int) -> list[int] | None:
        """The closing path's tokens from `matcher`'s state to a complete value (empty: complete
        now), or None when it is longer than `cap`: a dry run on a copy."""
        if matcher.is_accepting() or matcher.is_stopped():
            return []
        walker = matcher.deep_copy()
        path: list[int] = []
        for _ in range(cap):
            token = self.path_token(walker, state)
            if token is None or not walker.consume_token(token) or walker.is_error():
                return None
            path.append(token)
            state = self._advance(state, token)
            if walker.is_accepting() or walker.is_stopped():
                return path
        return None

    def path_token(self, matcher: LLMatcher, state: tuple[bool, bool]) -> int | None:
        """The closing path's next token from `matcher`'s state: end of sequence when complete,
        else the longest allowed run of closers (inside a JSON string: a quote first), else a
        comma outside a string, else a forced token, else the shortest allowed. The candidates'
        bits are read from the mask's words; the whole vocabulary is unpacked only for the last
        two (rare: a number or a patterned string)."""
        g = self.grammars
        llguidance.torch.fill_next_token_bitmask(matcher, self._bits, 0)
        words = self._words
        if matcher.is_accepting():
            ok = _allowed(words, g.eos_ids)
            if len(ok):
                return int(ok[0])
        if self.json_text:
            ok = _allowed(words, g.string_closers if state[0] and not state[1] else g.struct_closers)
            if len(ok):
                return int(ok[0])
            if not state[0]:  # the next required member or item (a value cannot end sooner)
                ok = _allowed(words, g.separators)
                if len(ok):
                    return int(ok[0])
        forced = matcher.compute_ff_tokens()
        if forced:
            return int(forced[0])
        for ids in (g.shortest_first[:SHORTEST_HEAD], g.shortest_first[SHORTEST_HEAD:]):
            ok = _allowed(words, ids)
            if len(ok):
                return int(ok[0])
        anything = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        return int(anything[0]) if len(anything) and anything[0] < g.vocab_size else None


def _allowed(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The tokens of `ids` (in their order) whose bit is set in a mask's uint32 words."""
    return ids[((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]


def _bit(k: int) -> int:
    """Bit k of an int32 word as a Python int in int32 range."""
    value = 1 << k
    return value - (1 << 32) if value >= 1 << 31 else value
