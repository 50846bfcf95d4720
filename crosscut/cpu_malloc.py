"""Keep freed CPU memory in the process, so a step does not page-fault its buffers back.

Why: glibc's malloc gives large blocks back to the kernel when they are freed
(``munmap``, or trimming the top of the heap) and its thresholds for doing so move
with the process's history. A training step frees and reallocates the same
tensors every iteration; each time memory went back, the next step faults every
page in again. On dev-2c this made one thread's ResNet-18 weight-gradient pass
(``W`` of a zero-bubble schedule) 30 % slower in a fresh profiling process than
in a pipeline rank that had held more memory (docs/BENCHMARKS.md), so the
profile priced zero bubble slower than it ran, and 1F1B steps themselves ran
15-20 % faster once memory was kept.

:func:`keep_freed_memory` sets glibc's trim threshold to 1 GiB and its mmap
threshold to its maximum (32 MiB), which also stops their drift; it is what
PyTorch's caching allocator does on a GPU, and what jemalloc or tcmalloc give a
CPU process. crosscut calls it where it profiles or runs on the CPU
(``cost_models.profiled.profile_costs``, ``crosscut.distributed.init`` with
gloo), so prices and steps see the same allocator. The benchmarks call it in
every baseline they compare against, so a comparison stays fair.
``CROSSCUT_CPU_MALLOC=0`` turns it off. Where the C library is not glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

ENV = "CROSSCUT_CPU_MALLOC"
TRIM_THRESHOLD = 1 << 30  # free memory above the heap's top kept up to 1 GiB
MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value (HEAP_MAX_SIZE / 2 on 64-bit)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True where they are set (now or before).

    False where the C library is not glibc, where ``CROSSCUT_CPU_MALLOC=0``, or where
    ``mallopt`` refused."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return False
        trimmed = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        mapped = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except OSError:
        return False
    _done = bool(trimmed) and bool(mapped)
    return _done
