"""Output processing: the emitter, a thread of its own per engine that turns the worker's raw
tokens into events.

The worker thread only decides which rows end for reasons it can see in token ids (EOS, the
length limit, cancellation, failures: the scheduler's stop check) and hands each step's tokens
to the emitter in one queue put (typed messages, messages.py). The emitter detokenizes,
matches stop strings, fills the tokens' text and bytes into their log probabilities, observes
the per-token metrics, ends the request's spans, creates the batch and prefill spans and wakes
each event loop once per batch of work. A stop string found by the emitter sets `stop_hit`;
the worker frees that row at its next iteration (the tokens it decoded in between are
dropped), as it does for a cancellation. It knows no Engine: the core hands it the engine's
tag, the model's name and version and its tokenizer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from tokenizers import Tokenizer

from services.inference.engine import metrics
from services.inference.engine.config import (
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_STOP_SEQUENCE,
)
from services.inference.engine.decoding import TokenPieces
from services.inference.engine.messages import (
    EmitterMessage,
    Ended,
    Prefilled,
    Segment,
    Stop,
    Sync,
    TokenItem,
    Tokens,
)
from services.inference.engine.sequence import GenerationEvent, SequenceState, Sink, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from services.inference.engine.sampling import RowLogprobs

log = logging.getLogger("llmesh.inference.engine")
tracer = trace.get_tracer("llmesh.inference")


class Emitter:
    """The results thread of one engine (see the module docstring)."""

    def __init__(self, tag: str, model_id: str, version: str, tokenizer: Tokenizer) -> None:
        self._model_id = model_id
        self._version = version
        self._tokenizer = tokenizer
        self._queue: queue.SimpleQueue[EmitterMessage] = queue.SimpleQueue()
        self._outbox: list[tuple[SequenceState, GenerationEvent | BaseException]] = []
        self._segment_span: trace.Span | None = None
        self._segment_id = ""
        self._thread = threading.Thread(target=self._run, name=f"inference-emit-{tag}", daemon=True)
        self._thread.start()
        self.avg_duration = 5.0
        self._pieces: TokenPieces | None = None

    # --- worker side

    def put(self, message: EmitterMessage) -> None:
        self._queue.put(message)

    def sync(self, timeout: float | None = 30.0) -> None:
        """Blocks until everything put so far has been handled and delivered."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return
        done = threading.Event()
        self._queue.put(Sync(done))
        done.wait(timeout)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._queue.put(Stop())
        if threading.current_thread() is not self._thread:
            self._thread.join(30.0)

    # --- emitter thread

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = False
            waiters: list[threading.Event] = []
            for message in batch:
                try:
                    if isinstance(message, Tokens):
                        self._tokens(message.now, message.items)
                    elif isinstance(message, Ended):
                        self._finish(message.seq, message.reason, failure=message.failure, outcome=message.outcome)
                    elif isinstance(message, Prefilled):
                        self._prefill(message)
                    elif isinstance(message, Segment):
                        self._segment(message)
                    elif isinstance(message, Sync):
                        waiters.append(message.done)
                    else:
                        stop = True
                except Exception:  # never lose the thread over one message
                    log.exception("inference emitter failed on a %s message", type(message).__name__)
            self._flush()
            for event in waiters:
                event.set()
            if stop:
                self._end_segment(0)
                return

    def _logprobs(self, score: RowLogprobs | None) -> list[TokenLogprob]:
        """The wire-ready form of a row's scores: each token's text and bytes (none: [])."""
        if score is None:
            return []
        if self._pieces is None:
            self._pieces = TokenPieces(self._tokenizer)
        piece = self._pieces.piece
        top = []
        for token_id, logprob in score.top:
            text, raw = piece(token_id)
            top.append(TopLogprob(token_id=token_id, token=text, logprob=logprob, bytes=raw))
        text, raw = piece(score.token_id)
        return [TokenLogprob(token_id=score.token_id, token=text, logprob=score.logprob, bytes=raw, top=tuple(top))]

    def _prompt_logprobs(self, seq: SequenceState) -> list[TokenLogprob]:
        """The prompt's scores (params.prompt_logprobs) in the wire-ready form, one per prompt
        token: the first scores 0 (nothing predicts it)."""
        if seq.params.prompt_logprobs is None or not seq.prompt_ids:
            return []
        if self._pieces is None:
            self._pieces = TokenPieces(self._tokenizer)
        piece = self._pieces.piece
        first, raw = piece(seq.prompt_ids[0])
        out = [TokenLogprob(token_id=seq.prompt_ids[0], token=first, logprob=0.0, bytes=raw)]
        for token_id, logprob, ranked in seq.prompt_scores:
            top = []
            for other, value in ranked:
                text, data = piece(other)
                top.append(TopLogprob(token_id=other, token=text, logprob=value, bytes=data))
            text, raw = piece(token_id)
            out.append(TokenLogprob(token_id=token_id, token=text, logprob=logprob, bytes=raw, top=tuple(top)))
        return out

    def _tokens(self, now: float, items: list[TokenItem]) -> None:
        produced = 0
        for item in items:
            seq, token, reason, score = item.seq, item.token, item.reason, item.logprobs
            if seq.finished:
                continue
            if token < 0:  # prompt_only: the prompt was read, nothing is generated
                self._finish(seq, FINISH_LENGTH, prompt_logprobs=self._prompt_logprobs(seq))
                continue
            first = seq.emitted == 0
            logprobs = self._logprobs(score)
            seq.emitted += 1
            if not seq.internal:
                produced += 1
                if seq.first_token_at == 0.0:
                    seq.first_token_at = now
                    metrics.TIME_TO_FIRST_TOKEN.observe(now - seq.enqueued_at)
                else:
                    metrics.INTER_TOKEN_LATENCY.observe(now - seq.last_token_at)
            seq.last_token_at = now
            scored = self._prompt_logprobs(seq) if first else []
            if reason == FINISH_STOP:
                # The EOS token is counted in the usage, so it is sent too (no text of its own).
                tail, _ = self._tail(seq)
                self._finish(seq, FINISH_STOP, token_ids=[token], text=tail, logprobs=logprobs, prompt_logprobs=scored)
                continue
            # Stop strings are looked for from min_new_tokens on.
            armed = seq.emitted >= seq.params.min_new_tokens
            text, stopped = seq.stopper.push(seq.decoder.push(token), armed)
            if stopped:
                seq.stop_hit = True
                self._finish(
                    seq, FINISH_STOP_SEQUENCE, token_ids=[token], text=text, logprobs=logprobs, prompt_logprobs=scored
                )
            elif reason == FINISH_LENGTH:
                # A stop string completed only by the held-back tail still is a stop string.
                tail, stopped = self._tail(seq)
                finish = FINISH_STOP_SEQUENCE if stopped else FINISH_LENGTH
                self._finish(
                    seq, finish, token_ids=[token], text=text + tail, logprobs=logprobs, prompt_logprobs=scored
                )
            else:
                event = GenerationEvent([token], text, seq.batch_id, logprobs=logprobs, prompt_logprobs=scored)
                self._outbox.append((seq, event))
        if produced:
            metrics.GENERATION_TOKENS.inc(produced)

    @staticmethod
    def _tail(seq: SequenceState) -> tuple[str, bool]:
        """The text the decoder and the stop matcher still hold at the end, and whether a stop
        string is in it (the text is cut before it)."""
        text, stopped = seq.stopper.push(seq.decoder.flush())
        return (text, True) if stopped else (text + seq.stopper.flush(), False)

    def _finish(
        self,
        seq: SequenceState,
        reason: str | None,
        *,
        token_ids: list[int] | None = None,
        text: str = "",
        failure: BaseException | None = None,
        outcome: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if seq.finished:
            return
        seq.finished = True
        now = time.monotonic()
        outcome = outcome or reason or "error"
        if failure is not None:
            self._outbox.append((seq, failure))
        else:
            self._outbox.append(
                (
                    seq,
                    GenerationEvent(
                        token_ids or [],
                        text,
                        seq.batch_id,
                        reason,
                        len(seq.prompt_ids),
                        seq.emitted,
                        logprobs or [],
                        prompt_logprobs=prompt_logprobs or [],
                        cached_input_tokens=seq.cached_prompt_tokens or 0,
                    ),
                )
            )
        if seq.internal:
            return
        duration = now - seq.enqueued_at
        metrics.REQUESTS.labels(outcome).inc()
        self.avg_duration = 0.9 * self.avg_duration + 0.1 * duration
        span = seq.span
        exemplar = None
        if span is not None:
            ctx = span.get_span_context()
            if ctx.is_valid and ctx.trace_flags.sampled:
                exemplar = {"trace_id": format(ctx.trace_id, "032x")}
        if reason in (FINISH_STOP, FINISH_LENGTH, FINISH_STOP_SEQUENCE):
            metrics.REQUEST_DURATION.observe(duration, exemplar=exemplar)
        if seq.decode_span is not None:
            seq.decode_span.set_attribute("gen_ai.usage.output_tokens", seq.emitted)
            seq.decode_span.end()
        if span is not None:
            span.set_attribute("gen_ai.usage.output_tokens", seq.emitted)
            span.set_attribute("gen_ai.response.finish_reasons", [outcome])
            span.set_attribute("gen_ai.response.model", self._model_id)
            if failure is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(failure)))
                span.record_exception(failure)
            span.end()

    def _flush(self) -> None:
        """Hands the events to their event loops, one wake-up per loop."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, GenerationEvent | BaseException]]] = {}
        for seq, item in self._outbox:
            if seq.sink.loop is None:
                seq.sink.items.append(item)
            else:
                by_loop.setdefault(seq.sink.loop, []).append((seq.sink, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    # --- spans

    def _segment(self, message: Segment) -> None:
        """A batch segment is the span of decode steps between two membership changes; it links
        to the request spans of its rows."""
        segment_id, seqs, reserved = message.segment_id, message.seqs, message.reserved_tokens
        self._end_segment(message.previous_steps)
        self._segment_id = segment_id
        links = [
            trace.Link(s.span.get_span_context())
            for s in seqs
            if s.span is not None and s.span.get_span_context().is_valid
        ]
        if not links:
            return
        self._segment_span = tracer.start_span(
            "inference.batch",
            context=otel_context.Context(),
            links=links,
            attributes={
                "llmesh.batch.id": segment_id,
                "llmesh.batch.size": len(seqs),
                "llmesh.model.version": self._version,
                "llmesh.batch.reserved_tokens": reserved,
            },
        )

    def _end_segment(self, steps: int) -> None:
        span = self._segment_span
        if span is not None:
            span.set_attribute("llmesh.batch.decode_steps", steps)
            span.end()
        self._segment_span = None

    def _prefill(self, message: Prefilled) -> None:
        """Queue and prefill child spans of each request span, and the link to its batch."""
        group, started_ns, ended_ns = message.group, message.started_ns, message.ended_ns
        tokens, padded, batch_id, batch_size = message.tokens, message.padded, message.batch_id, message.batch_size
        segment_ctx = self._segment_span.get_span_context() if self._segment_span is not None else None
        if self._segment_span is not None:
            self._segment_span.add_event(
                "prefill",
                {
                    "llmesh.prefill.sequences": len(group),
                    "llmesh.prefill.tokens": tokens,
                    "llmesh.prefill.padded_tokens": padded,
                },
            )
        mono_ns = time.monotonic_ns()
        now_ns = time.time_ns()
        for seq in group:
            span = seq.span
            if span is None or seq.span_ctx is None:
                continue
            if segment_ctx is not None and segment_ctx.is_valid:
                span.add_link(segment_ctx, {"llmesh.link": "ran_in_batch"})
            span.set_attribute("llmesh.batch.id", seq.batch_id)
            span.set_attribute("llmesh.batch.size", batch_size)
            waited_ns = mono_ns - int(seq.enqueued_at * 1e9)
            queue_start = now_ns - waited_ns
            tracer.start_span("inference.queue", context=seq.span_ctx, start_time=queue_start).end(
                end_time=min(started_ns, ended_ns)
            )
            prefill = tracer.start_span(
                "inference.prefill",
                context=seq.span_ctx,
                start_time=started_ns,
                attributes={
                    "llmesh.prefill.sequences": len(group),
                    "llmesh.prefill.tokens": tokens,
                    "llmesh.batch.id": batch_id,
                },
            )
            prefill.end(end_time=ended_ns)
            if seq.decode_span is None:
                seq.decode_span = tracer.start_span(
                    "inference.decode",
                    context=seq.span_ctx,
                    start_time=ended_ns,
                    attributes={"llmesh.batch.id": batch_id},
                )


def _deliver(items: list[tuple[Sink, GenerationEvent | BaseException]]) -> None:
    for sink, item in items:
        assert sink.queue is not None
        sink.queue.put_nowait(item)
