"""The math a convolution or matmul runs in, its achieved rate, and what it costs.

Why a module apart from ``analytic.py``: which kernels a node with FLOPs runs is a
question of its own, with its own evidence. PyTorch picks the math mode from its
switches (:class:`MathFlags`: TF32 for convolutions on by default, for matmuls off);
the generation's achieved fractions, a reduction-depth and an occupancy ramp give the
rate (``efficiency.py``); a model left in NCHW pays cuDNN's transposes around every
tensor-core convolution (:func:`nchw_transposes`). And where a convolution would run on
tensor cores (TF32, or 16-bit data), cuDNN's autotuner (``torch.backends.cudnn.benchmark``,
on in the published training scripts) also times its fp32 kernels (pseudo-half for 16-bit
data), Winograd among them, and keeps the faster
(:func:`conv_choice`): on an A100 or H100 TF32 wins every convolution; on GA10x and Ada
parts, whose TF32 rate is at or below their fp32 rate, a 3x3 convolution runs fp32
Winograd (Lambda's ResNet-50 rows: RTX 3090 priced 0.61 of its published TF32 rate
with TF32 forced, 0.95 with the choice; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from crosscut.cost_models.cpu_terms import roofline
from crosscut.cost_models.devices import DeviceSpec
from crosscut.cost_models.efficiency import (
    GROUP_OUT_HALF,
    GROUP_OUT_HALF_TENSOR,
    GROUPED_TF32,
    TENSOR_MIN_CHANNELS,
    WINOGRAD,
    Efficiency,
    MathMode,
    efficiency_of,
    math_mode,
    sm_count,
)
from crosscut.cost_models.op_terms import _HALF, inputs_per_group
from crosscut.ir.graph import OpGraph, OpNode

__all__ = [
    "BWD_BYTES_FACTOR",
    "NCHW_BWD_KERNELS",
    "NCHW_FWD_KERNELS",
    "MathFlags",
    "conv_choice",
    "flop_times",
    "narrow_input",
    "nchw_transposes",
    "node_mode",
    "pays_transposes",
    "priced_mode",
    "weight_cast",
    "winograd",
]

BWD_BYTES_FACTOR = 2.0  # backward moves about twice the forward's bytes (analytic.py)
# NCHW tensor-core convolutions: tensors cuDNN transposes to NHWC and back (read + write
# each), and the transpose kernels, per pass (nchw_transposes)
NCHW_FWD_KERNELS, NCHW_BWD_KERNELS = 2.0, 3.0


@dataclass(frozen=True)
class MathFlags:
    """PyTorch's TF32 switches: convolutions (cuDNN, on by default) and matmuls (off)."""

    tf32_conv: bool = True
    tf32_matmul: bool = False

    @classmethod
    def from_torch(cls) -> MathFlags:
        """The flags as this process has them (what the runtime will use)."""
        return cls(
            bool(torch.backends.cudnn.allow_tf32), bool(torch.backends.cuda.matmul.allow_tf32)
        )

    @classmethod
    def of(cls, tf32: bool | None) -> MathFlags:
        """``tf32`` given: both switches set to it; None: this process's flags."""
        return cls.from_torch() if tf32 is None else cls(tf32, tf32)


def _elements(node: OpNode) -> int:
    return math.prod(node.shapes[0]) if node.shapes and node.shapes[0] else 0


def node_mode(node: OpNode, spec: DeviceSpec, flags: MathFlags) -> MathMode:
    """The math ``node`` runs in on ``spec`` (a grouped convolution never in TF32:
    :data:`~crosscut.cost_models.efficiency.GROUPED_TF32`)."""
    conv = "conv" in node.kind
    return math_mode(
        spec.peak_flops,
        spec.kind,
        node.dtype,
        conv=conv,
        tf32_conv=flags.tf32_conv and (GROUPED_TF32 or _groups(node) == 1),
        tf32_matmul=flags.tf32_matmul,
        depthwise=_depthwise(node),
        narrow=narrow_input(node),
    )


def narrow_input(node: OpNode) -> bool:
    """A dense convolution with fewer input channels than
    :data:`~crosscut.cost_models.efficiency.TENSOR_MIN_CHANNELS` (an image stem). Grouped
    ones are priced by their outputs per group (``GROUP_OUT_HALF``) and depthwise ones
    on the CUDA cores for their own reason."""
    if node.conv is None or _groups(node) > 1 or not node.shapes or not node.shapes[0]:
        return False
    return 0 < round(inputs_per_group(node)) < TENSOR_MIN_CHANNELS


