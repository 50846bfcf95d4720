"""partition_graph: from a priced OpGraph and a Cluster to a validated Plan.

The steps, each a plain function elsewhere: coarsen the graph (chains no
sensible plan separates), build the PartitionProblem on the coarse nodes, solve
it, expand the answer to the original nodes, and record everything — the plan is
reported on the original graph and its predictions are recomputed from the plan
itself (``annotate``), never copied from the solver, so what a user reads is
what validation and the simulator check.

One :class:`~crosscut.partitioner.deadline.Deadline` covers the call (the API
makes it before tracing; ``options.time_limit_s`` otherwise): a cross-shaped
solve gives the pipeline-only CP-SAT ``PIPELINE_SHARE`` of it and the group DP
the rest, ``recompute="auto"`` holds ``AUTO_RESERVE`` back for a second solve,
and ``FINAL_RESERVE`` stays for expanding and annotating the plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from crosscut.errors import InfeasiblePlanError, InputError, PartitionError
from crosscut.ir.graph import OpGraph
from crosscut.ir.plan import (
    ModelInfo,
    Plan,
    PlanCluster,
    PlanDevice,
    PlanNode,
    PlanOptions,
    PlanStage,
    PricedRate,
    SolverRecord,
)
from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.build import CostLookup, plan_nodes, problem_from_parts
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import lower_bound
from crosscut.partitioner.recompute_choice import keep_needed, plan_objective
from crosscut.partitioner.solvers import PIPELINE_SHARE, SolveResult, SolveSettings, solve
from crosscut.partitioner.solvers.cross import solve_cross

__all__ = ["partition_graph", "plan_cluster"]


def plan_cluster(cluster: Any, costs: CostLookup | None = None) -> PlanCluster:
    """The plan's copy of a ``crosscut.cost_models.cluster.Cluster`` (plain data).

    A device kind that ``costs`` profiled takes the memory rate measured there:
    the update and gradient accumulation the simulator prices run at it."""
    rates = {d.kind: costs.memory_rate(d.kind) if costs is not None else None
             for d in cluster.devices}  # fmt: skip
    return PlanCluster(
        devices=[
            PlanDevice(
                name=d.name,
                kind=d.kind,
                device=d.device,
                mem_cap=int(d.mem_cap),
                peak_flops=float(d.peak("float32")),
                mem_bw=float(rates[d.kind] or d.mem_bw),
            )
            for d in cluster.devices
        ],
        bandwidth=[[float(x) for x in row] for row in cluster.bandwidth],
        latency=[[float(x) for x in row] for row in cluster.latency],
        name=str(getattr(cluster, "name", "")),
        nodes=int(getattr(cluster, "nodes", 1)),
        network=[float(v) for v in getattr(cluster, "network", (0.0, 0.0))],
        network_name=str(getattr(cluster, "network_name", "")),
        nics=int(getattr(cluster, "nics", 1)),
    )


def _coarse_nodes(
    coarse: OpGraph, members: dict[str, list[str]], fine: dict[str, PlanNode]
) -> list[PlanNode]:
    """PlanNodes of the coarse graph: members' times and memory summed."""
    owner = {m: c for c, ms in members.items() for m in ms}
    out: list[PlanNode] = []
    for cn in coarse.nodes:
        group = [fine[m] for m in members.get(cn.name, [cn.name])]
        # a chain's fanned-out member hands its value to the chain's end (nn.Identity);
        # the first one's readers are all of them (coarsen keeps branches apart)
        fan = next((g.fanout for g in group if g.fanout), [])
        kinds = group[0].time_s.keys()
        out.append(
            PlanNode(
                name=cn.name,
                op=cn.op,
                kind=cn.kind,
                target=cn.target,
                inputs=list(cn.inputs),
                out_bytes=group[-1].out_bytes,
                resident_bytes=sum(g.resident_bytes for g in group),
                activation_bytes=sum(g.activation_bytes for g in group),
                time_s={k: sum(g.time_s[k] for g in group) for k in kinds},
                bwd_s={k: sum(g.bwd_s.get(k, 0.0) for g in group) for k in kinds},
                bwd_split=_group_split(group, kinds),
                # conservative: a member's value may be what leaves the coarse node
                batch_major=all(g.batch_major for g in group),
                mixes_batch=any(g.mixes_batch for g in group),
                messages=group[-1].messages,  # what leaves it: its last member's value
                fanout=[[owner.get(r, r), owner.get(p, p)] for r, p in fan],
            )
        )
    return out


