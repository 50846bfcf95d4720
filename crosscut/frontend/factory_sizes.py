"""Tensor factories given a traced size one dimension at a time (``torch.zeros(x.size(0), 4)``).

torch's argument parser takes ``torch.zeros(b, 4)``'s sizes as Python integers and
rejects a torch.fx Proxy among them ("zeros() takes 1 positional argument but 2
were given") before torch's function dispatch could hand the call to fx; the same
sizes as one tuple, ``torch.zeros((b, 4))``, are traced. So a CNN that builds a
per-sample tensor from its batch size (a zero state, a noise tensor, a mask) made
the whole trace fail at its root.

While tracing, :func:`packing_factory_sizes` puts a wrapper in front of the
factories that take sizes as varargs: a call whose sizes hold a Proxy is made
with the sizes packed into one tuple, which is the same call; every other call
goes through untouched. The graph then records the factory with the traced size,
so each micro-batch and replica share builds its own.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx

__all__ = ["FACTORIES", "packing_factory_sizes"]

# torch functions whose leading positional arguments may be the sizes, one per dimension
FACTORIES = ("zeros", "ones", "empty", "rand", "randn")

_LOCK = threading.RLock()  # the wrappers replace torch's attributes: one trace at a time


def _packing(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def call(*size: Any, **kwargs: Any) -> Any:
        if len(size) > 1 and any(isinstance(s, torch.fx.Proxy) for s in size):
            return factory(tuple(size), **kwargs)
        return factory(*size, **kwargs)

    return call


@contextmanager
def packing_factory_sizes() -> Iterator[None]:
    """Trace ``torch.zeros(b, 4)`` as ``torch.zeros((b, 4))`` where ``b`` is traced."""
    with _LOCK:
        originals = {name: getattr(torch, name) for name in FACTORIES}
        for name, factory in originals.items():
            setattr(torch, name, _packing(factory))
        try:
            yield
        finally:
            for name, factory in originals.items():
                setattr(torch, name, factory)
