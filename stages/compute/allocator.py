"""Keep a stage process's freed memory for reuse instead of handing it back to the kernel.

A training step allocates and frees the same activation and gradient buffers every
micro-batch (megabytes each). glibc serves large blocks with fresh ``mmap`` calls
and trims freed heap memory back to the kernel, so each micro-batch page-faults its
buffers in again, zero-filled, a few thousand faults per micro-batch on the reference
workload. Raising the mmap and trim thresholds makes the heap keep those pages, which
is what torch's own GPU caching allocator (and jemalloc or tcmalloc, which CPU
training guides preload for the same reason) achieve. The cost is that a stage's
resident memory stays at its high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["keep_freed_memory"]

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to serve blocks under 32 MiB from the heap and to keep up to
    1 GiB of freed memory; returns False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.info("mallopt refused the allocator settings; freed memory goes back to the kernel")
    return ok
