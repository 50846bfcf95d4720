"""Achieved rates, not peaks: how close a GPU generation's kernels come to its datasheet.

A datasheet peak is what no training step reaches. Measured ResNet-50
training on V100 runs at 367 images/s in fp32 where the peak predicts ~480,
and at 1,200 in mixed precision where 125 TFLOPS of tensor cores would give
~2,000: big convolutions reach a fraction of the peak, small and grouped ones
far less, and the elementwise ops between them are bound by memory. So every
kernel is priced at an *achieved* rate, with a few physical parameters per
GPU generation (:class:`Efficiency`), shared by every preset of that
generation and fitted to published measurements (``calibration.py``;
docs/BENCHMARKS.md lists the points and the fit):

* **compute-bound ops** (convolutions, matmuls: the nodes with FLOPs) run at
  ``peak[math mode] × e``, ``e = e_max × K/(K + K½) × W/(W + W½)``, where ``K``
  is the reduction depth of one output (``Cin/groups × kh × kw`` of a
  convolution: 9 for a depthwise 3×3, so it gets ~a third of a dense one's
  rate) and ``W`` the output elements (a kernel needs enough output tiles to
  fill every SM: ``W½ = SMs × 4096``). ``e_max`` is the generation's large-op
  fraction, one for FMA math and one for tensor cores. Two facts of cuDNN's
  kernels on top: a dense 3×3 stride-1 convolution in FMA math runs as
  Winograd, :data:`WINOGRAD` times fewer multiplies than counted; a grouped one
  reuses each input only across its group's ``n`` output channels,
  ``× n/(n + GROUP_OUT_HALF)``, and never runs on TF32 tensor cores;
* **memory-bound ops** move their bytes at ``memory × mem_bw`` (STREAM-like
  achieved bandwidth), in-place or not (``analytic.py`` counts the bytes);
* every kernel pays the device's ``launch_overhead_s``.

Math modes follow what PyTorch runs (:func:`math_mode`): fp32 convolutions on
Ampere and later use TF32 tensor cores because ``torch.backends.cudnn.allow_tf32``
is on by default, fp32 matmuls only when ``torch.backends.cuda.matmul.allow_tf32``
is set (off by default); fp16/bf16 run on tensor cores from Volta on, fp16 at
twice the fp32 rate on P100, and at the fp32 rate with 16-bit storage on parts
without fast half precision (K20c, P40: cuDNN computes in fp32 there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "ACTION_OVERHEAD_S",
    "EFFICIENCIES",
    "GENERATIONS",
    "GROUPED_TF32",
    "GROUP_OUT_HALF",
    "GROUP_OUT_HALF_TENSOR",
    "HOST_DISPATCH_S",
    "STEP_OVERHEAD_S",
    "TENSOR_MIN_CHANNELS",
    "WINOGRAD",
    "Efficiency",
    "MathMode",
    "efficiency_of",
    "math_mode",
    "sm_count",
    "update_bytes_per_param",
]


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of one GPU generation's datasheet (module docstring).

    ``fma`` and ``tensor`` are the fractions of the FMA and tensor-core peaks a
    large, deep convolution or GEMM reaches; ``memory`` the fraction of DRAM
    bandwidth a streaming kernel reaches; ``depth_half`` the reduction depth
    ``K`` at which a kernel gets half of its large-``K`` rate. ``fitted`` says
    which fields were fitted to the published points of ``source`` (the rest
    come from microbenchmarks, see docs/BENCHMARKS.md).
    """

    generation: str
    fma: float
    tensor: float
    memory: float
    depth_half: float
    source: str
    fitted: tuple[str, ...] = ()
    tf32: float = 0.0  # fraction of the TF32 tensor-core peak (Ampere and later)


