"""Data-parallel replicas of a pipeline across nodes: the layouts and their gradient reduction.

A cluster of ``N`` identical nodes of ``g`` devices (``"32x8xV100"``) runs
``R`` replicas of a pipeline of ``d`` devices, ``R × d = N × g``. Stages stay
inside a node (their activations cross NVLink every micro-batch), so ``d``
divides ``g`` and each node holds ``p = g / d`` replicas; replica ``r`` is
the ``d`` devices ``r·d .. r·d + d − 1`` of the global rank order (node by
node), which is the layout ``crosscut run --replicas R`` starts.

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
algorithm is chosen. It is priced after the pipeline's backward, so the step
is the pipeline's step plus this time: an upper bound, since the runtime
starts each bucket during the stage's last backward (runtime/overlap.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from crosscut.partitioner.plan import Plan

__all__ = ["Reduction", "layouts", "reduction", "stage_gradient_bytes"]


@dataclass(frozen=True)
class Reduction:
    """The chosen all-reduce and its seconds per step (0 with one replica)."""

    algorithm: str  # "none" | "ring" | "2d"
    seconds: float


def layouts(per_node: int, nodes: int) -> list[tuple[int, int]]:
    """Every (devices per replica ``d``, replicas ``R``) with stages inside a node."""
    return [(d, nodes * per_node // d) for d in range(1, per_node + 1) if per_node % d == 0]


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

    ``plan.cluster`` describes one node (``nodes`` of them); the replica's
    ``len(plan.used_devices())`` devices sit inside a node, ``p`` replicas per node.
    """
    if replicas <= 1:
        return Reduction("none", 0.0)
    g = list(grads) if grads is not None else stage_gradient_bytes(plan)
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
