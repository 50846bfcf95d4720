"""CP-SAT partitioner: the exact solver, seeded and bounded by the baselines.

Flow: baselines (chain_dp, greedy, ...) give an incumbent; then CP-SAT
searches for a plan at most as slow as the incumbent, hinted with it, its stage
windows tightened by the incumbent's value; every plan is re-priced by
evaluate(). A plan is a stage→device map, and the device orders to cover come
from the devices' symmetries (``orders.py``: classes of interchangeable
devices). Identical devices on uniform links need one order model. Devices of
several kinds on uniform links (six accelerators and a CPU core; five GPU
generations) are searched all at once by the class model, where a stage picks
a class of devices: exact. Otherwise every distinct order up to
``orders.ORDER_LIMIT`` gets an :class:`OrderModel` of its own (exact), and
above that the class model with transfers on the fastest link gives a bound
valid for every order plus an order worth searching beside the first two
(heuristic plan, proven bound).

Bounds: besides CP-SAT's own and :func:`~crosscut.partitioner.evaluate.lower_bound`
(the compute averaged over the devices weighted by their speed),
:mod:`crosscut.partitioner.solvers.bounds` gives two valid ones. The static
bound (B) counts the transfers every plan must make; and when small side
trees make up a good share of the graph (swin's relative-position-bias MLPs),
CP-SAT first solves the problem without them (a relaxation, their least cost
charged to their consumers) for a share of the time: its bound is valid
here, its plan (each tree in its consumer's stage) is an incumbent, and when
the two meet the solve stops, optimal.

The time limit covers everything: baselines, the relaxation, building the
models; a small reserve is kept for re-pricing the answer. It is a
:class:`~crosscut.partitioner.deadline.Deadline` shared with the caller (or
made from ``time_limit``): the linear baselines always run (the fallback),
``chain_dp`` and ``greedy`` get at most ``BASELINE_SHARE`` of it, the
relaxation ``RELAX_SHARE``, the device orders the rest in equal parts; a
model is not built once the deadline is past (an order left unsearched makes
the status FEASIBLE or FALLBACK, never OPTIMAL).

Determinism: with ``workers=1`` the search is sequential, so a solve that ends
before its time limit (status OPTIMAL) returns the same plan every run; with
``deterministic=True`` the limit is CP-SAT's deterministic time, so time-limited
solves repeat too. ``workers>1`` runs CP-SAT's parallel portfolio: faster on
hard instances, but a time-limited answer may differ between runs. A
deterministic solve still stops at the wall-clock deadline (its answer then
depends on the machine's speed).
"""

from __future__ import annotations

import dataclasses
import math
import time

from crosscut.errors import InfeasiblePlanError, PartitionError
from crosscut.ir.problem import PartitionProblem
from crosscut.ir.schedule import least_in_flight
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import check, evaluate, lower_bound, renumber
from crosscut.partitioner.solvers.baselines import Plan, all_baselines
from crosscut.partitioner.solvers.bounds import comm_lower_bound, tree_relaxation
from crosscut.partitioner.solvers.cpsat_model import OrderModel
from crosscut.partitioner.solvers.cpsat_search import (
    ROUNDING_GAP,
    Incumbent,
    search_one,
)
from crosscut.partitioner.solvers.orders import (
    ORDER_LIMIT,
    STRATEGIES,
    candidate_orders,
    count_orders,
    device_classes,
    uniform_links,
)
from crosscut.partitioner.solvers.result import SolveResult, relative_gap
from crosscut.partitioner.solvers.settings import SolveSettings

__all__ = ["caps_summary", "infeasibility_report", "solve_cpsat"]

# the class model replaces enumerating orders from this many distinct orders up (exact
# prices only: uniform links; measured in benchmarks/heterogeneous.py)
CLASS_MODEL_ORDERS = 2
RELAX_SHARE = 0.25  # most of the time limit the side-tree relaxation may take
BASELINE_SHARE = 0.3  # most of it chain_dp and greedy may take (the linear baselines always run)
RELAX_MIN_REMOVED = 0.03  # ... and only when it removes at least this share of the nodes
RESERVE_SHARE = 0.03  # of the time limit, kept for re-pricing and CP-SAT's own overshoot


