"""Solvers against brute force on small random DAGs, plus the honesty contract.

Hypothesis draws tiny problems (4-7 nodes, 2-3 heterogeneous devices, random
links, caps that are sometimes infeasible) so brute force stays exact and fast;
CP-SAT must match its optimum, return valid plans priced by evaluate(), and
never lose to a baseline.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crosscut.errors import InfeasiblePlanError, PartitionError
from crosscut.partitioner.evaluate import check, evaluate
from crosscut.partitioner.problem import PartitionProblem
from crosscut.partitioner.solvers import solve, solve_cpsat
from crosscut.partitioner.solvers.baselines import (
    chain_dp,
    device_order,
    param_balanced,
    uniform_by_count,
)
from crosscut.partitioner.solvers.bruteforce import brute_force
from crosscut.partitioner.solvers.synthetic import (
    densenet_like,
    make_problem,
    num_nodes,
    random_dag,
    resnet_like,
)

REL = 1e-3
SETTINGS = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def problems(draw: st.DrawFn, max_nodes: int = 8) -> PartitionProblem:
    seed = draw(st.integers(0, 10**6))
    n = draw(st.integers(4, max_nodes))
    d = draw(st.integers(2, 3))
    rng = random.Random(seed)
    edges = random_dag(rng, n)
    speed = [rng.choice((1.0, 1.0, 1.5, 3.0)) for _ in range(d)]
    base = [rng.uniform(0.1, 3.0) for _ in range(n)]
    bw = [[rng.choice((1e3, 4e3)) for _ in range(d)] for _ in range(d)]
    act = [rng.randrange(0, 400) for _ in range(n)]
    out = [rng.randrange(0, 3000) for _ in range(n)]
    res = [rng.randrange(0, 500) for _ in range(n)]
    total = sum(res) + 2 * sum(act) + sum(out)
    caps = [int(total * rng.choice((0.15, 0.5, 0.7, 2.0))) for _ in range(d)]
    ties = [[i, i + 1] for i in range(n - 1) if rng.random() < 0.1][:1]
    return PartitionProblem(
        names=[f"v{i}" for i in range(n)],
        compute=[[b * s for s in speed] for b in base],
        resident=res,
        activation=act,
        out_bytes=out,
        edges=edges,
        devices=[f"d{i}" for i in range(d)],
        mem_cap=caps,
        bandwidth=bw,
        latency=[[rng.choice((0.0, 0.1)) for _ in range(d)] for _ in range(d)],
        ties=ties,
        microbatches=draw(st.integers(1, 4)),
        schedule=draw(st.sampled_from(("1f1b", "gpipe"))),
        objective=draw(st.sampled_from(("throughput", "latency"))),
        training=draw(st.booleans()),
        overlap_comm=draw(st.booleans()),
    )


def _brute_or_none(pb: PartitionProblem) -> float | None:
    try:
        return brute_force(pb).objective
    except InfeasiblePlanError:
        return None


@SETTINGS
@given(problems())
def test_cpsat_matches_brute_force(pb: PartitionProblem) -> None:
    best = _brute_or_none(pb)
    if best is None:
        with pytest.raises(InfeasiblePlanError) as info:
            solve_cpsat(pb, time_limit=5.0)
        assert any(ch.isdigit() for ch in str(info.value))
        return
    res = solve_cpsat(pb, time_limit=5.0)
    assert res.status == "OPTIMAL"
    assert check(pb, res.stage_of, res.stage_device) == []
    assert res.objective == pytest.approx(evaluate(pb, res.stage_of, res.stage_device).objective)
    assert res.objective == pytest.approx(best, rel=REL)
    assert res.best_bound <= best * (1 + REL)
    assert res.gap <= REL
    for value in res.baselines.values():
        assert res.objective <= value * (1 + 1e-9)


@SETTINGS
@given(problems(max_nodes=9))
def test_baselines_are_valid_and_chain_dp_beats_naive_splits(pb: PartitionProblem) -> None:
    order = device_order(pb)
    assert sorted(order) == list(range(pb.num_devices))
    dp = chain_dp(pb, order)
    for naive in (uniform_by_count(pb, None, order), param_balanced(pb, None, order)):
        if naive is None:
            continue
        assert check(pb, *naive) == []
        assert dp is not None
        assert evaluate(pb, *dp).objective <= evaluate(pb, *naive).objective * (1 + 1e-9)
    if dp is not None:
        assert check(pb, *dp) == []
        for solver in ("dp", "greedy"):
            res = solve(pb, solver=solver)
            assert check(pb, res.stage_of, res.stage_device) == []
            assert res.objective <= evaluate(pb, *dp).objective * (1 + 1e-9)
            assert res.best_bound <= res.objective


def test_chain_dp_is_optimal_among_contiguous_splits_on_a_chain() -> None:
    # a pure chain: every split is contiguous, so chain_dp must equal brute force
    rng = random.Random(3)
    edges = [(i, i + 1) for i in range(9)]
    pb = make_problem(edges, 10, 3, rng=rng)
    dp = chain_dp(pb)
    assert dp is not None
    assert evaluate(pb, *dp).objective == pytest.approx(brute_force(pb).objective)


def test_infeasible_caps_explain_the_numbers() -> None:
    pb = make_problem(resnet_like(3), 11, 2, rng=random.Random(0), mem_cap=1000)
    with pytest.raises(InfeasiblePlanError) as info:
        solve(pb)
    msg = str(info.value)
    assert "1000" in msg and "largest node" in msg and "remedy" in msg


def test_deterministic_and_progress_reported() -> None:
    edges = resnet_like(30)
    pb = make_problem(edges, num_nodes(edges), 4, rng=random.Random(7))
    seen: list[tuple[float, float, float]] = []
    a = solve(pb, seed=3, progress=lambda *x: seen.append(x))
    b = solve(pb, seed=3)
    assert (a.stage_of, a.stage_device, a.objective) == (b.stage_of, b.stage_device, b.objective)
    assert seen and all(obj >= bound * (1 - 1e-6) for _, obj, bound in seen)


def test_tiny_time_limit_still_returns_a_valid_plan_with_a_gap() -> None:
    edges = densenet_like()
    pb = make_problem(edges, num_nodes(edges), 8, rng=random.Random(1))
    res = solve(pb, time_limit=0.01)
    assert res.status in ("OPTIMAL", "FEASIBLE", "FALLBACK")
    assert check(pb, res.stage_of, res.stage_device) == []
    assert 0.0 <= res.gap < 1.0
    assert res.best_bound <= res.objective
    assert res.objective <= min(res.baselines.values()) * (1 + 1e-9)


def test_more_devices_than_useful_and_require_all() -> None:
    rng = random.Random(2)
    pb = make_problem([(0, 1), (1, 2)], 3, 4, rng=rng)
    res = solve(pb)
    assert res.num_stages <= 3
    assert any("of 4 devices" in note for note in res.notes)
    with pytest.raises(PartitionError):
        solve(pb, require_all_devices=True)
    pb2 = make_problem(resnet_like(3), 11, 4, rng=rng, bandwidth=1e6)  # comm dominates
    res2 = solve(pb2, require_all_devices=True)
    assert res2.num_stages == 4
    assert check(pb2, res2.stage_of, res2.stage_device) == []


def test_heterogeneous_many_devices_gets_a_valid_relaxed_bound() -> None:
    # 5 devices of two speeds: orders are searched heuristically, the bound comes
    # from the all-fastest relaxation and must stay below the returned objective
    edges = resnet_like(8)
    pb = make_problem(edges, num_nodes(edges), 5, rng=random.Random(4))
    pb = PartitionProblem(
        **{**pb.__dict__, "compute": [[c[0] * (1 + (d % 2)) for d in range(5)] for c in pb.compute]}
    )
    res = solve(pb, time_limit=5.0)
    assert check(pb, res.stage_of, res.stage_device) == []
    assert 0.0 < res.best_bound <= res.objective
    assert any("heuristic" in note for note in res.notes)
