"""The cost model of a plan, computed once, in one place.

Every solver (CP-SAT, DP, greedy, brute force), plan validation and the tests
price an assignment with :func:`evaluate`, so "the objective" means the same
float everywhere; the CP-SAT model is an integer-scaled transcription of these
formulas and its answer is always re-priced here before it is reported.

The model (``PartitionProblem``'s docstring, DESIGN.md "The partition problem"):

* stage ``k`` runs on device ``stage_device[k]``; its compute is the sum of
  ``compute[v][stage_device[k]]`` over its nodes.
* for every node ``u`` and every distinct later stage ``k != s(u)`` that holds a
  consumer of ``u``, one transfer of ``out_bytes[u]`` costing ``latencies(u) *
  latency + out_bytes / bandwidth`` between the two devices (a latency per
  message: ``PartitionProblem.latencies``), counted on the sender and on the
  receiver stage, twice when ``training`` (activation forward, gradient backward);
  one per remote reader where codegen gives each reader an alias (fanout_cost.py).
* ``stage_time = compute + comm`` (or ``max(compute, comm)`` with
  ``overlap_comm``); the throughput objective is the bottleneck ``max_k stage_time``.
* memory of the device of stage ``k`` (in a pipeline a device holds one stage;
  co-located group stages, below, add up on the devices they share):
  ``resident + inflight(k) * (activation + received bytes)`` when training,
  where ``inflight = microbatches`` for GPipe and ``min(microbatches, S - k)``
  for 1F1B (``S`` = number of stages). In inference (no activation kept, one
  buffer per received tensor): ``resident + received bytes``. A recomputing
  stage (every stage with ``problem.recompute``, or those ``stage_recompute``
  names) keeps one micro-batch of activations, the one it re-runs in backward:
  ``resident + activation + inflight(k) * received bytes``; its extra forward
  is already in ``compute``. A schedule that splits each backward into ``B`` and
  ``W`` (``zb-h1``, ``zb-h2``) also keeps, for each micro-batch between its
  ``B`` and its ``W`` (:func:`~crosscut.ir.schedule.pending_weights`), the
  gradient of every parametered node's output, which ``W`` restarts from:
  ``pending(k) * Σ out_bytes`` over the stage's nodes with parameters.
* the latency objective is the makespan of one micro-batch: nodes list-scheduled
  in index (topological) order, each device running one node at a time, a node
  starting when its device is free and its inputs have arrived (producer finish,
  plus the transfer time from another stage). Node times and transfers are those
  of the throughput model (both directions when training): one DAG pass
  approximates a training step's latency.
* cross-shaped stages (``groups``: a stage on several devices, split by batch or
  by channel) follow the formulas in ``partitioner/group_costs.py``; when every
  stage is one device they reduce to the ones above, and the plain path is used.
  Consecutive stages may share one group of two or more devices (co-located
  stages, e.g. batch-split convolutions followed by a channel-split classifier
  on the same devices); a device then works for every stage it serves, so the
  throughput bottleneck is the busiest *device*: ``max_d Σ stage_time`` of its stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from crosscut.ir.problem import PartitionProblem, StageGroup
from crosscut.ir.schedule import placement, virtual_stages, workers
from crosscut.partitioner.fanout_cost import cut_transfers
from crosscut.partitioner.group_costs import (
    batch_split_errors,
    collective_time,
    group_problems,
    node_compute,
    node_share,
    ring_allreduce_time,
)
from crosscut.partitioner.stage_memory import (
    activation_factor,
    buffer_factor,
    held_gradients,
    weight_grad_bytes,
)

__all__ = [
    "Evaluation",
    "check",
    "comm_multiplier",
    "consumers",
    "evaluate",
    "link_time",
    "lower_bound",
    "relative_speeds",
    "renumber",
    "single_groups",
    "transfer_time",
]


@dataclass(frozen=True)
class Evaluation:
    """Prices of one assignment; ``objective`` is the one the problem asks for."""

    objective: float  # bottleneck (throughput) or makespan (latency), seconds
    bottleneck: float  # busiest device's time (max stage time unless stages share devices)
    makespan: float  # one micro-batch through the list schedule, seconds
    stage_compute: list[float]
    stage_comm: list[float]
    stage_time: list[float]
    device_memory: list[int]  # [device] bytes needed (0 for unused devices)
    transfers: list[tuple[int, int, int, float]]  # (node, from stage, to stage, seconds)
    stage_collective: list[float] = field(default_factory=list)  # group collectives in comm
    device_time: list[float] = field(default_factory=list)  # [device] Σ times of its stages

    @property
    def num_stages(self) -> int:
        return len(self.stage_time)


def consumers(problem: PartitionProblem) -> list[list[int]]:
    """Consumers of every node, sorted, duplicates removed."""
    out: list[set[int]] = [set() for _ in range(problem.n)]
    for u, v in problem.edges:
        out[u].add(v)
    return [sorted(s) for s in out]


def comm_multiplier(problem: PartitionProblem) -> int:
    """2 when training (activation forward, gradient backward), else 1."""
    return 2 if problem.training else 1


def transfer_time(problem: PartitionProblem, node: int, src: int, dst: int) -> float:
    """Seconds to move ``node``'s output from device ``src`` to ``dst`` once, one way."""
    return link_time(problem, node, problem.latency[src][dst], problem.bandwidth[src][dst])


