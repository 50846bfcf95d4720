"""Lower bounds on the throughput objective: mandatory communication, side trees.

:func:`crosscut.partitioner.evaluate.lower_bound` (total compute over the
devices, or the largest node) ignores transfers, so on graphs where every cut
is expensive — a residual stream or a feature map, a few to ten percent of a
stage's time on NVLink — CP-SAT has to prove the missing part itself, and on
models with many small parallel ops (swin's window attention) its linear
relaxation does not. :func:`comm_lower_bound` adds the transfers every plan
must make; :func:`tree_relaxation` removes the small side trees.

The argument, for a plan with ``S`` used stages and bottleneck ``B`` (stage
time ``compute + comm``; every transfer is charged to its sender stage and to
its receiver stage, as evaluate() does):

* **Stage ``k > 0`` receives.** Let ``v`` be its first node in index order.
  Every producer of ``v`` has a smaller index, so none is in stage ``k``: all
  of them are in earlier stages, and each sends ``v``'s stage its own transfer.
  ``v``'s ancestors other than itself lie in stages ``< k`` and its descendants
  in stages ``>= k``, so ``A(v) - t(v) <= k B`` and ``D(v) <= (S - k) B``
  (``A``/``D``: compute of ancestors/descendants including ``v``, each node on
  its fastest device). Stage ``k`` therefore receives at least
  ``r_k(B) = min`` over such ``v`` of the summed cheapest transfers of ``v``'s
  producers (0 for a node without producers).
* **Stage ``k < S - 1`` sends.** Symmetrically its last node ``u`` has all its
  consumers in later stages, ``A(u) <= (k + 1) B``, ``D(u) - t(u) <= (S - k - 1) B``;
  it sends at least ``s_k(B) = min`` over such ``u`` of ``u``'s cheapest transfer
  (0 for a node without consumers).
* **Sum.** A transfer is counted once as received (by its destination stage)
  and once as sent (by its source stage), exactly as it is charged, so
  ``S B >= Σ stage times >= total + Σ_{k>0} r_k(B) + Σ_{k<S-1} s_k(B)``.
  The right side does not grow with ``B`` (larger ``B`` admits more nodes), so
  the smallest ``B`` that satisfies it is found by bisection; the bound is the
  smallest such ``B`` over ``S = 1 .. min(devices, nodes)``.

"Cheapest transfer" is the fastest link between two different devices
(``min latencies(u) * latency + bytes / bandwidth``: a latency per message),
doubled when training. Memory caps are ignored (a relaxation), so the bound
holds for every plan the pipeline solvers can return. With ``overlap_comm``
(stage time = ``max(compute, comm)``) or the latency objective the argument
does not apply and the plain bound is returned.

**Side trees** (:func:`tree_relaxation`). Removing nodes from a problem can
only lower its optimum: a plan restricted to the remaining nodes (empty stages
dropped) computes and sends a subset of what it did, and keeps fewer
micro-batches in flight. So the optimum of a smaller problem is a valid lower
bound, and the solver may spend a fraction of its time proving it. Which nodes
to remove only decides how strong the bound is: small in-trees hanging off
one consumer (swin's relative-position-bias MLPs and masks: ~40 % of its
coarse nodes, ~4 % of its compute, each placeable in any earlier stage, which
is what keeps CP-SAT's proof from closing). Their cost is not all lost: if
tree ``T`` feeds consumer ``c``, then either all of ``T`` runs in ``c``'s stage
or some node of ``T`` outside that stage sends its output into it (follow a
path to ``c``), so ``c``'s stage pays at least ``f(root)`` with
``f(x) = min(transfer(x), t(x) + Σ f(producers of x))``, added to ``c``'s
compute. Trees are disjoint, so these charges add up. The rest of the trees'
compute, ``floating = Σ (t(T) - f(T))``, still runs in some stage: the summed
stage times of any plan are at least the relaxed ones plus ``floating``, which
the CP-SAT model of the relaxation adds as one more constraint (C10 in
``cpsat_model.py``). With ``overlap_comm`` a transfer does not add to compute,
so neither is used then (plain removal stays valid).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from crosscut.ir.problem import PartitionProblem, restrict
from crosscut.partitioner.evaluate import comm_multiplier, consumers, link_time, lower_bound

__all__ = [
    "Relaxation",
    "closure_bitsets",
    "comm_lower_bound",
    "reach_compute",
    "stage_windows",
    "tree_relaxation",
]

_BISECTIONS = 60
_CHUNK = 512


def closure_bitsets(problem: PartitionProblem) -> tuple[list[int], list[int]]:
    """Every node's ancestors and descendants (itself included) as integer bitsets.

    Node indices are a topological order, so one pass each way suffices.
    """
    n = problem.n
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in problem.edges:
        preds[v].append(u)
        succs[u].append(v)
    anc = [0] * n
    for v in range(n):
        bits = 1 << v
        for u in preds[v]:
            bits |= anc[u]
        anc[v] = bits
    desc = [0] * n
    for v in reversed(range(n)):
        bits = 1 << v
        for w in succs[v]:
            bits |= desc[w]
        desc[v] = bits
    return anc, desc


def reach_compute(problem: PartitionProblem, times: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(A, D)``: summed ``times`` of every node's ancestors / descendants, itself included.

    Exact sums over node sets (bitsets), not over paths, so shared ancestors
    count once.
    """
    anc, desc = closure_bitsets(problem)
    vals = np.asarray(times, dtype=float)
    return _set_sums(anc, vals), _set_sums(desc, vals)


