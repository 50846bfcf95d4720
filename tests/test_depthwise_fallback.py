"""Convolutions as oneDNN runs them on a CPU (cost_models/cpu_terms.py): each call's
fixed cost, and depthwise passes on oneDNN's GEMM fallback.

oneDNN's depthwise kernels refuse some shapes, and PyTorch's CPU convolution then
runs that pass as im2col and one small GEMM per sample and channel, 5-20x slower:
every 5x5 and 7x7 weight gradient, and tiny inputs. ``depthwise_fallbacks``
restates the kernels' rules; these tests hold it to oneDNN's own choice (its
verbose log) and re-price the recorded kernels
(``docs/benchmarks/cpu-kernels-dw.json``, ``benchmarks/cpu_kernels.py --ops
conv2d_dw``) at the record's rates, so they need no timing of their own.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from crosscut.cost_models.analytic import node_times
from crosscut.cost_models.cpu_terms import (
    DW_GEMM_FLOPS,
    ONEDNN_CALL_FLOPS,
    depthwise_fallbacks,
    runs_onednn,
    runs_slow2d,
)
from crosscut.cost_models.devices import cpu_spec, preset
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph, OpNode
from tests.onednn_log import verbose_log

RECORD = Path(__file__).resolve().parent.parent / "docs/benchmarks/cpu-kernels-dw.json"

# (kernel, stride, padding, input size): every padding the rules distinguish, sizes 1-8
GRID = [
    (k, s, p, h)
    for k, s, h in itertools.product((3, 5, 7), (1, 2), range(1, 9))
    for p in sorted({0, k // 2, k - 1})
    if h + 2 * p >= k
]

_VERBOSE = r"""
import sys, torch
from torch import nn
torch.set_num_threads(1)
for k, s, p, h in eval(sys.argv[1]):
    conv = nn.Conv2d(16, 16, k, stride=s, padding=p, groups=16, bias=False)
    print(f"=== {k} {s} {p} {h}", flush=True)
    conv(torch.randn(2, 16, h, h, requires_grad=True)).sum().backward()
"""


def _dw(k: int, s: int, p: int, h: int, channels_last: bool = False) -> tuple[OpGraph, OpNode]:
    conv = nn.Conv2d(16, 16, k, stride=s, padding=p, groups=16, bias=False)
    x = torch.randn(2, 16, h, h)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    graph = trace(nn.Sequential(conv).train(), x, mode="train")
    (node,) = [n for n in graph.nodes if n.conv is not None]
    return graph, node


def _onednn_choices() -> dict[tuple[int, ...], dict[str, str]]:
    """(k, s, p, h) -> {pass: implementation} from oneDNN's verbose log."""
    out = verbose_log(_VERBOSE, GRID)
    seen: dict[tuple[int, ...], dict[str, str]] = {}
    key: tuple[int, ...] = ()
    for line in out.splitlines():
        if line.startswith("=== "):
            key = tuple(int(v) for v in line.split()[1:])
            seen[key] = {}
        elif ",exec,cpu,convolution," in line:
            fields = line.split(",")
            at = fields.index("convolution")
            seen[key][fields[at + 2]] = fields[at + 1]
    return seen


def test_the_fallbacks_are_where_onednn_runs_its_gemm() -> None:
    """Kernels 3, 5 and 7, strides 1 and 2, padding 0, k // 2 and k - 1, inputs of 1-8
    px: ``depthwise_fallbacks`` names the passes oneDNN's log runs on ``gemm`` and no
    other; the input gradient always runs the depthwise kernel. The rules restate the
    AVX-512 kernels (16 channels a vector, 6 outputs a block): on another instruction set
    oneDNN has other kernels, and the test says so rather than compare them."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: its CPU convolutions take another path")
    seen = _onednn_choices()
    assert len(seen) == len(GRID)
    impls = {impl for passes in seen.values() for impl in passes.values()}
    if not any(impl.startswith("jit_dw:avx512_core") for impl in impls):
        pytest.skip(f"oneDNN chose {sorted(impls)}: the rules restate its AVX-512 kernels")
    wrong = []
    for key, passes in seen.items():
        graph, node = _dw(*key)
        fwd_gemm, grad_gemm = depthwise_fallbacks(graph, node)
        assert passes["backward_data"].startswith("jit_dw"), (key, passes)
        if (fwd_gemm, grad_gemm) != (
            "gemm" in passes["forward_training"],
            "gemm" in passes["backward_weights"],
        ):
            wrong.append((key, passes))
    assert not wrong, wrong
    assert sum(depthwise_fallbacks(*_dw(*key))[0] for key in GRID) >= 5  # both kinds occur
    assert sum(not depthwise_fallbacks(*_dw(*key))[1] for key in GRID) >= 5


def test_a_fallback_pass_is_priced_per_plane_and_multiply_add() -> None:
    """A 5x5 weight gradient at 8 px: half the roofline's backward (the input gradient)
    plus the GEMM's ``DW_GEMM_FLOPS``; the 3x3 at 8 px keeps the roofline. Channels-last
    inputs (ConvNeXt's) run other kernels: the rule does not claim them."""
    spec = cpu_spec("cpu", peak=100e9, mem_bw=25e9)
    graph, node = _dw(5, 1, 2, 8)
    assert node.conv is not None and node.conv["padding"] == [2, 2]
    assert depthwise_fallbacks(graph, node) == (False, True)
    fwd, bwd = node_times(graph, node, spec)
    flops = 2 * 16 * (DW_GEMM_FLOPS["plane"] + DW_GEMM_FLOPS["multiply-add"] * 64 * 25)
    launch = spec.launch_overhead_s + ONEDNN_CALL_FLOPS["backward"] / 100e9
    graph3, node3 = _dw(3, 1, 1, 8)
    assert depthwise_fallbacks(graph3, node3) == (False, False)
    fwd3, bwd3 = node_times(graph3, node3, spec)
    # the roofline's backward of the 5x5 is 25/9 of the 3x3's arithmetic: its half is
    # what remains once the GEMM's price is taken out
    roof5 = 2.0 * (bwd - flops / 100e9 - launch)
    call = ONEDNN_CALL_FLOPS["backward"] / 100e9
    assert roof5 > bwd3 - call > 0 and bwd > flops / 100e9 + call
    assert fwd > fwd3  # more taps
    cl_graph, cl_node = _dw(5, 1, 2, 8, channels_last=True)
    assert cl_node.conv is not None and cl_node.conv["channels_last"]
    assert depthwise_fallbacks(cl_graph, cl_node) == (False, False)
    inference = trace(nn.Sequential(nn.Conv2d(16, 16, 5, padding=2, groups=16)).eval(),
                      torch.randn(2, 16, 8, 8), mode="infer")  # fmt: skip
    (inode,) = [n for n in inference.nodes if n.conv is not None]
    assert node_times(inference, inode, spec)[1] == 0.0


def _record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORD.read_text())
    return data


