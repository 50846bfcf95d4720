"""Tensor hooks registered inside a forward (``y.register_hook(fn)``), which torch.fx
does not record.

A hook on a tensor is backward code: it rescales, clips or records the gradient
that flows through that tensor (a gradient-scaling layer, Grad-CAM's
``self.gradients = g``). Symbolic tracing runs the forward once on proxies, so a
registration there is either refused by fx (a bound method as an argument:
``argument of type: <class 'method'>``, which says nothing of hooks) or, where
fx could record the call, ties the compiled module's backward to a function fx
cannot save or print.

So while tracing, a ``register_hook`` (or ``register_post_accumulate_grad_hook``)
call on a traced value raises :class:`TensorHookError`. Inside a submodule the
tracer makes that submodule a leaf (``tracer.py``), which the stage calls as
eager does: the hook is registered on every call, on each micro-batch's tensor,
and runs in the backward (shape propagation runs such a leaf with autograd on:
``propagate.py``). In the root's own forward no leaf can keep it, and the trace
is refused by name, with that remedy.
"""

from __future__ import annotations

from typing import Any

from crosscut.errors import TraceError

__all__ = ["HOOK_METHODS", "TensorHookError", "check_tensor_hook"]

# Tensor methods that attach backward code to a tensor.
HOOK_METHODS = frozenset({"register_hook", "register_post_accumulate_grad_hook"})


class TensorHookError(RuntimeError):
    """A forward registered a hook on a traced tensor (module docstring)."""

    def refusal(self, root: str) -> TraceError:
        """The error for a registration in the root's own forward, where no leaf keeps it."""
        return TraceError(
            f"the root module {root}'s {self}: compiled, the hook would never be registered "
            "and the gradient it changes or records would differ from eager",
            value=root,
            remedy="register the hook inside a submodule's forward (crosscut keeps that "
            "submodule whole as a leaf, so the hook is registered on every call), or use "
            "register_full_backward_hook on a submodule",
        )


def check_tensor_hook(kind: str, target: Any) -> None:
    """Raise :class:`TensorHookError` for a traced call that registers a tensor hook."""
    if kind == "call_method" and target in HOOK_METHODS:
        raise TensorHookError(
            f"forward calls Tensor.{target}(...) on a traced value: a backward hook "
            "torch.fx does not record"
        )
