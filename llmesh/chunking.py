"""The chunk window of an ingest, checked the same way by the gateway, retrieval and the
tokenizer (each is reachable directly), and the number of chunks a window makes of a text.

Why these bounds:

* `chunk_tokens` at least 16: a smaller window carries too little text to be found by meaning,
  and the number of chunks (each one embedding and one stored point) grows as 1/window: a 1 MiB
  document at a 1-token window is a million chunks.
* `chunk_tokens` at most 2048: the embedding model reads 256 tokens of a chunk (MiniLM's
  max_seq_length) and ignores the rest, and a chunk is context a generation reads: four chunks of
  2048 tokens already fill a small model's prompt. A larger window only makes the response and
  the stored payloads bigger.
* `overlap_tokens` at most half the window: each token is then in at most two chunks, so the
  chunks of a document hold at most twice its text, and the stride (window - overlap) is at
  least half the window. At 8192/8191 (the earlier limits) a 1 MiB document made about a million
  windows of 8192 tokens, some 8.5 GB of chunk text.

The number of chunks per document has a ceiling of its own (LLMESH_MAX_CHUNKS_PER_DOCUMENT),
computed from the document's token count and the stride before any chunk is made.
"""

from __future__ import annotations

MIN_CHUNK_TOKENS = 16
MAX_CHUNK_TOKENS = 2048
# An ingest's overlap is at most this fraction of its window (overlap <= chunk_tokens // 2).
MAX_OVERLAP_DIVISOR = 2
# A token covers at least one byte of text, so a 1 MiB document (LLMESH_MAX_DOCUMENT_BYTES'
# default) is at most 1,048,576 tokens: at the default window (200 tokens, overlap 32, stride
# 168) at most 6,242 chunks. This ceiling holds that with room to spare.
DEFAULT_MAX_CHUNKS_PER_DOCUMENT = 8192


def max_overlap(chunk_tokens: int) -> int:
    return chunk_tokens // MAX_OVERLAP_DIVISOR


def window_violations(chunk_tokens: int, overlap_tokens: int) -> list[tuple[str, str]]:
    """The field violations of one window (both resolved: no 0-means-default here)."""
    if not MIN_CHUNK_TOKENS <= chunk_tokens <= MAX_CHUNK_TOKENS:
        return [("chunk_tokens", f"must be in {MIN_CHUNK_TOKENS}..{MAX_CHUNK_TOKENS}")]
    if overlap_tokens > max_overlap(chunk_tokens):
        return [("overlap_tokens", f"at most half of chunk_tokens ({max_overlap(chunk_tokens)} for {chunk_tokens})")]
    return []


def request_violations(chunk_tokens: int, overlap_tokens: int) -> list[tuple[str, str]]:
    """The violations a caller's request shows on its own, where 0 means the server's default
    (the gateway checks these; retrieval, which knows its defaults, checks the resolved window)."""
    if chunk_tokens:
        return window_violations(chunk_tokens, overlap_tokens)
    if overlap_tokens > max_overlap(MAX_CHUNK_TOKENS):
        return [("overlap_tokens", f"at most half of chunk_tokens ({max_overlap(MAX_CHUNK_TOKENS)} at most)")]
    return []


def chunk_count(total_tokens: int, chunk_tokens: int, overlap_tokens: int) -> int:
    """Windows of `chunk_tokens` every `chunk_tokens - overlap_tokens` tokens over a text of
    `total_tokens` (the last window ends at the text's end)."""
    if total_tokens <= 0:
        return 0
    if total_tokens <= chunk_tokens:
        return 1
    stride = chunk_tokens - overlap_tokens
    return 1 + -(-(total_tokens - chunk_tokens) // stride)
