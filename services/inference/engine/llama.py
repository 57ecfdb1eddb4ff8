"""An own forward for Llama-family models over the block KV cache: the decode step (one new
token per row) and prefill (rows of any start and length, through the cache's plan as the HF
forward).

The Hugging Face forward stays the fallback for every other architecture (and on CUDA, where
the decode step is a captured graph); this one does what its generic code cannot:

* q/k/v and gate/up are one matmul each: their weights are concatenated once at load (in
  float32 the HF modules' weights become row views of the concatenation: no second copy);
* on CPU in bfloat16 the weights are prepacked for oneDNN once (the plain path lays them out
  again on every call: 20-40 us per small matmul), and the o/down projections add the residual
  in the matmul's epilogue. The packed copy is extra memory (about the model's size less the
  embeddings; +270 MB for SmolLM2-135M): the HF modules keep their plain weights for the
  fallback and the quality guard;
* the rotary cos/sin come from a table computed once by the model's own rotary module (the same
  values it computes per step), the attention mask once per step for all layers, and the KV
  columns of the step are written with one `index_copy_` per layer and tensor (kv.py);
* GQA without repeating keys: a row's query heads of one KV head are that head's query rows.

* quantized models (engine/quantize.py: LLMESH_QUANTIZE=int8|int4) run here too: the
  fused weights are quantized once (per-row scales and groups, so fusing changes no number) and
  calls of at most `quant_max_rows` rows (one stream decoding) go through the quantized kernel,
  larger ones through the served dtype's matmul;
* the LM head runs only over the rows that need logits (the decode rows, a prefill's last
  token per row).

Used only where `supported()` says so: a plain Llama (no biases, SiLU MLP, rotary of a static
kind, `nn.Linear` or quantize.py's `QuantizedLinear` projections), CPU. Its logits match the HF forward's (unit tests
compare them in float32). The fused and packed weights are taken at load: a model whose weights
change afterwards (`.to(dtype)`, quantization) needs a new runner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from services.inference.engine.kv import PagedKVCache
from services.inference.engine.quantize import QUANT_MAX_ROWS, QuantizedLinear, QuantizedWeight

#: Rotary kinds whose cos/sin for a position do not depend on the sequence length.
_STATIC_ROPE = {"default", "linear", "llama3"}
_MODEL_TYPES = {"llama"}


def supported(hf: Any, device: torch.device) -> str | None:
    """None when the model can use this forward, else why not."""
    cfg = hf.config
    if device.type != "cpu":
        return f"device {device.type} (CUDA decodes through graphs of the HF forward)"
    if getattr(cfg, "model_type", None) not in _MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r}"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "biases"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r}"
    base: Any = getattr(hf, hf.base_model_prefix, None)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in _STATIC_ROPE:
        return f"rotary {getattr(rotary, 'rope_type', None)!r}"
    methods = set()
    for layer in base.layers:
        att, mlp = layer.self_attn, layer.mlp
        for lin in (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(lin) not in (torch.nn.Linear, QuantizedLinear):
                return f"projection {type(lin).__name__}"
            methods.add(quantization_of(lin))
    if type(hf.get_output_embeddings()) not in (torch.nn.Linear, QuantizedLinear):
        return "output embeddings"
    if len(methods) > 1:
        return f"mixed quantizations {sorted(methods)}"
    return None


def quantization_of(module: Any) -> str:
    """'none' for a plain nn.Linear, else its QuantizedLinear's method."""
    return module.method if isinstance(module, QuantizedLinear) else "none"


