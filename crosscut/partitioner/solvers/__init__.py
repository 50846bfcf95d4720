"""Solvers of the partition problem and the one front door, :func:`solve`.

Every solver takes a :class:`~crosscut.ir.problem.PartitionProblem`
(plain data, no torch) and returns a :class:`SolveResult` whose objective was
re-priced by :func:`crosscut.partitioner.evaluate.evaluate`.
"""

from __future__ import annotations

import dataclasses
import time

from crosscut.errors import InfeasiblePlanError, InputError, PartitionError
from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import evaluate, lower_bound
from crosscut.partitioner.solvers.baselines import all_baselines, device_order
from crosscut.partitioner.solvers.bruteforce import brute_force, brute_force_groups
from crosscut.partitioner.solvers.cpsat import infeasibility_report, solve_cpsat
from crosscut.partitioner.solvers.cross import solve_cross
from crosscut.partitioner.solvers.result import SolveResult, relative_gap
from crosscut.partitioner.solvers.settings import SolveSettings

__all__ = [
    "SOLVERS",
    "SolveResult",
    "SolveSettings",
    "brute_force",
    "solve",
    "solve_cpsat",
    "solve_cross",
]

SOLVERS = ("cpsat", "dp", "greedy", "brute")
# of the time limit, what a cross-shaped solve gives the pipeline-only plan; the group DP
# gets the rest (it stops at the deadline with the plans of the stage counts it finished)
PIPELINE_SHARE = 0.5


def solve(problem: PartitionProblem, settings: SolveSettings | None = None) -> SolveResult:
    """Partition ``problem`` with the solver ``settings.solver`` names.

    ``settings.progress(wall_s, objective_s, bound_s)`` is called for each new
    CP-SAT incumbent. ``require_all_devices`` forces one stage per device
    (raises PartitionError when there are fewer nodes than devices); otherwise
    a solver may leave devices idle when another stage would not pay, and says
    so in ``notes``.

    When ``problem.cross_shaped`` (widths > 1 and split kinds allowed), the
    named solver first finds the pipeline-only plan, then :func:`solve_cross`
    weighs it against data parallelism and the cross-shaped group DP
    (``solver="brute"``: brute force over the cross-shaped space).

    ``settings.deadline`` (shared with the caller) replaces ``time_limit``
    when given; either way every solver returns by it with its best plan so
    far (brute force excepted: it is for tiny problems).
    """
    s = settings or SolveSettings()
    dl = s.deadline_or_limit()
    if problem.cross_shaped:
        return _solve_cross_shaped(problem, s, dl)
    if s.solver not in SOLVERS:
        raise InputError(
            f"unknown solver {s.solver!r}", value=s.solver, remedy=f"use one of {SOLVERS}"
        )
    if s.require_all_devices and problem.n < problem.num_devices:
        raise PartitionError(
            "require_all_devices needs at least one node per device",
            value=f"{problem.n} nodes, {problem.num_devices} devices",
            remedy="drop require_all_devices or coarsen the graph less",
        )
    if s.solver == "cpsat":
        return solve_cpsat(problem, dataclasses.replace(s, deadline=dl))
    if s.solver == "brute":
        return brute_force(problem, require_all_devices=s.require_all_devices)
    return _solve_linear(problem, s, dl)


def _solve_cross_shaped(problem: PartitionProblem, s: SolveSettings, dl: Deadline) -> SolveResult:
    """The pipeline-only plan by the named solver, then :func:`solve_cross` (or brute force)."""
    if s.solver == "brute":
        return brute_force_groups(problem)
    plain = dataclasses.replace(problem, widths=(1,), splits=())
    # only what the pipeline-only solve has always been given (no progress, no log)
    pipe_settings = SolveSettings(
        solver=s.solver,
        seed=s.seed,
        workers=s.workers,
        deadline=dl.share(PIPELINE_SHARE),
        require_all_devices=s.require_all_devices,
    )
    try:
        pipe = solve(plain, pipe_settings)
        pipeline: tuple[list[int], list[int]] | None = (pipe.stage_of, pipe.stage_device)
    except (InfeasiblePlanError, PartitionError):  # (fewer nodes than devices to fill)
        pipeline = None
    return solve_cross(
        problem,
        pipeline,
        pipeline_name=f"pipeline_{s.solver}",
        seed=s.seed,
        deadline=dl,
        # every device a stage or a share: a replica spanning nodes (its ranks all run)
        colocate=s.colocate and not s.require_all_devices,
        use_all=s.require_all_devices,
    )


def _solve_linear(problem: PartitionProblem, s: SolveSettings, dl: Deadline) -> SolveResult:
    """The "dp" and "greedy" solvers: the linear baselines, the named one's plan."""
    solver = s.solver
    t0 = time.perf_counter()
    order = device_order(problem)
    min_stages = problem.num_devices if s.require_all_devices else 1
    plans = all_baselines(problem, order, min_stages=min_stages, deadline=dl)
    baselines = {name: evaluate(problem, *p).objective for name, p in plans.items()}
    # the DP's plan (greedy's), or the best linear baseline where the deadline cut it
    plan = plans.get("greedy" if solver == "greedy" else "chain_dp")
    if plan is None and plans:
        plan = plans[min(plans, key=lambda k: baselines[k])]
    if plan is None or len(plan[1]) < min_stages:
        raise InfeasiblePlanError(
            f"{solver} found no contiguous split that fits the memory caps",
            value=infeasibility_report(problem),
            remedy="try solver='cpsat' (non-contiguous splits), or add devices or memory",
        )
    obj = evaluate(problem, *plan).objective
    bound = min(lower_bound(problem), obj)
    return SolveResult(
        stage_of=plan[0],
        stage_device=plan[1],
        objective=obj,
        status="FEASIBLE",
        best_bound=bound,
        gap=relative_gap(obj, bound),
        wall_time_s=time.perf_counter() - t0,
        seed=s.seed,
        workers=1,
        solver=solver,
        baselines=baselines,
    )
