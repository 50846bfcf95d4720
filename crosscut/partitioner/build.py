"""Builders between the torch-side objects and the plain PartitionProblem.

Two directions, one rule: the numbers the solver optimises are exactly the
numbers the plan records. ``plan_nodes`` turns an OpGraph and a CostTable into
:class:`PlanNode` records; ``problem_from_parts`` turns records plus a cluster
into a :class:`PartitionProblem`; ``plan_to_problem`` rebuilds the same problem
from a saved plan, so validation and the simulator recompute from the plan
alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from crosscut.errors import PlanError
from crosscut.ir.graph import OpGraph, OpNode
from crosscut.ir.plan import Plan, PlanCluster, PlanNode, PlanOptions
from crosscut.ir.problem import PartitionProblem, StageGroup
from crosscut.partitioner.shard import shard_kind

__all__ = [
    "CostLookup",
    "assigned_names",
    "batch_fed",
    "batch_major_value",
    "mixes_batch_value",
    "mixing_nodes",
    "plan_groups",
    "plan_nodes",
    "plan_to_problem",
    "problem_from_parts",
    "value_messages",
]


class CostLookup(Protocol):
    """What the builder needs from a cost table (``crosscut.cost_models.table.CostTable``)."""

    def fwd_s(self, name: str, kind: str) -> float: ...
    def bwd_s(self, name: str, kind: str) -> float: ...
    def bwd_split(self, name: str, kind: str) -> tuple[float, float] | None: ...
    def memory_rate(self, kind: str) -> float | None: ...
    def resident_bytes(self, name: str) -> int: ...
    def activation_bytes(self, name: str) -> int: ...
    def batch_scale(self, name: str) -> dict[str, dict[str, float]]: ...
    def channel_share_scale(self, name: str) -> dict[str, dict[str, float]]: ...


def plan_nodes(graph: OpGraph, costs: CostLookup, kinds: Sequence[str]) -> list[PlanNode]:
    """One PlanNode per graph node, with its time on every device kind in ``kinds``."""
    training = graph.mode == "train"
    reads: dict[str, list[tuple[str, str]]] = {}
    if graph.gm is not None:  # traced: torch is loaded already; plan readers never load it
        from crosscut.frontend.readers import fanout_reads

        reads = fanout_reads(graph.gm)
    mixing = mixing_nodes(graph)
    out: list[PlanNode] = []
    for n in graph.nodes:
        fwd = {k: 0.0 if n.is_io else costs.fwd_s(n.name, k) for k in sorted(set(kinds))}
        bwd = {k: 0.0 if n.is_io or not training else costs.bwd_s(n.name, k) for k in fwd}
        shard, channels = shard_kind(graph, n)
        split = {k: costs.bwd_split(n.name, k) for k in bwd} if training and not n.is_io else {}
        out.append(
            PlanNode(
                name=n.name,
                op=n.op,
                kind=n.kind,
                target=n.target,
                inputs=list(n.inputs),
                out_bytes=int(n.out_bytes),
                resident_bytes=0 if n.is_io else int(costs.resident_bytes(n.name)),
                activation_bytes=0 if n.is_io else int(costs.activation_bytes(n.name)),
                time_s={k: fwd[k] + bwd[k] for k in fwd},
                bwd_s=bwd if training else {},
                bwd_split={k: list(p) for k, p in split.items() if p is not None},
                module_path=n.module_path,
                param_bytes=0 if n.is_io else int(n.param_bytes),
                shard=shard,
                channels=channels,
                batch_major=batch_major_value(n, graph.batch_size),
                mixes_batch=n.name in mixing,
                messages=value_messages(n),
                fanout=[[r, p] for r, p in reads.get(n.name, [])],
                batch_scale={} if n.is_io else costs.batch_scale(n.name),
                channel_scale={} if n.is_io else costs.channel_share_scale(n.name),
            )
        )
    return out


def batch_major_value(node: OpNode, batch: int) -> bool:
    """Whether a node's value is tensors only (one, or a tuple of them), each with the
    (micro-)batch as dim 0: what a batch split joins by concatenating its shares'."""
    shapes = node.shapes
    return (
        not node.non_tensor
        and bool(shapes)
        and all(len(s) >= 1 and int(s[0]) == batch for s in shapes)
    )


