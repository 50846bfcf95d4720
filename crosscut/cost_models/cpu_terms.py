"""Per-op CPU terms: the two op kinds a CPU runs far from their bytes' price.

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
"""

from __future__ import annotations

import math

from crosscut.cost_models.devices import DeviceSpec
from crosscut.ir.graph import OpGraph, OpNode

__all__ = [
    "CPU_BN_BWD_FLOPS",
    "CPU_BN_FWD_FLOPS",
    "CPU_POOL_BWD_FLOPS",
    "CPU_POOL_OUTPUT_FLOPS",
    "CPU_POOL_TAP_FLOPS",
    "cpu_node_times",
    "roofline",
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


def _elements(shape: list[int] | None) -> int:
    return math.prod(shape) if shape else 0


def cpu_node_times(
    graph: OpGraph, node: OpNode, spec: DeviceSpec, part: float = 1.0
) -> tuple[float, float] | None:
    """(forward, backward) seconds of ``node`` on the CPU ``spec`` where a CPU term
    applies (an NCHW max pool; a training batch norm), else ``None``: the roofline
    prices it. ``part`` is the share of the node's channels a shard computes; the
    launch overhead stays whole, as in ``analytic.node_times``."""
    train = graph.mode == "train"
    launch = spec.launch_overhead_s
    rate = max(spec.peak("float32"), 1.0)
    out = _elements(node.shapes[0] if node.shapes else None) * part
    if node.pool is not None and not graph.channels_last:  # node.pool: max pools only
        taps = math.prod(int(k) for k in node.pool["kernel"])
        fwd = out * (CPU_POOL_OUTPUT_FLOPS + taps * CPU_POOL_TAP_FLOPS) / rate + launch
        return fwd, (out * CPU_POOL_BWD_FLOPS / rate + launch) if train else 0.0
    if train and "batch_norm" in node.kind:
        return out * CPU_BN_FWD_FLOPS / rate + launch, out * CPU_BN_BWD_FLOPS / rate + launch
    return None


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
