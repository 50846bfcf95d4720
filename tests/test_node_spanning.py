"""Replicas that span whole nodes (issue 16: "replicas mapped across nodes and stages
inside a node where that is cheaper").

A layout may put one replica's pipeline on ``k`` whole nodes (``d = k × g``
devices, ``R = nodes / k`` replicas), its devices priced as
``Cluster.transfer_time`` prices them (a node's links inside, the network
between nodes; crosscut/strategy.py ``replica_cluster``), and its
all-reduce as a ring over the replicas in which each node ships the gradients
of its own stages (crosscut/partitioner/replicas.py). The planner takes it
where only it fits the memory caps or where it is faster.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

import crosscut
from crosscut.cli.launch import build_command, parse_args
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.subclusters import replica_cluster
from crosscut.ir.plan import Plan
from crosscut.partitioner.replicas import (
    NCCL_BASE_S,
    NCCL_NET_HOP_S,
    reduction,
    replica_span,
    runs_in_rank_order,
    spanning_layouts,
    stage_nodes,
)
from crosscut.partitioner.validate import validate_plan
from crosscut.runtime.dist.world import RankLayout
from tests.plan_factory import make_plan


def _linears(n: int, width: int) -> torch.nn.Module:
    """``n`` square layers of ``width`` on the meta device (nothing allocated)."""
    with torch.device("meta"):
        layers: list[torch.nn.Module] = []
        for i in range(n):
            layers += [torch.nn.Linear(width, width)] + ([torch.nn.ReLU()] if i < n - 1 else [])
        return torch.nn.Sequential(*layers)


def test_spanning_layouts_are_whole_nodes_up_to_16_devices() -> None:
    assert spanning_layouts(2, 4) == [(4, 2), (8, 1)]
    assert spanning_layouts(1, 6) == [(2, 3), (3, 2), (6, 1)]
    assert spanning_layouts(8, 32) == [(16, 16)]  # 32 devices: too long a pipeline
    assert spanning_layouts(8, 1) == []


def test_a_replica_cluster_prices_its_pairs_like_the_cluster() -> None:
    cluster = Cluster.from_spec("4x4xK20c+eth25")
    rc = replica_cluster(cluster, 8)  # two whole nodes
    assert rc.nodes == 1 and len(rc) == 8
    assert rc.names[:5] == ["n0.gpu0", "n0.gpu1", "n0.gpu2", "n0.gpu3", "n1.gpu0"]
    for a in range(8):
        for b in range(8):
            assert rc.transfer_time(a, b, 10**6) == pytest.approx(
                cluster.transfer_time(a, b, 10**6)
            )
    assert rc.bandwidth[3][4] == cluster.network[0]  # across the two nodes: the network
    assert rc.bandwidth[0][1] == cluster.bandwidth[0][1]  # inside a node: its PCIe switch
    assert replica_cluster(cluster, 2).names == ["gpu0", "gpu1"]  # inside a node, as before


def test_a_spanning_replica_all_reduces_each_nodes_own_gradients_over_the_network() -> None:
    plan = make_plan(30, 4, cross_shaped=False)  # 4 stages on 4 devices
    plan.cluster.nodes = 4  # 2 replicas of 2 nodes of 2 devices each
    net = (10e9, 5e-6)
    plan.cluster.network = list(net)
    assert replica_span(plan, 2) == 2 and replica_span(plan, 4) == 1
    assert stage_nodes(plan, 2) == [0, 0, 1, 1]
    grads = [1_000_000, 2_000_000, 4_000_000, 8_000_000]
    got = reduction(plan, 2, grads)
    on_node = max(1_000_000 + 2_000_000, 4_000_000 + 8_000_000)
    assert got.algorithm == "ring"
    # NCCL's latency: a base per call, 2(N-1) steps between nodes at its per-step floor
    alpha = NCCL_BASE_S + 2 * 1 * max(net[1], NCCL_NET_HOP_S)
    assert got.seconds == pytest.approx(2 * 1 / 2 * on_node / net[0] + alpha)


def test_a_plan_across_nodes_out_of_rank_order_is_recognised() -> None:
    plan = make_plan(30, 4, cross_shaped=False)
    assert runs_in_rank_order(plan, 2)
    plan.stages[1].devices, plan.stages[2].devices = plan.stages[2].devices, plan.stages[1].devices
    assert stage_nodes(plan, 2) == [0, 1, 0, 1]
    assert not runs_in_rank_order(plan, 2)


def test_a_group_across_nodes_is_moved_to_its_ranks() -> None:
    """The solver may put a split group on one device of each node (its device order is
    its own); torchrun gives a group the next ranks in order, so the planner moves it
    there and re-prices, instead of refusing the layout. vgg11 on 2 nodes of 2 CPU ranks
    was refused so once gloo priced a node's own links."""
    from crosscut.partitioner.annotate import annotate, in_rank_order

    plan = make_plan(30, 4)  # stages on gpu0, a channel group gpu1+gpu2, gpu3
    assert [s.devices for s in plan.stages] == [["gpu0"], ["gpu1", "gpu2"], ["gpu3"]]
    data = plan.to_dict()
    for stage, devices in zip(data["stages"], [["gpu2"], ["gpu0", "gpu3"], ["gpu1"]]):
        stage["devices"] = devices
    crossed = annotate(Plan.from_dict(data))
    assert not runs_in_rank_order(crossed, 2)  # two nodes of two: stage 0 is on node 1
    moved = in_rank_order(crossed)
    assert [s.devices for s in moved.stages] == [["gpu0"], ["gpu1", "gpu2"], ["gpu3"]]
    assert [s.split for s in moved.stages] == [s.split for s in plan.stages]
    assert runs_in_rank_order(moved, 2)
    assert moved.solver.notes[-1].startswith("stages moved")
    same = annotate(Plan.from_dict(plan.to_dict()))  # the devices as the factory laid them
    assert moved.predicted.step_time_s == pytest.approx(same.predicted.step_time_s)
    # co-located stages (one group, two stages) have no rank order: left as they are
    data["stages"][0]["devices"] = ["gpu0", "gpu3"]
    data["stages"][0]["split"] = "channel"
    shared = Plan.from_dict(data)
    assert [s.devices for s in in_rank_order(shared).stages] == [s.devices for s in shared.stages]