def stage_windows(
    problem: PartitionProblem, slots: int, upper: float
) -> tuple[list[int], list[int]]:
    """Earliest and latest stage of every node in any plan whose stages compute <= upper.

    The prefix-sum argument of ``cpsat_model``'s docstring, with each node on its fastest
    device: if ``s(v) <= k``, ``v`` and its ancestors fit in ``k+1`` stages of at most
    ``upper`` each.
    """
    n = problem.n
    lo, hi = [0] * n, [slots - 1] * n
    if not math.isfinite(upper) or upper <= 0.0:
        return lo, hi
    # vectorised set sums: a bit-by-bit loop took seconds on 2,500 nodes
    anc_t, desc_t = reach_compute(problem, [min(row) for row in problem.compute])
    tol = 1e-9
    for v in range(n):
        a = float(anc_t[v]) / upper
        d = float(desc_t[v]) / upper
        lo[v] = max(0, math.ceil(a - 1.0 - tol))
        hi[v] = min(slots - 1, math.floor(slots - d + tol))
    return lo, hi


def _set_sums(sets: list[int], vals: np.ndarray) -> np.ndarray:
    """``Σ vals[i]`` over the members of each bitset, vectorised over bytes of the masks."""
    n = len(vals)
    if n == 0:
        return np.zeros(0)
    nbytes = (n + 7) // 8
    out = np.zeros(len(sets))
    for start in range(0, len(sets), _CHUNK):  # chunks keep the 0/1 matrix small
        part = sets[start : start + _CHUNK]
        raw = np.frombuffer(b"".join(s.to_bytes(nbytes, "little") for s in part), dtype=np.uint8)
        bits = np.unpackbits(raw.reshape(len(part), nbytes), axis=1, bitorder="little")[:, :n]
        out[start : start + len(part)] = bits.astype(float) @ vals
    return out


