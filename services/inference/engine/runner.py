"""The model runner: forwards over the block KV cache (kv.py), and the static-shape decode step.

Every forward is described by rows: a row is a sequence's new tokens, the position of the first
one, and the sequence's block table (kv_manager.py). The runner turns that into the cache's plan
(where each new token's keys and values go, the columns each row gathers) and the attention
mask, so each row attends to its own tokens only, at its own positions, over exactly its own
length: nothing is padded to a slot width.

Prefill (`prefill`): rows of any starts and lengths (fresh prompts, prompts continuing a cached
prefix, chunks of a long prompt) right-padded together under a causal mask; padding tokens write
nothing and read only their row's real columns.

Decode (`decode`): one token per row; batch row i is rows[i]. The step's inputs live in
persistent buffers (token ids, positions, write rows, lengths, block tables) updated in place,
so every step of a bucket has the same shapes and storage. On CUDA one graph per bucket is
captured at warm-up over the longest sequence's width and replayed (padding rows write the
scratch token and read the null block); elsewhere (CPU, or a batch above the captured sizes) the
same step function runs eagerly over the longest row only. Tokens are chosen on the device and
come back in a single device-to-host copy per step.

The forward: llama.py's own one where `llama.supported` allows (plain Llama models on CPU: fused
and prepacked matmuls), else the Hugging Face model's base forward with the cache standing in
for its `Cache`; both see the same inputs, masks and plans.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from services.inference.engine.kv import PagedKVCache
from services.inference.engine.kv_manager import NULL_BLOCK
from services.inference.engine.llama import LlamaDecoder, supported
from services.inference.engine.model import LoadedModel
from services.inference.engine.sampling import (
    Adjustments,
    Constraints,
    LogprobRows,
    Scores,
    StagedParams,
    choose_scored,
)

log = logging.getLogger("llmesh.inference.engine")

#: (batch rows that sample, temperatures, top_p, seeds, token counters, grammar masks, logit
#: adjustments, rows that return log probabilities)
Sampling = tuple[
    list[int],
    list[float],
    list[float],
    list[int],
    list[int],
    Constraints | None,
    Adjustments | None,
    LogprobRows | None,
]
#: A prefill row: (new token ids, position of the first, block table).
PrefillRow = tuple[Sequence[int], int, Sequence[int]]
#: A decode row: (input token, its position, block table).
DecodeRow = tuple[int, int, Sequence[int]]

#: Rows of the staged decode inputs: token ids, positions, write rows, valid lengths.
_IDS, _POS, _WRITE, _LEN = range(4)


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        num_blocks: int,
        block_tokens: int,
        max_seq_tokens: int,
        buckets: tuple[int, ...],
        cuda_graphs: bool,
        fast_decode: bool = True,
    ) -> None:
        self.model = model
        self.device = model.device
        self.block_tokens = block_tokens
        self.kv = PagedKVCache(model.config, num_blocks, block_tokens, model.dtype, model.device)
        #: Longest sequence (prompt + generated tokens) a row may hold.
        self.max_seq_tokens = max_seq_tokens
        self.max_blocks = -(-max_seq_tokens // block_tokens)
        #: The decode batch's sampling parameters on the device, staged once per batch change.
        self.decode_stage = StagedParams()
        self.buckets = buckets
        max_rows = buckets[-1]
        self.max_rows = max_rows
        hf = model.model
        self.base = getattr(hf, hf.base_model_prefix)
        self.lm_head = hf.get_output_embeddings()
        softcap = getattr(model.config, "final_logit_softcapping", None)
        if softcap:
            raise RuntimeError("models with final logit softcapping are not supported")
        dev = self.device
        self.inputs = torch.zeros((4, max_rows), dtype=torch.long, device=dev)
        self.tables = torch.zeros((max_rows, self.max_blocks), dtype=torch.long, device=dev)
        self.columns = torch.arange(self.max_blocks * block_tokens, device=dev)
        self.logits = torch.zeros((max_rows, model.vocab_size), dtype=model.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = cuda_graphs and dev.type == "cuda"
        self._pool: Any = None
        #: The own forward (llama.py) where the model allows it, else the HF forward.
        self.fast: LlamaDecoder | None = None
        why_not = supported(hf, dev) if fast_decode else "disabled"
        if why_not is None:
            self.fast = LlamaDecoder(hf, self.kv, max_rows, self.max_blocks * block_tokens)
        log.info("forward: %s", "own Llama forward" if self.fast else f"transformers ({why_not})")

    # ----------------------------------------------------------------- shapes

    def bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        return rows

    def _buffer_rows(self, table: Sequence[int], start: int, count: int) -> list[int]:
        bt = self.block_tokens
        return [table[p // bt] * bt + p % bt for p in range(start, start + count)]

    # ----------------------------------------------------------------- prefill

    def prefill(self, rows: Sequence[PrefillRow]) -> torch.Tensor:
        """Prefills each row's new tokens after its first `start` cached ones; returns each
        row's last logits [rows, vocab]."""
        return self.prefill_scored(rows, ())[0]

    def prefill_scored(
        self, rows: Sequence[PrefillRow], every: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`prefill`, and for the rows in `every` the float32 logits at each of their new
        tokens [new tokens, vocab] (what scoring a prompt needs)."""
        dev = self.device
        bt = self.block_tokens
        count = len(rows)
        tokens = max(len(ids) for ids, _, _ in rows)
        width = max(start + len(ids) for ids, start, _ in rows)
        blocks = -(-width // bt)
        ids = torch.zeros((count, tokens), dtype=torch.long)
        positions = torch.zeros((count, tokens), dtype=torch.long)
        table = torch.full((count, blocks), NULL_BLOCK, dtype=torch.long)
        ends = torch.zeros(count, dtype=torch.long)
        write: list[int] = []
        real: list[int] = []
        for r, (new, start, blocks_of_row) in enumerate(rows):
            n = len(new)
            ids[r, :n] = torch.tensor(list(new), dtype=torch.long)
            # Padding tokens sit at the row's last real position: they read only real columns.
            positions[r] = torch.arange(start, start + tokens).clamp_(max=start + n - 1)
            used = -(-(start + n) // bt)
            table[r, :used] = torch.tensor(list(blocks_of_row[:used]), dtype=torch.long)
            ends[r] = start + n
            write += self._buffer_rows(blocks_of_row, start, n)
            real += range(r * tokens, r * tokens + n)
        columns = torch.arange(width)
        gather = table[:, columns // bt] * bt + columns % bt
        gather = torch.where(columns[None, :] < ends[:, None], gather, NULL_BLOCK * bt)
        mask = (columns[None, None, :] <= positions[:, :, None])[:, None]
        self.kv.plan(
            torch.tensor(write, dtype=torch.long, device=dev),
            gather.to(dev),
            None if len(real) == count * tokens else torch.tensor(real, dtype=torch.long, device=dev),
        )
        hidden = self._hidden(ids.to(dev), positions.to(dev), mask.to(dev))
        last = torch.tensor([len(new) - 1 for new, _, _ in rows], device=dev)
        full = {r: self._head(hidden[r, : len(rows[r][0])]).float() for r in every}
        return self._head(hidden[torch.arange(count, device=dev), last]), full

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states of a prefill forward (the cache's plan set)."""
        if self.fast is not None:
            return self.fast.prefill(ids, positions, mask)
        out = self.base(
            input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.kv, use_cache=True
        )
        return out.last_hidden_state

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fast.lm_head(hidden) if self.fast is not None else self.lm_head(hidden)

    # ----------------------------------------------------------------- decode

    def decode(self, rows: Sequence[DecodeRow], sampling: Sampling, eager_width: int | None = None) -> list[int]:
        """One decode step. `rows`: (input token, position, block table) of every decoding row
        (batch row i is rows[i]); `sampling`: (batch rows that sample, temperatures, top_p,
        seeds, counters). Returns the chosen token of each row (one device-to-host copy).
        `eager_width` runs the step eagerly over that many columns even where a graph exists
        (to check a replay)."""
        return self.decode_scored(rows, sampling, eager_width)[0]

    def decode_scored(
        self, rows: Sequence[DecodeRow], sampling: Sampling, eager_width: int | None = None
    ) -> tuple[list[int], Scores | None]:
        """`decode`, and the log probabilities of the rows that ask (sampling's last item)."""
        logits = self.step_logits(rows, eager_width)
        tokens, scores = choose_scored(logits, *sampling, stage=self.decode_stage)
        return tokens[: len(rows)].tolist(), scores

    def step_logits(self, rows: Sequence[DecodeRow], eager_width: int | None = None) -> torch.Tensor:
        """The forward of one decode step: logits of batch rows 0..B-1 (B: the bucket covering
        the rows; rows past len(rows) are padding)."""
        count = len(rows)
        batch = self.bucket(count)
        bt = self.block_tokens
        width = max(position for _, position, _ in rows) + 1
        graph = self.graphs.get(batch) if eager_width is None else None
        # A graph reads the full table width; the eager step only the blocks the longest row uses.
        blocks = self.max_blocks if graph is not None else -(-width // bt)
        staged = [[0] * batch, [0] * batch, [self.kv.scratch] * batch, [1] * batch]
        tables = [[NULL_BLOCK] * blocks for _ in range(batch)]
        for r, (token, position, table) in enumerate(rows):
            staged[_IDS][r], staged[_POS][r], staged[_LEN][r] = token, position, position + 1
            staged[_WRITE][r] = table[position // bt] * bt + position % bt
            used = position // bt + 1
            tables[r][:used] = table[:used]
        pin = self.device.type == "cuda"
        host = torch.tensor(staged, dtype=torch.long)
        host_tables = torch.tensor(tables, dtype=torch.long)
        if pin:
            host, host_tables = host.pin_memory(), host_tables.pin_memory()
        self.inputs[:, :batch].copy_(host, non_blocking=True)
        self.tables[:batch, :blocks].copy_(host_tables, non_blocking=True)
        if graph is not None:
            graph.replay()
            return self.logits[:batch]
        # One row over exactly its own columns reads them all: no mask to apply.
        unmasked = batch == 1 and eager_width in (None, width)
        return self._forward_step(batch, eager_width or width, unmasked)

    def _step(self, batch: int, width: int) -> None:
        """The static-shape step over the persistent buffers (captured as is into a graph)."""
        self.logits[:batch] = self._forward_step(batch, width)

    def _forward_step(self, batch: int, width: int, unmasked: bool = False) -> torch.Tensor:
        inputs = self.inputs
        bt = self.block_tokens
        lengths = inputs[_LEN, :batch]
        columns = self.columns[:width]
        valid = columns[None, :] < lengths[:, None]
        gather = self.tables[:batch, columns // bt] * bt + columns % bt
        gather = torch.where(valid, gather, NULL_BLOCK * bt)
        mask = valid[:, None, None, :]
        self.kv.plan(inputs[_WRITE, :batch], gather)
        if self.fast is not None:
            return self.fast.forward(inputs[_IDS, :batch], inputs[_POS, :batch], None if unmasked else mask)
        hidden = self._hidden(inputs[_IDS, :batch, None], inputs[_POS, :batch, None], mask)
        return self.lm_head(hidden[:, -1])

    # ----------------------------------------------------------------- mixed step

    @property
    def can_mix(self) -> bool:
        """Whether decode rows and a prompt chunk can share one forward (the own forward)."""
        return self.fast is not None

    def mixed(self, rows: Sequence[DecodeRow], chunks: Sequence[PrefillRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward for the decode rows and prompt chunks together (a long prompt's next
        chunk, or whole short prompts that arrived while the rows decode): the decode rows'
        logits [rows, vocab] and each chunk's last logits [chunks, vocab]."""
        assert self.fast is not None
        dev = self.device
        bt = self.block_tokens
        ids = [token for token, _, _ in rows]
        positions = [position for _, position, _ in rows]
        write = [t[p // bt] * bt + p % bt for _, p, t in rows]
        parts: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for new, start, table in chunks:
            n = len(new)
            ids += list(new)
            positions += range(start, start + n)
            write += self._buffer_rows(table, start, n)
            gather = torch.tensor([self._buffer_rows(table, 0, start + n)], dtype=torch.long)
            mask = (torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None])[None, None]
            parts.append((n, gather.to(dev), mask.to(dev)))
        width = max((position for _, position, _ in rows), default=0) + 1
        blocks = -(-width // bt)
        tables = torch.tensor(
            [list(t[: p // bt + 1]) + [NULL_BLOCK] * (blocks - p // bt - 1) for _, p, t in rows], dtype=torch.long
        ).view(len(rows), blocks)
        lengths = torch.tensor([p + 1 for _, p, _ in rows], dtype=torch.long)
        columns = torch.arange(width)
        valid = columns[None, :] < lengths[:, None]
        decode_gather = torch.where(valid, tables[:, columns // bt] * bt + columns % bt, NULL_BLOCK * bt)
        self.kv.plan(torch.tensor(write, dtype=torch.long, device=dev), parts[0][1])
        return self.fast.mixed(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            len(rows),
            decode_gather.to(dev),
            valid[:, None, None, :].to(dev),
            parts,
        )

    # ----------------------------------------------------------------- CUDA graphs

    def capture(self) -> None:
        """One CUDA graph per bucket, over the longest sequence's width (largest first, one
        memory pool). A capture that fails (an op that syncs with the host in some model's
        forward) leaves the engine eager, with a warning, rather than unable to serve."""
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
        width = self.max_blocks * self.block_tokens
        self.inputs.zero_()
        self.inputs[_WRITE] = self.kv.scratch
        self.inputs[_LEN] = 1
        self.tables.zero_()
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
