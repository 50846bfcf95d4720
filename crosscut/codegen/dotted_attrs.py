"""Dotted-name attribute access on modules, shared by the stage and width rewrites.

Both ``split.py`` (inlining ``get_attr`` tensors into the stage that reads
them) and ``width.py`` (copying them into a rewritten stage) must put a tensor
at a qualified name such as ``layer1.0.weight`` in a module that may not have
the parents yet, as a parameter, a buffer or a plain attribute as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["get_attr", "set_attr"]


def set_attr(root: nn.Module, qualname: str, value: Any) -> None:
    """Register ``value`` at dotted ``qualname`` under ``root``, creating parents."""
    *path, leaf = qualname.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(leaf, value)
    else:
        setattr(mod, leaf, value)


def get_attr(root: nn.Module, qualname: str) -> Any:
    """The object at dotted ``qualname`` under ``root``."""
    obj: Any = root
    for p in qualname.split("."):
        obj = getattr(obj, p)
    return obj