def comm_lower_bound(problem: PartitionProblem, *, floating: float | None = None) -> float:
    """A valid lower bound on the bottleneck of any pipeline plan (module docstring).

    ``floating`` (seconds) makes ``problem`` a relaxation (:func:`tree_relaxation`)
    and bounds the original instead: every original plan of ``S`` stages
    restricts to one of ``S' <= S`` stages here, whose summed stage times plus
    ``floating`` are at most ``S B``; so every ``S' <= S`` is tried.
    """
    base = lower_bound(problem)
    pb = problem
    if pb.objective != "throughput" or pb.overlap_comm or pb.n == 0 or pb.num_devices < 2:
        return base if floating is None else 0.0
    fastest = [min(row) for row in pb.compute]
    total = float(sum(fastest)) + (floating or 0.0)
    a_sum, d_sum = reach_compute(pb, fastest)
    t = np.asarray(fastest)
    cheapest = _cheapest_transfers(pb)
    preds: list[list[int]] = [[] for _ in range(pb.n)]
    for u, v in pb.edges:
        preds[v].append(u)
    recv = np.asarray([sum(cheapest[u] for u in set(ps)) for ps in preds])
    cons = consumers(pb)
    send = np.asarray([cheapest[u] if cons[u] else 0.0 for u in range(pb.n)])
    shape = (t, a_sum, d_sum, recv, send)
    best = total  # one stage: no transfer
    for stages in range(
        2, pb.num_devices + 1 if floating is not None else min(pb.num_devices, pb.n) + 1
    ):
        here = [stages] if floating is None else range(1, min(stages, pb.n) + 1)
        b_s = min(_bound_for(stages, inner, total, shape, best) for inner in here)
        best = min(best, b_s)
    if floating is not None:
        return min(best, total)
    return max(base, min(best, total))


def _cheapest_transfers(pb: PartitionProblem) -> list[float]:
    """Every node's output over the fastest link between two devices, both ways if training.

    With one device nothing can be cut away, so every transfer costs infinity.
    """
    d = pb.num_devices
    links = [(a, b) for a in range(d) for b in range(d) if a != b]
    mult = comm_multiplier(pb)
    return [
        mult
        * min(
            (link_time(pb, u, pb.latency[a][b], pb.bandwidth[a][b]) for a, b in links),
            default=math.inf,
        )
        for u in range(pb.n)
    ]


