"""Token choice on the device: greedy argmax for the whole batch, and temperature / nucleus
sampling for the rows that ask for it, with no host round trip and no CPU generator.

A sampled row's uniform draw for its n-th token is a hash of (seed, n), computed on the device,
so a seeded request gets the same tokens in any batch (and alone), and the draw costs no sync.
"""

from __future__ import annotations

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
) -> torch.Tensor:
    """Temperature and nucleus sampling by inverse CDF for rows of `logits` [rows, vocab].

    The CDF runs in vocabulary order, not probability order: the last-bit differences batching
    makes in the logits then move its steps by as little, so the same draw picks the same token,
    where a re-sorted order would reshuffle near-equal tokens."""
    probs = torch.softmax(logits.float() / temperature.clamp(min=1e-5)[:, None], dim=-1)
    if nucleus_rows:  # some row has top_p < 1 (the caller knows without a device sync)
        nucleus = top_p < 1.0
        ranked, order = probs.sort(dim=-1, descending=True)
        before = ranked.cumsum(dim=-1) - ranked  # mass of the more likely tokens
        keep_sorted = (before < top_p[:, None]) | ~nucleus[:, None]
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
    cdf = probs.cumsum(dim=-1)
    draws = uniform_draws(seeds, counters)
    picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
    return picked.clamp_(max=cdf.shape[1] - 1)[:, 0]


# Rows under a grammar: (their rows in the batch, their allowed tokens as an int32 bitmask
# [rows, ceil(vocab / 32)], bit t % 32 of word t // 32 set for an allowed token t).
Constraints = tuple[list[int], torch.Tensor]


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask [rows, words] as booleans [rows, vocab] (tokens past the mask: not allowed).
    Unpacked by numpy on the host (a tenth of the time of shifts in torch on this CPU)."""
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    allowed = torch.from_numpy(bits[:, :vocab])
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed


def constrain(logits: torch.Tensor, constraints: Constraints | None) -> torch.Tensor:
    """Float32 logits with every token a row's grammar does not allow at -inf (its own row only)."""
    logits = logits.float()
    if constraints is None or not constraints[0]:
        return logits
    rows, bitmask = constraints
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_tokens(bitmask, logits.shape[1]).to(logits.device)
    masked = logits.index_select(0, index)
    masked.masked_fill_(~allowed, float("-inf"))
    logits[index] = masked
    return logits


def choose(
    logits: torch.Tensor,
    sampled_rows: list[int],
    temperature: list[float],
    top_p: list[float],
    seeds: list[int],
    counters: list[int],
    constraints: Constraints | None = None,
) -> torch.Tensor:
    """Greedy tokens for every row of `logits`, replaced by a sampled token in `sampled_rows`;
    rows in `constraints` choose among the tokens their grammar allows. The argmax runs in
    float32 (an exact widening, so the same index): the CPU's bfloat16 argmax takes twice as long
    as the conversion and the float32 argmax together."""
    logits = constrain(logits, constraints)
    chosen = torch.argmax(logits, dim=-1)
    if not sampled_rows:
        return chosen
    device = logits.device
    index = torch.tensor(sampled_rows, device=device)
    picked = sample_rows(
        logits.index_select(0, index),
        torch.tensor(temperature, device=device),
        torch.tensor(top_p, device=device),
        torch.tensor(seeds, dtype=torch.long, device=device),
        torch.tensor(counters, dtype=torch.long, device=device),
        nucleus_rows=any(p < 1.0 for p in top_p),
    )
    chosen[index] = picked
    return chosen
