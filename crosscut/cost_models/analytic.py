"""Analytic costs: a roofline per node on a DeviceSpec, no hardware needed.

``time = max(flops / peak[dtype], bytes_moved / mem_bw) + launch_overhead``.
Forward moves what the node reads plus what it writes; backward does
``bwd_flops`` and moves about twice the forward bytes (read the saved tensors
and the incoming gradient, write input and weight gradients). Placeholders,
the output and ``get_attr`` cost nothing; views move no bytes and pay only the
dispatch overhead. It is a lower bound with a fixed per-op tax, good enough to
rank placements; ``profiled.py`` replaces it with measurements.
"""

from __future__ import annotations

from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.devices import DeviceSpec
from crosscut.cost_models.memory import activation_bytes, is_alias, resident_bytes
from crosscut.cost_models.table import CostTable, NodeCost
from crosscut.graph import OpGraph, OpNode

__all__ = ["analytic_costs", "node_times"]

BWD_BYTES_FACTOR = 2.0


def node_times(graph: OpGraph, node: OpNode, spec: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` on ``spec``."""
    if node.is_io or node.op == "get_attr":
        return 0.0, 0.0
    if is_alias(graph, node) and node.fwd_flops == 0:
        return spec.launch_overhead_s, spec.launch_overhead_s if graph.mode == "train" else 0.0
    peak = spec.peak(node.dtype)
    moved = node.read_bytes + node.out_bytes
    fwd = max(node.fwd_flops / peak, moved / spec.mem_bw) + spec.launch_overhead_s
    if graph.mode != "train":
        return fwd, 0.0
    bwd = (
        max(node.bwd_flops / peak, BWD_BYTES_FACTOR * moved / spec.mem_bw) + spec.launch_overhead_s
    )
    return fwd, bwd


def analytic_costs(graph: OpGraph, cluster: Cluster, *, optimizer: str = "sgd") -> CostTable:
    """A CostTable with a roofline time for every device kind in ``cluster``."""
    cluster.validate()
    specs: dict[str, DeviceSpec] = {}
    for d in cluster.devices:
        specs.setdefault(d.kind, d)
    acts = activation_bytes(graph)
    nodes: dict[str, NodeCost] = {}
    for n in graph.nodes:
        cost = NodeCost(resident=0 if n.is_io else resident_bytes(n, graph.mode, optimizer))
        cost.activation = acts.get(n.name, 0)
        for kind, spec in specs.items():
            cost.fwd[kind], cost.bwd[kind] = node_times(graph, n, spec)
        nodes[n.name] = cost
    meta = {"fingerprint": graph.fingerprint(), "batch_size": graph.batch_size}
    return CostTable(nodes, "analytic", graph.mode, optimizer, meta)
