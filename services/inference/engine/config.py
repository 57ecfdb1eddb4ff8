"""Engine settings, finish reasons and the decode batch-size buckets."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from llmesh.settings import EngineSettings, GenerationLimits

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

#: Share of the device memory free after loading that the KV blocks may take (the rest is for
#: activations, logits, CUDA graphs and allocator slack).
CUDA_KV_MEMORY_FRACTION = 0.7
#: Tokens per KV block (vLLM's default): small enough that a sequence wastes little of its last
#: block, large enough that block tables and prefix hashes stay short.
DEFAULT_BLOCK_TOKENS = 16


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
    #: KV-cache tokens the engine preallocates (its physical footprint, in blocks); None
    #: derives it.
    max_batch_total_tokens: int | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    #: Reuse cached prefix blocks across requests (LLMESH_PREFIX_CACHING).
    prefix_caching: bool = True
    #: Prompts arriving while rows decode ride in their forward (LLMESH_MIX_PROMPTS).
    mix_prompts: bool = False
    #: Most prompt tokens prefilled in one iteration; None picks DEFAULT_MAX_PREFILL_TOKENS.
    max_prefill_tokens: int | None = None
    #: LLMESH_DTYPE and LLMESH_QUANTIZE (see LoadedModel; the service's setting defaults to auto).
    dtype: str = "auto"
    quantize: str = "none"
    #: Decode batch-size buckets; None: cuda_buckets() on CUDA, every size on CPU (no graphs
    #: there, so padding would only cost time). Tests set buckets on CPU to exercise padding.
    decode_buckets: tuple[int, ...] | None = None
    #: Capture one CUDA graph per bucket at warm-up (CUDA only).
    cuda_graphs: bool = True
    #: Longest a response format's grammar may take to compile (LLMESH_GRAMMAR_COMPILE_SECONDS).
    grammar_compile_s: float = 2.0
    #: Rows batch work may hold while interactive work is about (LLMESH_BATCH_ROWS_BESIDE_INTERACTIVE).
    batch_rows_beside_interactive: int = 4

    @classmethod
    def from_settings(cls, engine: EngineSettings, limits: GenerationLimits, **overrides: Any) -> EngineConfig:
        """From inference's engine settings and its generation limits; `overrides` replace fields."""
        config = cls(
            max_batch_size=engine.max_batch_size,
            max_queue=engine.max_queue,
            queue_timeout_s=engine.queue_timeout_seconds,
            batch_wait_s=engine.batch_wait_ms / 1000.0,
            max_prompt_tokens=limits.max_prompt_tokens,
            max_new_tokens=limits.max_new_tokens,
            default_max_new_tokens=limits.default_max_new_tokens,
            # LLMESH_MAX_BATCH_TOTAL_TOKENS, LLMESH_MAX_PREFILL_TOKENS: 0 means derived.
            max_batch_total_tokens=engine.max_batch_total_tokens or None,
            max_prefill_tokens=engine.max_prefill_tokens or None,
            dtype=engine.dtype,
            prefix_caching=engine.prefix_caching,
            mix_prompts=engine.mix_prompts,
            quantize=engine.quantize,
            grammar_compile_s=engine.grammar_compile_seconds,
            batch_rows_beside_interactive=engine.batch_rows_beside_interactive,
        )
        return replace(config, **overrides) if overrides else config

    def max_seq_tokens(self, max_context_tokens: int) -> int:
        """The longest sequence (prompt + answer) one request may reach."""
        return min(self.max_prompt_tokens + self.max_new_tokens, max_context_tokens)

    def kv_tokens(self, seq_tokens: int, kv_bytes_per_token: int, device: torch.device) -> int:
        """KV tokens to preallocate: LLMESH_MAX_BATCH_TOTAL_TOKENS when given; on CUDA a share
        of the memory free after loading, measured before this engine allocates (an engine
        loaded beside another, a model switch, only counts what the other left free); on CPU
        what one slot per batch row took before blocks (max batch x the longest sequence), so
        the same memory now holds as many sequences as their real lengths allow. Never less
        than one longest sequence."""
        if self.max_batch_total_tokens is not None:
            tokens = self.max_batch_total_tokens
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            tokens = int(free * CUDA_KV_MEMORY_FRACTION) // max(1, kv_bytes_per_token)
        else:
            tokens = self.max_batch_size * seq_tokens
        return max(tokens, seq_tokens)

    def kv_blocks(self, seq_tokens: int, kv_bytes_per_token: int, device: torch.device) -> int:
        """Blocks of the KV pool, the null block (kv_manager.py) included."""
        return -(-self.kv_tokens(seq_tokens, kv_bytes_per_token, device) // self.block_tokens) + 1

    def buckets(self, rows: int, device: torch.device) -> tuple[int, ...]:
        if self.decode_buckets is not None:
            sizes = sorted({b for b in self.decode_buckets if b < rows} | {rows})
            return tuple(sizes)
        if device.type == "cuda":
            return cuda_buckets(rows)
        return tuple(range(1, rows + 1))