def link_time(problem: PartitionProblem, node: int, latency: float, bandwidth: float) -> float:
    """``node``'s output one way over a link: a latency per message, then its bytes (what
    every solver's price or bound of a transfer reads, so they agree with evaluate)."""
    return problem.latencies(node) * latency + problem.out_bytes[node] / bandwidth


def single_groups(stage_device: Sequence[int]) -> list[StageGroup]:
    """One single-device group per stage: the pipeline-only layout."""
    return [StageGroup((d,)) for d in stage_device]


def _is_pipeline(groups: Sequence[StageGroup] | None) -> bool:
    return groups is None or all(g.width == 1 for g in groups)


def evaluate(
    problem: PartitionProblem,
    stage_of: list[int],
    stage_device: list[int],
    groups: Sequence[StageGroup] | None = None,
) -> Evaluation:
    """Price an assignment. Assumes it is well formed; :func:`check` says whether it is.

    ``groups[k]`` (optional) is stage ``k``'s device group; its leader must be
    ``stage_device[k]``. Without groups, or with one device per stage, the
    plain pipeline model prices it.
    """
    if not _is_pipeline(groups):
        assert groups is not None
        return _evaluate_groups(problem, stage_of, list(groups))
    num_stages = len(stage_device)
    mult = comm_multiplier(problem)
    comp = [0.0] * num_stages
    comm = [0.0] * num_stages
    act = [0] * num_stages
    res = [0] * num_stages
    recv = [0] * num_stages
    held = [0] * num_stages
    for v in range(problem.n):
        k = stage_of[v]
        comp[k] += problem.compute[v][stage_device[k]]
        act[k] += problem.activation[v]
        res[k] += problem.resident[v]
        held[k] += weight_grad_bytes(problem, v)
    transfers: list[tuple[int, int, int, float]] = []
    for u, j, k in cut_transfers(problem, stage_of, consumers(problem)):  # fan-out's aliases too
        t = mult * transfer_time(problem, u, stage_device[j], stage_device[k])
        comm[j] += t
        comm[k] += t
        recv[k] += problem.out_bytes[u]
        transfers.append((u, j, k, t))
    memory = [0] * problem.num_devices
    for k, d in enumerate(stage_device):
        memory[d] += (
            res[k]
            + activation_factor(problem, k, num_stages) * act[k]
            + buffer_factor(problem, k, num_stages) * recv[k]
            + held_gradients(problem, k, num_stages) * held[k]
        )
    span = _makespan(problem, stage_of, stage_device)
    members = [(d,) for d in stage_device]
    return _assemble(problem, comp, comm, memory, transfers, span, members)


