"""Order a graph's nodes by stage before splitting it.

``torch.fx.passes.split_module(..., keep_original_order=True)`` emits the call
of each stage at the position of that stage's first node in the graph. When a
plan puts a branch that comes early in fx order on a *later* stage (a solver is
free to: only edges must go forward), that stage would be called before the
values it reads exist. Sorting the nodes stably by (stage, original position)
is always a valid topological order — every edge goes from a stage to itself or
a later one — and makes the emitted stage calls follow the pipeline order.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from torch import fx

__all__ = ["order_by_stage"]

_FIXED = ("placeholder", "get_attr", "output")


def order_by_stage(gm: fx.GraphModule, stage_of: Mapping[str, int]) -> None:
    """Reorder ``gm``'s nodes in place: inputs and attributes, then stage 0, 1, ..., output."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    head = [n for n in nodes if n.op == "placeholder"]
    attrs = [n for n in nodes if n.op == "get_attr"]
    body = sorted(
        (n for n in nodes if n.op not in _FIXED),
        key=lambda n: (stage_of[n.name], position[n]),
    )
    order = head + attrs + body + [n for n in nodes if n.op == "output"]
    if order == nodes:
        return
    for prev, node in itertools.pairwise(order):
        prev.append(node)  # moves ``node`` to just after ``prev``
    gm.graph.lint()
    gm.recompile()