def caps_summary(names: list[str], caps: list[int]) -> str:
    """Memory caps in a line that stays short at 2,048 devices: devices grouped by cap."""
    by_cap: dict[int, list[str]] = {}
    for name, cap in zip(names, caps):
        by_cap.setdefault(cap, []).append(name)
    parts = []
    for cap, devs in sorted(by_cap.items(), key=lambda kv: -kv[0]):
        who = ", ".join(devs) if len(devs) <= 4 else f"{devs[0]} .. {devs[-1]}"
        parts.append(f"{len(devs)} x {cap} ({who})")
    return "; ".join(parts)


def infeasibility_report(pb: PartitionProblem) -> str:
    """The numbers that make the problem infeasible (or look most like it)."""
    least = _least_in_flight(pb)
    need = [pb.resident[v] + least * pb.activation[v] for v in range(pb.n)]
    big = max(range(pb.n), key=lambda v: need[v]) if pb.n else 0
    total = sum(pb.resident) + least * sum(pb.activation)
    caps = caps_summary(pb.devices, pb.mem_cap)
    return (
        f"{pb.n} nodes need at least {total} bytes in all (resident {sum(pb.resident)} + "
        f"activations {sum(pb.activation)} x {least} in flight) vs device caps {caps} "
        f"(sum {sum(pb.mem_cap)}); largest node {pb.names[big]!r} needs resident "
        f"{pb.resident[big]} + activation {pb.activation[big]} x {least} = {need[big]} bytes "
        f"vs largest cap {max(pb.mem_cap)}"
    )


_REMEDY = (
    "add devices or devices with more memory, use a smaller batch / more micro-batches, "
    "use the 1f1b schedule, recompute='auto' or 'always' (activation recomputation), "
    "or allow cross-shaped "
    "(channel-split) stages for nodes larger than one device"
)


def _least_in_flight(pb: PartitionProblem) -> int:
    """Micro-batches of activations any stage keeps at least (1F1B's last stage keeps 1)."""
    if not pb.training:
        return 0
    return 1 if pb.recompute else least_in_flight(pb.schedule, pb.microbatches)


def _precheck(pb: PartitionProblem) -> None:
    least = _least_in_flight(pb)
    too_big = any(pb.resident[v] + least * pb.activation[v] > max(pb.mem_cap) for v in range(pb.n))
    if too_big or sum(pb.resident) > sum(pb.mem_cap):
        raise InfeasiblePlanError(
            "no assignment of the graph to the devices fits the memory caps",
            value=infeasibility_report(pb),
            remedy=_REMEDY,
        )


def _relaxed_bound(
    pb: PartitionProblem, deadline: Deadline, seed: int, workers: int, hint: Plan | None
) -> float:
    d = pb.num_devices
    links = [(a, b) for a in range(d) for b in range(d) if a != b]
    bw = max((pb.bandwidth[a][b] for a, b in links), default=1.0)
    lat = min((pb.latency[a][b] for a, b in links), default=0.0)
    relaxed = dataclasses.replace(
        pb,
        compute=[[min(row)] * d for row in pb.compute],
        mem_cap=[max(pb.mem_cap)] * d,
        bandwidth=[[bw] * d for _ in range(d)],
        latency=[[lat] * d for _ in range(d)],
    )
    if deadline.expired():
        return 0.0  # no time left: the static bound stands
    try:
        # the best plan is feasible here too (faster devices, more memory): a hint, and
        # an incumbent that keeps the relaxed model small
        sub = SolveSettings(deadline=deadline, seed=seed, workers=workers, relax=False, hint=hint)
        return solve_cpsat(relaxed, sub).best_bound
    except PartitionError:
        return 0.0


