"""Recomputation as a planner decision (issue 17): priced, chosen, recorded, and run.

The rule being tested (partitioner/evaluate.py, partitioner/build.py): a
recomputing stage keeps one micro-batch of activations (the one it re-runs)
plus its received inputs for every in-flight micro-batch, and pays its
forward once more in backward. ``recompute="auto"`` uses it only where a plan
would not fit without it, or where memory shaped the plan and recomputing is
faster.
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
from crosscut.cost_models import Cluster
from crosscut.cost_models.devices import preset
from crosscut.errors import InfeasiblePlanError, InputError, PlanError
from crosscut.partitioner.build import plan_to_problem
from crosscut.partitioner.evaluate import evaluate, in_flight
from crosscut.partitioner.plan import Plan
from crosscut.partitioner.simulate import simulate
from crosscut.partitioner.validate import validate_plan


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
        Net(), _cluster(cap), X, microbatches=M, recompute=recompute, time_limit=5, **kw
    )


@pytest.fixture(scope="module")
def roomy() -> Plan:
    return _plan(10**10, "never")


def test_memory_and_time_follow_the_rule(roomy: Plan) -> None:
    again = Plan.from_dict(
        {**roomy.to_dict(), "options": {**roomy.to_dict()["options"], "recompute": True}}
    )
    base, stage_of, stage_device = plan_to_problem(roomy)
    pb, _, _ = plan_to_problem(again)
    assert pb.recompute and not base.recompute
    plain, rec = evaluate(base, stage_of, stage_device), evaluate(pb, stage_of, stage_device)
    s = len(stage_device)
    for k, d in enumerate(stage_device):
        mine = [v for v in range(pb.n) if stage_of[v] == k]
        res = sum(pb.resident[v] for v in mine)
        act = sum(pb.activation[v] for v in mine)
        recv = sum(pb.out_bytes[u] for u, j, kk, _ in rec.transfers if kk == k)
        inflight = in_flight(pb, k, s)
        assert rec.device_memory[d] == res + act + inflight * recv  # one micro-batch of act
        assert plain.device_memory[d] == res + inflight * act + inflight * recv
        # the extra forward: compute grows by the forward part of every node
        kind = roomy.cluster.devices[d].kind
        nodes = {n.name: n for n in roomy.nodes}
        fwd = sum(
            nodes[pb.names[v]].time_s[kind] - nodes[pb.names[v]].bwd_s.get(kind, 0.0) for v in mine
        )
        assert rec.stage_compute[k] == pytest.approx(plain.stage_compute[k] + fwd, rel=1e-9)
        assert fwd > 0


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
    assert plan.options.recompute and all(s.recompute for s in plan.stages)
    assert any("no plan fits the memory caps without recomputation" in n for n in plan.solver.notes)
    for dev, peak in plan.predicted.device_peak_bytes.items():
        assert peak <= cap, dev
    validate_plan(plan)
    sim = simulate(plan)
    # backward actions carry the recomputed forward: B > F for every stage here
    assert all(b > f for f, b in zip(sim.stage_fwd_s, sim.stage_bwd_s)), (sim.stage_fwd_s,)


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


def test_validation_refuses_mixed_flags() -> None:
    plan = _plan(10**10, "always", require_all_devices=True)
    data = plan.to_dict()
    data["stages"][0]["recompute"] = False
    with pytest.raises(PlanError, match="priced for every stage of a plan or none"):
        validate_plan(Plan.from_dict(data))


def test_bad_recompute_value_is_refused() -> None:
    with pytest.raises(InputError, match="recompute must be one of"):
        crosscut.partition(Net(), "2xV100", X, recompute="sometimes")
    with pytest.raises(InputError, match="recompute must be one of"):
        crosscut.compile(Net(), ["cpu", "cpu"], X, recompute="sometimes")


def test_compile_runs_what_the_plan_chose_with_eager_numbers() -> None:
    cap = _tight_cap()
    torch.manual_seed(0)
    model = Net()
    plan = crosscut.partition(
        model, _cluster(cap), X, microbatches=M, require_all_devices=True, time_limit=5
    )
    assert all(s.recompute for s in plan.stages)
    eager = Net()
    eager.load_state_dict(model.state_dict())
    compiled = crosscut.compile(model, ["cpu", "cpu"], X, plan=plan)
    try:
        assert compiled._recompute == [True] * plan.num_stages
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
        crosscut.compile(Net(), _cluster(cap), X, microbatches=M, bn_mode="step", time_limit=5)


@pytest.mark.parametrize(("name", "batch"), [("resnet152", 512), ("vgg16", 1024)])
def test_issue_acceptance_on_4xK20c(name: str, batch: int) -> None:
    """resnet152 at 512 and vgg16 at 1024, 8 micro-batches: feasible only by recomputing
    (traced on meta tensors: nothing of the batch is allocated)."""
    model = torchvision.models.get_model(name, weights=None)
    x = torch.empty(batch, 3, 224, 224, device="meta")
    with pytest.raises(InfeasiblePlanError):
        crosscut.partition(model, "4xK20c", x, microbatches=8, recompute="never", time_limit=10)
    plan = crosscut.partition(model, "4xK20c", x, microbatches=8, time_limit=10)
    assert plan.options.recompute and plan.num_stages >= 2
    caps = {d.name: d.mem_cap for d in plan.cluster.devices}
    for dev, peak in plan.predicted.device_peak_bytes.items():
        assert peak <= caps[dev], dev
