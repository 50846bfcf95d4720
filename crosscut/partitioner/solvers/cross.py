"""Cross-shaped search: stage boundaries, group widths and split kinds chosen together.

A stage may run on a group of devices (``partitioner/group_costs.py`` prices it).
The search space here is every split of the node order into contiguous
chunks, each chunk on a group of ``w`` consecutive devices of the device order
(``w`` from ``problem.widths``) split by a kind from ``problem.splits`` (or a
single device), where the last chunk may also share the group of the chunk
before it (a co-located tail: Krizhevsky's "one weird trick", convolutions
split by batch and the classifier split by channel on the same devices: vgg16
on 8 V100s at batch 64 reaches 1.09x the lower bound, against 1.19x for the
best plan of disjoint groups, 7 by batch and 1, since 64 samples do not split
evenly over 7 devices). A min-max dynamic program over ``(devices used,
boundary)`` finds the best such plan per stage count, exactly as ``chain_dp``
does for one device per stage: its stage prices are evaluate()'s formulas
written on prefix sums, exact on chains with uniform links and an
approximation where a node feeds several later stages or links differ (every
candidate is then re-priced by evaluate(), which is what is reported).

Why a DP and not CP-SAT width literals: with ``W`` widths and ``K`` kinds the
DP costs ``O(S · D · W · K · n²)`` numpy operations (about a second for
inception_v3 on 8 devices; the co-located tail adds ``O(S · D · W · K² · n²)``),
stays deterministic, and the pipeline-only CP-SAT plan is always a candidate
too, so a cross-shaped answer is never worse than the plain one.

Deadlines: the DP grows plans one stage at a time (``k`` stages before
``k + 1``), so stopping it is cheap: it checks its
:class:`~crosscut.partitioner.deadline.Deadline` before every group shape it
prices and keeps the plans of every stage count it finished (a note says
where it stopped). resnet50 on 64 V100s took 28 s of DP alone before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from crosscut.errors import InfeasiblePlanError
from crosscut.ir.problem import PartitionProblem, StageGroup
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import (
    check,
    comm_multiplier,
    evaluate,
    lower_bound,
    single_groups,
)
from crosscut.partitioner.group_costs import batch_split_refused
from crosscut.partitioner.solvers.baselines import allowed_cuts, device_order
from crosscut.partitioner.solvers.cpsat import caps_summary
from crosscut.partitioner.solvers.cross_tables import ChunkTables, StageShape
from crosscut.partitioner.solvers.result import SolveResult, relative_gap
from crosscut.partitioner.stage_memory import activation_factor, buffer_factor

__all__ = [
    "GroupPlan",
    "cross_dp",
    "cross_dp_search",
    "data_parallel",
    "group_types",
    "solve_cross",
]

GroupPlan = tuple[list[int], list[StageGroup]]  # (stage_of, group of every stage)


def group_types(problem: PartitionProblem) -> list[tuple[int, str]]:
    """(width, split) of every stage shape the search may use; (1, "none") first."""
    out = [(1, "none")]
    for w in sorted(set(problem.widths)):
        if 1 < w <= problem.num_devices:
            out += [(w, s) for s in ("batch", "channel") if s in problem.splits]
    return out


def data_parallel(problem: PartitionProblem, order: list[int] | None = None) -> GroupPlan | None:
    """One stage, batch-split over every device: the data-parallel yardstick."""
    order = order or device_order(problem)
    plan: GroupPlan = ([0] * problem.n, [StageGroup(tuple(order), "batch")])
    if len(order) < 2:
        plan = ([0] * problem.n, [StageGroup(tuple(order[:1]))])
    return plan if not check(problem, plan[0], [g.leader for g in plan[1]], plan[1]) else None


def cross_dp(
    problem: PartitionProblem,
    order: list[int] | None = None,
    max_stages: int | None = None,
    *,
    colocate: bool = True,
    deadline: Deadline | None = None,
) -> GroupPlan | None:
    """The best plan of contiguous chunks on contiguous device groups (module docstring).

    ``colocate=False`` leaves out plans whose last two stages share a group (the
    distributed runtime runs one stage per device). ``deadline``: the best plan
    of the stage counts finished by then (None if not even one stage was).
    """
    return cross_dp_search(problem, order, max_stages, colocate=colocate, deadline=deadline)[0]


def cross_dp_search(
    problem: PartitionProblem,
    order: list[int] | None = None,
    max_stages: int | None = None,
    *,
    colocate: bool = True,
    deadline: Deadline | None = None,
    use_all: bool = False,
) -> tuple[GroupPlan | None, bool]:
    """:func:`cross_dp`, and whether it searched its whole space before ``deadline``;
    ``use_all``: only plans whose groups hold every device (a replica spanning nodes,
    whose ranks all run a stage)."""
    pb = problem
    order = order or device_order(pb)
    n, num = pb.n, len(order)
    if n == 0:
        return None, True
    tb = ChunkTables.build(pb)
    ok = np.asarray(allowed_cuts(pb))
    valid = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]
    types = group_types(pb)
    batch_bad = _batch_bad(pb)
    shapes: dict[tuple[int, int, str], StageShape] = {}

    def shape(d: int, w: int, split: str) -> StageShape:
        key = (d, w, split)
        if key not in shapes:
            shapes[key] = StageShape(tb, StageGroup(tuple(order[d : d + w]), split))
        return shapes[key]

    # a co-located pair is two stages on one group, so there may be one stage per device
    # and one more
    smax = min(max_stages or num + 1, num + 1, n)
    s_loop = pb.training and pb.schedule == "1f1b" and pb.microbatches > 1
    best: GroupPlan | None = None
    best_key = (math.inf, math.inf)
    complete = True
    for total in range(1, smax + 1) if s_loop else [smax]:
        if deadline is not None and deadline.expired():
            complete = False
            break
        se = _Search(pb, tb, order, total, types, ok, valid, shape, deadline, batch_bad)
        plans, done = _dp(se, s_loop, colocate, use_all)
        complete = complete and done
        for plan in plans:
            stage_device = [g.leader for g in plan[1]]
            if check(pb, plan[0], stage_device, plan[1]):
                continue
            ev = evaluate(pb, plan[0], stage_device, plan[1])
            key = (ev.objective, sum(ev.stage_time))
            if key < best_key:
                best, best_key = plan, key
    return best, complete


def _batch_bad(pb: PartitionProblem) -> np.ndarray | None:
    """``bad[a, b]``: chunk ``[a, b)`` hands on a value a batch split cannot join
    (:func:`~crosscut.partitioner.group_costs.batch_split_refused`); None if none does."""
    refused = batch_split_refused(pb)
    if not refused:
        return None
    bad = np.zeros((pb.n + 1, pb.n + 1), dtype=bool)
    for v, last in refused:
        bad[: v + 1, v + 1 : last + 1] = True
    return bad


@dataclass
class _Search:
    """What every DP step shares: the problem, its tables, the device order, the shapes."""

    pb: PartitionProblem
    tb: ChunkTables
    order: list[int]
    total: int
    types: list[tuple[int, str]]
    ok: np.ndarray
    valid: np.ndarray
    shape: Callable[[int, int, str], StageShape]
    deadline: Deadline | None = None
    # chunk [a, b) may not be split by batch: it hands on a value that is not batch-major
    batch_bad: np.ndarray | None = None

    def expired(self) -> bool:
        return self.deadline is not None and self.deadline.expired()

    def priced(
        self, d: int, w: int, split: str, k: int, link_in: bool, link_out: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Time of every chunk ``[a, b)`` as stage ``k`` on ``order[d:d+w]``, and its memory.

        ``link_in``/``link_out``: whether values arrive from / leave for another
        device group over a link (not so between co-located stages).
        """
        pb, tb, order = self.pb, self.tb, self.order
        n = pb.n
        sh = self.shape(d, w, split)
        lead = order[d]
        com = np.zeros((n + 1, n + 1))
        if link_in:
            src = order[d - 1]
            com += tb.rl * pb.latency[src][lead] + tb.rb / pb.bandwidth[src][lead]
        if link_out:
            dst = order[d + w]
            com += tb.sl * pb.latency[lead][dst] + tb.sb / pb.bandwidth[lead][dst]
        com = comm_multiplier(pb) * com + sh.coll
        t = np.maximum(sh.compute, com) if pb.overlap_comm else sh.compute + com
        af = activation_factor(pb, k, self.total)
        bf = buffer_factor(pb, k, self.total)
        lead_mem, other_mem = sh.memory(tb, af, bf)
        return t, lead_mem, other_mem

    def caps(self, d: int, w: int) -> tuple[int, float]:
        """Memory cap of the group's leader and the smallest cap of the others."""
        others = self.order[d + 1 : d + w]
        return self.pb.mem_cap[self.order[d]], min(
            (self.pb.mem_cap[x] for x in others), default=math.inf
        )

    def bad_cuts(self, k: int) -> np.ndarray:
        """``bad[a, b]``: chunk ``[a, b)`` is empty or starts/ends inside a tie group."""
        n = self.pb.n
        bad = ~self.valid
        if k > 0:
            bad = bad | ~self.ok[:, None]
        return bad | (~self.ok[None, :] & (np.arange(n + 1) < n)[None, :])