def _side_tree_phase(
    pb: PartitionProblem, deadline: Deadline, s: SolveSettings
) -> tuple[float, Plan | None, str]:
    """(bound, plan or None, note) from the side-tree relaxation (module docstring)."""
    relaxation = tree_relaxation(pb)
    if relaxation is None or len(relaxation.kept) > (1 - RELAX_MIN_REMOVED) * pb.n:
        return 0.0, None, ""
    # the transfers every plan makes, counted on the relaxation: without the side trees
    # the first and last node of every stage are on the main path (module docstring)
    averaged = comm_lower_bound(relaxation.problem, floating=relaxation.floating)
    # only the search settings: the relaxation has no hint, no progress, no order strategy
    sub_settings = SolveSettings(
        deadline=deadline,
        seed=s.seed,
        workers=s.workers,
        deterministic=s.deterministic,
        relax=False,
        floating=relaxation.floating,
    )
    try:
        sub = solve_cpsat(relaxation.problem, sub_settings)
    except PartitionError:  # no plan of the relaxation within its share
        return averaged, None, ""
    loads = evaluate(relaxation.problem, sub.stage_of, sub.stage_device).stage_time
    plan = renumber(relaxation.expand(sub.stage_of, loads), sub.stage_device)
    note = (
        f"side-tree relaxation ({pb.n - len(relaxation.kept)} of {pb.n} nodes removed): "
        f"{sub.status}, bound {sub.best_bound:.6g} s in {sub.wall_time_s:.2f} s, "
        f"averaged transfer bound {averaged:.6g} s"
    )
    return max(sub.best_bound, averaged), plan, note


@dataclasses.dataclass
class _Coverage:
    """What the searches of one solve proved so far: the status and the bound rest on it."""

    orders: list[list[int]]  # the device orders still to search one by one
    exhaustive: bool  # ``orders`` are every distinct order
    static_lb: float  # valid for every plan (module docstring: bounds)
    global_bound: float  # valid for every plan, raised by what the searches prove
    use_classes: bool = False  # the class model runs (module docstring)
    exact_classes: bool = False  # ... and its prices are exact: it is the whole search
    proved: bool = True  # every search finished
    met: bool = False  # the incumbent meets the static bound (optimal)
    no_plan: bool = False  # a model covering every order has no plan: infeasible
    rounding: float = 0.0  # the most any model's integer rounding may hide (seconds)
    bounds: list[float] = dataclasses.field(default_factory=list)  # one per order searched


