# mypy: disable-error-code="no-any-return"
"""OpGraph invariants and coarsening: lint, partition of members, conservation, no hidden branch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crosscut.errors import InputError
from crosscut.frontend import trace
from crosscut.ir.graph import GraphLintError, OpGraph, OpNode
from crosscut.partitioner.coarsen import coarsen, expand_assignment
from tests.conftest import build_meta


def check_coarsening(fine: OpGraph, coarse: OpGraph, mapping: dict[str, list[str]]) -> None:
    """Every property coarsening promises, checked against the fine graph."""
    coarse.lint()
    assert set(mapping) == {n.name for n in coarse.nodes}
    members = [m for ms in mapping.values() for m in ms]
    assert sorted(members) == sorted(n.name for n in fine.nodes)  # a partition
    for field in ("fwd_flops", "bwd_flops", "param_bytes", "buffer_bytes"):
        assert sum(getattr(n, field) for n in coarse.nodes) == sum(
            getattr(n, field) for n in fine.nodes
        )
    owner = {m: c for c, ms in mapping.items() for m in ms}
    succ = fine.successors()
    for c in coarse.nodes:
        ms = mapping[c.name]
        assert c.members == ms and ms == fine.subgraph_names(ms)
        assert c.out_bytes == fine.node(ms[-1]).out_bytes
        # no branch hidden: only the last member may be read from outside the group
        for m in ms[:-1]:
            assert all(owner[s] == c.name for s in succ[m]), (c.name, m)
        # coarse edges are exactly the fine edges between different groups
        external = {owner[i] for m in ms for i in fine.node(m).inputs if owner[i] != c.name}
        assert set(c.inputs) == external
    for n in fine.nodes:
        if n.is_io:
            assert mapping[owner[n.name]] == [n.name]  # placeholders and output stay alone


def test_coarsen_resnet50(resnet50_graph: OpGraph) -> None:
    coarse, mapping = coarsen(resnet50_graph)
    check_coarsening(resnet50_graph, coarse, mapping)
    assert len(resnet50_graph) == 177 and len(coarse) == 74
    c = {n.name: n for n in coarse.nodes}
    assert c["conv1"].kind == "conv2d+batch_norm+relu"
    assert mapping["conv1"] == ["conv1", "bn1", "relu"]
    # the residual branch point (maxpool feeds two convs) is still a node of its own
    assert mapping["maxpool"] == ["maxpool"]
    assert c["add"].kind == "add+relu" and c["add"].inputs == [
        "layer1_0_conv3",
        "layer1_0_downsample_0",
    ]


@pytest.mark.parametrize(
    ("name", "size", "before", "after"),
    [("densenet121", 64, 433, 190), ("inception_v3", 75, 316, 126)],
)
def test_coarsen_branchy_models(name: str, size: int, before: int, after: int) -> None:
    fine = trace(build_meta(name), torch.empty(2, 3, size, size, device="meta"))
    coarse, mapping = coarsen(fine)
    check_coarsening(fine, coarse, mapping)
    assert (len(fine), len(coarse)) == (before, after)


def test_expand_assignment_round_trip(resnet50_graph: OpGraph) -> None:
    coarse, mapping = coarsen(resnet50_graph)
    stages = {n.name: (i * 3) // len(coarse) for i, n in enumerate(coarse.nodes)}
    fine = expand_assignment(mapping, stages)
    assert set(fine) == {n.name for n in resnet50_graph.nodes}
    assert fine["bn1"] == fine["relu"] == stages["conv1"]
    for src, dst in resnet50_graph.edges():
        assert fine[src] <= fine[dst]  # a monotone coarse plan stays monotone
    with pytest.raises(InputError, match="coarse node"):
        expand_assignment(mapping, {"bn1": 0})


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.mid = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.mid(torch.relu(self.lin(x)))))


def test_coarsen_keeps_ties_between_groups() -> None:
    fine = trace(Tied(), torch.randn(2, 4))
    assert fine.ties == [["lin", "lin_1"]]
    coarse, mapping = coarsen(fine)
    check_coarsening(fine, coarse, mapping)
    assert coarse.ties == [["lin", "lin_1"]]
    assert mapping["lin"] == ["lin", "relu"]


# ---- random DAGs -------------------------------------------------------------------------

KINDS = [
    "conv2d",
    "linear",
    "add",
    "cat",
    "batch_norm",
    "relu",
    "view",
    "dropout",
    "getitem",
    "size",
]


@st.composite
def random_graphs(draw: st.DrawFn) -> OpGraph:
    n = draw(st.integers(min_value=1, max_value=14))
    nodes = [OpNode("x", "placeholder", "placeholder", "x", shapes=[[1, 4]], out_bytes=16)]
    for i in range(n):
        earlier = [m.name for m in nodes]
        k = draw(st.integers(min_value=1, max_value=min(3, len(earlier))))
        inputs = draw(st.lists(st.sampled_from(earlier), min_size=1, max_size=k, unique=True))
        is_param = draw(st.integers(0, 5)) == 0
        kind = "get_attr" if is_param else draw(st.sampled_from(KINDS))
        shapes = [] if kind == "size" else [[1, 4]]  # size arithmetic carries no tensor
        nodes.append(
            OpNode(
                f"n{i}",
                "get_attr" if is_param else "call_function",
                kind,
                kind,
                inputs=[] if is_param else inputs,
                shapes=shapes,
                out_bytes=16 if shapes else 0,
                param_bytes=draw(st.integers(0, 100)),
                fwd_flops=draw(st.integers(0, 1000)),
                bwd_flops=draw(st.integers(0, 1000)),
            )
        )
    used = {i for m in nodes for i in m.inputs}
    sinks = [m.name for m in nodes if m.name not in used and m.op != "get_attr"] or ["x"]
    nodes.append(OpNode("output", "output", "output", "output", inputs=sinks))
    return OpGraph(nodes)


@settings(max_examples=150, deadline=None)
@given(random_graphs())
def test_coarsen_random_dags(fine: OpGraph) -> None:
    fine.lint()
    coarse, mapping = coarsen(fine)
    check_coarsening(fine, coarse, mapping)
    again, _ = coarsen(coarse)  # idempotent in size: nothing left to merge safely
    assert len(again) == len(coarse)


# ---- OpGraph basics ----------------------------------------------------------------------


def test_round_trip_keeps_fingerprint(resnet50_graph: OpGraph) -> None:
    back = OpGraph.from_dict(resnet50_graph.to_dict())
    back.lint()
    assert back.fingerprint() == resnet50_graph.fingerprint()
    assert back == resnet50_graph


def test_lint_names_the_offender() -> None:
    bad = OpGraph(
        [
            OpNode("x", "placeholder", "placeholder", "x"),
            OpNode("a", "call_function", "relu", "relu", inputs=["b"]),
            OpNode("b", "call_function", "relu", "relu", inputs=["x"]),
            OpNode("output", "output", "output", "output", inputs=["a"]),
        ]
    )
    with pytest.raises(GraphLintError, match="'a' reads 'b'"):
        bad.lint()


def test_coarsen_reaches_a_fixed_point_through_size_arithmetic() -> None:
    """conv -> size -> batch_norm: folding the size op exposes a chain; one call merges it."""

    def node(name: str, op: str, kind: str, inputs: list[str], shapes: list[list[int]]) -> OpNode:
        return OpNode(
            name=name,
            op=op,
            kind=kind,
            target=kind,
            inputs=inputs,
            shapes=shapes,
            out_bytes=16 if shapes else 0,
        )

    g = OpGraph(
        [
            node("x", "placeholder", "placeholder", [], [[1, 4]]),
            node("n0", "call_function", "conv2d", ["x"], [[1, 4]]),
            node("n1", "call_function", "size", ["n0"], []),
            node("n2", "call_function", "batch_norm", ["n1"], [[1, 4]]),
            node("output", "output", "output", ["n2"], []),
        ]
    )
    coarse, mapping = coarsen(g)
    assert mapping["n0"] == ["n0", "n1", "n2"]
    assert len(coarsen(coarse)[0]) == len(coarse) == 3
