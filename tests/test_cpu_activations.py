"""Activations on a CPU: the arithmetic of exp and kin, and autograd's copy before an
in-place one (``cpu_terms.elementwise_arithmetic``, ``op_terms.autograd_copy_bytes``).

``docs/benchmarks/cpu-kernels-act.json`` holds activations timed by
``benchmarks/cpu_kernels.py --ops activation`` with the GEMM and copy rates of the
same run; these tests re-price every row with the current model at that run's rates,
so they need no timing of their own and hold on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.cpu_kernels import ACTIVATIONS
from crosscut.cost_models import cpu_terms
from crosscut.cost_models.analytic import node_times
from crosscut.cost_models.devices import DeviceSpec, cpu_spec, preset
from crosscut.cost_models.efficiency import efficiency_of
from crosscut.cost_models.memory import is_alias
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph, OpNode

RECORD = Path(__file__).resolve().parent.parent / "docs/benchmarks/cpu-kernels-act.json"


def _node(module: nn.Module, shape: list[int], mode: str = "train") -> tuple[OpGraph, OpNode]:
    graph = trace(nn.Sequential(module).train(mode == "train"), torch.randn(*shape), mode=mode)
    ops = [n for n in graph.nodes if n.op == "call_module"]  # an in-place one: not a clone
    (node,) = ops or [n for n in graph.nodes if n.op == "call_function"]
    return graph, node


def _rows() -> tuple[DeviceSpec, list[dict[str, Any]]]:
    data = json.loads(RECORD.read_text())
    meta = data["meta"]
    spec = cpu_spec("cpu", peak=meta["gemm_flops_per_s"], mem_bw=meta["copy_bytes_per_s"])
    return spec, [r for r in data["rows"] if r["op"] == "activation"]


def _ratio(spec: DeviceSpec, row: dict[str, Any]) -> tuple[float, float]:
    graph, node = _node(ACTIVATIONS[row["activation"]](), row["shape"])
    fwd, bwd = node_times(graph, node, spec)
    return fwd / row["fwd_s"], bwd / row["bwd_s"]


def test_every_priced_activation_is_recorded_at_three_sizes() -> None:
    _, rows = _rows()
    for kind in cpu_terms.CPU_ELEMENTWISE_FLOPS:
        assert len([r for r in rows if r["activation"] == kind]) == 3, kind


@pytest.mark.parametrize("kind", sorted(cpu_terms.CPU_ELEMENTWISE_FLOPS))
def test_activations_that_compute_are_priced_by_their_arithmetic(kind: str) -> None:
    """Every recorded size within 25 % forward; the backward too where it computes
    (sigmoid's, tanh's and the rest's run at their bytes, from cache in this record)."""
    spec, rows = _rows()
    for row in [r for r in rows if r["activation"] == kind]:
        fwd, bwd = _ratio(spec, row)
        assert 0.75 <= fwd <= 1.25, (row["shape"], fwd)
        if cpu_terms.CPU_ELEMENTWISE_FLOPS[kind][1] > 0:
            assert 0.75 <= bwd <= 1.25, (row["shape"], bwd)


def test_by_their_bytes_they_were_priced_far_under(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the term, tanh, ELU and Mish were priced at a quarter of their time or less."""
    spec, rows = _rows()
    monkeypatch.setattr(cpu_terms, "CPU_ELEMENTWISE_FLOPS", {})
    for row in [r for r in rows if r["activation"] in ("tanh", "elu", "mish")]:
        assert _ratio(spec, row)[0] < 0.3, row["shape"]


def test_the_term_follows_the_gemm_rate_and_stays_off_a_gpu() -> None:
    node = _node(nn.Mish(), [8, 64, 16, 16])[1]
    spec = cpu_spec("cpu", peak=100e9, mem_bw=25e9)
    arith = cpu_terms.elementwise_arithmetic(node, spec)
    elements = 8 * 64 * 16 * 16
    assert arith == pytest.approx((elements * 350 / 100e9, elements * 408 / 100e9))
    fast = cpu_terms.elementwise_arithmetic(node, cpu_spec("cpu", peak=200e9, mem_bw=25e9))
    assert fast == pytest.approx((arith[0] / 2, arith[1] / 2))
    assert cpu_terms.elementwise_arithmetic(node, spec, part=0.5)[0] == pytest.approx(arith[0] / 2)
    assert cpu_terms.elementwise_arithmetic(node, preset("V100")) == (0.0, 0.0)
    relu = _node(nn.ReLU(), [8, 64, 16, 16])[1]
    assert cpu_terms.elementwise_arithmetic(relu, spec) == (0.0, 0.0)


@pytest.mark.parametrize("spec", [cpu_spec("cpu", peak=100e9, mem_bw=25e9), preset("A100-80GB")])
def test_an_in_place_activation_pays_autograd_copy_of_its_input(spec: DeviceSpec) -> None:
    """``silu_``, ``hardswish_`` and ``relu6`` in place: autograd copies the input their
    backward needs before they overwrite it, one more read and write and one more
    kernel, on every device, in training only. ``relu_`` saves its output: no copy."""
    shape = [8, 64, 16, 16]
    nbytes = 8 * 64 * 16 * 16 * 4
    for inplace, out_of_place in (
        (nn.SiLU(inplace=True), nn.SiLU()),
        (nn.Hardswish(inplace=True), nn.Hardswish()),
        (nn.ReLU6(inplace=True), nn.ReLU6()),
    ):
        graph, node = _node(inplace, shape)
        in_place_fwd = node_times(graph, node, spec)[0]
        plain = node_times(*_node(out_of_place, shape), spec)[0]
        copy = 2 * nbytes / (spec.mem_bw * _memory_fraction(spec)) + spec.launch_overhead_s
        assert in_place_fwd == pytest.approx(plain + copy), type(inplace).__name__
        infer = node_times(*_node(inplace, shape, mode="infer"), spec)[0]
        assert infer == pytest.approx(plain)
    relu = node_times(*_node(nn.ReLU(inplace=True), shape), spec)[0]
    assert relu == pytest.approx(node_times(*_node(nn.ReLU(), shape), spec)[0])


def _memory_fraction(spec: DeviceSpec) -> float:
    return efficiency_of(spec.kind, spec.device).memory


def test_a_module_is_an_alias_by_its_kind_not_its_attribute_name() -> None:
    """A module's target is the attribute it is stored under: ``self.t = nn.Tanh()`` was
    taken for the transpose ``t`` (a view: no bytes, no storage), ``nn.Flatten`` is a
    view under any name, and an in-place module is one by its flag."""

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Tanh()
            self.f = nn.Flatten()
            self.relu_ = nn.ReLU()
            self.a = nn.SiLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.f(self.a(self.relu_(self.t(x))))

    graph = trace(Named().train(), torch.randn(2, 4, 3, 3), mode="train")
    alias = {n.target: is_alias(graph, n) for n in graph.nodes if n.op == "call_module"}
    assert alias == {"t": False, "f": True, "relu_": False, "a": True}
