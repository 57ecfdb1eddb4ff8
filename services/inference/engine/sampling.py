"""Token choice on the device: greedy argmax for the whole batch, and temperature / nucleus
sampling for the rows that ask for it, with no host round trip and no CPU generator.

A sampled row's uniform draw for its n-th token is a hash of (seed, n), computed on the device,
so a seeded request gets the same tokens in any batch (and alone), and the draw costs no sync.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values below 2**32; products
    may wrap past 2**63, but only their low 32 bits are kept, which wrapping leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_draws(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float in [0, 1) per row from (seed, counter), both int64 [rows]."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    x = _mix32(_mix32(lo ^ _mix32(hi + 0x9E3779B9)) ^ (counters & _M32))
    x = _mix32(x ^ ((counters >> 32) & _M32) ^ 0x85EBCA6B)
    return (x >> 8).to(torch.float32) / float(1 << 24)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    nucleus_rows: bool = True,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature and nucleus sampling by inverse CDF for rows of `logits` [rows, vocab].

    The CDF runs in vocabulary order, not probability order: the last-bit differences batching
    makes in the logits then move its steps by as little, so the same draw picks the same token,
    where a re-sorted order would reshuffle near-equal tokens."""
    probs = torch.softmax(logits.float() / temperature.clamp(min=1e-5)[:, None], dim=-1)
    if top_k is not None:  # 0: off for that row
        ranked = probs.sort(dim=-1, descending=True).values
        kth = ranked.gather(1, (top_k.clamp(min=1) - 1)[:, None])
        probs = probs.masked_fill((probs < kth) & (top_k > 0)[:, None], 0.0)
    if min_p is not None:
        probs = probs.masked_fill(probs < (min_p * probs.max(dim=-1).values)[:, None], 0.0)
    if nucleus_rows:  # some row has top_p < 1 (the caller knows without a device sync)
        probs = probs.masked_fill(~nucleus_keep(probs, top_p), 0.0)
    cdf = probs.cumsum(dim=-1)
    draws = uniform_draws(seeds, counters)
    picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
    return picked.clamp_(max=cdf.shape[1] - 1)[:, 0]


#: Candidates the nucleus is looked for among before the whole vocabulary is sorted.
NUCLEUS_CANDIDATES = 256


