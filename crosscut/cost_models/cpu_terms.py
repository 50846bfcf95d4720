"""Per-op CPU terms: the op kinds a CPU runs far from their roofline price.

Why a module of its own: ``op_terms.py`` holds what GPUs measured; these were
measured on a CPU (one core of an AMD EPYC with AVX-512, ``OMP_NUM_THREADS=1``,
PyTorch 2.14's CPU kernels) and hold for a CPU only. Per-node times of
LeNet, ResNet-18 and MobileNetV2 in whole training steps (``profiled.py``'s
context profiles) against the analytic prices at that core's own measured GEMM
and copy rates put convolutions, linears, activations and ``add`` at 0.5-1.4x
their time, but two kinds far off:

* an NCHW max pool's forward at 0.03-0.04x (8-12 ms priced 0.2-0.5 ms);
* a training batch norm at 0.2x forward and 0.5x backward.

Neither is a matter of bytes. PyTorch's NCHW max pool walks each output's window
one element at a time, in training and inference alike (a channels-last pool
vectorises across channels and runs near its bytes); a training batch norm
computes its statistics per channel with a running mean and variance, arithmetic
per element, before it normalises. Both run from cache, bound by the core's
instructions, not by DRAM. So both are priced in *FLOP-equivalents*: the time the
CPU's GEMM rate (``DeviceSpec.peak_flops``, what its convolutions are priced at)
takes for that many FLOPs. That keeps them in proportion to the CPU a spec
describes, where absolute rates would tie them to the core they were measured
on; and it follows what moves them: in one session here the kernels' times moved
by under 10 % while the copy rate (DRAM, shared with the host's other guests)
moved between 20.5 and 30.3 GB/s, and the GEMM rate, best of three, by 4 %.

Four more terms came later: a 1x1 convolution that PyTorch runs as ``Slow2d``, one
GEMM per sample as wide as its feature map, under 16 pixels (``SLOW2D_MAC_FLOPS``);
the fixed cost of every convolution oneDNN runs (``ONEDNN_CALL_FLOPS``); a depthwise
convolution's pass that oneDNN's depthwise kernels refuse, run as one small GEMM per
sample and channel (``depthwise_fallbacks``, ``DW_GEMM_FLOPS``); and the blocks glibc
maps afresh every step (``fresh_blocks``), whose pages are faulted in at the spec's
``page_fault_bw``.
"""

from __future__ import annotations

import math

from crosscut import cpu_malloc
from crosscut.cost_models.devices import DeviceSpec, compute_threads
from crosscut.cost_models.memory import (
    _PASS_GRAD,
    _VIEW,
    _itemsize,
    _key,
    _matches,
    _shares_storage,
    is_alias,
    saved_by,
)
from crosscut.ir.graph import OpGraph, OpNode

__all__ = [
    "CPU_BN_BWD_FLOPS",
    "CPU_BN_BWD_TINY_FLOPS",
    "CPU_BN_FWD_FLOPS",
    "CPU_ELEMENTWISE_FLOPS",
    "CPU_POOL_BWD_FLOPS",
    "CPU_POOL_OUTPUT_FLOPS",
    "CPU_POOL_TAP_FLOPS",
    "DW_GEMM_FLOPS",
    "GLIBC_THRESHOLDS",
    "ONEDNN_CALL_FLOPS",
    "SLOW2D_MAC_FLOPS",
    "cpu_node_times",
    "depthwise_fallback",
    "depthwise_fallbacks",
    "elementwise_arithmetic",
    "fresh_blocks",
    "fresh_seconds",
    "onednn_convolution",
    "onednn_reorders",
    "roofline",
    "runs_onednn",
    "runs_slow2d",
]

