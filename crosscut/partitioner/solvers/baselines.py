"""Baseline partitioners: what existing pipeline planners reach, priced by evaluate().

They serve three purposes: a fallback plan when CP-SAT runs out of time, a
hint (and an upper bound) that makes CP-SAT fast, and the yardstick every
solve reports ("beat chain_dp by 12 %"). All of them cut the fixed node order
(``problem.names`` is topological) into contiguous chunks, as torchgpipe's
``balance_by_time``, DeepSpeed's ``partition_balanced`` and PiPPy do; only
``greedy`` leaves the chain by moving single nodes.

Deadlines: ``uniform_by_count``, ``param_balanced`` and ``time_balanced`` cost
a few evaluate() calls (linear in the graph), so they always run and there is
always a fallback plan. ``chain_dp`` is quadratic in the nodes and ``greedy``
re-prices the plan hundreds of times, so both take a
:class:`~crosscut.partitioner.deadline.Deadline` and stop before a step that
would not fit in it, keeping the best plan found so far.

Each returns ``(stage_of, stage_device)`` or ``None`` when no plan of its kind
fits the memory caps. Stage ``k`` runs on ``order[k]``: :func:`device_order`
picks a path through the devices over the fastest links.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np

from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import check, comm_multiplier, consumers, evaluate, renumber
from crosscut.partitioner.stage_memory import activation_factor, buffer_factor

__all__ = [
    "Plan",
    "all_baselines",
    "allowed_cuts",
    "chain_dp",
    "chunked",
    "device_order",
    "greedy",
    "param_balanced",
    "snap_cuts",
    "time_balanced",
    "uniform_by_count",
]

Plan = tuple[list[int], list[int]]  # (stage_of, stage_device)


def device_order(problem: PartitionProblem) -> list[int]:
    """Devices in the order stages should use them: the path with the cheapest links.

    Consecutive stages exchange most of the traffic, so the path minimises the
    sum of one typical transfer (median output size, median latencies per
    transfer) over consecutive pairs.
    Exact over subsets for up to 12 devices (a Held-Karp path), greedy above.
    Ties keep the natural order, so identical devices come out as 0, 1, 2, ...
    """
    num = problem.num_devices
    sizes = sorted(b for b in problem.out_bytes if b > 0) or [0]
    ref = sizes[len(sizes) // 2]
    lats = sorted(problem.latencies(v) for v in range(problem.n)) or [1.0]
    ref_lat = lats[len(lats) // 2]

    def link(a: int, b: int) -> int:
        # integer picoseconds: exact sums, so equal paths tie exactly and keep natural order
        return round(1e12 * (ref_lat * problem.latency[a][b] + ref / problem.bandwidth[a][b]))

    if num <= 2:
        return list(range(num))
    if num > 12:
        path, left = [0], set(range(1, num))
        while left:
            nxt = min(left, key=lambda d: (link(path[-1], d), d))
            path.append(nxt)
            left.remove(nxt)
        return path
    inf = float("inf")
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
    for d in range(num):
        best[(1 << d, d)] = (0, (d,))
    for mask in range(1, 1 << num):
        for last in range(num):
            cur = best.get((mask, last))
            if cur is None:
                continue
            for d in range(num):
                if mask >> d & 1:
                    continue
                cand = (cur[0] + link(last, d), (*cur[1], d))
                key = (mask | 1 << d, d)
                old = best.get(key, (inf, ()))
                if cand < old:
                    best[key] = cand
    full = (1 << num) - 1
    return list(min((best[(full, d)] for d in range(num)), key=lambda c: (c[0], c[1]))[1])


def allowed_cuts(problem: PartitionProblem) -> list[bool]:
    """``allowed[i]``: a stage boundary may fall just before node ``i`` (no tie split)."""
    ok = [True] * (problem.n + 1)
    for group in problem.ties:
        if group:
            for i in range(min(group) + 1, max(group) + 1):
                ok[i] = False
    return ok


def chunked(problem: PartitionProblem, cuts: list[int], order: list[int]) -> Plan:
    """The node order cut before each of ``cuts``; chunk ``k`` on device ``order[k]``."""
    bounds = [0, *sorted(set(cuts)), problem.n]
    stage_of = [0] * problem.n
    for k in range(len(bounds) - 1):
        for v in range(bounds[k], bounds[k + 1]):
            stage_of[v] = k
    return renumber(stage_of, order[: len(bounds) - 1])


def snap_cuts(problem: PartitionProblem, targets: list[float]) -> list[int]:
    """Allowed cut positions nearest to the targets, increasing, no repeats."""
    ok = allowed_cuts(problem)
    cuts: list[int] = []
    for t in targets:
        cands = [i for i in range(1, problem.n) if ok[i] and (not cuts or i > cuts[-1])]
        if cands:
            cuts.append(min(cands, key=lambda i: (abs(i - t), i)))
    return cuts


def _feasible(problem: PartitionProblem, plan: Plan) -> Plan | None:
    return plan if not check(problem, *plan) else None


def uniform_by_count(
    problem: PartitionProblem, num_stages: int | None = None, order: list[int] | None = None
) -> Plan | None:
    """Contiguous chunks with (nearly) equal node counts — the naive split."""
    order = order or device_order(problem)
    s = min(num_stages or len(order), problem.n, len(order))
    cuts = snap_cuts(problem, [problem.n * k / s for k in range(1, s)])
    return _feasible(problem, chunked(problem, cuts, order))


def param_balanced(
    problem: PartitionProblem, num_stages: int | None = None, order: list[int] | None = None
) -> Plan | None:
    """Contiguous chunks with balanced resident bytes (DeepSpeed/PiPPy's default)."""
    order = order or device_order(problem)
    s = min(num_stages or len(order), problem.n, len(order))
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(problem.resident, dtype=float))])
    total = float(prefix[-1]) or 1.0
    targets = [float(np.searchsorted(prefix, total * k / s)) for k in range(1, s)]
    cuts = snap_cuts(problem, targets)
    return _feasible(problem, chunked(problem, cuts, order))


