"""The CPU terms (cost_models/cpu_terms.py) against kernels timed on a CPU.

``docs/benchmarks/cpu-kernels.json`` holds max pools and training batch norms timed
by ``benchmarks/cpu_kernels.py`` with the copy rate of the same run; these tests
re-price every row with the current model at that rate. They need no timing of
their own, so they hold on any machine.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from crosscut.cost_models.analytic import node_times
from crosscut.cost_models.cpu_terms import cpu_node_times
from crosscut.cost_models.devices import cpu_spec, preset
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph, OpNode

RECORD = Path(__file__).resolve().parent.parent / "docs/benchmarks/cpu-kernels.json"


def _record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORD.read_text())
    return data


def _module(row: dict[str, Any]) -> nn.Module:
    if row["op"] == "batch_norm":
        return nn.BatchNorm2d(row["shape"][1])
    kernel, stride, padding = row["pool"]
    return nn.MaxPool2d(kernel, stride, padding)


def _node(
    module: nn.Module, shape: list[int], channels_last: bool = False, mode: str = "train"
) -> tuple[OpGraph, OpNode]:
    x = torch.randn(*shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    graph = trace(nn.Sequential(module).train(mode == "train"), x, mode=mode)
    (node,) = [n for n in graph.nodes if n.op == "call_module"]
    return graph, node


def _ratios(op: str, channels_last: bool) -> tuple[list[float], list[float]]:
    """Price over measured time, forward and backward, of the recorded rows."""
    data = _record()
    meta = data["meta"]
    spec = cpu_spec("cpu", peak=meta["gemm_flops_per_s"], mem_bw=meta["copy_bytes_per_s"])
    fwd, bwd = [], []
    for row in data["rows"]:
        if row["op"] != op or row["channels_last"] != channels_last:
            continue
        graph, node = _node(_module(row), row["shape"], channels_last)
        p_fwd, p_bwd = node_times(graph, node, spec)
        fwd.append(p_fwd / row["fwd_s"])
        bwd.append(p_bwd / row["bwd_s"])
    assert fwd, f"no recorded {op} rows"
    return fwd, bwd


def test_nchw_max_pools_are_priced_by_their_outputs() -> None:
    """PyTorch's NCHW max pool walks each window element by element: the recorded
    forwards run 15-30x slower than their bytes, and are priced within 35 %."""
    fwd, bwd = _ratios("max_pool2d", channels_last=False)
    assert all(0.65 <= r <= 1.35 for r in fwd), fwd
    assert 0.8 <= statistics.median(fwd) <= 1.25, fwd
    assert all(0.5 <= r <= 2.0 for r in bwd), bwd


def test_nchw_max_pool_forward_is_far_from_its_bytes() -> None:
    """The physics behind the term: in every recorded shape the NCHW forward takes at
    least 10x the time of its bytes (fp32 inputs and outputs) and 8x the same pool
    channels-last, which vectorises across channels."""
    data = _record()
    bw = data["meta"]["copy_bytes_per_s"]
    by_shape: dict[tuple[int, ...], dict[bool, dict[str, Any]]] = {}
    for row in data["rows"]:
        if row["op"] == "max_pool2d":
            by_shape.setdefault(tuple(row["shape"]), {})[row["channels_last"]] = row
    assert len(by_shape) >= 4
    for shape, rows in by_shape.items():
        nchw, nhwc = rows[False], rows[True]
        moved = 4.0 * (math.prod(shape) + nchw["units"])
        assert nchw["fwd_s"] * bw >= 10.0 * moved, (shape, nchw["fwd_s"] * bw / moved)
        assert nchw["fwd_s"] >= 8.0 * nhwc["fwd_s"], (shape, nchw["fwd_s"], nhwc["fwd_s"])


def test_training_batch_norms_are_priced_per_element() -> None:
    """The forward within 40 % in every recorded shape; the backward's median within
    35 % (some spatial sizes take a slow path that no per-element price follows)."""
    fwd, bwd = _ratios("batch_norm", channels_last=False)
    assert all(0.6 <= r <= 1.4 for r in fwd), fwd
    assert 0.65 <= statistics.median(bwd) <= 1.35, bwd


def test_channels_last_pools_and_inference_norms_keep_the_roofline() -> None:
    spec = cpu_spec("cpu")
    graph, node = _node(nn.MaxPool2d(2), [8, 16, 16, 16], channels_last=True)
    assert cpu_node_times(graph, node, spec) is None
    graph, node = _node(nn.BatchNorm2d(16), [8, 16, 16, 16], mode="infer")
    assert cpu_node_times(graph, node, spec) is None
    graph, node = _node(nn.ReLU(), [8, 16, 16, 16])
    assert cpu_node_times(graph, node, spec) is None


def test_cpu_terms_scale_with_a_shard_and_the_gemm_rate() -> None:
    """Half the channels cost half; a core with twice the GEMM rate takes half the time,
    and the copy rate (DRAM, which these cache-bound loops barely touch) moves nothing."""
    spec = cpu_spec("cpu")
    graph, node = _node(nn.BatchNorm2d(32), [16, 32, 16, 16])
    whole = cpu_node_times(graph, node, spec)
    half = cpu_node_times(graph, node, spec, part=0.5)
    fast = cpu_node_times(graph, node, cpu_spec("cpu", peak=2 * spec.peak("float32")))
    dram = cpu_node_times(graph, node, replace(spec, mem_bw=2 * spec.mem_bw))
    assert whole is not None and half is not None and fast is not None
    launch = spec.launch_overhead_s
    for w, h, f in zip(whole, half, fast):
        assert h - launch == pytest.approx((w - launch) / 2)
        assert f - launch == pytest.approx((w - launch) / 2)
    assert dram == whole


def test_gpu_prices_do_not_take_the_cpu_terms() -> None:
    """A V100 prices a max pool by its bytes and its outputs per SM, not a CPU's loop."""
    graph, node = _node(nn.MaxPool2d(2), [64, 32, 28, 28])
    gpu = preset("V100")
    cpu_like = cpu_node_times(graph, node, gpu)
    assert cpu_like is not None  # the function alone cannot tell; node_times must not call it
    assert node_times(graph, node, gpu)[0] < 0.5 * cpu_like[0]