# FLOP-equivalents of an NCHW max pool's forward: per output, and per tap of its window
# (kernel height x width). Measured (benchmarks/cpu_kernels.py, one EPYC core, Gaussian
# inputs; docs/benchmarks/cpu-kernels.json): 2,120-2,190 per output for 2x2 stride 2
# and 2,880-2,960 for 3x3 stride 2, the same under no_grad (this gives 2,146 and
# 2,916); 3x3 stride 1 2,280-2,330 (priced 1.26x: overlapping windows hit the cache).
# The loop branches on every compare, so its time follows the data: over zeros it ran
# 2.8x faster, over ReLU outputs 1.3x faster (2x2) or the same (3x3, ResNet-18 in context).
CPU_POOL_OUTPUT_FLOPS = 1530.0
CPU_POOL_TAP_FLOPS = 154.0
# The training backward, a scatter of each output's gradient to its argmax: 95-264 per output.
CPU_POOL_BWD_FLOPS = 120.0
# FLOP-equivalents per element of a training batch norm, forward and backward.
# Measured on the same core: forward 176-223 at 16 to 1,024 pixels per channel, 317-348
# at 2x2; backward 52-113, but about 1,300 at 2x2 (PyTorch's backward takes a slow path
# at some small spatial sizes, 2x2 and 5x5 among them: 55-75 ns a channel).
CPU_BN_FWD_FLOPS = 190.0
CPU_BN_BWD_FLOPS = 70.0
# The backward's slow path on planes of at most 4 pixels (1x1, 2x2): 1,326-1,374 per element
# in the record (16x512 and 16x960 channels at 2x2), 1,349-1,830 at 2x2 and 598-2,526 at
# 1x1 in a later scratch grid (96-960 channels); 3x3 and 2x4 planes ran at 193-460 (not priced).
CPU_BN_BWD_TINY_FLOPS = 1400.0


# FLOP-equivalents per element of the activations a CPU core computes rather than streams:
# each evaluates exp, erf or log1p per element, tens to hundreds of FLOPs of vector
# instructions, more than its bytes take from DRAM (8 a forward element: ~28 FLOP-
# equivalents at this core's rates). (forward, backward); 0: that pass runs at its bytes
# (sigmoid's and tanh's backward use their output). Measured on one EPYC core, float32,
# 0.15-3.6 M elements, the same per element at every size (a memory-bound ReLU's grew
# 2.4x): docs/benchmarks/cpu-kernels-act.json, re-priced by tests/test_cpu_terms.py.
# GELU is the erf form (``approximate="tanh"`` ran 152/176, priced as erf). ELU, softplus
# and log-sigmoid ran ~17 ns a negative element in a fresh process (~850-930 an element
# on Gaussian inputs, priced here) and 120-140 once the process had run a Mish: their
# time depends on the process's history, which no price can know.
CPU_ELEMENTWISE_FLOPS: dict[str, tuple[float, float]] = {
    "sigmoid": (39.0, 0.0),
    "silu": (40.0, 52.0),
    "gelu": (48.0, 92.0),
    "exp": (75.0, 0.0),
    "tanh": (245.0, 0.0),
    "mish": (350.0, 408.0),
    "elu": (845.0, 54.0),
    "softplus": (915.0, 54.0),
    "log_sigmoid": (925.0, 0.0),
}


# FLOP-equivalents per multiply-add of a 1x1 convolution PyTorch runs as ``Slow2d`` (one
# GEMM per sample, as wide as the feature map's pixels), by pixels per sample: (forward,
# input gradient, weight gradient). A GEMM under 16 columns wide starves the BLAS kernel.
# Measured on one EPYC core at batch 8 (six channel shapes of DenseNet's and MobileNetV2's
# 1x1 convolutions, 32-960 channels): at 2x2 and 3x3 pixels the forward ran at 6-8
# GFLOP/s against 98 for a large GEMM (0.17-0.37 ns a multiply-add), the input gradient
# at 0.19-0.86 ns; at 1x1 0.06-0.15 and 0.10-0.86; from 4x4 (16 columns) at the roofline.
# Rows re-priced by tests/test_cpu_terms.py: docs/benchmarks/cpu-kernels-slow2d.json.
SLOW2D_MAC_FLOPS: dict[str, tuple[float, float, float]] = {
    "one pixel": (11.0, 17.0, 15.0),
    "under 16 pixels": (26.0, 36.0, 4.5),
}