def _group_split(group: list[PlanNode], kinds: Any) -> dict[str, list[float]]:
    """A coarse node's split backward: its members' B and W seconds over their backward
    (a member without a measured split keeps its whole backward in B); empty where no
    member was measured on a kind."""
    out: dict[str, list[float]] = {}
    for k in kinds:
        if not any(k in g.bwd_split for g in group):
            continue
        total = sum(g.bwd_s.get(k, 0.0) for g in group)
        b = sum(g.bwd_s.get(k, 0.0) * g.bwd_split.get(k, [1.0, 0.0])[0] for g in group)
        w = sum(g.bwd_s.get(k, 0.0) * g.bwd_split.get(k, [1.0, 0.0])[1] for g in group)
        if total > 0:
            out[k] = [b / total, w / total]
    return out


# "auto" also tries recomputation when a device of the plain plan is this full: memory
# then likely shaped the plan, and a plan that recomputes may be faster
_MEMORY_BOUND = 0.9
# of the time left, held back by recompute="auto" for the solve with recomputation
AUTO_RESERVE = 0.25
# of the time limit, kept for expanding, annotating and simulating the plan
FINAL_RESERVE = 0.03


def priced_rates(costs: CostLookup, kinds: list[str], precision: str) -> list[PricedRate]:
    """What each device kind in ``kinds`` was priced at, from the cost table's record.

    Analytic and profiled tables record it per kind (``meta["priced"]``); a
    table without the record (a lookup built by hand, a profile cached before
    it existed) still says how it was priced, from its ``source``."""
    meta = getattr(costs, "meta", {}) or {}
    priced = meta.get("priced", {}) if isinstance(meta, dict) else {}
    source = str(getattr(costs, "source", "analytic"))
    out: list[PricedRate] = []
    for kind in dict.fromkeys(kinds):
        rec = priced.get(kind)
        if isinstance(rec, dict):
            out.append(PricedRate(**{k: rec[k] for k in rec if k in _RATE_FIELDS}))
        elif source in ("profiled", "mixed"):
            out.append(PricedRate(kind, "", [f"as run under {precision}"], "profiled", "profiled"))
        else:
            out.append(PricedRate(kind, "", [], f"{source} costs: no record of their rates"))
    return out


_RATE_FIELDS = ("kind", "preset", "math", "efficiency", "costs")


def partition_graph(
    graph: OpGraph,
    costs: CostLookup,
    cluster: Any,
    options: PlanOptions,
    *,
    settings: SolveSettings | None = None,
    input_shapes: list[list[int]] | None = None,
    use_coarsening: bool = True,
    recompute: str = "never",
) -> Plan:
    """Solve the partition of ``graph`` (traced at micro-batch size) over ``cluster``.

    ``settings``: how to solve (solver, require_all_devices, progress,
    colocate, ...). The seed and the time limit are the plan's, so they come
    from ``options`` (``options.seed``, ``options.time_limit_s``), not from
    ``settings``; ``settings.deadline`` (the caller's, covering tracing too)
    defaults to ``options.time_limit_s`` from now, and the call returns by it
    (module docstring).

    ``recompute``: ``"never"`` keeps every activation; ``"always"`` makes every
    stage keep only its inputs and one micro-batch of activations, paying one
    more forward in backward; ``"auto"`` solves without, and with recomputation
    only where that could help: when no plan fits without it, or when the
    plain plan fills a device past 90 % (memory then shaped it). The plan
    solved with recomputation then keeps it only on the stages that do not fit
    without it (:func:`~crosscut.partitioner.recompute_choice.keep_needed`), and
    "auto" keeps the faster of the two plans, saying why in the solver notes.
    Inference never recomputes. ``"never"`` is exactly the plan of a planner
    that knows nothing of recomputation.
    """
    if not any(n.op not in ("placeholder", "output", "get_attr") for n in graph.nodes):
        raise InputError(
            "the model computes nothing to place: its forward returns its inputs (or "
            "constants) without an operation",
            value=graph.model_name or "model",
            remedy="partition a model whose forward runs at least one op",
        )
    s = settings or SolveSettings()
    dl = Deadline.of(s.deadline, options.time_limit_s)

    def once(again: bool, within: Deadline) -> Plan:
        return _partition_once(
            graph,
            costs,
            cluster,
            dataclasses.replace(options, recompute=again),
            dataclasses.replace(s, deadline=within, seed=options.seed),
            input_shapes=input_shapes,
            use_coarsening=use_coarsening,
        )

    if graph.mode != "train" or recompute == "never":
        return once(False, dl)
    if recompute == "always":
        return once(True, dl)
    return _auto_recompute(once, dl)


