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

Hooks and the trace. A leaf module keeps all of its hooks: the stage calls
it, on real tensors, on every call. A module traced through loses them: fx
runs its forward hooks once, on Proxies, while tracing, and records only
their tensor ops — a hook that keeps features (``feats.append(out)``), counts
calls or logs statistics got Proxies at compile time and nothing after — and
it is never called in backward, so its backward hooks never run. So the
tracer makes every submodule with a hook of its own a leaf (:func:`hooked`).
What no leaf can keep is refused (:func:`refuse_lost_hooks`): the root's hooks
(fx calls its ``forward`` itself) and global hooks. A global forward hook runs
on every module call in eager; compiled, it would run once per traced-through
module on Proxies, then only on the leaves and on crosscut's own stage modules.
Compiled, such a model would silently train (or record) differently.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import fx, nn
from torch.nn.modules import module as _module

from crosscut.errors import TraceError

__all__ = ["backward_hooked", "hooked", "refuse_lost_hooks", "stock_module"]

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


def backward_hooked(mod: nn.Module) -> bool:
    """Whether ``mod`` has a backward hook of its own: it must be called, as a leaf."""
    return bool(mod._backward_hooks or getattr(mod, "_backward_pre_hooks", {}))


def hooked(mod: nn.Module) -> bool:
    """Whether ``mod`` has a hook of its own (forward, forward-pre or backward): it must
    be called as a module, a leaf, for the hook to run on every call (module docstring)."""
    return bool(mod._forward_hooks or mod._forward_pre_hooks or backward_hooked(mod))


def refuse_lost_hooks(model: nn.Module, gm: fx.GraphModule) -> None:
    """Raise a TraceError for hooks the traced graph would drop (module docstring)."""
    lost = []
    if model._forward_hooks or model._forward_pre_hooks:
        lost.append(f"forward hook on the root module {type(model).__name__}")
    leaves = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for path, mod in model.named_modules():
        if not backward_hooked(mod):
            continue
        parts = path.split(".")
        if not any(".".join(parts[:k]) in leaves for k in range(1, len(parts) + 1)):
            lost.append(f"backward hook on {path or 'the root module'}")
    if any(getattr(_module, h, {}) for h in _GLOBAL_HOOKS[:2]):
        lost.append("a global module forward hook (register_module_forward_hook or _pre_hook)")
    if any(getattr(_module, h, {}) for h in _GLOBAL_HOOKS[2:]):
        lost.append("a global module backward hook (register_module_full_backward_hook)")
    if lost:
        raise TraceError(
            "the traced graph cannot keep these hooks: fx never runs the root module's "
            "forward hooks, and a module traced through is not called in backward, so its "
            "backward hooks would not run; compiled, the model would train differently",
            value=lost,
            remedy="apply the hook's change inside forward (or to the input before the "
            "call), or register it on a submodule (one with a backward hook runs whole)",
        )
