"""One persistent thread per device: the runtime's only thread facility.

Mariana binds one CPU thread to each GPU, and so does crosscut: the local
executor runs each pipeline stage's schedule row on one :class:`DeviceThread`,
and a batch-split stage drives each of its other group devices from one
(:class:`~crosscut.runtime.batch_split.BatchSplitStage`). Both need the same
few things, written once here: a queue of jobs, each job's value or
exception handed back to the caller's thread (never lost in the worker), a
stop that does not deadlock when called from the thread itself, and — on
CUDA — a compute stream and a copy stream owned by the thread's device.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeviceThread", "JobResult", "stop_threads"]


class DeviceThread:
    """A persistent daemon thread that runs one share at a time for one group device.

    Holds no reference to the stage module, so a dropped stage can be
    collected (its finaliser stops the thread). The job carries everything a
    share needs; thread-local torch state (grad mode, current CUDA device and
    streams) is set by the job itself.
    """

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        """``device``: a CUDA device gets a compute and a copy stream (``None`` elsewhere)."""
        self.name = name
        self.device = device
        self.compute: Any = None
        self.copy: Any = None
        if device is not None and device.type == "cuda":
            self.compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.copy = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.jobs: queue.Queue[tuple[Callable[[], Any], JobResult] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            fn, result = item
            try:
                result.value = fn()
            except BaseException as exc:  # re-raised on the caller's thread
                result.error = exc
            finally:
                result.done.set()

    def submit(self, fn: Callable[[], Any]) -> JobResult:
        """Queue ``fn``; its value or exception lands in the returned result."""
        result = JobResult()
        self.jobs.put((fn, result))
        return result

    def stop(self) -> None:
        """Ask the thread to finish after its queued jobs; wait briefly unless it is us."""
        self.jobs.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)


class JobResult:
    """The outcome of one job: its value or its exception, and when it is done."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def stop_threads(threads: list[DeviceThread]) -> None:
    """Stop every thread (a stage's finaliser: holds the threads, never the stage)."""
    for t in threads:
        t.stop()