def runs_slow2d(graph: OpGraph, node: OpNode, threads: int | None = None) -> bool:
    """PyTorch runs the fp32 convolution ``node`` on a CPU as ``Slow2d`` (per-sample GEMMs)
    instead of oneDNN: ATen's ``use_mkldnn`` rule (``torch._C._select_conv_backend`` says
    which), a 1x1 stride-1 undilated convolution at batch under 16 on one thread, whose
    oneDNN kernels it judges slower there; or one whose input is tiny (a batch of one,
    ungrouped, kernel not above 3x3, at most 20,480 elements in)."""
    conv = node.conv
    if conv is None or conv["transposed"] or node.dtype != "float32" or not node.inputs:
        return False
    shape = graph.node(node.inputs[0]).shapes[0] if graph.node(node.inputs[0]).shapes else []
    if len(shape) != 4 or len(conv["kernel"]) != 2:
        return False
    batch, one_by_one = int(shape[0]), conv["kernel"] == [1, 1]
    strided = any(v != 1 for v in conv["stride"]) or any(v != 1 for v in conv["dilation"])
    threads = compute_threads() if threads is None else threads
    wide = strided or batch >= 16 or not one_by_one or threads > 1
    large = (
        conv["groups"] > 1
        or min(conv["kernel"]) > 3
        or batch > 1
        or math.prod(int(v) for v in shape) > 20480
    )
    return not (wide and large)


def _slow2d_times(
    graph: OpGraph, node: OpNode, spec: DeviceSpec, part: float
) -> tuple[float, float] | None:
    """A 1x1 ``Slow2d`` convolution under 16 pixels a sample, priced per multiply-add."""
    if node.conv is None or node.conv["kernel"] != [1, 1] or not node.shapes:
        return None
    if not runs_slow2d(graph, node):
        return None
    pixels = math.prod(int(v) for v in node.shapes[0][2:])
    if pixels >= 16:
        return None
    fwd, grad_in, grad_w = SLOW2D_MAC_FLOPS["one pixel" if pixels == 1 else "under 16 pixels"]
    macs, rate, launch = (
        node.fwd_flops / 2.0 * part,
        max(spec.peak("float32"), 1.0),
        spec.launch_overhead_s,
    )
    if graph.mode != "train":
        return macs * fwd / rate + launch, 0.0
    return macs * fwd / rate + launch, macs * (grad_in + grad_w) / rate + 2.0 * launch


def _elements(shape: list[int] | None) -> int:
    return math.prod(shape) if shape else 0


# FLOP-equivalents of oneDNN's fallback for a depthwise convolution's pass that its
# depthwise kernels refuse (``x64:gemm:jit``: im2col, then one GEMM per sample and channel):
# per plane (one sample's channel) and per multiply-add. Fitted to 120 weight gradients
# timed apart on one EPYC core (3x3 and 5x5, strides 1 and 2, 1-32 px, 96-960 channels,
# batch 16 and 32): 160-530 ns a plane at 1-4 output pixels, 0.6-1.5 ns a multiply-add
# beyond (1-1.7 GMAC/s; the depthwise kernel reaches 2-14); the fit prices them at
# 0.45-1.50x, 72 % within 25 % (the rest is the grid's noise: neighbouring shapes differ by
# 2x). The forward fallback (5x5 and 7x7 at 1-2 px) ran at the same ~290 ns a plane.
DW_GEMM_FLOPS: dict[str, float] = {"plane": 22000.0, "multiply-add": 78.0}


def _end_pad(start: int, out: int, size: int, stride: int, kernel: int) -> int:
    """oneDNN's end padding: how far past the input the last output's window reaches."""
    return (out - 1) * stride + kernel - (size + start)


def _dw_forward_ok(i: int, o: int, k: int, s: int, p: int) -> bool:
    """One axis of oneDNN's depthwise forward kernel: no window wholly in the padding, and
    the padding at either end within a block of up to 6 outputs (AVX-512)."""
    block = min(6, o)
    if k <= p or k <= _end_pad(p, o, i, s, k):
        return False
    return p <= block and max(0, _end_pad(p, o - o % block, i, s, k)) <= block


def _dw_weight_grad_ok(i: int, o: int, k: int, s: int, p: int) -> bool:
    """One axis of oneDNN's depthwise weight-gradient kernel: padding at most half the
    kernel (a multiple of the stride beyond 1), an input that holds the whole kernel."""
    end = max(0, _end_pad(p, o, i, s, k))
    return (
        max(p, end) <= k // 2
        and i >= k + (-p) % s
        and (p <= 1 or p % s == 0)
        and (end <= 1 or end % s == 0)
        and o == (i + p + end - k) // s + 1
    )


