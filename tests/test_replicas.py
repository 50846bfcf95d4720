"""Replicas chosen by the planner on clusters of nodes (issue 16): layouts, all-reduce, scale.

The planner's rule (crosscut/strategy.py, partitioner/replicas.py):
every device is used (replicas × devices per replica = nodes × devices per
node), stages stay inside a node (or a replica spans whole nodes:
tests/test_node_spanning.py), the gradient all-reduce is the cheaper of a
ring and a 2-D reduction, and the layout with the shortest step wins, each
with the micro-batch count that gives it the shortest step.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torchvision

import crosscut
from crosscut.cost_models.cluster import Cluster
from crosscut.errors import InputError
from crosscut.ir.plan import Plan
from crosscut.layouts import microbatch_candidates
from crosscut.partitioner.replicas import (
    NCCL_BASE_S,
    NCCL_NET_HOP_S,
    NCCL_NODE_HOP_S,
    NCCL_TREE_BW,
    layouts,
    reduction,
    stage_gradient_bytes,
)
from crosscut.partitioner.simulate import simulate
from crosscut.partitioner.validate import validate_plan
from tests.plan_factory import make_plan


def test_layouts_keep_stages_inside_a_node() -> None:
    assert layouts(8, 32) == [(1, 256), (2, 128), (4, 64), (8, 32)]
    assert layouts(6, 2) == [(1, 12), (2, 6), (3, 4), (6, 2)]
    assert all(d * r == 8 * 32 for d, r in layouts(8, 32))


def _priced(nodes: int, per_node_link: tuple[float, float], net: tuple[float, float]) -> Plan:
    plan = make_plan(30, 2, cross_shaped=False)
    plan.cluster.nodes = nodes
    plan.cluster.network = list(net)
    plan.cluster.node_link = list(per_node_link)
    return plan


def test_ring_tree_and_2d_follow_their_formulas() -> None:
    link, net = (100e9, 2e-6), (10e9, 5e-6)
    plan = _priced(4, link, net)
    grads = [4_000_000, 6_000_000]
    total = sum(grads)
    # 4 nodes, 2 replicas per node = 8 replicas; position k gets G_k / G of the NIC
    got = reduction(plan, 8, grads)

    def worst(alpha: float, beta_node: float, beta_net: float) -> float:
        return max(alpha + max(beta_node, beta_net * total / g) * g for g in grads)

    # NCCL's latency terms: a base per call, per-step floors inside a node and between nodes
    base, h_node, h_net = NCCL_BASE_S, NCCL_NODE_HOP_S, max(net[1], NCCL_NET_HOP_S)
    ring = worst(base + 2 * 3 * h_net + 2 * 4 * h_node, 2 * 7 / 8 / link[0], 2 * 7 / 8 / net[0])
    tree = worst(
        base + 2 * (2 * h_net + 1 * h_node),
        2 * 1 / 2 / link[0] / NCCL_TREE_BW,
        2 / net[0] / NCCL_TREE_BW,
    )
    two_d = max(
        3 * base
        + 2 * 1 * h_node
        + 2 * 3 * h_net
        + (1 / link[0] + 2 * 3 / 4 / net[0] * total / g) * g
        for g in grads
    )
    assert got.seconds == pytest.approx(min(ring, tree, two_d))
    assert (
        got.algorithm == min(("ring", ring), ("tree", tree), ("2d", two_d), key=lambda x: x[1])[0]
    )
    # two NICs per node halve the network terms
    plan.cluster.nics = 2
    assert reduction(plan, 8, grads).seconds < got.seconds
    plan.cluster.nics = 1
    # one replica per node: nothing to do inside a node
    one = reduction(plan, 4, grads)
    assert one.algorithm in ("ring", "tree") and "2d" not in one.algorithm
    ring1 = max(base + 2 * 3 * h_net + 2 * 3 / 4 / net[0] * total for _ in grads)
    assert one.seconds <= ring1 + 1e-12
    assert reduction(plan, 1, grads).seconds == 0.0
    # gradients reduced in 16 bits move half the bytes
    half = reduction(plan, 8, grad_bytes=2.0)
    assert half.seconds <= reduction(plan, 8).seconds
    # a run that used one algorithm is priced with it; one that cannot apply is refused
    assert reduction(plan, 8, grads, algorithms=["ring"]).seconds == pytest.approx(ring)
    with pytest.raises(InputError, match="algorithm"):
        reduction(plan, 4, grads, algorithms=["2d"])


def test_many_nodes_prefer_a_logarithmic_latency() -> None:
    plan = _priced(32, (50e9, 5e-6), (12.5e9, 5e-6))
    grads = stage_gradient_bytes(plan)
    assert sum(grads) == sum(n.param_bytes for n in plan.nodes if n.name in plan.assignment)
    # 8 per node, 32 nodes, small buckets: the ring's 2(N-1) network hops lose
    assert reduction(plan, 256, [1_000_000, 1_000_000]).algorithm in ("tree", "2d")


@pytest.fixture(scope="module")
def resnet50_on_256() -> tuple[Plan, float]:
    model = torchvision.models.resnet50(weights=None)
    x = torch.empty(8192, 3, 224, 224, device="meta")  # the global batch is never allocated
    t0 = time.perf_counter()
    plan = crosscut.partition(model, "32x8xV100", x, time_limit=20)
    return plan, time.perf_counter() - t0


def test_resnet50_uses_all_256_gpus_and_scales(resnet50_on_256: tuple[Plan, float]) -> None:
    """Issue 16: global batch 8192 on 32x8xV100 with default options."""
    plan, wall = resnet50_on_256
    used = plan.replication.replicas * len(plan.used_devices())
    assert used == 256 and plan.cluster.nodes == 32
    assert plan.model.batch_size * plan.replication.replicas == 8192
    assert wall < 20 * 1.1 + 10  # its time limit, plus tracing four layouts
    one = crosscut.partition(
        torchvision.models.resnet50(weights=None),
        "1xV100",
        torch.empty(32, 3, 224, 224, device="meta"),
    )
    # scaling efficiency against 256 independent GPUs at batch 32
    efficiency = one.predicted.step_time_s / plan.predicted.step_time_s
    assert 0.7 < efficiency <= 1.0, efficiency
    assert plan.predicted.throughput == pytest.approx(8192 / plan.predicted.step_time_s)
    chosen = [a for a in plan.strategy.alternatives if a.outcome == "chosen"]
    assert len(chosen) == 1 and chosen[0].replicas == plan.replication.replicas


def test_the_simulated_step_includes_the_all_reduce(resnet50_on_256: tuple[Plan, float]) -> None:
    plan, _ = resnet50_on_256
    sim = simulate(plan)
    reduce = [e for e in sim.events if e.kind == "R"]
    # each stage's reduction starts with its last backward and overlaps it: it lasts at
    # least its time on the wire, and the step waits only for what is left (exposed_s)
    assert reduce and all(
        e.end - e.start >= plan.replication.allreduce_s * (1 - 1e-9) for e in reduce
    )
    last_b = max(e.end for e in sim.events if e.kind == "B")
    assert max(e.end for e in reduce) - last_b == pytest.approx(sim.exposed_s, abs=1e-9)
    assert sim.step_time_s >= max(e.end for e in sim.events)
    assert plan.replication.allreduce_s > 0
    assert plan.replication.reduction in ("ring", "tree", "2d")
    validate_plan(plan)


def test_replication_round_trips(resnet50_on_256: tuple[Plan, float], tmp_path: Path) -> None:
    plan, _ = resnet50_on_256
    back = Plan.load(plan.save(tmp_path / "p.json"))
    assert back.replication == plan.replication and back.cluster.nodes == 32
    assert back.cluster.node_link == plan.cluster.node_link


def test_2048_gpus_plan_within_a_minute() -> None:
    model = torchvision.models.resnet50(weights=None)
    t0 = time.perf_counter()
    plan = crosscut.partition(
        model, "256x8xV100", torch.empty(65536, 3, 224, 224, device="meta"), time_limit=30
    )
    assert time.perf_counter() - t0 < 60
    assert plan.replication.replicas * len(plan.used_devices()) == 2048


def test_weights_too_big_for_one_device_make_a_pipeline() -> None:
    """Two 1.6 GB layers (6.4 GB with gradients) cannot be replicated per 4.8 GB K20c: the
    planner pipelines them over devices of a node, and says which layouts did not fit."""
    with torch.device("meta"):  # nothing of the 3.2 GB of weights is allocated
        model = torch.nn.Sequential(
            torch.nn.Linear(20_000, 20_000), torch.nn.ReLU(), torch.nn.Linear(20_000, 20_000)
        )
    x = torch.empty(64, 20_000, device="meta")
    plan = crosscut.partition(model, "2x4xK20c", x, time_limit=10)
    assert plan.replication.replicas * len(plan.used_devices()) == 8
    rows = plan.strategy.alternatives
    assert len(plan.used_devices()) >= 2, [a.text() for a in rows]
    assert any(a.data_parallel and a.outcome == "no fit" for a in rows), [a.text() for a in rows]
    caps = {d.name: d.mem_cap for d in plan.cluster.devices}
    assert all(peak <= caps[d] for d, peak in plan.predicted.device_peak_bytes.items())


def test_microbatch_candidates_are_a_ladder_of_divisors() -> None:
    assert microbatch_candidates(64) == [1, 2, 4, 8, 16, 32]  # MAX_MICROBATCHES = 32
    assert microbatch_candidates(24) == [1, 2, 4, 8, 24]
    assert microbatch_candidates(30) == [1, 2, 5, 10, 30]
    assert microbatch_candidates(7) == [1, 7]
    assert microbatch_candidates(1) == [1]
    assert microbatch_candidates(64, cap=8) == [1, 2, 4, 8]


def _two_big_layers(batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """Two 1.6 GB layers (6.4 GB with gradients): no 4.8 GB K20c holds the model alone."""
    with torch.device("meta"):  # nothing of the 3.2 GB of weights is allocated
        model = torch.nn.Sequential(
            torch.nn.Linear(20_000, 20_000), torch.nn.ReLU(), torch.nn.Linear(20_000, 20_000)
        )
    return model, torch.empty(batch, 20_000, device="meta")


@pytest.mark.timed
def test_the_planner_chooses_micro_batches_for_a_pipeline_layout() -> None:
    """Only pipelines fit, and a pipeline fed one micro-batch runs one stage at a time:
    left to the planner, the layout gets more micro-batches and a shorter step; a count
    the caller gives is kept; the whole search stays within the time limit."""
    model, x = _two_big_layers(2048)
    limit = 4.0
    t0 = time.perf_counter()
    chosen = crosscut.partition(model, "2x2xK20c+ib400", x, time_limit=limit)
    wall = time.perf_counter() - t0
    assert wall <= limit * 1.1 + 0.75, wall
    one = crosscut.partition(model, "2x2xK20c+ib400", x, time_limit=limit, microbatches=1)
    rows = chosen.strategy.alternatives
    assert chosen.num_stages == len(chosen.used_devices()) == 2, [a.text() for a in rows]
    assert chosen.options.microbatches > 1 and one.options.microbatches == 1
    assert chosen.predicted.step_time_s < one.predicted.step_time_s
    assert chosen.model.batch_size == 2048 // chosen.replication.replicas
    same = [a for a in rows if a.devices == 2 and a.step_time_s > 0]
    assert {1, chosen.options.microbatches} <= {a.microbatches for a in same}
    assert [a.outcome for a in same if a.microbatches == chosen.options.microbatches] == ["chosen"]
    fixed = crosscut.partition(model, "2x2xK20c+ib400", x, time_limit=limit, microbatches=2)
    assert fixed.options.microbatches == 2
    # the given count alone is tried
    assert {a.microbatches for a in fixed.strategy.alternatives} == {2}
    validate_plan(chosen)


def test_a_micro_batch_the_model_refuses_skips_that_count_only() -> None:
    """Batch norm refuses a micro-batch of one sample in training: the layouts whose
    share comes to one sample are skipped (named in the notes), the others planned; a
    model that refuses every layout's inputs raises its own error."""
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
    )  # fmt: skip
    x = torch.randn(4, 3, 5, 5)  # the second batch norm sees 1x1 maps: one value a sample
    plan = crosscut.partition(model, "2x2xcpu", x, time_limit=4)
    rows = {(a.replicas, a.microbatches): a for a in plan.strategy.alternatives}
    why = "the model rejects a micro-batch of 1"
    assert rows[(4, 1)].outcome == "refused" and rows[(4, 1)].reason == why, rows
    assert rows[(2, 2)].outcome == "refused" and rows[(2, 2)].reason == why, rows
    assert plan.model.batch_size // plan.options.microbatches >= 2
    with pytest.raises(InputError, match="rejected the example inputs"):
        crosscut.partition(model, "2x2xcpu", torch.randn(4, 5, 5, 5), time_limit=4)


