"""A fanned-out value is priced as codegen sends it: once per remote reader, where aliased.

Why: ``codegen/fanout.py`` gives each reader of a value with three or more
autograd readers its own alias once a cut breaks eager's gradient order, and
each remote reader's alias is its own transfer. The cost model priced one per
(value, stage), so interleaved re-cuts of densenet121 looked 4x cheaper in
transfers than they ran. These tests hold ``evaluate``'s transfers to the
edges ``build_stages`` makes, on hand-made cuts and on densenet121's re-cuts,
and the per-node record (``PlanNode.fanout``) to the plan file.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
import torchvision
from torch import nn

import crosscut
from crosscut.codegen import build_stages
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph
from crosscut.ir.plan import Plan, PlanCluster, PlanDevice, PlanOptions
from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.build import plan_nodes, plan_to_problem, problem_from_parts
from crosscut.partitioner.coarsen import coarsen, expand_assignment
from crosscut.partitioner.evaluate import evaluate
from crosscut.partitioner.interleave import interleave
from crosscut.partitioner.partition import _coarse_nodes
from tests.test_messages import _Flat


class Three(nn.Module):
    """One tensor read by three convolutions, joined by a ``cat``."""

    def __init__(self, through: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.a = nn.Conv2d(4, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(4, 4, 1)
        self.keep = nn.Identity() if through else None  # hands its input through: no reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.tanh(self.stem(x))
        w = self.keep(v) if self.keep is not None else v
        return torch.cat([self.a(w), self.b(w), self.c(w)], 1)


def _cluster(n: int) -> PlanCluster:
    return PlanCluster(
        [PlanDevice(f"d{i}", "cpu", "cpu", 1 << 30) for i in range(n)],
        [[1e9] * n for _ in range(n)],
        [[1e-3] * n for _ in range(n)],
    )


def _problem(graph: OpGraph) -> PartitionProblem:
    return problem_from_parts(
        plan_nodes(graph, _Flat(), ["cpu"]), _cluster(3), PlanOptions(), training=True
    )


def _priced(
    problem: PartitionProblem, stage_of: dict[str, int], stages: int
) -> Counter[tuple[str, int]]:
    ev = evaluate(problem, [stage_of[n] for n in problem.names], list(range(stages)))
    return Counter((problem.names[u], k) for u, _, k, _ in ev.transfers)


def _sent(graph: OpGraph, stage_of: dict[str, int], stages: int) -> Counter[tuple[str, int]]:
    """(value, destination stage) per edge codegen makes, an alias counted as its value."""
    program = build_stages(graph.gm, stage_of, ["cpu"] * stages)
    return Counter(
        (program.aliases.get(t.value, t.value), t.dst_stage)
        for t in program.transfers
        if t.src_stage >= 0 and t.dst_stage >= 0  # the model's inputs and outputs aside
    )


def test_readers_cut_out_of_eager_order_are_priced_one_transfer_each() -> None:
    """``a`` and ``c`` on stage 1, ``b`` between them on stage 0: stage 1's subtotal
    would not be eager's first partial sum, so codegen aliases every reader and stage 1
    receives ``tanh`` twice; the problem prices both."""
    graph = trace(Three(), torch.randn(2, 3, 4, 4))
    problem = _problem(graph)
    v = problem.names.index("tanh")
    reads = [(problem.names[r], problem.names[p]) for r, p in problem.fanout[v]]
    assert reads == [("a", "tanh"), ("b", "tanh"), ("c", "tanh")]  # program order
    assert len(problem.fanout) == 1
    stage_of = {n: int(n in {"a", "c", "cat"}) for n in problem.names}
    priced = _priced(problem, stage_of, 2)
    assert priced[("tanh", 1)] == 2
    assert priced == _sent(graph, stage_of, 2)


def test_readers_cut_in_eager_order_keep_one_transfer() -> None:
    """``b`` and ``c`` on stage 1 come last: the pipeline sums in eager's order, codegen
    makes no alias, and the problem prices ``tanh`` once to stage 1."""
    graph = trace(Three(), torch.randn(2, 3, 4, 4))
    problem = _problem(graph)
    stage_of = {n: int(n in {"b", "c", "cat"}) for n in problem.names}
    priced = _priced(problem, stage_of, 2)
    assert priced[("tanh", 1)] == 1
    assert priced == _sent(graph, stage_of, 2)


def test_readers_through_an_identity_are_priced_where_codegen_sends_them() -> None:
    """An ``nn.Identity`` returns ``tanh`` itself: its readers are ``tanh``'s, and they
    read aliases of ``tanh`` once aliased. On the traced nodes, and on the coarse nodes
    the solver sees (tanh and the identity merged), the price is codegen's count."""
    graph = trace(Three(through=True), torch.randn(2, 3, 4, 4))
    problem = _problem(graph)
    v = problem.names.index("tanh")
    reads = [(problem.names[r], problem.names[p]) for r, p in problem.fanout[v]]
    assert reads == [("a", "keep"), ("b", "keep"), ("c", "keep")]
    for late in ({"a", "c", "cat"}, {"b", "c", "cat"}):
        stage_of = {n: int(n in late) for n in problem.names}
        assert _priced(problem, stage_of, 2) == _sent(graph, stage_of, 2), late
    # the identity on a stage of its own readers' (1), a and c after it (2): it still
    # reads tanh (codegen leaves it, unread), and each reader reads its own alias
    stage_of = {n: {"keep": 1, "b": 1, "a": 2, "c": 2, "cat": 2}.get(n, 0) for n in problem.names}
    priced = _priced(problem, stage_of, 3)
    assert priced[("tanh", 1)] == 2 and priced[("tanh", 2)] == 2
    assert priced == _sent(graph, stage_of, 3)
    coarse, members = coarsen(graph)
    fine = {n.name: n for n in plan_nodes(graph, _Flat(), ["cpu"])}
    nodes = _coarse_nodes(coarse, members, fine)
    small = problem_from_parts(nodes, _cluster(2), PlanOptions(), training=True)
    assert len(small.fanout) == 1  # one entry, though tanh and keep each have three readers
    late = {"a", "c", "cat"}
    cut = {n: int(n in late) for n in small.names}
    stage_of = expand_assignment(members, cut)
    priced = _priced(small, cut, 2)
    assert sum(priced.values()) == sum(_sent(graph, stage_of, 2).values()) == 3


