"""``torch.no_grad()`` blocks in a forward, which torch.fx does not record.

Symbolic tracing runs the forward's Python once; a ``with torch.no_grad():``
block really disables grad mode while its ops are recorded, but the graph has
no node for it, so the traced module runs those ops WITH autograd. The usual
victim is a buffer updated in forward (an EMA ``self.avg.mul_(0.9).add_(0.1 *
y.mean(0))`` under ``no_grad``): traced, the buffer joins the autograd graph
of the call, and the next call's backward walks into the previous, freed one
("Trying to backward through the graph a second time"); and a value computed
under ``no_grad`` would pass gradients that eager never computes.

So the tracer marks every node created while grad mode is off
(:data:`NO_GRAD`), and :func:`detach_no_grad` makes each such node read its
inputs through :func:`detached`, and so does every reader of such a node's
result (a leaf module run under ``no_grad`` still has parameters that want
gradients) (``detach()`` on every tensor, containers
included): it then computes the same values with no autograd history, as in
eager (a write through ``x.detach()`` changes ``x``'s storage without
recording, exactly what a write under ``no_grad`` does).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, fx
from torch.utils._pytree import tree_map

__all__ = ["NO_GRAD", "detach_no_grad", "detached"]

NO_GRAD = "crosscut_no_grad"  # meta: the node was traced inside torch.no_grad()


def detached(x: Any) -> Any:
    """``x`` with every tensor in it detached (shares storage, no autograd history)."""
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, x)


def detach_no_grad(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place so nodes traced under ``no_grad`` see detached inputs.

    Returns the number of :func:`detached` nodes inserted (0 for a model without
    ``no_grad`` blocks: the graph is untouched).
    """
    made: dict[fx.Node, fx.Node] = {}
    count = 0
    for n in list(gm.graph.nodes):
        if n.op in ("placeholder", "get_attr") or n in made.values():
            continue
        for a in n.all_input_nodes:
            computed_without_grad = a.meta.get(NO_GRAD) and a.op not in ("placeholder", "get_attr")
            if not (n.meta.get(NO_GRAD) or computed_without_grad):
                continue
            if a not in made:
                with gm.graph.inserting_after(a):
                    made[a] = gm.graph.call_function(detached, (a,))
                made[a].meta[NO_GRAD] = True
                count += 1
            n.replace_input_with(a, made[a])
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
