"""Custom ``torch.autograd.Function`` calls, whose backward torch.fx does not record.

Symbolic tracing hands proxies to ``Function.apply``, which finds no tensor
among its arguments and just calls the class's ``forward``: the graph gets
the forward's ops and autograd later differentiates those, never the
class's own ``backward``. A gradient reversal layer (forward ``x.view_as(x)``,
backward ``-g``) then trains the other way, and the reentrant
``torch.utils.checkpoint`` (a Function whose forward runs the block under
``no_grad``) loses every gradient of the block: weights off by 1e2 after one
step, with no error.

So, while tracing, :func:`tracing_autograd_functions` puts a check in front
of ``Function.apply``:

* the reentrant checkpoint is traced as the call it stands for,
  ``function(*args)``: checkpointing changes memory, not values or
  gradients, and crosscut chooses its own recomputation per stage;
* any other Function called on traced values raises. Inside a submodule the
  tracer makes that submodule a leaf (``tracer.py``), which the stage calls
  as eager does, so the class's backward runs; in the root's own forward the
  trace is refused with the Function's name.

Calls on real tensors (the row probe, other threads) pass through unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten

from crosscut.errors import TraceError

__all__ = ["OpaqueFunctionError", "tracing_autograd_functions"]

# the check replaces a class attribute: one trace at a time, or two restores interleave
_LOCK = threading.RLock()


class OpaqueFunctionError(RuntimeError):
    """A custom autograd Function was called on traced values (module docstring)."""

    def refusal(self, root: str) -> TraceError:
        """The error for a call in the root's own forward, where no leaf can keep it."""
        return TraceError(
            f"the root module {root}'s {self}: compiled, its gradients would be autograd's "
            "through the forward's ops, not the Function's",
            value=root,
            remedy="call the Function inside a submodule (crosscut keeps a submodule that "
            "calls one as a leaf, so its backward runs)",
        )


@contextmanager
def tracing_autograd_functions() -> Iterator[None]:
    """Trace through the reentrant checkpoint; raise on any other custom Function."""
    base = torch.autograd.function.Function
    original = base.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, torch.fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
            return original.__get__(None, cls)(*args, **kwargs)
        if cls is torch.utils.checkpoint.CheckpointFunction:
            function, _preserve_rng_state, *inputs = args
            return function(*inputs)
        raise OpaqueFunctionError(
            f"forward calls the custom autograd Function {cls.__qualname__}, whose backward "
            "torch.fx does not record"
        )

    with _LOCK:
        base.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
        try:
            yield
        finally:
            base.apply = original  # type: ignore[method-assign]
