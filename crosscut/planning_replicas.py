"""Planning for a cluster of nodes: how many data-parallel replicas, how long a pipeline.

``crosscut.partition(model, "32x8xV100", global_batch)`` cannot solve one
partition problem over 256 devices (nor should it: a ResNet-50 pipeline of
256 stages would be all bubble). It chooses, jointly, the number of replicas
``R`` and the devices per replica ``d`` (``R × d`` = every device, stages
inside a node: :func:`crosscut.partitioner.replicas.layouts`): for each
layout it partitions the replica's share of the batch over ``d`` devices of
one node, prices the gradient all-reduce over ``R`` replicas (ring or 2-D,
whichever is cheaper: :func:`~crosscut.partitioner.replicas.reduction`), and
keeps the layout with the shortest step. The time limit is shared among the
layouts, so the whole search returns within it, tracing included: each layout
gets an equal part of what is left of the call's
:class:`~crosscut.partitioner.deadline.Deadline`.

The plan it returns describes one replica (its stages on ``d`` devices of a
node, ``model.batch_size`` = the replica's batch) and records ``R``, the
reduction and its time in ``Plan.replication``; ``crosscut run --replicas R``
starts that layout (replica ``r`` on global ranks ``r·d .. r·d + d − 1``,
node by node).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from crosscut.errors import InfeasiblePlanError, InputError, PartitionError
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.replicas import layouts

if TYPE_CHECKING:
    from crosscut.cost_models import Cluster
    from crosscut.partitioner.plan import Plan

__all__ = ["node_cluster", "plan_replicas"]


def node_cluster(cluster: Cluster, devices: int) -> Cluster:
    """The first ``devices`` devices of one node of ``cluster``, as a one-node cluster."""
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


def _slowest_link(cluster: Cluster) -> tuple[float, float]:
    """A node's slowest device pair: (bandwidth, latency); its own memory for one device."""
    n = len(cluster.devices)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    if not pairs:
        return (cluster.devices[0].mem_bw, 0.0)
    return (
        min(cluster.bandwidth[i][j] for i, j in pairs),
        max(cluster.latency[i][j] for i, j in pairs),
    )


def plan_replicas(
    model: Any,
    cluster: Cluster,
    inputs: tuple[Any, ...],
    request: Any,
    plan_one: Callable[[Any, Cluster, Any, Any, Deadline], Plan],
    deadline: Deadline | None = None,
) -> Plan:
    """The fastest (replicas, pipeline) layout of ``model`` on ``cluster``'s nodes.

    ``request`` is a ``crosscut.planning.PlanRequest``;
    ``plan_one(model, node_cluster, replica_inputs, request, deadline)``
    partitions one replica (crosscut.planning.plan_request for a one-node
    cluster) by ``deadline``; ``inputs``: the global batch's tensors.
    """
    from crosscut.partitioner.annotate import annotate

    dl = Deadline.of(deadline, request.time_limit)
    batch = int(inputs[0].shape[0])
    per_node = len(cluster.devices)
    options = [
        (d, r)
        for d, r in layouts(per_node, cluster.nodes)
        if batch % (r * request.microbatches) == 0
    ]
    if not options:
        raise InputError(
            f"the global batch ({batch}) must split into replicas × micro-batches for some "
            f"layout of {cluster.total_devices} devices",
            value={"batch": batch, "replicas": [r for _, r in layouts(per_node, cluster.nodes)]},
            remedy="use a batch that is a multiple of "
            f"{cluster.total_devices * request.microbatches}",
        )
    # every device of a layout is used (fewer stages is the next layout's business), and
    # the layouts share the time limit
    share = dataclasses.replace(
        request,
        time_limit=max(1.0, request.time_limit / len(options)),
        require_all_devices=True,
    )
    best: Plan | None = None
    tried: list[str] = []
    last_error: InfeasiblePlanError | None = None
    for i, (d, r) in enumerate(options):
        replica = tuple(t[: batch // r] for t in inputs)
        within = dl.within(dl.left() / (len(options) - i))  # an equal part of what is left
        try:
            plan = plan_one(model, node_cluster(cluster, d), replica, share, within)
        except InfeasiblePlanError as exc:
            tried.append(f"{r} replicas × {d} devices: no plan fits the memory caps")
            last_error = exc
            continue
        except PartitionError as exc:  # e.g. fewer nodes than devices to fill
            tried.append(f"{r} replicas × {d} devices: {exc.rule}")
            continue
        plan.cluster.nodes = cluster.nodes
        plan.cluster.network = list(cluster.network)
        plan.cluster.network_name = cluster.network_name
        plan.cluster.name = cluster.name
        plan.cluster.node_link = list(_slowest_link(cluster))
        plan.replication.replicas = r
        annotate(plan)  # prices the all-reduce and the step from the plan's own numbers
        tried.append(
            f"{r} replicas × {plan.num_stages} stages on {d} devices: step "
            f"{plan.predicted.step_time_s:.6g} s ({plan.replication.reduction} all-reduce "
            f"{plan.replication.allreduce_s:.3g} s)"
        )
        if best is None or plan.predicted.step_time_s < best.predicted.step_time_s:
            best = plan
    if best is None:
        raise InfeasiblePlanError(
            f"no layout of replicas × pipeline fits the memory caps: {'; '.join(tried)}",
            value=None if last_error is None else last_error.value,
            remedy=None if last_error is None else last_error.remedy,
        ) from last_error
    best.solver.notes.append("replicas × pipeline layouts tried: " + "; ".join(tried))
    return best