def _assemble(
    problem: PartitionProblem,
    comp: list[float],
    comm: list[float],
    memory: list[int],
    transfers: list[tuple[int, int, int, float]],
    span: float,
    members: Sequence[Sequence[int]],
    coll: list[float] | None = None,
) -> Evaluation:
    """Stage times (compute + comm, or their max when overlapped) and the objective.

    ``members[k]`` are stage ``k``'s devices; a device shared by co-located
    stages is busy for all of them, so the bottleneck is the busiest device.
    """
    if problem.overlap_comm:
        times = [max(c, m) for c, m in zip(comp, comm)]
    else:
        times = [c + m for c, m in zip(comp, comm)]
    load = [0.0] * problem.num_devices
    for k, devs in enumerate(members):
        for d in devs:
            load[d] += times[k]
    bottleneck = max(load, default=0.0)
    return Evaluation(
        objective=span if problem.objective == "latency" else bottleneck,
        bottleneck=bottleneck,
        makespan=span,
        stage_compute=comp,
        stage_comm=comm,
        stage_time=times,
        device_memory=memory,
        transfers=transfers,
        stage_collective=coll if coll is not None else [0.0] * len(comp),
        device_time=load,
    )


def _evaluate_groups(
    problem: PartitionProblem, stage_of: list[int], groups: list[StageGroup]
) -> Evaluation:
    """The cross-shaped cost model (``partitioner/group_costs.py``'s docstring)."""
    num_stages = len(groups)
    mult = comm_multiplier(problem)
    lead = [g.leader for g in groups]
    per_dev: list[dict[int, float]] = [{d: 0.0 for d in g.devices} for g in groups]
    memory = [0] * problem.num_devices
    shares = [node_share(problem, v, groups[stage_of[v]]) for v in range(problem.n)]
    for v in range(problem.n):
        k = stage_of[v]
        g, f = groups[k], shares[v]
        af = activation_factor(problem, k, num_stages)
        hf = held_gradients(problem, k, num_stages) * weight_grad_bytes(problem, v)
        whole_on_leader = g.split == "channel" and problem.shard_of(v) == "full"
        for d in g.devices:
            if whole_on_leader and d != g.leader:
                continue
            per_dev[k][d] += node_compute(problem, v, d, g, f)
            res = problem.resident[v] * (f if g.split == "channel" else 1.0)
            memory[d] += math.ceil(res + (af * problem.activation[v] + hf) * f)
    comp = [max(t.values()) for t in per_dev]
    comm = [0.0] * num_stages
    coll = [0.0] * num_stages
    transfers: list[tuple[int, int, int, float]] = []
    cons = consumers(problem)
    received: list[set[int]] = [set() for _ in range(num_stages)]
    local: list[set[int]] = [set() for _ in range(num_stages)]  # from the same leader
    for u, cs in enumerate(cons):
        j = stage_of[u]
        for k in sorted({stage_of[v] for v in cs} - {j}):
            if lead[j] == lead[k]:  # co-located stages: the value is already there
                t = 0.0
                local[k].add(u)
            else:
                t = mult * transfer_time(problem, u, lead[j], lead[k])
            comm[j] += t
            comm[k] += t
            received[k].add(u)
            transfers.append((u, j, k, t))
    for k, g in enumerate(groups):
        if g.width == 1:
            continue
        nbytes = _group_collective_bytes(problem, stage_of, k, g, received[k], cons)
        t = mult * sum(collective_time(problem, g, b) for b in nbytes)
        if problem.training and g.split == "batch":
            grads = sum(problem.grad_bytes(v) for v in range(problem.n) if stage_of[v] == k)
            t += ring_allreduce_time(problem, g, grads) / max(1, problem.microbatches)
        coll[k] = t
        comm[k] += t
    for k, g in enumerate(groups):
        bf = buffer_factor(problem, k, num_stages)
        for u in received[k]:
            for d in g.devices:
                part = 1.0 if d == g.leader or g.split != "batch" else node_share(problem, u, g)
                if g.split == "channel" and d != g.leader:
                    part = 0.0
                if d == g.leader and u in local[k]:
                    part = 0.0  # read in place on the shared leader: no receive buffer
                memory[d] += math.ceil(bf * problem.out_bytes[u] * part)
    at_leader = [
        node_compute(problem, v, lead[stage_of[v]], groups[stage_of[v]], shares[v])
        for v in range(problem.n)
    ]
    span = _makespan(problem, stage_of, lead, at_leader)
    members = [g.devices for g in groups]
    return _assemble(problem, comp, comm, memory, transfers, span, members, coll)


