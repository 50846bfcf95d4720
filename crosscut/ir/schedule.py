"""Pipeline schedules as plain data.

A schedule is one list of :class:`Action` per stage: the order in which that
stage's worker runs forwards (``F``) and backwards (``B``) of micro-batches.
Keeping it as data (torch pipelining's ``_Action`` habit) means the runtime,
the partitioner's memory model and its simulator all read the same object, and
a schedule can be printed, diffed, stored in a plan and parsed back.

This module imports no torch on purpose: the partitioner's simulator imports
it, and it must stay importable without a device stack.

Text forms
    one action   ``"2F0"``  = stage 2, forward, micro-batch 0
    a schedule   one line per stage: ``"0: 0F0 0F1 0B0 0B1"``

Dependency model (used by :func:`validate_schedule` and :func:`action_times`):
``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` needs ``F(s, m)`` and
``B(s+1, m)`` (the last stage's backward starts from its own forward, where the
loss is computed). Skip connections that jump over stages only add edges that
this chain already implies, so a schedule valid here is valid for any plan.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from crosscut.errors import InputError

__all__ = [
    "DEFAULT_SCHEDULE",
    "PIPELINE_SCHEDULES",
    "SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleError",
    "action_times",
    "format_schedule",
    "gpipe",
    "in_flight",
    "inference",
    "least_in_flight",
    "make_schedule",
    "max_inflight",
    "one_f_one_b",
    "parse_schedule",
    "validate_schedule",
]

Kind = Literal["F", "B"]
_ACTION_RE = re.compile(r"^\s*(\d+)([FB])(\d+)\s*$")


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
                "an action is written <stage><F|B><microbatch>",
                value=text,
                remedy="write e.g. '2F0' for stage 2, forward, micro-batch 0",
            )
        kind: Kind = "F" if m.group(2) == "F" else "B"
        return cls(int(m.group(1)), kind, int(m.group(3)))


Schedule = list[list[Action]]


def _check_sizes(num_stages: int, microbatches: int) -> None:
    if num_stages < 1 or microbatches < 1:
        raise ScheduleError(
            "a schedule needs at least one stage and one micro-batch",
            value={"num_stages": num_stages, "microbatches": microbatches},
            remedy="pass positive integers",
        )


def inference(num_stages: int, microbatches: int) -> Schedule:
    """Forwards only, each stage in micro-batch order."""
    _check_sizes(num_stages, microbatches)
    return [[Action(s, "F", m) for m in range(microbatches)] for s in range(num_stages)]


def gpipe(num_stages: int, microbatches: int) -> Schedule:
    """Fill-drain (GPipe): every forward, then every backward, in micro-batch order.

    Simple and bubble-heavy; every micro-batch's activations stay alive until
    its backward, so :func:`max_inflight` is ``microbatches`` on every stage.
    """
    _check_sizes(num_stages, microbatches)
    return [
        [Action(s, "F", m) for m in range(microbatches)]
        + [Action(s, "B", m) for m in range(microbatches)]
        for s in range(num_stages)
    ]


def one_f_one_b(num_stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up, alternate one forward / one backward, cool-down.

    Stage ``k`` runs ``min(S-k-1, M)`` warm-up forwards, so at most
    ``min(M, S-k)`` micro-batches are in flight on it: the later a stage, the
    less activation memory it holds. Same bubble as GPipe, far less memory.
    """
    _check_sizes(num_stages, microbatches)
    schedule: Schedule = []
    for k in range(num_stages):
        warm = min(num_stages - k - 1, microbatches)
        row = [Action(k, "F", m) for m in range(warm)]
        for i in range(microbatches - warm):
            row.append(Action(k, "F", warm + i))
            row.append(Action(k, "B", i))
        row.extend(Action(k, "B", m) for m in range(microbatches - warm, microbatches))
        schedule.append(row)
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "inference": inference,
}


#: the training schedules a plan may name (``"inference"`` is chosen by mode, never named)
PIPELINE_SCHEDULES = ("gpipe", "1f1b")

#: the schedule every entry point uses when none is given: the API, the CLI, the planner,
#: the plan format and both runtimes (one value, so a plan replays as it was priced)
DEFAULT_SCHEDULE = "1f1b"


