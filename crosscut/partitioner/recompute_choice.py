"""Recomputation per stage: keep it only on the stages that need it to fit.

``recompute="auto"`` first solves with every stage recomputing
(``PlanOptions.recompute``): that prices each stage at one micro-batch of
activations plus its received inputs per in-flight micro-batch, and one more
forward in backward (``partitioner/evaluate.py``). A stage whose device has
room for all its in-flight activations gains nothing from recomputing and
pays a whole forward for it, so :func:`keep_needed` turns it off again on
every stage that fits without it. Only that stage's own devices hold more
memory and only its own time shrinks, so each stage is decided on its own
(co-located stages sharing a group are decided one after another, each
checked with the others as they stand).

This never makes a plan slower (a stage's compute only loses its extra
forward; transfers do not change), and it keeps the partition the solve chose.
That partition was optimised with every stage recomputing; a partition chosen
knowing which stages will not recompute may be faster still, which this pass
does not search for (a per-stage choice inside the CP-SAT model would).
"""

from __future__ import annotations

from typing import Any

from crosscut.errors import InputError
from crosscut.ir.plan import Plan
from crosscut.ir.problem import RECOMPUTE
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.build import plan_to_problem
from crosscut.partitioner.evaluate import lower_bound
from crosscut.partitioner.solvers.result import relative_gap

__all__ = [
    "check_recompute",
    "keep_needed",
    "plan_objective",
    "recompute_flags_for",
    "recompute_request",
]


def plan_objective(plan: Plan) -> float:
    """The plan's objective as its own predictions price it (bottleneck or makespan)."""
    if plan.options.objective == "latency":
        return plan.predicted.makespan_s
    return plan.predicted.bottleneck_s


def _fits(plan: Plan) -> bool:
    caps = {d.name: d.mem_cap for d in plan.cluster.devices}
    return all(peak <= caps[d] for d, peak in plan.predicted.device_peak_bytes.items())


def keep_needed(plan: Plan) -> list[int]:
    """Turn recomputation off on every stage of ``plan`` that fits without it.

    ``plan`` (annotated, within its caps) is changed in place and re-annotated;
    returns the stages that stopped recomputing. When any did, the solver
    record is re-priced: the objective is the plan's own, and the bound is one
    valid for every per-stage choice (the smaller of the solve's bound and the
    memory-free bound without recomputation), so the status is at most
    ``FEASIBLE``: the solve proved nothing about mixed choices.
    """
    if not _fits(plan):
        return []
    dropped: list[int] = []
    # slowest stages first: with co-located stages competing for one group's
    # memory, the time saved where it sets the pace matters most
    for k in sorted(range(plan.num_stages), key=lambda j: -plan.stages[j].time_s):
        stage = plan.stages[k]
        if not stage.recompute:
            continue
        stage.recompute = False
        annotate(plan)
        if _fits(plan):
            dropped.append(k)
        else:
            stage.recompute = True
            annotate(plan)
    if not dropped:
        return []
    rec = plan.solver
    before = rec.objective
    flags = [s.recompute for s in plan.stages]
    for s in plan.stages:
        s.recompute = False
    free_bound = lower_bound(plan_to_problem(plan)[0])  # no stage recomputing: the least time
    for s, flag in zip(plan.stages, flags):
        s.recompute = flag
    rec.objective = plan_objective(plan)
    rec.best_bound = min(rec.best_bound, free_bound, rec.objective)
    rec.lower_bound = min(rec.lower_bound, free_bound)
    rec.gap = relative_gap(rec.objective, rec.best_bound)
    if rec.status == "OPTIMAL":
        rec.status = "FEASIBLE"
    keep = [k for k, s in enumerate(plan.stages) if s.recompute]
    rec.notes.append(
        f"recompute per stage: stage(s) {sorted(dropped)} fit without recomputing and do not; "
        f"{keep or 'none'} still do ({before:.6g} s -> {rec.objective:.6g} s; the partition "
        "was solved with every stage recomputing)"
    )
    return sorted(dropped)


def check_recompute(recompute: Any) -> None:
    """``recompute`` is a planning choice, one bool, or one bool per stage (checked on the plan)."""
    if isinstance(recompute, str) and recompute in RECOMPUTE:
        return
    flags = [recompute] if isinstance(recompute, bool) else recompute
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, bool) for f in flags):
        raise InputError(
            f"recompute must be one of {list(RECOMPUTE)}, True/False, or one bool per stage",
            value=repr(recompute)[:80],
            remedy="pass recompute='auto' (the planner decides), 'never', 'always' (= True), "
            "or e.g. [True, False]",
        )


def recompute_request(recompute: Any, bn_mode: str) -> str:
    """What the planner may do for ``compile(recompute=...)``.

    A list of flags is a run-time choice the planner does not price ("never");
    with ``bn_mode`` ``"step"``/``"exact"`` "auto" plans without recomputation,
    since those modes cannot run it (runtime/recomputing.py).
    """
    if recompute is True or recompute == "always":
        return "always"
    if recompute is False or recompute == "never" or not isinstance(recompute, str):
        return "never"
    return "never" if bn_mode != "micro" else "auto"


def recompute_flags_for(recompute: Any, plan: Plan) -> bool | list[bool]:
    """The run-time flags: the plan's own per-stage choice unless the caller overrides it."""
    if recompute == "auto":
        return [stage.recompute for stage in plan.stages]
    if isinstance(recompute, str):
        return recompute == "always"
    return recompute if isinstance(recompute, bool) else list(recompute)
