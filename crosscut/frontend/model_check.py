"""What a model must be before it is traced: an ``nn.Module`` whose tensors exist.

A lazy module (``nn.LazyConv2d``, ``nn.LazyLinear``, ...) has no parameter
shapes until its first call. Tracing reads every parameter's size to price
it, and torch refuses that on an uninitialised one, which surfaced from deep
inside the cost model as if crosscut had failed. Torch's own rule is the
remedy: call the model once on an example batch, which materialises them.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from crosscut.errors import InputError

__all__ = ["check_model"]


def check_model(model: Any) -> None:
    """Raise an InputError unless ``model`` is an ``nn.Module`` with every tensor made."""
    if not isinstance(model, nn.Module):
        raise InputError(
            "trace() needs a torch.nn.Module",
            value=type(model).__name__,
            remedy="pass the model object itself (e.g. torchvision.models.resnet50(weights=None))",
        )
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if is_lazy(t)]
    if lazy:
        raise InputError(
            f"the model has {len(lazy)} uninitialised lazy parameters or buffers (a "
            "LazyConv2d, LazyLinear, ...): their shapes are not known until the model "
            "runs once, and crosscut prices every parameter by its size",
            value=lazy[:8],
            remedy="call the model once on an example batch before compiling "
            "(model(x) materialises them, as torch requires before any other use)",
        )
