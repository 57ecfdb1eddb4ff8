"""How a process hands memory back to the system.

glibc serves an allocation above its mmap threshold (128 KiB at start) with a mapping of its
own, unmapped when freed. But each time such a block is freed it raises the threshold to the
block's size (up to 32 MiB), so after the first few large requests every later megabyte-sized
buffer comes from the heap, whose free space glibc keeps: a process that received 8 MiB
messages grew by 80 MB and kept it. Setting the threshold fixes it and turns that adjustment
off, so large buffers are always mapped and always returned.

Only for processes whose large buffers are requests' bytes (the gateway): an engine allocating
and freeing megabyte tensors every step would pay a mapping and page faults for each.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("llmesh.memory")

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def map_large_buffers(threshold_bytes: int) -> bool:
    """Serves allocations of at least `threshold_bytes` with their own mappings, for good (glibc
    only; elsewhere, or with 0, nothing changes). True when the allocator took the setting."""
    if threshold_bytes <= 0:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        log.info("the C library has no mallopt: large buffers stay as its allocator places them")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))
