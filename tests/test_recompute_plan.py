"""Recomputation as a planner decision (issue 17): priced, chosen, recorded, and run.

The rule being tested (partitioner/evaluate.py, partitioner/build.py): a
recomputing stage keeps one micro-batch of activations (the one it re-runs)
plus its received inputs for every in-flight micro-batch, and pays its
forward once more in backward. ``recompute="auto"`` uses it only where a plan
would not fit without it, or where memory shaped the plan and recomputing is
faster, and then only on the stages that do not fit without it
(partitioner/recompute_choice.py); the plan records the choice per stage.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import crosscut
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.devices import preset
from crosscut.errors import InfeasiblePlanError, InputError, PlanError
from crosscut.ir.plan import Plan
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.build import plan_to_problem
from crosscut.partitioner.evaluate import evaluate
from crosscut.partitioner.recompute_choice import keep_needed
from crosscut.partitioner.simulate import simulate
from crosscut.partitioner.stage_memory import in_flight
from crosscut.partitioner.validate import validate_plan
from crosscut.viz.summary import summary_text


class Net(nn.Module):
    """Big activations, small weights: the case recomputation is for."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


X = torch.randn(16, 3, 32, 32)
M = 4


def _cluster(cap: int, n: int = 2) -> Cluster:
    specs = [dataclasses.replace(preset("V100"), name=f"gpu{i}", mem_cap=cap) for i in range(n)]
    return Cluster.from_specs(specs, "nvlink")


def _plan(cap: int, recompute: str, **kw: object) -> Plan:
    torch.manual_seed(0)
    return crosscut.partition(
        Net(),
        _cluster(cap),
        X,
        microbatches=M,
        replicas=1,
        recompute=recompute,
        time_limit=5,
        # the rule is 1F1B's (in flight: S - k); pipelines only: batch-split groups hold a
        # share of each micro-batch's activations, another way to fit (tested elsewhere)
        **{"schedule": "1f1b", "cross_shaped": False, **kw},
    )


@pytest.fixture(scope="module")
def roomy() -> Plan:
    return _plan(10**10, "never")


@pytest.fixture(scope="module")
def two() -> Plan:
    """Two stages, nothing recomputing, caps that never bind."""
    plan = _plan(10**10, "never", require_all_devices=True)
    assert plan.num_stages == 2
    return plan


def _with_flags(plan: Plan, flags: list[bool]) -> Plan:
    data = plan.to_dict()
    for st, flag in zip(data["stages"], flags):
        st["recompute"] = flag
    return Plan.from_dict(data)


@pytest.mark.parametrize("flags", [[True, True], [True, False], [False, True]])
def test_memory_and_time_follow_the_rule(two: Plan, flags: list[bool]) -> None:
    """Per stage: resident + activations of ONE micro-batch + in-flight x received
    inputs, and one more forward in backward; a plain stage is priced as before."""
    base, stage_of, stage_device = plan_to_problem(two)
    pb, stage_of2, _ = plan_to_problem(_with_flags(two, flags))
    assert stage_of2 == stage_of and not base.recompute and not base.stage_recompute
    assert pb.recompute == all(flags)  # all: the solver's own problem; a mix: per stage
    assert pb.stage_recompute == (() if all(flags) else tuple(flags))
    plain, rec = evaluate(base, stage_of, stage_device), evaluate(pb, stage_of, stage_device)
    s = len(stage_device)
    nodes = {n.name: n for n in two.nodes}
    for k, d in enumerate(stage_device):
        mine = [v for v in range(pb.n) if stage_of[v] == k]
        res = sum(pb.resident[v] for v in mine)
        act = sum(pb.activation[v] for v in mine)
        recv = sum(pb.out_bytes[u] for u, j, kk, _ in rec.transfers if kk == k)
        inflight = in_flight(pb, k, s)
        assert plain.device_memory[d] == res + inflight * act + inflight * recv
        kind = two.cluster.devices[d].kind
        fwd = sum(
            nodes[pb.names[v]].time_s[kind] - nodes[pb.names[v]].bwd_s.get(kind, 0.0) for v in mine
        )
        assert fwd > 0
        if flags[k]:
            assert rec.device_memory[d] == res + act + inflight * recv  # one micro-batch
            assert rec.stage_compute[k] == pytest.approx(plain.stage_compute[k] + fwd, rel=1e-9)
        else:
            assert rec.device_memory[d] == plain.device_memory[d]
            assert rec.stage_compute[k] == plain.stage_compute[k]
    # the simulator and the plan's own numbers use the same prices
    mixed = _with_flags(two, flags)
    validate_plan(mixed)
    sim, sim0 = simulate(mixed), simulate(two)
    for k in range(s):
        assert sim.stage_fwd_s[k] == pytest.approx(sim0.stage_fwd_s[k])
        extra = rec.stage_compute[k] - plain.stage_compute[k]
        assert sim.stage_bwd_s[k] == pytest.approx(sim0.stage_bwd_s[k] + extra)
        assert (
            sim.device_peak_bytes[mixed.stages[k].devices[0]] == rec.device_memory[stage_device[k]]
        )