def time_balanced(problem: PartitionProblem, order: list[int] | None = None) -> Plan | None:
    """Contiguous chunks balancing compute time (torchgpipe's ``balance_by_time``), linear.

    Stage ``k`` gets a share of the total compute proportional to the speed of
    ``order[k]``; every stage count up to the device count is tried (powers of two
    and the count itself above 16 devices) and the best feasible split kept. It
    costs one evaluate() per stage count, so it is the fallback that always runs.
    """
    order = order or device_order(problem)
    n = problem.n
    if n == 0:
        return None
    comp = np.asarray(problem.compute, dtype=float)
    ref = comp.min(axis=1)
    speed = [float(ref.sum() / max(comp[:, d].sum(), 1e-30)) for d in order]
    prefix = np.concatenate([[0.0], np.cumsum(ref)])
    top = min(len(order), n)
    counts = list(range(1, top + 1))
    if top > 16:
        counts = sorted({*(1 << i for i in range(top.bit_length())), top})
    best: Plan | None = None
    best_key = (np.inf, np.inf)
    for s in counts:
        cum = np.cumsum(speed[:s]) / sum(speed[:s])
        targets = [float(np.searchsorted(prefix, prefix[-1] * c)) for c in cum[:-1]]
        plan = _feasible(problem, chunked(problem, snap_cuts(problem, targets), order))
        if plan is None:
            continue
        ev = evaluate(problem, *plan)
        key = (ev.objective, sum(ev.stage_time))
        if key < best_key:
            best, best_key = plan, key
    return best


# seconds per chunk cell (``(n + 1)^2`` of them) to build chain_dp's transfer matrices,
# measured at about 1e-7 on a loaded 2-core machine: chain_dp is skipped when even these
# would not fit in the deadline; later steps are timed as they run
_CELL_S = 1.5e-7


