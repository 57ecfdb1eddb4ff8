"""Retrieval validation and naming, without a store."""

from __future__ import annotations

import pytest

from llmesh.errors import InvalidArgument
from services.retrieval.core import Document, RetrievalCore, chunk_point_id, physical_name


def _core(**kw: int) -> RetrievalCore:
    return RetrievalCore(None, None, None, chunk_tokens=200, chunk_overlap=32, max_document_bytes=100, **kw)  # type: ignore[arg-type]


def test_physical_names_are_sanitized_and_unique() -> None:
    name = physical_name("Acme Corp", "Hand/Book")
    assert name.startswith("rag_acme_corp__hand_book_")
    assert physical_name("acme corp", "hand/book") != name  # case differs: another collection
    assert physical_name("a", "b") != physical_name("a_", "b") != physical_name("", "a_b")
    assert all(c.isalnum() or c in "_-" for c in physical_name("ü " * 100, "x" * 300))


def test_point_ids_are_deterministic() -> None:
    assert chunk_point_id("c", "doc", 0) == chunk_point_id("c", "doc", 0)
    assert len({chunk_point_id("c", "doc", 0), chunk_point_id("c", "doc", 1), chunk_point_id("c2", "doc", 0)}) == 3


def test_chunk_window_defaults() -> None:
    core = _core()
    docs = [Document("a", "text")]
    assert core.validate_upsert(docs, 0, 0) == (200, 32)
    assert core.validate_upsert(docs, 16, 0) == (16, 4)  # the default overlap shrinks with a small window
    assert core.validate_upsert(docs, 16, 8) == (16, 8)
    assert core.validate_upsert(docs, 2048, 1024) == (2048, 1024)
    with pytest.raises(InvalidArgument) as caught:
        core.validate_upsert(docs, 16, 9)
    assert caught.value.violations == [("overlap_tokens", "at most half of chunk_tokens (8 for 16)")]
    for window in (1, 15, 2049, 8192):
        with pytest.raises(InvalidArgument) as caught:
            core.validate_upsert(docs, window, 0)
        assert [f for f, _ in caught.value.violations] == ["chunk_tokens"]


def test_document_violations_name_each_field() -> None:
    docs = [
        Document("", "x"),
        Document("b", ""),
        Document("c", "é" * 51),
        Document("d", "x", {str(i): "v" for i in range(33)}),
        Document("e", "x", {"k": "v" * 1024}),
        Document("f", "x", {'bad"key': "v"}),
        Document("b", "x"),
    ]
    with pytest.raises(InvalidArgument) as caught:
        _core().validate_upsert(docs, 0, 0)
    assert [f for f, _ in caught.value.violations] == [
        "documents[0].id",
        "documents[1].text",
        "documents[2].text",
        "documents[3].metadata",
        "documents[4].metadata[k]",
        "documents[5].metadata",
        "documents[6].id",
    ]