def _depthwise(node: OpNode) -> bool:
    """One input and one output channel per group (a channel multiplier of one)."""
    g = _groups(node)
    if g == 1 or node.conv is None or not node.shapes or len(node.shapes[0]) < 2:
        return False
    return int(node.shapes[0][1]) == g and round(inputs_per_group(node)) == 1


def _groups(node: OpNode) -> int:
    """A convolution's groups (1 for a dense one and for every other op)."""
    return 1 if node.conv is None else int(node.conv["groups"])


def winograd(node: OpNode) -> bool:
    """Whether cuDNN can run ``node`` as a Winograd convolution: dense, 3x3, stride 1,
    no dilation (what its fp32 heuristics pick for such layers)."""
    c = node.conv
    return (
        c is not None
        and _groups(node) == 1
        and not c["transposed"]
        and all(k == 3 for k in c["kernel"])
        and all(v == 1 for v in (*c["stride"], *c["dilation"]))
    )


def _compute_rate(
    node: OpNode, spec: DeviceSpec, eff: Efficiency, mode: MathMode, part: float = 1.0
) -> float:
    """Achieved FLOP/s of a conv/GEMM node: peak × e_max × depth ramp × size ramp
    (``part`` of its output channels: the same depth, ``part`` of the outputs)."""
    out = _elements(node) * part
    frac = {"tensor": eff.tensor, "tf32": eff.tf32}.get(mode.unit, eff.fma)
    if eff.depth_half > 0 and out > 0:
        depth = node.fwd_flops / (2.0 * out)  # multiply-adds per output: Cin/groups·kh·kw
        frac *= depth / (depth + eff.depth_half)
        half_fill = sm_count(spec.kind) * 4096.0
        frac *= out / (out + half_fill)
        if mode.unit == "fma" and winograd(node):
            frac *= WINOGRAD  # FLOPs counted as direct convolution, run with fewer (cuDNN)
    nchw_dw = _depthwise(node) and not (node.conv or {}).get("channels_last")
    if _groups(node) > 1 and node.shapes[0] and not (eff.generation == "cpu" and nchw_dw):
        frac *= _group_fraction(node, eff, mode)  # oneDNN's NCHW depthwise: 16 channels a lane
    return mode.peak * max(frac, 1e-6)


def _group_fraction(node: OpNode, eff: Efficiency, mode: MathMode) -> float:
    """The share of a dense kernel's rate a grouped convolution reaches: each input a
    kernel loads feeds only its group's ``n`` output channels, ``n / (n + half)``, with
    the half of the kernels that run it: :data:`GROUP_OUT_HALF`, or on a GPU's tensor
    cores :data:`GROUP_OUT_HALF_TENSOR` (an MMA tile is wider than a small group)."""
    per_group = node.shapes[0][1] / _groups(node)
    tensor = eff.generation != "cpu" and mode.unit == "tensor"
    half = GROUP_OUT_HALF_TENSOR if tensor else GROUP_OUT_HALF
    return per_group / (per_group + half)


def nchw_transposes(node: OpNode, part: float = 1.0) -> tuple[float, float]:
    """(forward, backward) bytes cuDNN moves to run an NCHW convolution on tensor cores.

    Tensor cores take NHWC tiles, so for a model left in PyTorch's default NCHW
    layout cuDNN transposes around each 16-bit or TF32 convolution: forward its input
    and its output (each read and written once); backward the incoming
    gradient for each of the data- and weight-gradient kernels, the input for
    the weight gradient, and the input gradient it writes. Priced as that
    memory traffic (a shard transposes its whole input, ``part`` of its
    output). Checked against NCHW AMP measurements in docs/BENCHMARKS.md (the
    ``lambda`` and DLPerf rows): it accounts for the V100's gap, most of the
    A100's and H100's. TF32 pays the same since the sixteenth session: an H100
    ran ResNet-50's TF32 convolutions 19 ms (1.44x) slower NCHW than
    channels-last, and with no transposes priced, VGG-16 and channels-last TF32
    were priced 0.77-0.82 of their measured speed."""
    inp = max(0, node.read_bytes - node.param_bytes)
    out = node.out_bytes * part
    return 2.0 * (inp + out), 2.0 * (inp + 2.0 * out)


