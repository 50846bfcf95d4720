"""The whole strategy: data-parallel replicas, pipeline stages and micro-batches, chosen together.

A user's question is "how fast is a training step on my machine?", not "how
balanced is a pipeline I shaped by hand?". So the planner prices every
layout of the cluster's ``N`` devices as ``R`` data-parallel replicas of a
pipeline over ``d`` devices (``R × d = N``) — on one node as on many — and,
for each, the micro-batch count ``M``, and keeps the strategy with the
shortest predicted step (pipeline + gradient all-reduce, simulated under the
schedule). What the caller fixed (``replicas``, ``microbatches``) is a
constraint; everything left at ``None`` is searched.

Layouts (:func:`~crosscut.layouts.candidate_layouts`), cheapest first so a good plan exists
early and the time limit is honoured:

* ``d = 1``: **data parallelism** on every device, the baseline every user
  would try first. It is always priced, and the chosen plan is never
  predicted slower (it is one of the candidates).
* ``d = 2, 4, ...`` dividing a node (stages inside a node; their activations
  cross its links), then replicas spanning ``k`` whole nodes
  (:func:`~crosscut.partitioner.replicas.spanning_layouts`, up to 16 devices).
  Every device of such a layout is used: fewer stages is a smaller layout.
* ``d = N`` on one node: the pipeline over the node, the solver free to leave
  devices idle (``require_all_devices`` as the caller gave it). On a node of
  devices of several kinds this is the only layout: identical replicas need
  identical devices.

Stages replicated to their own degrees, searched by default (``cross_shaped``
``None``: batch splits; ``True``: the splits asked for): in the layout of one
replica, on one node or spanning nodes, a stage may run on a group of devices
(batch-split: data parallelism inside the stage; a replica spanning nodes keeps
only plans whose stages and groups hold every device, as its ranks all run:
:func:`~crosscut.layouts.layout_groups`), so a model's many-FLOP, few-parameter layers
take many devices and its parameter-heavy layers few (the cross-shaped
solver, ``partitioner/solvers/cross.py``, chooses them with the stage
boundaries). A group's shares are priced at their own batch: the attempt
also traces ``ceil(size / w)`` samples for each width ``w``
(:meth:`TraceCache.share_costs`), and by default skips groups when those
traces would not fit the time left (:func:`~crosscut.layouts.share_sizes`). A batch-split
stage never hands on a value its shares cannot join
(``PartitionProblem.batch_major``). Locally each stage position's replicas
are one batch-split group too, so a replicated layout ties every value that
is not a batch-major tensor to its readers (``replicas.batch_major_cuts``):
the solver cuts elsewhere. Only a model whose own output is not batch-major (a
0-d loss it returns) still has its replicated layouts refused, with that
reason.

Micro-batches: each layout tries 1, 2, 4, ... dividing the replica's batch
(:func:`~crosscut.layouts.microbatch_candidates`) in increasing order and stops once the step
grows again, once the plan has one stage (nothing to overlap), or when time
runs short; a count whose plan does not fit the memory caps does not stop it.
Before each attempt a lower bound prunes it: ``M`` micro-batches of work
spread perfectly over ``d`` devices (work conservation), the work of a
micro-batch bounded from the sizes already traced (time per sample never
grows with the batch, and time never shrinks with it). A pruned attempt is
listed with its bound.

The choice: the quickest prediction, unless the costs are profiled and a
simpler strategy (fewer stages, then fewer micro-batches) is predicted within
the profiles' spread of it (``_Search.choose``): a profile is a measurement,
and on a busy machine two strategies 10 % apart can swap places in the next
profile. The quicker row is then listed as ``within noise``, with by how much.

The model is traced once per micro-batch size (:class:`TraceCache`): the
data-parallel layout and a pipeline of ``R/2`` replicas with two micro-batches
read the same graph. A model that writes its own state in forward may rule out
micro-batches and replicas (``state_limits.py``): a row says so.

The plan returned describes one replica (its stages on ``d`` devices of a
node, or of ``k`` nodes, named ``n<node>.<device>``; ``model.batch_size`` = the
replica's batch), records ``R``, the reduction and its time in
``Plan.replication``, and every strategy tried, with its step or why it has
none, in ``Plan.strategy``. ``crosscut run`` starts ``R`` replicas by default
(replica ``r`` on ranks ``r·d .. r·d + d − 1``); ``crosscut.compile`` runs
them locally as batch-split device groups (one group per stage position).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from crosscut.cost_models.subclusters import replica_cluster
from crosscut.errors import CrosscutError, InfeasiblePlanError, InputError, PartitionError
from crosscut.ir.plan import Alternative, Plan, Strategy
from crosscut.ir.schedule import AUTO_SCHEDULE, DEFAULT_SCHEDULE
from crosscut.layouts import (
    Layout,
    candidate_layouts,
    first_count,
    layout_groups,
    microbatch_candidates,
    share_sizes,
)
from crosscut.options import PlanRequest, cross_options
from crosscut.partitioner.annotate import as_replicas, in_rank_order
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.replicas import (
    batch_major_cuts,
    check_replica_exports,
    replica_span,
    runs_in_rank_order,
    stage_nodes,
)
from crosscut.partitioner.schedule_choice import choose_schedule
from crosscut.state_limits import limited_request, traced_limits
from crosscut.traced import Progress, TraceCache, solve_traced

if TYPE_CHECKING:
    from crosscut.cost_models.cluster import Cluster

__all__ = ["plan_strategy"]


def _widths(plan: Plan) -> list[int]:
    """Devices of each stage, where some stage runs on a group; else empty."""
    widths = [len(st.devices) for st in plan.stages]
    return widths if any(w > 1 for w in widths) else []


class _Search:
    """The strategies tried so far: the best plan, every attempt's row, the quickest attempt."""

    def __init__(self, deadline: Deadline, cache: TraceCache, cluster: Cluster) -> None:
        self.deadline, self.cache, self.cluster = deadline, cache, cluster
        self.best: Plan | None = None
        self.best_row = -1
        self.rows: list[Alternative] = []
        self.quickest = 0.0  # seconds of the quickest solve so far
        self.trace_s = 0.0  # seconds of the slowest trace (and pricing) so far
        # the most seconds an attempt ran past its solve's deadline: the solver's set-up and
        # the schedule choice after it cannot be interrupted
        self.overrun_s = 0.0
        self.last_error: InfeasiblePlanError | None = None
        self.rejected: InputError | None = None  # the model refused a micro-batch size
        self.refusal: PartitionError | None = None  # a rule refused a layout
        self.priced: list[tuple[int, Plan, int]] = []  # (row, plan, micro-batch size)
        # what each priced row was planned from: (layout, request, micro-batches)
        self.sources: dict[int, tuple[Layout, PlanRequest, int]] = {}

    def affordable(self, left: float, *sizes: int) -> bool:
        """Whether another attempt fits in ``left`` seconds (always, before any plan).

        An attempt also needs a trace for each of ``sizes`` (samples) not traced yet, and
        may run past its solve's deadline by as much as any attempt before it did."""
        untraced = sum(1 for s in set(sizes) if not self.cache.has(s))
        need = max(self.quickest, self.overrun_s) + self.trace_s * untraced
        return self.best is None or (left > 0.0 and left >= need)

    def row(
        self, lay: Layout, m: int, outcome: str, reason: str = "", plan: Plan | None = None
    ) -> None:
        self.rows.append(
            Alternative(
                replicas=lay.replicas,
                devices=lay.devices,
                microbatches=m,
                outcome=outcome,
                reason=reason,
                stages=0 if plan is None else plan.num_stages,
                step_time_s=0.0 if plan is None else plan.predicted.step_time_s,
                reduction="none" if plan is None else plan.replication.reduction,
                allreduce_s=0.0 if plan is None else plan.replication.allreduce_s,
                widths=[] if plan is None else _widths(plan),
                schedule="" if plan is None else plan.options.schedule,
            )
        )

    def bound(self, lay: Layout, m: int) -> float:
        """Work conservation: ``m`` micro-batches' compute over the replica's devices."""
        size = self.cache.batch // (lay.replicas * m)
        kind = self.cluster.devices[0].kind
        return m * self.cache.work_bound(size, kind) / lay.devices

    def keep(self, plan: Plan, size: int) -> None:
        """Price ``plan`` (its row just written, micro-batches of ``size``) against the
        best so far."""
        self.priced.append((len(self.rows) - 1, plan, size))
        if self.best is None or plan.predicted.step_time_s < self.best.predicted.step_time_s:
            self.best, self.best_row = plan, len(self.rows) - 1

    def choose(self) -> None:
        """The simplest plan within the profiles' noise of the quickest becomes ``best``.

        A profiled prediction is a measurement: one taken a moment later may be
        off by its whole steps' spread (:func:`~crosscut.cost_models.profiled.step_spread`).
        When a pipeline is predicted faster than data parallelism by less than
        that, the ranking is the profile's noise, and the simpler strategy —
        fewer stages, then fewer micro-batches: fewer transfers and less
        per-micro-batch overhead the model does not price — is the safer bet.
        Analytic costs have no spread: the quickest plan is chosen, the simplest
        one on a tie."""
        if self.best is None:
            return
        quick, quick_size = self.best, self._size(self.best_row)

        def simpler(entry: tuple[int, Plan, int]) -> tuple[int, int, float]:
            _, plan, _ = entry
            return (plan.num_stages, plan.options.microbatches, plan.predicted.step_time_s)

        step = quick.predicted.step_time_s
        near = [
            e
            for e in self.priced
            if e[1].predicted.step_time_s
            <= step * (1.0 + max(self.cache.spread(e[2]), self.cache.spread(quick_size)))
        ]
        row, plan, size = min(near, key=simpler)
        if row == self.best_row:
            return
        gap = plan.predicted.step_time_s / step - 1.0
        noise = max(self.cache.spread(size), self.cache.spread(quick_size))
        fast = self.rows[self.best_row]
        fast.outcome = "within noise"
        fast.reason = (
            f"the quickest prediction, but the chosen {self.rows[row].label()} is only "
            f"{gap:.1%} slower: within the profiles' spread ({noise:.1%})"
        )
        plan.solver.notes.append(
            f"chose {self.rows[row].label()} over {fast.label()}: predicted {gap:.1%} "
            f"slower, within the profiles' spread of {noise:.1%} (the simpler strategy)"
        )
        self.best, self.best_row = plan, row

    def _size(self, row: int) -> int:
        return next(size for r, _, size in self.priced if r == row)


