"""Weight quantization (LLMESH_QUANTIZE) for the builtin engine: int8 and int4, weight-only.

Activations stay in the served dtype, so there is no activation outlier problem (the reason
naive dynamic int8 wrecks small models); the only error is the weights' rounding. Both run on
kernels torch ships for the CPU (the ones torchao's weight-only paths call):

* int8: symmetric, one scale per output channel, `aten._weight_int8pack_mm`;
* int4: asymmetric, one scale and one offset per group of `INT4_GROUP` input columns (the LM
  head int8: `HEAD_QUANTIZATION`),
  `aten._weight_int4pack_mm_for_cpu` over weights packed once at load
  (`aten._convert_weight_to_int4pack_for_cpu`). SmolLM2's weights come from a Q4_1 GGUF
  (asymmetric 4-bit groups of 32: min and step per group), so min/max groups of 32 recover the
  shipped 4-bit values: int4 serves the file llmesh ships, not a second rounding of it.

These kernels read a quarter (int8) or an eighth (int4) of float32's bytes and win where a step
reads every weight for a few rows (one stream decoding); over many rows the bf16/fp32 GEMM wins
(measured by `python -m bench.decode_step --kernels`). So a quantized layer keeps the served
dtype's weight too and multiplies through the quantized kernel only for calls of at most
`max_rows` rows (`QUANT_MAX_ROWS`): quantization costs extra memory and buys speed where one
stream decodes, and never loses it at batch 32. The quality guard (services/inference/engine/quality.py)
measures with every call forced through the quantized kernel (`quantized_everywhere`), so what
passes is the quantized arithmetic itself.

The engine's own Llama forward (engine/llama.py) fuses q/k/v and gate/up and quantizes the fused
weights with the same `QuantizedWeight` (per-row scales and groups: fusing changes no number);
`QuantizedLinear` is what other architectures' transformers forward runs.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("none", "int8", "int4")
#: LLMESH_QUANTIZE's values: a method, or auto (`auto_quantization`).
QUANTIZE_AUTO = "auto"
#: Calls with at most this many rows (tokens) use the quantized kernel; larger ones the served
#: dtype's weight (measured on the 2-core EPYC: bench.decode_step --kernels).
QUANT_MAX_ROWS = {"int8": 4, "int4": 4}
#: What the LM head (output embeddings) is quantized to under each method. With int4 it takes
#: int8: GGUF files keep the embeddings (tied to the head in small Llamas) above 4 bits (SmolLM2's
#: Q4_1 file does), and 4-bit groups of them cost SmolLM2 +9.6% perplexity and 0.85 top-1
#: agreement with float32 (measured); int8 keeps the head within the guard's bounds.
HEAD_QUANTIZATION = {"int8": "int8", "int4": "int8"}
#: Input columns per int4 scale/offset (Q4_1's block).
INT4_GROUP = 32
#: The quantized kernels' activation dtype, whatever the model serves in: their float32 variants
#: run 3-10x slower on AVX2 (measured), and a few rows' cast is cheap. A float32 model with
#: quantized weights so computes its matmuls' products in bfloat16 (the guard measures it so).
COMPUTE_DTYPE = torch.bfloat16


#: LLMESH_QUANTIZE=auto: quantize to int4 where the weights came from a file that held them in
#: this many bits or fewer (the manifest's source conversion, "gguf Q4_1 -> float32").
AUTO_INT4_SOURCE_BITS = 4


def source_bits(manifest: dict[str, Any]) -> int | None:
    """The bits per weight of the file the model was converted from ("gguf Q4_1 -> ..." gives 4),
    None where the manifest does not say (weights shipped as they are served)."""
    source = manifest.get("source")
    conversion = source.get("conversion", "") if isinstance(source, dict) else ""
    match = re.match(r"gguf (?:I?Q)(\d+)", conversion) if isinstance(conversion, str) else None
    return int(match.group(1)) if match else None


def auto_quantization(manifest: dict[str, Any], device: torch.device) -> str:
    """What LLMESH_QUANTIZE=auto serves: int4 on CPU for weights converted from a 4-bit file,
    else none. Such weights are 4-bit values already (min/max groups of 32 recover Q4_1's), so
    int4 rounds nothing away the shipped file had, and one stream decodes 1.6-1.8x faster than
    bfloat16 through the mesh (bench/results/engine.json); calls of more rows than
    QUANT_MAX_ROWS keep the served dtype's matmul, so batches lose nothing. Any other model
    keeps its weights unless LLMESH_QUANTIZE names a method."""
    bits = source_bits(manifest)
    if device.type != "cpu" or bits is None or bits > AUTO_INT4_SOURCE_BITS:
        return "none"
    return "int4" if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else "none"


def int4_supported(in_features: int) -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and in_features % INT4_GROUP == 0


class QuantizedWeight:
    """A [out, in] weight in int8 or int4 for `x @ W^T` (x: [rows, in], in the served dtype)."""

    def __init__(self, weight: torch.Tensor, method: str) -> None:
        if method not in QUANTIZATIONS[1:]:
            raise ValueError(f"unknown quantization {method!r}; expected one of {', '.join(QUANTIZATIONS)}")
        self.method = method
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        as_float = weight.detach().float()
        if method == "int8":
            scales = as_float.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            self.data = torch.round(as_float / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scales = scales.to(COMPUTE_DTYPE)
        else:
            if not int4_supported(self.in_features):
                raise ValueError(f"int4 needs torch's CPU int4 kernel and in_features % {INT4_GROUP} == 0")
            out, cols = weight.shape
            groups = as_float.view(out, cols // INT4_GROUP, INT4_GROUP)
            low, high = groups.amin(-1), groups.amax(-1)
            step = ((high - low) / 15.0).clamp(min=1e-12)
            q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view(out, cols)
            self.data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            # The kernel's convention: w = (q - 8) * scale + zero, [groups, out, 2] of (scale, zero).
            self.scales = torch.stack((step, low + 8.0 * step), -1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out], in x's dtype (computed in `COMPUTE_DTYPE`)."""
        h = x.to(COMPUTE_DTYPE).contiguous()
        if self.method == "int8":
            out = torch.ops.aten._weight_int8pack_mm(h, self.data, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(h, self.data, INT4_GROUP, self.scales)
        return out.to(x.dtype)


class QuantizedLinear(nn.Module):
    """y = x @ quantized(W).T + bias for calls of at most `max_rows` rows, x @ W.T + bias (the
    served dtype's weight) for larger ones."""

    def __init__(self, linear: nn.Linear, method: str) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.method = method
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.max_rows: float = QUANT_MAX_ROWS[method]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.quantized = QuantizedWeight(weight, method)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        out = self.quantized(flat)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def quantizable(model: Any, method: str) -> str | None:
    """None when every nn.Linear of the model can take `method`, else why not."""
    if method == "int4":
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not int4_supported(module.in_features):
                return f"{name}: {module.in_features} input columns (int4 groups of {INT4_GROUP})"
    return None


def quantize_model(model: Any, method: str) -> Any:
    """Replaces the model's nn.Linear layers in place (the model already in its served dtype)."""
    if method not in QUANTIZATIONS[1:]:
        raise ValueError(f"unknown quantization {method!r}; expected one of {', '.join(QUANTIZATIONS)}")
    why_not = quantizable(model, method)
    if why_not is not None:
        raise ValueError(f"cannot quantize to {method}: {why_not}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(module, HEAD_QUANTIZATION[method] if module is head else method))
    return model


@contextlib.contextmanager
def quantized_everywhere(model: Any) -> Iterator[None]:
    """Every call of every quantized layer through the quantized kernel (the guard's measure)."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.max_rows = math.inf
    try:
        yield
    finally:
        for layer in layers:
            layer.max_rows = QUANT_MAX_ROWS[layer.method]
