"""Cross-shaped stages: the group cost model, the group DP against brute force.

Problems are tiny (5-7 nodes, 4 identical devices on uniform links) so brute
force over every topological assignment x every stage shape stays exact. On
chains the DP's prefix-sum prices are evaluate()'s, so it must reach the brute
force optimum; on DAGs it may only lose (it searches contiguous chunks).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from crosscut.ir.problem import PartitionProblem, StageGroup
from crosscut.partitioner.evaluate import check, evaluate, lower_bound, single_groups
from crosscut.partitioner.group_costs import batch_split_exports, share
from crosscut.partitioner.solvers import SolveSettings, solve
from crosscut.partitioner.solvers.bruteforce import brute_force_groups
from crosscut.partitioner.solvers.cross import cross_dp, data_parallel

GB = 1 << 30


def _checked_dp(pb: PartitionProblem) -> tuple[list[int], list[StageGroup], list[int]]:
    """The group DP's plan for ``pb`` (stages, groups, leaders), checked well formed."""
    found = cross_dp(pb)
    assert found is not None
    stage_of, groups = found
    leaders = [g.leader for g in groups]
    assert not check(pb, stage_of, leaders, groups)
    return stage_of, list(groups), leaders


def make(
    rng: random.Random,
    n: int,
    *,
    chain: bool,
    devices: int = 4,
    training: bool = True,
    cap: int = 64 * GB,
    microbatches: int = 1,
) -> PartitionProblem:
    edges = [(v - 1, v) for v in range(1, n)]
    if not chain:
        edges += [(u, v) for v in range(2, n) for u in range(v - 1) if rng.random() < 0.3]
    shard = [rng.choice(["split", "channel", "full"]) for _ in range(n)]
    compute = [rng.uniform(0.5, 5.0) for _ in range(n)]
    return PartitionProblem(
        names=[f"n{v}" for v in range(n)],
        compute=[[c] * devices for c in compute],
        resident=[rng.randint(0, 4) * GB // 4 for _ in range(n)],
        activation=[rng.randint(1, 8) * (1 << 20) for _ in range(n)],
        out_bytes=[rng.randint(1, 64) * (1 << 20) for _ in range(n)],
        edges=sorted(set(edges)),
        devices=[f"d{i}" for i in range(devices)],
        mem_cap=[cap] * devices,
        bandwidth=[[50e9] * devices for _ in range(devices)],
        latency=[[1e-5] * devices for _ in range(devices)],
        microbatches=microbatches,
        training=training,
        widths=(1, 2, 4),
        splits=("batch", "channel"),
        shard=shard,
        channels=[rng.choice([0, 6, 64, 3]) for _ in range(n)],
        param_bytes=[rng.randint(0, 256) * (1 << 20) for _ in range(n)],
        batch=rng.choice([8, 6, 0]),
        # the image read by the first node (and sometimes by a later one, as a skip), the
        # last node returned (and sometimes a middle one, as an auxiliary head)
        graph_inputs=[(rng.randint(1, 32) * (1 << 20), sorted({0, rng.randrange(n)}))],
        graph_outputs=sorted({n - 1, rng.randrange(n)}),
    )


def test_share_prices_the_largest_shard() -> None:
    assert share(64, 4) == 0.25
    assert share(6, 4) == pytest.approx(2 / 6)  # shards 2,2,1,1
    assert share(3, 4) == pytest.approx(1 / 3)  # one device idles
    assert share(0, 4) == 0.25  # unknown size: an even split
    assert share(10, 1) == 1.0


def test_single_device_groups_price_as_the_pipeline_model() -> None:
    rng = random.Random(3)
    pb = make(rng, 6, chain=False)
    stage_of, stage_device = [0, 0, 1, 1, 2, 2], [2, 0, 1]
    plain = evaluate(pb, stage_of, stage_device)
    grouped = evaluate(pb, stage_of, stage_device, single_groups(stage_device))
    assert grouped == plain


def test_batch_group_formulas_by_hand() -> None:
    pb = PartitionProblem(
        names=["a", "b"],
        compute=[[4.0] * 4, [2.0] * 4],
        resident=[100, 50],
        activation=[40, 20],
        out_bytes=[1000, 10],
        edges=[(0, 1)],
        devices=["d0", "d1", "d2", "d3"],
        mem_cap=[10**6] * 4,
        bandwidth=[[1000.0] * 4 for _ in range(4)],
        latency=[[0.0] * 4 for _ in range(4)],
        microbatches=2,
        widths=(1, 2),
        splits=("batch",),
        param_bytes=[400, 0],
        batch=8,
    )
    groups = [StageGroup((0, 1), "batch"), StageGroup((2,))]
    ev = evaluate(pb, [0, 1], [0, 2], groups)
    assert ev.stage_compute == [2.0, 2.0]  # 4 s over two devices, half a batch each
    send = 1000 / 1000  # leader -> stage 1, one way
    gather = 0.5 * 1000 / 1000  # (w-1)/w of the output gathered on the leader
    ring = 2 * 0.5 * 400 / 1000 / 2  # all-reduce of 400 gradient bytes, per micro-batch
    assert ev.stage_collective[0] == pytest.approx(2 * gather + ring)
    assert ev.stage_comm[0] == pytest.approx(2 * send + 2 * gather + ring)
    assert ev.stage_comm[1] == pytest.approx(2 * send)
    # 1F1B, 2 stages: stage 0 keeps 2 micro-batches; every replica holds the weights
    assert ev.device_memory[0] == 100 + 2 * 40 * 0.5
    assert ev.device_memory[1] == ev.device_memory[0]
    assert ev.device_memory[2] == 50 + 1 * 20 + 1 * 1000


def test_batch_group_scatters_model_inputs_and_gathers_model_outputs() -> None:
    """A batch-split stage holding the model's input reader and its output node pays
    the scatter of the input and the gather of the output; a one-device stage does not."""
    pb = PartitionProblem(
        names=["a", "b"],
        compute=[[4.0] * 2, [2.0] * 2],
        resident=[0, 0],
        activation=[0, 0],
        out_bytes=[1000, 10],
        edges=[(0, 1)],
        devices=["d0", "d1"],
        mem_cap=[10**6] * 2,
        bandwidth=[[1000.0] * 2 for _ in range(2)],
        latency=[[0.0] * 2 for _ in range(2)],
        microbatches=1,
        training=False,
        widths=(1, 2),
        splits=("batch",),
        batch=8,
        graph_inputs=[(600, [0, 1])],  # read by both nodes: scattered once
        graph_outputs=[1],
    )
    ev = evaluate(pb, [0, 0], [0], [StageGroup((0, 1), "batch")])
    assert ev.stage_collective[0] == pytest.approx(0.5 * (600 + 10) / 1000)
    two = evaluate(pb, [0, 1], [0, 1], [StageGroup((0,)), StageGroup((1,))])
    assert two.stage_collective == [0.0, 0.0]
    # a large image makes the batch split (3 s of compute + 4 s of scatter) lose to one
    # device (6 s; the pipeline: 4 s + 3 s of transfer): the DP must price the scatter
    big = dataclasses.replace(pb, out_bytes=[3000, 10], graph_inputs=[(8000, [0])])
    found = cross_dp(big)
    assert found is not None
    stage_of, groups = found
    assert [g.split for g in groups] == ["none"]
    got = evaluate(big, stage_of, [g.leader for g in groups], groups)
    assert got.objective == pytest.approx(brute_force_groups(big).objective, rel=1e-9)


def test_channel_group_gathers_only_where_a_whole_value_is_needed() -> None:
    # conv(split) -> bn(channel) -> relu(channel) -> conv(split) -> flatten(full)
    pb = PartitionProblem(
        names=["c1", "bn", "relu", "c2", "flat"],
        compute=[[8.0] * 2, [2.0] * 2, [2.0] * 2, [8.0] * 2, [1.0] * 2],
        resident=[800, 16, 0, 800, 0],
        activation=[100, 100, 100, 100, 100],
        out_bytes=[100] * 5,
        edges=[(0, 1), (1, 2), (2, 3), (3, 4)],
        devices=["d0", "d1"],
        mem_cap=[10**6] * 2,
        bandwidth=[[100.0] * 2 for _ in range(2)],
        latency=[[0.0] * 2 for _ in range(2)],
        training=False,
        widths=(1, 2),
        splits=("channel",),
        shard=["split", "channel", "channel", "split", "full"],
        channels=[64, 64, 64, 64, 0],
    )
    ev = evaluate(pb, [0] * 5, [0], [StageGroup((0, 1), "channel")])
    assert ev.stage_compute == [(8 + 2 + 2 + 8) / 2 + 1]  # flatten runs whole on the leader
    # gathers: relu's shards before c2, c2's shards before flatten (50 bytes each way)
    assert ev.stage_collective == [pytest.approx(2 * 0.5 * 100 / 100)]
    assert ev.device_memory == [808, 808]  # inference: weights halved, no activations kept


def test_overlapping_groups_and_bad_splits_are_named() -> None:
    pb = make(random.Random(0), 4, chain=True)
    bad = [StageGroup((0, 1), "batch"), StageGroup((1, 2), "channel")]
    assert any("in stages 0 and 1" in e for e in check(pb, [0, 0, 1, 1], [0, 1], bad))
    one = [StageGroup((0,), "batch")]
    assert any("over one device" in e for e in check(pb, [0] * 4, [0], one))
    tiny = dataclasses.replace(pb, batch=2)
    wide = [StageGroup((0, 1, 2, 3), "batch")]
    assert any("no sample" in e for e in check(tiny, [0] * 4, [0], wide))


def test_memory_caps_differ_within_a_group() -> None:
    pb = make(random.Random(5), 5, chain=True, training=True)
    groups = [StageGroup((0, 1), "channel")]
    need = evaluate(pb, [0] * 5, [0], groups).device_memory
    assert need[0] >= need[1] > 0  # the leader also holds the whole ("full") nodes
    caps = [need[0], need[1] - 1, 10 * need[0], 10 * need[0]]
    tight = dataclasses.replace(pb, mem_cap=caps)
    assert any("'d1' needs" in e for e in check(tight, [0] * 5, [0], groups))
    assert not check(
        dataclasses.replace(pb, mem_cap=[need[0], need[1], 1, 1]), [0] * 5, [0], groups
    )


@pytest.mark.parametrize("seed", range(12))
def test_group_dp_matches_brute_force_on_chains(seed: int) -> None:
    rng = random.Random(seed)
    pb = make(rng, rng.randint(4, 6), chain=True, training=seed % 3 != 0)
    if seed % 2:  # channel splits only: the gather / broadcast prices are exercised
        pb = dataclasses.replace(pb, splits=("channel",))
    if seed % 4 == 1:  # tight memory: some shapes only fit when split
        total = sum(pb.resident) + sum(pb.activation)
        pb = dataclasses.replace(pb, mem_cap=[total // 3] * 4)
    try:
        brute = brute_force_groups(pb)
    except Exception:
        assert cross_dp(pb) is None
        return
    found = cross_dp(pb)
    assert found is not None
    stage_of, groups = found
    leaders = [g.leader for g in groups]
    assert not check(pb, stage_of, leaders, groups)
    obj = evaluate(pb, stage_of, leaders, groups).objective
    assert obj == pytest.approx(brute.objective, rel=1e-9)
    assert obj >= lower_bound(pb) * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_group_dp_prices_a_latency_per_message_as_evaluate_does(seed: int) -> None:
    """A value of several tensors pays a latency per message on the link between two
    stages (one collective inside a group); on chains the DP must still reach brute force,
    so its link prices must be evaluate()'s. Groups of at most 2 devices make the best
    plans cross links (one group of 4 would send nothing), and the latency is raised
    until it matters: priced at one latency per value, the DP misses 4 of these 8."""
    rng = random.Random(300 + seed)
    pb = make(rng, rng.randint(4, 6), chain=True, training=seed % 2 == 0)
    pb = dataclasses.replace(
        pb,
        widths=(1, 2),
        latency=[[0.2] * 4 for _ in range(4)],
        messages=[rng.choice((1, 4, 12)) for _ in range(pb.n)],
    )
    brute = brute_force_groups(pb)
    stage_of, groups, leaders = _checked_dp(pb)
    assert evaluate(pb, stage_of, leaders, groups).objective == pytest.approx(
        brute.objective, rel=1e-9
    )


@pytest.mark.parametrize("seed", range(8))
def test_group_dp_valid_on_dags_and_never_beats_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    pb = make(rng, rng.randint(5, 7), chain=False, microbatches=rng.choice([1, 2]))
    brute = brute_force_groups(pb)
    res = solve(pb, SolveSettings(time_limit=2.0))
    assert res.groups is not None
    leaders = [g.leader for g in res.groups]
    assert not check(pb, res.stage_of, leaders, res.groups)
    assert res.objective == pytest.approx(evaluate(pb, res.stage_of, leaders, res.groups).objective)
    assert res.objective >= brute.objective * (1 - 1e-9)
    assert res.objective <= min(v for v in res.baselines.values()) * (1 + 1e-12)
    assert res.best_bound <= brute.objective * (1 + 1e-9)


def test_cross_never_worse_than_pipeline_or_data_parallel() -> None:
    rng = random.Random(7)
    pb = make(rng, 7, chain=False)
    res = solve(pb, SolveSettings(time_limit=2.0))
    plain = solve(dataclasses.replace(pb, widths=(1,), splits=()), SolveSettings(time_limit=2.0))
    dp = data_parallel(pb)
    assert dp is not None
    dp_obj = evaluate(pb, dp[0], [g.leader for g in dp[1]], dp[1]).objective
    assert res.objective <= plain.objective * (1 + 1e-12)
    assert res.objective <= dp_obj * (1 + 1e-12)
    assert math.isfinite(res.baselines["data_parallel"])


def test_defaults_leave_the_pipeline_solver_alone() -> None:
    pb = dataclasses.replace(make(random.Random(2), 6, chain=False), widths=(1,), splits=())
    res = solve(pb, SolveSettings(time_limit=2.0))
    assert res.groups is None and res.solver == "cpsat"


def _conv_head(devices: int = 4) -> PartitionProblem:
    """Two convolutions (most of the time) then a classifier holding most parameters."""
    mb = 1 << 20
    return PartitionProblem(
        names=["conv1", "conv2", "flatten", "fc"],
        compute=[[c] * devices for c in (0.010, 0.010, 1e-5, 5e-4)],
        resident=[4 * mb, 4 * mb, 0, 1600 * mb],
        activation=[64 * mb, 16 * mb, 0, mb],
        out_bytes=[64 * mb, 16 * mb, 16 * mb, mb // 16],
        edges=[(0, 1), (1, 2), (2, 3)],
        devices=[f"d{i}" for i in range(devices)],
        mem_cap=[64 * GB] * devices,
        bandwidth=[[50e9] * devices for _ in range(devices)],
        latency=[[1e-5] * devices for _ in range(devices)],
        widths=(1, 2, 4),
        splits=("batch", "channel"),
        shard=["split", "split", "full", "split"],
        channels=[64, 64, 0, 4096],
        param_bytes=[mb, mb, 0, 400 * mb],
        batch=8,
    )


def test_colocated_stages_by_hand() -> None:
    # a (split) -> b (split); both stages on devices 0 and 1: a by batch, b by channel
    pb = PartitionProblem(
        names=["a", "b"],
        compute=[[8.0] * 3, [2.0] * 3],
        resident=[100, 4000],
        activation=[40, 20],
        out_bytes=[1000, 10],
        edges=[(0, 1)],
        devices=["d0", "d1", "d2"],
        mem_cap=[10**6] * 3,
        bandwidth=[[1000.0] * 3 for _ in range(3)],
        latency=[[0.0] * 3 for _ in range(3)],
        widths=(1, 2),
        splits=("batch", "channel"),
        shard=["split", "split"],
        channels=[64, 4],
        param_bytes=[400, 4000],
        batch=8,
    )
    pair = (0, 1)
    groups = [StageGroup(pair, "batch"), StageGroup(pair, "channel")]
    assert not check(pb, [0, 1], [0, 0], groups)
    ev = evaluate(pb, [0, 1], [0, 0], groups)
    assert ev.stage_compute == [4.0, 1.0]  # half a batch of a, half the channels of b
    gather = 0.5 * 1000 / 1000  # a's halves gathered on the leader, each way
    ring = 2 * 0.5 * 400 / 1000  # a's gradients all-reduced (b's are sharded, not reduced)
    bcast = 0.5 * 1000 / 1000  # the whole a broadcast to b's shards, each way
    assert ev.stage_collective == pytest.approx([2 * gather + ring, 2 * bcast])
    # a reaches stage 1 on the same leader: the transfer is recorded (an ordering) and free
    assert [(u, j, k, t) for u, j, k, t in ev.transfers] == [(0, 0, 1, 0.0)]
    assert ev.stage_time == pytest.approx([4.0 + 1.4, 1.0 + 1.0])
    # both devices serve both stages: the bottleneck is their sum, not the larger stage
    assert ev.device_time == pytest.approx([7.4, 7.4, 0.0])
    assert ev.bottleneck == pytest.approx(7.4)
    # memory: a whole + half its activation; b's half weights and activation; no receive
    # buffer on the leader (a is read in place), none on the other shard either
    assert ev.device_memory == [100 + 20 + 2000 + 10, 100 + 20 + 2000 + 10, 0]


def test_only_consecutive_identical_groups_share_devices() -> None:
    pb = _conv_head()
    both = StageGroup((0, 1), "batch")
    ok = [both, StageGroup((0, 1), "channel"), StageGroup((2,))]
    assert not check(pb, [0, 0, 1, 2], [0, 0, 2], ok)
    subset = [both, StageGroup((0,))]
    assert any("in stages 0 and 1" in e for e in check(pb, [0, 0, 1, 1], [0, 0], subset))
    apart = [both, StageGroup((2,)), StageGroup((0, 1), "channel")]
    assert any("in stages 0 and 2" in e for e in check(pb, [0, 0, 1, 2], [0, 2, 0], apart))
    single = [StageGroup((0,)), StageGroup((0,))]
    assert any("in stages 0 and 1" in e for e in check(pb, [0, 0, 1, 1], [0, 0], single))
    assert any("twice" in e for e in check(pb, [0, 0, 1, 1], [0, 0]))  # pipelines never share


def test_group_dp_finds_the_colocated_classifier() -> None:
    # Krizhevsky's trick: convolutions by batch on all 4 devices, then the classifier by
    # channel on the same 4 (data parallelism would all-reduce 400 MB of its gradients)
    pb = _conv_head()
    brute = brute_force_groups(pb)
    assert brute.groups is not None and brute.groups[-1].devices == brute.groups[-2].devices
    found = cross_dp(pb)
    assert found is not None
    stage_of, groups = found
    obj = evaluate(pb, stage_of, [g.leader for g in groups], groups).objective
    assert obj == pytest.approx(brute.objective, rel=1e-9)
    assert [(g.width, g.split) for g in groups] == [(4, "batch"), (4, "channel")]
    dp = data_parallel(pb)
    assert dp is not None
    assert obj < 0.5 * evaluate(pb, dp[0], [g.leader for g in dp[1]], dp[1]).objective
    assert obj >= lower_bound(pb)


def test_colocate_false_gives_one_stage_per_device() -> None:
    # the distributed runtime runs one stage per rank: with colocate=False the DP must
    # find another layout for the same problem, no better than the co-located one
    pb = _conv_head()
    with_tail = cross_dp(pb)
    without = cross_dp(pb, colocate=False)
    assert with_tail is not None and without is not None
    devices = [d for g in without[1] for d in g.devices]
    assert len(devices) == len(set(devices))
    obj = {
        name: evaluate(pb, so, [g.leader for g in gs], gs).objective
        for name, (so, gs) in (("tail", with_tail), ("none", without))
    }
    assert obj["tail"] < obj["none"]


@pytest.mark.parametrize("seed", range(6))
def test_group_dp_matches_brute_force_with_heavy_tails(seed: int) -> None:
    # chains whose last nodes hold most parameters: the co-located tail is often optimal
    rng = random.Random(200 + seed)
    pb = make(rng, rng.randint(4, 6), chain=True, microbatches=rng.choice([1, 2]))
    heavy = [0] * (pb.n - 2) + [rng.randint(512, 2048) * (1 << 20)] * 2
    pb = dataclasses.replace(pb, param_bytes=heavy, shard=[*pb.shard[:-1], "split"])
    brute = brute_force_groups(pb)
    found = cross_dp(pb)
    assert found is not None
    stage_of, groups = found
    obj = evaluate(pb, stage_of, [g.leader for g in groups], groups).objective
    assert obj == pytest.approx(brute.objective, rel=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_batch_split_stages_never_hand_on_values_that_are_not_batch_major(seed: int) -> None:
    """A ``x.size(0)`` or a batch mean leaving a batch-split stage would be each share's
    own (codegen refuses it): the DP respects it and still finds brute force's optimum."""
    rng = random.Random(300 + seed)
    pb = make(rng, rng.randint(4, 6), chain=seed % 2 == 0, microbatches=1)
    pb = dataclasses.replace(
        pb,
        splits=("batch",),
        batch=8,
        batch_major=[rng.random() < 0.6 for _ in range(pb.n)],
    )
    brute = brute_force_groups(pb)
    stage_of, groups, leaders = _checked_dp(pb)
    for k, g in enumerate(groups):
        if g.split == "batch":
            assert batch_split_exports(pb, stage_of, k) == []
    if seed % 2 == 0:  # chains: the DP's space is brute force's
        assert evaluate(pb, stage_of, leaders, groups).objective == pytest.approx(
            brute.objective, rel=1e-9
        )


def test_check_names_a_shape_leaving_a_batch_split_stage() -> None:
    pb = dataclasses.replace(
        make(random.Random(1), 4, chain=True),
        batch=8,
        splits=("batch",),
        batch_major=[True, False, True, True],  # n1 is a size read by n2
    )
    groups = [StageGroup((0, 1), "batch"), StageGroup((2,))]
    errors = check(pb, [0, 0, 1, 1], [0, 2], groups)
    assert any("hands on 'n1'" in e for e in errors), errors
    # the same cut after the reader, or the stage on one device, is fine
    assert not check(pb, [0, 0, 0, 1], [0, 2], groups)
    assert not check(pb, [0, 0, 1, 1], [0, 2], [StageGroup((0,)), StageGroup((2,))])