def _fuse(modules: list[torch.nn.Linear], share: bool) -> torch.Tensor:
    """Concatenates the modules' weights along the output rows. `share`: points each module at
    its rows of the result (a contiguous view), so the weights exist once (where the result is
    kept: not when it is only prepacked, and dropped)."""
    fused = torch.cat([m.weight.detach() for m in modules])
    if not share:
        return fused
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class _Linear:
    """y = x W^T (+ a fused epilogue), with the weight prepacked for oneDNN in bfloat16, and a
    quantized copy for calls of at most `quant_max_rows` rows where the model is quantized."""

    def __init__(
        self, weight: torch.Tensor, pack: bool, rows_hint: int, quantize: str = "none", quant_max_rows: float = 0
    ) -> None:
        #: The plain weight (None once prepacked: the packed copy is all the matmul needs).
        self.weight: torch.Tensor | None = None if pack else weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint) if pack else None
        self.quantized = None if quantize == "none" else QuantizedWeight(weight, quantize)
        self.quant_max_rows = quant_max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quant_max_rows:
            return self.quantized(x)
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T."""
        if self.packed is None or (self.quantized is not None and x.shape[0] <= self.quant_max_rows):
            return residual + self(x)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")


def can_pack(dtype: torch.dtype) -> bool:
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class LlamaDecoder:
    def __init__(
        self,
        hf: Any,
        kv: PagedKVCache,
        rows_hint: int,
        max_positions: int,
        pack: bool | None = None,
        share_weights: bool = True,
        quant_max_rows: float | None = None,
    ) -> None:
        """`share_weights`: in float32 the HF modules' weights become views of the fused ones
        (one copy); False leaves the model untouched (a throwaway forward: the quality guard).
        `quant_max_rows`: calls of at most this many rows through the quantized kernel (a
        quantized model; default quantize.QUANT_MAX_ROWS; math.inf: every call, as the guard
        measures)."""
        cfg = hf.config
        base = getattr(hf, hf.base_model_prefix)
        dtype = base.embed_tokens.weight.dtype
        self.pack = can_pack(dtype) if pack is None else pack
        #: "none", "int8" or "int4": what the model's projections were quantized to at load
        #: (the LM head may differ: quantize.quantize_model).
        self.quantize = quantization_of(base.layers[0].self_attn.q_proj)
        if quant_max_rows is None:
            quant_max_rows = QUANT_MAX_ROWS.get(self.quantize, 0)
        self.quant_max_rows = quant_max_rows

        def linear(weight: torch.Tensor, method: str = self.quantize) -> _Linear:
            return _Linear(weight, self.pack, rows_hint, method, quant_max_rows)

        #: Tests: called with (layer index, hidden [rows, hidden]) before each layer (fault
        #: injection inside a step, as a forward pre-hook on an HF layer does for its forward).
        self.before_layer: Callable[[int, torch.Tensor], None] | None = None
        self.fused_norm = True
        self.kv = kv
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.intermediate = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        head = hf.get_output_embeddings()
        self.lm_head = linear(head.weight.detach(), quantization_of(head))
        self.layers: list[tuple[Any, ...]] = []
        with torch.no_grad():
            for layer in base.layers:
                att, mlp = layer.self_attn, layer.mlp
                # A quantized model's modules keep their own copies (transformers' forward).
                share = share_weights and not self.pack and self.quantize == "none"
                qkv = _fuse([att.q_proj, att.k_proj, att.v_proj], share=share)
                gate_up = _fuse([mlp.gate_proj, mlp.up_proj], share=share)
                self.layers.append(
                    (
                        layer.input_layernorm.weight,
                        linear(qkv),
                        linear(att.o_proj.weight.detach()),
                        layer.post_attention_layernorm.weight,
                        linear(gate_up),
                        linear(mlp.down_proj.weight.detach()),
                    )
                )
            self.scaling = float(base.layers[0].self_attn.scaling)
            # cos/sin of every position a sequence reaches, by the model's own rotary module.
            positions = torch.arange(max_positions, device=self.embed.device)[None]
            cos, sin = base.rotary_emb(self.embed[:1], positions)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_norm:
            return F.rms_norm(x, (self.hidden,), weight, self.eps)
        # LlamaRMSNorm's arithmetic: in float32, cast back, then the weight.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step. `ids`, `positions`: [rows]; `mask`: bool
        [rows, 1, 1, width] (the columns each row reads), None where every row reads every
        column (one row over exactly its length). The KV cache has its plan (the write rows and
        gather index set for this step)."""
        rows = ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        cos = self.cos[positions][:, None, :]  # [rows, 1, dim]
        sin = self.sin[positions][:, None, :]
        kv = self.kv
        x = F.embedding(ids, self.embed)
        for index, (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj) in enumerate(self.layers):
            if self.before_layer is not None:
                self.before_layer(index, x[:, None])
            qkv = qkv_proj(self._norm(x, ln1))
            # q and k rotate as one tensor (their heads side by side): half the ops.
            qk = self._rotate(qkv[:, : q_size + kv_size].view(rows, heads + kv_heads, dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size :].view(rows, kv_heads, dim)
            keys, values = kv.write_decode(index, k, v)
            # The query heads of one KV head attend as that head's query rows (no repeat_kv).
            attn = F.scaled_dot_product_attention(
                q.view(rows, kv_heads, heads // kv_heads, dim), keys, values, attn_mask=mask, scale=self.scaling
            )
            x = o_proj.add(attn.reshape(rows, q_size), x)
            gate_up = gate_up_proj(self._norm(x, ln2))
            x = down_proj.add(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], x)
        return self.lm_head(self._norm(x, self.final_norm))

    def mixed(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        decode_rows: int,
        decode_gather: torch.Tensor,
        decode_mask: torch.Tensor,
        chunks: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward for a decode batch and prompt chunks together (the cache's write rows
        planned for all their tokens): `ids`, `positions` [tokens], the decode rows' tokens
        first, then each chunk's in order. `chunks`: (tokens, gather [1, columns], causal mask
        [1, 1, tokens, columns]) of each. The projections and the MLP run once over all tokens;
        attention runs per part (the decode rows batched, each chunk causal over its own
        columns). Returns the decode rows' logits [decode_rows, vocab] and each chunk's last
        logits [chunks, vocab]."""
        tokens = ids.shape[0]
        rows = decode_rows
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        cos = self.cos[positions][:, None, :]  # [tokens, 1, dim]
        sin = self.sin[positions][:, None, :]
        kv = self.kv
        x = F.embedding(ids, self.embed)
        for index, (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj) in enumerate(self.layers):
            if self.before_layer is not None:
                self.before_layer(index, x[:, None])
            qkv = qkv_proj(self._norm(x, ln1))
            qk = self._rotate(qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, dim)
            kv.write_tokens(index, k, v)
            parts: list[torch.Tensor] = []
            if rows:
                keys, values = kv.gather(index, decode_gather)
                decoded = F.scaled_dot_product_attention(
                    q[:rows].view(rows, kv_heads, heads // kv_heads, dim),
                    keys,
                    values,
                    attn_mask=decode_mask,
                    scale=self.scaling,
                )
                parts.append(decoded.reshape(rows, q_size))
            offset = rows
            for n, gather, mask in chunks:
                keys, values = kv.gather(index, gather)
                chunked = F.scaled_dot_product_attention(
                    q[offset : offset + n].transpose(0, 1)[None],
                    keys,
                    values,
                    attn_mask=mask,
                    scale=self.scaling,
                    enable_gqa=heads != kv_heads,
                )
                parts.append(chunked[0].transpose(0, 1).reshape(n, q_size))
                offset += n
            x = o_proj.add(torch.cat(parts) if len(parts) > 1 else parts[0], x)
            gate_up = gate_up_proj(self._norm(x, ln2))
            x = down_proj.add(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], x)
        ends = torch.tensor([n for n, _, _ in chunks], device=x.device).cumsum(0) + rows - 1
        normed = self._norm(torch.cat((x[:rows], x[ends])), self.final_norm)
        logits = self.lm_head(normed)
        return logits[:rows], logits[rows:]

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states [rows, tokens, hidden] of a prefill forward (the KV
        cache's plan set, as for the HF forward). `ids`, `positions`: [rows,
        tokens]; `mask`: bool [rows, 1, tokens, columns read]."""
        rows, tokens = ids.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        cos = self.cos[positions][:, None]  # [rows, 1, tokens, dim]
        sin = self.sin[positions][:, None]
        kv = self.kv
        x = F.embedding(ids, self.embed).view(rows * tokens, self.hidden)
        for index, (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj) in enumerate(self.layers):
            if self.before_layer is not None:
                self.before_layer(index, x.view(rows, tokens, self.hidden))
            qkv = qkv_proj(self._norm(x, ln1)).view(rows, tokens, -1)
            q = self._rotate(qkv[..., :q_size].view(rows, tokens, heads, dim).transpose(1, 2), cos, sin)
            k = qkv[..., q_size : q_size + kv_size].view(rows, tokens, kv_heads, dim).transpose(1, 2)
            v = qkv[..., q_size + kv_size :].view(rows, tokens, kv_heads, dim).transpose(1, 2)
            keys, values = kv.update(self._rotate(k, cos, sin), v, index)
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=heads != kv_heads
            )
            x = o_proj.add(attn.transpose(1, 2).reshape(rows * tokens, q_size), x)
            gate_up = gate_up_proj(self._norm(x, ln2))
            x = down_proj.add(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], x)
        return self._norm(x, self.final_norm).view(rows, tokens, self.hidden)


