"""Pipeline schedules as plain data.

A schedule is one list of :class:`Action` per stage: the order in which that
stage's worker runs forwards (``F``) and backwards (``B``) of micro-batches,
and, in a zero-bubble schedule, the backward split in two: ``B`` computes only
the gradients the stage sends upstream (on the critical path) and ``W`` the
weight gradients later, where the stage would otherwise idle.
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
loss is computed); ``W(s, m)`` needs ``B(s, m)``. Skip connections that jump
over stages only add edges that this chain already implies, so a schedule
valid here is valid for any plan.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from crosscut.errors import InputError

__all__ = [
    "AUTO_SCHEDULE",
    "DEFAULT_SCHEDULE",
    "PIPELINE_SCHEDULES",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
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
    "pending_weights",
    "splits_backward",
    "validate_schedule",
    "zero_bubble_h1",
    "zero_bubble_h2",
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


def zero_bubble_h1(num_stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B's memory, less idle.

    Each backward is split into ``B`` (the input gradients the stage upstream
    waits for) and ``W`` (the weight gradients nobody waits for); the ``W``
    passes fill the cool-down, where 1F1B's earlier stages wait for the
    backward to come back. Stage ``k`` holds at most ``min(M, S - k)``
    micro-batches between their ``F`` and their ``W`` (the activations a ``W``
    still reads), 1F1B's own bound: its activation memory is 1F1B's. The rows
    come from :func:`_zero_bubble`. With ``F = B = W`` it idles about a third
    less than 1F1B: the last stage still runs ``F B W`` in turn.
    """
    return _zero_bubble(num_stages, microbatches, [num_stages - k for k in range(num_stages)])


def zero_bubble_h2(num_stages: int, microbatches: int) -> Schedule:
    """ZB-H2-like: ZB-H1's rule with up to ``2S - 1`` micro-batches in flight on every stage.

    Twice 1F1B's peak activation memory (the paper's H2 budget), for less
    idle time: the last stage no longer runs each ``W`` before the next ``F``,
    so the backward reaches the first stage sooner and every stage fills its
    warm-up and cool-down with ``W`` passes. The planner prices it with its
    memory and picks it only where it fits the caps and wins.
    """
    return _zero_bubble(num_stages, microbatches, [2 * num_stages - 1] * num_stages)


def _zero_bubble(num_stages: int, microbatches: int, bound: Sequence[int]) -> Schedule:
    """The rows of a zero-bubble schedule: stage ``k`` holds at most ``bound[k]`` micro-batches.

    A stage runs, whenever it is free, the first that can go of: a ``B``
    whose gradients have arrived; an ``F`` whose input has arrived, if fewer
    than ``min(M, bound[k])`` micro-batches are in flight on it (``F`` run,
    ``W`` not yet); the oldest pending ``W``. The rows come from replaying that
    rule with ``F = B = W`` (the paper's setting: a backward is about two
    forwards), and the order is then fixed data, valid for any durations (an
    order that runs to completion once cannot deadlock when actions take
    longer or shorter).
    """
    _check_sizes(num_stages, microbatches)
    cap = [min(microbatches, b) for b in bound]
    rows: Schedule = [[] for _ in range(num_stages)]
    done: dict[Action, int] = {}  # end time of every action placed
    nxt_f, nxt_b, nxt_w = [0] * num_stages, [0] * num_stages, [0] * num_stages

    def ended(a: Action, t: int) -> bool:
        return done.get(a, t + 1) <= t

    t = 0
    while len(done) < 3 * num_stages * microbatches:
        placed: list[Action] = []
        for k in range(num_stages):
            if rows[k] and not ended(rows[k][-1], t):
                continue  # busy: unit actions end one tick after they start
            if nxt_b[k] < nxt_f[k] and (
                k == num_stages - 1 or ended(Action(k + 1, "B", nxt_b[k]), t)
            ):
                placed.append(Action(k, "B", nxt_b[k]))
                nxt_b[k] += 1
            elif (
                nxt_f[k] < microbatches
                and nxt_f[k] - nxt_w[k] < cap[k]
                and (k == 0 or ended(Action(k - 1, "F", nxt_f[k]), t))
            ):
                placed.append(Action(k, "F", nxt_f[k]))
                nxt_f[k] += 1
            elif nxt_w[k] < nxt_b[k]:
                placed.append(Action(k, "W", nxt_w[k]))
                nxt_w[k] += 1
        for a in placed:
            rows[a.stage].append(a)
            done[a] = t + 1
        t += 1
    return rows


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zero_bubble_h1,
    "zb-h2": zero_bubble_h2,
    "inference": inference,
}