def test_the_readers_survive_the_plan_file() -> None:
    """A plan records each fanned-out node's reads by name; a plan written before the
    field reads as none, and is priced once per stage as before."""
    x = torch.randn(4, 3, 4, 4)
    plan = crosscut.partition(
        Three(), "2xcpu", x, schedule="1f1b", microbatches=2, require_all_devices=True,
        time_limit=5,
    )  # fmt: skip
    by_name = {n.name: n for n in plan.nodes}
    assert by_name["tanh"].fanout == [["a", "tanh"], ["b", "tanh"], ["c", "tanh"]]
    assert all(not n.fanout for n in plan.nodes if n.name != "tanh")
    data = plan.to_dict()
    again = Plan.from_dict(data)
    assert {n.name: n.fanout for n in again.nodes} == {n.name: n.fanout for n in plan.nodes}
    problem, _, _ = plan_to_problem(again)
    stage_of = {n: int(n in {"a", "c", "cat"}) for n in problem.names}
    assert _priced(problem, stage_of, 2)[("tanh", 1)] == 2
    for node in data["nodes"]:
        node.pop("fanout")
    old, _, _ = plan_to_problem(Plan.from_dict(data))
    assert old.fanout == {}
    assert _priced(old, stage_of, 2)[("tanh", 1)] == 1


