"""Interleaved schedules: several smaller stages per worker, round-robin or V-shaped.

``"1f1b-vV"``: interleaved 1F1B. ``"zb-vV"``: the same order with each backward
split into ``B`` and a later ``W`` that fills the worker's idle slots
(interleaved zero bubble, as torch's ``ScheduleInterleavedZeroBubble``).
``"zbv"``: two stages per worker placed in a V (worker ``r`` runs stages ``r``
and ``2W - 1 - r``), zero bubble (Qi et al.'s ZB-V, as torch's
``ScheduleZBVZeroBubble``).

Kept out of :mod:`crosscut.ir.schedule` (which dispatches to it by name) for
size; it builds rows from the same vocabulary and checks them with the same
rules (:mod:`crosscut.ir.schedule_rules`).
"""

from __future__ import annotations

from collections.abc import Callable

from crosscut.ir.schedule_rules import (
    Action,
    Schedule,
    ScheduleError,
    action_times,
    check_sizes,
    deps,
)

__all__ = [
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "v_shape_placement",
    "v_shape_zero_bubble",
]


#: a builder's rule: given a free worker and a test of whether an action's inputs have
#: arrived, the action it runs next and for how many ticks (None: it idles this tick)
Pick = Callable[[int, Callable[[Action], bool]], "tuple[Action, int] | None"]


def _replay(workers: int, num_stages: int, total: int, pick: Pick, bound: int) -> Schedule:
    """Rows of ``workers`` from a unit-time replay of ``pick`` until ``total`` actions ran.

    Each tick every free worker asks ``pick`` for its next action; an action
    placed at tick ``t`` for ``d`` ticks ends at ``t + d``, and an action is
    ready when every dependency ended by now. The rows are then fixed data,
    valid for any durations: an order that ran to completion once cannot
    deadlock when actions take longer. ``bound`` is a tick count no valid
    replay reaches.
    """
    rows: Schedule = [[] for _ in range(workers)]
    done: dict[Action, int] = {}
    busy, t = [0] * workers, 0

    def ready(a: Action) -> bool:  # every dependency ended by tick t
        return all(done.get(d, t + 1) <= t for d in deps(a, num_stages))

    while len(done) < total:
        for r in range(workers):
            got = pick(r, ready) if busy[r] <= t else None
            if got is not None:
                rows[r].append(got[0])
                done[got[0]] = busy[r] = t + got[1]
        t += 1
        if t > bound:
            raise ScheduleError("the interleaved schedule did not complete", value=num_stages)
    return rows