def _auto_recompute(once: Callable[[bool, Deadline], Plan], dl: Deadline) -> Plan:
    """``recompute="auto"`` (see :func:`partition_graph`): ``once(recompute, deadline)``
    solves with or without recomputation; the reasons go into the plan's notes."""
    # the first solve leaves AUTO_RESERVE for a second one where "auto" may need it
    first = dl.before(AUTO_RESERVE * dl.left())

    def per_stage() -> Plan:
        plan = once(True, dl)
        keep_needed(plan)
        return plan

    try:
        plain = once(False, first)
    except PartitionError as exc:  # proved infeasible, or no plan within the time limit
        try:
            plan = per_stage()
        except PartitionError as again:
            raise type(again)(
                f"{again.rule} (tried with and without recomputation)",
                value=again.value,
                remedy=again.remedy,
            ) from exc
        which = [k for k, st in enumerate(plan.stages) if st.recompute]
        why = (
            "no plan fits the memory caps without recomputation"
            if isinstance(exc, InfeasiblePlanError)
            else "no plan without recomputation was found within the time limit"
        )
        plan.solver.notes.append(
            f"recompute='auto': {why}, so stage(s) {which} keep only their inputs and "
            "recompute in backward"
        )
        return plan
    fullest = max(
        (
            plain.predicted.device_peak_bytes.get(d.name, 0) / d.mem_cap
            for d in plain.cluster.devices
        ),
        default=0.0,
    )
    if fullest < _MEMORY_BOUND:
        return plain
    try:
        plan = per_stage()
    except InfeasiblePlanError:
        return plain
    new, old = plan_objective(plan), plan_objective(plain)
    if new < old * (1 - 1e-9):
        plan.solver.notes.append(
            f"recompute='auto': recomputing on stage(s) "
            f"{[k for k, st in enumerate(plan.stages) if st.recompute]} gives {new:.6g} s "
            f"against {old:.6g} s without (a device was {fullest:.0%} full)"
        )
        return plan
    plain.solver.notes.append(
        f"recompute='auto': recomputing was tried (a device was {fullest:.0%} full) and "
        f"is not faster ({new:.6g} s against {old:.6g} s)"
    )
    return plain


@dataclasses.dataclass
class _Solved:
    """What the solve decided, on the original (fine) nodes, and what it is measured by."""

    result: SolveResult
    assignment: dict[str, int]  # node name -> stage
    groups: list[list[int]]  # device indices of every stage
    split_of: list[str]  # how every stage splits over its group ("none": one device)
    lb_problem: PartitionProblem  # the problem the solver record's lower bound is of
    coarse_nodes: int  # nodes the pipeline-only solve saw


def _partition_once(
    graph: OpGraph,
    costs: CostLookup,
    cluster: Any,
    options: PlanOptions,
    settings: SolveSettings,
    *,
    input_shapes: list[list[int]] | None,
    use_coarsening: bool,
) -> Plan:
    """One solve, with the recomputation setting in ``options``, by ``settings.deadline``."""
    assert settings.deadline is not None  # partition_graph always passes one
    work = settings.deadline.before(FINAL_RESERVE * settings.deadline.seconds)
    pc = plan_cluster(cluster, costs)
    fine = plan_nodes(graph, costs, [d.kind for d in pc.devices])
    solved = _solve(
        graph, fine, pc, options, dataclasses.replace(settings, deadline=work), use_coarsening
    )
    plan = _make_plan(graph, costs, pc, options, fine, solved, input_shapes)
    from crosscut.version import __version__

    plan.crosscut_version = __version__
    return annotate(plan)


