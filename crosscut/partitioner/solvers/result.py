"""SolveResult: what every solver hands back, honest about how good it is.

DESIGN.md "Honesty": every solve reports status, objective, best bound and
gap, wall time and the baselines it beat, so a plan can be trusted (or not)
without rerunning the solver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crosscut.ir.problem import StageGroup

__all__ = ["SolveResult", "relative_gap"]


def relative_gap(objective: float, bound: float) -> float:
    """``(objective - bound) / objective``, 0 when the bound meets the objective."""
    if objective <= 0.0:
        return 0.0
    return max(0.0, (objective - bound) / objective)


@dataclass
class SolveResult:
    """A plan (stage of every node, device of every stage) and its credentials."""

    stage_of: list[int]
    stage_device: list[int]
    objective: float  # seconds, recomputed by evaluate()
    status: str  # "OPTIMAL" | "FEASIBLE" | "FALLBACK"
    best_bound: float  # seconds, a proven lower bound on the objective
    gap: float  # relative: (objective - best_bound) / objective
    wall_time_s: float
    seed: int
    workers: int
    solver: str = "cpsat"
    baselines: dict[str, float] = field(default_factory=dict)  # name -> objective (inf: infeasible)
    notes: list[str] = field(default_factory=list)
    groups: list[StageGroup] | None = None  # device group of every stage (cross-shaped plans)

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)
