"""The model runner: forwards over the KV slots, and the static-shape decode step.

Decode: slot i is batch row i, so a step runs rows 0..B-1 where B is the smallest bucket
covering the highest slot in use; slots in between that are free or still prefilling are
padding rows (they write the scratch column and read column 0; their outputs are ignored). The
step's inputs live in persistent buffers (token ids, positions, write columns, valid lengths)
updated in place from one staged host tensor, so every step of a bucket has the same shapes and
the same storage. On CUDA one graph per bucket is captured at warm-up over the full slot width
and replayed; elsewhere (CPU, or a batch above the captured sizes) the same step function runs
eagerly over the longest valid prefix only. Tokens are chosen on the device and come back in a
single device-to-host copy per step.

Prefill runs eagerly: a group of fresh prompts (right-padded, causal mask; each row writes its
own slot), or one chunk of a long prompt continuing its slot.

The forward: llama.py's own one where `llama.supported` allows (plain Llama models on CPU:
fused and prepacked matmuls), else the Hugging Face model's base forward with the slots as its
cache; both see the same inputs, masks and cache modes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from services.inference.engine.kv import SlotKVCache
from services.inference.engine.llama import LlamaDecoder, supported
from services.inference.engine.model import LoadedModel
from services.inference.engine.sampling import Adjustments, Constraints, choose

log = logging.getLogger("llmesh.inference.engine")

#: (batch rows that sample, temperatures, top_p, seeds, token counters)
Sampling = tuple[list[int], list[float], list[float], list[int], list[int], Constraints | None, Adjustments | None]

#: Rows of the staged decode inputs: token ids, positions, write columns, valid lengths.
_IDS, _POS, _COL, _LEN = range(4)


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        slots: int,
        slot_length: int,
        buckets: tuple[int, ...],
        cuda_graphs: bool,
        fast_decode: bool = True,
    ) -> None:
        self.model = model
        self.device = model.device
        self.kv = SlotKVCache(model.config, slots, slot_length, model.dtype, model.device)
        self.slots = slots
        self.slot_length = slot_length
        self.buckets = buckets
        hf = model.model
        self.base = getattr(hf, hf.base_model_prefix)
        self.lm_head = hf.get_output_embeddings()
        softcap = getattr(model.config, "final_logit_softcapping", None)
        if softcap:
            raise RuntimeError("models with final logit softcapping are not supported")
        dev = self.device
        self.inputs = torch.zeros((4, slots), dtype=torch.long, device=dev)
        pin = dev.type == "cuda"
        self.staged = torch.zeros((4, slots), dtype=torch.long, pin_memory=pin)
        self.rows = torch.arange(slots, device=dev)
        self.columns = torch.arange(slot_length + 1, device=dev)
        self.logits = torch.zeros((slots, model.vocab_size), dtype=model.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = cuda_graphs and dev.type == "cuda"
        self._pool: Any = None
        #: The own decode forward (llama.py) where the model allows it, else the HF forward.
        self.fast: LlamaDecoder | None = None
        why_not = supported(hf, dev) if fast_decode else "disabled"
        if why_not is None:
            self.fast = LlamaDecoder(hf, self.kv, slots)
        log.info("decode forward: %s", "own Llama forward" if self.fast else f"transformers ({why_not})")

    # ----------------------------------------------------------------- shapes

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        return rows

    # ----------------------------------------------------------------- prefill

    def prefill_fresh(self, slots: list[int], prompts: list[list[int]], pad_id: int) -> torch.Tensor:
        """Prefills whole prompts into their slots; returns each row's last logits [rows, vocab]."""
        dev = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        ids = ids.to(dev)
        positions = torch.arange(width, device=dev).expand(len(prompts), width)
        # Right padding: a real token never sees a padding one under the causal mask.
        mask = torch.ones((width, width), dtype=torch.bool, device=dev).tril_()[None, None]
        mask = mask.expand(len(prompts), 1, width, width)
        for slot in slots:
            self.kv.claim(slot)
        self.kv.fresh(torch.tensor(slots, device=dev))
        hidden = self._hidden(ids, positions, mask)
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        return self._head(hidden[torch.arange(len(prompts), device=dev), last])

    def prefill_chunk(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """Prefills `tokens` at columns [start, start + n) of `slot`; returns the last logits [1, vocab]."""
        dev = self.device
        n = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        positions = torch.arange(start, start + n, device=dev)[None]
        mask = (torch.arange(start + n, device=dev)[None, :] <= positions[0][:, None])[None, None]
        if start == 0:
            self.kv.claim(slot)
        self.kv.chunk(slot, start)
        hidden = self._hidden(ids, positions, mask)
        return self._head(hidden[:, -1])

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states of a prefill forward (the KV cache's mode set)."""
        if self.fast is not None:
            return self.fast.prefill(ids, positions, mask)
        out = self.base(
            input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.kv, use_cache=True
        )
        return out.last_hidden_state

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fast.lm_head(hidden) if self.fast is not None else self.lm_head(hidden)

    # ----------------------------------------------------------------- decode

    def decode(
        self,
        rows: list[tuple[int, int, int]],
        sampling: Sampling,
        eager_width: int | None = None,
    ) -> list[int]:
        """One decode step. `rows`: (slot, input token, position) of every decoding row;
        `sampling`: (batch rows that sample, temperatures, top_p, seeds, counters). Returns the
        chosen token of batch rows 0..max slot (one device-to-host copy). `eager_width` runs the
        step eagerly over that many columns even where a graph exists (to check a replay)."""
        logits, top = self.step_logits(rows, eager_width)
        tokens = choose(logits, *sampling)
        return tokens[:top].tolist()

    def step_logits(self, rows: list[tuple[int, int, int]], eager_width: int | None = None) -> tuple[torch.Tensor, int]:
        """The forward of one decode step: logits of batch rows 0..B-1 (B: the bucket covering
        the highest slot in use) and the number of rows up to that slot."""
        top = max(slot for slot, _, _ in rows) + 1
        batch = self.bucket(top)
        ids, pos, cols, lens = [0] * batch, [0] * batch, [self.kv.scratch] * batch, [1] * batch
        # Padding rows (free or prefilling slots) write the scratch column and read column 0.
        for slot, token, position in rows:
            ids[slot], pos[slot], cols[slot], lens[slot] = token, position, position, position + 1
        width = max(lens)
        staged = self.staged
        staged[:, :batch] = torch.tensor([ids, pos, cols, lens], dtype=torch.long)
        self.inputs[:, :batch].copy_(staged[:, :batch], non_blocking=True)
        graph = self.graphs.get(batch) if eager_width is None else None
        if graph is not None:
            graph.replay()
            return self.logits[:batch], top
        return self._forward_step(batch, eager_width or width), top

    def _step(self, batch: int, width: int) -> None:
        """The static-shape step over the persistent buffers (captured as is into a graph)."""
        self.logits[:batch] = self._forward_step(batch, width)

    def _forward_step(self, batch: int, width: int) -> torch.Tensor:
        inputs = self.inputs
        lengths = inputs[_LEN, :batch]
        mask = (self.columns[:width][None, :] < lengths[:, None])[:, None, None, :]
        self.kv.decode(self.rows[:batch], inputs[_COL, :batch], width)
        if self.fast is not None:
            return self.fast.forward(inputs[_IDS, :batch], inputs[_POS, :batch], mask)
        hidden = self._hidden(inputs[_IDS, :batch, None], inputs[_POS, :batch, None], mask)
        return self.lm_head(hidden[:, -1])

    # ----------------------------------------------------------------- CUDA graphs

    def capture(self) -> None:
        """One CUDA graph per bucket, over the full slot width (largest first, one memory pool).
        A capture that fails (an op that syncs with the host in some model's forward) leaves the
        engine eager, with a warning, rather than unable to serve."""
        if not self.use_graphs:
            return
        try:
            self._capture()
        except Exception:
            log.warning("CUDA graph capture failed; decoding eagerly", exc_info=True)
            self.graphs.clear()
            self.use_graphs = False
            torch.cuda.synchronize(self.device)

    def _capture(self) -> None:
        width = self.slot_length + 1
        staged = self.staged
        staged.zero_()
        staged[_COL] = self.kv.scratch
        staged[_LEN] = 1
        self.inputs.copy_(staged)
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm the kernels (and cuBLAS workspaces) outside capture
                self._step(self.buckets[-1], width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for batch in sorted(self.buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            self._step(batch, width)  # eager run of this shape first
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(batch, width)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs (decode buckets %s)", len(self.graphs), list(self.buckets))
