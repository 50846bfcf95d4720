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

After backward, stage position ``k`` all-reduces its gradients (``G_k``
bytes) over the ``R`` replicas. Two algorithms, both priced with the
alpha-beta model of the links (bandwidth, latency):

* **ring** over all ``R`` ranks: ``2(R−1)/R · G / B + 2(R−1) · α``, where
  ``B`` is the slowest link on the ring — the network between nodes as soon as
  there are two;
* **2d** (hierarchical, as on TPU pods and in NCCL's tree/CollNet modes):
  reduce-scatter among the ``p`` replicas inside a node, all-reduce of each
  ``G/p`` shard across the ``N`` nodes, all-gather inside:
  ``2(p−1)/p · G / B_node + 2(p−1)·α_node + 2(N−1)/N · G / B_net + 2(N−1)·α_net``
  (the node's ``p`` shards share its one network link: ``G`` crosses it).

Every stage position reduces at once, and all of them leave the node through
its one network link, so the network terms are charged on the sum of the
positions' gradients (a node always ships a whole model's gradients, however
the layout splits it); the NVLink terms on the largest position. A pipeline
therefore saves no network time, only latency hops and memory: replicas of
fewer devices each need a whole model per device. The cheaper
algorithm is chosen. A replica spanning ``k`` nodes has no partner inside a
node (each stage position has one device per replica, on ``R`` different
nodes): a ring over the ``R`` replicas, each node's NIC carrying the
gradients of the positions on that node, ``2(R−1)/R · max_node G_node / B_net
+ 2(R−1) · α_net``. It is priced after the pipeline's backward, so the step
is the pipeline's step plus this time: an upper bound, since the runtime
starts each bucket during the stage's last backward (runtime/overlap.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from crosscut.partitioner.plan import Plan

__all__ = [
    "MAX_SPAN_DEVICES",
    "Reduction",
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
class Reduction:
    """The chosen all-reduce and its seconds per step (0 with one replica)."""

    algorithm: str  # "none" | "ring" | "2d"
    seconds: float


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
    ``offset(s) + m`` (``runtime/world.py``), node by node; the solver picks
    devices by its own device order. Inside a node any device will do; across
    nodes the plan is priced as run only if the nodes agree."""
    per_node = max(1, len(plan.cluster.devices) // span)
    rank = 0
    for st in plan.stages:  # a group has a rank per device, a plain stage one (launch.py)
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


def reduction(plan: Plan, replicas: int, grads: Sequence[int] | None = None) -> Reduction:
    """The cheaper of ring and 2-D all-reduce for ``replicas`` copies of ``plan``.

    ``plan.cluster`` describes the replica's devices: inside one node (``nodes``
    of them, ``p`` replicas per node), or, with fewer replicas than nodes, the
    devices of ``nodes / replicas`` whole nodes, node by node.
    """
    if replicas <= 1:
        return Reduction("none", 0.0)
    g = list(grads) if grads is not None else stage_gradient_bytes(plan)
    span = replica_span(plan, replicas)
    if span > 1:  # one device per position per replica, every replica on its own nodes
        on_node = [0.0] * span
        for k, node in enumerate(stage_nodes(plan, span)):
            on_node[node] += g[k]
        bw, lat = plan.cluster.network
        hops = 2 * (replicas - 1)
        return Reduction("ring", hops / replicas * max(on_node) / bw + hops * lat)
    total, largest = float(sum(g)), float(max(g, default=0))
    nodes = max(1, plan.cluster.nodes)
    per_node = max(1, replicas // nodes)  # replicas inside one node
    node_bw, node_lat = _intra_link(plan)
    net_bw, net_lat = plan.cluster.network if nodes > 1 else (node_bw, node_lat)
    if nodes > 1:
        slow_bw, slow_lat = min(node_bw, net_bw), max(node_lat, net_lat)
        ring = 2 * (replicas - 1) / replicas * total / slow_bw + 2 * (replicas - 1) * slow_lat
    else:
        ring = 2 * (replicas - 1) / replicas * largest / node_bw + 2 * (replicas - 1) * node_lat
    if nodes == 1 or per_node == 1:
        return Reduction("ring", ring)
    inside = 2 * (per_node - 1) / per_node * largest / node_bw + 2 * (per_node - 1) * node_lat
    across = 2 * (nodes - 1) / nodes * total / net_bw + 2 * (nodes - 1) * net_lat
    two_d = inside + across
    return Reduction("2d", two_d) if two_d < ring else Reduction("ring", ring)