def serving_logits(hf: Any, ids: list[int], device: torch.device) -> torch.Tensor | None:
    """The logits [tokens, vocab] of every position of `ids` through this forward (one row
    prefilled over a scratch pool of blocks), None where `supported` says it does not serve:
    the perplexity guard measures the forward that serves (services.inference.engine.quality)."""
    if supported(hf, device) is not None:
        return None
    block = 16
    blocks = -(-len(ids) // block) + 1  # and the null block
    dtype = getattr(hf, hf.base_model_prefix).embed_tokens.weight.dtype
    kv = PagedKVCache(hf.config, blocks, block, dtype, device)
    # A quantized model is measured with every call through its quantized kernel: what passes
    # is the quantized arithmetic itself, not the served dtype's matmul that long calls take.
    decoder = LlamaDecoder(hf, kv, 1, blocks * block, share_weights=False, quant_max_rows=math.inf)
    n = len(ids)
    rows = torch.arange(block, block + n, device=device)  # blocks 1.. in order
    kv.plan(rows, rows[None])
    positions = torch.arange(n, device=device)[None]
    mask = torch.ones((n, n), dtype=torch.bool, device=device).tril_()[None, None]
    hidden = decoder.prefill(torch.tensor([ids], device=device), positions, mask)
    return decoder.lm_head(hidden[0])
