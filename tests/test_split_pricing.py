"""A split backward's two passes priced as measured, not by a fixed half.

A zero-bubble schedule runs each backward as ``B`` (the gradients sent
upstream) then ``W`` (the weight gradients). On a CPU a convolution's weight
gradient alone costs most of its whole backward, so ``B + W`` is well above
one backward (resnet18 at 64 px: ~1.4x). A profile times the two passes as the
runtime runs them (``cost_models/context.py``, ``measure_split``); the plan
carries them per node (``PlanNode.bwd_split``) and the simulator prices ``B``
and ``W`` from them (``partitioner/simulate.py``, ``backward_split``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from crosscut.api import partition
from crosscut.cost_models.context import measure_split
from crosscut.cost_models.profiled import profile_costs
from crosscut.cost_models.table import CostTable
from crosscut.errors import CostModelError
from crosscut.frontend.tracer import trace
from crosscut.ir.plan import Plan
from crosscut.partitioner.simulate import backward_split, simulate


class _Net(nn.Module):
    """Two convolution blocks and a head: parameters on both sides of any cut."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.b2 = nn.BatchNorm2d(32)
        self.c3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        y = torch.relu(self.c3(y))
        out: torch.Tensor = self.fc(y.mean((2, 3)))
        return out


def _x() -> torch.Tensor:
    return torch.randn(8, 3, 24, 24)


def test_both_passes_are_timed_and_charged_to_the_owner_of_the_weights() -> None:
    torch.manual_seed(0)
    graph = trace(_Net(), _x())
    assert graph.gm is not None
    passes = measure_split(graph.gm, [_x()], torch.device("cpu"), 1, 2)
    with_params = {n.name for n in graph.nodes if n.param_bytes > 0}
    computed = {n.name for n in graph.nodes if n.op not in ("placeholder", "output")}
    assert computed <= set(passes)
    for name in with_params:  # every convolution, norm and the head computes in both
        b, w = passes[name]
        assert b > 0 and w > 0, (name, b, w)
    for name in computed - with_params:  # a ReLU or a mean has no weights to restart
        assert passes[name][1] == 0.0, name
    # the model's parameters are left with gradients, as W fills them
    model = graph.gm
    assert all(p.grad is not None for p in model.parameters())


def test_a_profile_carries_the_split_and_a_file_keeps_it(tmp_path: Path) -> None:
    graph = trace(_Net(), _x())
    table = profile_costs(graph, "cpu", repeats=2, warmup=1, cache_dir=tmp_path)
    with_params = {n.name for n in graph.nodes if n.param_bytes > 0}
    assert {n for n, c in table.nodes.items() if c.split} == with_params
    for name in with_params:
        b, w = table.bwd_split(name, "cpu") or (-1.0, -1.0)
        assert b > 0 and w > 0, (name, b, w)
    assert table.bwd_split(next(iter(with_params)), "V100") is None  # not measured there
    again = CostTable.from_json(table.to_json())
    assert {n: c.split for n, c in again.nodes.items()} == {
        n: c.split for n, c in table.nodes.items()
    }
    cached = profile_costs(graph, "cpu", repeats=2, warmup=1, cache_dir=tmp_path)
    assert cached.meta["cache_hit"] or cached.meta.get("recheck") is not None
    assert {n for n, c in cached.nodes.items() if c.split} == with_params


@pytest.mark.parametrize("pair", [[-0.1, 0.5], [0.5, float("nan")], [0.5, 11.0]])
def test_a_cost_file_with_an_impossible_split_is_refused(pair: list[float]) -> None:
    data = {
        "source": "profiled",
        "nodes": {"a": {"fwd": {"cpu": 1e-3}, "bwd": {"cpu": 2e-3}, "resident": 0,
                        "activation": 0, "split": {"cpu": pair}}},
    }  # fmt: skip
    with pytest.raises(CostModelError, match="backward split"):
        CostTable.from_dict(json.loads(json.dumps(data)))


def _stage_sums(plan: Plan, k: int, kind: str) -> tuple[float, float]:
    moved = wgt = 0.0
    for n in plan.nodes:
        if plan.assignment.get(n.name) == k and kind in n.bwd_split:
            b, w = n.bwd_split[kind]
            moved += (1 - b) * n.bwd_s[kind]
            wgt += w * n.bwd_s[kind]
    return moved, wgt