def test_never_is_todays_plan_and_auto_leaves_a_roomy_plan_alone(roomy: Plan) -> None:
    auto = _plan(10**10, "auto")
    assert auto.assignment == roomy.assignment
    assert not auto.options.recompute and not any(s.recompute for s in auto.stages)
    assert auto.solver.objective == roomy.solver.objective


def _tight_cap() -> int:
    """Just above the recomputing plan's peak (each case checks that no plain plan fits)."""
    always = _plan(10**10, "always", require_all_devices=True)
    return int(max(always.predicted.device_peak_bytes.values()) * 1.05)


def test_auto_makes_an_infeasible_case_feasible() -> None:
    cap = _tight_cap()
    with pytest.raises(InfeasiblePlanError):
        _plan(cap, "never")
    plan = _plan(cap, "auto")
    assert plan.options.recompute  # solved with every stage recomputing ...
    assert plan.stages[0].recompute  # ... the first stage needs it ...
    # ... the last does not: under 1F1B it holds one micro-batch in flight anyway,
    # so recomputing would save nothing and cost a forward
    assert plan.num_stages == 2 and not plan.stages[-1].recompute
    assert any("no plan fits the memory caps without recomputation" in n for n in plan.solver.notes)
    assert any("recompute per stage: stage(s) [1] fit without" in n for n in plan.solver.notes)
    for dev, peak in plan.predicted.device_peak_bytes.items():
        assert peak <= cap, dev
    validate_plan(plan)
    assert plan.solver.status != "OPTIMAL"  # the per-stage choice proves nothing optimal
    assert plan.solver.best_bound <= plan.solver.objective
    sim = simulate(plan)
    # backward actions carry the recomputed forward on the recomputing stage only
    assert sim.stage_bwd_s[0] > sim.stage_fwd_s[0]
    # same partition as "always", never slower, strictly less compute
    always = _plan(cap, "always")
    assert always.assignment == plan.assignment and all(s.recompute for s in always.stages)
    assert plan.predicted.step_time_s <= always.predicted.step_time_s
    assert sum(s.compute_s for s in plan.stages) < sum(s.compute_s for s in always.stages)
    # never worse; equal up to the order floats were summed in when the recomputing stage
    # is not the bottleneck
    assert plan.solver.objective <= always.solver.objective * (1 + 1e-12)


def test_keep_needed_drops_every_stage_that_fits(two: Plan) -> None:
    plan = _with_flags(two, [True, True])
    annotate(plan)
    assert keep_needed(plan) == [0, 1]
    assert not any(s.recompute for s in plan.stages)
    assert plan.predicted == two.predicted


def test_too_small_for_either_says_both_were_tried() -> None:
    with pytest.raises(InfeasiblePlanError, match="with and without recomputation"):
        _plan(1000, "auto")


def test_inference_never_recomputes() -> None:
    plan = _plan(10**10, "always", mode="infer")
    assert not plan.options.recompute and not any(s.recompute for s in plan.stages)


def test_the_flag_round_trips_and_old_plans_load(tmp_path: Path) -> None:
    plan = _plan(10**10, "always")
    assert all(s.recompute for s in plan.stages)
    back = Plan.load(plan.save(tmp_path / "p.json"))
    assert back == plan
    data = json.loads((tmp_path / "p.json").read_text())
    del data["options"]["recompute"]
    for st in data["stages"]:
        del st["recompute"]
    old = Plan.from_dict(data)  # a plan written before the field existed
    assert not old.options.recompute and not any(s.recompute for s in old.stages)


def test_the_summary_marks_the_recomputing_stages(two: Plan) -> None:
    plan = annotate(_with_flags(two, [True, False]))
    text = summary_text(plan, width=120)
    rows = [line for line in text.splitlines() if "gpu0" in line or "gpu1" in line]
    marked = [line for line in rows if "↻" in line]
    assert len(marked) == 1 and "gpu" in marked[0], text
    assert "recomputes its activations in backward" in text
    assert "↻" not in summary_text(two, width=120)