def mixes_batch_value(node: OpNode, inputs: Sequence[OpNode], batch: int) -> bool:
    """Whether ``node`` computes a tensor from several samples of the batch (a mean over the
    batch, a concatenation along it, a 0-d loss): each share of a batch split would compute
    it from its own rows, so no batch-split stage may hold it.

    ``inputs``: the producers it reads that carry the batch (traced from a model input).
    Read from shapes: an output with the batch as dim 0 keeps rows per sample (batch norm,
    which mixes inside, is the runtime's documented per-share contract), and so does one
    that folds the batch into dim 0 with every element kept (a window partition's
    ``(B·n, ...)`` reshape). An op that keeps the shape but mixes rows (a softmax over dim 0,
    a permutation of the batch) is read from its call instead (``frontend/batch_dims.py``)."""
    if batch <= 1 or node.non_tensor or not node.shapes:
        return False
    sizes = {
        math.prod(s)
        for u in inputs
        if not u.non_tensor
        for s in u.shapes
        if s and int(s[0]) == batch
    }
    if not sizes:
        return False
    for s in node.shapes:
        if s and int(s[0]) == batch:
            continue
        if s and int(s[0]) % batch == 0 and math.prod(s) in sizes:
            continue
        return True
    return False


def mixing_nodes(graph: OpGraph) -> set[str]:
    """The nodes of ``graph`` that compute a tensor from several samples of the batch: by
    their shapes (:func:`mixes_batch_value`), or by a call along dim 0 that keeps the
    batch's size (``frontend/batch_dims.py``, where the graph was traced here)."""
    fed, by_name = batch_fed(graph), {n.name: n for n in graph.nodes}
    along: set[str] = set()
    if graph.gm is not None:
        from crosscut.frontend.batch_dims import batch_dim_ops

        along = batch_dim_ops(graph.gm, graph.batch_size)
    along |= set(graph.row_mixing or ())  # found by running them (frontend/row_probe.py)
    return {
        n.name
        for n in graph.nodes
        if (n.name in along and n.name in fed)
        or mixes_batch_value(n, [by_name[i] for i in n.inputs if i in fed], graph.batch_size)
    }


def batch_fed(graph: OpGraph) -> set[str]:
    """Nodes computed from a model input, directly or not (not from parameters alone)."""
    fed: set[str] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or any(i in fed for i in n.inputs):
            fed.add(n.name)
    return fed


def value_messages(node: OpNode) -> int:
    """The messages a node's value crosses a cut as, each way: one per tensor leaf.

    ``OpNode.shapes`` holds one shape per tensor leaf of the traced value, the
    same pytree flattening ``runtime/dist/p2p.build_routes`` posts a message
    for (a tuple of three tensors is three messages; a list of tensors
    passed between layers is one value per producing node, each its own
    transfer). A value with no tensor (``x.size(0)``) sends no message at run
    time but is priced as one: a conservative floor that keeps every transfer
    at least one latency, as before messages were counted.
    """
    return max(1, len(node.shapes))


def assigned_names(nodes: Sequence[PlanNode]) -> list[str]:
    """The nodes a plan assigns: everything but placeholders and the output.

    Inputs are delivered by the runtime to whichever stages read them and the
    output is gathered from wherever it is produced, so neither is placed.
    """
    return [n.name for n in nodes if n.op not in ("placeholder", "output")]


