"""The cost model on hand-computed examples: every number here was worked out on paper."""

from __future__ import annotations

import dataclasses

import pytest

from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.evaluate import check, evaluate, lower_bound, renumber


def tri(**kw: object) -> PartitionProblem:
    """a -> b -> c with a skip a -> c; device 1 is half as fast; 1000 B/s links, 0.5 s latency."""
    base = PartitionProblem(
        names=["a", "b", "c"],
        compute=[[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]],
        resident=[10, 20, 30],
        activation=[100, 200, 300],
        out_bytes=[1000, 2000, 3000],
        edges=[(0, 1), (0, 2), (1, 2)],
        devices=["d0", "d1"],
        mem_cap=[10**6, 10**6],
        bandwidth=[[1e3, 1e3], [1e3, 1e3]],
        latency=[[0.5, 0.5], [0.5, 0.5]],
        microbatches=4,
        schedule="1f1b",
        training=True,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_stage_times_training_count_transfers_twice_on_both_ends() -> None:
    ev = evaluate(tri(), [0, 0, 1], [0, 1])
    assert ev.stage_compute == pytest.approx([3.0, 6.0])
    # a: 2 * (1.5 * 0.5 + 1) = 3.5, b: 2 * (1.5 * 0.5 + 2) = 5.5 (a latency forward, and
    # backward one plus the mask message's), both counted on sender and receiver
    assert ev.stage_comm == pytest.approx([9.0, 9.0])
    assert ev.stage_time == pytest.approx([12.0, 15.0])
    assert ev.bottleneck == pytest.approx(15.0)
    assert ev.objective == ev.bottleneck
    assert sorted((u, j, k) for u, j, k, _ in ev.transfers) == [(0, 0, 1), (1, 0, 1)]


def test_one_transfer_per_receiving_stage_not_per_consumer() -> None:
    # a feeds b and c, both on stage 1: one transfer of a, not two
    pb = tri(edges=[(0, 1), (0, 2)])
    ev = evaluate(pb, [0, 1, 1], [0, 1])
    assert [t[0] for t in ev.transfers] == [0]
    # a feeds stage 1 and stage 2: two transfers
    pb3 = dataclasses.replace(
        pb,
        devices=["d0", "d1", "d2"],
        mem_cap=[10**6] * 3,
        compute=[[1.0] * 3] * 3,
        bandwidth=[[1e3] * 3] * 3,
        latency=[[0.5] * 3] * 3,
    )
    ev3 = evaluate(pb3, [0, 1, 2], [0, 1, 2])
    assert [(u, k) for u, _, k, _ in ev3.transfers] == [(0, 1), (0, 2)]
    assert ev3.stage_comm[0] == pytest.approx(2 * 3.5)


def test_a_value_of_several_tensors_pays_a_latency_per_message() -> None:
    """The torchrun runtime sends each tensor leaf of a value alone, and in training a
    mask message after the gradient's leaves: a's output as 3 tensors is 3 messages each
    way plus the mask, so its round trip pays 2 * 3 + 1 latencies, not 2 (nor 3)."""
    pb = tri(messages=[3, 1, 1])
    ev = evaluate(pb, [0, 0, 1], [0, 1])
    # a: 2 * (3.5 * 0.5 + 1) = 5.5, b: 2 * (1.5 * 0.5 + 2) = 5.5
    assert ev.stage_comm == pytest.approx([11.0, 11.0])
    assert sorted(round(t, 9) for *_, t in ev.transfers) == [5.5, 5.5]
    # inference: a latency per leaf, no mask: a 3 * 0.5 + 1 = 2.5, b 0.5 + 2 = 2.5
    assert evaluate(tri(messages=[3, 1, 1], training=False), [0, 0, 1], [0, 1]).stage_comm == (
        pytest.approx([5.0, 5.0])
    )
    # a value that stays on its stage sends nothing, however many leaves it has
    assert evaluate(pb, [0, 1, 1], [0, 1]).stage_comm == pytest.approx([5.5, 5.5])
    # the latency objective waits for the same messages: with 9 of them a arrives last,
    # at 1 + 2 * (9.5 * 0.5 + 1) = 12.5 (b at 3 + 5.5), then c runs 6 s
    late = dataclasses.replace(pb, objective="latency", messages=[9, 1, 1])
    assert evaluate(late, [0, 0, 1], [0, 1]).makespan == pytest.approx(1 + 2 * (9.5 * 0.5 + 1) + 6)


def test_overlap_takes_max_and_inference_counts_once() -> None:
    ev = evaluate(tri(overlap_comm=True), [0, 0, 1], [0, 1])
    assert ev.stage_time == pytest.approx([9.0, 9.0])
    inf = evaluate(tri(training=False), [0, 0, 1], [0, 1])
    assert inf.stage_comm == pytest.approx([4.0, 4.0])
    assert inf.stage_time == pytest.approx([7.0, 10.0])


def test_memory_depends_on_schedule() -> None:
    one = evaluate(tri(), [0, 0, 1], [0, 1]).device_memory
    # 1F1B: stage 0 keeps min(4, 2) = 2 micro-batches, stage 1 keeps 1 (+ received a and b)
    assert one == [30 + 2 * 300, 30 + 1 * (300 + 3000)]
    gp = evaluate(tri(schedule="gpipe"), [0, 0, 1], [0, 1]).device_memory
    assert gp == [30 + 4 * 300, 30 + 4 * (300 + 3000)]
    inf = evaluate(tri(training=False), [0, 0, 1], [0, 1]).device_memory
    assert inf == [30, 30 + 3000]
    # the device, not the stage, is what is charged
    assert evaluate(tri(), [0, 0, 1], [1, 0]).device_memory == [3330, 630]


def test_makespan_waits_for_transfers_and_overlaps_branches() -> None:
    # c starts when b arrives: 3 + 5.5 (a arrives at 1 + 3.5), and runs 6 s on d1
    assert evaluate(tri(objective="latency"), [0, 0, 1], [0, 1]).objective == pytest.approx(14.5)
    par = tri(
        edges=[(0, 1), (0, 2)],
        compute=[[1.0, 1.0], [5.0, 5.0], [5.0, 5.0]],
        out_bytes=[0, 0, 0],
        latency=[[0.0, 0.0], [0.0, 0.0]],
        objective="latency",
    )
    assert evaluate(par, [0, 0, 1], [0, 1]).makespan == pytest.approx(6.0)
    assert evaluate(par, [0, 0, 0], [0]).makespan == pytest.approx(11.0)


def test_check_names_every_broken_rule() -> None:
    pb = tri()
    assert check(pb, [0, 0, 1], [0, 1]) == []
    assert "backwards" in check(pb, [1, 0, 1], [0, 1])[0]
    assert "missing" in check(pb, [0, 0], [0, 1])[0]
    assert any("empty" in e for e in check(pb, [0, 0, 2], [0, 1, 1]))
    assert any("twice" in e for e in check(pb, [0, 0, 1], [1, 1]))
    assert any("tie" in e for e in check(tri(ties=[[1, 2]]), [0, 0, 1], [0, 1]))
    over = check(tri(mem_cap=[10**6, 1000]), [0, 0, 1], [0, 1])
    assert over == ["device 'd1' needs 3330 bytes, cap 1000"]


def test_renumber_and_lower_bound() -> None:
    assert renumber([0, 2, 2, 3], [5, 6, 7, 8]) == ([0, 1, 1, 2], [5, 7, 8])
    pb = tri()
    assert lower_bound(pb) == pytest.approx(4.0)  # max(6 s / (1 + 1/2 device speeds), 3)
    assert lower_bound(tri(objective="latency")) == pytest.approx(6.0)  # chain a-b-c
    for stage_of, devs in (([0, 0, 1], [0, 1]), ([0, 1, 1], [1, 0]), ([0, 0, 0], [0])):
        assert evaluate(pb, stage_of, devs).bottleneck >= lower_bound(pb)


def test_a_split_backward_holds_its_weight_gradients_from_b_to_w() -> None:
    """Between a micro-batch's B and its W a stage keeps the gradient of every parametered
    node's output (W restarts from them). zb-h2 on 2 stages, M=4 (rows in the comments)
    holds 2 such micro-batches on stage 0 and 3 on stage 1; zb-h1 one on each; 1F1B and
    GPipe none. a and c have parameters (out_bytes 1000 and 3000), b has none."""
    # zb-h2  0: F0 F1 F2 B0 W0 B1 F3 B2 W1 W2 B3 W3   (B1, B2 pending at once: 2)
    #        1: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3   (B0, B1, B2 pending: 3)
    pb = tri(param_bytes=[4, 0, 8])
    base = evaluate(pb, [0, 0, 1], [0, 1]).device_memory
    for schedule, held in (("zb-h1", (1, 1)), ("zb-h2", (2, 3)), ("gpipe", (0, 0))):
        ev = evaluate(dataclasses.replace(pb, schedule=schedule), [0, 0, 1], [0, 1])
        plain = evaluate(
            dataclasses.replace(pb, schedule=schedule, param_bytes=[0, 0, 0]), [0, 0, 1], [0, 1]
        )
        assert ev.device_memory[0] - plain.device_memory[0] == held[0] * 1000, schedule
        assert ev.device_memory[1] - plain.device_memory[1] == held[1] * 3000, schedule
    # 1F1B and ZB-H1 keep the same activations: only the held gradients differ
    zb1 = evaluate(dataclasses.replace(pb, schedule="zb-h1"), [0, 0, 1], [0, 1]).device_memory
    assert [z - b for z, b in zip(zb1, base)] == [1000, 3000]
    # inference holds none
    infer = dataclasses.replace(pb, schedule="zb-h1", training=False)
    assert (
        evaluate(infer, [0, 0, 1], [0, 1]).device_memory
        == evaluate(
            dataclasses.replace(infer, param_bytes=[0, 0, 0]), [0, 0, 1], [0, 1]
        ).device_memory
    )