# depth_half is one value for every GPU (a property of how cuDNN/cuBLAS tile the
# reduction: a k-loop prologue/epilogue of ~one 16-32-deep tile), fitted to the
# ResNeXt-101 32x4d (grouped, K = 36) against ResNet-50 (dense) points together.
DEPTH_HALF = 4.0
# cuDNN runs dense 3x3 stride-1 fp32 convolutions as Winograd F(2x2, 3x3): 16 multiplies
# for 4 outputs where direct convolution does 36, 2.25x fewer than the FLOPs counted
# (the transforms are memory traffic the roofline already bounds). Tensor-core math
# (fp16, bf16, TF32) runs implicit GEMM, counted as is.
WINOGRAD = 2.25
# a grouped convolution reuses each input it loads only across its group's output
# channels: with n outputs per group it reaches n / (n + GROUP_OUT_HALF) of a dense
# kernel's rate (depthwise: n = 1). Fitted with the ResNeXt-101 32x4d points; the CPU
# preset uses it too (MobileNetV2 on dev-2c: 1.70-2.45x its step before, 0.90-0.97 after).
GROUP_OUT_HALF = 16.0
# The same on tensor cores (16-bit grouped convolutions on a GPU): an MMA tile is 64 or
# more output channels wide, so a group of n fills n / (n + 64) of it. Measured on an
# H200 (benchmarks/gpu_kernels.py, per-shape kernel times, fp16 channels-last): group
# widths 4, 8, 16 and 32 ran their 3x3 convolutions at 23, 28-38, 68-97 and 142 TFLOPS,
# where this gives 25, 47, 85 and 142 (with 16 the price had been 1.7-3.3x too fast).
GROUP_OUT_HALF_TENSOR = 64.0
# whether cuDNN runs grouped convolutions on TF32 tensor cores: no (fitted, ResNeXt-101
# 32x4d on A100: priced in TF32 it is 1.3x faster than published)
GROUPED_TF32 = False
EFFICIENCIES: dict[str, Efficiency] = {
    # memory: BabelStream/STREAM triad as a fraction of the datasheet bandwidth
    # (K20c ~145/208 with ECC, P100 ~550/732, P40 ~260/346, V100 ~800/900,
    # A100 ~1,400/1,555, H100 ~3,000/3,350).
    "kepler": Efficiency("kepler", 0.636, 0.0, 0.70, DEPTH_HALF, "assumed: Pascal's fma"),
    "pascal": Efficiency(
        "pascal",
        0.636,
        0.0,
        0.75,
        DEPTH_HALF,
        "TensorFlow benchmarks, DGX-1 P100 fp32 (ResNet-50, ResNet-152, VGG-16)",
        ("fma",),
    ),
    "volta": Efficiency(
        "volta",
        0.738,
        0.661,
        0.88,
        DEPTH_HALF,
        "NVIDIA DeepLearningExamples PyTorch, DGX-1 V100 (ResNet-50, ResNeXt-101), 21.03",
        ("fma", "tensor"),
    ),
    "ampere": Efficiency(
        "ampere",
        0.5,
        0.459,
        0.90,
        DEPTH_HALF,
        "NVIDIA DeepLearningExamples PyTorch, DGX A100 (ResNet-50, ResNeXt-101), 21.03",
        ("fma", "tensor", "tf32"),
        tf32=0.402,
    ),
    "hopper": Efficiency(
        "hopper",
        0.5,
        0.459,
        0.90,
        DEPTH_HALF,
        "assumed: Ampere's fractions, not fitted; checked against Lambda's H100 rows and "
        "crosscut's own H100 measurements (calibration.MEASURED; its H200 rows held out)",
        tf32=0.402,
    ),
    # the cpu preset's rates (devices.py) are already achieved rates
    "cpu": Efficiency("cpu", 1.0, 1.0, 1.0, 0.0, "devices.cpu_spec: achieved rates"),
}
# parts no published figure was fitted on take the fractions of the generation their design
# follows (a refit moves them too); Lambda's one-GPU rows check them (held out,
# docs/BENCHMARKS.md)
EFFICIENCIES["turing"] = replace(
    EFFICIENCIES["volta"], generation="turing", source="assumed: Volta's fractions", fitted=()
)
EFFICIENCIES["ga10x"] = replace(
    EFFICIENCIES["ampere"], generation="ga10x", source="assumed: the A100's fractions", fitted=()
)
EFFICIENCIES["ada"] = replace(EFFICIENCIES["ga10x"], generation="ada")
DEFAULT_GENERATION = "volta"  # a custom GPU kind with no generation: a middle-aged one

