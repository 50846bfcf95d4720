"""Keep freed CPU memory in the process, so a step does not page-fault its buffers back.

Why: glibc's malloc gives large blocks back to the kernel when they are freed, and
the next step faults every page in again. A page fault costs about 1.8 µs per 4 KiB
page on dev-2c (a VM), about 2.3 GB/s, ten times slower than writing memory that is
already mapped. glibc gives memory back three ways, and each one has cost a
training step:

* **a block of its own** (``mmap``) for each allocation above the mmap threshold,
  unmapped on free. The threshold's largest accepted value is 32 MiB, so a tensor
  above it (VGG-11's 392 MiB classifier weight gradient, the first activations of a
  ResNet-50 at batch 32) is mapped and faulted afresh every step;
* **trimming** the top of the heap once more than the trim threshold is free there:
  VGG-11's three 392 MiB blocks, freed at the end of each step, went back to the
  kernel with a 1 GiB threshold (1.2 GB faulted per step);
* **per-thread arenas**: each thread (the local runtime's one worker per device)
  gets heaps of its own, at most 64 MiB each, which cannot hold such a block either.

:func:`keep_freed_memory` therefore turns all three off: no block is mapped on its
own (``M_MMAP_MAX`` 0, so every block comes from the heap), the heap is never trimmed
(``M_TRIM_THRESHOLD`` -1), and every thread allocates from the one main heap
(``M_ARENA_MAX`` 1). Measured on dev-2c (one thread, batch 8,
``benchmarks/page_faults.py``), against the trim and mmap thresholds it set before:
eager VGG-11-BN at 64 px went from 116,749 faults and 791 ms a step to 0 and 595 ms,
MobileNetV2 at 224 px from 18,819 and 532 ms to 0 and 490 ms; crosscut's local
runtime on two CPU devices ran VGG-11-BN's step 1.49x faster. The cost is memory:
what a process freed stays resident until the next call, and PyTorch's 64-byte aligned
requests are padded beyond a block just freed, so the heap grows for a few steps
until freed neighbours merge. Peak resident memory moved by -5 to +3 % on
MobileNetV2 and ResNet-50, and by +31 % (3.7 to 4.9 GiB) on the local runtime's
VGG-11-BN. This is what PyTorch's caching allocator does on a GPU, and what
jemalloc or tcmalloc give a CPU process. Like ``torch.cuda.empty_cache``, each call
of :func:`keep_freed_memory` gives the free part back: ten models trained in turn in
one process, calling it before each, held 0.84-2.73 GiB after each (what the last one
left), against 0.86-1.44 GiB under the old thresholds (``page_faults.py --sequence``).

crosscut calls it where it profiles or runs on the CPU
(``cost_models.profiled.profile_costs``, the local runtime, ``crosscut.distributed.init``
with gloo), so prices and steps see the same allocator. The benchmarks call it in
every baseline they compare against, so a comparison stays fair.
``CROSSCUT_CPU_MALLOC=0`` turns it off. Where the C library is not glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["ENV", "SETTINGS", "keep_freed_memory", "release_freed_memory"]

ENV = "CROSSCUT_CPU_MALLOC"
# <malloc.h> parameter -> value: never trim the heap, map no block on its own, one arena.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
SETTINGS: dict[str, tuple[int, int]] = {
    "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, -1),
    "M_MMAP_MAX": (_M_MMAP_MAX, 0),
    "M_ARENA_MAX": (_M_ARENA_MAX, 1),
}

_done: bool | None = None
_libc: ctypes.CDLL | None = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc parameters once per process, and give back what is free now;
    True where the parameters are set (now or before).

    Each call (not only the first) also returns to the kernel the memory the process
    has freed so far (``malloc_trim(0)``): crosscut calls it where one job starts (a
    profile, a compile, a rank's init), so the heap kept for one model's steps does
    not stay with a long-lived process (a notebook, a test session) for every model
    after it. Kept alone, a test session's worker grew past 7 GiB and was killed for
    memory.

    False where the C library is not glibc, where ``CROSSCUT_CPU_MALLOC=0``, or where
    ``mallopt`` refused one of them. Threads started before the first call keep the
    arenas they already have; crosscut calls it before it starts its own."""
    global _done, _libc
    if _done is None:
        _done, _libc = _configure()
    release_freed_memory()
    return _done


def release_freed_memory() -> bool:
    """Give the free part of the heap back to the kernel (``malloc_trim(0)``) where
    :func:`keep_freed_memory` has set the parameters; True where it gave any back. A
    long-lived process that runs many jobs between crosscut's calls (a test session
    after each test) can call it, as ``torch.cuda.empty_cache`` on a GPU."""
    return bool(_done and _libc is not None and _libc.malloc_trim(0))


def _configure() -> tuple[bool, ctypes.CDLL | None]:
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False, None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
            return False, None
        accepted = [libc.mallopt(param, value) for param, value in SETTINGS.values()]
    except OSError:
        return False, None
    return all(accepted), libc
