"""Re-cut a solved pipeline into interleaved stages: ``V`` smaller stages per device.

An interleaved schedule (``"1f1b-v2"``: :func:`crosscut.ir.schedule.interleaved_1f1b`)
gives each of a pipeline's ``S`` devices ``V`` stages, placed round-robin:
stage ``k`` of ``S × V`` runs on the device of the solved plan's stage
``k % S`` (``"zbv"``: in a V, :func:`crosscut.ir.schedule.placement`). A
micro-batch then visits every device ``V`` times, a ``1/V`` slice of the work
each time, and the warm-up and cool-down bubble shrinks by about
``V``, at the price of ``V``× the stage boundaries (transfers) and more
micro-batches in flight per device.

Why a re-cut and not a CP-SAT solve: the partition model prices one stage per
device (or co-located groups), and the bottleneck it minimises is the device
load, which interleaving does not change. So the planner keeps the CP-SAT
plan's device path and cuts the topological node order into ``S × V``
contiguous chunks (contiguous chunks of a topological order never send a value
backwards), first at the cumulative-time targets that give every device the
same share at its speed, then moving one cut at a time while the evaluator's
bottleneck (device load with transfers) falls and every memory cap holds. It
is a heuristic and the plan says so in its solver notes; the simulator prices
the result under the schedule, and :mod:`~crosscut.partitioner.schedule_choice`
keeps it only when its step is the shortest that fits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np

from crosscut.errors import PartitionError
from crosscut.ir.plan import Plan, PlanStage
from crosscut.ir.schedule import V_SHAPED, placement, virtual_stages
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.build import plan_to_problem
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import check, evaluate
from crosscut.partitioner.replicas import check_replica_exports
from crosscut.partitioner.solvers.baselines import allowed_cuts, chunked, snap_cuts

__all__ = ["interleave"]

# cut moves tried at most (each one evaluate() call, linear in the graph)
_MAX_MOVES = 400
# nodes that run nothing of their own: a stage of only these has no code (codegen/split.py)
_NOT_OPS = ("placeholder", "get_attr", "output")


def interleave(plan: Plan, schedule: str, deadline: Deadline | None = None) -> Plan | None:
    """``plan`` re-cut into ``S × V`` stages for ``schedule`` (``"1f1b-vV"``, ``"zbv"``), placed
    as :func:`~crosscut.ir.schedule.placement` says.

    ``None`` when there is nothing to interleave (inference, one stage, a
    stage on a device group, fewer nodes than stages), no re-cut fits the
    memory caps, or replicas could not join what a new cut hands on. The
    returned plan is a new object, annotated (priced and simulated); ``plan``
    is not changed.

    ``deadline``: when it passes, the cut moves stop and the best re-cut so far
    is priced (the plan's note says how many moves it had): a strategy search
    prices many pipelines within one time limit, and an unbounded refinement
    (up to 400 evaluations, seconds on a network of a few hundred ops) would
    run past it.
    """
    virtual = virtual_stages(schedule)
    if (
        virtual < 2
        or plan.model.mode != "train"
        or plan.num_stages < 2
        or any(len(st.devices) != 1 for st in plan.stages)
    ):
        return None
    path = [plan.cluster.index(st.devices[0]) for st in plan.stages]
    count = len(path) * virtual
    out = copy.deepcopy(plan)
    out.options.schedule = schedule
    # the per-stage recompute flags do not survive a re-cut: all or none
    every = all(st.recompute for st in plan.stages)
    out.options.recompute = every
    problem, _, _ = plan_to_problem(out)
    if problem.n < count:
        return None
    order = [path[w] for w in placement(schedule, count)]
    cuts = snap_cuts(problem, _targets(problem.compute, order))
    if len(cuts) != count - 1:
        return None

    # a stage needs an op of its own: a chunk of only buffers (get_attr) is empty to codegen
    ops = {plan_node.name: plan_node.op for plan_node in plan.nodes}
    computes = [ops.get(name, "call_function") not in _NOT_OPS for name in problem.names]

    def price(c: list[int]) -> tuple[bool, float]:
        stage_of, _ = chunked(problem, c, order)
        holds = {k for v, k in enumerate(stage_of) if computes[v]}
        fits = len(holds) == count and not check(problem, stage_of, order)
        return fits, evaluate(problem, stage_of, order).bottleneck

    cuts, moves, cut_short = _refine(cuts, price, allowed_cuts(problem), deadline)
    fits, _ = price(cuts)
    if not fits:
        return None
    stage_of, _ = chunked(problem, cuts, order)
    names = [d.name for d in plan.cluster.devices]
    out.assignment = {problem.names[v]: k for v, k in enumerate(stage_of)}
    out.stages = [
        PlanStage(index=k, devices=[names[d]], recompute=every) for k, d in enumerate(order)
    ]
    out.solver.notes = [n for n in out.solver.notes if not n.startswith("interleaved ")]
    out.solver.notes.append(
        f"interleaved {schedule}: the solved {len(path)}-stage pipeline re-cut into {count} "
        f"stages, {virtual} per device {'in a V' if schedule == V_SHAPED else 'round-robin'}, "
        "by time balance (a heuristic, not a "
        "CP-SAT solve; the status above is the pipeline's)"
        + (f"; its cut moves stopped at the time limit after {moves}" if cut_short else "")
    )
    annotate(out)
    if out.replication.replicas > 1:
        try:  # replicas join what a stage hands on: only batch-major values may cross a cut
            check_replica_exports(out)
        except PartitionError:
            return None
    return out


def _targets(compute: list[list[float]], order: list[int]) -> list[float]:
    """Node positions giving chunk ``k`` a share of the time proportional to its device's
    speed (as :func:`~crosscut.partitioner.solvers.baselines.time_balanced` aims)."""
    comp = np.asarray(compute, dtype=float)
    ref = comp.min(axis=1)
    speed = [float(ref.sum() / max(comp[:, d].sum(), 1e-30)) for d in order]
    prefix = np.concatenate([[0.0], np.cumsum(ref)])
    cum = np.cumsum(speed) / sum(speed)
    return [float(np.searchsorted(prefix, prefix[-1] * c)) for c in cum[:-1]]


def _refine(
    cuts: list[int],
    price: Callable[[list[int]], tuple[bool, float]],
    ok: list[bool],
    deadline: Deadline | None = None,
) -> tuple[list[int], int, bool]:
    """Move one cut at a time to a neighbouring allowed position while the price falls.

    Returns the cuts, the moves tried and whether ``deadline`` stopped them."""
    best_fit, best = price(cuts)
    n = len(ok) - 1
    moves = 0
    improved = True
    while improved and moves < _MAX_MOVES:
        improved = False
        for i in range(len(cuts)):
            if deadline is not None and deadline.expired():
                return cuts, moves, True
            lo = cuts[i - 1] + 1 if i > 0 else 1
            hi = cuts[i + 1] - 1 if i + 1 < len(cuts) else n - 1
            for step in (-1, 1):
                j = cuts[i] + step
                while lo <= j <= hi and not ok[j]:
                    j += step
                if not lo <= j <= hi:
                    continue
                trial = [*cuts[:i], j, *cuts[i + 1 :]]
                fit, value = price(trial)
                moves += 1
                # a fitting cut beats one over a cap; then the lower bottleneck
                if (fit, -value) > (best_fit, -best):
                    cuts, best_fit, best, improved = trial, fit, value, True
                    break
            if moves >= _MAX_MOVES:
                break
    return cuts, moves, False