def depthwise_fallbacks(graph: OpGraph, node: OpNode) -> tuple[bool, bool]:
    """(forward, weight gradient): which passes of the fp32 NCHW depthwise convolution
    ``node`` oneDNN runs on its GEMM fallback instead of its depthwise kernels.

    The rules restate the checks oneDNN's AVX-512 depthwise kernels make before they
    accept a shape (``jit_uni_dw_conv`` in the oneDNN PyTorch 2.14 bundles);
    ``ONEDNN_VERBOSE=1`` named the same kernel as these rules on 246 forward and 120
    weight-gradient shapes (kernels 3, 5 and 7, strides 1 and 2, padding 0 to k-1, inputs
    of 1-15 px). The forward falls back only on tiny inputs (5x5 at 1 px, or 1-2 px at
    stride 2; 7x7 at 1-2 px); the weight gradient on every kernel wider than 3 (each
    5x5 and 7x7 depthwise convolution of EfficientNet, MNASNet, MobileNetV3 and ConvNeXt),
    dilation, and inputs shorter than the kernel (3x3 at 1-2 px, 1-3 px at stride 2).
    The input gradient always runs the depthwise kernel. (False, False) where the rule
    does not apply: another dtype, a channel multiplier, a 1-D or 3-D convolution, a
    graph traced without padding, and an input laid out channels-last (ConvNeXt's,
    whose blocks hand on permuted tensors), whose kernels and costs differ: there
    ConvNeXt's 7x7 weight gradients ran at 5.9 us a plane at 16x16 px (NCHW: 14) and
    3.4 us at 2x2 (NCHW: 0.6), not priced yet."""
    conv = node.conv
    if conv is None or conv["transposed"] or "padding" not in conv or not node.inputs:
        return False, False
    src = graph.node(node.inputs[0]).shapes
    shape_in, shape_out = (src[0] if src else []), (node.shapes[0] if node.shapes else [])
    if node.dtype != "float32" or graph.channels_last or conv.get("channels_last"):
        return False, False
    if len(shape_in) != 4:
        return False, False
    if len(shape_out) != 4 or not int(conv["groups"]) == shape_in[1] == shape_out[1]:
        return False, False
    axes = list(zip(shape_in[2:], shape_out[2:], conv["kernel"], conv["stride"], conv["padding"]))
    dilated = [(d - 1) * (k - 1) for d, k in zip(conv["dilation"], conv["kernel"])]
    fwd_ok = all(_dw_forward_ok(i, o, k + e, s, p) for (i, o, k, s, p), e in zip(axes, dilated))
    kw, sw = conv["kernel"][1], conv["stride"][1]
    grad_ok = (
        kw <= 3 and sw <= kw and not any(dilated) and all(_dw_weight_grad_ok(*a) for a in axes)
    )
    return not fwd_ok, not grad_ok


def depthwise_fallback(
    graph: OpGraph, node: OpNode, spec: DeviceSpec, part: float, times: tuple[float, float]
) -> tuple[float, float]:
    """``times`` (the roofline's forward and backward seconds of ``node``) with each pass
    :func:`depthwise_fallbacks` finds on the GEMM fallback priced at :data:`DW_GEMM_FLOPS`
    instead: the whole forward, or the weight gradient's half of the backward."""
    on_gemm = depthwise_fallbacks(graph, node)
    if not any(on_gemm):
        return times
    n, c, oh, ow = (int(v) for v in node.shapes[0])
    taps = math.prod(int(k) for k in node.conv["kernel"]) if node.conv else 1
    flops = n * c * part * (DW_GEMM_FLOPS["plane"] + DW_GEMM_FLOPS["multiply-add"] * oh * ow * taps)
    cost, launch = flops / max(spec.peak("float32"), 1.0), spec.launch_overhead_s
    fwd, bwd = times
    if on_gemm[0]:
        fwd = cost + launch
    if on_gemm[1] and graph.mode == "train":
        bwd = bwd / 2.0 + cost + launch
    return fwd, bwd


