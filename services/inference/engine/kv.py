"""The KV cache as preallocated slots.

Every layer has one key and one value buffer [slots, kv_heads, slot_length + 1, head_dim],
allocated once when the engine is built. A running sequence owns one slot (a row) from its
prefill to its end: its token at position p lives in column p of its row. Joining writes the
sequence's own row, leaving just frees the slot; nothing is concatenated and no row ever moves.
The last column is scratch: padding rows of a decode step write there, so they never touch a
column a sequence reads.

Which columns of a row are valid is the engine's business (per-row lengths): the attention mask
it passes lets each row read only its own prefix, so stale columns of a reused slot are never
read. They are always finite (written by an earlier forward, or zeroed when the slot is first
used), so a masked column never turns an output into NaN either.

The object stands in for transformers' `Cache` in the model's forward: each attention layer
calls `update(key_states, value_states, layer_idx)` and attends over what it returns. Before a
forward the runner sets the mode:

* fresh prefill: the group's rows write columns [0, T) of their slots; attention runs over the
  new keys alone (nothing cached yet);
* chunk: one row continues a prompt at column `start`; attention reads columns [0, start + T);
* decode: rows 0..B-1 (slot i is batch row i) each write one column (`write_cols`, a persistent
  buffer); attention reads columns [0, width) of rows 0..B-1, a view (no copy).
"""

from __future__ import annotations

from typing import Any

import torch

FRESH, CHUNK, DECODE = "fresh", "chunk", "decode"


class SlotKVCache:
    def __init__(self, config: Any, slots: int, slot_length: int, dtype: torch.dtype, device: torch.device) -> None:
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(config, "sliding_window", None):
            raise RuntimeError("only models whose layers all use full attention are supported")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.slots = slots
        self.slot_length = slot_length
        self.scratch = slot_length  # the extra last column
        shape = (slots, kv_heads, slot_length + 1, head_dim)
        # CPU: uninitialised (pages are touched only as slots are used; a slot is zeroed on its
        # first use). CUDA: zeroed at once (device memory is reserved either way).
        make = torch.zeros if device.type == "cuda" else torch.empty
        self.keys = [make(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [make(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self._clean = [device.type == "cuda"] * slots
        self.bytes = 2 * sum(k.numel() * k.element_size() for k in self.keys)
        # Mode of the next forward (set by the runner).
        self.mode = DECODE
        self._rows: torch.Tensor | None = None  # decode: arange(B); fresh: the group's slots
        self._write_cols: torch.Tensor | None = None
        self._kv_heads = kv_heads
        self._head_dim = head_dim
        self._heads = torch.arange(kv_heads, device=device)
        #: decode: each (row, KV head)'s write position in a buffer seen as [-1, head_dim]
        self._flat: torch.Tensor | None = None
        self._slot = 0
        self._start = 0
        self._width = 0

    def claim(self, slot: int) -> None:
        """A sequence takes `slot`: zero it if it was never used (finite junk only, see above)."""
        if not self._clean[slot]:
            for buf in (*self.keys, *self.values):
                buf[slot].zero_()
            self._clean[slot] = True

    def fresh(self, slots: torch.Tensor) -> None:
        self.mode, self._rows = FRESH, slots

    def chunk(self, slot: int, start: int) -> None:
        self.mode, self._slot, self._start = CHUNK, slot, start

    def decode(self, rows: torch.Tensor, write_cols: torch.Tensor, width: int) -> None:
        self.mode, self._rows, self._write_cols, self._width = DECODE, rows, write_cols, width
        # One index for every layer of the step: a row-by-row index_put costs far more.
        columns = self.slot_length + 1
        self._flat = ((rows[:, None] * self._kv_heads + self._heads) * columns + write_cols[:, None]).reshape(-1)

    def write_decode(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode mode: writes each row's new key and value [rows, kv_heads, head_dim] at its
        write column; returns the columns [0, width) of rows 0..B-1 (views)."""
        assert self._flat is not None
        kb, vb = self.keys[layer_idx], self.values[layer_idx]
        dim = self._head_dim
        kb.view(-1, dim).index_copy_(0, self._flat, keys.reshape(-1, dim))
        vb.view(-1, dim).index_copy_(0, self._flat, values.reshape(-1, dim))
        rows, width = keys.shape[0], self._width
        return kb[:rows, :, :width], vb[:rows, :, :width]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self.keys[layer_idx], self.values[layer_idx]
        if self.mode == DECODE:
            return self.write_decode(layer_idx, key_states[:, :, 0], value_states[:, :, 0])
        n = key_states.shape[2]
        if self.mode == FRESH:
            assert self._rows is not None
            kb[:, :, :n][self._rows] = key_states
            vb[:, :, :n][self._rows] = value_states
            return key_states, value_states
        s, start = self._slot, self._start
        kb[s, :, start : start + n] = key_states[0]
        vb[s, :, start : start + n] = value_states[0]
        return kb[s : s + 1, :, : start + n], vb[s : s + 1, :, : start + n]

    # transformers asks these of a cache in some code paths (not with the 4-D masks we pass).
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False