def in_flight(name: str, num_stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches stage ``stage`` has started and not finished backward, at most.

    The closed form of :func:`max_inflight` on :func:`make_schedule`'s
    schedule (``tests/test_schedule.py`` checks they agree), so the evaluator
    and the solver can price every candidate cut without building schedules:
    GPipe (and inference) keep every micro-batch, 1F1B ``min(M, S - k)``.
    """
    if name == "1f1b":
        return max(1, min(microbatches, num_stages - stage))
    return microbatches


def least_in_flight(name: str, microbatches: int) -> int:
    """The fewest micro-batches any stage of any pipeline keeps: a last stage's."""
    return in_flight(name, 1, 0, microbatches)


def make_schedule(name: str, num_stages: int, microbatches: int) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`)."""
    try:
        fn = SCHEDULES[name.lower()]
    except KeyError:
        raise ScheduleError(
            "the schedule name must be known",
            value=name,
            remedy=f"use one of {sorted(SCHEDULES)}",
        ) from None
    return fn(num_stages, microbatches)


def max_inflight(schedule: Schedule, stage: int) -> int:
    """Most micro-batches whose forward ran on ``stage`` but whose backward has not.

    This is the multiplier on saved-activation memory the cost model uses.
    Forward-only schedules count every forward (nothing is released by a B).
    """
    live = peak = 0
    for a in schedule[stage]:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


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


def _deps(a: Action, num_stages: int) -> list[Action]:
    """The actions ``a`` waits for, by the chain dependency model in the module doc."""
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    deps = [Action(a.stage, "F", a.microbatch)]
    if a.stage < num_stages - 1:
        deps.append(Action(a.stage + 1, "B", a.microbatch))
    return deps


def validate_schedule(
    schedule: Schedule, num_stages: int, microbatches: int, training: bool
) -> None:
    """Raise :class:`ScheduleError` naming the first offending action, else return.

    Rules: one row per stage and each action on its own stage's row; every
    required action exactly once (``F`` for every micro-batch, plus ``B`` when
    training, and no ``B`` otherwise); on a stage ``F(m)`` precedes ``B(m)``;
    and the whole thing runs to completion (no deadlock) under the dependency
    model, checked by :func:`action_times` with unit times.
    """
    _check_sizes(num_stages, microbatches)
    if len(schedule) != num_stages:
        raise ScheduleError(
            "a schedule has one row per stage",
            value={"rows": len(schedule), "num_stages": num_stages},
        )
    kinds: tuple[Kind, ...] = ("F", "B") if training else ("F",)
    seen: set[Action] = set()
    for s, row in enumerate(schedule):
        for a in row:
            if a.stage != s:
                raise ScheduleError(f"action {a} is on the row of stage {s}", value=str(a))
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
) -> dict[Action, tuple[float, float]]:
    """Start and end time of every action when each stage runs its row in order.

    ``forward_cost[s]`` / ``backward_cost[s]`` default to 1 and 2 (a backward
    costs about two forwards). An action starts when its stage is free and its
    dependencies have ended. If no stage can make progress before all actions
    ran, the schedule deadlocks: :class:`ScheduleError` names the blocked
    actions and what each waits for.
    """
    fwd = list(forward_cost) if forward_cost is not None else [1.0] * num_stages
    bwd = list(backward_cost) if backward_cost is not None else [2.0] * num_stages
    present = {a for row in schedule for a in row}
    times: dict[Action, tuple[float, float]] = {}
    pos = [0] * len(schedule)
    free = [0.0] * len(schedule)
    total = sum(len(row) for row in schedule)
    while len(times) < total:
        progressed = False
        for s, row in enumerate(schedule):
            while pos[s] < len(row):
                a = row[pos[s]]
                deps = [d for d in _deps(a, num_stages) if d in present]
                if any(d not in times for d in deps):
                    break
                start = max([free[s], *(times[d][1] for d in deps)])
                end = start + (fwd[s] if a.kind == "F" else bwd[s])
                times[a] = (start, end)
                free[s] = end
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = {
                str(row[pos[s]]): [
                    str(d)
                    for d in _deps(row[pos[s]], num_stages)
                    if d in present and d not in times
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
