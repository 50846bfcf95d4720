"""Python-level state a forward changes: refused by name, and given back to the caller.

The trace turns tensor work into graph nodes, buffers included (a counter
``self.calls.add_(1)`` is a node that runs on every call). Python code runs
once, while tracing: ``self.step += 1`` bumps an int attribute then, and the
graph holds the value it had at that moment as a constant — the compiled
module would compute with it frozen, call after call, where eager counts.
Rebinding a buffer (``self.calls = self.calls + 1``) is the same thing for a
tensor: the new tensor is a graph value, not state the stages own, so nothing
would carry it from one call to the next.

No rewrite reproduces these, so :func:`refusing_python_state` wraps the
trace: it records every module's attributes (their identity) and buffer
bindings, and afterwards — also when the trace failed on the rebinding
itself — puts them back as they were (the caller's model is left unchanged)
and raises :class:`~crosscut.errors.TraceError` naming the first one that
changed, with the remedy: hold the state in a buffer updated in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from crosscut.errors import TraceError

__all__ = ["refusing_python_state"]

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None))


def _attributes(m: nn.Module) -> dict[str, Any]:
    """A module's own Python attributes (torch's bookkeeping and ``training`` aside)."""
    return {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return type(a) is type(b) and isinstance(a, _IMMUTABLE) and bool(a == b)


def _changes(
    model: nn.Module, saved: list[tuple[str, nn.Module, dict[str, Any], dict[str, Any]]]
) -> list[tuple[str, str]]:
    """``(key, kind)`` for each attribute or buffer binding that moved, in module order."""
    out: list[tuple[str, str]] = []
    for path, m, attrs, buffers in saved:
        prefix = f"{path}." if path else ""
        now = _attributes(m)
        for k in sorted(set(attrs) | set(now)):
            if k not in now or k not in attrs or not _same(attrs[k], now[k]):
                out.append((prefix + k, "attribute"))
        for k in sorted(set(buffers) | set(m._buffers)):
            if buffers.get(k) is not m._buffers.get(k):
                out.append((prefix + k, "buffer"))
    return out


def _refusal(key: str, kind: str, every: list[str]) -> TraceError:
    if kind == "buffer":
        return TraceError(
            f"forward rebinds buffer {key!r} (self.{key.rpartition('.')[2]} = ...): the traced "
            "graph computes the new tensor but no stage owns it, so the next call would start "
            "from the old value again",
            value={"rebound": every},
            remedy=f"update the buffer in place: self.{key.rpartition('.')[2]}.add_(1), "
            ".copy_(new_value), .mul_(...) (crosscut traces in-place writes to buffers)",
        )
    return TraceError(
        f"forward changes the Python attribute {key!r}: tracing runs Python code once, so "
        "the compiled module would keep the value it had while tracing, frozen, where eager "
        "changes it on every call",
        value={"changed": every},
        remedy="keep the value in a buffer updated in place (self.register_buffer('step', "
        "torch.zeros((), dtype=torch.long)) and self.step.add_(1) in forward), or change "
        "the attribute outside forward",
    )


@contextmanager
def refusing_python_state(model: nn.Module) -> Iterator[None]:
    """Refuse (and undo) Python attributes and buffer bindings the traced forward changed."""
    saved = [(path, m, _attributes(m), dict(m._buffers)) for path, m in model.named_modules()]
    failure: BaseException | None = None
    try:
        yield
    except Exception as exc:  # the rebinding may itself be what failed the trace
        failure = exc
    moved = _changes(model, saved)
    for _, m, attrs, buffers in saved:  # the caller's model as it was
        for k in [k for k in _attributes(m) if k not in attrs]:
            del vars(m)[k]
        vars(m).update(attrs)
        m._buffers.clear()
        m._buffers.update(buffers)
    if moved:
        key, kind = moved[0]
        raise _refusal(key, kind, [k for k, _ in moved]) from failure
    if failure is not None:
        raise failure
