"""Engine settings, finish reasons and the decode batch-size buckets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_STOP_SEQUENCE = "stop_sequence"
FINISH_CANCELLED = "cancelled"

#: Most prompt tokens prefilled in one iteration while no batch decodes, per device kind.
DEFAULT_MAX_PREFILL_TOKENS = {"cpu": 2048, "cuda": 8192}
#: While a batch decodes, a prompt chunk is sized to take about this many decode steps.
PREFILL_STALL_STEPS = 1.0
#: Smallest prefill chunk while a batch decodes: small prefills waste the batched GEMMs, and
#: a short prompt (a chat request) should be prefilled whole, together with the other arrivals.
MIN_PREFILL_CHUNK = 128

#: Share of the device memory free after loading that the KV slots may take (the rest is for
#: activations, logits, CUDA graphs and allocator slack).
CUDA_KV_MEMORY_FRACTION = 0.7


def cuda_buckets(max_batch: int) -> tuple[int, ...]:
    """Decode batch sizes a CUDA graph is captured for: 1, 2, 4, 8, 16, then steps of 16, and
    the max batch itself."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    sizes += list(range(32, max_batch, 16))
    sizes.append(max_batch)
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32
    max_queue: int = 256
    queue_timeout_s: float = 30.0
    batch_wait_s: float = 0.002
    max_prompt_tokens: int = 1536
    max_new_tokens: int = 512
    default_max_new_tokens: int = 128
    #: KV-cache tokens the engine preallocates (its physical footprint: slots x slot length);
    #: None derives it.
    max_batch_total_tokens: int | None = None
    #: Most prompt tokens prefilled in one iteration; None picks DEFAULT_MAX_PREFILL_TOKENS.
    max_prefill_tokens: int | None = None
    #: LLMESH_DTYPE and LLMESH_QUANTIZE (see LoadedModel).
    dtype: str = "auto"
    quantize: str = "none"
    #: Decode batch-size buckets; None: cuda_buckets() on CUDA, every size on CPU (no graphs
    #: there, so padding would only cost time). Tests set buckets on CPU to exercise padding.
    decode_buckets: tuple[int, ...] | None = None
    #: Capture one CUDA graph per bucket at warm-up (CUDA only).
    cuda_graphs: bool = True

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

    def slot_length(self, max_context_tokens: int) -> int:
        """KV columns of one slot: room for a maximal request."""
        return min(self.max_prompt_tokens + self.max_new_tokens, max_context_tokens)

    def slot_count(self, slot_length: int, kv_bytes_per_token: int, device: torch.device) -> int:
        """Number of KV slots (rows) to preallocate: the physical footprint is slot_count x
        slot_length tokens. A given budget (LLMESH_MAX_BATCH_TOTAL_TOKENS) is divided by the slot
        length; on CUDA the budget is a share of the memory free after loading, measured before
        this engine allocates, so an engine loaded beside another (a model switch) only counts
        what the other left free; on CPU every batch row gets a slot."""
        if self.max_batch_total_tokens is not None:
            slots = self.max_batch_total_tokens // slot_length
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            slots = int(free * CUDA_KV_MEMORY_FRACTION) // max(1, slot_length * kv_bytes_per_token)
        else:
            slots = self.max_batch_size
        return max(1, min(self.max_batch_size, slots))

    def buckets(self, rows: int, device: torch.device) -> tuple[int, ...]:
        if self.decode_buckets is not None:
            sizes = sorted({b for b in self.decode_buckets if b < rows} | {rows})
            return tuple(sizes)
        if device.type == "cuda":
            return cuda_buckets(rows)
        return tuple(range(1, rows + 1))
