"""Every search path returns by its time limit, with a valid plan and an honest bound.

The problems are large on purpose (2,564 nodes on 7 unequal devices; a
cross-shaped search over 64 devices), where the solvers used to overrun: the
fallback baseline was quadratic in the nodes and ran after the budget was
spent, and the group DP had no deadline at all. Limits are small so the file
stays quick; the allowance is the promise (limit + 10 %) plus a little slack
for a loaded 2-core machine. The full-size measurement (resnet50 on 64 V100s)
is ``benchmarks/deadlines.py``, not a unit test.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from benchmarks.synthetic import make_problem, num_nodes, resnet_like
from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.evaluate import check, evaluate
from crosscut.partitioner.solvers import SolveResult, SolveSettings, solve
from crosscut.partitioner.solvers.baselines import all_baselines, chain_dp, greedy, time_balanced
from crosscut.partitioner.solvers.cross import cross_dp_search, solve_cross

# timed against the wall clock: `make test` runs this file alone, after the parallel run
pytestmark = pytest.mark.timed

SLACK_S = 0.75  # a loaded machine's scheduling noise, on top of the 10 % the API promises


def _within(limit: float, wall: float) -> None:
    assert wall <= limit * 1.1 + SLACK_S, f"{wall:.2f} s for a {limit} s limit"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_deadline_counts_down_and_sub_deadlines_never_outlive_it() -> None:
    clock = _Clock()
    dl = Deadline(10.0, clock=clock)
    assert dl.left() == 10.0 and not dl.expired()
    clock.now += 4.0
    assert dl.left() == pytest.approx(6.0) and dl.elapsed() == pytest.approx(4.0)
    assert dl.share(0.5).left() == pytest.approx(3.0)
    assert dl.before(1.0).left() == pytest.approx(5.0)
    assert dl.within(100.0).end == dl.end  # never past the parent
    assert dl.before(100.0).expired()
    clock.now += 7.0
    assert dl.left() == 0.0 and dl.expired()
    assert Deadline.of(dl, 99.0) is dl
    with pytest.raises(ValueError, match="seconds >= 0"):
        Deadline(float("nan"))


def _big(devices: int = 7) -> PartitionProblem:
    """resnet_like(854): 2,564 nodes, on devices of four speeds (no interchangeable order)."""
    edges = resnet_like(854)
    pb = make_problem(edges, num_nodes(edges), devices, rng=random.Random(1), mem_cap=128 << 30)
    speed = [(1.0, 1.0, 1.5, 1.5, 2.0, 3.0, 3.0)[d % 7] for d in range(devices)]
    return dataclasses.replace(pb, compute=[[row[0] * s for s in speed] for row in pb.compute])


@pytest.fixture(scope="module")
def big() -> PartitionProblem:
    return _big()


def _honest(pb: PartitionProblem, res: SolveResult) -> None:
    """A valid plan, priced as evaluate() prices it, and a bound no higher than it."""
    groups = res.groups
    leaders = res.stage_device if groups is None else [g.leader for g in groups]
    assert check(pb, res.stage_of, leaders, groups) == []
    assert res.objective == pytest.approx(evaluate(pb, res.stage_of, leaders, groups).objective)
    assert res.best_bound <= res.objective * (1 + 1e-9)
    if res.status == "OPTIMAL":
        assert res.gap <= 1e-3


@pytest.mark.parametrize("solver", ["cpsat", "dp", "greedy"])
def test_large_graph_on_unequal_devices_returns_by_the_limit(
    big: PartitionProblem, solver: str
) -> None:
    limit = 1.5
    t0 = time.perf_counter()
    res = solve(big, SolveSettings(time_limit=limit, solver=solver))
    _within(limit, time.perf_counter() - t0)
    _honest(big, res)
    assert res.status in ("FEASIBLE", "FALLBACK", "OPTIMAL")


def test_an_expired_deadline_still_gives_the_linear_fallback(big: PartitionProblem) -> None:
    spent = Deadline(0.0)
    t0 = time.perf_counter()
    plans = all_baselines(big, deadline=spent)
    assert time.perf_counter() - t0 < 1.5  # linear: a few evaluate() calls
    assert "chain_dp" in plans or "time_balanced" in plans  # chain_dp: its naive splits
    for plan in plans.values():
        assert check(big, *plan) == []
    assert time_balanced(big) is not None
    dp = chain_dp(big, deadline=spent)
    assert dp is not None and check(big, *dp) == []
    assert greedy(big, start=dp, deadline=spent) == dp  # stopped before the first move


def _cross(devices: int, n_blocks: int = 60) -> PartitionProblem:
    """A resnet-like chain on ``devices`` identical devices, every group shape allowed."""
    edges = resnet_like(n_blocks)
    n = num_nodes(edges)
    rng = random.Random(2)
    pb = make_problem(edges, n, devices, rng=rng, bandwidth=50e9, latency=5e-6)
    widths = tuple(sorted({1, *(w for w in (2, 4, 8, 16, 32, 64) if w <= devices), devices}))
    return dataclasses.replace(
        pb,
        widths=widths,
        splits=("batch", "channel"),
        shard=[rng.choice(["split", "channel", "full"]) for _ in range(n)],
        channels=[rng.choice([64, 128, 256]) for _ in range(n)],
        param_bytes=[r // 4 for r in pb.resident],
        batch=32,
        graph_inputs=[(4 << 20, [0])],
        graph_outputs=[n - 1],
    )


def test_cross_shaped_search_on_64_devices_returns_by_the_limit() -> None:
    pb = _cross(64)
    limit = 2.0
    t0 = time.perf_counter()
    res = solve(pb, SolveSettings(time_limit=limit))
    _within(limit, time.perf_counter() - t0)
    assert res.groups is not None
    _honest(pb, res)
    assert res.status == "FEASIBLE"


def test_group_dp_stops_with_its_best_plan_so_far() -> None:
    pb = _cross(16, n_blocks=20)
    full, complete = cross_dp_search(pb)
    assert complete and full is not None
    none, done = cross_dp_search(pb, deadline=Deadline(0.0))
    assert (none, done) == (None, False)
    res = solve_cross(pb, None, deadline=Deadline(0.0))  # data parallelism still competes
    assert "the group DP stopped at the deadline" in " ".join(res.notes)
    _honest(pb, res)


def test_partition_of_a_graph_returns_by_the_limit_with_a_valid_plan() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    from crosscut.api import partition
    from crosscut.frontend import trace
    from crosscut.partitioner.validate import validate_plan

    layers: list[nn.Module] = []
    for _ in range(40):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()]
    model = nn.Sequential(*layers)
    graph = trace(model, torch.randn(4, 16, 16, 16))
    limit = 3.0
    t0 = time.perf_counter()
    plan = partition(graph, "64xV100", cross_shaped=True, time_limit=limit)
    _within(limit, time.perf_counter() - t0)
    validate_plan(plan, graph)
    assert plan.solver.best_bound <= plan.solver.objective * (1 + 1e-9)
    assert plan.solver.status in ("FEASIBLE", "FALLBACK")


def test_replica_layouts_on_nodes_share_one_deadline() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    from crosscut.api import partition

    layers: list[nn.Module] = []
    for _ in range(20):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()]
    limit = 3.0
    t0 = time.perf_counter()
    plan = partition(
        nn.Sequential(*layers), "4x4xV100", torch.randn(32, 16, 16, 16), time_limit=limit
    )
    _within(limit, time.perf_counter() - t0)  # every layout traced and solved within it
    assert plan.replication.replicas >= 1
    assert plan.solver.best_bound <= plan.solver.objective * (1 + 1e-9)


@pytest.mark.slow
def test_resnet50_on_64_v100s_cross_shaped_returns_by_30_s() -> None:
    """The issue's measurement (``benchmarks/deadlines.py``); heavy: CROSSCUT_HEAVY=1."""
    import os

    if os.environ.get("CROSSCUT_HEAVY") != "1":
        pytest.skip("heavy on 2 CPU cores (30 s); run with CROSSCUT_HEAVY=1")
    torch = pytest.importorskip("torch")
    from crosscut.api import partition
    from tests.conftest import build_meta

    t0 = time.perf_counter()
    plan = partition(
        build_meta("resnet50"),
        "64xV100",
        torch.empty(32, 3, 224, 224, device="meta"),
        cross_shaped=True,
        time_limit=30,
    )
    _within(30, time.perf_counter() - t0)
    assert plan.solver.best_bound <= plan.solver.objective