#: the training schedules a plan may name (``"inference"`` is chosen by mode, never named)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2")

#: the schedule a plan or a runtime uses when none is given: the plan format and both
#: runtimes (one value, so a plan replays as it was priced), and what the planner solves under
DEFAULT_SCHEDULE = "1f1b"

#: what a caller asks for when the planner is to choose (``partitioner/schedule_choice.py``):
#: the default of the API, the CLI and the planner
AUTO_SCHEDULE = "auto"
SCHEDULE_CHOICES = (AUTO_SCHEDULE, *PIPELINE_SCHEDULES)


def in_flight(name: str, num_stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches stage ``stage`` has started and not finished backward, at most.

    The closed form of :func:`max_inflight` on :func:`make_schedule`'s
    schedule (``tests/test_schedule.py`` checks they agree), so the evaluator
    and the solver can price every candidate cut without building schedules:
    GPipe (and inference) keep every micro-batch, 1F1B and ZB-H1 ``min(M, S - k)``;
    ZB-H2's counts are read off its built schedule (cached).
    """
    if name in ("1f1b", "zb-h1"):  # zb-h1 holds a micro-batch from its F to its W
        return max(1, min(microbatches, num_stages - stage))
    if name == "zb-h2":
        return _built_in_flight(name, num_stages, microbatches)[stage]
    return microbatches


@functools.lru_cache(maxsize=256)
def _built_in_flight(name: str, num_stages: int, microbatches: int) -> tuple[int, ...]:
    """Each stage's peak in flight, read off the built schedule (no closed form)."""
    built = make_schedule(name, num_stages, microbatches)
    return tuple(max_inflight(built, k) for k in range(num_stages))


def pending_weights(name: str, num_stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose ``B`` stage ``stage`` has run and whose ``W`` it has not, at most.

    Between the two a stage holds the gradients its ``W`` restarts from (one per
    weight node: the gradient of that layer's output), so a split backward keeps
    them for this many micro-batches at once; 0 for a schedule that does not split
    its backward (read off the built schedule, cached)."""
    if name not in ("zb-h1", "zb-h2"):
        return 0
    return _built_pending(name, num_stages, microbatches)[stage]


@functools.lru_cache(maxsize=256)
def _built_pending(name: str, num_stages: int, microbatches: int) -> tuple[int, ...]:
    built = make_schedule(name, num_stages, microbatches)
    out = []
    for row in built:
        live = peak = 0
        for a in row:
            live += {"B": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


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
    Forward-only schedules count every forward (nothing is released by a B);
    in a split backward a micro-batch's activations live until its ``W``
    (the weight gradients read the layers' inputs).
    """
    release = "W" if splits_backward(schedule) else "B"
    live = peak = 0
    for a in schedule[stage]:
        if a.kind == "F":
            live += 1
        elif a.kind == release:
            live -= 1
        peak = max(peak, live)
    return peak


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


def _deps(a: Action, num_stages: int) -> list[Action]:
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
    schedule: Schedule, num_stages: int, microbatches: int, training: bool
) -> None:
    """Raise :class:`ScheduleError` naming the first offending action, else return.

    Rules: one row per stage and each action on its own stage's row; every
    required action exactly once (``F`` for every micro-batch, plus ``B`` when
    training, and no ``B`` otherwise; a split backward has a ``W`` for every
    ``B``, or none at all); on a stage ``F(m)`` precedes ``B(m)``, which
    precedes ``W(m)``; and the whole thing runs to completion (no deadlock)
    under the dependency model, checked by :func:`action_times` with unit times.
    """
    _check_sizes(num_stages, microbatches)
    if len(schedule) != num_stages:
        raise ScheduleError(
            "a schedule has one row per stage",
            value={"rows": len(schedule), "num_stages": num_stages},
        )
    kinds: tuple[Kind, ...] = ("F", "B") if training else ("F",)
    if training and splits_backward(schedule):
        kinds = ("F", "B", "W")
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
    """Start and end time of every action when each stage runs its row in order.

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
                end = start + cost[a.kind][s]
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