def solve_cpsat(problem: PartitionProblem, settings: SolveSettings | None = None) -> SolveResult:
    """Solve the partition problem with CP-SAT; see the module docstring.

    Of ``settings``: ``relax=False`` skips the side-tree relaxation (it is
    itself solved that way); ``floating`` (seconds) is compute the problem
    leaves out that some stage must still run (a relaxation's, see
    ``bounds.tree_relaxation``). ``deadline`` (shared with the caller)
    replaces ``time_limit`` when given. ``orders``: how device orders are
    covered (``orders.STRATEGIES``; the others than "auto" are there to
    measure it, ``benchmarks/heterogeneous.py``). ``hint``: a plan to start
    from (used when it fits).
    """
    s = settings or SolveSettings()
    if s.orders not in STRATEGIES:
        raise ValueError(f"orders must be one of {STRATEGIES}, got {s.orders!r}")
    t0 = time.perf_counter()
    dl = s.deadline_or_limit()
    time_limit = dl.left()  # this solve's budget, for the shares below
    # everything but re-pricing the answer stops here (also CP-SAT's own overshoot)
    work = dl.before(RESERVE_SHARE * time_limit)
    pb = problem
    if s.require_all_devices and pb.n < pb.num_devices:
        raise PartitionError(
            "require_all_devices needs at least one node per device",
            value=f"{pb.n} nodes, {pb.num_devices} devices",
            remedy="drop require_all_devices or coarsen the graph less",
        )
    _precheck(pb)
    classes = device_classes(pb)
    limit = 1 if s.orders == "heuristic" else ORDER_LIMIT
    order_list, exhaustive = candidate_orders(pb, limit, classes)
    min_stages = pb.num_devices if s.require_all_devices else 1
    baselines, inc = _baselines(pb, s, order_list[0], min_stages, work)
    notes: list[str] = []
    static_lb = max(lower_bound(pb, pb.num_devices), comm_lower_bound(pb))
    if s.relax:
        sub_lb, sub_plan, note = _side_tree_phase(pb, work.share(RELAX_SHARE), s)
        static_lb = max(static_lb, sub_lb)
        notes += [note] if note else []
        if sub_plan is not None and len(sub_plan[1]) >= min_stages and not check(pb, *sub_plan):
            obj = evaluate(pb, *sub_plan).objective
            if obj < inc.objective:
                inc.plan, inc.objective = sub_plan, obj
    cov = _Coverage(order_list, exhaustive, static_lb, static_lb)
    auto = s.orders == "auto"
    cov.exact_classes = auto and count_orders(classes) >= CLASS_MODEL_ORDERS and uniform_links(pb)
    cov.use_classes = cov.exact_classes or (auto and not exhaustive)
    if cov.use_classes:
        notes.append(_search_classes(pb, s, classes, inc, cov, work, t0))
    _search_orders(pb, s, inc, cov, work, t0)
    if not cov.proved and work.expired():
        notes.append("the deadline came before every device order was searched to the end")
    _close_bound(pb, s, inc, cov, work)
    wall = time.perf_counter() - t0
    (stage_of, stage_device), status, bound = _verdict(pb, inc, cov, notes, time_limit)
    if not cov.exhaustive:
        notes.append(
            f"searched {len(cov.orders)} of {count_orders(classes)} distinct device orders "
            "one by one (heuristic)"
        )
    if len(stage_device) < pb.num_devices:
        notes.append(
            f"uses {len(stage_device)} of {pb.num_devices} devices: another stage does not pay"
        )
    return SolveResult(
        stage_of=stage_of,
        stage_device=stage_device,
        objective=inc.objective,
        status=status,
        best_bound=bound,
        gap=relative_gap(inc.objective, bound),
        wall_time_s=wall,
        seed=s.seed,
        workers=s.workers,
        solver="cpsat",
        baselines=baselines,
        notes=notes,
    )


def _baselines(
    pb: PartitionProblem, s: SolveSettings, order: list[int], min_stages: int, work: Deadline
) -> tuple[dict[str, float], Incumbent]:
    """The baselines' objectives by name, and the best of them (or the hint) as incumbent."""
    plans = all_baselines(pb, order, min_stages=min_stages, deadline=work.share(BASELINE_SHARE))
    hint = s.hint
    if hint is not None and not check(pb, *hint) and len(hint[1]) >= min_stages:
        plans["hint"] = hint
    baselines = {name: evaluate(pb, *plan).objective for name, plan in plans.items()}
    best: Plan | None = None
    best_obj = math.inf
    for name, plan in plans.items():
        if baselines[name] < best_obj:
            best, best_obj = plan, baselines[name]
    return baselines, Incumbent(best, best_obj)


def _search_classes(
    pb: PartitionProblem,
    s: SolveSettings,
    classes: list[list[int]],
    inc: Incumbent,
    cov: _Coverage,
    work: Deadline,
    t0: float,
) -> str:
    """Search every order at once (module orders.py); the note that says so.

    The whole search when its prices are exact, else a bound for every order
    and one more order worth searching (appended to ``cov.orders``).
    """
    order_list = cov.orders
    om = OrderModel(pb, order_list[0], inc.objective, require_all=s.require_all_devices)
    om.classes = classes
    share = work if cov.exact_classes else work.within(work.left() / (len(order_list) + 1))
    res = search_one(pb, om, inc, cov.static_lb, share, work, s, t0)
    cov.global_bound, cov.met = max(cov.global_bound, res.bound), res.met
    cov.rounding = max(cov.rounding, res.rounding)
    # no plan at all in a model that covers every order (exact, or a relaxation:
    # cheaper links, the same memory): infeasibility proven
    cov.no_plan = res.finished and inc.plan is None
    if cov.exact_classes or cov.no_plan:
        cov.proved, cov.orders = res.finished, []
    elif inc.plan is not None and inc.plan[1] not in [o[: len(inc.plan[1])] for o in order_list]:
        rest = [d for d in order_list[0] if d not in inc.plan[1]]
        order_list.append(list(inc.plan[1]) + rest)
    return f"class model over {count_orders(classes)} device orders" + (
        "" if cov.exact_classes else " (transfers on the fastest link: a bound)"
    )