_Back = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]


def _dp(
    se: _Search, exact_count: bool, colocate: bool = True, use_all: bool = False
) -> tuple[list[GroupPlan], bool]:
    """Min-max DP over (stage k, devices used d, boundary b); one plan per stage count.

    Besides one plan per stage count it returns, per stage count, the best plan
    whose last two stages share one device group (:func:`_colocated_tail`), and
    whether it finished before the deadline (else: the plans of the stage
    counts it finished).
    """
    pb, order, total = se.pb, se.order, se.total
    n, num = pb.n, len(order)
    vals = {0: np.full(n + 1, np.inf)}
    vals[0][0] = 0.0
    hist = [vals]  # hist[k]: best value per (devices used, boundary) after k stages
    back: list[_Back] = []
    plans: list[GroupPlan] = []
    for k in range(total):
        new: dict[int, np.ndarray] = {}
        arg: _Back = {}
        bad_cut = se.bad_cuts(k)
        for d, row in vals.items():
            if not np.isfinite(row).any():
                continue
            for ti, (w, split) in enumerate(se.types):
                if d + w > num:
                    continue
                if se.expired():  # stage k unfinished: the plans of 1..k stages stand
                    return plans, False
                t, lead_mem, other_mem = se.priced(d, w, split, k, k > 0, d + w < num)
                cap_lead, cap_other = se.caps(d, w)
                bad = bad_cut | (lead_mem > cap_lead) | (other_mem > cap_other)
                if split == "batch" and se.batch_bad is not None:
                    bad = bad | se.batch_bad
                cand = np.where(bad, np.inf, np.maximum(row[:, None], t))
                a_best = np.argmin(cand, axis=0)
                v_best = cand[a_best, np.arange(n + 1)]
                key = d + w
                if key not in new:
                    new[key] = np.full(n + 1, np.inf)
                    arg[key] = (np.zeros(n + 1, int), np.zeros(n + 1, int), np.zeros(n + 1, int))
                better = v_best < new[key]
                new[key] = np.where(better, v_best, new[key])
                for arr, val in zip(arg[key], (a_best, np.full(n + 1, d), np.full(n + 1, ti))):
                    arr[better] = val[better]
        vals = new
        hist.append(vals)
        back.append(arg)
        if exact_count and k < total - 1:
            continue
        ends = [
            (v[n], d) for d, v in vals.items() if np.isfinite(v[n]) and (not use_all or d == num)
        ]
        if ends:
            plans.append(_backtrack(se, back, min(ends)[1], n))
        if k >= 1 and colocate and not use_all:
            tail = _colocated_tail(se, k, hist[k - 1], back[: k - 1])
            if tail is not None:
                plans.append(tail)
    return plans, not se.expired()


