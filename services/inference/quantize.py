"""Opt-in weight quantization (LLMESH_QUANTIZE) for the builtin engine.

int8: weight-only, symmetric, one scale per output channel, on torch's own int8-weight matmul
kernel (`aten._weight_int8pack_mm`, the kernel torchao's int8 weight-only path uses).
Activations stay in the served dtype, so there is no activation outlier problem (the reason
naive dynamic int8 wrecks small models); the only error is the weights' rounding. Every
nn.Linear of the decoder is replaced; the embedding table stays as it is and a tied lm_head
gets its own int8 copy. Like any non-float32 serving it must pass the perplexity guard
(services/inference/quality.py) at load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8")


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (int8 weight * per-channel scale).T + bias, in x's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("weight_int8", quantized.contiguous())
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, scales)
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
