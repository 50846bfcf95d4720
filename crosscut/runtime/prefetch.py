"""Input prefetch: Mariana's three-stage I/O pipeline, in one background thread.

While the model computes batch ``i``, a background thread takes batch
``i+1`` from the loader (whose own DataLoader workers are already reading
batch ``i+2``), applies ``preprocess``, pins it (only when CUDA is
available and the target is a CUDA device) and copies it to the first
stage's device — ``non_blocking`` on a side stream for CUDA, with an event the
consumer's stream waits on. ``depth`` bounds how many ready batches wait.

Batches come out in loader order; an exception raised by the loader or by
``preprocess`` is re-raised from ``next()`` in the caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from crosscut.errors import InputError

__all__ = ["Prefetcher"]

_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _target_device(compiled_or_device: Any) -> torch.device:
    program = getattr(compiled_or_device, "program", None)
    if program is not None:
        return torch.device(program.stages[0].device)
    return torch.device(compiled_or_device)


class Prefetcher:
    """Iterate ``loader`` with preprocessing and device copies overlapped with compute."""

    def __init__(
        self,
        loader: Iterable[Any],
        compiled_or_device: Any,
        *,
        preprocess: Callable[[Any], Any] | None = None,
        depth: int = 2,
    ) -> None:
        if depth < 1:
            raise InputError("depth must be >= 1", value=depth, remedy="use 1 or 2")
        self.loader = loader
        self.device = _target_device(compiled_or_device)
        self.preprocess = preprocess
        self.depth = depth
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._stream: Any = (
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self._cuda
            else None
        )

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _prepare(self, batch: Any) -> tuple[Any, Any]:
        if self.preprocess is not None:
            batch = self.preprocess(batch)
        if not self._cuda:
            moved = pytree.tree_map(
                lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, batch
            )
            return moved, None
        with torch.cuda.stream(self._stream):
            moved = pytree.tree_map(
                lambda t: (
                    t.pin_memory().to(self.device, non_blocking=True)
                    if isinstance(t, torch.Tensor)
                    else t
                ),
                batch,
            )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return moved, event

    def __iter__(self) -> Iterator[Any]:
        q: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for batch in self.loader:
                    if not put(self._prepare(batch)):
                        return
                put(_END)
            except BaseException as exc:
                put(_Failure(exc))

        thread = threading.Thread(target=produce, name="crosscut-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                batch, event = item
                if event is not None:
                    torch.cuda.current_stream(self.device).wait_event(event)
                    pytree.tree_map(
                        lambda t: (
                            t.record_stream(torch.cuda.current_stream(self.device))
                            if isinstance(t, torch.Tensor)
                            else None
                        ),
                        batch,
                    )
                yield batch
        finally:
            stop.set()
            thread.join(timeout=5)
