"""bench.streams' SSE reading: every event once, whatever the read boundaries, nothing before its blank line."""

from __future__ import annotations

from bench.streams import sse_events

STREAM = b'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'
EVENTS = [b'{"a":1}', b'{"b":\n2}', b"[DONE]"]


def test_every_split_gives_every_event_once() -> None:
    for newline in (b"\n", b"\r\n"):
        stream = STREAM.replace(b"\n", newline)
        for cut in range(len(stream) + 1):
            buffer = bytearray()
            events = sse_events(buffer, stream[:cut]) + sse_events(buffer, stream[cut:])
            assert events == EVENTS, (newline, cut)
            assert not buffer


def test_an_event_waits_for_its_blank_line() -> None:
    buffer = bytearray()
    assert sse_events(buffer, b'data: {"a":1}\n') == []
    assert sse_events(buffer, b"\n") == [b'{"a":1}']