def test_the_simulator_prices_b_and_w_as_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the profile cache goes here
    torch.manual_seed(0)
    plan = partition(_Net(), ["cpu", "cpu"], _x(), microbatches=2, replicas=1,
                     require_all_devices=True, cost="profiled", schedule="zb-h1")  # fmt: skip
    assert plan.num_stages == 2
    assert any(n.bwd_split for n in plan.nodes if plan.assignment.get(n.name) == 1)
    # the plan file keeps the measured split (the schema accepts it)
    plan.save(str(tmp_path / "plan.json"))
    loaded = Plan.load(str(tmp_path / "plan.json"))
    assert {n.name: n.bwd_split for n in loaded.nodes} == {n.name: n.bwd_split for n in plan.nodes}
    moved, wgt = backward_split(plan, 1, 1.0, receives=True)
    assert (moved, wgt) == pytest.approx(_stage_sums(plan, 1, "cpu"))
    # the first stage sends nothing upstream: its whole backward is W
    assert backward_split(plan, 0, 0.25, receives=False) == (0.25, 0.25)
    # a W measured longer makes the step longer, a B shorter the critical path shorter
    base = simulate(plan).step_time_s

    def scaled(fb: float, fw: float) -> Plan:
        nodes = [
            dataclasses.replace(
                n, bwd_split={k: [b * fb, w * fw] for k, (b, w) in n.bwd_split.items()}
            )
            for n in plan.nodes
        ]
        return dataclasses.replace(plan, nodes=nodes)

    assert simulate(scaled(1.0, 3.0)).step_time_s > base
    assert simulate(scaled(0.2, 1.0)).step_time_s < base


def test_without_a_measurement_the_rule_prices_the_split() -> None:
    """Analytic costs carry no split: a convolution's backward is half B, half W."""
    plan = partition(_Net(), "2xV100", _x(), microbatches=2, replicas=1,
                     require_all_devices=True, schedule="zb-h1")  # fmt: skip
    assert all(not n.bwd_split for n in plan.nodes)
    kind = plan.cluster.devices[0].kind
    convs = [n for n in plan.nodes if plan.assignment.get(n.name) == 1 and "conv" in n.kind]
    others = [
        n
        for n in plan.nodes
        if plan.assignment.get(n.name) == 1 and n.param_bytes > 0 and n not in convs
        and not any(t in n.kind for t in ("linear", "matmul", "mm"))
    ]  # fmt: skip
    heads = [
        n for n in plan.nodes if plan.assignment.get(n.name) == 1 and n.param_bytes > 0
        and n not in convs and n not in others
    ]  # fmt: skip
    half = 0.5 * sum(n.bwd_s[kind] for n in convs + heads)
    assert half > 0 and convs
    extra = 0.5 * sum(n.bwd_s[kind] for n in others)
    assert backward_split(plan, 1, 10.0, receives=True) == pytest.approx((half, half + extra))


def test_every_micro_batch_after_the_first_adds_its_gradients_into_grad() -> None:
    """One stage, M=4: the step is the parameter-free step plus the update and three
    accumulation passes over the gradients (the first micro-batch writes them fresh)."""
    from crosscut.partitioner.simulate import _stage_accumulate, _stage_update

    plan = partition(_Net(), "1xV100", _x(), microbatches=4, replicas=1, schedule="1f1b")
    bare = dataclasses.replace(
        plan, nodes=[dataclasses.replace(n, param_bytes=0) for n in plan.nodes]
    )
    acc, upd = _stage_accumulate(plan, 0), _stage_update(plan, 0)
    assert acc > 0 and upd > 0
    gap = simulate(plan).step_time_s - simulate(bare).step_time_s
    assert gap == pytest.approx(3 * acc + upd, rel=1e-9)
    one = dataclasses.replace(plan, options=dataclasses.replace(plan.options, microbatches=1))
    one_bare = dataclasses.replace(one, nodes=bare.nodes)
    assert simulate(one).step_time_s - simulate(one_bare).step_time_s == pytest.approx(upd)


def test_a_profiled_plan_prices_gradient_passes_at_the_measured_memory_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from crosscut.cost_models.devices import PRESETS
    from crosscut.cost_models.profiled import stream_rate

    monkeypatch.chdir(tmp_path)
    rate = stream_rate(torch.device("cpu"), mib=8)
    assert 1e8 < rate < 1e13
    plan = partition(_Net(), ["cpu", "cpu"], _x(), microbatches=2, replicas=1,
                     require_all_devices=True, cost="profiled", schedule="1f1b")  # fmt: skip
    measured = {d.mem_bw for d in plan.cluster.devices}
    assert len(measured) == 1 and 1e8 < measured.pop() != PRESETS["cpu"].mem_bw
    analytic = partition(_Net(), ["cpu", "cpu"], _x(), microbatches=2, replicas=1,
                         require_all_devices=True, schedule="1f1b")  # fmt: skip
    assert {d.mem_bw for d in analytic.cluster.devices} == {PRESETS["cpu"].mem_bw}
