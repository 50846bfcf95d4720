"""Pipeline schedules as plain data.

A schedule is one list of :class:`Action` per worker: the order in which that
worker runs forwards (``F``) and backwards (``B``) of micro-batches,
and, in a zero-bubble schedule, the backward split in two: ``B`` computes only
the gradients the stage sends upstream (on the critical path) and ``W`` the
weight gradients later, where the stage would otherwise idle.
Keeping it as data (torch pipelining's ``_Action`` habit) means the runtime,
the partitioner's memory model and its simulator all read the same object, and
a schedule can be printed, diffed, stored in a plan and parsed back.

Workers and stages: in every schedule but the interleaved ones a worker runs
one stage, and row ``k`` is stage ``k``'s. An interleaved schedule
(``"1f1b-v2"``, ``"1f1b-v3"``, ...: :func:`interleaved_1f1b`) gives each of
``W`` workers ``V`` smaller stages ("virtual stages", Narayanan et al. 2021),
placed round-robin: stage ``s`` runs on worker ``s % W``, so row ``r`` holds
the actions of stages ``r, r + W, r + 2W, ...`` in the one order that worker
runs them. ``"zbv"`` places two stages per worker in a V instead (worker ``r``
runs stages ``r`` and ``2W - 1 - r``). :func:`placement` gives each stage's
worker from the schedule's name (what plans and runtimes place devices and
ranks by); :func:`worker_of` reads it off built rows.

This module imports no torch on purpose: the partitioner's simulator imports
it, and it must stay importable without a device stack.

Text forms
    one action   ``"2F0"``  = stage 2, forward, micro-batch 0
    a schedule   one line per stage: ``"0: 0F0 0F1 0B0 0B1"``

The vocabulary (:class:`Action`, :data:`Schedule`) and the rules every
schedule obeys (:func:`validate_schedule`, :func:`action_times`, the dependency
model) live in :mod:`crosscut.ir.schedule_rules` and are re-exported here; the
interleaved builder in :mod:`crosscut.ir.interleaved`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

from crosscut.ir.interleaved import (
    interleaved_1f1b,
    interleaved_zero_bubble,
    v_shape_placement,
    v_shape_zero_bubble,
)
from crosscut.ir.schedule_rules import (
    Action,
    Schedule,
    ScheduleError,
    action_times,
    check_sizes,
    format_schedule,
    parse_schedule,
    splits_backward,
    validate_schedule,
    worker_of,
)

__all__ = [
    "AUTO_INTERLEAVED",
    "AUTO_SCHEDULE",
    "DEFAULT_SCHEDULE",
    "INTERLEAVED_SCHEDULES",
    "PIPELINE_SCHEDULES",
    "SCHEDULES",
    "SCHEDULE_CHOICES",
    "V_SHAPED",
    "Action",
    "Schedule",
    "ScheduleError",
    "action_times",
    "format_schedule",
    "forward_only",
    "gpipe",
    "in_flight",
    "inference",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "least_in_flight",
    "make_schedule",
    "max_inflight",
    "one_f_one_b",
    "parse_schedule",
    "pending_weights",
    "placement",
    "same_cut",
    "splits_backward",
    "splits_name",
    "v_shape_zero_bubble",
    "validate_schedule",
    "virtual_stages",
    "worker_of",
    "workers",
    "zero_bubble_h1",
    "zero_bubble_h2",
]

_INTERLEAVED_RE = re.compile(r"^(?:1f1b|zb)-v(\d+)$")

#: the V-shaped zero-bubble schedule (two stages per worker, :func:`v_shape_zero_bubble`)
V_SHAPED = "zbv"


def inference(num_stages: int, microbatches: int) -> Schedule:
    """Forwards only, each stage in micro-batch order."""
    check_sizes(num_stages, microbatches)
    return [[Action(s, "F", m) for m in range(microbatches)] for s in range(num_stages)]


def gpipe(num_stages: int, microbatches: int) -> Schedule:
    """Fill-drain (GPipe): every forward, then every backward, in micro-batch order.

    Simple and bubble-heavy; every micro-batch's activations stay alive until
    its backward, so :func:`max_inflight` is ``microbatches`` on every stage.
    """
    check_sizes(num_stages, microbatches)
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
    check_sizes(num_stages, microbatches)
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
    check_sizes(num_stages, microbatches)
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


def forward_only(name: str, num_stages: int, microbatches: int) -> Schedule:
    """The forwards of the schedule ``name`` runs, rows per worker as in training.

    Inference keeps the training schedule's workers, so a runtime has one
    worker layout for both modes: one stage per row (:func:`inference`), or an
    interleaved worker's forwards in the order its training row runs them
    (forwards wait only for forwards, so the projection runs to completion).
    """
    if virtual_stages(name) < 2:
        return inference(num_stages, microbatches)
    if name.lower() != V_SHAPED:  # the zero-bubble variant keeps interleaved 1F1B's order
        name = f"1f1b-v{virtual_stages(name)}"
    return [
        [a for a in row if a.kind == "F"] for row in make_schedule(name, num_stages, microbatches)
    ]


def virtual_stages(name: str) -> int:
    """Stages per worker the schedule called ``name`` runs: ``V`` for ``"1f1b-vV"`` and
    ``"zb-vV"``, else 1."""
    if name.lower() == V_SHAPED:
        return 2
    found = _INTERLEAVED_RE.match(name.lower())
    return int(found.group(1)) if found else 1


def placement(name: str, num_stages: int) -> tuple[int, ...]:
    """The worker (device, rank) of each of a ``num_stages``-stage plan's stages under ``name``.

    One stage per worker for most schedules, ``s % W`` for the round-robin
    interleaved ones, a V for ``"zbv"`` (:func:`v_shape_placement`). Plans,
    the partitioner's re-cut and both runtimes place stages by this one
    function, so a new placement is one branch here."""
    if name.lower() == V_SHAPED:
        return v_shape_placement(num_stages)
    w = workers(name, num_stages)
    return tuple(s % w for s in range(num_stages))


def same_cut(a: str, b: str) -> bool:
    """Whether schedules ``a`` and ``b`` run a plan's stages on the same workers (a runtime
    may switch between them without re-partitioning)."""
    return virtual_stages(a) == virtual_stages(b) and (a.lower() == V_SHAPED) == (
        b.lower() == V_SHAPED
    )


def workers(name: str, num_stages: int) -> int:
    """Workers (devices, or device groups) a ``num_stages``-stage plan under ``name`` uses."""
    return max(1, num_stages // virtual_stages(name))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zero_bubble_h1,
    "zb-h2": zero_bubble_h2,
    "inference": inference,
}


#: the interleaved schedules a plan may name and the fuzzer draws (any ``"1f1b-vV"`` or
#: ``"zb-vV"``, V >= 2, is accepted by a runtime)
INTERLEAVED_SCHEDULES = ("1f1b-v2", "1f1b-v3", "1f1b-v4", "zb-v2", V_SHAPED)

#: the interleaved re-cuts ``"auto"`` tries (partitioner/schedule_choice.py): each is a
#: planning pass over the graph; more stages per device, or the split backward on top,
#: priced slower on every benchmark request (docs/BENCHMARKS.md), so they are asked by name.
#: ``zbv`` prices below ``1f1b-v2`` on most requests but never below ``zb-h2``, which
#: ``auto`` tries on the solved stages at no planning cost. ``zb-v2`` on ``1f1b-v2``'s
#: stages was tried in ``auto`` too and taken out: it won by 1 % where it ran 11 % over
#: its price (the engine's per-action cost is not priced; docs/BENCHMARKS.md)
AUTO_INTERLEAVED = ("1f1b-v2",)

#: the training schedules a plan may name (``"inference"`` is chosen by mode, never named)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", *INTERLEAVED_SCHEDULES)

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
    ZB-H2's and the interleaved schedules' counts are read off the built schedule
    (cached). A worker of an interleaved schedule holds the sum over its stages
    (the evaluator adds the stages of a device up), which bounds its true peak.
    """
    if name in ("1f1b", "zb-h1"):  # zb-h1 holds a micro-batch from its F to its W
        return max(1, min(microbatches, num_stages - stage))
    if name == "zb-h2" or virtual_stages(name) > 1:
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
    if not splits_name(name):
        return 0
    return _built_pending(name, num_stages, microbatches)[stage]


