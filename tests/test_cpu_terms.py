"""The CPU terms (cost_models/cpu_terms.py) against kernels timed on a CPU.

``docs/benchmarks/cpu-kernels.json`` holds max pools and training batch norms, and
``cpu-kernels-slow2d.json`` narrow 1x1 convolutions, timed by
``benchmarks/cpu_kernels.py`` with the GEMM and copy rates of the same run; these tests
re-price every row with the current model at that rate. They need no timing of
their own, so they hold on any machine.
"""

from __future__ import annotations

import itertools
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
from crosscut.cost_models.cpu_terms import SLOW2D_MAC_FLOPS, cpu_node_times, runs_slow2d
from crosscut.cost_models.devices import cpu_spec, preset
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph, OpNode

RECORD = Path(__file__).resolve().parent.parent / "docs/benchmarks/cpu-kernels.json"
SLOW2D = RECORD.with_name("cpu-kernels-slow2d.json")


def _record(path: Path = RECORD) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _module(row: dict[str, Any]) -> nn.Module:
    if row["op"] == "conv2d_1x1":
        return nn.Conv2d(row["shape"][1], row["out_channels"], 1)
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
    rows = [r for r in _record()["rows"] if r["op"] == "batch_norm"]
    tiny = [b for r, b in zip(rows, bwd) if r["shape"][2] * r["shape"][3] <= 4]
    assert len(tiny) >= 2 and all(0.8 <= r <= 1.25 for r in tiny), tiny  # the slow path


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


def _conv_node(conv: nn.Conv2d, shape: tuple[int, ...]) -> tuple[OpGraph, OpNode]:
    graph = trace(nn.Sequential(conv).train(), torch.randn(*shape), mode="train")
    (node,) = [n for n in graph.nodes if n.conv is not None]
    return graph, node


@pytest.mark.parametrize("threads", [1, 2])
def test_slow2d_is_where_pytorch_sends_a_convolution(threads: int) -> None:
    """``runs_slow2d`` restates ATen's backend rule; ``torch._C._select_conv_backend``
    is the rule itself, asked over batch sizes, kernels, strides, groups and sizes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b, k, s, g, hw in itertools.product((1, 2, 8, 16), (1, 3, 5), (1, 2), (1, 2), (2, 40)):
            conv = nn.Conv2d(4, 8, k, stride=s, groups=g, padding=k // 2)
            x = torch.randn(b, 4, hw, hw)
            pad, one = [k // 2] * 2, [1, 1]
            backend = torch._C._select_conv_backend(
                x, conv.weight, conv.bias, [s, s], pad, one, False, [0, 0], g, None
            )
            graph, node = _conv_node(conv, tuple(x.shape))
            assert runs_slow2d(graph, node, threads) == str(backend).endswith("Slow2d"), (
                (b, k, s, g, hw),
                backend,
            )
    finally:
        torch.set_num_threads(before)


def test_a_narrow_1x1_slow2d_convolution_is_priced_per_multiply_add() -> None:
    """DenseNet's 1x1 convolutions at 2x2 pixels, batch 8, one thread, ran at 6-8 GFLOP/s
    against 98 for a large GEMM: priced at ``SLOW2D_MAC_FLOPS``. At 4x4, at batch 16
    (oneDNN) or on two threads the roofline prices them, as before."""
    spec = cpu_spec("cpu", peak=100e9, mem_bw=25e9)
    conv = nn.Conv2d(512, 128, 1)
    graph, node = _conv_node(conv, (8, 512, 2, 2))
    assert runs_slow2d(graph, node, 1)
    fwd_f, in_f, w_f = SLOW2D_MAC_FLOPS["under 16 pixels"]
    macs = 8 * 4 * 512 * 128
    launch = spec.launch_overhead_s
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the price follows the threads torch computes on
    try:
        fwd, bwd = node_times(graph, node, spec)
    finally:
        torch.set_num_threads(before)
    assert fwd == pytest.approx(macs * fwd_f / 100e9 + launch)
    assert bwd == pytest.approx(macs * (in_f + w_f) / 100e9 + 2 * launch)
    wide_graph, wide = _conv_node(conv, (8, 512, 4, 4))  # Slow2d, 16 columns: the roofline
    assert runs_slow2d(wide_graph, wide, 1) and cpu_node_times(wide_graph, wide, spec) is None
    batch_graph, batch = _conv_node(conv, (16, 512, 2, 2))  # oneDNN
    assert not runs_slow2d(batch_graph, batch, 1)
    assert cpu_node_times(batch_graph, batch, spec) is None
    assert not runs_slow2d(graph, node, 2)


def test_narrow_1x1_convolutions_are_priced_per_multiply_add() -> None:
    """The recorded 1x1 convolutions at batch 8 on one thread (Slow2d) at 2x2 and 3x3
    pixels: each forward took 10-18 FLOP-equivalents per multiply-add where a GEMM
    takes 2, and the per-MAC price follows it (forward and backward within 0.35-2x,
    medians within 30 %). The 1x1-pixel rows are priced too but lean on fixed costs;
    the 4x4 control is the roofline's (its backward is under-priced: see the record)."""
    data = _record(SLOW2D)
    assert data["meta"]["threads"] == 1
    rows = [r for r in data["rows"] if r["op"] == "conv2d_1x1" and r["shape"][2] in (2, 3)]
    assert len(rows) >= 5
    assert all(r["fwd_flops_per_unit"] >= 10.0 for r in rows), rows
    meta = data["meta"]
    spec = cpu_spec("cpu", peak=meta["gemm_flops_per_s"], mem_bw=meta["copy_bytes_per_s"])
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the backend rule, and so the price, depends on it
    try:
        priced = [node_times(*_node(_module(r), r["shape"]), spec) for r in rows]
    finally:
        torch.set_num_threads(before)
    fwd = [p[0] / r["fwd_s"] for p, r in zip(priced, rows)]
    bwd = [p[1] / r["bwd_s"] for p, r in zip(priced, rows)]
    assert all(0.35 <= r <= 2.0 for r in fwd + bwd), (fwd, bwd)
    assert 0.7 <= statistics.median(fwd) <= 1.3 and 0.7 <= statistics.median(bwd) <= 1.3
