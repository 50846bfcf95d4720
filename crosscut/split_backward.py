"""A stage's backward in two passes: input gradients now (``B``), weight gradients later (``W``).

Why: in a pipeline only the gradients a stage sends upstream are on the
critical path; its weight gradients are needed at the end of the step. A
zero-bubble schedule (``ir/schedule.py``: ``zb-h1``) runs the first part as
soon as the gradients arrive and the second where the stage would idle.

How, with the same numbers as one backward: autograd runs only the edges a
call needs. ``B`` is ``torch.autograd.backward(roots, inputs=received
leaves, retain_graph=True)``: a convolution's node then computes its data
gradient and skips its weight gradient. The nodes where the two parts meet
— *weight nodes*: nodes on a path to a received leaf with an edge into a
subgraph that reaches only other leaves (parameters, directly or through a
view or a cast) — are found by walking the graph once, and a pre-hook
records the gradients each is handed in ``B``. ``W`` restarts every weight
node from exactly those gradients (``GradientEdge`` roots) with its
parameter leaves as ``inputs``, so autograd runs the node again for the
weight edges only and accumulates through the parameters' own
``AccumulateGrad`` (layout, hooks and micro-batch order as in eager).
Each node computes each of its outputs from the same gradient and saved
tensors as in one backward, so the results are bit-for-bit the same
(``tests/test_split_backward.py`` checks it against one backward on model
families, with recomputation and shared weights).

When the walk cannot split a backward safely, ``B`` runs the whole backward
and ``W`` does nothing — always correct, only not earlier:

* a parameter region reached from two weight nodes (a weight used twice:
  restarting both would double or reorder its accumulation), or from a weight
  node and a stage output (a value the stage both uses and sends on, computed
  from parameters and inputs that need no gradient);
* a root that is itself a leaf.

A stage with no received leaf that needs a gradient (the first stage) has
nothing to send: ``B`` is empty and ``W`` runs its whole backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightPass", "backward_input", "backward_weight", "weight_steps"]


@dataclass
class _Item:
    """One weight node (or a root of a parameter-only output) and what W starts it from."""

    node: Node
    leaves: list[torch.Tensor]
    grads: tuple[torch.Tensor | None, ...] = ()


@dataclass
class WeightPass:
    """What ``W`` still has to do for one micro-batch after ``B``."""

    items: list[_Item] = field(default_factory=list)
    whole: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None  # deferred


def _post_order(starts: Sequence[Node]) -> list[Node]:
    """Every node reachable from ``starts``, children before parents."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(n, False) for n in starts]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in seen)
    return order


def _region(start: Node, owner: dict[Node, int], tag: int) -> list[torch.Tensor] | None:
    """The leaves under the parameter-only subgraph at ``start``, marking its nodes ``tag``;
    None when a node of it is already another item's (shared: not splittable)."""
    leaves: list[torch.Tensor] = []
    stack = [start]
    while stack:
        node = stack.pop()
        seen_by = owner.get(node)
        if seen_by is not None:
            if seen_by != tag:
                return None
            continue
        owner[node] = tag
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return leaves


