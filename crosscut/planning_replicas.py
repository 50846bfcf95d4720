"""Planning for a cluster of nodes: how many data-parallel replicas, how long a pipeline.

``crosscut.partition(model, "32x8xV100", global_batch)`` cannot solve one
partition problem over 256 devices (nor should it: a ResNet-50 pipeline of
256 stages would be all bubble). It chooses, jointly, the number of replicas
``R`` and the devices per replica ``d`` (``R × d`` = every device): stages
inside a node (:func:`crosscut.partitioner.replicas.layouts`), or a replica
on ``k`` whole nodes (:func:`~crosscut.partitioner.replicas.spanning_layouts`,
up to 16 devices), where a model does not fit one node or its gradients
cost the network more than its activations do. For each layout it partitions
the replica's share of the batch over its ``d`` devices
(:func:`replica_cluster`: a node's links inside a node, the network between
nodes, as ``Cluster.transfer_time`` prices them), prices the gradient
all-reduce over ``R`` replicas (ring or 2-D, whichever is cheaper:
:func:`~crosscut.partitioner.replicas.reduction`), and keeps the layout with
the shortest step. The time limit is shared among the
layouts, so the whole search returns within it, tracing included: each layout
gets an equal part of what is left of the call's
:class:`~crosscut.partitioner.deadline.Deadline`.

Micro-batches: a pipeline of ``d`` stages fed one micro-batch runs one stage
at a time, so unless the caller fixed ``microbatches`` each layout is also
planned for more (:func:`microbatch_candidates`: 1, 2, 4, ... dividing the
replica's batch, up to :data:`MAX_MICROBATCHES`), each attempt an equal part
of what is left of the layout's share, and keeps the count with the shortest
step. Counts are tried in increasing order and the search stops once the step
grows again (the bubble shrinks as ``1/M``, the per-micro-batch overheads
grow with ``M``), when a plan has one stage (nothing to overlap), or when
less time is left than the quickest attempt so far took (its tracing cannot
be interrupted); a count whose plan does not fit the memory caps does not stop
it (smaller micro-batches keep fewer activations).

The plan it returns describes one replica (its stages on ``d`` devices of a
node, or of ``k`` nodes, named ``n<node>.<device>``; ``model.batch_size`` = the
replica's batch) and records ``R``, the reduction and its time in
``Plan.replication``; ``crosscut run --replicas R`` starts that layout
(replica ``r`` on global ranks ``r·d .. r·d + d − 1``, node by node, its
stage ``s`` on its ``s``-th rank: a spanning plan whose solver put stages on
other nodes than those ranks is not kept,
:func:`~crosscut.partitioner.replicas.runs_in_rank_order`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from crosscut.errors import InfeasiblePlanError, InputError, PartitionError
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.replicas import (
    layouts,
    replica_span,
    runs_in_rank_order,
    spanning_layouts,
    stage_nodes,
)

if TYPE_CHECKING:
    from crosscut.cost_models import Cluster
    from crosscut.partitioner.plan import Plan

__all__ = [
    "MAX_MICROBATCHES",
    "microbatch_candidates",
    "node_cluster",
    "plan_replicas",
    "replica_cluster",
]

# the largest micro-batch count tried per layout: with 1F1B a pipeline of S stages idles
# (S-1)/(M+S-1) of its step, under 20 % at M = 4S for the 8 stages of a node
MAX_MICROBATCHES = 32


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


def _as_replicas(plan: Plan, cluster: Cluster, replicas: int) -> Plan:
    """``plan`` (one replica) priced as ``replicas`` copies on ``cluster``'s nodes."""
    from crosscut.partitioner.annotate import annotate

    plan.cluster.nodes = cluster.nodes
    plan.cluster.network = list(cluster.network)
    plan.cluster.network_name = cluster.network_name
    plan.cluster.name = cluster.name
    plan.cluster.node_link = list(_slowest_link(cluster))
    plan.replication.replicas = replicas
    return annotate(plan)  # prices the all-reduce and the step from the plan's own numbers


def _attempt(
    plan_one: Callable[[Any, Cluster, Any, Any, Deadline], Plan],
    model: Any,
    node: Cluster,
    replica: tuple[Any, ...],
    request: Any,
    cluster: Cluster,
    replicas: int,
    microbatches: int,
    by: Deadline,
) -> Plan:
    """One replica on ``node`` with ``microbatches``, priced as ``replicas`` on ``cluster``."""
    req = dataclasses.replace(request, microbatches=microbatches)
    plan = _as_replicas(plan_one(model, node, replica, req, by), cluster, replicas)
    span = replica_span(plan, replicas)
    if span > 1 and not runs_in_rank_order(plan, span):
        raise PartitionError(
            "a replica spanning nodes runs stage s on its s-th rank, node by node; this "
            "plan's stages sit on other nodes",
            value={"stage nodes": stage_nodes(plan, span)},
            remedy="a fixed device order would avoid it; the layout is skipped",
        )
    return plan


class _Search:
    """The layouts' attempts so far: the best plan, what was tried, the quickest attempt."""

    def __init__(self, deadline: Deadline, batch: int) -> None:
        self.deadline, self.batch = deadline, batch
        self.best: Plan | None = None
        self.tried: list[str] = []
        self.quickest = 0.0  # seconds of the quickest attempt (trace + solve) so far
        self.last_error: InfeasiblePlanError | None = None
        self.rejected: InputError | None = None  # the model refused a micro-batch size

    def affordable(self, left: float) -> bool:
        """Whether another attempt fits in ``left`` seconds (always, before any plan)."""
        return self.best is None or (left > 0.0 and left >= self.quickest)

    def keep(self, plan: Plan) -> None:
        if self.best is None or plan.predicted.step_time_s < self.best.predicted.step_time_s:
            self.best = plan