def pays_transposes(graph: OpGraph, node: OpNode, mode: MathMode) -> bool:
    """Whether ``node`` is a convolution cuDNN runs on tensor cores (16-bit or TF32) in a
    model left NCHW: tensor-core kernels take NHWC tiles (:func:`nchw_transposes`)."""
    return mode.unit in ("tensor", "tf32") and node.conv is not None and not graph.channels_last


def flop_times(
    graph: OpGraph,
    node: OpNode,
    spec: DeviceSpec,
    mode: MathMode,
    part: float,
    moved: float,
    cast_kernels: tuple[float, float],
) -> tuple[float, float]:
    """(forward, backward) seconds of a convolution or matmul ``node`` in ``mode``."""
    eff = efficiency_of(spec.kind, spec.device)
    bw, launch, train = spec.mem_bw * eff.memory, spec.launch_overhead_s, graph.mode == "train"
    cast, kernels = cast_kernels
    rate = _compute_rate(node, spec, eff, mode, part)
    t_fwd = t_bwd = 0.0  # NCHW transposes around a tensor-core convolution
    if pays_transposes(graph, node, mode):
        b_fwd, b_bwd = nchw_transposes(node, part)
        t_fwd = b_fwd / bw + NCHW_FWD_KERNELS * launch
        t_bwd = b_bwd / bw + NCHW_BWD_KERNELS * launch
    cpu = eff.generation == "cpu"  # arithmetic and data movement add up on a CPU core
    fwd = roofline(node.fwd_flops * part / rate, moved / bw, cpu) + cast / bw + t_fwd
    fwd += kernels * launch
    bwd_kernels = 2.0 if node.param_bytes > 0 else 1.0  # data and weight gradients
    bwd = roofline(node.bwd_flops * part / rate, BWD_BYTES_FACTOR * moved / bw, cpu) + cast / bw
    return fwd, bwd + (bwd_kernels + kernels - 1.0) * launch + t_bwd if train else 0.0


def conv_choice(
    graph: OpGraph,
    node: OpNode,
    spec: DeviceSpec,
    flags: MathFlags,
    part: float,
    moved: float,
    cast_kernels: tuple[float, float],
) -> tuple[MathMode, tuple[float, float]]:
    """The math ``node`` is priced in and its (forward, backward) seconds: its mode
    (:func:`node_mode`), or, for a convolution on tensor cores (TF32 or 16-bit), cuDNN's
    fp32 kernels where those are faster (module docstring)."""
    mode = node_mode(node, spec, flags)
    times = flop_times(graph, node, spec, mode, part, moved, cast_kernels)
    if mode.unit in ("tf32", "tensor") and node.conv is not None:
        short = {"float16": "fp16 storage, ", "bfloat16": "bf16 storage, "}.get(node.dtype, "")
        pick = f"{short}fp32 FMA (cuDNN's pick over tensor cores)"  # pseudo-half: fp32 math
        fma = MathMode(pick, spec.peak("float32"), "fma")
        other = flop_times(graph, node, spec, fma, part, moved, cast_kernels)
        if sum(other) < sum(times):
            return fma, other
    return mode, times


def priced_mode(graph: OpGraph, node: OpNode, spec: DeviceSpec, flags: MathFlags) -> MathMode:
    """The math the whole ``node`` is priced in (:func:`conv_choice`'s pick): what the
    plan's record of its rates lists."""
    moved = float(node.read_bytes + node.out_bytes)
    return conv_choice(graph, node, spec, flags, 1.0, moved, weight_cast(graph, node))[0]


def weight_cast(graph: OpGraph, node: OpNode, part: float = 1.0) -> tuple[float, float]:
    """(bytes, kernels) of ``node``'s own work under autocast: a 16-bit op with weights
    first casts them (fp32 read, 16-bit write: 1.5 bytes a weight byte), a second kernel;
    any other op ``(0, 1)``."""
    if node.dtype in _HALF and node.param_bytes > 0 and graph.precision != "fp32":
        return 1.5 * node.param_bytes * part, 2.0
    return 0.0, 1.0