def _attempt(
    search: _Search,
    lay: Layout,
    request: PlanRequest,
    m: int,
    share: Callable[[], Deadline],
    progress: Progress | None,
) -> Plan:
    """One replica of ``lay`` with ``m`` micro-batches, priced as ``lay.replicas`` copies.

    ``share()``, called once the graph is traced, is the solve's deadline: its
    part of what tracing left (until a first plan exists, all the call has left)."""
    cache, cluster = search.cache, search.cluster
    size = cache.batch // (lay.replicas * m)
    node = replica_cluster(cluster, lay.devices)
    t0 = time.monotonic()
    graph = cache.graph(size)
    costs = cache.costs(size, node)
    search.trace_s = max(search.trace_s, time.monotonic() - t0)
    groups, splits = layout_groups(lay, request)
    widths = request.widths
    if share_sizes(lay, request, size):  # batch-split shares priced at their own batch
        allowed, _ = cross_options(groups, request.widths, splits, lay.devices)
        costs = cache.share_costs(size, node, allowed)
        # a share the model refuses (batch norm on one value per channel) would fail at
        # run time: no group that splits a micro-batch that finely
        widths = tuple(w for w in allowed if not cache.refuses(-(-size // w)))
    t0 = time.monotonic()
    chosen_later = lay.replicas > 1 and request.schedule == AUTO_SCHEDULE
    if lay.replicas > 1:
        graph = batch_major_cuts(graph)
    req = dataclasses.replace(
        request,
        microbatches=m,
        require_all_devices=lay.require_all,
        cross_shaped=groups,
        splits=splits,
        widths=widths,
        # "auto" groups split by batch only: a co-located tail (two stages on one group)
        # would gain nothing, and `crosscut run` could not run the plan it made
        colocate=request.colocate and request.cross_shaped is not None,
        # replicas: the schedule is chosen once below, with the all-reduce priced
        schedule=DEFAULT_SCHEDULE if chosen_later else request.schedule,
    )
    shapes = [[cache.batch // lay.replicas, *t.shape[1:]] for t in cache.inputs]
    by = search.deadline
    if search.best is not None:  # its share, ending early enough for the overrun seen so far
        by = share().within(search.deadline.left() - search.overrun_s)
    given = by.left()
    plan = solve_traced(
        graph, costs, node, req, input_shapes=shapes, progress=progress, deadline=by
    )
    plan = as_replicas(plan, cluster, lay.replicas)
    if chosen_later:  # with the all-reduce priced
        noise = search.cache.spread(size)
        plan = choose_schedule(plan, not request.fill_devices, noise, by)
    if lay.replicas > 1:
        check_replica_exports(plan)
    wall = time.monotonic() - t0
    search.quickest = wall if search.quickest == 0.0 else min(search.quickest, wall)
    search.overrun_s = max(search.overrun_s, wall - given)
    span = replica_span(plan, lay.replicas)
    if span > 1 and not runs_in_rank_order(plan, span):
        plan = in_rank_order(plan)
    if span > 1 and not runs_in_rank_order(plan, span):
        raise PartitionError(
            "a replica spanning nodes runs stage s on its s-th rank, node by node; this "
            "plan's stages sit on other nodes",
            value={"stage nodes": stage_nodes(plan, span)},
            remedy="a fixed device order would avoid it; the layout is skipped",
        )
    return plan


def _share_of(within: Deadline, parts: int) -> Deadline:
    """An equal part of what is left of ``within`` for each of ``parts`` attempts to come."""
    return within.within(within.left() / parts)


def _one(
    search: _Search,
    lay: Layout,
    request: PlanRequest,
    m: int,
    share: Callable[[], Deadline],
    progress: Progress | None,
) -> Plan | str:
    """One attempt, its row written: the plan, or ``"skip"`` (no fit, pruned: other counts
    may still do), ``"too small"`` (the model refuses so small a micro-batch: fewer
    micro-batches may do) or ``"stop"`` (refused, or no time: the layout ends here)."""
    size = search.cache.batch // (lay.replicas * m)
    # tracing cannot be interrupted: an attempt starts while the whole call's time covers it
    if not search.affordable(search.deadline.left(), size):
        search.row(lay, m, "not tried", "time limit")
        return "stop"
    shares = share_sizes(lay, request, size)
    auto = request.cross_shaped is None
    if shares and auto and not search.affordable(search.deadline.left(), size, *shares):
        request = dataclasses.replace(request, cross_shaped=False)  # "auto": no time for groups
    if search.best is not None:
        lb, best = search.bound(lay, m), search.best.predicted.step_time_s
        if lb >= best:
            search.row(lay, m, "pruned", f"bound {lb:.4g} s >= best {best:.4g} s")
            return "skip"
    try:
        plan = _attempt(search, lay, request, m, share, progress)
    except InfeasiblePlanError as exc:
        search.row(lay, m, "no fit", "no plan fits the memory caps")
        search.last_error = exc
        return "skip"
    except PartitionError as exc:  # e.g. fewer nodes than devices to fill, or no time
        search.row(lay, m, "refused", exc.rule)
        search.refusal = exc
        return "stop"
    except InputError as exc:  # e.g. batch norm refuses a micro-batch of one sample
        search.row(lay, m, "refused", f"the model rejects a micro-batch of {size}")
        search.rejected = exc
        return "too small"
    search.row(lay, m, "priced", plan=plan)
    search.sources[len(search.rows) - 1] = (lay, request, m)
    search.keep(plan, size)
    return plan


def _polish(search: _Search, progress: Progress | None) -> None:
    """Spend the time the search left re-solving the best strategy, if its solve was cut short.

    Every attempt had a share of the limit, and the shares assume every
    micro-batch count of a layout is tried; the unimodal search stops earlier,
    so time is often left when the last layout ends. A solve that stopped at its
    deadline (not proven optimal) may find a better plan for the same (R, M)
    with more time, as a user fixing that (R, M) by hand would; the re-solved
    plan replaces the best one only when its predicted step is shorter."""
    best = search.best
    if best is None or search.best_row not in search.sources:
        return
    if best.solver.status == "OPTIMAL":
        return
    left = search.deadline.left()
    if left <= 0.0 or left < 2.0 * search.quickest:  # at least twice the quickest solve
        return
    lay, request, m = search.sources[search.best_row]
    try:
        plan = _attempt(search, lay, request, m, lambda: search.deadline, progress)
    except CrosscutError:
        return
    before = best.predicted.step_time_s
    if plan.predicted.step_time_s >= before * (1.0 - 1e-9):
        return
    plan.solver.notes.append(
        f"re-solved with the {left:.1f} s the strategy search left: step "
        f"{plan.predicted.step_time_s * 1e3:.4g} ms, was {before * 1e3:.4g} ms"
    )
    row = search.best_row
    search.row(lay, m, "priced", plan=plan)  # written last, then moved into the best's place
    search.rows[row] = search.rows.pop()
    size = search.cache.batch // (lay.replicas * m)
    search.priced = [e for e in search.priced if e[0] != row] + [(row, plan, size)]
    search.best = plan


def _layout(
    search: _Search,
    lay: Layout,
    request: PlanRequest,
    counts: list[int],
    within: Deadline,
    progress: Progress | None,
) -> None:
    """Plan one layout for the micro-batch counts worth trying, a row per attempt.

    From :func:`first_count` upwards while the step shrinks (more micro-batches:
    a smaller bubble and fewer activations in flight; a count that does not
    fit does not stop it), then downwards from there while it shrinks (fewer:
    less per-micro-batch overhead; a count that does not fit ends it, as a
    smaller one would not fit either). The step is taken as unimodal in M."""
    start = first_count(counts, lay.devices)
    tried = [0]
    best_step = float("inf")

    def attempt(m: int) -> Plan | str:
        tried[0] += 1
        share = functools.partial(_share_of, within, max(1, len(counts) - tried[0] + 1))
        return _one(search, lay, request, m, share, progress)

    for m in counts[start:]:
        got = attempt(m)
        if got == "stop":
            return
        if got == "too small":
            break
        if isinstance(got, str):
            continue
        if got.predicted.step_time_s >= best_step:
            break  # past the shortest step
        best_step = got.predicted.step_time_s
        if got.num_stages == 1:
            break  # no pipeline: more micro-batches only add overhead
    for m in reversed(counts[:start]):
        got = attempt(m)
        if isinstance(got, str) or got.predicted.step_time_s >= best_step:
            return
        best_step = got.predicted.step_time_s


def plan_strategy(
    cache: TraceCache,
    cluster: Cluster,
    request: PlanRequest,
    deadline: Deadline | None = None,
    progress: Progress | None = None,
) -> Plan:
    """The fastest (replicas, pipeline, micro-batches) strategy of ``cache``'s model on ``cluster``.

    ``request``: the caller's options (``replicas``/``microbatches`` ``None``:
    searched). Returns by ``deadline`` (default: the request's time limit).
    """
    dl = Deadline.of(deadline, request.time_limit)
    batch = cache.batch
    limits = traced_limits(cache, cluster.total_devices)  # what state written in forward allows
    request = limited_request(request, limits)
    every = candidate_layouts(cluster, request, batch, limits.shares)
    options = [lay for lay in every if not lay.why_not]
    if not options:
        raise InputError(
            f"the batch ({batch}) must split into replicas × micro-batches for some "
            f"layout of {cluster.total_devices} devices",
            value={lay.replicas: lay.why_not for lay in every},
            remedy=f"use a batch that is a multiple of "
            f"{cluster.total_devices * (request.microbatches or 1)}, or leave replicas and "
            "microbatches to the planner",
        )
    # the layouts share the time limit; each solve's own limit is its share of it
    share = dataclasses.replace(request, time_limit=max(1.0, request.time_limit / len(options)))
    search = _Search(dl, cache, cluster)
    for lay in every:
        if lay.why_not:
            search.row(lay, request.microbatches or 1, "excluded", lay.why_not)
    if limits.micro:
        search.row(every[-1], 2, "excluded", limits.micro)
    for i, lay in enumerate(options):
        fixed = request.microbatches
        counts = [fixed] if fixed else microbatch_candidates(batch // lay.replicas)
        within = dl.within(dl.left() / (len(options) - i))  # an equal part of what is left
        _layout(search, lay, share, counts, within, progress)
    _polish(search, progress)
    search.choose()
    best = search.best
    if best is None and search.last_error is None:  # nothing failed for memory
        if search.rejected is not None:
            raise search.rejected  # every layout's batch share was refused by the model
        if search.refusal is not None:
            raise search.refusal  # a rule refused every layout, e.g. too few nodes
    if best is None:
        err = search.last_error
        tried = "; ".join(
            f"{a.replicas}×{a.devices} M={a.microbatches}: {a.outcome}" for a in search.rows
        )
        last = "" if err is None else f" (the last: {err.rule})"
        raise InfeasiblePlanError(
            f"no strategy of replicas × pipeline × micro-batches fits the memory caps{last}: "
            f"{tried}",
            value=None if err is None else err.value,
            remedy=None if err is None else err.remedy,
        ) from err
    for k, row in enumerate(search.rows):
        if row.outcome == "priced":
            row.outcome = "chosen" if k == search.best_row else "slower"
    best.strategy = Strategy(alternatives=search.rows, wall_time_s=dl.elapsed())
    return best