def test_a_graph_cannot_be_planned_on_several_nodes() -> None:
    graph = crosscut.trace(torchvision.models.resnet18(weights=None), torch.randn(2, 3, 32, 32))
    with pytest.raises(InputError, match="planned from the model"):
        crosscut.partition(graph, Cluster.from_spec("2x2xV100"))


def test_compile_refuses_a_multi_node_cluster_with_the_way_to_run_it() -> None:
    with pytest.raises(InputError, match="crosscut run"):
        crosscut.compile(
            torchvision.models.resnet18(weights=None), "2x2xV100", torch.randn(8, 3, 32, 32)
        )


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_two_nodes_run_the_plans_replicas_with_stages_inside_a_node(tmp_path: Path) -> None:
    """Issue 16: 2 torchrun node groups on 127.0.0.1, 2 ranks each, started by
    `crosscut run --nnodes 2` from a plan of 2 replicas × 2 stages: replica r is the
    ranks of node r (its stages share a node), and training equals eager's."""
    import tests.test_distributed as td

    x, _ = td.batch(8, 32)
    plan = crosscut.partition(
        td.build("resnet18"),
        ["cpu", "cpu"],
        x[:4],
        microbatches=2,
        schedule="1f1b",
        require_all_devices=True,
        time_limit=5,
    )
    plan.replication.replicas = 2  # as the strategy search records it for a 2x2 cluster
    plan.cluster.nodes = 2
    plan.cluster.network = [1.25e9, 30e-6]
    path = plan.save(tmp_path / "plan.json")
    script = ["--replicas", "2", "--schedules", "1f1b", "--microbatches", "2"]
    td.run_node_groups(path, tmp_path, script)
    got = td.merged(tmp_path, "resnet18_1f1b", 4, 2)
    assert len(got["losses"]) == 2  # each replica's last stage reports the global loss
    td.compare(got, td.eager("resnet18", 8, 32, 4), buffers=False)
