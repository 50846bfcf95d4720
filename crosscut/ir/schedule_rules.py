"""Pipeline schedules' vocabulary and rules: actions, rows, validation, unit-time replay.

:mod:`crosscut.ir.schedule` builds the schedules and says what each keeps in
memory; this module holds what every schedule is made of (:class:`Action`, a
:data:`Schedule` of rows) and the rules all of them obey
(:func:`validate_schedule`, :func:`action_times`), so that a builder in another
module (:mod:`crosscut.ir.interleaved`) can check its own rows without
importing the registry that imports it. Everything here is re-exported by
:mod:`crosscut.ir.schedule`, the one name callers use. No torch, as there.

Dependency model (used by :func:`validate_schedule` and :func:`action_times`):
``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` needs ``F(s, m)`` and
``B(s+1, m)`` (the last stage's backward starts from its own forward, where the
loss is computed); ``W(s, m)`` needs ``B(s, m)``. Skip connections that jump
over stages only add edges that this chain already implies, so a schedule
valid here is valid for any plan. Rows are workers: every action of a stage
is on one row, the stage's worker (:func:`worker_of`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from crosscut.errors import InputError

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "action_times",
    "check_sizes",
    "deps",
    "format_schedule",
    "parse_schedule",
    "splits_backward",
    "validate_schedule",
    "worker_of",
]

Kind = Literal["F", "B", "W"]
_ACTION_RE = re.compile(r"^\s*(\d+)([FBW])(\d+)\s*$")
_KINDS: dict[str, Kind] = {"F": "F", "B": "B", "W": "W"}


class ScheduleError(InputError):
    """A schedule breaks a rule (duplicate, missing, out of order, deadlock)."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage ``stage`` runs ``kind`` on micro-batch ``microbatch``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str(action)``: ``Action.parse("2F0") == Action(2, "F", 0)``."""
        m = _ACTION_RE.match(text)
        if m is None:
            raise ScheduleError(
                "an action is written <stage><F|B|W><microbatch>",
                value=text,
                remedy="write e.g. '2F0' for stage 2, forward, micro-batch 0",
            )
        return cls(int(m.group(1)), _KINDS[m.group(2)], int(m.group(3)))


Schedule = list[list[Action]]


def check_sizes(num_stages: int, microbatches: int) -> None:
    if num_stages < 1 or microbatches < 1:
        raise ScheduleError(
            "a schedule needs at least one stage and one micro-batch",
            value={"num_stages": num_stages, "microbatches": microbatches},
            remedy="pass positive integers",
        )


def worker_of(schedule: Schedule, stage: int) -> int:
    """The row (worker) that runs ``stage``'s actions, read off the rows themselves.

    Row ``stage % rows`` is tried first: one stage per row, and the round-robin
    interleaved schedules, place stages there; a V-shaped schedule does not
    (:func:`crosscut.ir.interleaved.v_shape_placement`). A stage with no
    action on any row raises :class:`ScheduleError`."""
    guess = stage % len(schedule)
    if any(a.stage == stage for a in schedule[guess]):
        return guess
    for r, row in enumerate(schedule):
        if any(a.stage == stage for a in row):
            return r
    raise ScheduleError(f"stage {stage} has no action on any row", value=stage)


def splits_backward(schedule: Schedule) -> bool:
    """Whether ``schedule`` runs each backward as a ``B`` and a later ``W``."""
    return any(a.kind == "W" for row in schedule for a in row)


def format_schedule(schedule: Schedule) -> str:
    """One line per stage, ``"0: 0F0 0F1 0B0 0B1"``; :func:`parse_schedule` inverts it."""
    return "\n".join(f"{s}:" + "".join(f" {a}" for a in row) for s, row in enumerate(schedule))


def parse_schedule(text: str) -> Schedule:
    """Inverse of :func:`format_schedule`; stage lines must be 0, 1, 2, ... in order."""
    schedule: Schedule = []
    for lineno, line in enumerate(ln for ln in text.strip().splitlines() if ln.strip()):
        head, sep, rest = line.partition(":")
        if not sep or not head.strip().isdigit() or int(head) != lineno:
            raise ScheduleError(
                "each schedule line starts with its stage number and a colon, in order",
                value=line,
                remedy=f"start line {lineno} with '{lineno}:'",
            )
        schedule.append([Action.parse(tok) for tok in rest.split()])
    return schedule


def deps(a: Action, num_stages: int) -> list[Action]:
    """The actions ``a`` waits for, by the chain dependency model in the module doc."""
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action(a.stage, "B", a.microbatch)]
    deps = [Action(a.stage, "F", a.microbatch)]
    if a.stage < num_stages - 1:
        deps.append(Action(a.stage + 1, "B", a.microbatch))
    return deps