def _group_collective_bytes(
    problem: PartitionProblem,
    stage_of: list[int],
    k: int,
    g: StageGroup,
    received: set[int],
    cons: list[list[int]],
) -> list[int]:
    """Bytes of every one-way collective stage ``k``'s group runs per micro-batch."""
    out: list[int] = []
    if g.split == "batch":
        # scattered into the shares: values from other stages and the model's inputs
        out += [problem.out_bytes[u] for u in sorted(received)]
        out += [b for b, readers in problem.graph_inputs if any(stage_of[v] == k for v in readers)]
        # gathered from the shares: values other stages read, and the model's outputs
        # (once: an output another stage reads is gathered for that send already)
        returned = set(problem.graph_outputs)
        for u in range(problem.n):
            if stage_of[u] == k and (u in returned or any(stage_of[v] != k for v in cons[u])):
                out.append(problem.out_bytes[u])
        return out
    for u in range(problem.n):
        inside = stage_of[u] == k
        if not inside and u not in received:
            continue
        here = [v for v in cons[u] if stage_of[v] == k]
        sharded = inside and problem.shard_of(u) != "full"
        if sharded:
            if any(stage_of[v] != k or problem.shard_of(v) != "channel" for v in cons[u]):
                out.append(problem.out_bytes[u])  # all-gather of its shards
        elif any(problem.shard_of(v) == "split" for v in here):
            out.append(problem.out_bytes[u])  # broadcast of a whole value
    return out


def _makespan(
    problem: PartitionProblem,
    stage_of: list[int],
    stage_device: list[int],
    times: list[float] | None = None,
) -> float:
    """List schedule of one micro-batch in index order (see the module docstring).

    ``times[v]``: node ``v``'s time on its stage's leader (a group's share);
    default ``compute[v][leader]``."""
    mult = comm_multiplier(problem)
    preds: list[set[int]] = [set() for _ in range(problem.n)]
    for u, v in problem.edges:
        preds[v].add(u)
    finish = [0.0] * problem.n
    free = [0.0] * problem.num_devices  # per device: co-located stages share their leader
    for v in range(problem.n):
        k = stage_of[v]
        d = stage_device[k]
        start = free[d]
        for u in preds[v]:
            j = stage_of[u]
            arrive = finish[u]
            if j != k and stage_device[j] != d:
                arrive += mult * transfer_time(problem, u, stage_device[j], d)
            start = max(start, arrive)
        finish[v] = start + (times[v] if times is not None else problem.compute[v][d])
        free[d] = finish[v]
    return max(finish, default=0.0)


def check(
    problem: PartitionProblem,
    stage_of: list[int],
    stage_device: list[int],
    groups: Sequence[StageGroup] | None = None,
) -> list[str]:
    """Every rule the assignment breaks, as readable strings (empty list = valid)."""
    errors: list[str] = []
    if groups is not None:
        if len(groups) != len(stage_device):
            return [f"{len(groups)} device groups for {len(stage_device)} stages"]
        errors += group_problems(problem, groups)
        errors += [
            f"stage {k}'s group leader {g.leader} is not its device {d}"
            for k, (g, d) in enumerate(zip(groups, stage_device))
            if g.devices and g.leader != d
        ]
        if errors:
            return errors
    num_stages = len(stage_device)
    if len(stage_of) != problem.n:
        return [f"stage_of has {len(stage_of)} entries for {problem.n} nodes (node missing)"]
    for v, k in enumerate(stage_of):
        if not 0 <= k < num_stages:
            errors.append(f"node {problem.names[v]!r} in stage {k}, not in 0..{num_stages - 1}")
    if errors:
        return errors
    for u, v in problem.edges:
        if stage_of[u] > stage_of[v]:
            errors.append(
                f"edge {problem.names[u]!r} -> {problem.names[v]!r} goes backwards "
                f"(stage {stage_of[u]} -> {stage_of[v]})"
            )
    for group in problem.ties:
        if len({stage_of[v] for v in group}) > 1:
            errors.append(f"tie group {[problem.names[v] for v in group]} is split over stages")
    used = set(stage_of)
    for k in range(num_stages):
        if k not in used:
            errors.append(f"stage {k} is empty (renumber the stages)")
    for k, g in enumerate(groups or []):
        if g.split == "batch":
            errors += batch_split_errors(problem, stage_of, k)
    if (
        groups is None
        and len(set(stage_device)) != len(stage_device)
        and not _interleaved(problem.schedule, stage_device)
    ):
        errors.append(f"stage_device {stage_device} uses a device twice")
    if any(not 0 <= d < problem.num_devices for d in stage_device):
        errors.append(
            f"stage_device {stage_device} names a device outside 0..{problem.num_devices - 1}"
        )
    if errors:
        return errors
    ev = evaluate(problem, stage_of, stage_device, groups)
    for d, need in enumerate(ev.device_memory):
        if need > problem.mem_cap[d]:
            errors.append(
                f"device {problem.devices[d]!r} needs {need} bytes, cap {problem.mem_cap[d]}"
            )
    return errors