def test_recorded_fallbacks_are_priced_within_their_spread() -> None:
    """Re-priced at the record's GEMM and copy rates: the backwards with a weight gradient
    on the GEMM (3x3 under its kernel's input size; 5x5 and 7x7 at 1-32 px) within
    0.6-1.8x of their time, median within 25 %; the forwards on it within 0.6-1.4x.
    (Before this term they were priced at 0.04-0.58x and 0.04-0.14x.) The forwards
    on oneDNN's depthwise kernels are not this term's: the roofline prices them 2-11x
    over their time (the control row too), a known gap."""
    data = _record()
    meta = data["meta"]
    spec = cpu_spec("cpu", peak=meta["gemm_flops_per_s"], mem_bw=meta["copy_bytes_per_s"])
    grads, fwds, jit = [], [], 0
    for row in data["rows"]:
        n, c, h, _ = row["shape"]
        k, s = row["kernel_stride"]
        conv = nn.Conv2d(c, c, k, stride=s, padding=k // 2, groups=c, bias=False)
        graph = trace(nn.Sequential(conv).train(), torch.randn(n, c, h, h), mode="train")
        (node,) = [x for x in graph.nodes if x.conv is not None]
        on_fwd, on_grad = depthwise_fallbacks(graph, node)
        p_fwd, p_bwd = node_times(graph, node, spec)
        if on_grad:
            grads.append(p_bwd / row["bwd_s"])
        if on_fwd:
            fwds.append(p_fwd / row["fwd_s"])
        jit += not (on_fwd or on_grad)
    assert len(grads) >= 10 and len(fwds) >= 3 and jit >= 1
    assert all(0.6 <= r <= 1.8 for r in grads), grads
    assert 0.75 <= statistics.median(grads) <= 1.25, grads
    assert all(0.6 <= r <= 1.4 for r in fwds), fwds


def test_every_onednn_convolution_pays_its_call() -> None:
    """A convolution oneDNN runs costs its call (``ONEDNN_CALL_FLOPS``, 52-57 us forward
    and 91-114 us backward measured in context on one EPYC core, where the launch alone
    charged 10 and 20) whatever its size, whole for a channel shard; a ``Slow2d`` one, a
    GPU's and an inference backward do not pay it."""
    spec = cpu_spec("cpu", peak=100e9, mem_bw=25e9)
    call_f, call_b = (ONEDNN_CALL_FLOPS[k] / 100e9 for k in ("forward", "backward"))
    assert 40e-6 <= call_f + spec.launch_overhead_s <= 70e-6
    assert 80e-6 <= call_b + 2 * spec.launch_overhead_s <= 130e-6
    conv = nn.Conv2d(64, 64, 3, padding=1)
    graph = trace(nn.Sequential(conv).train(), torch.randn(16, 64, 8, 8), mode="train")
    (node,) = [n for n in graph.nodes if n.conv is not None]
    assert runs_onednn(graph, node) and not runs_slow2d(graph, node)
    fwd, bwd = node_times(graph, node, spec)
    half_f, half_b = node_times(graph, node, spec, part=0.5)
    # a shard does half the arithmetic, but the call stays whole
    assert fwd - call_f > half_f - call_f > (fwd - call_f) / 2
    assert half_f > call_f and bwd > half_b > call_b
    gpu = node_times(graph, node, preset("V100"))
    assert gpu[0] < call_f  # a GPU's price has no such term
    narrow = nn.Conv2d(512, 128, 1)  # Slow2d on one thread at batch 8: its own price
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g2 = trace(nn.Sequential(narrow).train(), torch.randn(8, 512, 2, 2), mode="train")
        (n2,) = [n for n in g2.nodes if n.conv is not None]
        assert runs_slow2d(g2, n2) and not runs_onednn(g2, n2)
    finally:
        torch.set_num_threads(before)
    infer = trace(nn.Sequential(conv).eval(), torch.randn(16, 64, 8, 8), mode="infer")
    (n3,) = [n for n in infer.nodes if n.conv is not None]
    f3, b3 = node_times(infer, n3, spec)
    assert b3 == 0.0 and f3 == pytest.approx(fwd)
