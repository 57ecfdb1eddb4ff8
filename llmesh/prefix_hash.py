"""Prefix block hashes: one definition shared by the engine's prefix cache and the gateway's
prefix-affinity routing, so both name the same cached prefix the same way.

A prompt's token ids are cut into full blocks of `block_tokens`; block i's hash covers the ids
of blocks 0..i (each hash chains over the one before it), so equal hashes mean equal prefixes,
not just equal blocks. The chain starts from 0: an engine's cache belongs to one loaded model
version in one dtype (a model switch starts a new cache), which is what scopes it to the model.
Hashes are 63-bit ints from blake2b, stable across processes and machines (Python's `hash` is
not salted for ints, but its value is an implementation detail we do not lean on).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0
_MASK = (1 << 63) - 1


def chain(parent: int, block: Sequence[int]) -> int:
    """The hash of a block whose prefix before it hashes to `parent`."""
    digest = hashlib.blake2b(struct.pack(f"<q{len(block)}I", parent, *block), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def block_hashes(token_ids: Sequence[int], block_tokens: int, limit: int | None = None) -> list[int]:
    """The chained hashes of every full block of `token_ids` (at most `limit` of them)."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    full = len(token_ids) // block_tokens
    if limit is not None:
        full = min(full, limit)
    hashes: list[int] = []
    parent = ROOT
    for i in range(full):
        parent = chain(parent, token_ids[i * block_tokens : (i + 1) * block_tokens])
        hashes.append(parent)
    return hashes