def test_validation_refuses_recompute_in_inference() -> None:
    plan = _plan(10**10, "never", mode="infer")
    data = plan.to_dict()
    data["stages"][0]["recompute"] = True
    with pytest.raises(PlanError, match="only training stages recompute"):
        validate_plan(Plan.from_dict(data))


def test_a_mixed_plan_round_trips(two: Plan, tmp_path: Path) -> None:
    plan = annotate(_with_flags(two, [True, False]))
    back = Plan.load(plan.save(tmp_path / "mixed.json"))
    assert [s.recompute for s in back.stages] == [True, False]
    assert back == plan
    assert annotate(back).predicted == plan.predicted


def test_bad_recompute_value_is_refused() -> None:
    with pytest.raises(InputError, match="recompute must be one of"):
        crosscut.partition(Net(), "2xV100", X, recompute="sometimes", microbatches=1, replicas=1)
    with pytest.raises(InputError, match="recompute must be one of"):
        crosscut.compile(
            Net(), ["cpu", "cpu"], X, recompute="sometimes", microbatches=1, replicas=1
        )


def test_compile_runs_what_the_plan_chose_with_eager_numbers() -> None:
    cap = _tight_cap()
    torch.manual_seed(0)
    model = Net()
    plan = crosscut.partition(
        model, _cluster(cap), X, microbatches=M, require_all_devices=True, time_limit=5, replicas=1
    )
    flags = [s.recompute for s in plan.stages]
    assert flags == [True, False]  # per stage: the last one fits without
    eager = Net()
    eager.load_state_dict(model.state_dict())
    compiled = crosscut.compile(model, ["cpu", "cpu"], X, plan=plan)
    try:
        assert compiled._recompute == flags
        y = torch.randint(0, 10, (16,))
        loss = compiled.train_step((X,), y, nn.functional.cross_entropy)
        # eager over the same micro-batches, gradients accumulated as the pipeline does
        want = 0.0
        for xs, ys in zip(X.chunk(M), y.chunk(M)):
            part = nn.functional.cross_entropy(eager(xs), ys) / M
            part.backward()
            want += float(part.detach())
        assert float(loss) == pytest.approx(want, rel=1e-5)
        grads = dict(compiled.named_parameters())
        for name, p in eager.named_parameters():
            got = grads[name].grad
            assert got is not None and torch.allclose(got, p.grad, rtol=1e-4, atol=1e-6), name
        for name, buf in eager.named_buffers():
            assert torch.equal(dict(compiled.named_buffers())[name], buf), name
    finally:
        compiled.close()
    # an explicit run-time choice overrides the plan's
    off = crosscut.compile(model, ["cpu", "cpu"], X, plan=plan, recompute=False)
    try:
        assert off._recompute == [False] * plan.num_stages
    finally:
        off.close()


def test_bn_step_mode_plans_without_recomputation() -> None:
    cap = _tight_cap()
    with pytest.raises(InfeasiblePlanError):
        torch.manual_seed(0)
        crosscut.compile(
            Net(),
            _cluster(cap),
            X,
            microbatches=M,
            bn_mode="step",
            time_limit=5,
            replicas=1,
            schedule="1f1b",
            cross_shaped=False,
        )


@pytest.mark.parametrize(("name", "batch"), [("resnet152", 512), ("vgg16", 1024)])
def test_issue_acceptance_on_4xK20c(name: str, batch: int) -> None:
    """resnet152 at 512 and vgg16 at 1024, 8 micro-batches, pipelines only: feasible only by
    recomputing (traced on meta tensors: nothing of the batch is allocated). Batch-split
    groups would be another way to fit (``test_strategy``)."""
    model = torchvision.models.get_model(name, weights=None)
    x = torch.empty(batch, 3, 224, 224, device="meta")
    with pytest.raises(InfeasiblePlanError):
        crosscut.partition(model, "4xK20c", x, microbatches=8, recompute="never",
                           time_limit=10, replicas=1, cross_shaped=False)  # fmt: skip
    plan = crosscut.partition(
        model, "4xK20c", x, microbatches=8, time_limit=10, replicas=1, cross_shaped=False
    )
    assert plan.options.recompute and plan.num_stages >= 2
    assert any(s.recompute for s in plan.stages)
    assert not plan.stages[-1].recompute  # 1F1B: the last stage keeps one micro-batch anyway
    caps = {d.name: d.mem_cap for d in plan.cluster.devices}
    for dev, peak in plan.predicted.device_peak_bytes.items():
        assert peak <= caps[dev], dev
