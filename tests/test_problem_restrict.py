"""A problem over a subset of its nodes (``ir.problem.restrict``): every per-node field
renumbered. The side-tree relaxation once carried the whole problem's fan-out map
into its smaller problem, and planning timm's rdnet_tiny crashed on an index past
the relaxation's last node."""

from __future__ import annotations

import dataclasses

import pytest

from crosscut.ir.problem import AS_IS, NODE_REFS, ROWS, PartitionProblem, restrict
from crosscut.partitioner.evaluate import consumers, evaluate
from crosscut.partitioner.fanout_cost import cut_transfers
from crosscut.partitioner.solvers.bounds import tree_relaxation


def test_every_field_of_a_problem_is_carried_one_way() -> None:
    """A field added to PartitionProblem must say how a restriction carries it."""
    names = {f.name for f in dataclasses.fields(PartitionProblem)}
    lists = [*ROWS, *NODE_REFS, *AS_IS]
    assert len(lists) == len(set(lists)), "a field is listed twice"
    assert set(lists) == names, f"not listed: {names - set(lists)}; unknown: {set(lists) - names}"


def _fanned() -> PartitionProblem:
    """m0 -> m1; m1 read by m2, m3, m4 (a fanned-out value); s0, a side node that reads
    the model's input and feeds m2; m4 also reads m2 and m3 and is the output."""
    names = ["m0", "s0", "m1", "m2", "m3", "m4"]
    n = len(names)
    return PartitionProblem(
        names=names,
        compute=[[10.0] * 2, [0.01] * 2, [10.0] * 2, [10.0] * 2, [10.0] * 2, [10.0] * 2],
        resident=[1, 2, 3, 4, 5, 6],
        activation=[10, 20, 30, 40, 50, 60],
        out_bytes=[100] * n,
        edges=[(0, 2), (1, 3), (2, 3), (2, 4), (2, 5), (3, 5), (4, 5)],
        devices=["d0", "d1"],
        mem_cap=[10**9] * 2,
        bandwidth=[[1e9] * 2] * 2,
        latency=[[0.0] * 2] * 2,
        ties=[[1, 3]],
        shard=["split", "channel", "split", "full", "channel", "full"],
        channels=[8, 1, 8, 16, 16, 5],
        param_bytes=[7, 0, 7, 9, 9, 11],
        batch_major=[True, True, True, True, True, False],
        messages=[1, 1, 2, 1, 1, 1],
        graph_inputs=[(4096, [0, 1])],
        graph_outputs=[5],
        share_compute={2: [[float(v)] * 2 for v in range(n)]},
        channel_compute={2: [[float(10 * v)] * 2 for v in range(n)]},
        fanout={2: [(3, 2), (4, 2), (5, 2)]},
    )


def test_restrict_renumbers_every_per_node_field() -> None:
    pb = _fanned()
    sub = restrict(pb, [0, 2, 3, 4, 5], stand_in=[0, 3, 2, 3, 4, 5])  # s0 joins m2
    assert sub.names == ["m0", "m1", "m2", "m3", "m4"]
    assert sub.resident == [1, 3, 4, 5, 6] and sub.messages == [1, 2, 1, 1, 1]
    assert sub.batch_major == [True, True, True, True, False]
    assert sub.edges == [(0, 1), (1, 2), (1, 3), (1, 4), (2, 4), (3, 4)]
    assert sub.fanout == {1: [(2, 1), (3, 1), (4, 1)]}
    assert sub.graph_inputs == [(4096, [0, 2])]  # s0 read the input: m2 does now
    assert sub.graph_outputs == [4]
    assert sub.ties == []  # s0 and m2 are one node now
    assert [row[0] for row in sub.share_compute[2]] == [0.0, 2.0, 3.0, 4.0, 5.0]
    assert [row[0] for row in sub.channel_compute[2]] == [0.0, 20.0, 30.0, 40.0, 50.0]
    assert sub.devices == pb.devices and sub.training == pb.training
    with pytest.raises(ValueError, match="stand-in"):
        restrict(pb, [0, 2, 3, 4, 5], stand_in=[0, 1, 2, 3, 4, 5])  # s0 stands for itself


def test_the_side_tree_relaxation_prices_fanned_out_values_on_its_own_nodes() -> None:
    """The relaxation's plan is priced with the fan-out rewrite (partitioner/fanout_cost.py)
    on the relaxation's own indices: m2 and m4 on the next stage, m3 on m1's, breaks
    eager's order of m1's readers, so m1 is sent once per remote reader."""
    pb = dataclasses.replace(_fanned(), ties=[])  # a tied node is never a side node
    rx = tree_relaxation(pb)
    assert rx is not None and rx.kept == [0, 2, 3, 4, 5]
    assert rx.problem.fanout == {1: [(2, 1), (3, 1), (4, 1)]}
    stage_of = [0, 0, 1, 0, 1]
    sent = cut_transfers(rx.problem, stage_of, consumers(rx.problem))  # IndexError before
    assert [t for t in sent if t[0] == 1] == [(1, 0, 1), (1, 0, 1)]
    assert evaluate(rx.problem, stage_of, [0, 1]).objective > 0
