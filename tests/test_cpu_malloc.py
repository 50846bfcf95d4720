"""crosscut keeps freed CPU memory in its processes (``crosscut/cpu_malloc.py``).

Why it matters: glibc gives large freed blocks back to the kernel and a fresh
process then page-faults them in again every step; a CPU profile taken that way
priced zero-bubble's weight-gradient pass 30 % slower than the pipeline ranks ran
it. These tests check the setting's effect on glibc itself (a 20 MiB block comes
from the heap, not from a fresh mapping), its off switch, and that the profiler
and the local runtime apply it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import crosscut
from crosscut.cost_models import profiled
from crosscut.frontend.tracer import trace
from crosscut.runtime.local import compiled

_LIBC = ctypes.util.find_library("c")
glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or _LIBC is None
    or not hasattr(ctypes.CDLL(_LIBC), "mallinfo2"),
    reason="needs glibc 2.33+ (mallinfo2) to observe where malloc puts a block",
)

_PROBE = textwrap.dedent(
    """
    import ctypes, sys
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    from crosscut.cpu_malloc import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(20 << 20)
    grown = libc.mallinfo2().hblkhd - before
    libc.free(block)
    print(kept, grown)
    """
)


def _probe(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return out[0], int(out[1])


@glibc
def test_a_large_block_comes_from_the_heap_once_memory_is_kept() -> None:
    """By default glibc maps a 20 MiB block afresh (and unmaps it on free); after
    ``keep_freed_memory`` it comes from the heap, where a freed block stays."""
    assert _probe("default")[1] >= 20 << 20  # a mapping of its own, header page included
    assert _probe("keep") == ("True", 0)


@glibc
def test_crosscut_cpu_malloc_0_turns_it_off() -> None:
    kept, grown = _probe("keep", CROSSCUT_CPU_MALLOC="0")
    assert kept == "False" and grown >= 20 << 20


def test_the_profiler_and_the_local_runtime_keep_freed_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prices and steps must see one allocator: a CPU profile and a local compile with a
    CPU device both set it."""
    calls: list[str] = []
    monkeypatch.setattr(profiled, "keep_freed_memory", lambda: calls.append("profile"))
    monkeypatch.setattr(compiled, "keep_freed_memory", lambda: calls.append("runtime"))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    profiled.profile_costs(trace(model, x), "cpu", repeats=1, warmup=0, cache_dir=None)
    crosscut.compile(model, ["cpu", "cpu"], x, microbatches=2, replicas=1)
    assert calls[0] == "profile" and "runtime" in calls
