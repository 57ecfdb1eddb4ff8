"""The tokenizer's Chunk on the real SmolLM2 tokenizer: the same windows as the offsets say, the
most windows per text refused from the token count, and a cancelled or expired call stopping
between batches."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from llmesh import chunking
from llmesh.errors import Cancelled, DeadlineExceeded, InvalidArgument
from services.tokenizer.core import TokenizerCore

TEXT = (
    "Employees receive twenty-five days of paid vacation per calendar year. Ünïcødé naïve café 😀 12345. "
    "Business travel expenses are reimbursed within thirty days; keep every receipt. "
) * 40


@pytest.fixture(scope="module")
def core(models_dir: Path) -> TokenizerCore:
    return TokenizerCore(models_dir / "smollm2" / "current", 4 * 1024 * 1024)


def test_windows_are_the_slices_between_token_offsets(core: TokenizerCore) -> None:
    encoding = core.tokenizer.encode(TEXT, add_special_tokens=False)
    offsets = encoding.offsets
    for chunk, overlap in ((16, 0), (24, 4), (200, 32), (2048, 1024)):
        chunks, total = core.chunk(TEXT, chunk, overlap)
        assert total == len(offsets)
        assert len(chunks) == chunking.chunk_count(total, chunk, overlap)
        for index, made in enumerate(chunks):
            start = index * (chunk - overlap)
            end = min(start + chunk, total)
            assert (made.token_start, made.token_count) == (start, end - start)
            assert (made.char_start, made.char_end) == (offsets[start][0], offsets[end - 1][1])
            assert made.text == TEXT[made.char_start : made.char_end]
        assert chunks[-1].token_start + chunks[-1].token_count == total


def test_windows_outside_the_bounds_and_too_many_windows_are_refused(core: TokenizerCore, models_dir: Path) -> None:
    for chunk, overlap, field in ((1, 0, "chunk_tokens"), (8192, 8191, "chunk_tokens"), (64, 33, "overlap_tokens")):
        with pytest.raises(InvalidArgument) as refused:
            core.chunk(TEXT, chunk, overlap)
        assert [f for f, _ in refused.value.violations] == [field]
    core = TokenizerCore(models_dir / "smollm2" / "current", 4 * 1024 * 1024, max_chunks=100)
    total = len(core.tokenizer.encode(TEXT, add_special_tokens=False))
    count = chunking.chunk_count(total, 16, 8)
    assert count > 100  # past this tokenizer's own ceiling
    with pytest.raises(InvalidArgument) as refused:
        core.chunk(TEXT, 16, 8, max_chunks=5000)  # a request never raises the ceiling
    assert refused.value.violations == [
        ("text", f"makes {count} chunks ({total} tokens, a window every 8); at most 100")
    ]
    with pytest.raises(InvalidArgument):
        core.chunk(TEXT, 200, 0, max_chunks=2)
    assert len(core.chunk(TEXT, 200, 0, max_chunks=50)[0]) == chunking.chunk_count(total, 200, 0)


def test_a_cancelled_or_expired_call_stops_between_batches(core: TokenizerCore) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled):
        core.chunk(TEXT, 16, 0, stop=stop)
    with pytest.raises(DeadlineExceeded):
        core.chunk(TEXT, 16, 0, deadline=time.monotonic())
