"""Keep freed CPU memory in the process, so a step does not page-fault its buffers back.

Why: glibc's malloc gives large blocks back to the kernel when they are freed, and
the next step faults every page in again. A page fault costs about 1.8 µs per 4 KiB
page on dev-2c (a VM), about 2.3 GB/s, ten times slower than writing memory that is
already mapped. glibc gives memory back three ways:

* **a block of its own** (``mmap``) for each allocation above the mmap threshold,
  unmapped on free. The threshold's largest accepted value is 32 MiB, so a tensor
  above it (VGG-11's 392 MiB classifier weight gradient, the first activations of a
  ResNet-50 at batch 32) is mapped and faulted afresh every step;
* **trimming** the top of the heap once more than the trim threshold is free there;
* **per-thread arenas**: each thread (the local runtime's one worker per device)
  gets heaps of its own, at most 64 MiB each.

Two settings, chosen by ``CROSSCUT_CPU_MALLOC``:

* **thresholds** (the default; ``1`` or unset): a 1 GiB trim threshold and the
  largest mmap threshold, 32 MiB. Blocks up to 32 MiB stay in the heap and are
  reused; larger ones are still mapped afresh. A process's memory stays what its
  live tensors need.
* **kept** (``CROSSCUT_CPU_MALLOC=kept``): no block mapped on its own
  (``M_MMAP_MAX`` 0), the heap never trimmed (``M_TRIM_THRESHOLD`` -1), one arena
  for every thread (``M_ARENA_MAX`` 1). Measured on dev-2c (``benchmarks/page_faults.py``,
  one thread, batch 8), against thresholds: eager VGG-11-BN at 64 px went from
  116,749 faults and 791 ms a step to 0 and 595 ms, MobileNetV2 at 224 px from 18,819
  and 532 ms to 0 and 490 ms; crosscut's local runtime on two CPU devices ran
  VGG-11-BN's step 1.49x faster. The cost is memory, and it is why this is not the
  default. Large blocks then share the heap with small ones and fragment it, and
  PyTorch's 64-byte aligned requests are padded beyond a block just freed. A
  training loop settles within a few steps (peak +31 % on VGG-11-BN's local
  runtime, -5 to +3 % elsewhere), but a process that runs varied work grows: a test
  session's workers reached 9-14 GiB within single tests (7.5 under thresholds), and
  one was killed for memory. So under kept each :func:`keep_freed_memory` call also
  gives the free heap back (``malloc_trim(0)``, as ``torch.cuda.empty_cache`` on a
  GPU), and :func:`release_freed_memory` does it alone.

``0`` turns both off (glibc's defaults). crosscut calls :func:`keep_freed_memory`
where it profiles or runs on the CPU (``cost_models.profiled.profile_costs``, the
local runtime, ``crosscut.distributed.init`` with gloo), so prices and steps see the
same allocator; the benchmarks call it in every baseline they compare against, so a
comparison stays fair. Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from crosscut.errors import InputError

__all__ = ["ENV", "SETTINGS", "keep_freed_memory", "mode", "release_freed_memory"]

ENV = "CROSSCUT_CPU_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -3, -4, -8  # <malloc.h>
# mode -> [(mallopt parameter, value)]
SETTINGS: dict[str, list[tuple[int, int]]] = {
    "thresholds": [(_M_TRIM_THRESHOLD, 1 << 30), (_M_MMAP_THRESHOLD, 32 << 20)],
    "kept": [(_M_TRIM_THRESHOLD, -1), (_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1)],
}

_done: bool | None = None
_libc: ctypes.CDLL | None = None
_kept = False  # the mode set was kept


def mode() -> str:
    """The setting ``CROSSCUT_CPU_MALLOC`` asks for: ``"off"``, ``"thresholds"`` or
    ``"kept"``; an unknown value raises InputError naming the accepted ones."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value == "0":
        return "off"
    if value in ("", "1", "thresholds"):
        return "thresholds"
    if value == "kept":
        return "kept"
    raise InputError(
        f"{ENV} must be 0 (off), 1 or thresholds (the default), or kept",
        value=value,
        remedy=f"unset {ENV}, or set it to one of those",
    )


def keep_freed_memory() -> bool:
    """Set glibc's malloc parameters once per process (the mode ``CROSSCUT_CPU_MALLOC``
    names); True where they are set (now or before). Under kept, every call (not only
    the first) also gives the free heap back, where crosscut calls it: a job's start
    (a profile, a compile, a rank's init).

    False where the C library is not glibc, where ``CROSSCUT_CPU_MALLOC=0``, or where
    ``mallopt`` refused a parameter. Threads started before the first call keep the
    arenas they already have; crosscut calls it before it starts its own."""
    global _done, _libc, _kept
    if _done is None:
        chosen = mode()
        _done, _libc = _configure(chosen)
        _kept = _done and chosen == "kept"
    release_freed_memory()
    return _done


def release_freed_memory() -> bool:
    """Under kept, give the free part of the heap back to the kernel (``malloc_trim(0)``);
    True where it gave any back. A long-lived process that runs many jobs between
    crosscut's calls (a test session, after each test) can call it."""
    return bool(_kept and _libc is not None and _libc.malloc_trim(0))


def _configure(chosen: str) -> tuple[bool, ctypes.CDLL | None]:
    if chosen == "off" or not sys.platform.startswith("linux"):
        return False, None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
            return False, None
        accepted = [libc.mallopt(param, value) for param, value in SETTINGS[chosen]]
    except OSError:
        return False, None
    return all(accepted), libc