def validate_schedule(
    schedule: Schedule,
    num_stages: int,
    microbatches: int,
    training: bool,
    where: Sequence[int] | None = None,
) -> None:
    """Raise :class:`ScheduleError` naming the first offending action, else return.

    Rules: one row per worker (a divisor of the stage count) and each action on
    its stage's worker's row: ``where[stage]`` (the schedule's
    :func:`~crosscut.ir.schedule.placement`), by default ``stage % rows``; every
    required action exactly once (``F`` for every micro-batch, plus ``B`` when
    training, and no ``B`` otherwise; a split backward has a ``W`` for every
    ``B``, or none at all); on a stage ``F(m)`` precedes ``B(m)``, which
    precedes ``W(m)``; and the whole thing runs to completion (no deadlock)
    under the dependency model, checked by :func:`action_times` with unit times.
    """
    check_sizes(num_stages, microbatches)
    if not schedule or len(schedule) > num_stages or num_stages % len(schedule):
        raise ScheduleError(
            "a schedule has one row per worker, and each worker runs as many stages",
            value={"rows": len(schedule), "num_stages": num_stages},
            remedy="one row per stage, or (interleaved) a divisor of the stage count",
        )
    kinds: tuple[Kind, ...] = ("F", "B") if training else ("F",)
    if training and splits_backward(schedule):
        kinds = ("F", "B", "W")
    seen: set[Action] = set()
    for r, row in enumerate(schedule):
        for a in row:
            if not 0 <= a.stage < num_stages:
                raise ScheduleError(f"action {a} names no stage of {num_stages}", value=str(a))
            want = where[a.stage] if where is not None else a.stage % len(schedule)
            if want != r:
                raise ScheduleError(
                    f"action {a} is on row {r}; stage {a.stage} runs on row {want}"
                    + (" (stage % rows)" if where is None else " (the schedule's placement)"),
                    value=str(a),
                )
            s = a.stage
            if a.kind not in kinds or not 0 <= a.microbatch < microbatches:
                raise ScheduleError(
                    f"action {a} is not part of this run",
                    value=str(a),
                    remedy=f"kinds {kinds}, micro-batches 0..{microbatches - 1}",
                )
            if a in seen:
                raise ScheduleError(f"action {a} appears more than once", value=str(a))
            if a.kind == "B" and Action(s, "F", a.microbatch) not in seen:
                raise ScheduleError(
                    f"action {a} runs before its forward {s}F{a.microbatch} on stage {s}",
                    value=str(a),
                    remedy="put every forward before the backward of the same micro-batch",
                )
            if a.kind == "W" and Action(s, "B", a.microbatch) not in seen:
                raise ScheduleError(
                    f"action {a} runs before its input-gradient pass {s}B{a.microbatch}",
                    value=str(a),
                    remedy="put every W after the B of the same micro-batch on its stage",
                )
            seen.add(a)
    for s in range(num_stages):
        for kind in kinds:
            for m in range(microbatches):
                if Action(s, kind, m) not in seen:
                    raise ScheduleError(f"action {s}{kind}{m} is missing", value=f"{s}{kind}{m}")
    action_times(schedule, num_stages)


def action_times(
    schedule: Schedule,
    num_stages: int,
    forward_cost: Sequence[float] | None = None,
    backward_cost: Sequence[float] | None = None,
    weight_cost: Sequence[float] | None = None,
) -> dict[Action, tuple[float, float]]:
    """Start and end time of every action when each worker runs its row in order.

    ``forward_cost[s]`` / ``backward_cost[s]`` default to 1 and 2 (a backward
    costs about two forwards); in a split backward ``B`` takes
    ``backward_cost[s] - weight_cost[s]`` and ``W`` ``weight_cost[s]``
    (default: half of the backward each). An action starts when its stage is free and its
    dependencies have ended. If no stage can make progress before all actions
    ran, the schedule deadlocks: :class:`ScheduleError` names the blocked
    actions and what each waits for.
    """
    fwd = list(forward_cost) if forward_cost is not None else [1.0] * num_stages
    bwd = list(backward_cost) if backward_cost is not None else [2.0] * num_stages
    wgt = [0.0] * num_stages
    if splits_backward(schedule):
        wgt = list(weight_cost) if weight_cost is not None else [b / 2.0 for b in bwd]
    cost = {"F": fwd, "B": [b - w for b, w in zip(bwd, wgt)], "W": wgt}
    present = {a for row in schedule for a in row}
    times: dict[Action, tuple[float, float]] = {}
    pos = [0] * len(schedule)
    free = [0.0] * len(schedule)  # per worker (row)
    total = sum(len(row) for row in schedule)
    while len(times) < total:
        progressed = False
        for s, row in enumerate(schedule):
            while pos[s] < len(row):
                a = row[pos[s]]
                needs = [d for d in deps(a, num_stages) if d in present]
                if any(d not in times for d in needs):
                    break
                start = max([free[s], *(times[d][1] for d in needs)])
                end = start + cost[a.kind][a.stage]
                times[a] = (start, end)
                free[s] = end
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = {
                str(row[pos[s]]): [
                    str(d) for d in deps(row[pos[s]], num_stages) if d in present and d not in times
                ]
                for s, row in enumerate(schedule)
                if pos[s] < len(row)
            }
            first = next(iter(blocked))
            raise ScheduleError(
                f"the schedule deadlocks: action {first} waits for {blocked[first]}, "
                "which can never run first",
                value=blocked,
                remedy="reorder the rows so each stage's next action's dependencies can finish",
            )
    return times
