"""Writes to the model's own tensors that the trace cannot see.

The tracer turns a parameter or buffer read through a module attribute
(``self.conv.weight``) into a graph node, so an in-place write on it is a
node too. A tensor reached another way is the real tensor: ``for p in
self.teacher.parameters(): p.mul_(0.9).add_(0.1 * q)`` (a mean teacher's
EMA), ``self.fc.weight.data.clamp_(-c, c)``, a tensor kept in a Python list.
Symbolic tracing runs such a write once, for real, on the caller's model, and
records nothing: the compiled module would never update that tensor again,
and the caller's weights moved without a call.

:func:`refusing_hidden_writes` watches every torch call while the tracer
runs (a ``TorchFunctionMode``) and stops an in-place op on a real tensor that
shares storage with one of the model's parameters or buffers *before* it
writes. Raised inside a submodule, the tracer makes that submodule a leaf
(``tracer.py``): its stage calls it as eager does, so the write happens on
every call; raised in the root's own forward, the trace is refused naming the
tensor and the write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from crosscut.errors import TraceError

__all__ = ["HiddenWriteError", "refusing_hidden_writes"]

# Python's in-place operators on tensors; other dunders (``__init__``, ``__iter__``) read
_INPLACE_OPERATORS = "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift"
_INPLACE_DUNDERS = frozenset(f"__i{op}__" for op in _INPLACE_OPERATORS.split()) | {"__setitem__"}
# trailing underscore, but they change flags, not values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})


class HiddenWriteError(RuntimeError):
    """An in-place write on a model tensor the trace does not see (module docstring)."""

    def refusal(self, root: str) -> TraceError:
        """The error for a write in the root's own forward, where no leaf can keep it."""
        return TraceError(
            f"the root module {root}'s {self}: torch.fx would run it once while tracing and "
            "record nothing, so the compiled module would never write it again",
            value=root,
            remedy="update the tensor outside forward (a mean teacher's EMA: after "
            "optimizer.step()), write it through its module attribute "
            "(self.teacher.conv.weight.mul_(...)), which the trace records, or do it "
            "inside a submodule (crosscut keeps that submodule as a leaf, which runs it)",
        )


def _writes(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tensor ``func`` writes in place, or None."""
    if isinstance(kwargs.get("out"), Tensor):
        return kwargs["out"]
    name = getattr(func, "__name__", "")
    inplace = name in _INPLACE_DUNDERS or (
        name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES
    )
    return args[0] if inplace and args and isinstance(args[0], Tensor) else None


class _Watch(TorchFunctionMode):
    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        target = _writes(func, args, kwargs)
        if target is not None and target.device.type != "meta":
            key = self.names.get(target.untyped_storage().data_ptr())
            if key is not None:
                raise HiddenWriteError(
                    f"forward writes {key!r} in place ({getattr(func, '__name__', func)}) "
                    "through a tensor the trace does not see (reached by .parameters(), "
                    ".data or a Python reference, not a module attribute)"
                )
        return func(*args, **kwargs)


@contextmanager
def refusing_hidden_writes(model: nn.Module) -> Iterator[None]:
    """Stop in-place writes on ``model``'s real parameters and buffers while tracing."""
    names: dict[int, str] = {}
    for key, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "meta" and t.numel() > 0:
            names.setdefault(t.untyped_storage().data_ptr(), key)
    with _Watch(names):
        yield