@functools.lru_cache(maxsize=256)
def _built_pending(name: str, num_stages: int, microbatches: int) -> tuple[int, ...]:
    built = make_schedule(name, num_stages, microbatches)
    out = []
    for k in range(num_stages):  # an interleaved worker's row holds several stages
        live = peak = 0
        for a in built[worker_of(built, k)]:
            if a.stage == k:
                live += {"B": 1, "W": -1}.get(a.kind, 0)
                peak = max(peak, live)
        out.append(peak)
    return tuple(out)


def least_in_flight(name: str, microbatches: int) -> int:
    """The fewest micro-batches any stage of any pipeline keeps: a last stage's."""
    return in_flight(name, 1, 0, microbatches)


def splits_name(name: str) -> bool:
    """Whether the schedule called ``name`` splits each backward into ``B`` and ``W``."""
    return name.lower() in ("zb-h1", "zb-h2", V_SHAPED) or name.lower().startswith("zb-v")


def make_schedule(name: str, num_stages: int, microbatches: int) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`, ``"1f1b-vV"`` or ``"zb-vV"``)."""
    if name.lower() == V_SHAPED:
        return v_shape_zero_bubble(num_stages, microbatches)
    if virtual_stages(name) > 1:
        build = interleaved_zero_bubble if splits_name(name) else interleaved_1f1b
        return build(num_stages, microbatches, virtual_stages(name))
    try:
        fn = SCHEDULES[name.lower()]
    except KeyError:
        raise ScheduleError(
            "the schedule name must be known",
            value=name,
            remedy=f"use one of {sorted(SCHEDULES)}, 1f1b-vV / zb-vV (V >= 2 stages per "
            "worker) or zbv",
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
    for a in schedule[worker_of(schedule, stage)]:
        if a.stage != stage:
            continue
        if a.kind == "F":
            live += 1
        elif a.kind == release:
            live -= 1
        peak = max(peak, live)
    return peak
