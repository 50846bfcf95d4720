"""This thread's draw key: which (call seed, micro-batch) random ops draw for.

A leaf module with no crosscut imports, because two modules read it: the
seeded random ops of :mod:`crosscut.runtime.rng` draw from the key, and
:class:`~crosscut.runtime.thread_state.ThreadState` carries it to the threads
that run part of a stage (batch-split shares), which
:mod:`crosscut.runtime.share_threads` in turn enters. ``rng`` imports
``share_threads`` and ``share_threads`` imports ``thread_state``; keeping the
key in ``rng`` would close that into a circle.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["current_key", "draw_scope"]

_scope = threading.local()


def current_key() -> tuple[int, int] | None:
    """This thread's (call seed, micro-batch), for threads that run part of its work."""
    key: tuple[int, int] | None = getattr(_scope, "key", None)
    return key


@contextmanager
def draw_scope(key: tuple[int, int] | None) -> Iterator[None]:
    """Run random ops from (call seed, micro-batch, op) seeds; ``None``: no re-seeding."""
    saved = getattr(_scope, "key", None)
    _scope.key = key
    try:
        yield
    finally:
        _scope.key = saved
