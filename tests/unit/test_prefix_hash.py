from __future__ import annotations

import pytest

from llmesh.prefix_hash import block_hashes, chain


def test_equal_hashes_mean_equal_prefixes_not_just_equal_blocks() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different prefix before it
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # a partial block is not hashed
    assert a[0] == chain(0, [1, 2, 3, 4])


def test_limit_and_bad_block_size() -> None:
    assert len(block_hashes(list(range(100)), 16, limit=3)) == 3
    with pytest.raises(ValueError):
        block_hashes([1], 0)


def test_hashes_are_stable_values() -> None:
    # Engines and gateways in other processes (and versions) must agree: pin one value.
    assert block_hashes([0, 1, 2, 3], 4) == [5919486166599431679]