def _bound_for(
    devices: int,
    stages: int,
    total: float,
    shape: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    cap: float,
) -> float:
    """The least ``B <= cap`` with ``devices · B >= total + Σ r_k(B) + Σ s_k(B)`` (bisection).

    ``r_k``/``s_k`` are over ``stages`` stages of the problem (``stages <
    devices`` only for a relaxation, see :func:`comm_lower_bound`). Returns a
    value no larger than the true least such ``B`` (the last ``B`` shown
    infeasible), or ``cap`` when even ``cap`` is infeasible.
    """
    t, a_sum, d_sum, recv, send = shape
    ks = np.arange(stages)[:, None]
    tol = 1e-12 * max(total, 1e-30)

    def short(b: float) -> bool:
        """Whether bottleneck ``b`` is too small."""
        first = (a_sum - t <= ks * b + tol) & (d_sum <= (stages - ks) * b + tol)
        last = (a_sum <= (ks + 1) * b + tol) & (d_sum - t <= (stages - ks - 1) * b + tol)
        if not first.any(axis=1).all() or not last.any(axis=1).all():
            return True  # some stage has no possible first or last node
        r = np.where(first[1:], recv[None, :], np.inf).min(axis=1).sum()
        s = np.where(last[:-1], send[None, :], np.inf).min(axis=1).sum()
        return bool(devices * b < total + r + s)

    lo = total / devices
    if not short(lo):
        return lo
    hi = cap
    if short(hi):
        return cap
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if short(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return lo


@dataclass(frozen=True)
class Relaxation:
    """A smaller problem whose optimum bounds the original's from below.

    ``kept[i]`` is the original index of reduced node ``i``; ``root[v]`` is the
    kept node whose stage an original node follows (itself when kept).
    """

    problem: PartitionProblem
    kept: list[int]
    consumer: list[int]  # [original node] the one consumer of a removed node, else -1
    floating: float = 0.0  # tree compute not charged to any consumer: lands in some stage
    # [original node] the seconds a removed node's subtree adds to an earlier stage when
    # the charge chose to send it (compute + its transfer); -1 where it stays with its
    # consumer, and for kept nodes
    detached: list[float] = dataclasses.field(default_factory=list)
    kept_cost: list[float] = dataclasses.field(default_factory=list)  # ... if it stays instead

    def expand(self, stage_of: list[int], loads: list[float] | None = None) -> list[int]:
        """A plan of the original problem from a plan of the relaxation (a heuristic).

        Every removed node joins its consumer's stage. Then, given ``loads``
        (seconds per stage of the relaxation), each subtree the charge chose to
        send moves to the least loaded earlier stage when that lowers the larger
        of the two stages' loads, busiest stages first: that is how the cheapest
        plans hold swin's bias MLPs, in stages with room.
        """
        out = [0] * len(self.consumer)
        for i, v in enumerate(self.kept):
            out[v] = stage_of[i]
        order = list(reversed(range(len(out))))
        for v in order:
            if self.consumer[v] >= 0:
                out[v] = out[self.consumer[v]]
        if loads is None:
            return out
        load = list(loads)
        movable = [v for v in order if self.detached[v] >= 0]
        for v in movable:
            load[out[v]] += self.kept_cost[v]
        for v in sorted(movable, key=lambda v: (-load[out[v]], v)):
            k = out[v]
            j = min(range(k), key=lambda i: (load[i], i), default=k)
            if j < k and load[j] + self.detached[v] < load[k]:
                load[k] -= self.kept_cost[v]
                load[j] += self.detached[v]
                out[v] = j
        for v in order:  # the rest of a moved subtree follows its root
            c = self.consumer[v]
            if c >= 0 and self.detached[v] < 0:
                out[v] = out[c]
        return out


def tree_relaxation(problem: PartitionProblem, fraction: float = 0.05) -> Relaxation | None:
    """Remove the small side trees of ``problem`` (module docstring); None if none.

    A node joins a tree when it has exactly one consumer, all its producers are
    tree nodes too, it is not tied to other nodes, and the tree it roots has at
    most ``fraction`` of :func:`lower_bound` in compute (so the main path, whose
    trees grow with every node, stays).
    """
    pb = problem
    if pb.objective != "throughput" or pb.n == 0:
        return None
    cons = consumers(pb)
    preds: list[set[int]] = [set() for _ in range(pb.n)]
    for u, v in pb.edges:
        preds[v].add(u)
    tied = {v for g in pb.ties if len(g) > 1 for v in g}
    fastest = [min(row) for row in pb.compute]
    cheapest = _cheapest_transfers(pb)
    limit = fraction * lower_bound(pb)
    side = [False] * pb.n
    size = [0.0] * pb.n  # compute of the tree a side node roots
    charge = [0.0] * pb.n  # f(v): the least its tree adds to its consumer's stage
    for v in range(pb.n):
        if len(cons[v]) != 1 or v in tied or not all(side[u] for u in preds[v]):
            continue
        tree = fastest[v] + sum(size[u] for u in preds[v])
        if tree <= limit:
            side[v], size[v] = True, tree
            charge[v] = min(cheapest[v], fastest[v] + sum(charge[u] for u in preds[v]))
    if not any(side):
        return None
    kept = [v for v in range(pb.n) if not side[v]]
    consumer = [cons[v][0] if side[v] else -1 for v in range(pb.n)]
    # where the charge sends a subtree rather than running it with its consumer: only
    # below nodes that themselves stay with their consumer (or under a kept node)
    detached = [-1.0] * pb.n
    kept_cost = [0.0] * pb.n
    stays = [not side[v] for v in range(pb.n)]
    for v in reversed(range(pb.n)):
        if side[v] and stays[consumer[v]]:
            if cheapest[v] < fastest[v] + sum(charge[u] for u in preds[v]):
                detached[v] = size[v] + cheapest[v]
                kept_cost[v] = size[v] - charge[v]
            else:
                stays[v] = True
    extra = [0.0] * pb.n
    if not pb.overlap_comm:
        for v in kept:
            extra[v] = sum(charge[u] for u in preds[v] if side[u])
    stand_in = list(range(pb.n))  # a removed node runs with its consumer's stage
    for v in reversed(range(pb.n)):
        if side[v]:
            stand_in[v] = stand_in[consumer[v]]
    reduced = restrict(pb, kept, stand_in)
    reduced = dataclasses.replace(
        reduced, compute=[[c + extra[v] for c in pb.compute[v]] for v in kept]
    )
    roots = [v for v in range(pb.n) if side[v] and not side[cons[v][0]]]
    floating = sum(size[v] - charge[v] for v in roots) if not pb.overlap_comm else 0.0
    return Relaxation(reduced, kept, consumer, floating, detached, kept_cost)