# FLOP-equivalents each oneDNN convolution call costs beyond the spec's launch overhead
# (10 us a kernel on the cpu preset), whatever its size: PyTorch builds the primitive and
# reorders the weights on every call. Measured in context on one EPYC core: chains of 40
# tiny convolutions (1x1, 3x3 and depthwise 3x3, 16 channels, 2-4 px, batch 16) in
# training steps, against chains of scalar multiplies: 52-57 us a forward and 91-114 us
# a backward (input and weight gradients, one call) beyond them, where the price charged
# 10 and 20; at that run's ~97 GFLOP/s the rest is about 4.4 and 7.8 million. MobileNetV2
# has 52 such convolutions: 7 ms a step, 5-6 % at 64 px.
ONEDNN_CALL_FLOPS: dict[str, float] = {"forward": 4.4e6, "backward": 7.8e6}


def runs_onednn(graph: OpGraph, node: OpNode) -> bool:
    """PyTorch runs the fp32 2-D convolution ``node`` on a CPU through oneDNN (not as
    ``Slow2d``: :func:`runs_slow2d`)."""
    conv = node.conv
    if conv is None or conv["transposed"] or node.dtype != "float32" or not node.inputs:
        return False
    src = graph.node(node.inputs[0]).shapes
    if not src or len(src[0]) != 4 or len(conv["kernel"]) != 2:
        return False
    return not runs_slow2d(graph, node)


def onednn_convolution(
    graph: OpGraph, node: OpNode, spec: DeviceSpec, part: float, times: tuple[float, float]
) -> tuple[float, float]:
    """``times`` (the roofline's forward and backward of ``node`` on the CPU ``spec``) as
    oneDNN runs the convolution: each call's fixed cost (:data:`ONEDNN_CALL_FLOPS`,
    whole for a channel shard, as the launch) and a depthwise pass on the GEMM fallback
    (:func:`depthwise_fallback`). Anything else comes back unchanged."""
    if not runs_onednn(graph, node):
        return times
    fwd, bwd = depthwise_fallback(graph, node, spec, part, times)
    rate = max(spec.peak("float32"), 1.0)
    copy_fwd, copy_bwd = onednn_reorders(graph, node, spec, part)
    fwd += ONEDNN_CALL_FLOPS["forward"] / rate + copy_fwd
    if graph.mode == "train":
        bwd += ONEDNN_CALL_FLOPS["backward"] / rate + copy_bwd
    return fwd, bwd


def onednn_reorders(
    graph: OpGraph, node: OpNode, spec: DeviceSpec, part: float = 1.0
) -> tuple[float, float]:
    """(forward, backward) seconds of the layout copies oneDNN makes around the NCHW
    convolution ``node``: its kernels take channels in blocks of 16 (``aBcd16b``), so
    ``ONEDNN_VERBOSE`` shows every call reorder its activations into fresh blocked
    buffers and its result back. Forward: the input in, the output out. Backward: the
    output gradient in and the input gradient out (data gradient), then the input and
    the output gradient in again (weight gradient). A depthwise pass on the GEMM
    fallback (:func:`depthwise_fallbacks`) takes plain layouts, and a dense convolution
    with under 16 input channels (an image stem) reads its input plain
    (``tests/test_onednn_reorders.py`` holds this list to oneDNN's log). Each copy
    reads and writes its bytes at ``spec.mem_bw``; a buffer of at least glibc's mmap threshold (the
    setting's, :data:`GLIBC_THRESHOLDS`; none under kept) is mapped afresh and
    faulted in at ``spec.page_fault_bw``: measured, a 38.5 MB input's copy took
    20-30 ms (9,409 faults a call) where a 14.5 MB one took 1.5 ms. A channels-last
    model has no copies. A shard copies its whole input and ``part`` of its output."""
    if graph.channels_last or (node.conv or {}).get("channels_last") or not node.inputs:
        return 0.0, 0.0
    src = graph.node(node.inputs[0])
    inp, out = float(src.out_bytes), node.out_bytes * part
    setting = cpu_malloc.mode()
    mmap_at = GLIBC_THRESHOLDS[setting][0] if setting in GLIBC_THRESHOLDS else None
    faults = spec.page_fault_bw if spec.page_fault_bw > 0 else 0.0

    def seconds(buffers: list[float]) -> float:
        moved = 2.0 * sum(buffers) / max(spec.mem_bw, 1.0)
        fresh = sum(b for b in buffers if mmap_at is not None and b >= mmap_at)
        return moved + (fresh / faults if faults else 0.0)

    gemm_fwd, gemm_grad = depthwise_fallbacks(graph, node)  # the GEMM takes plain layouts
    shape = src.shapes[0] if src.shapes else []
    narrow = (node.conv or {}).get("groups") == 1 and len(shape) == 4 and int(shape[1]) < 16
    src_in = [] if narrow else [inp]  # an image stem's kernels read few channels plain
    fwd = [] if gemm_fwd else [*src_in, out]
    bwd = [out, inp] + ([] if gemm_grad else [*src_in, out])
    return seconds(fwd), seconds(bwd) if graph.mode == "train" else 0.0