def _comm_matrices(
    problem: PartitionProblem, weights: Sequence[float] | None = None
) -> tuple[np.ndarray, ...]:
    """For every chunk ``[a, b)``: count and bytes received from before ``a`` and sent past ``b``.

    A transfer of node ``u`` counts ``weights[u]`` (default 1): with
    ``PartitionProblem.latencies`` the counts are the latencies the link charges.
    The received part is exact. The sent part charges each node once if any
    consumer lies past ``b`` — exact unless a node feeds two or more later
    stages, where it is a lower bound (the DP then is a heuristic; evaluate()
    prices its answer exactly).
    """
    n = problem.n
    rc = np.zeros((n + 1, n + 2))
    rb = np.zeros((n + 1, n + 2))
    sc = np.zeros((n + 2, n + 2))
    sb = np.zeros((n + 2, n + 2))
    for u, cons in enumerate(consumers(problem)):
        if not cons:
            continue
        arr = np.asarray(cons)
        maxc = cons[-1]
        rows = np.arange(u + 1, maxc + 1)
        nxt = arr[np.searchsorted(arr, rows)]
        count = 1.0 if weights is None else float(weights[u])
        np.add.at(rc, (rows, nxt + 1), count)
        np.add.at(rb, (rows, nxt + 1), float(problem.out_bytes[u]))
        for mat, val in ((sc, count), (sb, float(problem.out_bytes[u]))):
            mat[0, u + 1] += val
            mat[0, maxc + 1] -= val
            mat[u + 1, u + 1] -= val
            mat[u + 1, maxc + 1] += val
    # prefix sums in place: on 2,500+ nodes each matrix is ~50 MB, and fresh copies
    # cost more in page faults than the sums themselves
    for mat in (rc, rb):
        np.cumsum(mat, axis=1, out=mat)
    for mat in (sc, sb):
        np.cumsum(mat, axis=0, out=mat)
        np.cumsum(mat, axis=1, out=mat)
    return rc[:, : n + 1], rb[:, : n + 1], sc[: n + 1, : n + 1], sb[: n + 1, : n + 1]


def chain_dp(
    problem: PartitionProblem,
    order: list[int] | None = None,
    max_stages: int | None = None,
    min_stages: int = 1,
    *,
    deadline: Deadline | None = None,
) -> Plan | None:
    """The best contiguous split of the node order, by dynamic programming over boundaries.

    For every stage count ``S`` a min-max DP over ``(stage, boundary)`` finds
    the split minimising the bottleneck stage time including transfers, under
    the exact memory caps (1F1B in-flight counts depend on ``S``, hence the
    loop). Every candidate, plus the naive contiguous splits, is re-priced by
    evaluate() and the best kept, so it is never worse than them. The DP is exact
    unless a node feeds two or more later stages (see :func:`_comm_matrices`).
    This is what torchgpipe/PipeDream-style planners reach at best.

    ``deadline``: a DP step (one stage of one stage count, ``O(n^2)``) starts
    only when the last one would still fit; the stage counts finished by then
    compete with the naive splits, so a plan comes back whenever one fits.
    """
    order = order or device_order(problem)
    n = problem.n
    smax = min(max_stages or len(order), len(order), n)
    cands: list[Plan | None] = []
    if min_stages <= 1:
        # the naive contiguous splits too: the DP's send cost is a lower bound when a
        # node feeds several later stages, so one of them can price better exactly
        cands += [uniform_by_count(problem, None, order), param_balanced(problem, None, order)]
    if deadline is None or deadline.left() > _CELL_S * (n + 1) ** 2:
        cands += _chain_dp_plans(problem, order, smax, min_stages, deadline)
    best_plan: Plan | None = None
    best_key: tuple[float, float] | None = None
    for plan in cands:
        if plan is None or check(problem, *plan):
            continue
        ev = evaluate(problem, *plan)
        key = (ev.objective, sum(ev.stage_time))
        if best_key is None or key < best_key:
            best_key, best_plan = key, plan
    return best_plan


