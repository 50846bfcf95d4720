"""Data-parallel replicas of a pipeline across nodes: the layouts and their gradient reduction.

A cluster of ``N`` identical nodes of ``g`` devices (``"32x8xV100"``) runs
``R`` replicas of a pipeline of ``d`` devices, ``R × d = N × g``. Either the
stages stay inside a node (their activations cross NVLink every micro-batch):
``d`` divides ``g`` and each node holds ``p = g / d`` replicas
(:func:`layouts`); or a replica spans ``k`` whole nodes, ``d = k × g`` and
``R = N / k``, its activations crossing the network ``k − 1`` times per
micro-batch (:func:`spanning_layouts`: a model too big for one node, or
gradients too big for the network). Replica ``r`` is the ``d`` devices
``r·d .. r·d + d − 1`` of the global rank order (node by node), which is the
layout ``crosscut run --replicas R`` starts; stage ``s`` of a replica runs on
its ``s``-th rank (:func:`runs_in_rank_order` checks that a spanning plan's
stages sit on the nodes those ranks do).

**The reduction as the runtime does it.** Stage position ``k`` all-reduces its
gradients over the ``R`` replicas the way DDP's reducer does it
(runtime/dist/overlap.py): in buckets (the first 1 MB, then 25 MB, in reverse
parameter order), each started as its last gradient lands during the
stage's last backward, one after another on the wire. Gradients travel in the
dtype they are reduced in (``grad_bytes`` per element, fp32 master gradients
under autocast by default). Each bucket costs ``α + β · bytes`` for the chosen
algorithm, with the latency terms NCCL's tuner gives its algorithms
(``src/graph/tuning.cc``, the Simple protocol that carries MB-sized buckets):
every call pays ``NCCL_BASE_S`` (8.4 µs), every step inside a node
``h_node = NCCL_NODE_HOP_S`` (4 µs: a pipelined step, not a whole copy's
latency ``α_node``) and every step between nodes
``h_net = max(α_net, NCCL_NET_HOP_S)`` (14 µs: NCCL's per-step cost over a
NIC, wire included, however fast the wire). ``B_node``: a node's slowest
device link; ``B_net = nics × NIC bandwidth`` per node, ``α_net`` its latency:

* **ring** over all ``R`` ranks: ``β = 2(R−1)/R · max(1/B_node, 1/B_net)``,
  ``α = base + 2(N−1)·h_net + 2(R−N)·h_node`` (NCCL: ``nsteps − nInterSteps``
  steps inside nodes, ``2(nNodes − 1)`` between them);
* **tree** (NCCL's double binary tree between nodes, a chain inside):
  ``β = max(2/B_net, 2(p−1)/p / B_node) / 0.92`` (NCCL prices a tree all-reduce
  at 0.92 of the link's bus bandwidth), ``α = base + 2·(⌈log2 N⌉·h_net + (p−1)·h_node)``;
* **2d** (hierarchical, as on TPU pods, Mikami et al.'s 2D-torus and NCCL's
  CollNet): reduce-scatter among the ``p`` replicas inside a node, all-reduce of
  each ``G/p`` shard across the ``N`` nodes, all-gather inside, three calls:
  ``β = 2(p−1)/p / B_node + 2(N−1)/N / B_net``,
  ``α = 3·base + 2(p−1)·h_node + 2(N−1)·h_net``.

All positions of a node leave it through the same NICs, so position ``k`` gets
``G_k / G_node`` of ``B_net`` (a node always ships a whole model's gradients,
however the layout splits it). A replica spanning ``k`` nodes has no partner
inside a node: a ring or tree over the ``R`` replicas, each node's NICs carrying
the gradients of the positions on that node. The algorithm with the shortest
total is chosen. :class:`Reduction` keeps each position's buckets (when each is
ready, measured from the start of the stage's last backward, and its bytes):
the simulator (partitioner/simulate.py) overlaps them with that backward and
charges only what is left after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from crosscut.errors import InputError, PartitionError
from crosscut.ir.plan import Plan
from crosscut.ir.schedule import placement, virtual_stages

if TYPE_CHECKING:
    from crosscut.ir.graph import OpGraph

__all__ = [
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "MAX_SPAN_DEVICES",
    "NCCL_BASE_S",
    "NCCL_NET_HOP_S",
    "NCCL_NODE_HOP_S",
    "NCCL_TREE_BW",
    "PositionReduction",
    "Reduction",
    "batch_major_cuts",
    "buckets",
    "check_replica_exports",
    "layouts",
    "reduction",
    "replica_span",
    "runs_in_rank_order",
    "spanning_layouts",
    "stage_gradient_bytes",
    "stage_nodes",
]

# the largest replica spanning nodes: a CNN pipeline of more stages is mostly bubble,
# and its partition problem (one device per stage) slower to solve
MAX_SPAN_DEVICES = 16


@dataclass(frozen=True)
class PositionReduction:
    """One stage position's reduction: ``α + β·bytes`` per bucket, and its buckets.

    ``buckets`` are ``(ready_s, bytes)``: when the bucket's last gradient lands,
    in seconds of the stage's node backward times from the start of its last
    backward, and the bytes it reduces.
    """

    alpha: float
    beta: float
    buckets: tuple[tuple[float, int], ...] = ()

    @property
    def seconds(self) -> float:
        """The position's reduction alone on the wire (no overlap)."""
        return sum(self.alpha + self.beta * b for _, b in self.buckets)

    def finish(self, start: float, end: float, backward_s: float) -> float:
        """When the last bucket is done, the last backward running ``start .. end``.

        Bucket ``ready`` times are scaled from ``backward_s`` (the stage's summed
        node backward times) to the action's length, which includes transfers."""
        scale = (end - start) / backward_s if backward_s > 0 else 0.0
        t = start
        for ready, nbytes in self.buckets:
            t = max(t, start + ready * scale) + self.alpha + self.beta * nbytes
        return t


