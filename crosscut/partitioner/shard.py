"""How each traced node behaves in a channel-split stage (for the cost model).

``codegen/width.py`` decides for real, op by op, when it rewrites a stage; this
is the same classification ahead of time, from the OpGraph, so the solver can
price a channel split: ``split`` nodes (``Conv2d`` with ``groups == 1``,
``Linear``) need their whole input and make channel shards, ``channel`` nodes
(batch norm, activations, pooling, element-wise arithmetic) work shard by
shard, and every other node (``full``) runs whole on the group's leader. A
module counts as its class only as torch's own class without hooks
(``frontend/stock.py``).
Dropout is ``full`` on purpose: it must draw eager mode's random numbers.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from crosscut.ir.graph import OpGraph, OpNode

__all__ = ["shard_kind"]

_CHANNEL_MODULES = (
    "ReLU",
    "ReLU6",
    "LeakyReLU",
    "SiLU",
    "GELU",
    "Sigmoid",
    "Tanh",
    "Hardswish",
    "Hardsigmoid",
    "ELU",
    "Identity",
    "MaxPool2d",
    "AvgPool2d",
    "AdaptiveAvgPool2d",
    "AdaptiveMaxPool2d",
    "BatchNorm2d",
)
_CHANNEL_FUNCTIONS = {
    "add",
    "iadd",
    "mul",
    "imul",
    "relu",
    "relu_",
    "relu6",
    "sigmoid",
    "tanh",
    "silu",
    "hardswish",
    "adaptive_avg_pool2d",
    "max_pool2d",
    "avg_pool2d",
}


def _channels(node: OpNode) -> int:
    shape = node.shapes[0] if node.shapes else []
    return int(shape[1]) if len(shape) > 1 else 0


@cache
def _channel_types() -> frozenset[type]:
    """torch's own classes that work shard by shard.

    Imported here, not at the top: the viewers import the planner's modules, and
    a plan is read and drawn without torch (tests/test_viz.py holds that).
    """
    from torch import nn

    return frozenset(getattr(nn, name) for name in _CHANNEL_MODULES)


def shard_kind(graph: OpGraph, node: OpNode) -> tuple[str, int]:
    """``(kind, output channels)`` of ``node``; kind is "split", "channel" or "full"."""
    if node.op == "call_module" and graph.gm is not None:
        # torch's own classes, without hooks (frontend/stock.py): a subclass or a hook
        # may mix channels, and codegen/width.py then runs the module whole
        from torch import nn

        from crosscut.frontend.stock import stock_module

        try:
            mod: Any = graph.gm.get_submodule(node.target)
        except AttributeError:
            return "full", 0
        if stock_module(mod, (nn.Conv2d,)) and mod.groups == 1:
            return "split", int(mod.out_channels)
        if stock_module(mod, (nn.Linear,)):
            return "split", int(mod.out_features)
        if stock_module(mod, _channel_types()):
            return "channel", _channels(node)
        return "full", 0
    if node.op in ("call_function", "call_method"):
        leaf = node.target.rsplit(".", 1)[-1]
        if node.kind in _CHANNEL_FUNCTIONS or leaf in _CHANNEL_FUNCTIONS:
            return "channel", _channels(node)
    return "full", 0