def interleaved_1f1b(num_stages: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B: ``W = num_stages / virtual`` workers, ``virtual`` stages each.

    Stage ``s`` runs on worker ``s % W`` (round-robin), so a micro-batch visits
    every worker ``virtual`` times on its way through, each visit ``1/virtual``
    of the work: the warm-up and cool-down, where 1F1B idles, shrink by that
    factor. Worker ``r`` runs its forwards in groups of ``W`` micro-batches,
    each group through its stages in order (its backwards in the reverse stage
    order); it starts with ``2 (W - r - 1) + (virtual - 1) W`` forwards, then
    alternates one forward and one backward, then drains the backwards
    (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", 2021). Where that fixed order deadlocks (a
    last group of fewer than ``W`` micro-batches), the rows come from
    replaying a rule instead (:func:`_replayed`). The price: more transfers
    (every stage boundary crosses workers) and more micro-batches in flight
    per worker. Every stage still runs its micro-batches' forwards and
    backwards in micro-batch order, so gradients accumulate as under 1F1B.
    """
    check_sizes(num_stages, microbatches)
    if virtual < 2 or num_stages % virtual:
        raise ScheduleError(
            "an interleaved schedule needs a whole number (2 or more) of stages per worker",
            value={"num_stages": num_stages, "virtual": virtual},
            remedy=f"use a multiple of {max(2, virtual)} stages, or schedule '1f1b'",
        )
    w = num_stages // virtual
    total = microbatches * virtual
    fwd = [_order(r, w, virtual, microbatches, backward=False) for r in range(w)]
    bwd = [_order(r, w, virtual, microbatches, backward=True) for r in range(w)]
    warm = [min(total, 2 * (w - r - 1) + (virtual - 1) * w) for r in range(w)]
    static: Schedule = []
    for r in range(w):
        row = [Action(s, "F", m) for s, m in fwd[r][: warm[r]]]
        for i in range(total - warm[r]):
            row.append(Action(fwd[r][warm[r] + i][0], "F", fwd[r][warm[r] + i][1]))
            row.append(Action(bwd[r][i][0], "B", bwd[r][i][1]))
        row.extend(Action(s, "B", m) for s, m in bwd[r][total - warm[r] :])
        static.append(row)
    try:
        action_times(static, num_stages)
        return static
    except ScheduleError:
        return _replayed(num_stages, fwd, bwd, [k + 1 for k in warm])


def _order(
    r: int, w: int, virtual: int, microbatches: int, backward: bool
) -> list[tuple[int, int]]:
    """Worker ``r``'s (stage, micro-batch) pairs: groups of ``w`` micro-batches, each
    group through the worker's stages in order (reversed for the backwards)."""
    out: list[tuple[int, int]] = []
    for first in range(0, microbatches, w):
        group = range(first, min(microbatches, first + w))
        chunks = range(virtual - 1, -1, -1) if backward else range(virtual)
        out.extend((v * w + r, m) for v in chunks for m in group)
    return out


def _replayed(
    num_stages: int,
    fwd: list[list[tuple[int, int]]],
    bwd: list[list[tuple[int, int]]],
    cap: list[int],
) -> Schedule:
    """Rows from replaying a rule with ``F = 1``, ``B = 2`` (a backward is about two forwards).

    A free worker runs its next backward if its gradient has arrived, else its
    next forward if fewer than ``cap`` are in flight on it and its input has
    arrived. The rows are then fixed data, valid for any durations (an order
    that ran to completion once cannot deadlock when actions take longer).
    """
    w, total = len(fwd), len(fwd[0])
    nf, nb = [0] * w, [0] * w

    def pick(r: int, ready: Callable[[Action], bool]) -> tuple[Action, int] | None:
        if nb[r] < total and ready(a := Action(bwd[r][nb[r]][0], "B", bwd[r][nb[r]][1])):
            nb[r] += 1
            return a, 2
        if (
            nf[r] < total
            and nf[r] - nb[r] < cap[r]
            and ready(a := Action(fwd[r][nf[r]][0], "F", fwd[r][nf[r]][1]))
        ):
            nf[r] += 1
            return a, 1
        return None

    return _replay(w, num_stages, 2 * total * w, pick, 8 * (total * w + num_stages) + 16)


def interleaved_zero_bubble(num_stages: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B with each backward split: ``B`` where 1F1B runs the backward,
    ``W`` (the weight gradients) where the worker would otherwise wait.

    Built by replaying the interleaved 1F1B rows with unit-time actions: a free
    worker runs its next ``F``/``B`` in 1F1B's order when its inputs have
    arrived, else the oldest ``W`` it owes, else idles; the ``W`` left run at
    the end. A micro-batch keeps its activations until its ``W``, so before a
    forward that would put more micro-batches in flight on the worker than
    interleaved 1F1B's peak, the worker first runs an owed ``W`` (ZB-H1's
    rule: 1F1B's memory). The ``F``/``B`` order is interleaved 1F1B's and
    nothing waits for a ``W``, so the rows cannot deadlock, and every stage
    still runs its micro-batches in order.
    """
    base = interleaved_1f1b(num_stages, microbatches, virtual)
    caps = [_peak_in_flight(row) for row in base]
    head, live = [0] * len(base), [0] * len(base)
    owed: list[list[Action]] = [[] for _ in base]
    total = sum(2 * len(row) - sum(a.kind == "F" for a in row) for row in base)

    def pick(r: int, ready: Callable[[Action], bool]) -> tuple[Action, int] | None:
        a = base[r][head[r]] if head[r] < len(base[r]) else None
        full = a is not None and a.kind == "F" and live[r] >= caps[r]
        if a is not None and ready(a) and not (full and owed[r]):
            head[r] += 1
            live[r] += a.kind == "F"
            if a.kind == "B":
                owed[r].append(Action(a.stage, "W", a.microbatch))
            return a, 1
        if owed[r]:
            live[r] -= 1
            return owed[r].pop(0), 1
        return None

    return _replay(len(base), num_stages, total, pick, 8 * total + 16)


def _peak_in_flight(row: list[Action]) -> int:
    """Most micro-batches a worker's row has run forward and not yet backward."""
    live = peak = 0
    for a in row:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def v_shape_placement(num_stages: int) -> tuple[int, ...]:
    """The worker of each stage under ``"zbv"``: ``W = S / 2`` workers, stage ``s`` on
    worker ``s`` going down and ``2W - 1 - s`` coming back (worker 0 holds the first
    and the last stage, worker ``W - 1`` the two middle ones)."""
    w = num_stages // 2
    return tuple(s if s < w else 2 * w - 1 - s for s in range(num_stages))


def v_shape_zero_bubble(num_stages: int, microbatches: int) -> Schedule:
    """ZB-V: two stages per worker in a V, each backward split into ``B`` and ``W``.

    Placing stage ``s`` and ``2W - 1 - s`` on one worker (:func:`v_shape_placement`)
    puts the loss on worker 0, where the micro-batch started, and the turn of
    each pass (stage ``W - 1`` to ``W``, forward and backward) inside worker
    ``W - 1``: no transfer there, and every worker's two stages take its work
    in a balanced pair (Qi et al., "Pipeline Parallelism with Controllable
    Memory", 2024). Built by replaying a rule with unit-time actions: a free
    worker runs the first that can go of a ``B`` whose gradient has arrived
    (oldest micro-batch first), a forward of its second stage, a forward of its
    first stage (admitting a micro-batch) if fewer than ``W`` admitted
    micro-batches still hold activations on it, and its oldest owed ``W``.

    Memory: a worker holds at most ``W`` micro-batches, each over two stages of
    ``1/(2W)`` of the model: 1F1B's first-stage peak. Why it cannot deadlock:
    only admission waits for memory, and every micro-batch older than the
    oldest unfinished one is finished, so that one's next action is never
    refused for memory (the replay also checks it ran to completion). Every
    stage runs its micro-batches in order, so gradients accumulate as under
    1F1B; the rows are then fixed data, valid for any durations.
    """
    check_sizes(num_stages, microbatches)
    if num_stages % 2 or num_stages < 4:
        raise ScheduleError(
            "the V-shaped schedule runs two stages per worker on 2 or more workers",
            value={"num_stages": num_stages},
            remedy="use an even stage count of 4 or more, or schedule 'zb-h1'",
        )
    w = num_stages // 2
    mine = [(r, num_stages - 1 - r) for r in range(w)]  # v_shape_placement
    nxt = {(s, k): 0 for s in range(num_stages) for k in "FBW"}
    live = [0] * w  # micro-batches admitted on a worker whose activations are not all freed
    freed: dict[tuple[int, int], int] = {}  # (worker, micro-batch) -> its stages' W run

    def next_of(s: int, kind: str) -> Action:
        return Action(s, kind, nxt[(s, kind)])  # type: ignore[arg-type]

    def options(r: int, ready: Callable[[Action], bool]) -> list[Action]:
        first, second = mine[r]
        bs = [next_of(s, "B") for s in (second, first) if nxt[(s, "B")] < nxt[(s, "F")]]
        out = sorted((a for a in bs if ready(a)), key=lambda a: (a.microbatch, -a.stage))
        if nxt[(second, "F")] < nxt[(first, "F")] and ready(a := next_of(second, "F")):
            out.append(a)
        admit = nxt[(first, "F")] < microbatches and live[r] < min(w, microbatches)
        if admit and ready(a := next_of(first, "F")):
            out.append(a)
        ws = [next_of(s, "W") for s in (first, second) if nxt[(s, "W")] < nxt[(s, "B")]]
        return out + sorted(ws, key=lambda a: (a.microbatch, a.stage))

    def pick(r: int, ready: Callable[[Action], bool]) -> tuple[Action, int] | None:
        if not (found := options(r, ready)):
            return None
        a = found[0]
        nxt[(a.stage, a.kind)] += 1
        live[r] += a.kind == "F" and a.stage == mine[r][0]
        if a.kind == "W":
            freed[(r, a.microbatch)] = freed.get((r, a.microbatch), 0) + 1
            live[r] -= freed[(r, a.microbatch)] == 2
        return a, 1

    total = 3 * num_stages * microbatches
    return _replay(w, num_stages, total, pick, 4 * total + 16)
