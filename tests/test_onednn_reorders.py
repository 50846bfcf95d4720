"""The layout copies oneDNN makes around an NCHW convolution (cost_models/cpu_terms.py).

oneDNN's CPU kernels take channels in blocks of 16, so PyTorch's NCHW tensors are
copied into fresh blocked buffers and the result copied back, on every call. The
first test holds ``onednn_reorders``' list of copies to oneDNN's own verbose log
(which activation tensors it reorders in each pass); the others check the price:
bytes at the copy rate, page faults for a buffer glibc maps afresh, nothing for a
channels-last model, and a depthwise convolution's arithmetic at the GEMM rate (its
kernel runs 16 channels a vector, not one group at a time).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from crosscut.cost_models.analytic import node_times
from crosscut.cost_models.cpu_terms import (
    GLIBC_THRESHOLDS,
    ONEDNN_CALL_FLOPS,
    depthwise_fallbacks,
    onednn_reorders,
    runs_onednn,
)
from crosscut.cost_models.devices import cpu_spec
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph, OpNode
from tests.onednn_log import verbose_log

# (input channels, output channels, kernel, groups, input size), batch 2, stride 1
CASES = [
    (32, 32, 3, 1, 8),  # dense
    (3, 32, 3, 1, 8),  # an image stem: its input is read plain
    (32, 32, 3, 32, 8),  # depthwise, every pass on the depthwise kernel
    (32, 32, 5, 32, 8),  # depthwise, its weight gradient on the GEMM fallback
]

_VERBOSE = r"""
import sys, torch
from torch import nn
torch.set_num_threads(1)
for cin, cout, k, g, h in eval(sys.argv[1]):
    conv = nn.Conv2d(cin, cout, k, padding=k // 2, groups=g, bias=False)
    x = torch.randn(2, cin, h, h, requires_grad=True)
    conv(x).sum().backward()  # oneDNN builds its primitives on the first call
    print(f"=== F {cin} {cout} {k} {g} {h}", flush=True)
    y = conv(x)
    print("=== B", flush=True)
    y.sum().backward()
    print("=== E", flush=True)
"""


def _conv(cin: int, cout: int, k: int, g: int, h: int) -> tuple[OpGraph, OpNode]:
    conv = nn.Conv2d(cin, cout, k, padding=k // 2, groups=g, bias=False)
    graph = trace(nn.Sequential(conv).train(), torch.randn(2, cin, h, h), mode="train")
    (node,) = [n for n in graph.nodes if n.conv is not None]
    return graph, node


def _logged_copies() -> dict[tuple[int, ...], dict[str, list[int]]]:
    """case -> {"F": bytes of each activation reorder in the forward, "B": the backward's}."""
    out = verbose_log(_VERBOSE, CASES)
    seen: dict[tuple[int, ...], dict[str, list[int]]] = {}
    key: tuple[int, ...] = ()
    phase = ""
    for line in out.splitlines():
        if line.startswith("=== F"):
            key, phase = tuple(int(v) for v in line.split()[2:]), "F"
            seen[key] = {"F": [], "B": []}
        elif line.startswith("=== B"):
            phase = "B"
        elif line.startswith("=== E"):
            phase = ""  # the next case's first call builds its primitives
        elif phase and ",exec,cpu,reorder," in line and line.split(",")[-2].startswith("2x"):
            dims = [int(v) for v in line.split(",")[-2].split("x")]  # an activation: batch 2
            seen[key][phase].append(4 * math.prod(dims))
    return seen


def test_the_copies_priced_are_the_ones_onednn_logs() -> None:
    """Per pass, the bytes ``onednn_reorders`` copies equal those of the activation
    reorders in oneDNN's log: 2 copies forward and 4 backward for a dense or a depthwise
    convolution; a stem (its input read plain) 1 forward and 3 backward; 2 backward for a depthwise
    one whose weight gradient runs on the GEMM fallback."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: its CPU convolutions take another path")
    seen = _logged_copies()
    assert set(seen) == set(CASES)
    spec = cpu_spec("cpu", peak=100e9, mem_bw=1e9, page_fault_bw=0.0)
    for case, logged in seen.items():
        graph, node = _conv(*case)
        assert runs_onednn(graph, node)
        fwd, bwd = onednn_reorders(graph, node, spec)  # each copy read and written at 1 GB/s
        assert (fwd * 1e9 / 2, bwd * 1e9 / 2) == pytest.approx(
            (sum(logged["F"]), sum(logged["B"]))
        ), (case, logged)
    assert [len(seen[c]["F"]) for c in CASES] == [2, 1, 2, 2]
    assert [len(seen[c]["B"]) for c in CASES] == [4, 3, 4, 2]


def test_a_buffer_glibc_maps_afresh_is_faulted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 38.5 MB input (MobileNetV2's second depthwise convolution at 224 px, batch 8):
    above glibc's 32 MiB mmap threshold, so its blocked copy is mapped and faulted in at
    every call (measured: 9,409 faults, 20-30 ms a copy); under kept, no faults, only
    the bytes. The output (9.6 MB) is below the threshold: bytes only."""
    graph = trace(
        nn.Sequential(nn.Conv2d(96, 96, 3, stride=2, padding=1, groups=96, bias=False)).train(),
        torch.randn(8, 96, 112, 112, device="meta"),
        mode="train",
    )
    (node,) = [n for n in graph.nodes if n.conv is not None]
    inp, out = graph.node(node.inputs[0]).out_bytes, node.out_bytes
    assert inp >= GLIBC_THRESHOLDS["thresholds"][0] > out
    assert depthwise_fallbacks(graph, node) == (False, False)
    spec = cpu_spec("cpu", peak=100e9, mem_bw=25e9, page_fault_bw=2e9)
    monkeypatch.setenv("CROSSCUT_CPU_MALLOC", "kept")
    kept = onednn_reorders(graph, node, spec)
    assert kept == pytest.approx((2 * (inp + out) / 25e9, 4 * (inp + out) / 25e9))
    monkeypatch.setenv("CROSSCUT_CPU_MALLOC", "thresholds")
    fresh = onednn_reorders(graph, node, spec)
    assert fresh[0] == pytest.approx(kept[0] + inp / 2e9)  # the input's copy, forward
    assert fresh[1] == pytest.approx(kept[1] + 2 * inp / 2e9)  # input gradient, input again
    assert fresh[0] > 0.02  # what the copy took: 20-30 ms


def test_a_channels_last_model_copies_nothing_and_a_shard_copies_its_part() -> None:
    spec = cpu_spec("cpu", peak=100e9, mem_bw=25e9)
    x = torch.randn(2, 32, 8, 8).to(memory_format=torch.channels_last)
    conv = nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False)
    graph = trace(nn.Sequential(conv).train(), x, mode="train")
    (node,) = [n for n in graph.nodes if n.conv is not None]
    assert onednn_reorders(graph, node, spec) == (0.0, 0.0)
    graph, node = _conv(32, 32, 3, 1, 8)
    whole, half = onednn_reorders(graph, node, spec), onednn_reorders(graph, node, spec, 0.5)
    out = node.out_bytes
    assert whole[0] - half[0] == pytest.approx(2 * 0.5 * out / 25e9)  # the whole input still


def test_a_depthwise_convolution_runs_at_the_gemm_rate_on_a_cpu() -> None:
    """oneDNN's depthwise kernel runs 16 channels a vector: its forward is priced as a
    dense kernel's arithmetic (2 FLOPs a multiply-add at the GEMM rate) plus its bytes,
    its copies and its call, not at 1/17 of the rate (the group fraction GPUs keep)."""
    spec = cpu_spec("cpu", peak=100e9, mem_bw=25e9, page_fault_bw=0.0)
    graph, node = _conv(96, 96, 3, 96, 14)
    macs = 2 * 96 * 14 * 14 * 9
    moved = node.read_bytes + node.out_bytes
    copies = onednn_reorders(graph, node, spec)[0]
    call = ONEDNN_CALL_FLOPS["forward"] / 100e9
    expected = 2 * macs / 100e9 + moved / 25e9 + spec.launch_overhead_s + call + copies
    assert node_times(graph, node, spec)[0] == pytest.approx(expected)
    # channels-last inputs (ConvNeXt's) run other kernels, not claimed: the group fraction stays
    x = torch.randn(2, 96, 14, 14).to(memory_format=torch.channels_last)
    conv = nn.Conv2d(96, 96, 3, padding=1, groups=96, bias=False)
    cl_graph = trace(nn.Sequential(conv).train(), x, mode="train")
    (cl_node,) = [n for n in cl_graph.nodes if n.conv is not None]
    assert node_times(cl_graph, cl_node, spec)[0] > 2 * (expected - copies)
