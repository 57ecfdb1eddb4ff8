"""The block manager alone: block tables, reference counts, the prefix cache and its LRU
eviction (pure bookkeeping, no model)."""

from __future__ import annotations

import pytest

from llmesh.prefix_hash import block_hashes
from services.inference.engine import kv_manager
from services.inference.engine.kv_manager import NULL_BLOCK, BlockManager

B = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_a_sequence_holds_only_the_blocks_its_tokens_fill() -> None:
    kv = BlockManager(9, B)
    table = kv.allocate(tokens(0, 5))
    assert table is not None and len(table.blocks) == 2 and NULL_BLOCK not in table.blocks
    assert kv.free_blocks == 6
    assert kv.grow(table, 8) and len(table.blocks) == 2  # still room in the second block
    assert kv.grow(table, 9) and len(table.blocks) == 3
    kv.free(table)
    assert kv.free_blocks == 8 and table.blocks == []


def test_a_shared_prefix_is_held_by_both_and_the_last_prompt_block_is_never_shared() -> None:
    kv = BlockManager(17, B)
    system = tokens(100, 3 * B)
    first = kv.allocate([*system, 1, 2])
    assert first is not None and first.cached_tokens == 0
    kv.register(first, [*system, 1, 2])
    assert first.hashes == block_hashes([*system, 1, 2], B)  # the gateway's definition
    second = kv.allocate([*system, 7])
    assert second is not None and second.cached_tokens == 3 * B
    assert second.blocks[:3] == first.blocks[:3] and second.blocks[3] != first.blocks[3]
    assert all(kv.refs(b) == 2 for b in first.blocks[:3])
    # A prompt of exactly the cached blocks reuses all but the one holding its last token.
    exact = kv.allocate(system)
    assert exact is not None and exact.cached_tokens == 2 * B and exact.blocks[2] != first.blocks[2]
    for t in (first, second, exact):
        kv.free(t)
    assert kv.free_blocks == 16 and all(kv.refs(b) == 0 for b in range(1, 17))
    assert kv.cached_blocks == 3  # unreferenced, still cached
    assert kv.stats().hit_tokens == 5 * B


def test_eviction_is_least_recently_released_first_and_never_takes_a_held_block() -> None:
    kv = BlockManager(7, B)  # 6 usable
    held = kv.allocate(tokens(0, 2 * B + 1))  # 3 blocks, 2 full
    assert held is not None
    kv.register(held, tokens(0, 2 * B + 1))
    old = kv.allocate(tokens(50, B + 1))
    assert old is not None
    kv.register(old, tokens(50, B + 1))
    kv.free(old)  # its full block stays cached, evictable; its partial one is free
    newer = kv.allocate(tokens(80, B + 1))
    assert newer is not None
    kv.register(newer, tokens(80, B + 1))
    kv.free(newer)
    assert kv.free_blocks == 3 and kv.cached_blocks == 4
    # Pressure: 3 blocks wanted, 1 free + 2 evictable: both cached ones go, the older first.
    hungry = kv.allocate(tokens(200, 3 * B))
    assert hungry is not None
    assert kv.stats().evictions == 2
    assert not set(hungry.blocks) & set(held.blocks)
    assert kv.match([*tokens(0, 2 * B), 1])[0] == held.blocks[:2]  # the held prefix still matches
    assert kv.match([*tokens(50, B), 1])[0] == [] and kv.match([*tokens(80, B), 1])[0] == []
    # Nothing left to evict: held blocks are not an option.
    assert kv.allocate(tokens(300, B)) is None and kv.free_blocks == 0
    assert not kv.grow(hungry, 3 * B + 1)


def test_admission_leaves_the_reserve_for_running_rows() -> None:
    kv = BlockManager(5, B)
    assert kv.allocate(tokens(0, B), reserve=4) is None and kv.free_blocks == 4
    assert kv.allocate(tokens(0, B), reserve=3) is not None


def test_a_hash_collision_cannot_serve_another_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = BlockManager(9, B)
    monkeypatch.setattr(kv_manager, "chain", lambda parent, block: 42)  # every block collides
    first = kv.allocate([*tokens(0, B), 9])
    assert first is not None
    kv.register(first, [*tokens(0, B), 9])
    assert kv.match([*tokens(0, B), 9])[0] == first.blocks[:1]
    assert kv.match([*tokens(1, B), 9])[0] == []  # same hash, other ids: a miss


def test_with_caching_off_nothing_is_registered_or_reused() -> None:
    kv = BlockManager(9, B, prefix_caching=False)
    first = kv.allocate(tokens(0, 2 * B + 1))
    assert first is not None
    kv.register(first, tokens(0, 2 * B + 1))
    second = kv.allocate(tokens(0, 2 * B + 1))
    assert second is not None and second.cached_tokens == 0 and kv.cached_blocks == 0
    kv.free(first)
    kv.free(second)
    assert kv.free_blocks == 8 and kv.prefix_hashes() == ()