def cpu_node_times(
    graph: OpGraph, node: OpNode, spec: DeviceSpec, part: float = 1.0
) -> tuple[float, float] | None:
    """(forward, backward) seconds of ``node`` on the CPU ``spec`` where a CPU term
    applies (an NCHW max pool; a training batch norm; a narrow 1x1 ``Slow2d``
    convolution), else ``None``: the roofline prices it. ``part`` is the share of the
    node's channels a shard computes; the launch overhead stays whole, as in
    ``analytic.node_times``."""
    train = graph.mode == "train"
    launch = spec.launch_overhead_s
    rate = max(spec.peak("float32"), 1.0)
    out = _elements(node.shapes[0] if node.shapes else None) * part
    if node.pool is not None and not graph.channels_last:  # node.pool: max pools only
        taps = math.prod(int(k) for k in node.pool["kernel"])
        fwd = out * (CPU_POOL_OUTPUT_FLOPS + taps * CPU_POOL_TAP_FLOPS) / rate + launch
        return fwd, (out * CPU_POOL_BWD_FLOPS / rate + launch) if train else 0.0
    if train and "batch_norm" in node.kind:
        shape = node.shapes[0] if node.shapes else []
        tiny = len(shape) == 4 and int(shape[2]) * int(shape[3]) <= 4
        bwd = CPU_BN_BWD_TINY_FLOPS if tiny else CPU_BN_BWD_FLOPS
        return out * CPU_BN_FWD_FLOPS / rate + launch, out * bwd / rate + launch
    return _slow2d_times(graph, node, spec, part)


def elementwise_arithmetic(
    node: OpNode, spec: DeviceSpec, part: float = 1.0
) -> tuple[float, float]:
    """(forward, backward) seconds of ``node``'s per-element arithmetic on the CPU
    ``spec`` (:data:`CPU_ELEMENTWISE_FLOPS` at its GEMM rate), (0, 0) for any other
    op or device. ``analytic.node_times`` takes the larger of this and the bytes: the
    core streams while it computes (SiLU ran at 1.0-1.1x its arithmetic from 1 to 16
    MB). Measured in context, EfficientNet-B0's 49 SiLUs ran their forward at 2.3x
    their price by bytes."""
    flops = CPU_ELEMENTWISE_FLOPS.get(node.kind.lower())
    if flops is None or not spec.device.startswith("cpu"):
        return 0.0, 0.0
    n = _elements(node.shapes[0] if node.shapes else None) * part / max(spec.peak("float32"), 1.0)
    return n * flops[0], n * flops[1]


def roofline(compute_s: float, memory_s: float, cpu: bool) -> float:
    """A kernel's seconds from its arithmetic's and its data movement's: the larger on a
    GPU, whose thousands of threads in flight hide one behind the other; their sum on
    a CPU core, which runs a small convolution's packing and layout reorders (oneDNN's
    NCHW to blocked and back) apart from its multiply-adds. Measured on one EPYC core,
    seven NCHW 1x1 convolutions of MobileNetV2's shapes (batch 16, 2-16 px, 24-960
    channels) ran their forward at 1.15-1.69x the larger of FLOPs at the GEMM rate and
    bytes at the copy rate, and at 0.97-1.34x their sum; MobileNetV2's 52 convolutions
    in whole steps went from 0.65-0.76x to 0.79-0.83x of their time, ResNet-18's 3x3
    ones (compute-bound) moved by 2 %."""
    return compute_s + memory_s if cpu else max(compute_s, memory_s)