def test_densenet_recuts_are_priced_as_the_edges_codegen_makes() -> None:
    """densenet121's dense blocks read each layer's output from every later layer's
    ``cat``: interleaved re-cuts put those readers on several stages of each device,
    and codegen sends one alias per remote reader. Every transfer the plan lists is an
    edge the staged program makes, and the other way round."""
    model = torchvision.models.densenet121(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    plan = crosscut.partition(
        model, "4xcpu", x, schedule="1f1b", microbatches=2, require_all_devices=True,
        time_limit=5,
    )  # fmt: skip
    graph = trace(model, torch.randn(2, 3, 32, 32))
    aliased = 0
    for schedule in ("1f1b-v2", "1f1b-v4"):
        out = interleave(plan, schedule)
        assert out is not None
        priced = Counter((t.tensor, t.dst_stage) for t in out.transfers)
        sent = _sent(graph, dict(out.assignment), out.num_stages)
        assert priced == sent, schedule
        aliased = max(aliased, max(priced.values()))
    assert aliased > 1  # some value does cross to one stage more than once


def _random_cut(
    problem: PartitionProblem, stages: int, rng: random.Random
) -> tuple[dict[str, int], int]:
    """A stage per node, never before its inputs' stages, and how many stages it uses
    (renumbered in order: codegen refuses an empty stage). The stages follow program
    order, but a node runs a stage ahead at random, so parallel branches land on
    different stages and one value's readers are spread out of program order too."""
    inputs: dict[int, list[int]] = {}
    for u, v in problem.edges:
        inputs.setdefault(v, []).append(u)
    stage: list[int] = []
    for v in range(problem.n):
        lo = max((stage[u] for u in inputs.get(v, [])), default=0)
        ahead = int(rng.random() < 0.1)  # a branch a stage ahead of program order
        stage.append(min(stages - 1, max(lo, stages * v // problem.n + ahead)))
    used = {k: i for i, k in enumerate(sorted(set(stage)))}
    return {n: used[k] for n, k in zip(problem.names, stage, strict=True)}, len(used)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "googlenet",
        "inception_v3",
        "densenet121",
        "squeezenet1_0",
        "efficientnet_b0",
        "regnet_y_400mf",
        "shufflenet_v2_x0_5",
    ],
)
def test_random_cuts_of_a_family_are_priced_as_the_edges_codegen_makes(name: str) -> None:
    """Over whole families and cuts nobody chose (any stage at or after the inputs'), the
    transfers ``evaluate`` prices are the edges the staged program makes, alias by alias."""
    inception = name in ("googlenet", "inception_v3")
    kw = {"aux_logits": False, "init_weights": False} if inception else {}
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=10, **kw)
    size = 96 if name == "inception_v3" else 64  # its stem needs 75 px or more
    graph = trace(model, torch.randn(2, 3, size, size))
    problem = problem_from_parts(
        plan_nodes(graph, _Flat(), ["cpu"]), _cluster(6), PlanOptions(), training=True
    )
    rng = random.Random(name)
    once_per_stage = dataclasses.replace(problem, fanout={})
    differs = 0
    for _ in range(4):  # six stages: densenet's third block spans three of them
        stage_of, stages = _random_cut(problem, 6, rng)
        assert stages > 1
        priced = _priced(problem, stage_of, stages)
        assert priced == _sent(graph, stage_of, stages)
        differs += priced != _priced(once_per_stage, stage_of, stages)
    if name in ("googlenet", "inception_v3", "densenet121"):  # 3+ readers, several stages
        assert differs, "no cut drawn where a value crosses once per reader"


def test_a_proof_for_the_solvers_model_is_not_called_optimal_once_aliases_add_time() -> None:
    """CP-SAT prices a fanned-out value once per stage, a lower bound on what codegen
    sends. A plan it proved optimal for that model, whose aliases then cost more, is
    reported FEASIBLE with a note saying why: "OPTIMAL" must hold for the plan as priced.
    Without fan-out (or when the aliases add nothing) the verdict is unchanged."""
    from crosscut.partitioner.solvers.cpsat import _Coverage, _verdict
    from crosscut.partitioner.solvers.cpsat_search import Incumbent

    problem = _problem(trace(Three(), torch.randn(2, 3, 4, 4)))
    assert problem.fanout
    plan = ([0] * problem.n, [0])

    def verdict(pb: PartitionProblem, objective: float, notes: list[str]) -> str:
        cov = _Coverage(orders=[], exhaustive=True, static_lb=0.5, global_bound=1.0)
        return _verdict(pb, Incumbent(plan, objective, True), cov, notes, 10.0)[1]

    notes: list[str] = []
    assert verdict(problem, 1.0, notes) == "OPTIMAL" and not notes
    assert verdict(problem, 1.3, notes) == "FEASIBLE"
    assert any("fanned-out" in n and "0.3 s" in n for n in notes), notes
    assert verdict(dataclasses.replace(problem, fanout={}), 1.3, []) == "OPTIMAL"
