"""The KV cache as a pool of fixed-size blocks (kv_manager.py decides which block holds what).

Every layer has one key and one value buffer [num_blocks x block_tokens, kv_heads, head_dim]
(token-major), allocated once when the engine is built: the token at position p of a sequence
lives at row `table[p // B] * B + p % B` of the buffer (B: block_tokens). A forward writes its
new tokens' keys and values with one `index_copy_` per layer and tensor, then gathers each row's
columns [0, width) with one `index_select` into [rows, kv_heads, width, head_dim] (a strided
view of the gathered rows: SDPA reads it as is) and attends over that. Measured on this
machine's CPU (16 rows, 600 columns, SmolLM2's 3 KV heads of 64): the token-major gather with
SDPA costs ~0.75 ms per layer against ~0.5 ms for a contiguous slot view; gathering whole
blocks, or a head-major layout, costs more.

A column a row does not own (past its length, or padding) gathers the null block's token 0,
which is zero and never written: a masked column is a finite zero whatever an earlier owner
left in a reused block, so it cannot turn an output into NaN (0 x NaN is NaN, a mask does not
help). Padding rows of a CUDA graph's decode step write the null block's last token (scratch).

The object stands in for transformers' `Cache` in the model's forward: each attention layer
calls `update(key_states, value_states, layer_idx)` and attends over what it returns. The
runner sets the plan of the next forward first (`plan`): where the new tokens go, which of the
[rows, tokens] inputs are real, and the gather index.
"""

from __future__ import annotations

from typing import Any

import torch

from services.inference.engine.kv_manager import NULL_BLOCK


class PagedKVCache:
    def __init__(
        self, config: Any, num_blocks: int, block_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(config, "sliding_window", None):
            raise RuntimeError("only models whose layers all use full attention are supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        shape = (num_blocks * block_tokens, kv_heads, head_dim)
        # CPU: uninitialised (pages are touched only as blocks are used); the null block is
        # zeroed. CUDA: zeroed at once (device memory is reserved either way).
        make = torch.zeros if device.type == "cuda" else torch.empty
        self.keys = [make(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [make(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        for buf in (*self.keys, *self.values):
            buf[NULL_BLOCK * block_tokens : (NULL_BLOCK + 1) * block_tokens].zero_()
        self.bytes = 2 * sum(k.numel() * k.element_size() for k in self.keys)
        #: The buffer row padding rows write (the null block's last token; never gathered).
        self.scratch = NULL_BLOCK * block_tokens + block_tokens - 1
        self._kv_heads = kv_heads
        self._head_dim = head_dim
        # The plan of the next forward (set by the runner).
        self._write: torch.Tensor | None = None
        self._real: torch.Tensor | None = None
        self._gather: torch.Tensor | None = None
        self._width = 0

    def plan(self, write: torch.Tensor, gather: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """`write`: the buffer row of each new token [n]; `real`: which of the forward's
        rows x tokens inputs (flattened) those are, None when all; `gather`: [rows, width] buffer
        rows each row attends to."""
        self._write, self._real, self._gather = write, real, gather
        self._width = gather.shape[1]

    def write_decode(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per row: keys and values [rows, kv_heads, head_dim]; returns each row's
        gathered columns [rows, kv_heads, width, head_dim]."""
        assert self._write is not None
        kb, vb = self.keys[layer_idx], self.values[layer_idx]
        kb.index_copy_(0, self._write, keys)
        vb.index_copy_(0, self._write, values)
        return self._gathered(kb), self._gathered(vb)

    def write_tokens(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes the forward's new tokens [tokens, kv_heads, head_dim] at the planned rows (a
        mixed step: its rows then gather with `gather`)."""
        assert self._write is not None
        self.keys[layer_idx].index_copy_(0, self._write, keys)
        self.values[layer_idx].index_copy_(0, self._write, values)

    def gather(self, layer_idx: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows `index` [rows, width] of a layer as [rows, kv_heads, width, head_dim] views."""
        rows, width = index.shape
        shape = (rows, width, self._kv_heads, self._head_dim)
        flat = index.view(-1)
        k = self.keys[layer_idx].index_select(0, flat).view(shape).transpose(1, 2)
        v = self.values[layer_idx].index_select(0, flat).view(shape).transpose(1, 2)
        return k, v

    def _gathered(self, buf: torch.Tensor) -> torch.Tensor:
        assert self._gather is not None
        rows, width = self._gather.shape
        gathered = buf.index_select(0, self._gather.view(-1))
        return gathered.view(rows, width, self._kv_heads, self._head_dim).transpose(1, 2)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states [rows, kv_heads, tokens, head_dim] (transformers' layout)."""
        assert self._write is not None
        kb, vb = self.keys[layer_idx], self.values[layer_idx]
        rows, heads, tokens, dim = key_states.shape
        k = key_states.transpose(1, 2).reshape(rows * tokens, heads, dim)
        v = value_states.transpose(1, 2).reshape(rows * tokens, heads, dim)
        if self._real is not None:
            k, v = k.index_select(0, self._real), v.index_select(0, self._real)
        kb.index_copy_(0, self._write, k)
        vb.index_copy_(0, self._write, v)
        return self._gathered(kb), self._gathered(vb)

    def block(self, layer_idx: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block's keys and values of a layer [block_tokens, kv_heads, head_dim] (views; tests)."""
        rows = slice(block * self.block_tokens, (block + 1) * self.block_tokens)
        return self.keys[layer_idx][rows], self.values[layer_idx][rows]

    # transformers asks these of a cache in some code paths (not with the 4-D masks we pass).
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False
