"""The layouts a strategy search tries: replicas × a pipeline, and the micro-batch counts.

:mod:`crosscut.strategy` searches them in this order (its docstring says why);
this module only enumerates them and says which the caller's options exclude,
and which micro-batch sizes a layout's batch-split groups would run their
shares at (each one traced to price them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from crosscut.options import PlanRequest, cross_options
from crosscut.partitioner.replicas import layouts, spanning_layouts

if TYPE_CHECKING:
    from crosscut.cost_models.cluster import Cluster

__all__ = [
    "MAX_MICROBATCHES",
    "Layout",
    "candidate_layouts",
    "first_count",
    "layout_groups",
    "microbatch_candidates",
    "share_sizes",
]

# the largest micro-batch count tried per layout: with 1F1B a pipeline of S stages idles
# (S-1)/(M+S-1) of its step, under 20 % at M = 4S for the 8 stages of a node
MAX_MICROBATCHES = 32


def microbatch_candidates(batch: int, cap: int = MAX_MICROBATCHES) -> list[int]:
    """1, then each time the smallest divisor of ``batch`` at least twice the last, up to ``cap``.

    Powers of two where the batch allows (64: 1, 2, 4, ..., 32), a geometric
    ladder of divisors where it does not (24: 1, 2, 4, 8, 24).
    """
    out = [1]
    top = min(batch, cap)
    while True:
        nxt = next((m for m in range(2 * out[-1], top + 1) if batch % m == 0), None)
        if nxt is None:
            return out
        out.append(nxt)


@dataclass(frozen=True)
class Layout:
    """``replicas`` copies of a pipeline over ``devices`` devices each."""

    devices: int
    replicas: int
    require_all: bool  # every device of the replica holds a stage
    why_not: str = ""  # set: the layout cannot be planned, and this says why


def _uniform(cluster: Cluster) -> bool:
    """Whether a node's devices are interchangeable (same kind and memory): replicas need it."""
    first = cluster.devices[0]
    return all(d.kind == first.kind and d.mem_cap == first.mem_cap for d in cluster.devices)


def candidate_layouts(
    cluster: Cluster, request: PlanRequest, batch: int, no_replicas: str = ""
) -> list[Layout]:
    """Every layout of ``cluster``, cheapest first; those the rules exclude carry ``why_not``
    (``no_replicas``: why every layout of several replicas is, from ``state_limits.py``)."""
    per_node, nodes = len(cluster.devices), cluster.nodes
    if nodes > 1:
        every = layouts(per_node, nodes) + spanning_layouts(per_node, nodes)
    elif _uniform(cluster):
        every = layouts(per_node, 1)
    else:
        every = [(per_node, 1)]
    out = []
    fixed_m = request.microbatches or 1
    for d, r in sorted(every):
        why = ""
        if request.replicas is not None and r != request.replicas:
            why = f"replicas={request.replicas} was given"
        elif no_replicas and r > 1:
            why = no_replicas
        elif nodes == 1 and request.require_all_devices and request.replicas is None and r > 1:
            why = "require_all_devices: a pipeline stage on every device"
        elif batch % (r * fixed_m):
            why = f"the batch ({batch}) does not split into {r} replicas × {fixed_m} micro-batches"
        whole_node = nodes == 1 and r == 1
        fill = request.require_all_devices or request.fill_devices
        out.append(Layout(d, r, fill or not whole_node, why))
    if nodes == 1 and not _uniform(cluster) and per_node > 1:
        kinds = sorted({d.kind for d in cluster.devices})
        out.insert(
            0,
            Layout(
                1,
                per_node,
                True,
                f"the devices differ ({', '.join(kinds)}): identical "
                "replicas would run at the slowest one's pace",
            ),
        )
    return out


def layout_groups(lay: Layout, request: PlanRequest) -> tuple[bool, tuple[str, ...]]:
    """Whether an attempt on ``lay`` searches device groups, and their splits.

    :meth:`PlanRequest.stage_groups`'s rule (one replica holds the cluster), except
    where the caller wants a stage of its own on every device (``require_all_devices``,
    or the torchrun path's ``fill_devices``). A replica spanning nodes must fill its
    devices too, but a group fills them: there the solver keeps only plans whose
    stages and groups hold every device (``solve_cross(use_all=True)``), so a
    parameter-light stage may be replicated over both nodes while a heavy one stays
    on a few devices of one, its gradients never crossing the network."""
    if request.require_all_devices or request.fill_devices:
        return False, ()
    return request.stage_groups(lay.replicas)


def share_sizes(lay: Layout, request: PlanRequest, size: int) -> list[int]:
    """The micro-batch sizes a batch-split group's shares run at in this attempt (each
    traced to price them), or none where the attempt searches no batch-split group."""
    groups, splits = layout_groups(lay, request)
    if not groups or "batch" not in splits:
        return []
    widths, _ = cross_options(groups, request.widths, splits, lay.devices)
    return sorted({-(-size // w) for w in widths if w > 1 and -(-size // w) < size})


def first_count(counts: list[int], devices: int) -> int:
    """Where a layout's micro-batch search starts: the smallest count of at least its
    devices (a pipeline of ``d`` stages idles ``(d−1)/(M+d−1)`` of its step: under half
    from ``M = d``); one device starts at 1 (data parallelism needs no more)."""
    return next((i for i, m in enumerate(counts) if m >= devices), len(counts) - 1)