GENERATIONS: dict[str, str] = {
    "K20c": "kepler",
    "P40": "pascal",
    "P100": "pascal",
    "V100": "volta",
    "V100-32GB": "volta",
    "A100-40GB": "ampere",
    "A100-80GB": "ampere",
    "H100": "hopper",
    "H200": "hopper",
    "RTX8000": "turing",
    "T4": "turing",
    "A10": "ga10x",
    "A40": "ga10x",
    "RTXA6000": "ga10x",
    "RTX3090": "ga10x",
    "A100-PCIe-40GB": "ampere",
    "A100-PCIe-80GB": "ampere",
    "L4": "ada",
    "L40S": "ada",
    "RTX6000Ada": "ada",
    "RTX4090": "ada",
    "H100-PCIe": "hopper",
    "cpu": "cpu",
}
_SMS: dict[str, int] = {
    "K20c": 13,
    "P40": 30,
    "P100": 56,
    "V100": 80,
    "V100-32GB": 80,
    "A100-40GB": 108,
    "A100-80GB": 108,
    "H100": 132,
    "H200": 132,
    "RTX8000": 72,
    "T4": 40,
    "A10": 72,
    "A40": 84,
    "RTXA6000": 84,
    "RTX3090": 82,
    "A100-PCIe-40GB": 108,
    "A100-PCIe-80GB": 108,
    "L4": 58,
    "L40S": 142,
    "RTX6000Ada": 142,
    "RTX4090": 128,
    "H100-PCIe": 114,
}
TILE_OUTPUTS = 4096  # outputs per SM for half occupancy: one 64x64 tile

# One training iteration's fixed host work outside forward and backward: zero_grad,
# the optimizer's and the loss scaler's dispatch, the loss read-back and the data
# loader hand-off; ~1 ms per step in PyTorch eager on a GPU (assumed, not fitted).
STEP_OVERHEAD_S = {"gpu": 1e-3, "cpu": 0.0}

# The host's seconds to issue one kernel in eager PyTorch on a GPU: the Python call, the
# dispatcher, autograd's bookkeeping and the launch itself (``host_flow``: a node costs
# its kernels' time unless the host falls behind them). Measured on the lent H200's host
# (benchmarks/gpu_kernels.py, docs/BENCHMARKS.md): the step at batch 8, where the GPU
# keeps up, over the kernels the profiler counted, 25-44 µs in 28 steps of 23 models
# (an upper bound: it includes the GPU's own time and a sync). Set to 28 µs, where the
# first call's 16 steps (15 models) are priced at 0.62-1.14 of measured (median 1.0); the
# second call's eight new models were held out (0.73-1.10). One constant of the host class,
# not of the GPU: a faster host issues faster. On a CPU the host *is* the device, and
# its dispatch is the spec's ``launch_overhead_s``.
HOST_DISPATCH_S = {"gpu": 28e-6, "cpu": 0.0}

# The stage engine's host work per schedule action (one F, B or W of one stage and
# micro-batch) beyond its nodes' kernels: choosing the action, waiting for and
# unpacking its inputs, autograd's set-up, handing its outputs on (a gloo send on
# ranks). On a CPU that work and the kernels share the core, so every action pays it:
# measured 0.32-0.42 ms on two 2-core VMs, local threads and gloo ranks alike
# (benchmarks/action_overhead.py, docs/BENCHMARKS.md). On a GPU the host issues an
# action's kernels ahead of the device and the work hides behind the kernels queued
# before it; not measured there, so not priced.
ACTION_OVERHEAD_S = {"gpu": 0.0, "cpu": 3.3e-4}


def efficiency_of(kind: str, device: str = "cuda") -> Efficiency:
    """The generation's :class:`Efficiency` of preset ``kind`` (CPUs: the cpu entry)."""
    if device.startswith("cpu") or kind == "cpu":
        return EFFICIENCIES["cpu"]
    return EFFICIENCIES[GENERATIONS.get(kind, DEFAULT_GENERATION)]


def sm_count(kind: str) -> int:
    """Streaming multiprocessors of preset ``kind`` (80 for an unknown GPU)."""
    return _SMS.get(kind, 80)


@dataclass(frozen=True)
class MathMode:
    """How one op's arithmetic runs: the name shown in reports, its peak and unit."""

    name: str  # "fp32 FMA", "tf32 tensor cores", "fp16 tensor cores", ...
    peak: float  # FLOP/s
    unit: str  # the Efficiency field that applies: "fma", "tensor" or "tf32"