def _interleaved(schedule: str, stage_device: list[int]) -> bool:
    """Whether an interleaved ``schedule`` places the stages as it runs them
    (:func:`~crosscut.ir.schedule.placement`) over distinct devices."""
    n, w = len(stage_device), workers(schedule, len(stage_device))
    if virtual_stages(schedule) < 2 or n % w or len(set(stage_device[:w])) != w:
        return False
    return all(d == stage_device[p] for d, p in zip(stage_device, placement(schedule, n)))


def renumber(stage_of: list[int], stage_device: list[int]) -> tuple[list[int], list[int]]:
    """Drop empty stages, keeping the order of the others and their devices."""
    used = sorted(set(stage_of))
    new = {k: i for i, k in enumerate(used)}
    return [new[k] for k in stage_of], [stage_device[k] for k in used]


def lower_bound(problem: PartitionProblem, devices: int | None = None) -> float:
    """A valid lower bound on the objective for any plan.

    Throughput: the fastest-device compute spread evenly over the devices, and
    no stage is faster than its slowest single node on its best device (or, with
    cross-shaped stages allowed, that node's smallest share on a group).
    Latency: the longest chain of nodes on their fastest device (no transfers).
    """
    fastest = [min(row) for row in problem.compute]
    if not fastest:
        return 0.0
    if problem.objective == "latency":
        longest = [0.0] * problem.n
        preds: list[list[int]] = [[] for _ in range(problem.n)]
        for u, v in problem.edges:
            preds[v].append(u)
        for v in range(problem.n):
            longest[v] = fastest[v] + max((longest[u] for u in preds[v]), default=0.0)
        return max(longest)
    num = devices or problem.num_devices
    largest = max(fastest)
    if problem.cross_shaped:
        # a node may be shared by a group: its floor is its smallest share's time
        largest = max(t * _min_share(problem, v, num) for v, t in enumerate(fastest))
    return max(sum(fastest) / sum(sorted(relative_speeds(problem), reverse=True)[:num]), largest)


def relative_speeds(problem: PartitionProblem) -> list[float]:
    """Per device, the most of a fastest device's work it does per second (at most 1).

    ``r_d = max_v fastest[v] / compute[v][d]``: in ``B`` seconds device ``d``
    runs nodes worth at most ``r_d · B`` seconds of fastest-device compute, so
    every plan's bottleneck is at least ``Σ fastest / Σ_d r_d`` — the average
    over devices, weighted by speed (a CPU 10× slower than six GPUs counts as
    0.1 of a device, not 1).
    """
    fastest = [min(row) for row in problem.compute]
    out = []
    for d in range(problem.num_devices):
        ratios = [f / row[d] for f, row in zip(fastest, problem.compute) if row[d] > 0]
        out.append(min(1.0, max(ratios, default=1.0)))
    return out


def _min_share(problem: PartitionProblem, v: int, num: int) -> float:
    best = 1.0
    for w in problem.widths:
        if 1 < w <= num:
            for split in problem.splits:
                g = StageGroup(tuple(range(w)), split)
                # a share priced at its own batch costs at least its linear part
                best = min(best, node_share(problem, v, g))
    return best