def _layout_steps(plan: Plan) -> dict[tuple[int, int], float]:
    """(replicas, devices) -> the layout's shortest predicted step, from the plan's strategy."""
    out: dict[tuple[int, int], float] = {}
    for a in plan.strategy.alternatives:
        if a.step_time_s > 0:
            key = (a.replicas, a.devices)
            out[key] = min(out.get(key, a.step_time_s), a.step_time_s)
    return out


def test_a_model_too_big_for_a_node_spans_two_nodes_with_network_transfers() -> None:
    """Four 1.6 GB layers (12.8 GB with gradients) on nodes of two 4.8 GB K20c (9.6 GB):
    no replica inside a node fits; one replica over both nodes does, and the activation
    that crosses between the nodes is priced at the network's speed (eth10)."""
    cluster = Cluster.from_spec("2x2xK20c")
    plan = crosscut.partition(
        _linears(4, 20_000), cluster, torch.empty(64, 20_000, device="meta"), time_limit=5
    )
    rows = plan.strategy.alternatives
    for layout in ((2, 2), (4, 1)):  # no micro-batch count made these fit
        tried = [a for a in rows if (a.replicas, a.devices) == layout]
        assert tried and all(a.outcome == "no fit" for a in tried), [a.text() for a in rows]
    assert plan.replication.replicas == 1 and plan.cluster.nodes == 2
    assert [s.devices for s in plan.stages] == [["n0.gpu0"], ["n0.gpu1"], ["n1.gpu0"], ["n1.gpu1"]]
    caps = {d.name: d.mem_cap for d in plan.cluster.devices}
    assert all(peak <= caps[d] for d, peak in plan.predicted.device_peak_bytes.items())
    index = {d.name: i for i, d in enumerate(plan.cluster.devices)}
    crossing = 0
    for t in plan.transfers:
        a, b = index[t.src_device], index[t.dst_device]
        # one tensor each way; training adds half the backward's mask message to each way
        half_mask = 0.5 * plan.cluster.latency[a][b]
        assert t.time_s == pytest.approx(cluster.transfer_time(a, b, t.bytes) + half_mask)
        if not cluster.same_node(a, b):
            crossing += 1
            assert t.time_s == pytest.approx(1.5 * 30e-6 + t.bytes / 1.25e9)  # eth10
    assert crossing == 1
    validate_plan(plan)
    # `crosscut run --nnodes 2` starts 2 ranks per node; replica 0's stage s is rank s
    ns = parse_args(["--plan", "p.json", "--nnodes", "2", "script.py"])
    ns.replicas, ns.log_dir = plan.replication.replicas, "logs"
    cmd = build_command(ns, plan.num_stages)
    per_node = int(cmd[cmd.index("--nproc-per-node") + 1])
    ranks = RankLayout(tuple(1 for _ in plan.stages), plan.replication.replicas)
    assert [ranks.rank(0, s) // per_node for s in range(4)] == stage_nodes(plan, 2)


def test_spanning_nodes_wins_where_gradients_cost_the_network_more() -> None:
    """Four 0.4 GB layers fit one node, but replicas inside nodes ship 1.6 GB of
    gradients over 10 GbE every step; one replica over both nodes ships none and
    sends a 1.3 MB activation across once per micro-batch: the planner takes it."""
    plan = crosscut.partition(
        _linears(4, 10_000), "2x2xK20c", torch.empty(64, 10_000, device="meta"), time_limit=5
    )
    steps = _layout_steps(plan)
    assert set(steps) == {(4, 1), (2, 2), (1, 4)}, [a.text() for a in plan.strategy.alternatives]
    assert plan.replication.replicas == 1 and len(plan.used_devices()) == 4
    assert plan.predicted.step_time_s == pytest.approx(steps[(1, 4)])
    assert steps[(1, 4)] < min(steps[(4, 1)], steps[(2, 2)]) / 10


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_two_node_groups_run_a_replica_spanning_both(tmp_path: Path) -> None:
    """A planner-made plan of 1 replica × 4 stages over 2 nodes of 2 CPU devices (caps
    too small for one node to hold resnet18), run by `crosscut run --nnodes 2` as 2
    torchrun node groups on 127.0.0.1: stages 0-1 on node 0, 2-3 on node 1, training
    equal to eager's."""
    import tests.test_distributed as td

    x, _ = td.batch(8, 32)
    base = Cluster.from_spec("2x2xcpu")
    small = [dataclasses.replace(d, mem_cap=40 * 10**6) for d in base.devices]
    cluster = dataclasses.replace(base, devices=small)  # 80 MB a node < resnet18's 94 MB
    plan = crosscut.partition(td.build("resnet18"), cluster, x, microbatches=2, time_limit=10)
    assert plan.replication.replicas == 1 and plan.num_stages == 4, plan.solver.notes[-1]
    assert stage_nodes(plan, 2) == [0, 0, 1, 1]
    path = plan.save(tmp_path / "plan.json")
    td.run_node_groups(path, tmp_path, ["--schedules", "1f1b", "--microbatches", "2"])
    got = td.merged(tmp_path, "resnet18_1f1b", 4, 4)
    assert len(got["losses"]) == 1  # one replica, its last stage reports the loss
    td.compare(got, td.eager("resnet18", 8, 32, 2), buffers=False)


def _spanning_group(plan: Plan) -> Plan:
    """``plan`` (stages on groups 2+1+1 over 2 nodes of 2) re-laid as 1+2+1: the middle
    stage a batch-split group of one device of each node, then re-priced."""
    from crosscut.partitioner.annotate import annotate

    data = plan.to_dict()
    layout = [(["n0.cpu0"], "none"), (["n0.cpu1", "n1.cpu0"], "batch"), (["n1.cpu1"], "none")]
    for stage, (devices, split) in zip(data["stages"], layout, strict=True):
        stage["devices"], stage["split"] = devices, split
    return annotate(Plan.from_dict(data))


def test_a_replica_spanning_nodes_may_put_stages_on_device_groups() -> None:
    """Groups were searched only inside one node: alexnet at batch 256 on two nodes of 4
    K20c was an 8-stage pipeline (213 ms a step). Its convolutions, light in parameters,
    now run on groups (one of them spanning both nodes) and its classifier on groups of
    its own: a quicker step, every device still holding a stage or a share."""
    import torchvision

    x = torch.empty(256, 3, 224, 224, device="meta")
    model = torchvision.models.alexnet(weights=None)
    flat = crosscut.partition(model, "2x4xK20c", x, replicas=1, cross_shaped=False, time_limit=20)
    plan = crosscut.partition(model, "2x4xK20c", x, replicas=1, time_limit=20)
    assert any(s.split == "batch" for s in plan.stages), [s.devices for s in plan.stages]
    assert plan.predicted.step_time_s < flat.predicted.step_time_s * 0.95
    held = [d for s in plan.stages for d in s.devices]
    assert sorted(held) == sorted(d.name for d in plan.cluster.devices)  # each device once
    assert runs_in_rank_order(plan, 2)
    validate_plan(plan)


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_two_node_groups_run_device_groups_of_a_spanning_replica(tmp_path: Path) -> None:
    """The planner's group plan for vgg11 on 2 nodes of 2 CPU devices (a batch-split group
    of node 0's two devices, then a stage on each device of node 1), and the same cuts
    with the group spanning both nodes, each run by `crosscut run --nnodes 2` as 2
    torchrun node groups on 127.0.0.1: loss, gradients and weights after an SGD step as
    eager training (vgg11 has no batch norm: shares compute what the whole batch does)."""
    import tests.test_distributed as td

    x, _ = td.batch(8, 64)
    plan = crosscut.partition(td.build("vgg11"), "2x2xcpu", x, replicas=1, microbatches=2,
                              time_limit=10)  # fmt: skip
    assert [(s.devices, s.split) for s in plan.stages] == [
        (["n0.cpu0", "n0.cpu1"], "batch"), (["n1.cpu0"], "none"), (["n1.cpu1"], "none")
    ], plan.solver.notes  # fmt: skip
    spanning = _spanning_group(plan)
    assert runs_in_rank_order(spanning, 2)
    want = td.eager("vgg11", 8, 64, 2)
    for label, p in (("planned", plan), ("spanning", spanning)):
        out = tmp_path / label
        path = p.save(tmp_path / f"{label}.json")
        td.run_node_groups(path, out, ["--models", "vgg11", "--batch", "8", "--size", "64",
                                       "--schedules", "1f1b", "--microbatches", "2"])  # fmt: skip
        got = td.merged(out, "vgg11_1f1b", 4, 4)  # group members hold the same weights
        assert len(got["losses"]) == 1
        td.compare(got, want, buffers=False)
        shutil.rmtree(out)  # 4 ranks' vgg11 gradients and weights: ~1.4 GB a run
