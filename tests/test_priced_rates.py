"""A plan says which rates it was priced at: preset, math mode, efficiency source (issue 24).

Why: every predicted time rests on a datasheet, the math PyTorch runs and an
achieved fraction of the peaks that was either fitted to published
measurements, assumed, or measured here. A user can only judge a prediction
knowing which, so the plan records it per device kind (``Plan.rates``), it
survives JSON (and plans made before it still load), and the terminal
summary and the HTML report print it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import crosscut
from crosscut.cost_models.analytic import analytic_costs, priced_rate
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.devices import cpu_spec
from crosscut.cost_models.table import CostTable, NodeCost
from crosscut.errors import PlanError
from crosscut.frontend.tracer import trace
from crosscut.ir.plan import Plan, PricedRate
from crosscut.partitioner.partition import priced_rates
from crosscut.viz import plan_to_html
from crosscut.viz.summary import summary_text


def _cnn(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def _x(batch: int = 8) -> torch.Tensor:
    return torch.empty(batch, 3, 32, 32, device="meta")


def _rate(
    kind: str, precision: str = "fp32", tf32: bool | None = True, batch: int = 8, width: int = 16
) -> dict[str, object]:
    graph = trace(_cnn(width), _x(batch), precision=precision)
    spec = Cluster.from_spec(f"1x{kind}").devices[0]
    return analytic_costs(graph, Cluster.from_spec(f"1x{kind}"), tf32=tf32).meta["priced"][  # type: ignore[no-any-return]
        spec.kind
    ]


def test_each_kind_says_its_preset_math_and_where_its_efficiency_came_from() -> None:
    v100 = _rate("V100")
    assert v100["preset"] == "V100" and v100["costs"] == "analytic"
    assert v100["math"] == ["fp32 FMA"]
    assert str(v100["efficiency"]).startswith("calibrated")
    assert "DeepLearningExamples" in str(v100["efficiency"])
    # PyTorch runs fp32 convolutions in TF32 on Ampere, but not its matmuls by default
    a100 = _rate("A100-80GB", tf32=None, batch=256)
    assert "tf32 tensor cores" in a100["math"]  # type: ignore[operator]
    # at batch 8 cuDNN's transposes around the NCHW tensor-core kernels cost more than its
    # fp32 kernels take (conv_math.conv_choice): the record says which was priced
    assert "fp32 FMA (cuDNN's pick over tensor cores)" in _rate("A100-80GB")["math"]  # type: ignore[operator]
    assert _rate("A100-80GB", tf32=False)["math"] == ["fp32 FMA"]
    # an NCHW model (the default) pays cuDNN's transposes around its tensor-core
    # convolutions; its RGB stem (3 input channels) runs on the CUDA cores
    assert _rate("V100", "fp16", batch=64, width=128)["math"] == [
        "fp16 FMA (few input channels)",
        "fp16 tensor cores",
        "NCHW: cuDNN's transposes priced (channels_last avoids them)",
    ]
    assert _rate("P40", "fp16")["math"] == ["fp16 storage, fp32 math"]
    # no published H100 figure was fitted: the record must not call it calibrated
    h100 = str(_rate("H100")["efficiency"])
    assert h100.startswith("analytic default") and "Ampere" in h100
    assert "not calibrated" in str(_rate("cpu")["efficiency"])


def test_a_cpu_says_whose_rates_price_it() -> None:
    """The reference core's rates are not this machine's, and the record says so; a CPU
    measured here (or described in a JSON) is named by its own rates."""
    graph = trace(_cnn(), _x())
    ref = Cluster.from_spec("1xcpu").devices[0]
    said = str(priced_rate(graph, ref)["efficiency"])
    assert "reference core" in said and f"{ref.peak('float32') / 1e9:.0f} GFLOP/s" in said
    own = cpu_spec(ref.name, peak=123e9, mem_bw=45e9)
    said = str(priced_rate(graph, own)["efficiency"])
    assert "123 GFLOP/s, 45 GB/s, page faults at 4.0 GB/s, measured or described" in said
    assert "not calibrated" not in said
    faults = cpu_spec(ref.name, page_fault_bw=2e9)  # only the page-fault rate measured
    assert "page faults at 2.0 GB/s, measured or described" in str(
        priced_rate(graph, faults)["efficiency"]
    )


def test_a_device_described_by_hand_has_no_preset() -> None:
    graph = trace(_cnn(), _x())
    spec = Cluster.from_spec("1xV100").devices[0]
    faster = type(spec)(spec.name, spec.kind, spec.device, {"float32": 1e15}, 1e12, spec.mem_cap)
    assert priced_rate(graph, faster)["preset"] == ""
    assert priced_rate(graph, spec)["preset"] == "V100"


def test_profiled_kinds_replace_their_analytic_record_when_merged() -> None:
    nodes = {"a": NodeCost({"V100": 1.0}, {"V100": 1.0})}
    analytic = CostTable(nodes, "analytic", meta={"priced": {"V100": {"kind": "V100"}, "P40": {}}})
    measured = {"V100": {"kind": "V100", "costs": "profiled", "efficiency": "profiled on cuda:0"}}
    merged = analytic.merge(CostTable(nodes, "profiled", meta={"priced": measured}))
    assert merged.meta["priced"]["V100"]["costs"] == "profiled"
    assert "P40" in merged.meta["priced"]  # the other kind keeps its analytic record
    # a table without the record still says how it was priced
    bare = priced_rates(CostTable(nodes, "profiled"), ["V100"], "fp32")
    assert bare == [PricedRate("V100", "", ["as run under fp32"], "profiled", "profiled")]


@pytest.fixture(scope="module")
def plan() -> Plan:
    return crosscut.partition(_cnn(), "2xV100", _x(16), time_limit=5)


def test_the_plan_records_rates_and_round_trips(plan: Plan, tmp_path: Path) -> None:
    assert [r.kind for r in plan.rates] == ["V100"]
    assert plan.rates[0].math == ["fp32 FMA"] and plan.rates[0].preset == "V100"
    back = Plan.load(plan.save(tmp_path / "p.json"))
    assert back.rates == plan.rates
    # a plan written before the record loads, with none
    data = json.loads(plan.to_json())
    del data["rates"]
    assert Plan.from_dict(data).rates == []
    # the schema checks the record's fields
    data["rates"] = [{"kind": "V100", "tflops": 15}]
    with pytest.raises(PlanError):
        Plan.from_dict(data)


def test_summary_and_report_print_the_rates(plan: Plan) -> None:
    text = summary_text(plan, width=200)
    assert "priced at" in text
    assert "fp32 FMA" in text and "calibrated: 'volta'" in text
    html = plan_to_html(plan)
    assert "id='rates'" in html and "calibrated: &#x27;volta&#x27;" in html
    # an old plan prints no empty section
    old = Plan.from_dict({k: v for k, v in json.loads(plan.to_json()).items() if k != "rates"})
    assert "priced at" not in summary_text(old, width=200)
    assert "id='rates'" not in plan_to_html(old)