_TENSOR_HALF = ("volta", "turing", "ampere", "ga10x", "ada", "hopper")
# A dense convolution with fewer input channels than this runs on the CUDA cores
# (math_mode's ``narrow``): a tensor-core convolution loads 16 bytes of channels at a
# time, 8 in 16-bit, and cuDNN's kernels for fewer do not use the tensor cores.
# Evidence: the stem of ResNet-50 (3 channels, 7x7) on an H100 ran forward and weight
# gradient at 24-56 TFLOP/s in every precision (fp32 NCHW 5.1 ms, TF32 NHWC 4.2, bf16
# 4.0, fp16 2.1 at batch 256), CUDA-core rates (66.9 TFLOPS fp32 peak), where the
# tensor-core price was 0.6-1.1 ms.
TENSOR_MIN_CHANNELS = 8
# half-precision FMA on CUDA cores (not tensor cores), as a multiple of the fp32 rate:
# V100 31.4 vs 15.7 TFLOPS, A100 78 (fp16) / 39 (bf16) vs 19.5, H100 SXM 133.8 vs 66.9
# (the vendors' datasheets and architecture whitepapers)
HALF_FMA_RATIO: dict[tuple[str, str], float] = {
    ("volta", "float16"): 2.0,
    ("ampere", "float16"): 4.0,
    ("ampere", "bfloat16"): 2.0,
    ("hopper", "float16"): 2.0,
    ("hopper", "bfloat16"): 2.0,
    ("turing", "float16"): 2.0,
    ("ga10x", "float16"): 1.0,  # GA10x and Ada: 16-bit FMA at the fp32 rate
    ("ga10x", "bfloat16"): 1.0,
    ("ada", "float16"): 1.0,
    ("ada", "bfloat16"): 1.0,
}


def math_mode(
    peak_flops: dict[str, float],
    kind: str,
    dtype: str,
    *,
    conv: bool,
    tf32_conv: bool,
    tf32_matmul: bool,
    depthwise: bool = False,
    narrow: bool = False,
) -> MathMode:
    """The math PyTorch uses for a ``dtype`` conv (``conv``) or matmul on preset ``kind``.

    A ``depthwise`` convolution (one input and one output channel per group) has no
    tensor-core kernel: a matrix-multiply tile needs several output channels to
    fill, so cuDNN runs it on the CUDA cores, in half precision at
    :data:`HALF_FMA_RATIO` times the fp32 rate. A ``narrow`` one (fewer input
    channels than :data:`TENSOR_MIN_CHANNELS`: an RGB stem) runs there too, in
    every precision, TF32 included: its channels cannot fill the tensor cores'
    16-byte loads (measured on an H100, docs/BENCHMARKS.md)."""
    fp32 = peak_flops.get("float32", 0.0)
    gen = GENERATIONS.get(kind, DEFAULT_GENERATION)
    if dtype in ("float16", "bfloat16"):
        short = "fp16" if dtype == "float16" else "bf16"
        if dtype not in peak_flops:  # no fast half precision: fp16 storage, fp32 math
            return MathMode(f"{short} storage, fp32 math", fp32, "fma")
        if gen in _TENSOR_HALF and (depthwise or narrow):
            ratio = HALF_FMA_RATIO.get((gen, dtype), 2.0)
            why = "depthwise" if depthwise else "few input channels"
            return MathMode(f"{short} FMA ({why})", fp32 * ratio, "fma")
        if gen in _TENSOR_HALF:
            return MathMode(f"{short} tensor cores", peak_flops[dtype], "tensor")
        return MathMode(f"{short} FMA", peak_flops[dtype], "fma")
    if "tfloat32" in peak_flops and (tf32_conv if conv else tf32_matmul) and not narrow:
        return MathMode("tf32 tensor cores", peak_flops["tfloat32"], "tf32")
    return MathMode("fp32 FMA", fp32, "fma")


# bytes the optimizer update moves per parameter element (fp32 master weights):
# read w, g (+ momentum / Adam's two moments), write w (+ state)
_UPDATE_BYTES = {"sgd": 12.0, "momentum": 20.0, "rmsprop": 28.0, "adam": 28.0, "adamw": 28.0}
# fp16 with a loss scaler: unscale_ reads and writes every gradient, the inf check reads it
_SCALER_BYTES = 12.0


def update_bytes_per_param(optimizer: str, precision: str) -> float:
    """DRAM bytes one fp32 parameter's update moves per step (optimizer + loss scaler)."""
    base = _UPDATE_BYTES.get(optimizer, _UPDATE_BYTES["momentum"])
    return base + (_SCALER_BYTES if precision == "fp16" else 0.0)