@dataclass(frozen=True)
class Reduction:
    """The chosen all-reduce and its seconds per step alone on the wire (0 with one replica)."""

    algorithm: str  # "none" | "ring" | "tree" | "2d"
    seconds: float
    positions: tuple[PositionReduction, ...] = ()


def layouts(per_node: int, nodes: int) -> list[tuple[int, int]]:
    """Every (devices per replica ``d``, replicas ``R``) with stages inside a node."""
    return [(d, nodes * per_node // d) for d in range(1, per_node + 1) if per_node % d == 0]


def spanning_layouts(
    per_node: int, nodes: int, max_devices: int = MAX_SPAN_DEVICES
) -> list[tuple[int, int]]:
    """Every (``d = k × per_node``, ``R = nodes / k``), a replica on ``k >= 2`` whole nodes."""
    return [
        (k * per_node, nodes // k)
        for k in range(2, nodes + 1)
        if nodes % k == 0 and k * per_node <= max_devices
    ]


def replica_span(plan: Plan, replicas: int) -> int:
    """Whole nodes one of ``replicas`` replicas of ``plan`` spans (1: it sits inside a node)."""
    nodes = max(1, plan.cluster.nodes)
    if 1 <= replicas < nodes and nodes % replicas == 0:
        return nodes // replicas
    return 1


def stage_nodes(plan: Plan, span: int) -> list[int]:
    """The node of the replica (``0 .. span − 1``) each stage's leading device is on.

    A spanning plan's devices are its ``span`` nodes' devices, node by node."""
    per_node = max(1, len(plan.cluster.devices) // span)
    return [plan.cluster.index(st.devices[0]) // per_node for st in plan.stages]


def runs_in_rank_order(plan: Plan, span: int) -> bool:
    """Whether every stage's devices are on the node its ranks are on under torchrun.

    The runtime gives stage ``s`` (member ``m`` of its group) the replica's rank
    ``offset(s) + m`` (``runtime/dist/world.py``), node by node; the solver picks
    devices by its own device order. Inside a node any device will do; across
    nodes the plan is priced as run only if the nodes agree. An interleaved plan's
    stage ``s`` runs on the rank its schedule places it on (``ir.schedule.placement``)."""
    per_node = max(1, len(plan.cluster.devices) // span)
    if virtual_stages(plan.options.schedule) > 1 and all(
        len(st.devices) == 1 for st in plan.stages
    ):
        ranks = placement(plan.options.schedule, plan.num_stages)
        return all(
            plan.cluster.index(st.devices[0]) // per_node == r // per_node
            for st, r in zip(plan.stages, ranks)
        )
    rank = 0
    for st in plan.stages:  # a group has a rank per device, a plain stage one (cli/launch.py)
        for name in st.devices if st.split in ("channel", "batch") else st.devices[:1]:
            if plan.cluster.index(name) // per_node != rank // per_node:
                return False
            rank += 1
    return True


def stage_gradient_bytes(plan: Plan) -> list[int]:
    """Gradient bytes each stage position reduces (its parameters', fp32 as trained)."""
    out = [0] * plan.num_stages
    for n in plan.nodes:
        k = plan.assignment.get(n.name)
        if k is not None:
            out[k] += n.param_bytes
    return out


def _intra_link(plan: Plan) -> tuple[float, float]:
    """The slowest (bandwidth, largest latency) between two devices of a node."""
    if plan.cluster.node_link[0] > 0:
        bw, lat = plan.cluster.node_link
        return (bw, lat)
    n = len(plan.cluster.devices)
    if n < 2:
        return (float("inf"), 0.0)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    bw = min(plan.cluster.bandwidth[i][j] for i, j in pairs)
    lat = max(plan.cluster.latency[i][j] for i, j in pairs)
    return (bw, lat)


# DDP's reducer: the first bucket 1 MB (it starts the wire early), the rest 25 MB
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def buckets(plan: Plan, stage: int, grad_bytes: float = 4.0) -> tuple[tuple[float, int], ...]:
    """DDP's buckets of ``stage``'s gradients: (ready seconds into its backward, bytes).

    Reverse parameter order (the graph's reverse topological order), closed at
    ``FIRST_BUCKET_BYTES`` then ``BUCKET_BYTES``; a bucket is ready when the
    backward of its last node is done (node backward times on the stage's kind)."""
    if not plan.stages[stage].devices:
        return ()
    kind = next(d.kind for d in plan.cluster.devices if d.name == plan.stages[stage].devices[0])
    out: list[tuple[float, int]] = []
    clock, size, cap = 0.0, 0, FIRST_BUCKET_BYTES
    for n in reversed(plan.nodes):
        if plan.assignment.get(n.name) != stage:
            continue
        clock += n.bwd_s.get(kind, 0.0)
        size += int(n.param_bytes * grad_bytes / 4.0)
        if size >= cap:
            out.append((clock, size))
            size, cap = 0, BUCKET_BYTES
    if size:
        out.append((clock, size))
    return tuple(out)


# NCCL's tuner constants for the Simple protocol (src/graph/tuning.cc, NVIDIA/nccl at
# 5067397, baseLatencies and hwLatencies): a call's base latency, the per-step latency
# inside a node (NVLink: ring 3.4, tree 4.0 µs; PCIe: ring 5.7, tree 4.0 µs: we take 4.0)
# and over the network (14 µs, ring and tree); a tree all-reduce runs at 0.92 of busBw.
NCCL_BASE_S = 8.4e-6
NCCL_NODE_HOP_S = 4.0e-6
NCCL_NET_HOP_S = 14e-6
NCCL_TREE_BW = 0.92


def _log2(n: int) -> int:
    return max(1, (n - 1).bit_length())


def _algorithms(
    replicas: int, nodes: int, node: tuple[float, float], net: tuple[float, float]
) -> dict[str, tuple[float, float]]:
    """``{algorithm: (α, β)}`` for ``replicas`` over ``nodes`` (module docstring)."""
    (b_node, _), (b_net, a_net) = node, net
    h_node = NCCL_NODE_HOP_S  # NCCL's, whatever the link's copy latency
    h_net = max(a_net, NCCL_NET_HOP_S)
    p = max(1, replicas // nodes)
    if nodes == 1:
        return {
            "ring": (
                NCCL_BASE_S + 2 * (replicas - 1) * h_node,
                2 * (replicas - 1) / replicas / b_node,
            )
        }
    slow = max(1 / b_node if p > 1 else 0.0, 1 / b_net)
    out = {
        "ring": (
            NCCL_BASE_S + 2 * (nodes - 1) * h_net + 2 * (replicas - nodes) * h_node,
            2 * (replicas - 1) / replicas * slow,
        ),
        "tree": (
            NCCL_BASE_S + 2 * (_log2(nodes) * h_net + (p - 1) * h_node),
            max(2 / b_net, 2 * (p - 1) / p / b_node) / NCCL_TREE_BW,
        ),
    }
    if p > 1:
        out["2d"] = (
            3 * NCCL_BASE_S + 2 * (p - 1) * h_node + 2 * (nodes - 1) * h_net,
            2 * (p - 1) / p / b_node + 2 * (nodes - 1) / nodes / b_net,
        )
    return out


def reduction(
    plan: Plan,
    replicas: int,
    grads: Sequence[int] | None = None,
    *,
    grad_bytes: float | None = None,
    algorithms: Sequence[str] | None = None,
) -> Reduction:
    """The fastest of ring, tree and 2-D all-reduce for ``replicas`` copies of ``plan``.

    ``plan.cluster`` describes the replica's devices: inside one node (``nodes``
    of them, ``p`` replicas per node), or, with fewer replicas than nodes, the
    devices of ``nodes / replicas`` whole nodes, node by node. ``grads``
    overrides each position's gradient bytes (one bucket each, ready at the
    end of the backward); ``grad_bytes`` is the bytes per gradient element on
    the wire (4: fp32, 2: gradients reduced in fp16/bf16), by default the
    plan's ``replication.grad_bytes``. ``algorithms`` limits the choice to
    those named (a run that used one algorithm: benchmarks/published_scale.py).
    """
    if replicas <= 1:
        return Reduction("none", 0.0)
    if grad_bytes is None:
        grad_bytes = float(plan.replication.grad_bytes)
    if grads is None:
        g = [b * grad_bytes / 4.0 for b in stage_gradient_bytes(plan)]
        bucket_lists = [buckets(plan, k, grad_bytes) for k in range(plan.num_stages)]
    else:
        g = [float(b) for b in grads]
        bucket_lists = [((0.0, int(b)),) if b else () for b in g]
    nics = max(1, int(getattr(plan.cluster, "nics", 1)))
    net_bw, net_lat = plan.cluster.network
    span = replica_span(plan, replicas)
    if span > 1:  # one device per position per replica, every replica on its own nodes
        on_node = [0.0] * span
        where = stage_nodes(plan, span)
        for k, node in enumerate(where):
            on_node[node] += g[k]
        shares = [g[k] / on_node[where[k]] if on_node[where[k]] else 1.0 for k in range(len(g))]
        nodes = replicas
        node_link: tuple[float, float] = (float("inf"), 0.0)
    else:
        total = sum(g)
        shares = [x / total if total else 1.0 for x in g]
        nodes = max(1, plan.cluster.nodes)
        node_link = _intra_link(plan)
    best: Reduction | None = None
    for name in _algorithms(replicas, nodes, node_link, (1.0, net_lat)):
        if algorithms is not None and name not in algorithms:
            continue
        positions = []
        for k, share in enumerate(shares):
            # a position with no gradient ships nothing: any bandwidth prices it at 0 bytes
            b_net = nics * net_bw * (share or 1.0) if nodes > 1 else 1.0
            alpha, beta = _algorithms(replicas, nodes, node_link, (b_net, net_lat))[name]
            positions.append(PositionReduction(alpha, beta, bucket_lists[k]))
        seconds = max((p.seconds for p in positions), default=0.0)
        if best is None or seconds < best.seconds:
            best = Reduction(name, seconds, tuple(positions))
    if best is None:
        raise InputError(
            "an all-reduce algorithm must apply to the layout",
            value=(list(algorithms or ()), replicas, nodes),
            remedy="name one of ring, tree, or 2d with several replicas per node",
        )
    return best


# ---- rules of replicated plans (crosscut/strategy.py applies them) ---------------------


def batch_major_cuts(graph: OpGraph) -> OpGraph:
    """``graph`` with every value that is not a batch-major tensor tied to its readers.

    Locally the replicas of a stage position run as one batch-split group,
    which can hand on only tensors whose dim 0 is the batch (it concatenates its
    shares' copies): a ``x.size(0)``, a mean over the batch or a parameter sent
    as a value would be each share's own. A tie (``OpGraph.ties``: nodes that
    share a stage) keeps such a value on its readers' stage, so the solver cuts
    elsewhere instead of the layout being refused after the solve. The ties are
    recorded in the plan (``Plan.ties``), so a replay prices the same problem."""
    from crosscut.partitioner.build import batch_major_value

    readers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for u in n.inputs:
            readers.setdefault(u, []).append(n.name)
    placed = {n.name for n in graph.nodes if n.op not in ("placeholder", "output")}
    extra = [
        [n.name, *(r for r in readers[n.name] if r in placed)]
        for n in graph.nodes
        if n.name in placed
        and n.name in readers
        and not batch_major_value(n, graph.batch_size)
        and any(r in placed for r in readers[n.name])
    ]
    if not extra:
        return graph
    return dataclasses.replace(graph, ties=[*graph.ties, *extra], gm=graph.gm)


def check_replica_exports(plan: Plan) -> None:
    """Refuse replicas of a pipeline whose stages hand on values a batch split cannot join.

    Locally the replicas of a stage position run as one batch-split group
    (``codegen/grouped_stages.local_groups``), which concatenates its shares'
    copies of everything it hands on: a ``x.size(0)`` or a mean over the batch
    crossing a cut — or returned by the model — would be each share's own."""
    from crosscut.partitioner.build import plan_to_problem
    from crosscut.partitioner.group_costs import batch_split_exports

    pb, stage_of, _ = plan_to_problem(plan)
    for k in range(plan.num_stages):
        names = batch_split_exports(pb, stage_of, k)
        if names:
            raise PartitionError(
                f"replicas split every stage by batch, and stage {k} hands on values "
                "that are not batch-major tensors",
                value=names[:4],
                remedy="the layout is skipped; one replica plans without this rule",
            )
