"""SolveSettings: how to solve a partition problem, kept apart from what to solve.

Why one object: the knobs (time, seed, workers, which solver, ...) travel
from ``partition_graph`` through :func:`~crosscut.partitioner.solvers.solve`
to :func:`~crosscut.partitioner.solvers.cpsat.solve_cpsat` and its searches.
As separate parameters every layer repeated the list and every new knob
grew every signature on the way down; a frozen dataclass is passed as it
is, or changed where one step needs a different value
(``dataclasses.replace``), and the defaults live in one place. Plain data,
no torch: the partitioner sits below ``crosscut.options``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from crosscut.partitioner.deadline import Deadline

__all__ = ["Progress", "SolveSettings"]

# (wall seconds, objective seconds, bound seconds) of each new CP-SAT incumbent
Progress = Callable[[float, float, float], None]


@dataclass(frozen=True)
class SolveSettings:
    """Every setting a solve may read; each solver reads the ones it understands."""

    solver: str = "cpsat"  # one of solvers.SOLVERS
    time_limit: float = 10.0  # seconds, used only when there is no ``deadline``
    # shared with the caller (it covers what comes after the solve too): replaces time_limit
    deadline: Deadline | None = None
    seed: int = 0
    workers: int = 1  # CP-SAT workers; > 1 runs its parallel portfolio (not repeatable)
    # one stage per device (fails when there are fewer nodes than devices)
    require_all_devices: bool = False
    progress: Progress | None = None
    log_callback: Callable[[str], None] | None = None
    # the cross-shaped DP may co-locate the last two stages on one group
    colocate: bool = True
    # CP-SAT only (cpsat.py's module docstring)
    deterministic: bool = False  # limit CP-SAT's deterministic time, so limited solves repeat
    relax: bool = True  # try the side-tree relaxation first (False: this is that relaxation)
    floating: float = 0.0  # seconds of compute the problem leaves out that a stage must run
    orders: str = "auto"  # how device orders are covered: orders.STRATEGIES
    hint: tuple[list[int], list[int]] | None = None  # (stage_of, stage_device) to start from

    def deadline_or_limit(self) -> Deadline:
        """The shared deadline, or one of ``time_limit`` seconds from now."""
        return Deadline.of(self.deadline, self.time_limit)
