"""One CP-SAT model of the partition problem, solved: build, hint, solve, keep the best.

``cpsat.py`` decides which models to solve (one per device order, or the
class model over every order: ``orders.py``) and how the time limit is
shared; each is solved here the same way. The incumbent (baselines first)
hints the model and tightens its stage windows; a plan CP-SAT finds is
re-priced by evaluate() and replaces the incumbent only when it is faster;
the search stops as soon as an incumbent meets the static bound, which
proves it optimal (to the integer model's rounding).
"""

from __future__ import annotations

import dataclasses
import math
import time

from ortools.sat.python import cp_model

from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import check, evaluate, renumber
from crosscut.partitioner.solvers.baselines import Plan
from crosscut.partitioner.solvers.cpsat_model import OrderModel
from crosscut.partitioner.solvers.settings import Progress, SolveSettings

__all__ = ["ROUNDING_GAP", "Incumbent", "Progress", "Searched", "search_one"]

ROUNDING_GAP = 1e-5  # a relative gap this small is the integer model's rounding: optimal


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
    """Whether ``obj`` is within the integer model's rounding of a proven ``bound``.

    No incumbent (``obj`` infinite: no baseline fits memory) meets nothing; it
    used to "meet" every bound (inf <= inf), so CP-SAT never ran and a problem
    with a plan was reported infeasible.
    """
    if not math.isfinite(obj):
        return False
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


@dataclasses.dataclass
class Incumbent:
    """The best plan so far (baselines first), and whether CP-SAT found any plan."""

    plan: Plan | None
    objective: float
    found: bool = False


@dataclasses.dataclass(frozen=True)
class Searched:
    bound: float  # seconds: valid for every plan the model covers
    finished: bool  # the model was solved to the end (optimal, infeasible or beaten)
    met: bool  # the incumbent meets the static bound: optimal over every plan
    build_s: float  # seconds the model took to build
    rounding: float = 0.0  # seconds the integer model's objective may differ from evaluate()'s


def search_one(
    pb: PartitionProblem,
    om: OrderModel,
    inc: Incumbent,
    static_lb: float,
    share: Deadline,
    work: Deadline,
    cfg: SolveSettings,
    t0: float,
) -> Searched:
    """Build ``om`` (one order, or the class model), solve it by ``share``, update ``inc``.

    ``t0``: when the solve began (``perf_counter``), for ``cfg.progress``'s wall seconds.
    """
    t_build = time.perf_counter()
    om.floating, om.deadline = cfg.floating, work
    om.build()
    build_s = time.perf_counter() - t_build
    if om.skipped:  # the model would not be built in time
        return Searched(static_lb, False, False, build_s)
    if om.empty:  # no plan of this model beats the incumbent
        return Searched(max(static_lb, inc.objective), True, False, build_s, 2 * om.slack * om.unit)
    if _meets(inc.objective, static_lb, om):  # optimal to the rounding
        return Searched(static_lb, True, True, build_s, 2 * om.slack * om.unit)
    m = om.model
    # (B) objective >= the static lower bound
    m.add(om.objective_var >= max(0, math.floor(static_lb / om.unit) - om.slack))
    if inc.plan is not None:
        stage_of, stage_device = inc.plan
        if om.classes:
            om.add_hint(stage_of, stage_device)
        elif stage_device == om.order[: len(stage_device)]:
            om.add_hint(stage_of)
    budget = max(share.left(), 0.005)  # after the build: it counts
    solver = _solver(cfg.workers, cfg.seed, budget, cfg.deterministic, work.left())
    if cfg.log_callback is not None:
        solver.parameters.log_search_progress = True
        solver.log_callback = cfg.log_callback
    target = math.floor(static_lb * (1 + ROUNDING_GAP) / om.unit)
    status = solver.solve(m, _Callback(cfg.progress, om.unit, t0, target))
    if status == cp_model.INFEASIBLE:
        return Searched(max(static_lb, inc.objective), True, False, build_s, 2 * om.slack * om.unit)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Searched(static_lb, False, False, build_s, 2 * om.slack * om.unit)
    inc.found = True
    plan = renumber(om.stage_of(solver), om.stage_devices(solver))
    if not check(pb, *plan):
        obj = evaluate(pb, *plan).objective
        if inc.plan is None or obj < inc.objective * (1 - 1e-9):
            inc.plan, inc.objective = plan, obj
    bound = max(static_lb, (solver.best_objective_bound - om.slack) * om.unit)
    if status == cp_model.OPTIMAL:
        return Searched(bound, True, False, build_s, 2 * om.slack * om.unit)
    met = _meets(inc.objective, static_lb, om)  # stopped by the callback at the bound
    return Searched(bound, met, met, build_s, 2 * om.slack * om.unit)