def _colocated_tail(
    se: _Search, k: int, before: dict[int, np.ndarray], back: list[_Back]
) -> GroupPlan | None:
    """The best plan whose stages ``k - 1`` and ``k`` (the last) share one group.

    Krizhevsky's "one weird trick" on the same devices: e.g. convolutions split
    by batch, then the parameter-heavy classifier split by channel (or run by
    the leader), so no device idles while another holds the classifier. The
    pair over ``[a, c)`` and ``[c, n)`` costs each device of the group
    ``t1[a, c] + t2[c, n]`` (they take turns); with the tail fixed at ``n``
    this is one ``(a, c)`` matrix per group, so it stays as cheap as a DP
    step. A co-located pair in the middle of the plan would need a min-plus
    product per step (``O(n^3)``) and is not searched.
    """
    pb, order = se.pb, se.order
    n, num = pb.n, len(order)
    splits: list[str] = [s for s in ("batch", "channel") if s in pb.splits]
    widths = sorted({w for w in pb.widths if 1 < w <= num})
    best: tuple[float, int, int, str, str, int, int] | None = None
    bad_first = se.bad_cuts(k - 1)
    for d, row in before.items():
        if not np.isfinite(row).any():
            continue
        for w in widths:
            if d + w > num:
                continue
            cap_lead, cap_other = se.caps(d, w)
            if se.expired():
                break  # the best tail so far (the caller sees the deadline too)
            for s1 in splits:
                t1, lm1, om1 = se.priced(d, w, s1, k - 1, k - 1 > 0, False)
                for s2 in splits:
                    t2, lm2, om2 = se.priced(d, w, s2, k, False, False)
                    # second chunk [c, n): column n, indexed by c; c must be a legal cut < n
                    tot = t1 + t2[:, n][None, :]
                    bad = bad_first | ~se.ok[None, :] | ~se.valid[:, n][None, :]
                    bad |= lm1 + lm2[:, n][None, :] > cap_lead
                    bad |= om1 + om2[:, n][None, :] > cap_other
                    if se.batch_bad is not None:  # [a, c) first, [c, n) second
                        if s1 == "batch":
                            bad |= se.batch_bad
                        if s2 == "batch":
                            bad |= se.batch_bad[:, n][None, :]
                    cand = np.where(bad, np.inf, np.maximum(row[:, None], tot))
                    flat = int(np.argmin(cand))
                    val = float(cand.flat[flat])
                    if math.isfinite(val) and (best is None or val < best[0]):
                        best = (val, d, w, s1, s2, *divmod(flat, n + 1))
    if best is None:
        return None
    _, d, w, s1, s2, a, c = best
    stage_of, groups = _backtrack(se, back, d, a) if back else ([0] * n, [])
    devices = tuple(order[d : d + w])
    groups = [*groups, StageGroup(devices, s1), StageGroup(devices, s2)]
    first = len(groups) - 2
    for v in range(a, n):
        stage_of[v] = first if v < c else first + 1
    return stage_of, groups


