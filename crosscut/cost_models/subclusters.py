"""Parts of a cluster as clusters of their own: one replica's devices.

The strategy search (:mod:`crosscut.strategy`) partitions one replica of a
pipeline at a time; these build the one-node cluster it is solved on, priced
as the whole cluster prices the same pairs.
"""

from __future__ import annotations

import dataclasses

from crosscut.cost_models.cluster import Cluster

__all__ = ["node_cluster", "replica_cluster", "slowest_link"]


def node_cluster(cluster: Cluster, devices: int) -> Cluster:
    """The first ``devices`` devices of one node of ``cluster``, as a one-node cluster."""
    if devices == len(cluster.devices) and cluster.nodes == 1:
        return cluster
    keep = range(devices)
    return dataclasses.replace(
        cluster,
        devices=[cluster.devices[i] for i in keep],
        bandwidth=[[cluster.bandwidth[i][j] for j in keep] for i in keep],
        latency=[[cluster.latency[i][j] for j in keep] for i in keep],
        nodes=1,
        meta=dict(cluster.meta),
        name=f"{devices}x{cluster.devices[0].kind} of {cluster.name}",
    )


def replica_cluster(cluster: Cluster, devices: int) -> Cluster:
    """One replica's ``devices`` as a one-node cluster the partitioner can solve.

    Inside a node: its first ``devices`` (:func:`node_cluster`). Over
    ``devices / g`` whole nodes of ``g``: their devices node by node, named
    ``n<node>.<name>``, each pair priced as :meth:`Cluster.transfer_time`
    prices it (``same_node``: the node's link; else the network). A
    ``devices²`` matrix, so spans stay small (``replicas.MAX_SPAN_DEVICES``).
    """
    g = len(cluster.devices)
    if devices <= g:
        return node_cluster(cluster, devices)

    def link(a: int, b: int) -> tuple[float, float]:
        if cluster.same_node(a, b):
            return cluster.bandwidth[a % g][b % g], cluster.latency[a % g][b % g]
        return cluster.network

    links = [[link(a, b) for b in range(devices)] for a in range(devices)]
    out = dataclasses.replace(
        cluster,
        devices=[
            cluster.devices[i % g].renamed(f"n{i // g}.{cluster.devices[i % g].name}")
            for i in range(devices)
        ],
        bandwidth=[[bw for bw, _ in row] for row in links],
        latency=[[lat for _, lat in row] for row in links],
        nodes=1,
        meta=dict(cluster.meta),
        name=f"{devices // g} nodes of {g}x{cluster.devices[0].kind} of {cluster.name}",
    )
    out.validate()
    return out


def slowest_link(cluster: Cluster) -> tuple[float, float]:
    """A node's slowest device pair: (bandwidth, latency); its own memory for one device."""
    n = len(cluster.devices)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    if not pairs:
        return (cluster.devices[0].mem_bw, 0.0)
    return (
        min(cluster.bandwidth[i][j] for i, j in pairs),
        max(cluster.latency[i][j] for i, j in pairs),
    )