class _DPStep:
    """One step of chain_dp (stage ``k`` of ``s`` on device ``order[k]``) over every chunk.

    Each table is ``(n+1)^2`` floats, ~50 MB on 2,500 nodes; the work arrays are
    allocated once and reused, because fresh ones per step cost more in page
    faults than the arithmetic (the first step took 0.8 s on such a graph, and
    on a loaded machine a step is what overran the deadline).
    """

    def __init__(self, problem: PartitionProblem, order: list[int]) -> None:
        self.problem, self.order = problem, order
        self.mult = comm_multiplier(problem)
        lat = [problem.latencies(v) for v in range(problem.n)]
        self.rc, self.rb, self.sc, self.sb = _comm_matrices(problem, lat)
        comp = np.asarray(problem.compute, dtype=float)
        self.pre_c = np.vstack([np.zeros(comp.shape[1]), np.cumsum(comp, axis=0)])
        pre_r = np.concatenate([[0.0], np.cumsum(np.asarray(problem.resident, dtype=float))])
        pre_a = np.concatenate([[0.0], np.cumsum(np.asarray(problem.activation, dtype=float))])
        self.resident = pre_r[None, :] - pre_r[:, None]  # chunk [a, b) in row a, column b
        self.act = pre_a[None, :] - pre_a[:, None]
        idx = np.arange(problem.n + 1)
        self.empty = idx[:, None] >= idx[None, :]  # chunk [a, b) has no node
        self.no_cut = ~np.asarray(allowed_cuts(problem))
        self.t, self.com, self.tmp = (np.empty_like(self.act) for _ in range(3))
        self.bad = np.empty(self.act.shape, dtype=bool)

    def _link(self, counts: np.ndarray, nbytes: np.ndarray, pair: tuple[int, int]) -> None:
        """Add one link's latencies and bytes over every chunk to ``self.com``."""
        la, bw = self.problem.latency[pair[0]][pair[1]], self.problem.bandwidth[pair[0]][pair[1]]
        np.multiply(counts, la, out=self.t)
        np.divide(nbytes, bw, out=self.tmp)
        self.t += self.tmp
        self.com += self.t

    def __call__(self, vals: np.ndarray, k: int, s: int) -> tuple[np.ndarray, np.ndarray]:
        """``(argmin, values)``: the best start of a chunk ending at each boundary."""
        pb, d, order = self.problem, self.order[k], self.order
        self.com.fill(0.0)
        if k > 0:
            self._link(self.rc, self.rb, (order[k - 1], d))
        if k + 1 < s:
            self._link(self.sc, self.sb, (d, order[k + 1]))
        self.com *= self.mult
        t = np.subtract(self.pre_c[None, :, d], self.pre_c[:, None, d], out=self.t)
        (np.maximum if pb.overlap_comm else np.add)(t, self.com, out=t)
        mem = np.multiply(self.act, activation_factor(pb, k, s), out=self.com)
        np.add(self.resident, mem, out=mem)
        mem += np.multiply(self.rb, buffer_factor(pb, k, s), out=self.tmp)
        bad = np.greater(mem, pb.mem_cap[d], out=self.bad)
        bad |= self.empty
        if k > 0:
            bad |= self.no_cut[:, None]
        if k + 1 < s:
            bad |= self.no_cut[None, :]
        np.maximum(vals[:, None], t, out=t)
        np.copyto(t, np.inf, where=bad)
        return np.argmin(t, axis=0), t.min(axis=0)


def _chain_dp_plans(
    problem: PartitionProblem,
    order: list[int],
    smax: int,
    min_stages: int,
    deadline: Deadline | None,
) -> list[Plan | None]:
    """chain_dp's plan for every stage count it reaches before ``deadline``."""
    n = problem.n
    t0 = time.perf_counter()
    step = _DPStep(problem, order)
    step_s = (time.perf_counter() - t0) / 4  # a DP step costs about a quarter of these
    cands: list[Plan | None] = []
    for s in range(min_stages, smax + 1):
        if deadline is not None and deadline.left() < s * step_s:
            break  # this stage count's s steps would overrun
        vals = np.full(n + 1, np.inf)
        vals[0] = 0.0
        args: list[np.ndarray] = []
        for k in range(s):
            if deadline is not None and deadline.left() < step_s:
                return cands  # a loaded machine slowed the steps: stop at this one
            t_step = time.perf_counter()
            arg, vals = step(vals, k, s)
            args.append(arg)
            step_s = max(step_s, time.perf_counter() - t_step)
        if not np.isfinite(vals[n]):
            continue
        cuts, b = [], n
        for k in range(s - 1, 0, -1):
            b = int(args[k][b])
            cuts.append(b)
        cands.append(chunked(problem, cuts, order))
    return cands