def _search_orders(
    pb: PartitionProblem,
    s: SolveSettings,
    inc: Incumbent,
    cov: _Coverage,
    work: Deadline,
    t0: float,
) -> None:
    """One model per order left in ``cov.orders``, sharing the time left equally."""
    build_s = 0.0  # the last model build's seconds: a build that would overrun is skipped
    for i, order in enumerate(cov.orders):
        if cov.met:
            cov.bounds.append(cov.static_lb)
            continue
        if work.left() <= build_s:  # (the first build always runs, unless time is up)
            cov.proved = False
            cov.bounds.append(cov.static_lb)
            continue
        om = OrderModel(pb, order, inc.objective, require_all=s.require_all_devices)
        share = work.within(work.left() / (len(cov.orders) - i))
        res = search_one(pb, om, inc, cov.static_lb, share, work, s, t0)
        build_s, cov.met = res.build_s, res.met
        cov.rounding = max(cov.rounding, res.rounding)
        cov.proved = cov.proved and res.finished
        cov.bounds.append(res.bound)


def _close_bound(
    pb: PartitionProblem, s: SolveSettings, inc: Incumbent, cov: _Coverage, work: Deadline
) -> None:
    """Raise ``cov.global_bound`` by what the searches proved, and settle ``exhaustive``."""
    if cov.exhaustive and cov.orders:
        cov.global_bound = max(cov.global_bound, min(cov.bounds, default=cov.static_lb))
    elif not cov.exhaustive and not cov.use_classes and not cov.met:  # ("heuristic" only)
        # a relaxation valid for every device order: each node on its fastest device,
        # the largest cap everywhere, the fastest link between every pair
        relaxed = _relaxed_bound(pb, work, s.seed, s.workers, inc.plan)
        cov.global_bound = max(cov.global_bound, relaxed)
    cov.exhaustive = cov.exhaustive or cov.exact_classes or (cov.use_classes and cov.no_plan)


def _verdict(
    pb: PartitionProblem, inc: Incumbent, cov: _Coverage, notes: list[str], time_limit: float
) -> tuple[Plan, str, float]:
    """The incumbent, its status and its bound; raises when there is no incumbent."""
    best, best_obj = inc.plan, inc.objective
    if best is None:
        if cov.proved and cov.exhaustive:
            raise InfeasiblePlanError(
                "no assignment of the graph to the devices fits the memory caps",
                value=infeasibility_report(pb),
                remedy=_REMEDY,
            )
        raise PartitionError(
            f"no plan found within the time limit of {time_limit} s and no baseline fits memory",
            value=infeasibility_report(pb),
            remedy="raise the time limit; " + _REMEDY,
        )
    bound = min(cov.global_bound, best_obj)
    tight = best_obj - cov.global_bound <= max(cov.rounding, ROUNDING_GAP * best_obj)
    if tight or (cov.proved and (cov.exhaustive or cov.met) and not pb.fanout):
        return best, "OPTIMAL", bound
    if cov.proved and cov.exhaustive:  # optimal for the model, which prices fan-out low
        notes.append(
            "optimal for the solver's model, which sends a fanned-out value once per "
            f"stage; this plan's per-reader aliases add {best_obj - cov.global_bound:.3g} s "
            "it does not model (partitioner/fanout_cost.py), so it is not proved optimal"
        )
        return best, "FEASIBLE", bound
    if inc.found:
        return best, "FEASIBLE", bound
    notes.append("CP-SAT found no plan within the time limit: returning the best baseline")
    return best, "FALLBACK", bound