def nucleus_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The tokens each row's nucleus keeps (bool [rows, vocab]): those whose more likely tokens
    hold less than top_p of the mass (every token where top_p >= 1).

    On the CPU the nucleus is looked for among the NUCLEUS_CANDIDATES likeliest tokens (a
    partial top-k, not a sort of the whole vocabulary); where they hold less than a row's top_p
    the rows are sorted in full. Exact either way: a token outside the candidates has all of them before it, so more
    than top_p of the mass, and the full sort would not keep it either."""
    vocab = probs.shape[1]
    nucleus = top_p < 1.0
    # On an accelerator the full sort is cheap and the check below would sync with the host.
    k = min(vocab, NUCLEUS_CANDIDATES) if probs.device.type == "cpu" else vocab
    ranked, order = probs.topk(k, dim=-1, sorted=True)
    if k < vocab and bool(((ranked.sum(dim=-1) < top_p) & nucleus).any()):
        ranked, order = probs.sort(dim=-1, descending=True)
    before = ranked.cumsum(dim=-1) - ranked  # mass of the more likely tokens
    keep_ranked = (before < top_p[:, None]) | ~nucleus[:, None]
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, keep_ranked)
    if keep_ranked.shape[1] < vocab:  # the rows without a nucleus keep every token
        keep |= ~nucleus[:, None]
    return keep


class StagedParams:
    """The sampled rows' fixed parameters on the device (batch rows, temperature, top_p, seeds),
    built once per change of the batch and reused while it holds: a decode step then copies
    only its token counters to the device, not five lists. One per decode loop (its owner's
    worker thread only)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: How often the parameters were staged (a test reads it).
        self.builds = 0

    def get(
        self, rows: list[int], temperature: list[float], top_p: list[float], seeds: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (device, tuple(rows), tuple(temperature), tuple(top_p), tuple(seeds))
        if key != self._key or self._tensors is None:
            self._tensors = (
                torch.tensor(rows, device=device),
                torch.tensor(temperature, device=device),
                torch.tensor(top_p, device=device),
                torch.tensor(seeds, dtype=torch.long, device=device),
            )
            self._key = key
            self.builds += 1
        return self._tensors


@dataclass(frozen=True)
class GrammarRows:
    """Rows under a grammar, their masks computed in the choice, all in one call (`fill`, the
    grammar library's batch fill: engine/grammar.py), and applied to the logits only where they
    change the token: a greedy row whose likeliest token its grammar allows takes it with no
    masking of its logits (the masked argmax is the same token: it is the first index of the
    maximum, and masking only removes other indices). `words`: int32 words of a mask."""

    rows: list[int]
    grammars: list[Any]
    words: int
    fill: Callable[[list[Any], torch.Tensor], None]

    def bitmask(self) -> BitmaskRows:
        """Every row's mask as a bitmask [rows, words]."""
        bitmask = torch.zeros((len(self.rows), self.words), dtype=torch.int32)
        self.fill(self.grammars, bitmask)
        return self.rows, bitmask


# Rows under a grammar: (their rows in the batch, their allowed tokens as an int32 bitmask
# [rows, ceil(vocab / 32)], bit t % 32 of word t // 32 set for an allowed token t)...
BitmaskRows = tuple[list[int], torch.Tensor]
# ...or their grammars, the masks computed as the choice needs them.
Constraints = BitmaskRows | GrammarRows


@dataclass(frozen=True)
class RowAdjustment:
    """What changes one row's logits before it chooses: OpenAI's logit_bias and presence /
    frequency penalties (over the tokens it generated), the repetition penalty (over its prompt
    and answer, as Hugging Face and vLLM define it)."""

    row: int
    bias: tuple[tuple[int, float], ...] = ()
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    seen: tuple[int, ...] = ()
    generated: tuple[int, ...] = ()
    #: Tokens the row may not choose now (EOS and stop token ids before min_new_tokens).
    banned: tuple[int, ...] = ()


@dataclass(frozen=True)
class Adjustments:
    """Per-row logit adjustments, and top_k / min_p of sampled rows (by batch row)."""

    rows: tuple[RowAdjustment, ...] = ()
    filters: dict[int, tuple[int, float]] = field(default_factory=dict)


def adjust(logits: torch.Tensor, adjustments: Adjustments | None) -> torch.Tensor:
    """Float32 logits with each row's penalties and biases applied (its own row only)."""
    logits = logits.float()
    if adjustments is None:
        return logits
    vocab = logits.shape[1]
    for a in adjustments.rows:
        row = logits[a.row]
        if a.repetition != 1.0 and a.seen:
            ids = torch.tensor(sorted(set(a.seen)), device=logits.device)
            values = row.index_select(0, ids)
            row.index_copy_(0, ids, torch.where(values > 0, values / a.repetition, values * a.repetition))
        if (a.presence or a.frequency) and a.generated:
            counts = torch.bincount(torch.tensor(a.generated, device=logits.device), minlength=vocab)[:vocab]
            row -= a.frequency * counts + a.presence * (counts > 0)
        if a.bias:
            ids, values = _bias_tensors(a.bias, logits.device)
            row.index_add_(0, ids, values)
        if a.banned:
            row.index_fill_(0, torch.tensor(a.banned, device=logits.device), float("-inf"))
    return logits


#: One prompt token's score: (its id, its log probability, the likeliest (id, logprob) there).
PromptScore = tuple[int, float, tuple[tuple[int, float], ...]]


def prompt_scores(logits: torch.Tensor, targets: list[int], top: int) -> list[PromptScore]:
    """The log probability of each of `targets` under the logits of the position before it
    (row i of `logits` [len(targets), vocab] predicts targets[i]), in float32, with the `top`
    likeliest tokens there: the model's own distribution (no temperature, penalties, biases)."""
    dist = torch.log_softmax(logits.float(), dim=-1)
    picked = dist.gather(1, torch.tensor(targets, device=dist.device)[:, None])[:, 0].tolist()
    if not top:
        return [(t, v, ()) for t, v in zip(targets, picked, strict=True)]
    values, ids = dist.topk(top, dim=-1, sorted=True)
    ranked = zip(ids.tolist(), values.tolist(), strict=True)
    return [(t, v, tuple(zip(i, w, strict=True))) for t, v, (i, w) in zip(targets, picked, ranked, strict=True)]


#: A request's logit_bias as device tensors, kept across its steps (by the bias itself: a row's
#: is the same every step, and building them from Python numbers costs more than the add).
_BIAS_TENSORS: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
BIAS_CACHE_SIZE = 256
_BIAS_LOCK = threading.Lock()


def _bias_tensors(bias: tuple[tuple[int, float], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), bias)
    with _BIAS_LOCK:  # engines' worker threads share it
        found = _BIAS_TENSORS.get(key)
        if found is not None:
            _BIAS_TENSORS.move_to_end(key)
            return found
    found = (
        torch.tensor([t for t, _ in bias], device=device),
        torch.tensor([b for _, b in bias], dtype=torch.float32, device=device),
    )
    with _BIAS_LOCK:
        _BIAS_TENSORS[key] = found
        while len(_BIAS_TENSORS) > BIAS_CACHE_SIZE:
            _BIAS_TENSORS.popitem(last=False)
    return found


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask [rows, words] as booleans [rows, vocab] (tokens past the mask: not allowed).
    Unpacked by numpy on the host (a tenth of the time of shifts in torch on this CPU)."""
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    allowed = torch.from_numpy(bits[:, :vocab])
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed


def constrain(logits: torch.Tensor, constraints: BitmaskRows | None) -> torch.Tensor:
    """Float32 logits with every token a row's grammar does not allow at -inf (its own row only)."""
    logits = logits.float()
    if constraints is None or not constraints[0]:
        return logits
    rows, bitmask = constraints
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_tokens(bitmask, logits.shape[1]).to(logits.device)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits.masked_fill_(~allowed, float("-inf"))  # every row constrained: in place
    masked = logits.index_select(0, index)
    masked.masked_fill_(~allowed, float("-inf"))
    logits[index] = masked
    return logits


@dataclass(frozen=True)
class LogprobRows:
    """The batch rows that return log probabilities (SamplingParams.logprobs), the temperature
    each row's token is drawn at (1.0 for a greedy row: its own logits) and how many likeliest
    alternatives each wants (0-20)."""

    rows: tuple[int, ...]
    temperatures: tuple[float, ...]
    top: tuple[int, ...]


@dataclass(frozen=True)
class RowLogprobs:
    """One row's chosen token, its log probability and the likeliest tokens (likeliest first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Scores:
    """The log probabilities of a step's LogprobRows, read back to the host (one copy for the
    chosen tokens' values and the alternatives, one for the alternatives' ids). The rows' whole
    distributions stay on the device for a token the caller replaces (a grammar's closing path)."""

    def __init__(
        self, request: LogprobRows, dist: torch.Tensor, values: list[list[float]], ids: list[list[int]]
    ) -> None:
        """`values` and `ids`: per asked row, the chosen token then the likeliest ones."""
        self._dist = dist
        self._index = {row: i for i, row in enumerate(request.rows)}
        self._ranked = {row: list(zip(ids[i][1:], values[i][1:], strict=True)) for i, row in enumerate(request.rows)}
        self._top = dict(zip(request.rows, request.top, strict=True))
        self.rows: dict[int, RowLogprobs] = {}
        for i, row in enumerate(request.rows):
            self.rows[row] = self._scored(row, ids[i][0], values[i][0])

    def get(self, row: int, token: int) -> RowLogprobs | None:
        """Batch row `row`'s scores for `token` (None when the row did not ask)."""
        found = self.rows.get(row)
        if found is None or found.token_id == token:
            return found
        return self._scored(row, token, float(self._dist[self._index[row], token]))

    def _scored(self, row: int, token: int, logprob: float) -> RowLogprobs:
        """`token`'s entry with the row's likeliest alternatives, the token ahead of those that tie
        with it: topk orders equal values arbitrarily, and a greedy answer's first alternative must
        be the token it took (a flat, random-weight or bfloat16 distribution ties often)."""
        ranked = self._ranked[row]
        if ranked and token not in (t for t, _ in ranked) and logprob >= ranked[-1][1]:
            ranked = [*ranked, (token, logprob)]  # tied at the cut: it may take a place
        ordered = sorted(ranked, key=lambda pair: (-pair[1], pair[0] != token))
        return RowLogprobs(token, logprob, tuple(ordered[: self._top[row]]))


def _log_probs(logits: torch.Tensor, request: LogprobRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The asked rows' log-softmax at their temperature (float32 [rows, vocab]) and its top
    values and ids [rows, max top]."""
    device = logits.device
    index = torch.tensor(request.rows, device=device)
    temperature = torch.tensor(request.temperatures, dtype=torch.float32, device=device).clamp(min=1e-5)
    dist = torch.log_softmax(logits.index_select(0, index) / temperature[:, None], dim=-1)
    values, ids = dist.topk(max(request.top), dim=-1, sorted=True)
    return dist, values, ids


def choose(
    logits: torch.Tensor,
    sampled_rows: list[int],
    temperature: list[float],
    top_p: list[float],
    seeds: list[int],
    counters: list[int],
    constraints: Constraints | None = None,
    adjustments: Adjustments | None = None,
    *,
    stage: StagedParams | None = None,
) -> torch.Tensor:
    """Greedy tokens for every row of `logits`, replaced by a sampled token in `sampled_rows`;
    rows in `constraints` choose among the tokens their grammar allows. The argmax runs in
    float32 (an exact widening, so the same index): the CPU's bfloat16 argmax takes twice as long
    as the conversion and the float32 argmax together. `stage`: where a decode loop keeps its
    batch's parameters on the device between steps (None: staged for this call only)."""
    return _choose(logits, sampled_rows, temperature, top_p, seeds, counters, constraints, adjustments, stage, None)[0]


def choose_scored(
    logits: torch.Tensor,
    sampled_rows: list[int],
    temperature: list[float],
    top_p: list[float],
    seeds: list[int],
    counters: list[int],
    constraints: Constraints | None = None,
    adjustments: Adjustments | None = None,
    logprobs: LogprobRows | None = None,
    *,
    stage: StagedParams | None = None,
) -> tuple[torch.Tensor, Scores | None]:
    """`choose`, and the log probabilities of the rows in `logprobs` (None when none asks: no
    cost to a batch where no row asks). They are of the distribution the token is drawn from
    after temperature, penalties and biases, before top-k / min-p / top-p truncation and the
    grammar's mask."""
    return _choose(logits, sampled_rows, temperature, top_p, seeds, counters, constraints, adjustments, stage, logprobs)


def _choose(
    logits: torch.Tensor,
    sampled_rows: list[int],
    temperature: list[float],
    top_p: list[float],
    seeds: list[int],
    counters: list[int],
    constraints: Constraints | None,
    adjustments: Adjustments | None,
    stage: StagedParams | None,
    logprobs: LogprobRows | None,
) -> tuple[torch.Tensor, Scores | None]:
    logits = adjust(logits, adjustments)
    # Before the mask (constrain may write into `logits`): a new tensor of the asked rows only.
    measured = _log_probs(logits, logprobs) if logprobs is not None and logprobs.rows else None
    if isinstance(constraints, GrammarRows):
        if logits.device.type == "cpu":
            chosen, logits = _choose_masked_lazily(logits, constraints, sampled_rows)
        else:  # on an accelerator a check per row would sync with the host: every mask, once
            logits = constrain(logits, constraints.bitmask())
            chosen = torch.argmax(logits, dim=-1)
    else:
        logits = constrain(logits, constraints)
        chosen = torch.argmax(logits, dim=-1)
    if sampled_rows:
        chosen = _sample(logits, chosen, sampled_rows, temperature, top_p, seeds, counters, adjustments, stage)
    if measured is None or logprobs is None:
        return chosen, None
    dist, values, ids = measured
    index = torch.tensor(logprobs.rows, device=logits.device)
    picked = chosen.index_select(0, index)[:, None]
    host_values = torch.cat([dist.gather(1, picked), values], dim=1).tolist()
    host_ids = torch.cat([picked, ids], dim=1).tolist()
    return chosen, Scores(logprobs, dist, host_values, host_ids)


def _choose_masked_lazily(
    logits: torch.Tensor, grammars: GrammarRows, sampled_rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens, and the logits with the grammar rows' masks applied only to the rows that
    need them: the sampled ones, and the greedy ones whose likeliest token is not allowed."""
    chosen = torch.argmax(logits, dim=-1)
    rows, bitmask = grammars.bitmask()
    likeliest = chosen.numpy()[rows]
    words = bitmask.numpy().view(np.uint32)
    word = np.minimum(likeliest >> 5, words.shape[1] - 1)
    bit = (words[np.arange(len(rows)), word] >> (likeliest & 31).astype(np.uint32)) & 1
    allowed = (bit == 1) & (likeliest >> 5 < words.shape[1])
    sampled = set(sampled_rows)
    need = [k for k, row in enumerate(rows) if row in sampled or not allowed[k]]
    if not need:
        return chosen, logits
    masked = [rows[k] for k in need]
    logits = constrain(logits, (masked, bitmask[need] if len(need) < len(rows) else bitmask))
    greedy = [row for row in masked if row not in sampled]
    if greedy:
        index = torch.tensor(greedy)
        chosen[index] = torch.argmax(logits.index_select(0, index), dim=-1)
    return chosen, logits


def _sample(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    sampled_rows: list[int],
    temperature: list[float],
    top_p: list[float],
    seeds: list[int],
    counters: list[int],
    adjustments: Adjustments | None,
    stage: StagedParams | None,
) -> torch.Tensor:
    device = logits.device
    index, temperatures, top_ps, seed_tensor = (stage or StagedParams()).get(
        sampled_rows, temperature, top_p, seeds, device
    )
    picked = sample_rows(
        logits.index_select(0, index),
        temperatures,
        top_ps,
        seed_tensor,
        torch.tensor(counters, dtype=torch.long, device=device),
        nucleus_rows=any(p < 1.0 for p in top_p),
        **_filters(sampled_rows, adjustments, device),
    )
    chosen[index] = picked
    return chosen


def _filters(rows: list[int], adjustments: Adjustments | None, device: torch.device) -> dict[str, torch.Tensor]:
    """top_k and min_p tensors aligned with the sampled rows (none when no row filters)."""
    if adjustments is None or not any(r in adjustments.filters for r in rows):
        return {}
    pairs = [adjustments.filters.get(r, (0, 0.0)) for r in rows]
    return {
        "top_k": torch.tensor([k for k, _ in pairs], dtype=torch.long, device=device),
        "min_p": torch.tensor([p for _, p in pairs], dtype=torch.float32, device=device),
    }
