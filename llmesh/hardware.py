"""What the processor can do, read from the kernel rather than guessed.

bf16 is only fast where the CPU computes it natively (AVX-512 BF16 or AMX); elsewhere torch
emulates it and it is slower than fp32, so the dtype choice hangs on these flags.
"""

from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of the first processor in /proc/cpuinfo (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether matrix products in bf16 run natively on this CPU (AVX-512 BF16 or AMX)."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))
