"""Opt-in weight quantization (LLMESH_QUANTIZE) for the builtin engine.

int8: weight-only, symmetric, one scale per output channel, on torch's own int8-weight matmul
kernel (`aten._weight_int8pack_mm`, the kernel torchao's int8 weight-only path uses).
Activations stay in the served dtype, so there is no activation outlier problem (the reason
naive dynamic int8 wrecks small models); the only error is the weights' rounding. Every
nn.Linear of the model is replaced (a tied lm_head gets its own int8 copy).

That kernel is a matrix-vector kernel: on the 2-core EPYC it beats bf16's GEMM for one or two
rows and loses from about four rows on (at 32 rows it takes about 1.7x as long). So each layer
keeps its bf16 weight too and multiplies with int8 only for calls of at most `INT8_MAX_ROWS`
rows (single-stream decode), bf16 otherwise (prefill, batched decode): int8 costs 1.5x the
weights' memory and buys speed where one stream decodes alone, never loses it at batch 32.
The perplexity guard (services/inference/engine/quality.py) measures with every call forced through
int8 (`int8_everywhere`), so what passes is the int8 arithmetic itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("none", "int8")
#: Calls with at most this many rows (tokens) use the int8 kernel; larger ones the bf16 weight.
INT8_MAX_ROWS = 2


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (int8 weight * per-channel scale).T + bias for small calls, x @ weight.T + bias
    (the served dtype's weight) for large ones."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        as_float = weight.float()
        scales = as_float.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        quantized = torch.round(as_float / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.int8_max_rows: float = INT8_MAX_ROWS
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_int8", quantized.contiguous())
        self.register_buffer("scales", scales.to(weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.shape[0] > self.int8_max_rows:
            return F.linear(x, self.weight, self.bias)
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), self.weight_int8, scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def quantize_model(model: Any, method: str) -> Any:
    """Replaces the model's nn.Linear layers in place (the model already in its served dtype)."""
    if method not in QUANTIZATIONS[1:]:
        raise ValueError(f"unknown quantization {method!r}; expected one of {', '.join(QUANTIZATIONS)}")
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8WeightOnlyLinear(module))
    return model


@contextlib.contextmanager
def int8_everywhere(model: Any) -> Iterator[None]:
    """Every call of every int8 layer through the int8 kernel (the perplexity guard's measure)."""
    layers = [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    for layer in layers:
        layer.int8_max_rows = math.inf
    try:
        yield
    finally:
        for layer in layers:
            layer.int8_max_rows = INT8_MAX_ROWS
