"""Python's and NumPy's random draws, replayed when a stage recomputes.

crosscut replays torch's random ops under recomputation (``runtime/rng.py``),
but a leaf module may draw from Python's ``random`` or NumPy's global generator
(stochastic depth written as ``if random.random() < self.p``: a leaf because its
forward branches on data, so the trace left it whole). Recomputed, such a leaf
would draw again and get other numbers: the block dropped in the first pass and
kept in the recomputation. Checkpoint then fails ("a different number of tensors
was saved"), or, where both branches save as many tensors, backpropagates through
a forward that never produced the output: wrong gradients, silently.

So while a recomputing stage runs its first pass, :func:`recording` keeps every
value this thread draws from those generators, and the recomputation
(:func:`replaying`) is handed the same values in the same order. The module
functions are wrapped only while a stage records or replays (counted, under a
lock), and the wrappers pass straight through on every other thread: a stage on
another worker thread, or the caller's own code, draws as it always does.

A generator object of the model's own (``self.rng = random.Random(0)``) is covered
through its class: every ``random.Random`` method draws through two primitives,
``random()`` and ``getrandbits()``, which are wrapped on the class, so the object's
draws are replayed and its state moves on once. A draw inside a wrapped draw
(``random.uniform`` calls ``self.random()``) belongs to the outer one and passes
straight through. NumPy's ``Generator`` objects cannot be wrapped (their type is
immutable) and are not covered.
"""

from __future__ import annotations

import copy
import random
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

__all__ = ["recording", "replaying"]

# the draws that return their numbers (an in-place shuffle is not replayed)
_PYTHON = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "gauss",
           "normalvariate", "lognormvariate", "betavariate", "expovariate", "triangular",
           "vonmisesvariate", "gammavariate", "paretovariate", "weibullvariate")  # fmt: skip
_NUMPY = ("rand", "randn", "random", "random_sample", "uniform", "randint", "choice",
          "binomial", "normal", "beta", "permutation", "poisson", "exponential")  # fmt: skip

# ``random.Random``'s primitives, wrapped on the class (module docstring)
_PRIMITIVES = ("random", "getrandbits")

_local = threading.local()  # .log: list of values; .at: position, or None when recording;
# .inside: a wrapped draw is running on this thread (a draw within it is its own business)
_lock = threading.Lock()
_users = 0
_originals: list[tuple[Any, str, Callable[..., Any] | None]] = []


def _wrapped(draw: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        log: list[Any] | None = getattr(_local, "log", None)
        if log is None or getattr(_local, "inside", False):
            return draw(*args, **kwargs)
        at: int | None = getattr(_local, "at", None)
        if at is not None and at < len(log):  # replaying the first pass's value
            _local.at = at + 1
            return copy.deepcopy(log[at])
        _local.inside = True
        try:
            value = draw(*args, **kwargs)
        finally:
            _local.inside = False
        if at is None:
            log.append(copy.deepcopy(value))
        return value

    return wrapper


def _targets() -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = [(random, name) for name in _PYTHON]
    out += [(random.Random, name) for name in _PRIMITIVES]
    np_random = getattr(sys.modules.get("numpy"), "random", None)  # only if already imported
    if np_random is not None:
        out += [(np_random, name) for name in _NUMPY if hasattr(np_random, name)]
    return out


@contextmanager
def _wrapping() -> Iterator[None]:
    global _users
    with _lock:
        if _users == 0:
            for module, name in _targets():
                original = getattr(module, name)
                own = name in vars(module)  # a class's inherited method is deleted after
                _originals.append((module, name, original if own else None))
                setattr(module, name, _wrapped(original))
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                while _originals:
                    module, name, original = _originals.pop()
                    if original is None:
                        delattr(module, name)
                    else:
                        setattr(module, name, original)


@contextmanager
def _on_this_thread(log: list[Any], at: int | None) -> Iterator[None]:
    saved = getattr(_local, "log", None), getattr(_local, "at", None)
    _local.log, _local.at = log, at
    try:
        with _wrapping():
            yield
    finally:
        _local.log, _local.at = saved


def recording(log: list[Any]) -> AbstractContextManager[None]:
    """Append every Python or NumPy draw this thread makes inside to ``log``."""
    return _on_this_thread(log, None)


def replaying(log: list[Any]) -> AbstractContextManager[None]:
    """Hand this thread's draws inside the values of ``log``, in order (then draw anew)."""
    return _on_this_thread(log, 0)
