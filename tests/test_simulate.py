"""The simulator against closed-form pipeline times and the evaluator."""

from __future__ import annotations

import itertools

import pytest

from crosscut.cost_models import efficiency
from crosscut.ir.plan import (
    ModelInfo,
    Plan,
    PlanCluster,
    PlanDevice,
    PlanNode,
    PlanOptions,
    PlanStage,
)
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.simulate import simulate
from crosscut.partitioner.validate import plan_problems
from tests.plan_factory import make_plan


@pytest.fixture(autouse=True)
def _no_engine_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The closed forms below are the schedules' arithmetic: the stage engine's own
    cost per action (``efficiency.ACTION_OVERHEAD_S``, priced on CPU devices such as
    these) is set to zero here, and set on purpose by the tests that price it."""
    monkeypatch.setitem(efficiency.ACTION_OVERHEAD_S, "cpu", 0.0)


def chain_plan(
    stages: int,
    micro: int,
    schedule: str,
    *,
    fwd: float = 1.0,
    bwd: float = 2.0,
    mode: str = "train",
    out_bytes: int = 0,
) -> Plan:
    """One node per stage, equal times; transfers free unless ``out_bytes``."""
    devs = [PlanDevice(f"d{i}", "k", "cpu", 1 << 40) for i in range(stages)]
    bw = [[1e9] * stages for _ in range(stages)]
    lat = [[0.0] * stages for _ in range(stages)]
    nodes = [
        PlanNode(
            f"n{i}",
            "call_module",
            "conv2d",
            f"m{i}",
            [f"n{i - 1}"] if i else [],
            out_bytes,
            0,
            10,
            {"k": fwd + (bwd if mode == "train" else 0.0)},
            bwd_s={"k": bwd} if mode == "train" else {},
        )
        for i in range(stages)
    ]
    plan = Plan(
        model=ModelInfo("chain", "fp", micro, [[micro, 1]], mode),
        cluster=PlanCluster(devs, bw, lat),
        options=PlanOptions(schedule=schedule, microbatches=micro),
        nodes=nodes,
        edges=[(f"n{i - 1}", f"n{i}", out_bytes) for i in range(1, stages)],
        assignment={f"n{i}": i for i in range(stages)},
        stages=[PlanStage(i, [f"d{i}"]) for i in range(stages)],
    )
    return annotate(plan)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (2, 4), (4, 4), (4, 8), (3, 2)])
def test_balanced_pipeline_matches_closed_form(schedule: str, stages: int, micro: int) -> None:
    sim = simulate(chain_plan(stages, micro, schedule))
    # Balanced stages: fill + steady + drain = (M + S - 1) * (F + B) for both schedules.
    assert sim.step_time_s == pytest.approx((micro + stages - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))
    assert len(sim.events) == 2 * stages * micro


def test_inference_runs_forwards_only() -> None:
    sim = simulate(chain_plan(3, 4, "gpipe", mode="infer"))
    assert {e.kind for e in sim.events} == {"F"}
    assert sim.step_time_s == pytest.approx((4 + 3 - 1) * 1.0)


def test_transfers_lengthen_each_action() -> None:
    slow = simulate(chain_plan(2, 2, "gpipe", out_bytes=10**9))  # 1 s per hop at 1 GB/s
    # Each stage sends or receives one tensor: +1 s on every F and every B.
    assert slow.stage_fwd_s == pytest.approx([2.0, 2.0])
    assert slow.stage_bwd_s == pytest.approx([3.0, 3.0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (2, 4), (4, 8), (3, 2)])
def test_every_action_pays_the_engine_once(
    monkeypatch: pytest.MonkeyPatch, schedule: str, stages: int, micro: int
) -> None:
    """F and B each take the engine's per-action cost on top of their compute, so the
    balanced closed form holds with F + h and B + h."""
    h = 0.25
    monkeypatch.setitem(efficiency.ACTION_OVERHEAD_S, "cpu", h)
    sim = simulate(chain_plan(stages, micro, schedule))
    assert sim.stage_fwd_s == pytest.approx([1.0 + h] * stages)
    assert sim.stage_bwd_s == pytest.approx([2.0 + h] * stages)
    assert sim.step_time_s == pytest.approx((micro + stages - 1) * (3.0 + 2 * h))
    infer = simulate(chain_plan(stages, micro, "gpipe", mode="infer"))
    assert infer.step_time_s == pytest.approx((micro + stages - 1) * (1.0 + h))


def test_a_split_backward_pays_the_engine_for_its_third_action(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """zb-h1 runs F, B and W per micro-batch: each device is busy 3·M·h longer."""
    plain = simulate(chain_plan(3, 4, "zb-h1"))
    h = 0.1
    monkeypatch.setitem(efficiency.ACTION_OVERHEAD_S, "cpu", h)
    paid = simulate(chain_plan(3, 4, "zb-h1"))
    assert {e.kind for e in paid.events} >= {"F", "B", "W"}
    for dev, busy in plain.device_busy_s.items():
        assert paid.device_busy_s[dev] - busy == pytest.approx(3 * 4 * h)
    assert paid.step_time_s > plain.step_time_s + 3 * 4 * h - 1e-9


def test_a_gpu_stage_pays_no_engine_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the engine's host work hides behind queued kernels: not priced."""
    monkeypatch.setitem(efficiency.ACTION_OVERHEAD_S, "cpu", 0.25)
    plan = chain_plan(2, 4, "1f1b")
    for d in plan.cluster.devices:
        d.device = d.device.replace("cpu", "cuda")
    assert efficiency.ACTION_OVERHEAD_S["gpu"] == 0.0
    gpu = simulate(plan)
    assert gpu.stage_fwd_s == pytest.approx([1.0, 1.0])
    # the closed form, plus a GPU step's fixed host overhead (zero_grad, the update's dispatch)
    assert gpu.step_time_s == pytest.approx((4 + 2 - 1) * 3.0 + efficiency.STEP_OVERHEAD_S["gpu"])