def _backtrack(se: _Search, back: list[_Back], used: int, end: int) -> GroupPlan:
    """Stages ``0 .. len(back) - 1`` covering nodes ``[0, end)`` on ``used`` devices.

    Nodes from ``end`` on are left in stage 0 for the caller to place.
    """
    b, d_end = end, used
    chunks: list[tuple[int, int, StageGroup]] = []
    for k in range(len(back) - 1, -1, -1):
        a_arr, d_arr, t_arr = back[k][d_end]
        a, d, ti = int(a_arr[b]), int(d_arr[b]), int(t_arr[b])
        w, split = se.types[ti]
        chunks.append((a, b, StageGroup(tuple(se.order[d : d + w]), split)))
        b, d_end = a, d
    chunks.reverse()
    stage_of = [0] * se.pb.n
    for k, (a, bb, _) in enumerate(chunks):
        for v in range(a, bb):
            stage_of[v] = k
    return stage_of, [g for _, _, g in chunks]


def solve_cross(
    problem: PartitionProblem,
    pipeline: tuple[list[int], list[int]] | None = None,
    *,
    pipeline_name: str = "pipeline",
    seed: int = 0,
    colocate: bool = True,
    deadline: Deadline | None = None,
    use_all: bool = False,
) -> SolveResult:
    """The best of: the group DP, data parallelism, and a given pipeline-only plan.

    ``use_all``: every device must run a stage or a share of one (a replica spanning
    nodes under torchrun has a rank on every device); the DP keeps only such plans.

    ``pipeline`` (stage_of, stage_device) is typically the CP-SAT answer on the
    same problem without groups; keeping it as a candidate means allowing
    cross-shaped stages never makes a plan worse. Raises InfeasiblePlanError
    when no candidate fits the memory caps. ``deadline`` stops the group DP
    (its best plan so far competes; a note says so).
    """
    t0 = time.perf_counter()
    order = device_order(problem)
    cands: dict[str, GroupPlan] = {}
    if pipeline is not None:
        cands[pipeline_name] = (list(pipeline[0]), single_groups(pipeline[1]))
    dp = data_parallel(problem, order)
    if dp is not None:
        cands["data_parallel"] = dp
    found, complete = cross_dp_search(
        problem, order, colocate=colocate, deadline=deadline, use_all=use_all
    )
    if found is not None:
        cands["cross_dp"] = found
    baselines: dict[str, float] = {}
    best_name, best_key = "", (math.inf, math.inf)
    for name, (stage_of, groups) in cands.items():
        leaders = [g.leader for g in groups]
        if check(problem, stage_of, leaders, groups):
            baselines[name] = math.inf
            continue
        ev = evaluate(problem, stage_of, leaders, groups)
        baselines[name] = ev.objective
        if (ev.objective, sum(ev.stage_time)) < best_key:
            best_name, best_key = name, (ev.objective, sum(ev.stage_time))
    if not best_name:
        raise InfeasiblePlanError(
            "no pipeline, data-parallel or cross-shaped plan fits the memory caps",
            value=f"caps {caps_summary(problem.devices, problem.mem_cap)}, widths "
            f"{list(problem.widths)}, splits {list(problem.splits)}",
            remedy="allow wider groups or channel splits, add devices, or use more micro-batches",
        )
    stage_of, groups = cands[best_name]
    bound = min(lower_bound(problem), best_key[0])
    return SolveResult(
        stage_of=stage_of,
        stage_device=[g.leader for g in groups],
        objective=best_key[0],
        status="FEASIBLE",
        best_bound=bound,
        gap=relative_gap(best_key[0], bound),
        wall_time_s=time.perf_counter() - t0,
        seed=seed,
        workers=1,
        solver="cross",
        baselines=baselines,
        notes=[
            f"cross-shaped search (widths {list(problem.widths)}, splits "
            f"{list(problem.splits)}): chose {best_name}; the group DP covers contiguous "
            "chunks on contiguous device groups, so the status is FEASIBLE, not OPTIMAL"
        ]
        + (
            []
            if complete
            else ["the group DP stopped at the deadline: plans with more stages were not searched"]
        ),
        groups=list(groups),
    )
