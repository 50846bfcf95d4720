"""The CP-SAT model of the partition problem for one fixed device order.

Stage ``k`` runs on ``order[k]``; trailing stages may stay empty, so every
injective stage→device map is the prefix of some order (the driver in
``cpsat.py`` enumerates orders where devices differ). The model is written
data → variables → constraints → objective; each constraint carries the
equation it implements. Times are integers in units of ``unit`` seconds;
evaluate() re-prices the answer in float seconds. One transfer per (value,
stage): the extra ones codegen's fan-out aliases make where readers are cut out
of eager's gradient order (``partitioner/fanout_cost.py``) are not modelled, so
the model's objective is a lower bound on evaluate's there (equal elsewhere).

Variables (throughput and latency):

* ``y[v,k] = [s(v) <= k]`` booleans, only inside node ``v``'s stage window
  ``lo[v]..hi[v]`` (0 below, 1 from ``hi`` on) — windows come from prefix sums:
  if ``s(v) <= k`` then ``v`` and all its ancestors fit in ``k+1`` stages of
  compute at most ``UB`` each, so ``A(v) <= (k+1) UB``; symmetric for descendants.
* ``x[v,k] = y[v,k] - y[v,k-1]`` stage membership.
* ``p[u,j,k]`` for ``j < k``: ``u`` sits in stage ``j`` and is sent to stage ``k``
  (only lower-bounded; both objective and memory push it down).
* ``used[k]``: stage ``k`` non-empty; used stages form a prefix; ``e[s]``: exactly
  ``s`` stages (needed by 1F1B in-flight counts).

The class model (``classes`` given; both objectives) searches every device
order at once: ``classes`` are the interchangeable devices
(``orders.device_classes``), and ``z[k,c]`` says stage ``k`` runs on a device
of class ``c``; a stage's compute and memory are written once per class, each
enforced by its ``z``. Transfers are priced on the fastest link between two
different devices: exact when every link is the same, a
relaxation (a valid bound, a class sequence worth searching) otherwise.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from ortools.sat.python import cp_model

from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import comm_multiplier, consumers, link_time, transfer_time
from crosscut.partitioner.solvers.bounds import stage_windows
from crosscut.partitioner.stage_memory import activation_factor, buffer_factor

__all__ = ["OrderModel"]

SCALE = 10_000_000  # integer units in the upper bound: ~1e-7 relative resolution
# seconds to build the model per boolean variable (with its constraints): 64 stage slots
# on 182 nodes (141k variables) took 3.2 s on a loaded 2-core machine; a model whose
# estimate does not fit the deadline is not built (``OrderModel.skipped``)
BUILD_S_PER_VAR = 1e-5


@dataclass
class OrderModel:
    """CP-SAT model for one device order; build once, then hint and solve."""

    problem: PartitionProblem
    order: list[int]
    upper: float  # seconds: only plans with objective <= upper are sought (inf: none known)
    require_all: bool = False
    model: cp_model.CpModel = field(default_factory=cp_model.CpModel)
    unit: float = 1.0
    lo: list[int] = field(default_factory=list)
    hi: list[int] = field(default_factory=list)
    y: dict[tuple[int, int], Any] = field(default_factory=dict)
    x: dict[tuple[int, int], Any] = field(default_factory=dict)
    p: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    used: list[Any] = field(default_factory=list)
    objective_var: Any = None
    empty: bool = False  # windows prove no plan beats ``upper`` in this order
    terms: int = 1  # most rounded terms in one time sum (for the rounding slack)
    stage_count: dict[int, Any] = field(default_factory=dict)
    slack: int = 1  # units: most the rounded objective can differ from the exact one
    # seconds of compute some stage must also run but the problem leaves out (the side
    # trees a relaxation removed, beyond what it charged their consumers): (C10)
    floating: float = 0.0
    # building stops (``skipped``) when the estimated build would not fit, or at the
    # deadline between variable/constraint families (a model is built in Python: seconds)
    deadline: Deadline | None = None
    skipped: bool = False
    # the class model (module docstring): classes of interchangeable devices
    classes: list[list[int]] = field(default_factory=list)
    z: dict[tuple[int, int], Any] = field(default_factory=dict)
    # set by build(): the constant true literal, each stage's device choices (one device
    # per class, or the order's), the link transfers are priced on (class model), and
    # the transfers' multiplier (comm_multiplier)
    true: Any = None
    choices: list[list[int]] = field(default_factory=list)
    link: tuple[float, float] = (0.0, 1.0)
    mult: float = 1.0

    def _late(self, estimate_s: float = 0.0) -> bool:
        """Whether to stop building: past the deadline, or ``estimate_s`` would not fit."""
        if self.deadline is not None and self.deadline.left() <= estimate_s:
            self.skipped = True
        return self.skipped

    def size(self) -> int:
        """Boolean variables the model will have, from the stage windows (before building)."""
        total = sum(2 * (hi - lo) + 1 for lo, hi in zip(self.lo, self.hi))
        for u, v in self.problem.edges:
            for j in range(self.lo[u], self.hi[u] + 1):
                total += max(0, self.hi[v] - max(j + 1, self.lo[v]) + 1)
        return total

    def build(self) -> None:
        """data -> variables -> constraints -> objective, one step per method below.

        Each step may stop the build (``skipped``) at the deadline; the model is
        then not solved. The steps add to the model in a fixed order: CP-SAT's
        search (and so a time-limited answer) depends on it.
        """
        pb = self.problem
        # ---- data -------------------------------------------------------------
        slots = min(pb.num_devices if self.classes else len(self.order), pb.n)
        # the device of each class a stage may run on (one per stage in an order model)
        self.choices = [[c[0] for c in self.classes] or [self.order[k]] for k in range(slots)]
        self.link = self._fastest_links() if self.classes else (0.0, 1.0)
        self.mult = comm_multiplier(pb)
        horizon = self.upper if math.isfinite(self.upper) else self._trivial_upper()
        self.unit = max(horizon, 1e-12) / SCALE
        self.lo, self.hi = stage_windows(pb, slots, self.upper * (1 + 1e-6))
        if any(lo > hi for lo, hi in zip(self.lo, self.hi)):
            self.empty = True
            return
        if self._late(BUILD_S_PER_VAR * self.size()) or not self._add_variables(slots):
            return
        if not self._add_structure(slots):
            return
        self.stage_count = self._stage_count_literals(slots)
        comp, comm, recv_bytes = self._stage_sums(slots)
        if not self._add_memory(slots, recv_bytes):
            return
        self._add_objective(slots, comp, comm)

    def _t_units(self, u: int, j: int, k: int) -> int:
        """Units to send ``u``'s output from stage ``j`` to stage ``k``."""
        pb = self.problem
        if self.classes:
            sec = self.mult * link_time(pb, u, *self.link)
        else:
            sec = self.mult * transfer_time(pb, u, self.order[j], self.order[k])
        return round(sec / self.unit)

    def _c_units(self, v: int, dev: int) -> int:
        return round(self.problem.compute[v][dev] / self.unit)

    def _ylit(self, v: int, k: int) -> Any:
        """y[v,k], or the constant it is outside node ``v``'s stage window."""
        if k < self.lo[v]:
            return self.true.negated()
        if k >= self.hi[v]:
            return self.true
        return self.y[(v, k)]

    def _add_variables(self, slots: int) -> bool:
        """y, x, used, z and p (module docstring); False when the deadline stopped it."""
        pb, m = self.problem, self.model
        self.true = true = m.new_bool_var("true")
        m.add(true == 1)
        for v in range(pb.n):
            if self._late():
                return False
            for k in range(self.lo[v], self.hi[v]):
                self.y[(v, k)] = m.new_bool_var(f"y{v}_{k}")
            for k in range(self.lo[v], self.hi[v] + 1):
                if self.lo[v] == self.hi[v]:
                    self.x[(v, k)] = true
                    continue
                xv = m.new_bool_var(f"x{v}_{k}")
                prev = self._ylit(v, k - 1) if k > 0 else true.negated()
                # (X) x[v,k] = y[v,k] - y[v,k-1]
                m.add(xv == self._ylit(v, k) - prev)
                self.x[(v, k)] = xv
        self.used = [true] + [m.new_bool_var(f"used{k}") for k in range(1, slots)]
        for k in range(slots):
            for i in range(len(self.choices[k])):
                self.z[(k, i)] = m.new_bool_var(f"z{k}_{i}") if self.classes else true
        for u, v in pb.edges:
            if self._late():
                return False
            for j, k in self._sends(u, v):
                if (u, j, k) not in self.p:
                    self.p[(u, j, k)] = m.new_bool_var(f"p{u}_{j}_{k}")
        return True

    def _sends(self, u: int, v: int) -> list[tuple[int, int]]:
        """(j, k): the stages ``u`` in j may send to ``v`` in k > j, inside their windows."""
        return [
            (j, k)
            for j in range(self.lo[u], self.hi[u] + 1)
            for k in range(max(j + 1, self.lo[v]), self.hi[v] + 1)
        ]

    def _add_structure(self, slots: int) -> bool:
        """(C1)-(C6), (C11), (C12): what makes y, x, used, p and z a plan."""
        pb, m, n = self.problem, self.model, self.problem.n
        for v in range(n):
            for k in range(self.lo[v], self.hi[v] - 1):
                # (C1) s(v) <= k implies s(v) <= k+1: y monotone in k
                m.add_implication(self.y[(v, k)], self.y[(v, k + 1)])
        for u, v in pb.edges:
            for k in range(self.lo[v], self.hi[u]):
                # (C2) topological subsets: s(u) <= s(v), i.e. y[v,k] => y[u,k]
                m.add_implication(self._ylit(v, k), self._ylit(u, k))
        for group in pb.ties:
            for a, b in itertools.pairwise(group):
                for k in range(slots - 1):
                    # (C3) tied nodes share a stage: y[a,k] == y[b,k]
                    m.add(self._ylit(a, k) == self._ylit(b, k))
        cons = consumers(pb)
        sinks = [v for v in range(n) if not cons[v]]
        # (C5) stage 0 is used and non-empty
        m.add(sum(self.x[(v, 0)] for v in range(n) if (v, 0) in self.x) >= 1)
        for k in range(1, slots):
            later = [self._ylit(v, k - 1).negated() for v in sinks]
            # (C4) used[k] <=> some node has s(v) >= k (through the sinks)
            m.add_bool_or(later).only_enforce_if(self.used[k])
            for lit in later:
                m.add_implication(lit, self.used[k])
            members = [self.x[(v, k)] for v in range(n) if (v, k) in self.x]
            # (C5) a used stage is non-empty (no holes: used stages are a prefix)
            m.add(sum(members) >= 1).only_enforce_if(self.used[k])
            if self.require_all:
                # (C5') every device gets a stage
                m.add(self.used[k] == 1)
        for u, v in pb.edges:
            if self._late():
                return False
            for j, k in self._sends(u, v):
                # (C6) transfer: s(u)=j and a consumer in k>j => p[u,j,k]
                m.add_bool_or(
                    [self.x[(u, j)].negated(), self.x[(v, k)].negated(), self.p[(u, j, k)]]
                )
        if self.classes:
            for k in range(slots):
                # (C11) a used stage runs on exactly one class of devices
                m.add(sum(self.z[(k, i)] for i in range(len(self.choices[k]))) == self.used[k])
            for i, cls in enumerate(self.classes):
                # (C12) no more stages on a class than it has devices
                m.add(sum(self.z[(k, i)] for k in range(slots)) <= len(cls))
        return True

    def _stage_sums(self, slots: int) -> tuple[list[list[Any]], list[Any], list[Any]]:
        """Per stage: compute on each device choice, transfer time, bytes received.

        Also sets ``terms`` (the most rounded terms in one stage's time sum).
        """
        pb, n = self.problem, self.problem.n
        comp = [
            [
                sum(self._c_units(v, dev) * self.x[(v, k)] for v in range(n) if (v, k) in self.x)
                for dev in self.choices[k]
            ]
            for k in range(slots)
        ]
        comm: list[Any] = [0] * slots
        recv_bytes: list[Any] = [0] * slots
        count = [0] * slots
        for (u, j, k), lit in self.p.items():
            t = self._t_units(u, j, k)
            comm[j] += t * lit
            comm[k] += t * lit
            recv_bytes[k] += pb.out_bytes[u] * lit
            count[j] += 1
            count[k] += 1
        self.terms = max(
            [sum(1 for v in range(n) if (v, k) in self.x) + count[k] for k in range(slots)] + [1]
        )
        return comp, comm, recv_bytes

    def _add_memory(self, slots: int, recv_bytes: list[Any]) -> bool:
        """(C8) for every stage, stage count and device choice; False at the deadline."""
        pb, m, n = self.problem, self.model, self.problem.n
        exactly = self.stage_count
        for k in range(slots):
            if self._late():
                return False
            res = sum(pb.resident[v] * self.x[(v, k)] for v in range(n) if (v, k) in self.x)
            act = sum(pb.activation[v] * self.x[(v, k)] for v in range(n) if (v, k) in self.x)
            for s in range(k + 1, slots + 1):
                af, bf = activation_factor(pb, k, s), buffer_factor(pb, k, s)
                for i, d in enumerate(self.choices[k]):
                    # (C8) memory of stage k's device when there are s stages:
                    #      resident + inflight(k,s) * (activation + received bytes) <= cap
                    m.add(res + af * act + bf * recv_bytes[k] <= pb.mem_cap[d]).only_enforce_if(
                        [exactly[s], self.z[(k, i)]]
                    )
        return True

    def _add_objective(self, slots: int, comp: list[list[Any]], comm: list[Any]) -> None:
        """(C7), (C10) and (O): the bottleneck stage time, or the makespan (latency)."""
        pb, m = self.problem, self.model
        # rounding: at most 1/2 unit per summed term (a stage sum, or a path for latency)
        paths = 2 * pb.n if pb.objective == "latency" else self.terms
        self.slack = paths // 2 + 1
        cap = SCALE + self.slack if math.isfinite(self.upper) else 2 * SCALE
        if pb.objective == "latency":
            self.objective_var = self._latency(slots, cap)
        else:
            bvar = m.new_int_var(0, cap, "bottleneck")
            for k in range(slots):
                for i in range(len(self.choices[k])):
                    on = self.z[(k, i)]  # the stage's class (always true in an order model)
                    if pb.overlap_comm:
                        # (C7') stage time = max(compute, comm) <= B
                        m.add(comp[k][i] <= bvar).only_enforce_if(on)
                        m.add(comm[k] <= bvar)
                    else:
                        # (C7) stage time = compute + comm (sent and received) <= B
                        m.add(comp[k][i] + comm[k] <= bvar).only_enforce_if(on)
            if self.floating > 0 and not pb.overlap_comm:
                self._add_floating(slots, comp, comm, bvar)
            self.objective_var = bvar
        # ---- objective --------------------------------------------------------
        # (O) minimise the bottleneck stage time (throughput) or the makespan (latency)
        m.minimize(self.objective_var)

    def _add_floating(self, slots: int, comp: list[list[Any]], comm: list[Any], bvar: Any) -> None:
        """(C10) the devices' summed time holds every stage and the floating work:
        Σ_k (compute + comm) + floating <= slots * B  (at most `slots` stages);
        a class model counts every node on its fastest device (a relaxation)."""
        pb, n = self.problem, self.problem.n
        lost = math.floor(self.floating / self.unit) - self.slack * slots
        least = [c[0] for c in comp]
        if self.classes:  # every node on its fastest device: the stage's class unknown
            least = [
                sum(
                    round(min(pb.compute[v]) / self.unit) * self.x[(v, k)]
                    for v in range(n)
                    if (v, k) in self.x
                )
                for k in range(slots)
            ]
        self.model.add(sum(least[k] + comm[k] for k in range(slots)) + max(0, lost) <= slots * bvar)

    def _stage_count_literals(self, slots: int) -> dict[int, Any]:
        """e[s] = [exactly s stages used] = used[s-1] and not used[s]."""
        m = self.model
        out: dict[int, Any] = {}
        for s in range(1, slots + 1):
            e = m.new_bool_var(f"stages{s}")
            nxt = self.used[s].negated() if s < slots else None
            # (C9) e[s] <=> used[s-1] and not used[s]
            m.add_implication(e, self.used[s - 1])
            if nxt is not None:
                m.add_implication(e, nxt)
                m.add_bool_or([self.used[s - 1].negated(), self.used[s], e])
            else:
                m.add_implication(self.used[s - 1], e)
            out[s] = e
        return out

    def _latency(self, slots: int, cap: int) -> Any:
        """Makespan of one micro-batch, list-scheduled in index order per device."""
        pb, m = self.problem, self.model
        n = pb.n
        start = [m.new_int_var(0, cap, f"start{v}") for v in range(n)]
        end = [m.new_int_var(0, cap, f"end{v}") for v in range(n)]
        for v in range(n):
            if self.classes:
                for k in range(self.lo[v], self.hi[v] + 1):
                    for i, dev in enumerate(self.choices[k]):
                        # (L1') end >= start + compute on the class the stage picked (only
                        #       lower bounds on `end` follow, so >= is exact when minimising)
                        m.add(end[v] >= start[v] + self._c_units(v, dev)).only_enforce_if(
                            [self.x[(v, k)], self.z[(k, i)]]
                        )
                continue
            dur = sum(
                self._c_units(v, self.order[k]) * self.x[(v, k)]
                for k in range(self.lo[v], self.hi[v] + 1)
            )
            # (L1) end = start + compute on the stage's device
            m.add(end[v] == start[v] + dur)
        for u, v in pb.edges:
            # (L2) a node starts after its producers finish ...
            m.add(start[v] >= end[u])
            for j, k in self._sends(u, v):
                # (L3) ... plus the transfer when the producer is on an earlier stage
                m.add(start[v] >= end[u] + self._t_units(u, j, k)).only_enforce_if(
                    [self.x[(u, j)], self.x[(v, k)]]
                )
        for k in range(slots):
            last: Any = 0
            for v in range(n):
                if (v, k) not in self.x:
                    continue
                ready = m.new_int_var(0, cap, f"ready{v}_{k}")
                # (L4) one node at a time, in index order: v waits for the stage's earlier nodes
                m.add(start[v] >= last).only_enforce_if(self.x[(v, k)])
                m.add(ready >= last)
                m.add(ready >= end[v]).only_enforce_if(self.x[(v, k)])
                last = ready
        span = m.new_int_var(0, cap, "makespan")
        for v in range(n):
            # (L5) makespan >= every finish
            m.add(span >= end[v])
        return span

    def _fastest_links(self) -> tuple[float, float]:
        """(latency, bandwidth) of the cheapest link between two different devices."""
        pb = self.problem
        d = pb.num_devices
        pairs = [(a, b) for a in range(d) for b in range(d) if a != b]
        if not pairs:
            return (0.0, 1.0)
        return (min(pb.latency[a][b] for a, b in pairs), max(pb.bandwidth[a][b] for a, b in pairs))

    def _trivial_upper(self) -> float:
        """Every node on its slowest device plus every output sent to every stage."""
        pb = self.problem
        mult = comm_multiplier(pb)
        devs = range(pb.num_devices) if self.classes else self.order
        pairs = [(a, b) for a in devs for b in devs if a != b]
        total = sum(max(row) for row in pb.compute)
        for u in range(pb.n):
            worst = max((transfer_time(pb, u, a, b) for a, b in pairs), default=0.0)
            total += 2 * mult * len(self.order) * worst
        return max(total, 1e-9)

    def add_hint(self, stage_of: list[int], stage_device: list[int] | None = None) -> None:
        """Hint a plan given as stages of this order (all hinted values consistent).

        The class model also needs the plan's ``stage_device`` (its classes).
        """
        if self.empty:
            return
        m = self.model
        if self.classes:
            assert stage_device is not None, "the class model hints a plan's devices too"
            label = {dev: c for c, cls in enumerate(self.classes) for dev in cls}
            for (k, i), var in self.z.items():
                m.add_hint(var, int(k < len(stage_device) and label[stage_device[k]] == i))
        for (v, k), var in self.y.items():
            m.add_hint(var, int(stage_of[v] <= k))
        for (v, k), var in self.x.items():
            if self.lo[v] < self.hi[v]:
                m.add_hint(var, int(stage_of[v] == k))
        sent = {(u, stage_of[u], stage_of[v]) for u, v in self.problem.edges}
        for key, var in self.p.items():
            m.add_hint(var, int(key in sent))
        top = max(stage_of)
        for k in range(1, len(self.used)):
            m.add_hint(self.used[k], int(k <= top))
        for s, var in self.stage_count.items():
            m.add_hint(var, int(s == top + 1))

    def stage_devices(self, solver: cp_model.CpSolver) -> list[int]:
        """The device of every slot: this order, or the class model's choice per used stage."""
        if not self.classes:
            return list(self.order[: len(self.used)])
        nxt = [0] * len(self.classes)
        out = []
        for k in range(len(self.used)):
            for i, cls in enumerate(self.classes):
                if solver.boolean_value(self.z[(k, i)]):
                    out.append(cls[nxt[i]])
                    nxt[i] += 1
                    break
            else:  # an unused trailing slot: any device left (renumber drops it)
                out.append(-1)
        return out

    def stage_of(self, solver: cp_model.CpSolver) -> list[int]:
        """The solved stage of every node."""
        out = []
        for v in range(self.problem.n):
            k = self.lo[v]
            while k < self.hi[v] and not solver.boolean_value(self.y[(v, k)]):
                k += 1
            out.append(k)
        return out
