"""``torch.autocast`` inside a forward, which torch.fx does not record.

Symbolic tracing runs the forward's Python once. A ``with torch.autocast(...)``
block (or an ``@torch.autocast`` decorator) really switches autocast while its
ops are recorded, but the graph has no node for it: the compiled module would
run those ops in the precision around it (fp32, or the whole-model autocast
of ``precision="bf16"``), not in the one the forward asked for, and give
other values than eager with no error (a convolution under bf16 autocast:
outputs off by 1e-4, weights by 6e-3 after one step).

:func:`refusing_autocast` watches every entry into an autocast context while
the tracer runs and refuses the model where the graph would drop one: a
region that turns autocast on, and, under crosscut's own mixed precision, a
region that turns it off (without it the region's ops run in fp32 as the
forward said, because nothing is autocast). Running a recorded region under
its own autocast would need every op wrapped on every stage; until then the
error names the way that works: crosscut's ``precision`` option.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from crosscut.errors import TraceError

__all__ = ["refusing_autocast"]

_DEVICE_TYPES = ("cpu", "cuda")
# the watch patches a class method: one trace at a time, or two threads' restores interleave
_WATCH = threading.RLock()


@contextmanager
def refusing_autocast(precision: str) -> Iterator[None]:
    """Trace with no ambient autocast; raise a TraceError for regions the graph drops."""
    with _WATCH, _watching_entries() as entered:
        yield
    lost = [e for e in entered if e[1] or precision != "fp32"]
    if lost:
        raise TraceError(
            "forward enters torch.autocast, which torch.fx does not record: compiled, the "
            "region's ops would run in another precision than eager's, with other values",
            value=[f"autocast({d!r}, enabled={on}, dtype={t})" for d, on, t in lost],
            remedy="take autocast out of forward and compile with precision='bf16' or "
            "'fp16' (crosscut runs every stage under autocast), or with precision='fp32' "
            "for a region that only turns autocast off",
        )


@contextmanager
def _watching_entries() -> Iterator[list[tuple[str, bool, str]]]:
    cls = torch.amp.autocast_mode.autocast
    original = cls.__enter__
    entered: list[tuple[str, bool, str]] = []

    def watching(self: Any) -> Any:
        entered.append((str(self.device), bool(self._enabled), str(self.fast_dtype)))
        return original(self)  # type: ignore[no-untyped-call]

    ambient = [torch.autocast(d, enabled=False) for d in _DEVICE_TYPES]
    for ctx in ambient:  # a caller compiling inside autocast: the trace sees none of it
        ctx.__enter__()  # type: ignore[no-untyped-call]
    cls.__enter__ = watching  # type: ignore[method-assign]
    try:
        yield entered
    finally:
        cls.__enter__ = original  # type: ignore[method-assign]
        for ctx in reversed(ambient):
            ctx.__exit__(None, None, None)
