"""The pipeline schedule, chosen for the step time: every schedule the runtimes run, priced.

A schedule does not change which ops a stage holds, only the order its
actions run in and how many micro-batches each stage keeps: so the planner
solves the partition once (under 1F1B, whose memory bound is the tightest a
zero-bubble schedule keeps too) and then prices the same stages under every
schedule (``annotate``: the simulator's step, the evaluator's memory per
device), keeping the quickest that fits every device's memory cap. On a tie
the earlier of :data:`PREFERENCE` wins: fewer moving parts; with profiled
costs, so does a simpler schedule within the profiles' spread of the
quickest (a lead that size is the measurement's noise). A plan of one
stage, or an inference plan, has no bubble to close and keeps 1F1B.

An interleaved schedule (``"1f1b-v2"``) changes the stages themselves: each
device gets two, round-robin. The planner re-cuts the solved pipeline for it
(:mod:`crosscut.partitioner.interleave`), prices the re-cut the same way and
keeps it only when it is the quickest that fits.

Each schedule's step is written to the plan's solver notes, so a user sees
what the choice rejected and by how much (``crosscut partition`` prints them).
"""

from __future__ import annotations

from crosscut.ir.plan import Plan
from crosscut.ir.schedule import AUTO_INTERLEAVED, DEFAULT_SCHEDULE
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.interleave import interleave as interleave_plan

__all__ = ["PREFERENCE", "choose_schedule"]

#: the order ties are broken in: the simplest first
PREFERENCE = ("1f1b", "zb-h1", "zb-h2", "gpipe")


def _fits(plan: Plan) -> bool:
    caps = {d.name: d.mem_cap for d in plan.cluster.devices}
    return all(b <= caps.get(d, b) for d, b in plan.predicted.device_peak_bytes.items())


def choose_schedule(
    plan: Plan, interleave: bool = True, noise: float = 0.0, deadline: Deadline | None = None
) -> Plan:
    """The quickest of :data:`PREFERENCE` that fits, on ``plan``'s stages, or an interleaved re-cut.

    ``plan`` is set to the quickest schedule of :data:`PREFERENCE` and returned,
    unless ``interleave`` and a re-cut of its stages under one of
    :data:`~crosscut.ir.schedule.AUTO_INTERLEAVED`
    (:func:`~crosscut.partitioner.interleave.interleave`) is quicker still and
    fits: then that new plan is returned. ``interleave=False`` where the plan
    will run under torchrun's own planning.

    ``noise``: the profiles' spread (0 for analytic costs). A profiled step is a
    measurement; where the quickest schedule leads the simplest one that is
    within that spread of it (:data:`PREFERENCE` order, the interleaved re-cut
    last: twice the stages, transfers and actions the model prices least
    well), the lead is noise and the simpler schedule is kept, as the strategy
    search does between strategies (``strategy._Search.choose``).

    ``deadline``: the interleaved re-cuts stop refining when it passes (the
    schedules of :data:`PREFERENCE`, a few simulations, are always priced); one
    that has passed before a re-cut starts skips it, and the note says so.
    """
    if plan.model.mode != "train" or plan.num_stages == 1:
        if plan.options.schedule != DEFAULT_SCHEDULE:
            plan.options.schedule = DEFAULT_SCHEDULE
            annotate(plan)
        return plan
    priced: list[tuple[str, float, bool]] = []
    for name in PREFERENCE:
        plan.options.schedule = name
        annotate(plan)
        priced.append((name, plan.predicted.step_time_s, _fits(plan)))
    recut: dict[str, Plan] = {}
    skipped: list[str] = []
    if interleave and all(len(st.devices) == 1 for st in plan.stages):
        for name in AUTO_INTERLEAVED:
            if deadline is not None and deadline.expired():
                skipped.append(name)
                continue
            cand = interleave_plan(plan, name, deadline)
            if cand is None:
                continue
            recut[name] = cand
            priced.append((name, cand.predicted.step_time_s, _fits(cand)))
    fitting = [(step, i, name) for i, (name, step, ok) in enumerate(priced) if ok]
    quickest, _, best = min(fitting) if fitting else (0.0, 0, DEFAULT_SCHEDULE)
    within = [(i, name) for step, i, name in fitting if step <= quickest * (1.0 + noise)]
    best = min(within)[1] if within else best  # the simplest within the noise
    if best in recut:
        plan = recut[best]
    else:
        plan.options.schedule = best
        annotate(plan)
    rest = "; ".join(
        f"{name} {step * 1e3:.4g} ms" + ("" if ok else " (over a memory cap)")
        for name, step, ok in priced
        if name != best
    )
    note = f"schedule {best} ({plan.predicted.step_time_s * 1e3:.4g} ms per step) over {rest}"
    if plan.predicted.step_time_s > quickest:
        note += f" (the simplest within the profiles' spread of {noise:.1%})"
    if skipped:
        note += f"; not tried at the time limit: {', '.join(skipped)}"
    plan.solver.notes = [n for n in plan.solver.notes if not n.startswith("schedule ")]
    plan.solver.notes.append(note)
    return plan
