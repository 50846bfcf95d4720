"""crosscut keeps freed CPU memory in its processes (``crosscut/cpu_malloc.py``).

Why it matters: glibc gives large freed blocks back to the kernel and a fresh
process then page-faults them in again every step; a CPU profile taken that way
priced zero-bubble's weight-gradient pass 30 % slower than the pipeline ranks ran
it, and VGG-11's 392 MiB gradients cost its steps 1.2 GB of page faults each.
These tests check each setting's effect on glibc itself (a block below glibc's
32 MiB mmap cap comes from the heap; under kept, one above it too, a freed
1.5 GiB stays until the next job, a worker thread's block is reused without
faults), its off switch, and that the profiler and the local runtime apply it.
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

# glibc's own account of its heap (mallinfo2), and keep_freed_memory, in a fresh process.
_LIBC_HEADER = textwrap.dedent(
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
    """
)

_PROBE = _LIBC_HEADER + textwrap.dedent(
    """
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    size = int(sys.argv[2]) << 20
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    grown = libc.mallinfo2().hblkhd - before
    libc.free(block)
    print(kept, grown)
    """
)

# A 1.5 GiB block freed at the top of the heap: how much of the heap glibc kept, then
# how much after the next keep_freed_memory call (a job's start), and after another such
# block and release_freed_memory. Not written to, so it
# costs address space, not memory.
_TRIM_PROBE = _LIBC_HEADER + textwrap.dedent(
    """
    if sys.argv[1] == "keep":
        keep_freed_memory()
    from crosscut.cpu_malloc import release_freed_memory
    before = libc.mallinfo2().arena
    libc.free(libc.malloc(3 << 29))
    kept = libc.mallinfo2().arena - before
    keep_freed_memory()
    after_keep = libc.mallinfo2().arena - before
    libc.free(libc.malloc(3 << 29))
    release_freed_memory()
    print(kept, after_keep, libc.mallinfo2().arena - before)
    """
)

# Page faults of a worker thread's last two "steps", each of which allocates three 64 MiB
# tensors and frees them, as the local runtime's threads allocate a step's buffers again
# every step. (A block freed alone is not always reused at once: PyTorch asks for 64-byte
# aligned blocks, and glibc pads such a request beyond the block it just freed until
# neighbouring free blocks have merged. Here that settles after three or four steps.)
_THREAD_PROBE = textwrap.dedent(
    """
    import resource, sys, threading, torch
    from crosscut.cpu_malloc import keep_freed_memory
    if sys.argv[1] == "keep":
        keep_freed_memory()
    faults = []
    def work():
        for _ in range(8):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step = [torch.empty(16 << 20).fill_(1.0) for _ in range(3)]
            del step
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(max(faults[-2:]))
    """
)


def _run(probe: str, *args: str, **env: str) -> list[str]:
    return subprocess.run(
        [sys.executable, "-c", probe, *args],
        env={**os.environ, "CROSSCUT_CPU_MALLOC": "1", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()


def _probe(mode: str, mib: int = 20, **env: str) -> tuple[str, int]:
    out = _run(_PROBE, mode, str(mib), **env)
    return out[0], int(out[1])


@glibc
def test_a_large_block_comes_from_the_heap_once_memory_is_kept() -> None:
    """By default glibc maps a 20 MiB block afresh (and unmaps it on free); after
    ``keep_freed_memory`` it comes from the heap, where a freed block stays."""
    assert _probe("default")[1] >= 20 << 20  # a mapping of its own, header page included
    assert _probe("keep") == ("True", 0)  # the default setting: thresholds
    assert _probe("keep", CROSSCUT_CPU_MALLOC="kept") == ("True", 0)


@glibc
def test_a_block_above_glibcs_mmap_cap_comes_from_the_heap_too() -> None:
    """glibc's mmap threshold cannot go above 32 MiB, so under the default setting a
    64 MiB block is mapped (and faulted) afresh every time; kept turns mapping off."""
    assert _probe("default", mib=64)[1] >= 64 << 20
    assert _probe("keep", mib=64)[1] >= 64 << 20  # thresholds: above 32 MiB still mapped
    assert _probe("keep", mib=64, CROSSCUT_CPU_MALLOC="kept") == ("True", 0)


@glibc
def test_a_large_block_freed_at_the_heaps_top_stays_until_the_next_job() -> None:
    """Under kept, what trimming gave back every step (VGG-11's freed gradients) stays. What is
    kept goes back at the next job's start: a test session kept it all, and its
    worker was killed for memory."""
    assert int(_run(_TRIM_PROBE, "default")[0]) < 1 << 30  # trimmed
    probe = _run(_TRIM_PROBE, "keep", CROSSCUT_CPU_MALLOC="kept")
    kept, after_keep, after_release = (int(v) for v in probe)
    assert kept >= 3 << 29 and after_keep < 1 << 30 and after_release < 1 << 30


@glibc
def test_a_worker_threads_tensor_is_reused_without_page_faults() -> None:
    """A thread's own arena holds at most 64 MiB heaps; under kept, with one arena, its blocks come
    from the main heap and are reused: a 64 MiB tensor is 16,384 pages."""
    assert int(_run(_THREAD_PROBE, "default")[0]) >= 3 * 16_000
    assert int(_run(_THREAD_PROBE, "keep", CROSSCUT_CPU_MALLOC="kept")[0]) < 1_000


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


def test_an_unknown_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from crosscut.cpu_malloc import mode

    for value, chosen in (("0", "off"), ("1", "thresholds"), ("kept", "kept"), ("", "thresholds")):
        monkeypatch.setenv("CROSSCUT_CPU_MALLOC", value)
        assert mode() == chosen
    monkeypatch.setenv("CROSSCUT_CPU_MALLOC", "always")
    with pytest.raises(ValueError, match=r"CROSSCUT_CPU_MALLOC must be .*kept.*always"):
        mode()