def _layout(
    search: _Search,
    attempt: Callable[[int, Deadline], Plan],
    layout: tuple[int, int],
    counts: list[int],
    within: Deadline,
) -> None:
    """Plan one (devices, replicas) layout for each micro-batch count worth trying."""
    (d, r), batch = layout, search.batch
    if not search.affordable(search.deadline.left()):
        search.tried.append(f"{r} replicas × {d} devices: not tried (time limit)")
        return
    steps: list[str] = []
    layout_best: Plan | None = None
    infeasible = False
    for j, m in enumerate(counts):
        if j and not search.affordable(within.left()):
            steps.append(f"{m}: not tried (time limit)")
            break
        t0 = time.monotonic()
        try:
            plan = attempt(m, within.within(within.left() / (len(counts) - j)))
        except InfeasiblePlanError as exc:
            steps.append(f"{m}: no plan fits the memory caps")
            search.last_error, infeasible = exc, True
            continue
        except PartitionError as exc:  # e.g. fewer nodes than devices to fill
            steps.append(f"{m}: {exc.rule}")
            break
        except InputError as exc:  # e.g. batch norm refuses a micro-batch of one sample
            steps.append(f"{m}: the model rejects a micro-batch of {batch // r // m}")
            search.rejected = exc
            break
        finally:
            wall = time.monotonic() - t0
            search.quickest = wall if search.quickest == 0.0 else min(search.quickest, wall)
        step = plan.predicted.step_time_s
        steps.append(f"{m}: step {step:.6g} s")
        search.keep(plan)
        if layout_best is not None and step >= layout_best.predicted.step_time_s:
            break  # past the shortest step
        layout_best = plan
        if plan.num_stages == 1:
            break  # no pipeline: more micro-batches only add overhead
    if layout_best is None:
        fits = "no plan fits the memory caps" if infeasible else "no plan"
        search.tried.append(
            f"{r} replicas × {d} devices: {fits} (micro-batches {', '.join(steps)})"
        )
        return
    rep = layout_best.replication
    search.tried.append(
        f"{r} replicas × {layout_best.num_stages} stages on {d} devices: step "
        f"{layout_best.predicted.step_time_s:.6g} s with {layout_best.options.microbatches} "
        f"micro-batches ({rep.reduction} all-reduce {rep.allreduce_s:.3g} s; micro-batches "
        f"{', '.join(steps)})"
    )


def plan_replicas(
    model: Any,
    cluster: Cluster,
    inputs: tuple[Any, ...],
    request: Any,
    plan_one: Callable[[Any, Cluster, Any, Any, Deadline], Plan],
    deadline: Deadline | None = None,
) -> Plan:
    """The fastest (replicas, pipeline, micro-batches) layout of ``model`` on ``cluster``'s nodes.

    ``request`` is a ``crosscut.planning.PlanRequest`` (``microbatches=None``:
    chosen per layout); ``plan_one(model, node_cluster, replica_inputs,
    request, deadline)`` partitions one replica (crosscut.planning.plan_request
    for a one-node cluster) by ``deadline``; ``inputs``: the global batch's tensors.
    """
    dl = Deadline.of(deadline, request.time_limit)
    batch = int(inputs[0].shape[0])
    per_node = len(cluster.devices)
    fixed: int | None = request.microbatches
    every = layouts(per_node, cluster.nodes) + spanning_layouts(per_node, cluster.nodes)
    options = [(d, r) for d, r in every if batch % (r * (fixed or 1)) == 0]
    if not options:
        raise InputError(
            f"the global batch ({batch}) must split into replicas × micro-batches for some "
            f"layout of {cluster.total_devices} devices",
            value={"batch": batch, "replicas": [r for _, r in every]},
            remedy=f"use a batch that is a multiple of {cluster.total_devices * (fixed or 1)}",
        )
    # every device of a layout is used (fewer stages is the next layout's business), and
    # the layouts share the time limit
    share = dataclasses.replace(
        request,
        time_limit=max(1.0, request.time_limit / len(options)),
        require_all_devices=True,
    )
    search = _Search(dl, batch)
    for i, (d, r) in enumerate(options):
        replica = tuple(t[: batch // r] for t in inputs)
        node = replica_cluster(cluster, d)
        attempt = functools.partial(_attempt, plan_one, model, node, replica, share, cluster, r)
        counts = [fixed] if fixed else microbatch_candidates(batch // r)
        within = dl.within(dl.left() / (len(options) - i))  # an equal part of what is left
        _layout(search, attempt, (d, r), counts, within)
    best = search.best
    if best is None and search.rejected is not None and search.last_error is None:
        raise search.rejected  # every layout's batch share was refused by the model
    if best is None:
        err = search.last_error
        raise InfeasiblePlanError(
            f"no layout of replicas × pipeline fits the memory caps: {'; '.join(search.tried)}",
            value=None if err is None else err.value,
            remedy=None if err is None else err.remedy,
        ) from err
    best.solver.notes.append("replicas × pipeline layouts tried: " + "; ".join(search.tried))
    return best