def _plan_items(
    roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple[list[_Item], dict[Node, bool]] | None:
    """The weight nodes of the graph under ``roots`` (module docstring), and per node
    whether it reaches a leaf of ``inputs``; None: not splittable."""
    targets = {get_gradient_edge(t).node for t in inputs}
    starts = [r.grad_fn for r in roots if r.grad_fn is not None]
    reaches: dict[Node, bool] = {}
    for node in _post_order(starts):
        reaches[node] = node in targets or any(
            c is not None and reaches.get(c, False) for c, _ in node.next_functions
        )
    items: list[_Item] = []
    owner: dict[Node, int] = {}
    for node, mixed in reaches.items():
        if not mixed:
            continue
        kids = [c for c, _ in node.next_functions if c is not None and not reaches[c]]
        if not kids:
            continue
        leaves: list[torch.Tensor] = []
        for kid in kids:
            got = _region(kid, owner, len(items))
            if got is None:
                return None
            leaves.extend(got)
        items.append(_Item(node, leaves))
    for root in roots:  # an output that depends on parameters only: W starts at the root
        start = root.grad_fn
        if start is None or reaches[start]:
            continue
        if start in owner:
            if items[owner[start]].node is start:
                continue  # another output of the same node: its slot joins that item
            # inside a weight node's region: that region gets gradient from the weight node
            # and from this root, which eager adds before running it once. Restarting the
            # weight node alone dropped the root's gradient (B never runs it: it reaches
            # no received leaf); restarting both would run the region twice
            return None

        got = _region(start, owner, len(items))
        if got is None:
            return None
        items.append(_Item(start, got))
    return items, reaches


def backward_input(
    roots: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor]
) -> WeightPass:
    """``B``: accumulate the gradients of ``inputs`` (leaves) only; returns what ``W`` owes.

    ``roots``/``grads`` are what one backward would be called with."""
    if not roots:
        return WeightPass()
    if not inputs:
        return WeightPass(whole=(roots, grads))
    nodes = [r.grad_fn for r in roots]
    planned = None if any(n is None for n in nodes) else _plan_items(roots, inputs)
    # a parameter-only loss (no gradient given) would need autograd's implicit 1 in W
    if planned is None or any(
        not planned[1][n] and g is None for n, g in zip(nodes, grads) if n is not None
    ):
        torch.autograd.backward(roots, grads)
        return WeightPass()
    items, reaches = planned
    handles = []
    for item in items:
        if not reaches[item.node]:  # a parameter-only root: its slots are the roots' grads
            slots: list[torch.Tensor | None] = [None] * (1 + max(r.output_nr for r in roots))
            for r, g in zip(roots, grads):
                have = slots[r.output_nr]
                if r.grad_fn is item.node and g is not None:
                    slots[r.output_nr] = g if have is None else have + g
            item.grads = tuple(slots)
            continue

        def record(grad_outputs: Any, item: _Item = item) -> None:
            item.grads = tuple(grad_outputs)

        handles.append(item.node.register_prehook(record))
    try:
        reaching = [(r, g) for r, n, g in zip(roots, nodes, grads) if n is not None and reaches[n]]
        if reaching:
            torch.autograd.backward(
                [r for r, _ in reaching], [g for _, g in reaching], inputs=inputs, retain_graph=True
            )
    finally:
        for h in handles:
            h.remove()
    return WeightPass(items=items)


def weight_steps(pending: WeightPass) -> list[tuple[list[torch.Tensor], Callable[[], None]]]:
    """``W`` as its separate autograd calls, each with the parameter leaves it fills.

    :func:`backward_weight` runs them in order; the profiler
    (``cost_models/context.py``) times each and charges it to the operator that
    owns those parameters."""
    if pending.whole is not None:
        roots, whole = pending.whole
        return [([], lambda: torch.autograd.backward(roots, whole))]
    steps: list[tuple[list[torch.Tensor], Callable[[], None]]] = []
    for item in pending.items:
        slots = [(i, g) for i, g in enumerate(item.grads) if g is not None]
        if not item.leaves or not slots:
            continue  # no gradient reached this node in B: eager gives its leaves none either
        edges = [GradientEdge(item.node, i) for i, _ in slots]
        given: list[torch.Tensor | None] = [g for _, g in slots]

        def run(edges: list[GradientEdge] = edges, grads: list[torch.Tensor | None] = given,
                leaves: list[torch.Tensor] = item.leaves) -> None:  # fmt: skip
            torch.autograd.backward(edges, grads, inputs=leaves)

        steps.append((item.leaves, run))
    return steps


def backward_weight(pending: WeightPass) -> None:
    """``W``: the weight gradients ``B`` left, from the gradients it recorded."""
    for _, run in weight_steps(pending):
        run()
