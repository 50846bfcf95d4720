"""The pipeline schedule, chosen for the step time: every schedule the runtimes run, priced.

A schedule does not change which ops a stage holds, only the order its
actions run in and how many micro-batches each stage keeps: so the planner
solves the partition once (under 1F1B, whose memory bound is the tightest a
zero-bubble schedule keeps too) and then prices the same stages under every
schedule (``annotate``: the simulator's step, the evaluator's memory per
device), keeping the quickest that fits every device's memory cap. On a tie
the earlier of :data:`PREFERENCE` wins: fewer moving parts. A plan of one
stage, or an inference plan, has no bubble to close and keeps 1F1B.

Each schedule's step is written to the plan's solver notes, so a user sees
what the choice rejected and by how much (``crosscut partition`` prints them).
"""

from __future__ import annotations

from crosscut.ir.plan import Plan
from crosscut.ir.schedule import DEFAULT_SCHEDULE
from crosscut.partitioner.annotate import annotate

__all__ = ["PREFERENCE", "choose_schedule"]

#: the order ties are broken in: the simplest first
PREFERENCE = ("1f1b", "zb-h1", "zb-h2", "gpipe")


def _fits(plan: Plan) -> bool:
    caps = {d.name: d.mem_cap for d in plan.cluster.devices}
    return all(b <= caps.get(d, b) for d, b in plan.predicted.device_peak_bytes.items())


def choose_schedule(plan: Plan) -> Plan:
    """Set ``plan``'s schedule to the quickest of :data:`PREFERENCE` that fits; returns it."""
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
    fitting = [(step, i, name) for i, (name, step, ok) in enumerate(priced) if ok]
    _, _, best = min(fitting) if fitting else (0.0, 0, DEFAULT_SCHEDULE)
    plan.options.schedule = best
    annotate(plan)
    rest = "; ".join(
        f"{name} {step * 1e3:.4g} ms" + ("" if ok else " (over a memory cap)")
        for name, step, ok in priced
        if name != best
    )
    note = f"schedule {best} ({plan.predicted.step_time_s * 1e3:.4g} ms per step) over {rest}"
    plan.solver.notes = [n for n in plan.solver.notes if not n.startswith("schedule ")]
    plan.solver.notes.append(note)
    return plan