def problem_from_parts(
    nodes: Sequence[PlanNode],
    cluster: PlanCluster,
    options: PlanOptions,
    *,
    training: bool,
    ties: Sequence[Sequence[str]] = (),
    batch: int = 0,
) -> PartitionProblem:
    """The PartitionProblem over the assigned nodes of ``nodes``.

    ``batch`` (samples per micro-batch) prices uneven batch splits; the cross-shaped
    fields come from the nodes and from ``options.widths/splits``."""
    names = assigned_names(nodes)
    index = {name: i for i, name in enumerate(names)}
    by_name = {n.name: n for n in nodes}
    kinds = [d.kind for d in cluster.devices]
    again = options.recompute and training
    compute: list[list[float]] = []
    for name in names:
        node = by_name[name]
        missing = [k for k in kinds if k not in node.time_s]
        if missing:
            raise PlanError(
                f"node {name!r} has no cost for device kind(s) {missing}",
                value=sorted(node.time_s),
                remedy="re-run `crosscut partition` for this cluster so every kind is priced",
            )
        times = [float(node.time_s[k]) for k in kinds]
        if again:  # the forward runs twice: once in the pipeline, once inside backward
            times = [t + max(0.0, t - node.bwd_s.get(k, 0.0)) for t, k in zip(times, kinds)]
        compute.append(times)
    edges = sorted(
        {
            (index[src], index[n.name])
            for n in nodes
            if n.name in index
            for src in n.inputs
            if src in index
        }
    )
    readers: dict[str, list[int]] = {
        n.name: sorted({index[c.name] for c in nodes if c.name in index and n.name in c.inputs})
        for n in nodes
        if n.op == "placeholder"
    }
    returned = sorted({index[i] for n in nodes if n.op == "output" for i in n.inputs if i in index})
    return PartitionProblem(
        names=names,
        compute=compute,
        resident=[by_name[n].resident_bytes for n in names],
        activation=[by_name[n].activation_bytes for n in names],
        out_bytes=[by_name[n].out_bytes for n in names],
        edges=edges,
        devices=[d.name for d in cluster.devices],
        mem_cap=[d.mem_cap for d in cluster.devices],
        bandwidth=[list(map(float, row)) for row in cluster.bandwidth],
        latency=[list(map(float, row)) for row in cluster.latency],
        ties=[[index[n] for n in group if n in index] for group in ties if len(group) > 1],
        microbatches=options.microbatches,
        schedule=options.schedule,
        objective=options.objective,
        training=training,
        overlap_comm=options.overlap_comm,
        recompute=again,
        widths=tuple(options.widths) or (1,),
        splits=tuple(options.splits),
        shard=[by_name[n].shard for n in names],
        channels=[by_name[n].channels for n in names],
        param_bytes=[by_name[n].param_bytes for n in names],
        batch_major=[by_name[n].batch_major for n in names],
        mixes_batch=[by_name[n].mixes_batch for n in names],
        messages=[by_name[n].messages for n in names],
        fanout=_fanout([by_name[n] for n in names], index),
        batch=batch,
        graph_inputs=[(by_name[p].out_bytes, cs) for p, cs in readers.items() if cs],
        graph_outputs=returned,
        share_compute=_share_compute([by_name[n] for n in names], kinds, compute, options, batch),
        channel_compute=_channel_compute([by_name[n] for n in names], kinds, compute, options),
    )


def _fanout(nodes: Sequence[PlanNode], index: dict[str, int]) -> dict[int, list[tuple[int, int]]]:
    """``PartitionProblem.fanout`` from the nodes' ``fanout`` records, by problem index.

    A record naming a node the problem does not place is dropped whole: its
    value is then priced once per stage, as before fan-out was priced.
    """
    out: dict[int, list[tuple[int, int]]] = {}
    for v, node in enumerate(nodes):
        if node.fanout and all(r in index and p in index for r, p in node.fanout):
            out[v] = [(index[r], index[p]) for r, p in node.fanout]
    return out


