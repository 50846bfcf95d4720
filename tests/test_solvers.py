"""Solvers against brute force on small random DAGs, plus the honesty contract.

Hypothesis draws tiny problems (4-7 nodes, 2-3 heterogeneous devices, random
links, values of one or several messages, caps that are sometimes infeasible)
so brute force stays exact and fast;
CP-SAT must match its optimum, return valid plans priced by evaluate(), and
never lose to a baseline.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.synthetic import (
    densenet_like,
    make_problem,
    num_nodes,
    random_dag,
    resnet_like,
)
from crosscut.errors import InfeasiblePlanError, PartitionError
from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.evaluate import check, consumers, evaluate, lower_bound
from crosscut.partitioner.solvers import SolveSettings, solve, solve_cpsat
from crosscut.partitioner.solvers.baselines import (
    chain_dp,
    device_order,
    param_balanced,
    uniform_by_count,
)
from crosscut.partitioner.solvers.bounds import comm_lower_bound, tree_relaxation
from crosscut.partitioner.solvers.bruteforce import brute_force

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
    latency = [[rng.choice((0.0, 0.1)) for _ in range(d)] for _ in range(d)]
    # tensor leaves per value (a tuple output is several messages): drawn last, so the
    # problems drawn before messages were counted are the same otherwise
    messages = [rng.choice((1, 1, 2, 5)) for _ in range(n)]
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
        latency=latency,
        ties=ties,
        microbatches=draw(st.integers(1, 4)),
        schedule=draw(st.sampled_from(("1f1b", "gpipe"))),
        objective=draw(st.sampled_from(("throughput", "latency"))),
        training=draw(st.booleans()),
        overlap_comm=draw(st.booleans()),
        messages=messages,
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
            solve_cpsat(pb, SolveSettings(time_limit=5.0))
        assert any(ch.isdigit() for ch in str(info.value))
        return
    res = solve_cpsat(pb, SolveSettings(time_limit=5.0))
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
            res = solve(pb, SolveSettings(solver=solver))
            assert check(pb, res.stage_of, res.stage_device) == []
            assert res.objective <= evaluate(pb, *dp).objective * (1 + 1e-9)
            assert res.best_bound <= res.objective


@pytest.mark.parametrize("messages", [False, True])
def test_chain_dp_is_optimal_among_contiguous_splits_on_a_chain(messages: bool) -> None:
    # a pure chain: every split is contiguous, so chain_dp must equal brute force
    rng = random.Random(3)
    edges = [(i, i + 1) for i in range(9)]
    pb = make_problem(edges, 10, 3, rng=rng)
    if messages:  # values of several tensors on a link whose latency matters (~2 ms nodes)
        lat = [[1e-3] * 3 for _ in range(3)]
        pb = dataclasses.replace(
            pb, latency=lat, messages=[rng.choice((1, 3, 8)) for _ in range(10)]
        )
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
    a = solve(pb, SolveSettings(seed=3, progress=lambda *x: seen.append(x)))
    b = solve(pb, SolveSettings(seed=3))
    assert (a.stage_of, a.stage_device, a.objective) == (b.stage_of, b.stage_device, b.objective)
    assert seen and all(obj >= bound * (1 - 1e-6) for _, obj, bound in seen)


def test_tiny_time_limit_still_returns_a_valid_plan_with_a_gap() -> None:
    edges = densenet_like()
    pb = make_problem(edges, num_nodes(edges), 8, rng=random.Random(1))
    res = solve(pb, SolveSettings(time_limit=0.01))
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
        solve(pb, SolveSettings(require_all_devices=True))
    pb2 = make_problem(resnet_like(3), 11, 4, rng=rng, bandwidth=1e6)  # comm dominates
    res2 = solve(pb2, SolveSettings(require_all_devices=True))
    assert res2.num_stages == 4
    assert check(pb2, res2.stage_of, res2.stage_device) == []


def test_heterogeneous_many_devices_are_searched_by_device_class() -> None:
    # 5 devices of two speeds on uniform links: 10 distinct orders, all searched at once by
    # the class model (a stage picks a speed), so the answer is proven optimal
    edges = resnet_like(8)
    pb = make_problem(edges, num_nodes(edges), 5, rng=random.Random(4))
    pb = PartitionProblem(
        **{**pb.__dict__, "compute": [[c[0] * (1 + (d % 2)) for d in range(5)] for c in pb.compute]}
    )
    res = solve(pb, SolveSettings(time_limit=5.0))
    assert check(pb, res.stage_of, res.stage_device) == []
    assert res.status == "OPTIMAL" and res.best_bound == pytest.approx(res.objective, rel=1e-5)
    assert any("class model over 10 device orders" in note for note in res.notes)


def test_speed_weighted_lower_bound() -> None:
    # 2 nodes of 6 s on a fast device; the second device is 3x slower: in B seconds the
    # pair does at most B + B/3 seconds of fast work, so B >= 12 / (4/3) = 9
    pb = _chain4(
        names=["a", "b"],
        compute=[[6.0, 18.0], [6.0, 18.0]],
        resident=[0, 0],
        activation=[0, 0],
        out_bytes=[0, 0],
        edges=[(0, 1)],
    )
    assert lower_bound(pb) == pytest.approx(9.0)
    assert brute_force(pb).objective >= lower_bound(pb)


# ---- lower bounds beyond lower_bound(): transfers every plan makes, side trees ----------


def _chain4(**kw: object) -> PartitionProblem:
    """a -> b -> c -> d, 1 s each, 1 s per transfer (inference), two devices."""
    base = PartitionProblem(
        names=list("abcd"),
        compute=[[1.0, 1.0]] * 4,
        resident=[0] * 4,
        activation=[0] * 4,
        out_bytes=[1000] * 4,
        edges=[(0, 1), (1, 2), (2, 3)],
        devices=["d0", "d1"],
        mem_cap=[10**6] * 2,
        bandwidth=[[1e3, 1e3], [1e3, 1e3]],
        latency=[[0.0, 0.0], [0.0, 0.0]],
        training=False,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_comm_bound_by_hand() -> None:
    pb = _chain4()
    assert lower_bound(pb) == pytest.approx(2.0)  # 4 s of compute over 2 devices
    # two stages: the second receives >= 1 s and the first sends >= 1 s, so 2 B >= 4 + 2
    assert comm_lower_bound(pb) == pytest.approx(3.0)
    assert brute_force(pb).objective == pytest.approx(3.0)  # {a,b} | {c,d}: 2 + 1 each
    assert comm_lower_bound(_chain4(overlap_comm=True)) == pytest.approx(2.0)  # not applied


def _with_side_trees(rng: random.Random, core: int, trees: int) -> PartitionProblem:
    """A random DAG plus small chains of 1-2 source nodes, each feeding one core node."""
    edges = random_dag(rng, core)
    n = core
    for _ in range(trees):
        target = rng.randrange(1, core)
        length = rng.randint(1, 2)
        for i in range(length):
            edges.append((n + i, n + i + 1) if i + 1 < length else (n + i, target))
        n += length
    # renumber topologically: side nodes before the core node they feed
    order = sorted(range(n), key=lambda v: (_depth_key(v, edges, core), v))
    pos = {v: i for i, v in enumerate(order)}
    d = rng.randint(2, 3)
    compute = [rng.uniform(0.5, 3.0) if v < core else rng.uniform(0.01, 0.3) for v in order]
    return PartitionProblem(
        names=[f"v{v}" for v in order],
        compute=[[c] * d for c in compute],
        resident=[rng.randrange(0, 500) for _ in range(n)],
        activation=[rng.randrange(0, 400) for _ in range(n)],
        out_bytes=[rng.randrange(0, 3000) for _ in range(n)],
        edges=sorted({(pos[u], pos[v]) for u, v in edges}),
        devices=[f"d{i}" for i in range(d)],
        mem_cap=[10**7] * d,
        bandwidth=[[rng.choice((1e3, 4e3))] * d for _ in range(d)],
        latency=[[rng.choice((0.0, 0.05))] * d for _ in range(d)],
        microbatches=rng.randint(1, 3),
        training=rng.random() < 0.5,
        overlap_comm=rng.random() < 0.2,
        # tensor leaves per value, in the renumbered order the tree relaxation must keep
        messages=[rng.choice((1, 1, 3)) for _ in range(n)],
    )


def _depth_key(v: int, edges: list[tuple[int, int]], core: int) -> float:
    """Core nodes at their index; a side node just before the core node it leads to."""
    if v < core:
        return float(v)
    nxt = {u: w for u, w in edges if u >= core}  # a side node's one consumer
    steps = 0
    while v >= core:
        v, steps = nxt[v], steps + 1
    return v - 0.1 * steps


@pytest.mark.parametrize("seed", range(25))
def test_bounds_never_exceed_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    pb = _with_side_trees(rng, rng.randint(4, 6), rng.randint(1, 3))
    assert pb.n <= 12
    try:
        best = brute_force(pb).objective
    except InfeasiblePlanError:
        return
    assert comm_lower_bound(pb) <= best * (1 + 1e-9)
    relaxed = tree_relaxation(pb, fraction=1.0)  # any choice of trees is a valid relaxation
    assert relaxed is not None
    assert relaxed.problem.n < pb.n
    # the kept nodes keep their own message counts (a latency per tensor of their value)
    assert relaxed.problem.messages == [pb.messages[v] for v in relaxed.kept]
    floating = relaxed.floating
    assert comm_lower_bound(relaxed.problem, floating=floating) <= best * (1 + 1e-9)
    sub = brute_force(relaxed.problem)
    assert sub.objective <= best * (1 + 1e-9)
    with_c10 = solve_cpsat(
        relaxed.problem, SolveSettings(time_limit=5.0, relax=False, floating=floating)
    )
    assert with_c10.best_bound <= best * (1 + 1e-6)
    # the expanded plan is a plan of the original (placement rules; memory may differ)
    plan = relaxed.expand(
        sub.stage_of, evaluate(relaxed.problem, sub.stage_of, sub.stage_device).stage_time
    )
    assert not [e for e in check(pb, plan, sub.stage_device) if "needs" not in e]
    full = solve_cpsat(pb, SolveSettings(time_limit=5.0))
    assert full.status == "OPTIMAL"
    assert full.objective == pytest.approx(best, rel=REL)
    assert full.best_bound <= best * (1 + 1e-6)


def _fanned_out(pb: PartitionProblem) -> PartitionProblem:
    """``pb`` with every value of three or more readers listed as codegen's fan-out
    rewrite lists it (each reader reads the value itself)."""
    cons = consumers(pb)
    fan = {v: [(r, v) for r in sorted(cs)] for v, cs in enumerate(cons) if len(cs) >= 3}
    return dataclasses.replace(pb, fanout=fan)


@pytest.mark.parametrize("seed", range(25))
def test_the_tree_relaxation_of_a_fanned_out_problem_is_a_relaxation(seed: int) -> None:
    """The relaxation keeps the fan-out map on its own nodes (it once kept the whole
    problem's, and planning timm's rdnet_tiny crashed): its optimum stays under the
    problem's, and the solver's bound under the brute-force optimum."""
    rng = random.Random(1000 + seed)
    pb = _fanned_out(_with_side_trees(rng, rng.randint(4, 6), rng.randint(1, 3)))
    relaxed = tree_relaxation(pb, fraction=1.0)
    assert relaxed is not None
    sub = relaxed.problem
    assert all(max(v, *(i for rp in reads for i in rp)) < sub.n for v, reads in sub.fanout.items())
    assert len(sub.fanout) == len(pb.fanout)  # side nodes never fan out
    try:
        best = brute_force(pb).objective
    except InfeasiblePlanError:
        return
    assert brute_force(sub).objective <= best * (1 + 1e-9)
    full = solve_cpsat(pb, SolveSettings(time_limit=5.0))
    assert best * (1 - 1e-6) <= full.objective and full.best_bound <= best * (1 + 1e-6)


def test_tree_relaxation_by_hand() -> None:
    # main chain m0 -> m1 -> m2 (10 s each); side tree s0 -> s1 -> m2, 0.3 s and 0.1 s
    pb = PartitionProblem(
        names=["m0", "s0", "m1", "s1", "m2"],
        compute=[[10.0] * 2, [0.3] * 2, [10.0] * 2, [0.1] * 2, [10.0] * 2],
        resident=[0] * 5,
        activation=[0] * 5,
        out_bytes=[1000, 1000, 1000, 50, 0],  # s1's output: 0.05 s over a 1000 B/s link
        edges=[(0, 2), (1, 3), (2, 4), (3, 4)],
        devices=["d0", "d1"],
        mem_cap=[10**6] * 2,
        bandwidth=[[1e3, 1e3], [1e3, 1e3]],
        latency=[[0.0, 0.0], [0.0, 0.0]],
        training=False,
    )
    rx = tree_relaxation(pb)
    assert rx is not None
    assert rx.problem.names == ["m0", "m1", "m2"]
    # m2's stage runs s1 (0.1 s + s0's 0.3 s, or s0 sent: 1 s) or receives s1: 0.05 s
    assert rx.problem.compute[2] == pytest.approx([10.05, 10.05])
    assert rx.floating == pytest.approx(0.4 - 0.05)
    assert rx.expand([0, 1, 1]) == [0, 1, 1, 1, 1]  # the tree follows m2


@SETTINGS
@given(problems(max_nodes=9))
def test_comm_bound_never_exceeds_brute_force(pb: PartitionProblem) -> None:
    best = _brute_or_none(pb)
    if best is not None and pb.objective == "throughput":
        assert comm_lower_bound(pb) <= best * (1 + 1e-9)


def _transformer_with_bias_trees(blocks: int, devices: int) -> PartitionProblem:
    """Blocks of attention + MLP on a residual stream; each attention reads a small
    bias computed from parameters alone (swin's relative-position-bias MLP)."""
    rng = random.Random(0)
    names: list[str] = []
    compute: list[float] = []
    out: list[int] = []
    edges: list[tuple[int, int]] = []

    def node(name: str, ms: float, nbytes: int, *ins: int) -> int:
        names.append(name)
        compute.append(ms * 1e-3)
        out.append(nbytes)
        edges.extend((u, len(names) - 1) for u in ins)
        return len(names) - 1

    x = node("embed", 1.0, 4_000_000)
    for b in range(blocks):
        bias = node(f"b{b}.bias", 0.01, 2_700, node(f"b{b}.bias_mlp", 0.04, 460_000))
        attn = node(f"b{b}.attn", rng.uniform(1.5, 2.5), 2_400_000, x, bias)
        res = node(f"b{b}.add1", 0.05, 2_400_000, x, attn)
        x = node(f"b{b}.add2", 0.05, 2_400_000, res, node(f"b{b}.mlp", 3.0, 2_400_000, res))
    node("head", 0.5, 4_000, x)
    n = len(names)
    return PartitionProblem(
        names=names,
        compute=[[c] * devices for c in compute],
        resident=[0] * n,
        activation=[0] * n,
        out_bytes=out,
        edges=edges,
        devices=[f"d{i}" for i in range(devices)],
        mem_cap=[1 << 40] * devices,
        bandwidth=[[50e9] * devices for _ in range(devices)],
        latency=[[5e-6] * devices for _ in range(devices)],
        microbatches=4,
    )


def test_side_tree_phase_proves_the_same_optimum() -> None:
    pb = _transformer_with_bias_trees(12, 8)
    plain = solve_cpsat(pb, SolveSettings(time_limit=10.0, relax=False))
    res = solve_cpsat(pb, SolveSettings(time_limit=10.0))
    assert any("side-tree relaxation (24 of 74 nodes removed)" in note for note in res.notes)
    assert res.status == plain.status == "OPTIMAL"
    assert res.objective == pytest.approx(plain.objective, rel=1e-5)
    assert res.best_bound <= res.objective
    assert res.best_bound >= comm_lower_bound(pb) >= lower_bound(pb)
    assert check(pb, res.stage_of, res.stage_device) == []
