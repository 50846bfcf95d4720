"""CP-SAT partitioner: the exact solver, seeded and bounded by the baselines.

Flow: baselines (chain_dp, greedy, ...) give an incumbent; for every device
order worth distinguishing, an :class:`OrderModel` searches for a plan at most
as slow as the incumbent, hinted with it, its stage windows tightened by the
incumbent's value; every plan is re-priced by evaluate(). Orders: identical
devices on uniform links need one; otherwise every order up to 4 devices is
tried (exact), and above that a few sensible ones (heuristic; the bound then
only comes from :func:`lower_bound`).

Bounds: besides CP-SAT's own, :mod:`crosscut.partitioner.solvers.bounds`
gives two valid ones. The static bound (B) counts the transfers every plan
must make; and when small side trees make up a good share of the graph
(swin's relative-position-bias MLPs), CP-SAT first solves the problem without
them (a relaxation, their least cost charged to their consumers) for a share
of the time: its bound is valid here, its plan (each tree in its consumer's
stage) is an incumbent, and when the two meet the solve stops, optimal.

The time limit covers everything: baselines, the relaxation, building the
models; a small reserve is kept for re-pricing the answer. It is a
:class:`~crosscut.partitioner.deadline.Deadline` shared with the caller (or
made from ``time_limit``): the linear baselines always run (the fallback),
``chain_dp`` and ``greedy`` get at most ``BASELINE_SHARE`` of it, the
relaxation ``RELAX_SHARE``, the device orders the rest in equal parts; a
model is not built once the deadline is past (an order left unsearched makes
the status FEASIBLE or FALLBACK, never OPTIMAL).

Determinism: with ``workers=1`` the search is sequential, so a solve that ends
before its time limit (status OPTIMAL) returns the same plan every run; with
``deterministic=True`` the limit is CP-SAT's deterministic time, so time-limited
solves repeat too. ``workers>1`` runs CP-SAT's parallel portfolio: faster on
hard instances, but a time-limited answer may differ between runs. A
deterministic solve still stops at the wall-clock deadline (its answer then
depends on the machine's speed).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable

from ortools.sat.python import cp_model

from crosscut.errors import InfeasiblePlanError, PartitionError
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import check, evaluate, lower_bound, renumber
from crosscut.partitioner.problem import PartitionProblem
from crosscut.partitioner.solvers.baselines import Plan, all_baselines, device_order
from crosscut.partitioner.solvers.bounds import comm_lower_bound, tree_relaxation
from crosscut.partitioner.solvers.cpsat_model import OrderModel
from crosscut.partitioner.solvers.result import SolveResult, relative_gap

__all__ = ["candidate_orders", "infeasibility_report", "solve_cpsat"]

RESTART_SLICE_S = math.inf  # seconds before rebuilding with a tighter incumbent; inf = never
RELAX_SHARE = 0.25  # most of the time limit the side-tree relaxation may take
BASELINE_SHARE = 0.3  # most of it chain_dp and greedy may take (the linear baselines always run)
RELAX_MIN_REMOVED = 0.03  # ... and only when it removes at least this share of the nodes
ROUNDING_GAP = 1e-5  # a relative gap this small is the integer model's rounding: optimal
RESERVE_SHARE = 0.03  # of the time limit, kept for re-pricing and CP-SAT's own overshoot

Progress = Callable[[float, float, float], None]


def _interchangeable(pb: PartitionProblem) -> bool:
    d = pb.num_devices
    same_dev = all(len(set(row)) == 1 for row in pb.compute) and len(set(pb.mem_cap)) == 1
    links = {(pb.bandwidth[a][b], pb.latency[a][b]) for a in range(d) for b in range(d) if a != b}
    return same_dev and len(links) <= 1


def candidate_orders(pb: PartitionProblem) -> tuple[list[list[int]], bool]:
    """Device orders to search, and whether they cover every stage→device map."""
    primary = device_order(pb)
    if _interchangeable(pb):
        return [primary], True
    d = pb.num_devices
    if d <= 4:
        kind = {dev: (tuple(r[dev] for r in pb.compute), pb.mem_cap[dev]) for dev in range(d)}
        seen: set[tuple[object, ...]] = set()
        out: list[list[int]] = []
        for order in [tuple(primary), *itertools.permutations(range(d))]:
            sig = (
                tuple(kind[x] for x in order),
                tuple((pb.bandwidth[a][b], pb.latency[a][b]) for a in order for b in order),
            )
            if sig not in seen:
                seen.add(sig)
                out.append(list(order))
        return out, True
    speed = sorted(range(d), key=lambda x: (sum(r[x] for r in pb.compute), -pb.mem_cap[x], x))
    out = [primary]
    if speed != primary:
        out.append(speed)
    return out, False


def infeasibility_report(pb: PartitionProblem) -> str:
    """The numbers that make the problem infeasible (or look most like it)."""
    least = _least_in_flight(pb)
    need = [pb.resident[v] + least * pb.activation[v] for v in range(pb.n)]
    big = max(range(pb.n), key=lambda v: need[v]) if pb.n else 0
    total = sum(pb.resident) + least * sum(pb.activation)
    caps = ", ".join(f"{name}={cap}" for name, cap in zip(pb.devices, pb.mem_cap))
    return (
        f"{pb.n} nodes need at least {total} bytes in all (resident {sum(pb.resident)} + "
        f"activations {sum(pb.activation)} x {least} in flight) vs device caps {caps} "
        f"(sum {sum(pb.mem_cap)}); largest node {pb.names[big]!r} needs resident "
        f"{pb.resident[big]} + activation {pb.activation[big]} x {least} = {need[big]} bytes "
        f"vs largest cap {max(pb.mem_cap)}"
    )


_REMEDY = (
    "add devices or devices with more memory, use a smaller batch / more micro-batches, "
    "use the 1f1b schedule, recompute='auto' or 'always' (activation recomputation), "
    "or allow cross-shaped "
    "(channel-split) stages for nodes larger than one device"
)


def _least_in_flight(pb: PartitionProblem) -> int:
    """Micro-batches of activations any stage keeps at least (1F1B's last stage keeps 1)."""
    if not pb.training:
        return 0
    return 1 if pb.schedule == "1f1b" or pb.recompute else pb.microbatches


def _precheck(pb: PartitionProblem) -> None:
    least = _least_in_flight(pb)
    too_big = any(pb.resident[v] + least * pb.activation[v] > max(pb.mem_cap) for v in range(pb.n))
    if too_big or sum(pb.resident) > sum(pb.mem_cap):
        raise InfeasiblePlanError(
            "no assignment of the graph to the devices fits the memory caps",
            value=infeasibility_report(pb),
            remedy=_REMEDY,
        )


class _Callback(cp_model.CpSolverSolutionCallback):  # type: ignore[misc]
    """Reports each new incumbent as (wall seconds, objective s, bound s), and stops
    the search once one reaches ``target`` units (it then meets a proven bound)."""

    def __init__(self, progress: Progress | None, unit: float, t0: float, target: int) -> None:
        super().__init__()
        self._progress, self._unit, self._t0, self._target = progress, unit, t0, target

    def on_solution_callback(self) -> None:
        if self._progress is not None:
            self._progress(
                time.perf_counter() - self._t0,
                self.objective_value * self._unit,
                self.best_objective_bound * self._unit,
            )
        if self.objective_value <= self._target:
            self.stop_search()


def _meets(obj: float, bound: float, om: OrderModel) -> bool:
    """Whether ``obj`` is within the integer model's rounding of a proven ``bound``."""
    return obj - bound <= max(2 * om.slack * om.unit, ROUNDING_GAP * obj)


def _solver(
    workers: int, seed: int, seconds: float, deterministic: bool, wall: float
) -> cp_model.CpSolver:
    """A CpSolver limited to ``seconds`` (deterministic or wall) and ``wall`` wall seconds."""
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = workers
    prm.random_seed = seed
    if deterministic:
        prm.max_deterministic_time = seconds
    prm.max_time_in_seconds = max(wall if deterministic else min(seconds, wall), 0.005)
    return solver


def _relaxed_bound(
    pb: PartitionProblem, deadline: Deadline, seed: int, workers: int, hint: Plan | None
) -> float:
    d = pb.num_devices
    links = [(a, b) for a in range(d) for b in range(d) if a != b]
    bw = max((pb.bandwidth[a][b] for a, b in links), default=1.0)
    lat = min((pb.latency[a][b] for a, b in links), default=0.0)
    relaxed = dataclasses.replace(
        pb,
        compute=[[min(row)] * d for row in pb.compute],
        mem_cap=[max(pb.mem_cap)] * d,
        bandwidth=[[bw] * d for _ in range(d)],
        latency=[[lat] * d for _ in range(d)],
    )
    if deadline.expired():
        return 0.0  # no time left: the static bound stands
    try:
        # the best plan is feasible here too (faster devices, more memory): a hint, and
        # an incumbent that keeps the relaxed model small
        return solve_cpsat(
            relaxed, deadline=deadline, seed=seed, workers=workers, relax=False, hint=hint
        ).best_bound
    except PartitionError:
        return 0.0


def _side_tree_phase(
    pb: PartitionProblem,
    deadline: Deadline,
    seed: int,
    workers: int,
    deterministic: bool,
) -> tuple[float, Plan | None, str]:
    """(bound, plan or None, note) from the side-tree relaxation (module docstring)."""
    relaxation = tree_relaxation(pb)
    if relaxation is None or len(relaxation.kept) > (1 - RELAX_MIN_REMOVED) * pb.n:
        return 0.0, None, ""
    # the transfers every plan makes, counted on the relaxation: without the side trees
    # the first and last node of every stage are on the main path (module docstring)
    averaged = comm_lower_bound(relaxation.problem, floating=relaxation.floating)
    try:
        sub = solve_cpsat(
            relaxation.problem,
            deadline=deadline,
            seed=seed,
            workers=workers,
            deterministic=deterministic,
            relax=False,
            floating=relaxation.floating,
        )
    except PartitionError:  # no plan of the relaxation within its share
        return averaged, None, ""
    loads = evaluate(relaxation.problem, sub.stage_of, sub.stage_device).stage_time
    plan = renumber(relaxation.expand(sub.stage_of, loads), sub.stage_device)
    note = (
        f"side-tree relaxation ({pb.n - len(relaxation.kept)} of {pb.n} nodes removed): "
        f"{sub.status}, bound {sub.best_bound:.6g} s in {sub.wall_time_s:.2f} s, "
        f"averaged transfer bound {averaged:.6g} s"
    )
    return max(sub.best_bound, averaged), plan, note


def solve_cpsat(
    problem: PartitionProblem,
    *,
    time_limit: float = 10.0,
    seed: int = 0,
    workers: int = 1,
    hint: Plan | None = None,
    log_callback: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    require_all_devices: bool = False,
    deterministic: bool = False,
    relax: bool = True,
    floating: float = 0.0,
    deadline: Deadline | None = None,
) -> SolveResult:
    """Solve the partition problem with CP-SAT; see the module docstring.

    ``relax=False`` skips the side-tree relaxation (it is itself solved that
    way); ``floating`` (seconds) is compute the problem leaves out that some
    stage must still run (a relaxation's, see ``bounds.tree_relaxation``).
    ``deadline`` (shared with the caller) replaces ``time_limit`` when given.
    """
    t0 = time.perf_counter()
    dl = Deadline.of(deadline, time_limit)
    time_limit = dl.left()  # this solve's budget, for the shares below
    # everything but re-pricing the answer stops here (also CP-SAT's own overshoot)
    work = dl.before(RESERVE_SHARE * time_limit)
    pb = problem
    if require_all_devices and pb.n < pb.num_devices:
        raise PartitionError(
            "require_all_devices needs at least one node per device",
            value=f"{pb.n} nodes, {pb.num_devices} devices",
            remedy="drop require_all_devices or coarsen the graph less",
        )
    _precheck(pb)
    orders, exhaustive = candidate_orders(pb)
    min_stages = pb.num_devices if require_all_devices else 1
    plans = all_baselines(pb, orders[0], min_stages=min_stages, deadline=work.share(BASELINE_SHARE))
    if hint is not None and not check(pb, *hint) and len(hint[1]) >= min_stages:
        plans["hint"] = hint
    baselines = {name: evaluate(pb, *plan).objective for name, plan in plans.items()}
    best: Plan | None = None
    best_obj = math.inf
    for name, plan in plans.items():
        if baselines[name] < best_obj:
            best, best_obj = plan, baselines[name]
    notes: list[str] = []
    static_lb = max(lower_bound(pb, pb.num_devices), comm_lower_bound(pb))
    if relax:
        sub_lb, sub_plan, note = _side_tree_phase(
            pb, work.share(RELAX_SHARE), seed, workers, deterministic
        )
        static_lb = max(static_lb, sub_lb)
        notes += [note] if note else []
        if sub_plan is not None and len(sub_plan[1]) >= min_stages and not check(pb, *sub_plan):
            obj = evaluate(pb, *sub_plan).objective
            if obj < best_obj:
                best, best_obj = sub_plan, obj
    bounds: list[float] = []
    proved = True
    found = False
    runs = len(orders) + (0 if exhaustive else 1)
    met = False  # the incumbent meets the static bound: optimal over every order
    build_s = 0.0  # the last model build's seconds: a build that would overrun is skipped
    for i, order in enumerate(orders):
        if met:
            bounds.append(static_lb)
            continue
        order_dl = work.within(work.left() / (runs - i))
        order_bound = static_lb
        slice_s = RESTART_SLICE_S
        while True:
            if work.left() <= build_s:  # (the first build always runs, unless time is up)
                proved = False
                break
            # restart loop: a better incumbent tightens the stage windows, so a rebuilt
            # model is smaller (off by default: measured slower, it forgets what it learnt)
            t_build = time.perf_counter()
            om = OrderModel(pb, order, best_obj, require_all=require_all_devices)
            om.floating, om.deadline = floating, work
            om.build()
            build_s = time.perf_counter() - t_build
            if om.skipped:  # the model would not be built in time
                proved = False
                break
            if om.empty:  # no plan in this order beats the incumbent
                order_bound = max(order_bound, best_obj)
                break
            if _meets(best_obj, static_lb, om):
                met = True  # the incumbent meets a proven bound: optimal to the rounding
                break
            budget = max(order_dl.left(), 0.005)  # after the build: it counts
            last = budget <= 2 * slice_s
            m = om.model
            # (B) objective >= the static lower bound
            m.add(om.objective_var >= max(0, math.floor(static_lb / om.unit) - om.slack))
            if best is not None and best[1] == order[: len(best[1])]:
                om.add_hint(best[0])
            solver = _solver(workers, seed, budget if last else slice_s, deterministic, work.left())
            if log_callback is not None:
                solver.parameters.log_search_progress = True
                solver.log_callback = log_callback
            target = math.floor(static_lb * (1 + ROUNDING_GAP) / om.unit)
            status = solver.solve(m, _Callback(progress, om.unit, t0, target))
            improved = False
            if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                found = True
                plan = renumber(om.stage_of(solver), order[: min(len(order), pb.n)])
                if not check(pb, *plan):
                    obj = evaluate(pb, *plan).objective
                    if best is None or obj < best_obj * (1 - 1e-9):
                        best, best_obj, improved = plan, obj, True
                bnd = (solver.best_objective_bound - om.slack) * om.unit
                order_bound = max(order_bound, bnd)
                if status == cp_model.OPTIMAL:
                    break
                if _meets(best_obj, static_lb, om):
                    met = True  # stopped by the callback at the proven bound
                    break
            elif status == cp_model.INFEASIBLE:
                order_bound = max(order_bound, best_obj)
                break
            if last:
                proved = False
                break
            if not improved:
                slice_s *= 2
        bounds.append(order_bound)
    if not proved and work.expired():
        notes.append("the deadline came before every device order was searched to the end")
    if not exhaustive and not met:
        # a relaxation valid for every device order: each node on its fastest device,
        # the largest cap everywhere, the fastest link between every pair
        bounds = [_relaxed_bound(pb, work, seed, workers, best)]
    wall = time.perf_counter() - t0
    if best is None:
        if proved:
            raise InfeasiblePlanError(
                "no assignment of the graph to the devices fits the memory caps",
                value=infeasibility_report(pb),
                remedy=_REMEDY,
            )
        raise PartitionError(
            f"no plan found within the time limit of {time_limit} s and no baseline fits memory",
            value=infeasibility_report(pb),
            remedy="raise the time limit; " + _REMEDY,
        )
    bound = max(static_lb, min(bounds, default=static_lb))
    bound = min(bound, best_obj)
    if proved and (exhaustive or met):
        status_s = "OPTIMAL"
    elif found:
        status_s = "FEASIBLE"
    else:
        status_s = "FALLBACK"
        notes.append("CP-SAT found no plan within the time limit: returning the best baseline")
    if not exhaustive:
        notes.append(f"searched {len(orders)} device orders of {pb.num_devices}! (heuristic)")
    stage_of, stage_device = best
    if len(stage_device) < pb.num_devices:
        notes.append(
            f"uses {len(stage_device)} of {pb.num_devices} devices: another stage does not pay"
        )
    return SolveResult(
        stage_of=stage_of,
        stage_device=stage_device,
        objective=best_obj,
        status=status_s,
        best_bound=bound,
        gap=relative_gap(best_obj, bound),
        wall_time_s=wall,
        seed=seed,
        workers=workers,
        solver="cpsat",
        baselines=baselines,
        notes=notes,
    )