def _solve(
    graph: OpGraph,
    fine: list[PlanNode],
    pc: PlanCluster,
    options: PlanOptions,
    settings: SolveSettings,
    use_coarsening: bool,
) -> _Solved:
    """The pipeline-only solve on the coarse graph; where cross-shaped stages are
    allowed, weighed against data parallelism and the group DP on the fine graph."""
    training = graph.mode == "train"
    work = settings.deadline
    assert work is not None
    if use_coarsening:
        from crosscut.partitioner.coarsen import coarsen

        coarse_graph, members = coarsen(graph)
    else:
        coarse_graph, members = graph, {n.name: [n.name] for n in graph.nodes}
    nodes = _coarse_nodes(coarse_graph, members, {n.name: n for n in fine})
    problem = problem_from_parts(nodes, pc, options, training=training, ties=coarse_graph.ties)
    problem = dataclasses.replace(problem, widths=(1,), splits=())  # the pipeline-only solve
    # with require_all_devices (a replica spanning nodes) groups still compete, among the
    # plans whose stages and groups hold every device (use_all below)
    cross = any(w > 1 for w in options.widths) and bool(options.splits)
    try:
        within = work.share(PIPELINE_SHARE) if cross else work
        piped: SolveResult | None = solve(problem, dataclasses.replace(settings, deadline=within))
    except PartitionError as exc:
        if not cross:
            raise
        # no pipeline fits (or none was found in time): groups may still fit, e.g. data
        # parallelism holding 1/256 of the batch's activations per device
        piped, pipe_error = None, exc
    assignment: dict[str, int] = {}
    stage_device = [] if piped is None else piped.stage_device
    for cname, stage in zip(problem.names, [] if piped is None else piped.stage_of):
        for member in members.get(cname, [cname]):
            assignment[member] = stage
    if not cross:
        assert piped is not None
        groups = [[d] for d in stage_device]
        return _Solved(piped, assignment, groups, ["none"] * len(groups), problem, problem.n)
    # cross-shaped: on the fine graph (its nodes know how they split), the
    # pipeline plan above competes with data parallelism and the group DP
    fine_pb = problem_from_parts(
        fine, pc, options, training=training, ties=graph.ties, batch=graph.batch_size
    )
    pipe = None if piped is None else ([assignment[n] for n in fine_pb.names], stage_device)
    found = solve_cross(
        fine_pb,
        pipe,
        pipeline_name=f"pipeline_{settings.solver}",
        seed=settings.seed,  # the plan records the seed it was asked for
        colocate=settings.colocate and not settings.require_all_devices,
        deadline=work,
        use_all=settings.require_all_devices,
    )
    if piped is None:
        found.notes.insert(0, f"no pipeline-only plan: {pipe_error}")
        result = found
    else:
        result = _merge(piped, found)
    assert found.groups is not None
    return _Solved(
        result,
        dict(zip(fine_pb.names, found.stage_of)),
        [list(g.devices) for g in found.groups],
        [g.split for g in found.groups],
        fine_pb,
        problem.n,
    )


def _make_plan(
    graph: OpGraph,
    costs: CostLookup,
    pc: PlanCluster,
    options: PlanOptions,
    fine: list[PlanNode],
    solved: _Solved,
    input_shapes: list[list[int]] | None,
) -> Plan:
    """The plan on the original graph, with the solver's record (before ``annotate``)."""
    training = graph.mode == "train"
    result = solved.result
    out_bytes = {n.name: n.out_bytes for n in fine}
    return Plan(
        model=ModelInfo(
            name=graph.model_name,
            fingerprint=graph.fingerprint(),
            batch_size=graph.batch_size * options.microbatches,
            input_shapes=input_shapes or [],
            mode=graph.mode,
            dtype=_dtype(graph),
        ),
        cluster=pc,
        options=options,
        nodes=fine,
        edges=[(src, dst, out_bytes[src]) for src, dst in graph.edges()],
        assignment=solved.assignment,
        stages=[
            PlanStage(
                index=k,
                devices=[pc.devices[d].name for d in group],
                split=solved.split_of[k],
                recompute=options.recompute and training,  # every stage, as the solve priced
            )
            for k, group in enumerate(solved.groups)
        ],
        ties=[list(t) for t in graph.ties],
        rates=priced_rates(costs, [d.kind for d in pc.devices], graph.precision),
        solver=SolverRecord(
            solver=result.solver,
            status=result.status,
            objective=result.objective,
            best_bound=result.best_bound,
            gap=result.gap,
            lower_bound=lower_bound(solved.lb_problem),
            wall_time_s=result.wall_time_s,
            seed=result.seed,
            workers=result.workers,
            coarse_nodes=solved.coarse_nodes,
            baselines={k: v for k, v in result.baselines.items() if math.isfinite(v)},
            notes=list(result.notes)
            + [
                f"baseline {k} is infeasible"
                for k, v in result.baselines.items()
                if not math.isfinite(v)
            ],
        ),
    )


def _merge(pipeline: SolveResult, cross: SolveResult) -> SolveResult:
    """The cross-shaped result, keeping the pipeline solve's record in its notes."""
    cross.wall_time_s += pipeline.wall_time_s
    cross.notes = [
        f"pipeline-only {pipeline.solver}: {pipeline.status}, objective "
        f"{pipeline.objective:.6g} s on the coarse graph (gap {pipeline.gap:.3g})",
        *pipeline.notes,
        *cross.notes,
    ]
    cross.baselines = {
        **{f"pipeline:{k}": v for k, v in pipeline.baselines.items()},
        **cross.baselines,
    }
    return cross


def _dtype(graph: OpGraph) -> str:
    for n in graph.nodes:
        if n.op == "placeholder":
            return n.dtype
    return "float32"
