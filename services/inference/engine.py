"""Inference engine: iteration-level continuous batching on a transformers causal LM.

Domain code only (no gRPC). One `Engine` serves one loaded model version:

* Requests are submitted from asyncio (`Engine.submit`), validated at once and put in a
  bounded waiting queue; a full queue answers ResourceExhausted immediately.
* ONE dedicated worker thread owns the model and the running batch. Each iteration it
  (1) drops cancelled rows, (2) admits waiting requests that fit (batch slots, the batch
  token budget, the prefill token budget), prefills them together left-padded, and merges
  their KV cache into the running batch, (3) decodes one token for every running row, and
  (4) removes finished rows at once. Prompts are never recomputed.
* The KV cache is a transformers `DynamicCache`; its per-layer `keys`/`values` tensors
  ([batch, kv_heads, time, head_dim]) are edited directly: a prefilled group is left-padded
  to the running length and concatenated along the batch axis, finished rows are dropped
  (index_select; the last live rows move into the holes), and leading columns that are padding
  in every row are trimmed. The layers (`BatchKVLayer`, a DynamicLayer) keep spare rows and
  time columns, so a decode step writes its one new column in place instead of copying the
  whole cache as `DynamicLayer.update` does, and surgery copies only the rows that move.
  A 2-D attention mask hides the padding and explicit per-row `position_ids` count real
  tokens only, so a row yields the same tokens in any batch as alone.
* Results go back to the event loop with one `call_soon_threadsafe` per iteration.

Admission budget: a sequence reserves prompt + max_new_tokens tokens of KV cache while it
is in the batch; the sum over the batch stays under `max_batch_total_tokens`, so admitted
sequences never need preemption. Unless given, it is derived: on CUDA from the device memory
free after loading (70% of it over the KV bytes per token, like TGI); on CPU it is
`max_batch_size * (max_prompt_tokens + max_new_tokens)` (host memory is plentiful; every slot
fits a maximal request). It is never below one maximal request.

Prefill budget: a prefill stalls every running row for its duration. While a batch is
decoding, a prefill group is sized to take about one decode step (padded tokens = measured
prefill tokens/s x measured decode step time), so a new request waits at most about one step
to start and running rows see at most about a doubled inter-token gap; requests arriving
together are spread over consecutive steps. With no batch running nobody is stalled and a
group may hold up to `max_prefill_tokens` padded tokens. One request is always admitted.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from opentelemetry import context as otel_context
from opentelemetry import trace
from tokenizers import Tokenizer
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from llmesh import errors
from llmesh.hardware import DtypeChoice, choose_dtype, dtype_name
from llmesh.models import VerifiedModel
from services.inference import metrics
from services.inference.decoding import (
    IncrementalDecoder,
    Limits,
    ResolvedParams,
    SamplingParams,
    StopMatcher,
    resolve_params,
)
from services.inference.quality import load_guarded

log = logging.getLogger("llmesh.inference.engine")
tracer = trace.get_tracer("llmesh.inference")

#: Most padded prompt tokens in one prefill group, per device kind.
DEFAULT_MAX_PREFILL_TOKENS = {"cpu": 2048, "cuda": 8192}
#: While a batch decodes, a prefill group is sized to take about this many decode steps.
PREFILL_STALL_STEPS = 1.0

#: Spare time columns allocated with each KV buffer (decode steps fill them in place).
KV_SPARE_COLUMNS = 64

#: Share of the device memory free after loading that the KV cache may use (the rest is for
#: activations, logits and allocator slack).
CUDA_KV_MEMORY_FRACTION = 0.7

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_STOP_SEQUENCE = "stop_sequence"
FINISH_CANCELLED = "cancelled"

# torch.cuda.OutOfMemoryError is this class too.
_OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_queue: int = 256
    queue_timeout_s: float = 30.0
    batch_wait_s: float = 0.002
    max_prompt_tokens: int = 1536
    max_new_tokens: int = 512
    default_max_new_tokens: int = 128
    #: KV-cache tokens reserved by the whole batch (prompt + max_new per sequence); None derives it.
    max_batch_total_tokens: int | None = None
    #: Most padded tokens per prefill group; None picks DEFAULT_MAX_PREFILL_TOKENS for the device.
    max_prefill_tokens: int | None = None
    #: LLMESH_DTYPE and LLMESH_QUANTIZE (see LoadedModel).
    dtype: str = "auto"
    quantize: str = "none"

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> EngineConfig:
        values = dict(
            max_batch_size=settings.max_batch_size,
            max_queue=settings.max_queue,
            queue_timeout_s=settings.queue_timeout_seconds,
            batch_wait_s=settings.batch_wait_ms / 1000.0,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_new_tokens=settings.max_new_tokens,
            default_max_new_tokens=settings.default_max_new_tokens,
            # Optional settings (LLMESH_MAX_BATCH_TOTAL_TOKENS, LLMESH_MAX_PREFILL_TOKENS); 0 or
            # undeclared means derived.
            max_batch_total_tokens=getattr(settings, "max_batch_total_tokens", 0) or None,
            max_prefill_tokens=getattr(settings, "max_prefill_tokens", 0) or None,
            dtype=getattr(settings, "dtype", "auto"),
            quantize=getattr(settings, "quantize", "none"),
        )
        values.update(overrides)
        return cls(**values)

    def total_tokens(self, kv_bytes_per_token: int, device: torch.device) -> int:
        """The batch KV-token budget (see the module docstring)."""
        floor = self.max_prompt_tokens + self.max_new_tokens
        ceiling = self.max_batch_size * floor
        if self.max_batch_total_tokens is not None:
            return max(self.max_batch_total_tokens, floor)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return max(floor, min(ceiling, int(free * CUDA_KV_MEMORY_FRACTION) // max(1, kv_bytes_per_token)))
        return ceiling


def pick_device(preference: str, dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """auto/cuda: CUDA if available. The dtype: LLMESH_DTYPE, or by hardware (llmesh.hardware:
    CUDA bf16, fp16 without bf16; CPU bf16 with native bf16, else float32)."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("LLMESH_DEVICE=cuda but CUDA is not available")
    device = torch.device("cuda" if preference in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    choice = choose_dtype(device, dtype)
    log.info("dtype %s on %s: %s", choice.name, device, choice.reason)
    return device, choice.dtype


@dataclass(frozen=True)
class ModelDescription:
    model_id: str
    version: str
    digest: str
    path: Path
    device: str
    dtype: str
    max_context_tokens: int
    max_batch_size: int


class LoadedModel:
    """A verified model directory loaded for serving: safetensors weights only, no remote code."""

    def __init__(
        self, verified: VerifiedModel, device_preference: str = "auto", dtype: str = "auto", quantize: str = "none"
    ) -> None:
        from transformers import GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.verified = verified
        self.device, chosen = pick_device(device_preference, dtype)
        self.tokenizer = Tokenizer.from_file(str(verified.path / "tokenizer.json"))
        # The perplexity guard (services.inference.quality) may refuse the dtype: float32 then.
        choice = DtypeChoice(chosen, dtype != "auto", f"LLMESH_DTYPE={dtype}")
        self.model, self.dtype, self.quality = load_guarded(
            verified, self.device, choice, quantize, self.tokenizer, 1024
        )
        self.quantize = quantize
        #: ModelInfo.dtype and the gateway's cache scope: "bfloat16", "bfloat16+int8"...
        self.dtype_name = dtype_name(self.dtype) + ("" if quantize == "none" else f"+{quantize}")
        self.config = self.model.config
        eos: Any = self.config.eos_token_id
        if (verified.path / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(verified.path, local_files_only=True).eos_token_id or eos
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        pad = self.config.pad_token_id
        self.pad_id = int(pad if pad is not None else (eos_ids[0] if eos_ids else 0))
        self.max_context_tokens = int(getattr(self.config, "max_position_embeddings", 2048))
        self.vocab_size = int(self.config.vocab_size)
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize

    def encode(self, text: str) -> list[int]:
        """Tokens of an already chat-templated prompt (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------- KV cache


class BatchKVLayer(DynamicLayer):
    """One layer of a batch's KV cache. `keys`/`values` ([batch, kv_heads, time, head_dim], as
    in DynamicLayer) are views `buffer[:rows, :, start:end]` of buffers with spare rows and
    spare time columns, so that:

    * a decode step writes its one column in place (DynamicLayer.update concatenates, i.e.
      copies the whole cache, on every step);
    * dropping rows moves the last live rows into the holes (copies only the moved rows);
    * joining rows writes them after the live rows, right-aligned, zero-padded on the left
      (copies only the new rows), extending the live columns to the left when they are longer;
    * trimming leading columns moves `start`.

    A buffer is reallocated (one copy of the live region) when rows or columns run out."""

    def __init__(self) -> None:
        super().__init__()
        self._kb: torch.Tensor | None = None
        self._vb: torch.Tensor | None = None
        self._rows = 0
        self._start = 0
        self._end = 0

    @property
    def length(self) -> int:
        return self._end - self._start

    def _set(self, kb: torch.Tensor, vb: torch.Tensor, rows: int, start: int, end: int) -> None:
        self._kb, self._vb, self._rows, self._start, self._end = kb, vb, rows, start, end
        self.dtype, self.device = kb.dtype, kb.device
        self.is_initialized = True
        self._view()

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._kb is not None and self._vb is not None
        keys = self._kb[: self._rows, :, self._start : self._end]
        values = self._vb[: self._rows, :, self._start : self._end]
        self.keys, self.values = keys, values
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, n, dim = key_states.shape
        if self._kb is None:
            shape = (rows, heads, n + KV_SPARE_COLUMNS, dim)
            self._set(key_states.new_empty(shape), value_states.new_empty(shape), rows, 0, 0)
        elif self._end + n > self._kb.shape[2]:
            self._reallocate(self._kb.shape[0], self.length + n + KV_SPARE_COLUMNS, 0)
        assert self._kb is not None and self._vb is not None and rows == self._rows
        self._kb[:rows, :, self._end : self._end + n] = key_states
        self._vb[:rows, :, self._end : self._end + n] = value_states
        self._end += n
        return self._view()

    def _reallocate(self, capacity_rows: int, width: int, left: int) -> None:
        """New buffers of capacity_rows x width columns; the live columns land at [left, left + length)."""
        keys, values = self._view()
        batch, heads, length, dim = keys.shape
        kb = keys.new_empty((capacity_rows, heads, width, dim))
        vb = values.new_empty((capacity_rows, heads, width, dim))
        kb[:batch, :, left : left + length] = keys
        vb[:batch, :, left : left + length] = values
        self._set(kb, vb, batch, left, left + length)

    def remove_rows(self, holes: torch.Tensor, movers: torch.Tensor, remaining: int, drop_leading: int) -> None:
        """Rows `movers` (all at or past `remaining`) move into rows `holes` (all before it);
        then only `remaining` rows and the columns after `drop_leading` stay live."""
        assert self._kb is not None and self._vb is not None
        if holes.numel():
            live = slice(self._start, self._end)
            self._kb[holes, :, live] = self._kb[movers, :, live]
            self._vb[holes, :, live] = self._vb[movers, :, live]
        self._rows = remaining
        self._start += drop_leading
        self._view()

    def append_rows(self, other: BatchKVLayer, max_rows: int) -> None:
        """Adds the rows of `other` after the live rows, both sides left-padded with zeros to
        the longer of the two lengths."""
        assert self._kb is not None and other._kb is not None
        rows, extra = self._rows, other._rows
        own, theirs = self.length, other.length
        width = max(own, theirs)
        capacity = self._kb.shape[0]
        if rows + extra > capacity or self._start < width - own:
            if rows + extra > capacity:
                capacity = min(max(rows + extra, 2 * capacity), max(max_rows, rows + extra))
            self._reallocate(capacity, width + KV_SPARE_COLUMNS, width - own)
            start = 0
        else:
            start = self._start - (width - own)
        assert self._kb is not None and self._vb is not None
        for buf in (self._kb, self._vb):
            buf[:rows, :, start : self._start].zero_()  # running rows, if the new ones are longer
            buf[rows : rows + extra, :, start : self._end - theirs].zero_()
        their_keys, their_values = other._view()
        self._kb[rows : rows + extra, :, self._end - theirs : self._end] = their_keys
        self._vb[rows : rows + extra, :, self._end - theirs : self._end] = their_values
        self._rows = rows + extra
        self._start = start
        self._view()

    def truncate(self, length: int) -> None:
        """Forgets columns past `length` (a step that failed half-way)."""
        if self._kb is not None and self.length > length:
            self._end = self._start + length
            self._view()


def new_batch_cache(config: Any) -> DynamicCache:
    """A DynamicCache whose layers are BatchKVLayers (full attention only: the surgery assumes
    every layer holds the same columns, which sliding-window layers do not)."""
    cache = DynamicCache(config=config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise RuntimeError("only models whose layers all use full attention are supported")
    cache.layers = [BatchKVLayer() for _ in cache.layers]
    return cache


# --------------------------------------------------------------------------- requests


@dataclass
class GenerationEvent:
    """One streamed message: tokens and text produced since the last one; the last event has
    finish_reason and usage set."""

    token_ids: list[int]
    text: str
    batch_id: str = ""
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0


class _Sink:
    """Where a sequence's events go: an asyncio queue on its loop, or a plain list (warm-up)."""

    __slots__ = ("items", "loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerationEvent | BaseException] | None = asyncio.Queue() if loop else None
        self.items: list[GenerationEvent | BaseException] = []


_seq_ids = itertools.count(1)


@dataclass(eq=False)
class SequenceState:
    """State of one request inside the engine (touched by the worker thread only, except
    `cancelled`, a flag the event loop sets)."""

    prompt_ids: list[int]
    params: ResolvedParams
    request_id: str
    sink: _Sink
    decoder: IncrementalDecoder
    stopper: StopMatcher
    generator: torch.Generator | None
    enqueued_at: float
    #: When the sequence (re)entered the waiting queue; the queue timeout counts from here.
    queued_since: float = 0.0
    internal: bool = False
    span: trace.Span | None = None
    span_ctx: otel_context.Context | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    prompt_counted: bool = False
    batch_id: str = ""
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    decode_span: trace.Span | None = None

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def prefill_ids(self) -> list[int]:
        # After an OOM requeue the tokens generated so far are prefilled again with the prompt.
        return self.prompt_ids + self.generated


class RequestStream:
    """Async iterator over one request's GenerationEvents. Stopping early (aclose, a cancelled
    task, a dropped RPC) must call cancel(): the engine then frees the row within one step."""

    def __init__(self, engine: Engine, seq: SequenceState) -> None:
        self._engine = engine
        self._seq = seq
        self._done = False

    @property
    def batch_id(self) -> str:
        return self._seq.batch_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        queue = self._seq.sink.queue
        assert queue is not None
        try:
            item = await queue.get()
        except BaseException:
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._engine._cancel(self._seq)

    async def aclose(self) -> None:
        self.cancel()


# --------------------------------------------------------------------------- engine


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig, name: str = "") -> None:
        self.model = model
        self.config = config
        self.name = name or model.verified.version
        self.tag = f"{self.name}.{secrets.token_hex(2)}"
        self.max_total_tokens = config.total_tokens(model.kv_bytes_per_token, model.device)
        self.max_prefill_tokens = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS.get(model.device.type, 2048)
        self.limits = Limits(
            max_prompt_tokens=config.max_prompt_tokens,
            max_new_tokens=config.max_new_tokens,
            default_max_new_tokens=config.default_max_new_tokens,
            max_context_tokens=model.max_context_tokens,
            vocab_size=model.vocab_size,
        )
        self.description = ModelDescription(
            model_id=model.verified.model_id,
            version=model.verified.version,
            digest=model.verified.digest,
            path=model.verified.path,
            device=str(model.device),
            dtype=model.dtype_name,
            max_context_tokens=model.max_context_tokens,
            max_batch_size=config.max_batch_size,
        )
        self._cond = threading.Condition()
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        # Running batch (worker thread only).
        self._running: list[SequenceState] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, T] 1 = real token, over the cached columns
        self._pos: torch.Tensor | None = None  # [B] position id of each row's next input
        self._last: torch.Tensor | None = None  # [B] each row's next input token
        self._reserved = 0
        self._outbox: list[tuple[SequenceState, GenerationEvent | BaseException]] = []
        self._segment_span: trace.Span | None = None
        self._segment_id = ""
        self._segment_steps = 0
        self._segments = itertools.count(1)
        self._membership_changed = False
        self._avg_duration = 5.0
        # Measured speeds (EWMA) that size prefill groups while a batch decodes.
        self._prefill_tok_s: float | None = None
        self._step_s: float | None = None
        #: Fault injection for tests: called before each forward with ("prefill"|"decode", batch size).
        self.fault_hook: Callable[[str, int], None] | None = None
        self.steps = 0

    # ----------------------------------------------------------------- lifecycle

    @classmethod
    def load(cls, verified: VerifiedModel, config: EngineConfig, device: str = "auto") -> Engine:
        """Loads, warms up and starts an engine; returns once it serves (blocking).

        Loading, warm-up and serving all run on the engine's own worker thread: torch's CPU
        kernels keep one OpenMP thread pool per calling thread, and a second pool (say, the
        warm-up's on an executor thread) makes OpenMP see more threads than cores and put its
        workers to sleep between kernels, which costs about a fifth of the decode speed on a
        small machine."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def boot() -> None:
            try:
                engine = cls(LoadedModel(verified, device, config.dtype, config.quantize), config)
                engine.warm_up()
                engine._thread = threading.current_thread()
                box["engine"] = engine
            except BaseException as exc:
                box["error"] = exc
                return
            finally:
                ready.set()
            engine._run()

        threading.Thread(target=boot, name=f"inference-{verified.version}", daemon=True).start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        engine: Engine = box["engine"]
        return engine

    def start(self) -> None:
        """Starts the worker thread of an engine built directly (tests)."""
        self._thread = threading.Thread(target=self._run, name=f"inference-{self.tag}", daemon=True)
        self._thread.start()

    def warm_up(self) -> None:
        """A short generation through the real path (padding, merge, removal, sampling), before
        the worker starts, so the first user request pays no first-call costs."""
        ids = self.model.encode("Hello! How are you today?") or [self.model.pad_id]
        seqs = [
            self._new_sequence(ids, SamplingParams(max_new_tokens=4, ignore_eos=True), "warm-up", None, True),
            self._new_sequence(
                ids[:2],
                SamplingParams(max_new_tokens=3, temperature=0.7, seed=0, ignore_eos=True),
                "warm-up",
                None,
                True,
            ),
        ]
        self._waiting.extend(seqs)
        metrics.QUEUE_SIZE.inc(len(seqs))
        with torch.inference_mode():
            while self._waiting or self._running:
                group = self._admit()
                self._iteration(group)
        for seq in seqs:
            failure = next((i for i in seq.sink.items if isinstance(i, BaseException)), None)
            if failure is not None:
                raise RuntimeError(f"warm-up failed: {failure}") from failure
        self._outbox.clear()

    def close(self, reason: str = "the model was unloaded") -> None:
        """Stops the worker; anything still queued or running gets UNAVAILABLE."""
        with self._cond:
            self._closing = self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        failure = errors.Unavailable(f"inference: {reason}", retry_after=1.0)
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        metrics.QUEUE_SIZE.dec(len(waiting))
        for seq in waiting + self._running:
            self._finish(seq, None, failure=failure, outcome="error")
        self._reset_batch()
        self._flush()
        self._idle.set()

    def drain(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running (the old engine after a model switch)."""
        return self._idle.wait(timeout)

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def cache_columns(self) -> int:
        """Time columns of the running batch's KV cache (0 when the batch is empty)."""
        mask = self._mask
        return 0 if mask is None else int(mask.shape[1])

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------------- submission (event loop)

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> RequestStream:
        """Validates and enqueues a request; raises InvalidArgument, ResourceExhausted (queue
        full) or Unavailable (engine closed) at once. Call from a running event loop."""
        loop = asyncio.get_running_loop()
        try:
            seq = self._new_sequence(list(prompt_ids), params, request_id, loop, False)
        except errors.InvalidArgument:
            metrics.REQUESTS.labels("invalid").inc()
            raise
        with self._cond:
            if self._closed:
                raise errors.Unavailable("inference: the model is being unloaded", retry_after=1.0)
            # Requests the next iteration admits into free batch slots are not "waiting for a slot".
            free_slots = max(0, self.config.max_batch_size - len(self._running))
            if len(self._waiting) >= self.config.max_queue + free_slots:
                metrics.REQUESTS.labels("rejected_queue_full").inc()
                retry = self._retry_after()
                raise errors.ResourceExhausted(
                    f"inference queue is full ({self.config.max_queue} waiting, LLMESH_MAX_QUEUE)",
                    retry_after=retry,
                    reason="QUEUE_FULL",
                )
            self._start_request_span(seq)
            self._waiting.append(seq)
            self._idle.clear()
            metrics.QUEUE_SIZE.inc()
            self._cond.notify()
        return RequestStream(self, seq)

    def _retry_after(self) -> float:
        per_slot = self._avg_duration / max(1, self.config.max_batch_size)
        return round(min(30.0, max(0.5, per_slot * len(self._waiting))), 3)

    def _new_sequence(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        loop: asyncio.AbstractEventLoop | None,
        internal: bool,
    ) -> SequenceState:
        resolved = resolve_params(params, prompt_ids, self.limits)
        generator = None
        if not resolved.greedy:
            generator = torch.Generator()
            if resolved.seed is None:
                generator.seed()
            else:
                generator.manual_seed(resolved.seed)
        now = time.monotonic()
        return SequenceState(
            prompt_ids=prompt_ids,
            params=resolved,
            request_id=request_id,
            sink=_Sink(loop),
            decoder=IncrementalDecoder(self.model.tokenizer),
            stopper=StopMatcher(resolved.stop),
            generator=generator,
            enqueued_at=now,
            queued_since=now,
            internal=internal,
        )

    def _start_request_span(self, seq: SequenceState) -> None:
        p = seq.params
        span = tracer.start_span(
            "inference.generate",
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": self.description.model_id,
                "gen_ai.request.max_tokens": p.max_new_tokens,
                "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p,
                "gen_ai.usage.input_tokens": len(seq.prompt_ids),
                "llmesh.model.version": self.description.version,
                "llmesh.request.id": seq.request_id,
            },
        )
        if p.seed is not None:
            span.set_attribute("gen_ai.request.seed", p.seed)
        seq.span = span
        seq.span_ctx = trace.set_span_in_context(span)

    def _cancel(self, seq: SequenceState) -> None:
        seq.cancelled = True
        with self._cond:
            self._cond.notify()

    # ----------------------------------------------------------------- worker thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    group = self._next_work()
                    if group is None:
                        return
                    self._iteration(group)
        except BaseException:
            log.exception("inference worker crashed")
            raise

    def _next_work(self) -> list[SequenceState] | None:
        """Blocks until there is something to do; returns the group to prefill (maybe empty),
        or None when the engine closes."""
        with self._cond:
            while True:
                now = time.monotonic()
                self._expire_waiting(now)
                self._flush()
                if self._closing:
                    return None
                if self._running:
                    return self._admit()
                if self._waiting:
                    # Empty batch: give requests arriving together a moment to share a prefill.
                    left = self._waiting[0].enqueued_at + self.config.batch_wait_s - now
                    if left > 0 and len(self._waiting) < self.config.max_batch_size:
                        self._cond.wait(left)
                        continue
                    return self._admit()
                self._idle.set()
                self._cond.wait(1.0)

    def _expire_waiting(self, now: float) -> None:
        """Drops cancelled and timed-out requests from the queue (lock held)."""
        if not self._waiting:
            return
        timeout = self.config.queue_timeout_s
        keep: collections.deque[SequenceState] = collections.deque()
        for seq in self._waiting:
            if seq.cancelled:
                metrics.QUEUE_SIZE.dec()
                self._finish(seq, FINISH_CANCELLED)
            elif now - seq.queued_since > timeout:
                metrics.QUEUE_SIZE.dec()
                failure = errors.ResourceExhausted(
                    f"no batch slot within {timeout:g}s (LLMESH_QUEUE_TIMEOUT_SECONDS)",
                    retry_after=self._retry_after(),
                    reason="QUEUE_TIMEOUT",
                )
                self._finish(seq, None, failure=failure, outcome="queue_timeout")
            else:
                keep.append(seq)
        self._waiting = keep

    def _admit(self) -> list[SequenceState]:
        """FIFO admission within batch slots, the batch token budget and the prefill budget."""
        group: list[SequenceState] = []
        reserved = self._reserved
        longest = 0
        budget = self.prefill_budget()
        while self._waiting and len(self._running) + len(group) < self.config.max_batch_size:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                metrics.QUEUE_SIZE.dec()
                self._finish(seq, FINISH_CANCELLED)
                continue
            if reserved + seq.reserved_tokens > self.max_total_tokens and (self._running or group):
                break
            width = max(longest, len(seq.prefill_ids))
            if group and width * (len(group) + 1) > budget:
                break
            self._waiting.popleft()
            metrics.QUEUE_SIZE.dec()
            group.append(seq)
            reserved += seq.reserved_tokens
            longest = width
        return group

    def prefill_budget(self) -> int:
        """Padded tokens the next prefill group may hold (see the module docstring)."""
        if not self._running or self._prefill_tok_s is None or self._step_s is None:
            return self.max_prefill_tokens
        stall = int(self._prefill_tok_s * self._step_s * PREFILL_STALL_STEPS)
        return max(1, min(self.max_prefill_tokens, stall))

    def _iteration(self, group: list[SequenceState]) -> None:
        try:
            self._drop_cancelled()
            if group:
                self._prefill(group)
            if self._running:
                self._decode()
            if self._membership_changed:
                self._new_segment()
        except Exception as exc:  # a bug or a device error: fail this batch, keep serving
            log.exception("inference step failed")
            failure = errors.LlmeshError("inference step failed", reason="ENGINE_ERROR")
            failure.__cause__ = exc
            for seq in [*self._running, *(s for s in group if not s.finished and s not in self._running)]:
                self._finish(seq, None, failure=failure, outcome="error")
            self._reset_batch()
        self._flush()

    # ----------------------------------------------------------------- batch surgery

    def _reset_batch(self) -> None:
        metrics.BATCH_SIZE.dec(len(self._running))
        self._running = []
        self._cache = self._mask = self._pos = self._last = None
        self._reserved = 0
        if self._segment_span is not None:
            self._end_segment()

    def _drop_cancelled(self) -> None:
        gone = [i for i, seq in enumerate(self._running) if seq.cancelled]
        if gone:
            for i in gone:
                self._finish(self._running[i], FINISH_CANCELLED)
            self._remove_rows(gone)

    def _remove_rows(self, rows: Sequence[int]) -> None:
        """Drops rows from the batch (the last live rows move into the holes) and trims
        columns that became padding in every remaining row."""
        drop = set(rows)
        total = len(self._running)
        remaining = total - len(drop)
        for i in drop:
            self._reserved -= self._running[i].reserved_tokens
        metrics.BATCH_SIZE.dec(len(drop))
        self._membership_changed = True
        if not remaining:
            self._running = []
            self._cache = self._mask = self._pos = self._last = None
            self._reserved = 0
            return
        assert self._mask is not None and self._pos is not None and self._last is not None
        holes = [r for r in sorted(drop) if r < remaining]
        movers = [r for r in range(remaining, total) if r not in drop]
        order = list(range(remaining))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        device = self._mask.device
        index = torch.tensor(order, device=device)
        mask = self._mask.index_select(0, index)
        first = int(mask.any(dim=0).int().argmax())  # first column holding a real token somewhere
        self._mask = mask[:, first:] if first else mask
        holes_t = torch.tensor(holes, dtype=torch.long, device=device)
        movers_t = torch.tensor(movers, dtype=torch.long, device=device)
        for layer in self._cache.layers:
            layer.remove_rows(holes_t, movers_t, remaining, first)
        self._pos = self._pos.index_select(0, index)
        self._last = self._last.index_select(0, index)
        self._running = [self._running[i] for i in order]

    def _join(
        self, group: list[SequenceState], cache: Any, mask: torch.Tensor, pos: torch.Tensor, last: torch.Tensor
    ) -> None:
        """Merges a prefilled group into the running batch: left-pad to a common length, then
        concatenate along the batch axis."""
        if not self._running:
            self._cache, self._mask, self._pos, self._last = cache, mask, pos, last
        else:
            assert self._mask is not None and self._pos is not None and self._last is not None
            t_run, t_new = self._mask.shape[1], mask.shape[1]
            width = max(t_run, t_new)
            joined_mask = torch.cat([F.pad(self._mask, (width - t_run, 0)), F.pad(mask, (width - t_new, 0))])
            for layer, joining in zip(self._cache.layers, cache.layers, strict=True):
                layer.append_rows(joining, self.config.max_batch_size)
            self._mask = joined_mask
            self._pos = torch.cat([self._pos, pos])
            self._last = torch.cat([self._last, last])
        self._running.extend(group)
        self._reserved += sum(s.reserved_tokens for s in group)
        metrics.BATCH_SIZE.inc(len(group))
        self._membership_changed = True

    # ----------------------------------------------------------------- model steps

    def _forward(self, kind: str, **inputs: Any) -> torch.Tensor:
        if self.fault_hook is not None:
            self.fault_hook(kind, int(inputs["input_ids"].shape[0]))
        out = self.model.model(**inputs, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _prefill(self, group: list[SequenceState]) -> None:
        started_ns = time.time_ns()
        started = time.perf_counter()
        while True:
            device = self.model.device
            lengths = [len(s.prefill_ids) for s in group]
            width = max(lengths)
            ids = torch.full((len(group), width), self.model.pad_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, seq in enumerate(group):
                n = lengths[row]
                ids[row, width - n :] = torch.tensor(seq.prefill_ids, dtype=torch.long)
                mask[row, width - n :] = 1
            ids, mask = ids.to(device), mask.to(device)
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
            cache = new_batch_cache(self.model.config)
            try:
                logits = self._forward(
                    "prefill", input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache
                )
                break
            except _OOM_ERRORS:
                del cache
                group = self._on_prefill_oom(group)
                if not group:
                    return
        if width * len(group) >= 16:  # tiny prefills say little about the speed
            self._prefill_tok_s = _ewma(self._prefill_tok_s, width * len(group) / (time.perf_counter() - started))
        now = time.monotonic()
        for seq in group:
            if not seq.prompt_counted and not seq.internal:
                seq.prompt_counted = True
                metrics.PROMPT_TOKENS.inc(len(seq.prompt_ids))
        tokens = self._sample(group, logits)
        start = len(self._running)
        self._join(group, cache, mask, torch.tensor(lengths, device=device), tokens)
        self._new_segment()
        self._trace_prefill(group, started_ns, sum(lengths), width * len(group))
        self._accept(tokens.tolist(), start, now)
        self._flush()  # first tokens go out now, not after this iteration's decode step

    def _decode(self) -> None:
        assert self._mask is not None and self._pos is not None and self._last is not None
        started = time.perf_counter()
        while True:
            batch = len(self._running)
            mask = torch.cat([self._mask, self._mask.new_ones((batch, 1))], dim=1)
            cached = self._mask.shape[1]
            try:
                logits = self._forward(
                    "decode",
                    input_ids=self._last[:, None],
                    attention_mask=mask,
                    position_ids=self._pos[:, None],
                    past_key_values=self._cache,
                )
                break
            except _OOM_ERRORS:
                self._on_decode_oom(cached)
                if not self._running:
                    return
        self._mask = mask
        self._pos = self._pos + 1
        tokens = self._sample(self._running, logits)
        self._last = tokens
        ids = tokens.tolist()
        self._step_s = _ewma(self._step_s, time.perf_counter() - started)
        self.steps += 1
        self._segment_steps += 1
        self._accept(ids, 0, time.monotonic())

    def _sample(self, seqs: list[SequenceState], logits: torch.Tensor) -> torch.Tensor:
        """Greedy for temperature 0 (one argmax for the whole batch); otherwise temperature and
        nucleus sampling by inverse CDF with one uniform draw per row from the request's own
        generator, so a seeded request gets the same tokens in any batch."""
        chosen = torch.argmax(logits, dim=-1)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return chosen
        nucleus = [i for i in sampled if seqs[i].params.top_p < 1.0]
        plain = [i for i in sampled if seqs[i].params.top_p >= 1.0]
        for rows, use_top_p in ((plain, False), (nucleus, True)):
            if not rows:
                continue
            index = torch.tensor(rows, device=logits.device)
            temps = torch.tensor([seqs[i].params.temperature for i in rows], device=logits.device)
            probs = torch.softmax(logits.index_select(0, index).float() / temps[:, None], dim=-1)
            if use_top_p:
                top_p = torch.tensor([seqs[i].params.top_p for i in rows], device=logits.device)
                ranked, order = probs.sort(dim=-1, descending=True)
                before = ranked.cumsum(dim=-1) - ranked  # mass of the more likely tokens
                keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, before < top_p[:, None])
                probs = probs.masked_fill(~keep, 0.0)
            # The CDF runs in vocabulary order, not in probability order: the last-bit differences
            # that batching makes in the logits then move its steps by as little, so the same draw
            # picks the same token, where a re-sorted order would reshuffle near-equal tokens.
            cdf = probs.cumsum(dim=-1)
            draws = torch.cat([torch.rand(1, generator=seqs[i].generator) for i in rows]).to(logits.device)
            picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)
            picked = picked.clamp_(max=cdf.shape[1] - 1)
            chosen[index] = picked[:, 0]
        return chosen

    def _accept(self, tokens: list[int], start: int, now: float) -> None:
        """Per-row bookkeeping after a step: events, stop conditions, metrics; finished rows
        leave the batch at once."""
        done: list[int] = []
        produced = 0
        eos = self.model.eos_ids
        for offset, token in enumerate(tokens):
            row = start + offset
            seq = self._running[row]
            p = seq.params
            seq.generated.append(token)
            if not seq.internal:
                produced += 1
                if seq.first_token_at == 0.0:
                    seq.first_token_at = now
                    metrics.TIME_TO_FIRST_TOKEN.observe(now - seq.enqueued_at)
                else:
                    metrics.INTER_TOKEN_LATENCY.observe(now - seq.last_token_at)
            seq.last_token_at = now
            if token in eos and not p.ignore_eos:
                self._finish(seq, FINISH_STOP, text=self._tail(seq))
                done.append(row)
                continue
            text, stopped = seq.stopper.push(seq.decoder.push(token))
            if stopped:
                self._finish(seq, FINISH_STOP_SEQUENCE, token_ids=[token], text=text)
                done.append(row)
            elif len(seq.generated) >= p.max_new_tokens:
                self._finish(seq, FINISH_LENGTH, token_ids=[token], text=text + self._tail(seq))
                done.append(row)
            else:
                self._outbox.append((seq, GenerationEvent([token], text, seq.batch_id)))
        if produced:
            metrics.GENERATION_TOKENS.inc(produced)
        if done:
            self._remove_rows(done)

    @staticmethod
    def _tail(seq: SequenceState) -> str:
        text, stopped = seq.stopper.push(seq.decoder.flush())
        return text if stopped else text + seq.stopper.flush()

    def _finish(
        self,
        seq: SequenceState,
        reason: str | None,
        *,
        token_ids: list[int] | None = None,
        text: str = "",
        failure: BaseException | None = None,
        outcome: str | None = None,
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
                        len(seq.generated),
                    ),
                )
            )
        if seq.internal:
            return
        duration = now - seq.enqueued_at
        metrics.REQUESTS.labels(outcome).inc()
        self._avg_duration = 0.9 * self._avg_duration + 0.1 * duration
        span = seq.span
        exemplar = None
        if span is not None:
            ctx = span.get_span_context()
            if ctx.is_valid and ctx.trace_flags.sampled:
                exemplar = {"trace_id": format(ctx.trace_id, "032x")}
        if reason in (FINISH_STOP, FINISH_LENGTH, FINISH_STOP_SEQUENCE):
            metrics.REQUEST_DURATION.observe(duration, exemplar=exemplar)
        if seq.decode_span is not None:
            seq.decode_span.set_attribute("gen_ai.usage.output_tokens", len(seq.generated))
            seq.decode_span.end()
        if span is not None:
            span.set_attribute("gen_ai.usage.output_tokens", len(seq.generated))
            span.set_attribute("gen_ai.response.finish_reasons", [outcome])
            span.set_attribute("gen_ai.response.model", self.description.model_id)
            if failure is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(failure)))
                span.record_exception(failure)
            span.end()

    def _flush(self) -> None:
        """Hands this iteration's events to their event loops, one wake-up per loop."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sink, GenerationEvent | BaseException]]] = {}
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

    # ----------------------------------------------------------------- OOM handling

    def _requeue_front(self, seqs: list[SequenceState]) -> None:
        now = time.monotonic()
        for seq in seqs:
            seq.queued_since = now
        with self._cond:
            self._waiting.extendleft(reversed(seqs))
            metrics.QUEUE_SIZE.inc(len(seqs))

    def _on_prefill_oom(self, group: list[SequenceState]) -> list[SequenceState]:
        metrics.OOM_RETRIES.inc()
        self._empty_device_cache()
        if len(group) > 1:
            half = len(group) // 2
            log.warning("out of device memory in prefill; prefilling %d of %d now", half, len(group))
            self._requeue_front(group[half:])
            return group[:half]
        if self._running:
            self._halve_running()
            return group
        self._finish(
            group[0],
            None,
            outcome="error",
            failure=errors.ResourceExhausted("inference: out of device memory", retry_after=1.0),
        )
        return []

    def _on_decode_oom(self, cached: int) -> None:
        metrics.OOM_RETRIES.inc()
        # Layers that ran before the failure already appended this step's column: take it back.
        for layer in self._cache.layers:
            layer.truncate(cached)
        self._empty_device_cache()
        if len(self._running) > 1:
            self._halve_running()
            return
        seq = self._running[0]
        self._finish(
            seq,
            None,
            outcome="error",
            failure=errors.ResourceExhausted("inference: out of device memory", retry_after=1.0),
        )
        self._remove_rows([0])

    def _halve_running(self) -> None:
        half = len(self._running) // 2
        moved = self._running[half:]
        log.warning("out of device memory; requeueing %d of %d running sequences", len(moved), len(self._running))
        self._remove_rows(list(range(half, len(self._running))))
        for seq in moved:
            if seq.decode_span is not None:
                seq.decode_span.add_event("requeued after out of memory")
        self._requeue_front(moved)

    def _empty_device_cache(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    # ----------------------------------------------------------------- tracing

    def _new_segment(self) -> None:
        """A batch segment is the span of decode steps between two membership changes; it
        links to the request spans of its rows (span creation stays off the per-token path)."""
        self._membership_changed = False
        if self._segment_span is not None:
            self._end_segment()
        self._segment_id = f"{self.tag}-{next(self._segments)}"
        self._segment_steps = 0
        if not self._running:
            return
        links = [
            trace.Link(s.span.get_span_context())
            for s in self._running
            if s.span is not None and s.span.get_span_context().is_valid
        ]
        if not links:
            return
        self._segment_span = tracer.start_span(
            "inference.batch",
            context=otel_context.Context(),
            links=links,
            attributes={
                "llmesh.batch.id": self._segment_id,
                "llmesh.batch.size": len(self._running),
                "llmesh.model.version": self.description.version,
                "llmesh.batch.reserved_tokens": self._reserved,
            },
        )

    def _end_segment(self) -> None:
        span = self._segment_span
        if span is not None:
            span.set_attribute("llmesh.batch.decode_steps", self._segment_steps)
            span.end()
        self._segment_span = None

    def _trace_prefill(self, group: list[SequenceState], started_ns: int, tokens: int, padded: int) -> None:
        """Queue and prefill child spans of each request span, and the link to its batch."""
        batch_id, batch_size = self._segment_id, len(self._running)
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
        now_ns = time.time_ns()
        queued_ns = time.monotonic_ns()
        for seq in group:
            if not seq.batch_id:
                seq.batch_id = batch_id
            span = seq.span
            if span is None or seq.span_ctx is None:
                continue
            if segment_ctx is not None and segment_ctx.is_valid:
                span.add_link(segment_ctx, {"llmesh.link": "ran_in_batch"})
            span.set_attribute("llmesh.batch.id", seq.batch_id)
            span.set_attribute("llmesh.batch.size", batch_size)
            waited_ns = queued_ns - int(seq.enqueued_at * 1e9)
            queue_start = now_ns - waited_ns
            tracer.start_span("inference.queue", context=seq.span_ctx, start_time=queue_start).end(
                end_time=min(started_ns, now_ns)
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
            prefill.end(end_time=now_ns)
            if seq.decode_span is None:
                seq.decode_span = tracer.start_span(
                    "inference.decode",
                    context=seq.span_ctx,
                    start_time=now_ns,
                    attributes={"llmesh.batch.id": batch_id},
                )


def _ewma(previous: float | None, value: float, weight: float = 0.2) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value


def _deliver(items: list[tuple[_Sink, GenerationEvent | BaseException]]) -> None:
    for sink, item in items:
        assert sink.queue is not None
        sink.queue.put_nowait(item)