# glibc's malloc under each ``CROSSCUT_CPU_MALLOC`` setting (cpu_malloc.py): (mmap threshold,
# trim threshold). A block of at least the mmap threshold gets a mapping of its own, and
# the kernel faults its pages in at first touch, unless a free chunk of the heap holds it;
# the heap's top goes back to the kernel once more than the trim threshold is free there.
# glibc's own defaults ("off") raise the mmap threshold to the largest block freed, at most
# 32 MiB, and the trim threshold to twice that. Under "kept" nothing is mapped on its own.
GLIBC_THRESHOLDS: dict[str, tuple[int, int]] = {
    "thresholds": (32 << 20, 1 << 30),
    "off": (32 << 20, 64 << 20),
}


def _blocks(graph: OpGraph, node: OpNode) -> tuple[list[int], list[int]]:
    """(blocks a forward allocates, blocks its backward allocates), in bytes."""
    if node.is_io or node.op == "get_attr":
        return [], []
    fwd: list[int] = []
    if not is_alias(graph, node):
        fwd = [_elements(s) * _itemsize(node) for s in node.shapes] or [node.out_bytes]
    elif not _shares_storage(graph, node):  # in place, but autograd saves a copy of the input
        fwd = [node.out_bytes]
    fwd += [extra] if (extra := saved_by(graph, node)[1]) else []
    if graph.mode != "train":
        return fwd, []
    bwd = [node.param_bytes] if node.param_bytes else []
    kind, tgt = _key(node)
    if not (kind in _VIEW or tgt in _VIEW or _matches(node, _PASS_GRAD)):
        data = [graph.node(i) for i in node.inputs]
        bwd += [p.out_bytes for p in data if p.op not in ("placeholder", "get_attr")]
    return fwd, bwd


def fresh_blocks(graph: OpGraph, setting: str | None = None) -> dict[str, tuple[int, int]]:
    """Node -> (forward bytes, backward bytes) that one step maps afresh under glibc's
    ``setting`` (default: ``cpu_malloc.mode()``, what this process runs under), the
    blocks whose pages it faults in every step.

    Why it is priced: measured on dev-2c under the default setting, VGG-11-BN's 392 MiB
    classifier weight gradient was mapped afresh at every step (117,000 faults, about
    a quarter of the step), and ResNet-50 at 224 px and batch 32 mapped 4.5-7.7 GB a
    step (12-14 s against 9.7-10 s with nothing mapped; docs/benchmarks/cpu-preset-faults.txt).

    Which blocks, by glibc's rules: every block of at least the mmap threshold, when
    the step's smaller blocks (``H``, their sum: an upper bound on the heap they keep)
    exceed the trim threshold, since the heap then goes back to the kernel at each
    step's end and no free chunk is left to hold a large block; otherwise only the
    blocks larger than ``H``, which no free chunk of the heap can hold. Blocks between
    the two (a 32-37 MiB activation beside a heap of hundreds of MiB) were mapped in
    some steps and not others (MobileNetV2 at 224 px, batch 8: 2-3 of its nine) and
    are not priced: the price is a floor."""
    chosen = cpu_malloc.mode() if setting is None else setting
    if chosen not in GLIBC_THRESHOLDS:
        return {}
    mmap_at, trim_at = GLIBC_THRESHOLDS[chosen]
    blocks = {n.name: _blocks(graph, n) for n in graph.nodes}
    grads = [n.param_bytes for n in graph.nodes] if graph.mode == "train" else []
    small = [b for f, _ in blocks.values() for b in f] + grads
    heap = sum(b for b in small if b < mmap_at)

    def mapped(sizes: list[int]) -> int:
        return sum(b for b in sizes if b >= mmap_at and (heap > trim_at or b > heap))

    out = {name: (mapped(f), mapped(w)) for name, (f, w) in blocks.items()}
    return {name: fw for name, fw in out.items() if fw != (0, 0)}


def fresh_seconds(graph: OpGraph, spec: DeviceSpec) -> dict[str, tuple[float, float]]:
    """:func:`fresh_blocks` at ``spec.page_fault_bw`` (none where it is 0, as on a GPU)."""
    if spec.page_fault_bw <= 0 or not spec.device.startswith("cpu"):
        return {}
    rate = spec.page_fault_bw
    return {name: (f / rate, b / rate) for name, (f, b) in fresh_blocks(graph).items()}