def _score(problem: PartitionProblem, plan: Plan) -> tuple[float, float] | None:
    if check(problem, *plan):
        return None
    ev = evaluate(problem, *plan)
    return (ev.objective, sum(ev.stage_time))


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = 1e-12 * max(abs(b[0]), 1e-30)
    if a[0] < b[0] - tol:
        return True
    return abs(a[0] - b[0]) <= tol and a[1] < b[1] * (1 - 1e-12)


def greedy(
    problem: PartitionProblem,
    order: list[int] | None = None,
    start: Plan | None = None,
    max_evals: int = 400,
    *,
    deadline: Deadline | None = None,
) -> Plan | None:
    """chain_dp's split improved by moving single nodes to a neighbouring stage.

    A node may move one stage later if all its consumers are already later, or
    one stage earlier if all its producers are already earlier, so edges stay
    forward; tied nodes stay put. First improvement of (objective, total stage
    time) wins; nodes of the slowest stage are tried first. The budget counts
    evaluations, not seconds, so the result is deterministic (unless
    ``deadline`` ends it first: the best plan so far comes back).
    """
    plan = start or chain_dp(problem, order)
    if plan is None:
        return None
    score = _score(problem, plan)
    if score is None:
        return None
    tied = {v for g in problem.ties if len(g) > 1 for v in g}
    preds: list[list[int]] = [[] for _ in range(problem.n)]
    for u, v in problem.edges:
        preds[v].append(u)
    cons = consumers(problem)
    evals = 0
    improved = True
    while improved and evals < max_evals:
        if deadline is not None and deadline.expired():
            break
        improved = False
        stage_of, stage_device = plan
        ev = evaluate(problem, stage_of, stage_device)
        rank = sorted(range(len(stage_device)), key=lambda k: -ev.stage_time[k])
        pos = {k: i for i, k in enumerate(rank)}
        nodes = sorted(range(problem.n), key=lambda v: (pos[stage_of[v]], v))
        for v, step in itertools.product(nodes, (1, -1)):
            if v in tied or evals >= max_evals:
                continue
            if deadline is not None and deadline.expired():  # one evaluate() is ms
                break
            k = stage_of[v] + step
            if not 0 <= k < len(stage_device):
                continue
            if step > 0 and any(stage_of[c] < k for c in cons[v]):
                continue
            if step < 0 and any(stage_of[p] > k for p in preds[v]):
                continue
            new = list(stage_of)
            new[v] = k
            cand = renumber(new, stage_device)
            evals += 1
            cand_score = _score(problem, cand)
            if cand_score is not None and _better(cand_score, score):
                plan, score, improved = cand, cand_score, True
                break
    return plan


def all_baselines(
    problem: PartitionProblem,
    order: list[int] | None = None,
    min_stages: int = 1,
    *,
    deadline: Deadline | None = None,
) -> dict[str, Plan]:
    """Every baseline that finds a feasible plan with >= min_stages stages, by name.

    The linear ones run first and always (the fallback); ``chain_dp`` and
    ``greedy`` only as far as ``deadline`` allows (module docstring).
    """
    order = order or device_order(problem)
    out: dict[str, Plan] = {}
    for name, fn in (("uniform_by_count", uniform_by_count), ("param_balanced", param_balanced)):
        plan = fn(problem, None, order)
        if plan is not None:
            out[name] = plan
    balanced = time_balanced(problem, order)
    if balanced is not None:
        out["time_balanced"] = balanced
    dp = chain_dp(problem, order, min_stages=min_stages, deadline=deadline)
    if dp is not None:
        out["chain_dp"] = dp
        g = greedy(problem, order, start=dp, deadline=deadline)
        if g is not None:
            out["greedy"] = g
    return {k: v for k, v in out.items() if len(v[1]) >= min_stages}
