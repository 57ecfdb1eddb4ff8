"""What the hardware computes natively, and the dtype the inference engine serves in.

The rule (LLMESH_DTYPE=auto): on CUDA bf16, fp16 where the GPU has no bf16; on CPU bf16 where
the processor has native bf16 instructions (AVX512_BF16 or AMX-BF16), fp32 otherwise. Native
bf16 is detected, never guessed: torch's own CPU capability checks (the cpuinfo library, which
also checks that the OS enabled the registers) where torch has them, then the kernel's CPU
flags in /proc/cpuinfo. Without native bf16, torch emulates bf16 matmuls through fp32 and bf16
is slower than fp32, so fp32 it is.

torch is imported inside the functions: the gateway imports `llmesh` without needing torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: LLMESH_DTYPE values (besides auto) and their torch names.
DTYPES = ("float32", "bfloat16", "float16")
#: /proc/cpuinfo flags that mean native bf16 arithmetic.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU feature flags the kernel reports (first `flags` line); empty where unreadable."""
    try:
        with cpuinfo.open() as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _torch_cpu_check(name: str) -> bool | None:
    """torch.cpu's private capability probe `name`, None where this torch has none."""
    import torch

    probe = getattr(torch.cpu, name, None)
    if probe is None:
        return None
    try:
        return bool(probe())
    except Exception:
        return None


@dataclass(frozen=True)
class CpuBf16:
    native: bool
    #: How it was found out, for the startup log and `llmesh` notes.
    evidence: str


@functools.cache
def cpu_native_bf16() -> CpuBf16:
    """Whether this CPU does bf16 arithmetic natively (AVX512_BF16 or AMX-BF16)."""
    avx512_bf16 = _torch_cpu_check("_is_avx512_bf16_supported")
    amx = _torch_cpu_check("_is_amx_tile_supported")
    if avx512_bf16 or amx:
        found = "AVX512_BF16" if avx512_bf16 else "AMX"
        return CpuBf16(True, f"{found} (torch.cpu capability check)")
    flags = cpu_flags()
    present = [f for f in BF16_CPU_FLAGS if f in flags]
    if present:
        return CpuBf16(True, f"{', '.join(present)} (/proc/cpuinfo flags)")
    if avx512_bf16 is not None or flags:
        return CpuBf16(False, "no avx512_bf16/amx_bf16 on this CPU")
    return CpuBf16(False, "CPU features unknown (no torch.cpu check, no /proc/cpuinfo flags)")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: Any  # torch.dtype
    #: True when LLMESH_DTYPE named the dtype; False when the hardware rule picked it.
    explicit: bool
    reason: str

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 -> "bfloat16" (the name ModelInfo.dtype and cache keys carry)."""
    return str(dtype).removeprefix("torch.")


def choose_dtype(device: Any, requested: str = "auto") -> DtypeChoice:
    """The dtype to serve in on `device` (a torch.device); `requested` is LLMESH_DTYPE."""
    import torch

    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {requested!r}")
        return DtypeChoice(getattr(torch, requested), True, f"LLMESH_DTYPE={requested}")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, False, "CUDA with bf16")
        return DtypeChoice(torch.float16, False, "CUDA without bf16")
    if device.type == "cpu":
        bf16 = cpu_native_bf16()
        if bf16.native:
            return DtypeChoice(torch.bfloat16, False, f"CPU with native bf16: {bf16.evidence}")
        return DtypeChoice(torch.float32, False, f"CPU without native bf16: {bf16.evidence}")
    return DtypeChoice(torch.float32, False, f"{device.type}: float32")