def test_steady_state_equals_evaluated_stage_time() -> None:
    plan = make_plan(60, 4, cross_shaped=False, microbatches=4)
    for d in plan.cluster.devices:
        d.mem_cap = 1 << 40
    plan = annotate(plan)
    sim = simulate(plan)
    assert sim.evaluation is not None
    for k in range(plan.num_stages):
        assert sim.stage_fwd_s[k] + sim.stage_bwd_s[k] == pytest.approx(
            sim.evaluation.stage_time[k]
        )
    # A step is never shorter than the bottleneck stage's work for every micro-batch.
    assert sim.step_time_s >= plan.options.microbatches * max(sim.evaluation.stage_time) - 1e-12
    assert plan.predicted.step_time_s == pytest.approx(sim.step_time_s)


def test_one_f_one_b_keeps_fewer_in_flight_than_gpipe() -> None:
    a = simulate(chain_plan(4, 8, "gpipe"))
    b = simulate(chain_plan(4, 8, "1f1b"))
    # activation 10 bytes per micro-batch: GPipe keeps 8 in flight on every stage, 1F1B at most S-k.
    assert a.device_peak_bytes["d0"] == 80
    assert b.device_peak_bytes["d0"] == 40
    assert b.device_peak_bytes["d3"] == 10


def _colocated_plan(micro: int) -> Plan:
    """Three one-node stages: 0 by batch on d0+d1, 1 by channel on the same two, 2 on d2."""
    plan = chain_plan(3, micro, "1f1b")
    for node in plan.nodes:
        node.shard, node.channels = "split", 8
    plan.model.batch_size = 4 * micro
    plan.options.widths, plan.options.splits = [1, 2], ["batch", "channel"]
    plan.assignment = {"n0": 0, "n1": 1, "n2": 2}
    plan.stages = [
        PlanStage(0, ["d0", "d1"], split="batch"),
        PlanStage(1, ["d0", "d1"], split="channel"),
        PlanStage(2, ["d2"]),
    ]
    return annotate(plan)


@pytest.mark.parametrize("micro", [1, 4])
def test_colocated_stages_take_turns_on_their_devices(micro: int) -> None:
    plan = _colocated_plan(micro)
    assert plan_problems(plan) == []  # consecutive stages may share one group of 2+ devices
    sim = simulate(plan)
    for dev in ("d0", "d1"):
        spans = sorted((e.start, e.end) for e in sim.events if e.device == dev)
        assert all(end <= nxt + 1e-12 for (_, end), (nxt, _) in itertools.pairwise(spans))
        assert {e.stage for e in sim.events if e.device == dev} == {0, 1}
    # stage 0: half of n0 (1.5 s), stage 1: half of n1; d0 and d1 work for both
    assert plan.predicted.stage_time_s[:2] == pytest.approx([1.5, 1.5])
    assert plan.predicted.bottleneck_s == pytest.approx(3.0)
    assert sim.device_busy_s["d0"] == pytest.approx(micro * 3.0)
    assert sim.step_time_s >= micro * plan.predicted.bottleneck_s - 1e-12


def test_devices_shared_out_of_turn_are_refused() -> None:
    plan = _colocated_plan(1)
    plan.stages[2].devices = ["d0"]  # stage 2 reuses d0 without being stage 1's group
    assert any("runs stages 1 and 2" in p for p in plan_problems(plan))
