"""A value of several tensors crosses a cut as several messages, and is priced so.

Why: the torchrun runtime (``runtime/dist/stage_io.py``) sends each tensor leaf
of a value as its own message, and a gradient's leaves back the same way plus a
mask message. A plan that priced such a value as one message would cut there
too readily. These tests hold the count the planner reads
(``PlanNode.messages``, from ``OpNode.shapes``) to the leaves the runtime
posts, and the count to the plan file and the price.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crosscut.codegen import build_stages
from crosscut.frontend.tracer import trace
from crosscut.ir.plan import Plan, PlanCluster, PlanDevice, PlanOptions
from crosscut.partitioner.build import (
    plan_nodes,
    plan_to_problem,
    problem_from_parts,
    value_messages,
)
from crosscut.partitioner.evaluate import evaluate
from crosscut.runtime.dist.p2p import build_routes
from tests.plan_factory import make_plan


class Split(nn.Module):
    """ShuffleNet's channel split in miniature: ``chunk`` makes one value of three
    tensors; the list ``torch.cat`` reads is one value per producing node."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 1)
        self.a = nn.Conv2d(2, 2, 3, padding=1)
        self.b = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(self.stem(x), 3, dim=1)
        feats = [self.a(parts[0]), self.b(parts[1])]
        return torch.cat([*feats, parts[2]], 1)


class _Flat:
    """A cost table where every node costs the same: only the structure is under test."""

    def fwd_s(self, name: str, kind: str) -> float:
        return 1e-3

    def bwd_s(self, name: str, kind: str) -> float:
        return 2e-3

    def bwd_split(self, name: str, kind: str) -> tuple[float, float] | None:
        return None

    def memory_rate(self, kind: str) -> float | None:
        return None

    def resident_bytes(self, name: str) -> int:
        return 0

    def activation_bytes(self, name: str) -> int:
        return 0

    def batch_scale(self, name: str) -> dict[str, dict[str, float]]:
        return {}

    def channel_share_scale(self, name: str) -> dict[str, dict[str, float]]:
        return {}


def test_a_tuple_value_is_priced_as_the_messages_the_runtime_posts() -> None:
    graph = trace(Split(), torch.randn(2, 3, 8, 8))
    by_name = {n.name: n for n in graph.nodes}
    assert value_messages(by_name["chunk"]) == 3  # the tuple: three tensors
    assert {value_messages(n) for n in graph.nodes if n.name != "chunk"} == {1}
    cluster = PlanCluster(
        [PlanDevice(f"d{i}", "cpu", "cpu", 1 << 30) for i in range(2)],
        [[1e9] * 2 for _ in range(2)],
        [[1e-3] * 2 for _ in range(2)],
    )
    nodes = plan_nodes(graph, _Flat(), ["cpu"])
    problem = problem_from_parts(nodes, cluster, PlanOptions(), training=True)
    count = dict(zip(problem.names, problem.messages))
    assert count["chunk"] == 3 and count["a"] == 1
    # the runtime's side: cut after the chunk and a's conv; the tuple crosses, and so
    # does a's output, and each edge posts as many leaves as the problem counts
    compute = [n.name for n in graph.gm.graph.nodes if n.op not in ("placeholder", "output")]
    first = {"stem", "chunk", "getitem", "a"}
    assert first <= set(compute)
    program = build_stages(graph.gm, {n: int(n not in first) for n in compute}, ["cpu"] * 2)
    routes = build_routes(
        graph.gm,
        [list(s.inputs) for s in program.stages],
        dict(program.output_sources),
        program.aliases,
    )
    crossing = {}
    for e in routes.edges:
        value = program.aliases.get(e.value, e.value)
        crossing[value] = len(routes.tensor_leaves(e.value))
        assert len(routes.grad_leaves(e.value)) == count[value]  # backward: one per leaf
    assert crossing == {"chunk": 3, "a": 1}
    assert crossing == {v: count[v] for v in crossing}


def test_the_count_survives_the_plan_file_and_prices_each_message() -> None:
    plan = make_plan(n_nodes=40, n_devices=2, cross_shaped=False)
    sent = plan.transfers[0].tensor
    problem, stage_of, stage_device = plan_to_problem(plan)
    before = evaluate(problem, stage_of, stage_device)
    for node in plan.nodes:
        if node.name == sent:
            node.messages = 4
    data = plan.to_dict()
    again = Plan.from_dict(data)
    assert next(n.messages for n in again.nodes if n.name == sent) == 4
    problem, stage_of, stage_device = plan_to_problem(again)
    assert problem.messages[problem.names.index(sent)] == 4
    after = evaluate(problem, stage_of, stage_device)
    # three more messages each way (training): 2 * 3 latencies on sender and receiver
    lat = plan.cluster.latency[0][1]
    extra = [a - b for a, b in zip(after.stage_comm, before.stage_comm)]
    assert extra == pytest.approx([2 * 3 * lat, 2 * 3 * lat])
    # a plan written before messages were counted reads as one message per value
    for node in data["nodes"]:
        node.pop("messages")
    old = Plan.from_dict(data)
    assert {n.messages for n in old.nodes} == {1}
