"""Whether a leaf module runs torch's own forward, so that a rule about its type holds.

Several passes reason about a traced leaf by its type alone: codegen/width.py
slices a ``Conv2d``'s filters into per-device shards and runs a ``ReLU`` shard
by shard, ``partitioner/shard.py`` prices the same, and the row probe
(``row_probe.py``) skips a convolution as computing each sample alone. That
holds only while the module computes what its class computes:

* a subclass may override ``forward``; a parametrized module
  (``torch.nn.utils.parametrize``) is a generated subclass whose weight is made
  from the whole parameter (spectral norm divides by the largest singular
  value of the whole matrix, so a shard of it is not the shard's weight);
* a forward or backward hook runs on whatever the module produced there: a
  hook that normalises over channels sees one shard's channels, one that
  subtracts a batch mean sees one share's rows.

So such rules ask :func:`stock_module` first, and a module that fails it is
treated as an opaque op: run whole, probed by running it.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["stock_module"]

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def stock_module(mod: nn.Module, types: Collection[type]) -> bool:
    """True when ``mod``'s type is exactly one of ``types`` and no hook changes its forward."""
    if type(mod) not in types:
        return False
    own = (mod._forward_hooks, mod._forward_pre_hooks, mod._backward_hooks)
    pre = getattr(mod, "_backward_pre_hooks", {})
    return not any(own) and not pre and not any(getattr(_module, h, {}) for h in _GLOBAL_HOOKS)
