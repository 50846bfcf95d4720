"""Brute force: every legal plan of a tiny problem, priced by evaluate().

The reference the other solvers are tested against (hypothesis, random DAGs of
up to ~10 nodes and 3-4 devices). It enumerates stage assignments in node
order with ``s(v) >= s(u)`` for every producer (so edges never go backwards),
keeps those whose stages are ``0..S-1`` without holes and whose ties hold,
and tries every injective stage→device map. No cleverness, on purpose.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

from crosscut.errors import InfeasiblePlanError
from crosscut.ir.problem import PartitionProblem, StageGroup
from crosscut.partitioner.evaluate import check, evaluate
from crosscut.partitioner.solvers.result import SolveResult

__all__ = ["brute_force", "brute_force_groups", "stage_assignments"]

MAX_NODES = 14


def stage_assignments(problem: PartitionProblem, max_stages: int) -> Iterator[list[int]]:
    """Every topological, hole-free stage assignment with at most ``max_stages`` stages."""
    preds: list[list[int]] = [[] for _ in range(problem.n)]
    for u, v in problem.edges:
        preds[v].append(u)
    stage_of = [0] * problem.n

    def rec(v: int, top: int) -> Iterator[list[int]]:
        if v == problem.n:
            if len(set(stage_of)) == top + 1:
                yield list(stage_of)
            return
        low = max((stage_of[u] for u in preds[v]), default=0)
        for k in range(low, max_stages):
            stage_of[v] = k
            yield from rec(v + 1, max(top, k))

    yield from rec(0, 0)


@dataclass
class _Best:
    """The fastest plan that fits among those offered; then the answer, proven optimal.

    Shared by both enumerations so they price, check and report a plan the same way.
    """

    problem: PartitionProblem
    t0: float  # perf_counter at the start: the answer's wall time
    plan: tuple[float, list[int], list[int], list[StageGroup] | None] | None = None

    def offer(
        self, stage_of: list[int], stage_device: list[int], groups: list[StageGroup] | None = None
    ) -> None:
        obj = evaluate(self.problem, stage_of, stage_device, groups).objective
        if self.plan is not None and obj >= self.plan[0]:
            return
        if check(self.problem, stage_of, stage_device, groups):
            return
        self.plan = (obj, list(stage_of), stage_device, groups)

    def answer(self, rule: str) -> SolveResult:
        """The best plan offered; InfeasiblePlanError (``rule``) when none fits memory."""
        if self.plan is None:
            raise InfeasiblePlanError(
                rule, value=f"caps {self.problem.mem_cap}", remedy="add devices or memory"
            )
        obj, stage_of, stage_device, groups = self.plan
        return SolveResult(
            stage_of=stage_of,
            stage_device=stage_device,
            objective=obj,
            status="OPTIMAL",
            best_bound=obj,
            gap=0.0,
            wall_time_s=time.perf_counter() - self.t0,
            seed=0,
            workers=1,
            solver="brute",
            groups=groups,
        )


def brute_force(problem: PartitionProblem, *, require_all_devices: bool = False) -> SolveResult:
    """The optimal plan by enumeration; raises InfeasiblePlanError when none fits memory."""
    if problem.n > MAX_NODES:
        raise ValueError(f"brute force is for tiny problems (n <= {MAX_NODES}), got {problem.n}")
    best = _Best(problem, time.perf_counter())
    devs = range(problem.num_devices)
    for stage_of in stage_assignments(problem, min(problem.n, problem.num_devices)):
        if any(len({stage_of[v] for v in g}) > 1 for g in problem.ties):
            continue
        num = max(stage_of) + 1
        if require_all_devices and num < problem.num_devices:
            continue
        for perm in itertools.permutations(devs, num):
            best.offer(stage_of, list(perm))
    return best.answer(
        "no assignment of the graph to the devices fits the memory caps (brute force)"
    )


def brute_force_groups(problem: PartitionProblem) -> SolveResult:
    """The optimal cross-shaped plan among stages on contiguous groups of the device order.

    Every topological stage assignment (not only contiguous chunks) times every
    sequence of stage shapes ``(width, split)`` whose groups take consecutive
    devices of :func:`device_order`, and every such sequence whose last stage
    shares the group of the stage before it (a co-located tail, as the DP
    searches): the space the group DP searches, and more.
    """
    from crosscut.partitioner.solvers.baselines import device_order
    from crosscut.partitioner.solvers.cross import group_types

    if problem.n > MAX_NODES:
        raise ValueError(f"brute force is for tiny problems (n <= {MAX_NODES}), got {problem.n}")
    best = _Best(problem, time.perf_counter())
    order = device_order(problem)
    types = group_types(problem)
    # one stage more than devices: a co-located last stage takes no device of its own
    for stage_of in stage_assignments(problem, min(problem.n, problem.num_devices + 1)):
        if any(len({stage_of[v] for v in g}) > 1 for g in problem.ties):
            continue
        num = max(stage_of) + 1
        for groups in _group_sequences(problem, order, types, num):
            best.offer(stage_of, [g.leader for g in groups], groups)
    return best.answer("no cross-shaped plan fits the memory caps (brute force)")


def _group_sequences(
    problem: PartitionProblem, order: list[int], types: list[tuple[int, str]], num: int
) -> Iterator[list[StageGroup]]:
    """Every group sequence of ``num`` stages on consecutive devices of ``order``.

    Includes the sequences whose last stage shares the group (2+ devices) of the
    stage before it, with any split kind; such a stage takes no device of its own.
    """
    splits = [s for s in ("batch", "channel") if s in problem.splits]
    for shapes in itertools.product(types, repeat=num):
        groups: list[StageGroup] = []
        d = 0
        for w, split in shapes:
            groups.append(StageGroup(tuple(order[d : d + w]), split))
            d += w
        if d <= len(order):
            yield groups
        if num >= 2 and shapes[-1] == types[0] and shapes[-2][0] > 1 and d - 1 <= len(order):
            # the last stage on the previous stage's group instead of a device of its own
            for split in splits:
                yield [*groups[:-1], StageGroup(groups[-2].devices, split)]