def _share_compute(
    nodes: Sequence[PlanNode],
    kinds: Sequence[str],
    compute: list[list[float]],
    options: PlanOptions,
    batch: int,
) -> dict[int, list[list[float]]]:
    """``PartitionProblem.share_compute``: per batch-split width, each node's share on
    each device at its own ``ceil(batch / w)`` samples (``compute × share × scale``).

    A scale under 1 is taken as 1: a share never costs less than its linear part (time
    per sample does not grow with the batch), which keeps the solvers' work bounds
    valid. Widths whose share size no node was priced at are left out (linear)."""
    out: dict[int, list[list[float]]] = {}
    if "batch" not in options.splits or batch <= 0:
        return out
    for w in sorted(set(options.widths)):
        samples = math.ceil(batch / w)
        key = str(samples)
        if w <= 1 or samples >= batch or not any(key in n.batch_scale for n in nodes):
            continue
        out[w] = _scaled(
            kinds,
            compute,
            [samples / batch] * len(nodes),
            [n.batch_scale.get(key, {}) for n in nodes],
        )
    return out


def _channel_compute(
    nodes: Sequence[PlanNode],
    kinds: Sequence[str],
    compute: list[list[float]],
    options: PlanOptions,
) -> dict[int, list[list[float]]]:
    """``PartitionProblem.channel_compute``: per channel-split width, each shared node's
    shard on each device (``compute × share × scale``, the share of its channels; a
    scale under 1 taken as 1, as for batch shares). Widths no node has a scale for are
    left out (linear); ``full`` nodes are not shared (node_compute prices them whole)."""
    out: dict[int, list[list[float]]] = {}
    if "channel" not in options.splits:
        return out
    for w in sorted(set(options.widths)):
        key = str(w)
        if w <= 1 or not any(key in n.channel_scale for n in nodes):
            continue
        out[w] = _scaled(
            kinds,
            compute,
            [math.ceil(n.channels / w) / n.channels if n.channels > 0 else 1.0 / w for n in nodes],
            [n.channel_scale.get(key, {}) for n in nodes],
        )
    return out


def _scaled(
    kinds: Sequence[str],
    compute: list[list[float]],
    fractions: list[float],
    scales: list[dict[str, float]],
) -> list[list[float]]:
    """``compute[v][d] × fractions[v] × scales[v][kind of d]``, a scale under 1 taken as
    1 (a share never costs less than its linear part, so the solvers' bounds hold)."""
    return [
        [t * f * max(1.0, by_kind.get(k, 1.0)) for t, k in zip(row, kinds)]
        for row, f, by_kind in zip(compute, fractions, scales)
    ]


def plan_groups(plan: Plan) -> list[StageGroup] | None:
    """Every stage's device group, or None when each stage is one device (a pipeline)."""
    if all(len(stage.devices) == 1 for stage in plan.stages):
        return None
    return [
        StageGroup(tuple(plan.cluster.index(d) for d in stage.devices), stage.split)
        for stage in plan.stages
    ]


def plan_to_problem(plan: Plan) -> tuple[PartitionProblem, list[int], list[int]]:
    """The problem a plan solves, and its solution as (stage_of, stage_device) lists.

    Recomputation is priced per stage, as the plan's stages say (not by
    ``options.recompute``, which records what the solve assumed): all or none
    gives the solver's own problem; a mix prices the extra forward on the
    recomputing stages' nodes only (``PartitionProblem.stage_recompute``).
    """
    training = plan.model.mode == "train"
    flags = [stage.recompute and training for stage in plan.stages]

    def build(recompute: bool) -> PartitionProblem:
        return problem_from_parts(
            plan.nodes,
            plan.cluster,
            replace(plan.options, recompute=recompute),
            training=training,
            ties=plan.ties,
            batch=plan.model.batch_size // max(1, plan.options.microbatches),
        )

    every = bool(flags) and all(flags)
    problem = build(every)
    stage_of = [plan.assignment[name] for name in problem.names]
    stage_device = [plan.cluster.index(stage.devices[0]) for stage in plan.stages]
    if any(flags) and not every:
        again = build(True)
        compute = [
            again.compute[v] if flags[k] else problem.compute[v] for v, k in enumerate(stage_of)
        ]
        problem = replace(problem, compute=compute, stage_recompute=tuple(flags))
    return problem, stage_of, stage_device
