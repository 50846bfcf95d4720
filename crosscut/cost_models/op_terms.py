"""Per-op GPU terms the whole-model fits cannot see, each measured on an H100 or an H200.

Why a module of its own: a whole training step can be priced within 10 % while
single ops are off by 3x in both directions, and the planner cuts stages where
the per-op prices say they balance (``benchmarks/per_op.py`` measures how far
they do against an H100's per-node times). These terms are the physics of five
op groups whose price was wrong that way: batch norm in NCHW, which cannot fill
the GPU with few channels; max pool, whose forward is bound by its outputs and
whose backward is a gather; ``add``, whose backward runs no kernel; one-input ops
(activations), whose backward moves three tensors, not four; and the gradient sums
where a tensor has several readers.
``analytic.node_times`` and ``analytic.analytic_costs`` apply them.
"""

from __future__ import annotations

import math

from crosscut.cost_models.devices import DeviceSpec
from crosscut.cost_models.efficiency import efficiency_of, sm_count
from crosscut.cost_models.memory import _key, copies_input
from crosscut.ir.graph import OpGraph, OpNode

__all__ = [
    "BN_16BIT_KERNELS",
    "BN_NCHW_CHANNEL_RATE",
    "BN_NHWC_FILL_CHANNELS",
    "INDEX_BYTES",
    "POOL_OUTPUTS_PER_SM_S",
    "autograd_copy_bytes",
    "bn_channel_occupancy",
    "bn_kernels",
    "bn_nhwc_occupancy",
    "consumers",
    "fan_out_seconds",
    "gpu_training",
    "inputs_per_group",
    "max_pool_bytes",
    "max_pool_forward_floor",
    "passes_gradient_through",
    "unary_backward",
]

# bytes/s one channel of an NCHW training batch norm streams (bn_channel_occupancy):
# fitted to the H100's per-node times, 164 channels fill its 3.0 TB/s
BN_NCHW_CHANNEL_RATE = 18.4e9
INDEX_BYTES = 8.0  # a max pool's saved argmax, int64
# max pool outputs one SM computes per second in a training forward (max_pool_forward_floor):
# the median of 25 pools measured on an H200, 0.34-0.66e9 (3x3 stride 2 at 0.40-0.48)
POOL_OUTPUTS_PER_SM_S = 0.48e9

# Training batch norm of a 16-bit tensor on a GPU, by the kernels PyTorch runs it with, as
# time relative to fp16 channels-last (cuDNN's persistent kernels: what the fitted AMP
# points ran). Measured on an H100 by benchmarks/gpu_check.py, ResNet-50 at batch 256,
# per-node profiles summed over the 53 batch norms (forward + backward): fp16 NHWC
# 21.6 ms, fp16 NCHW 42.3 ms (cuDNN's non-persistent kernels), bf16 NHWC 28.2 ms and bf16
# NCHW 62.5 ms. The NCHW factors are those ratios (1.96, 2.89) over the mean channel
# occupancy of ResNet-50's batch norms (1.41), which bn_kernels applies on its own. fp32
# channels-last is left at 1 (measured 0.9-1.1 of its price).
BN_16BIT_KERNELS = {
    ("float16", True): 1.0,
    ("float16", False): 1.39,
    ("bfloat16", True): 1.31,
    ("bfloat16", False): 2.06,
}
_HALF = ("float16", "bfloat16")


def bn_channel_occupancy(node: OpNode, spec: DeviceSpec) -> float:
    """How much longer an NCHW training batch norm of ``C`` channels takes than its bytes
    at the memory rate: ``sqrt(1 + (C_fill / C)^2)``, where ``C_fill`` channels stream
    the GPU's achieved bandwidth at :data:`BN_NCHW_CHANNEL_RATE` each.

    Why: in NCHW the statistics and the gradient's sums reduce each channel over
    N·H·W, and the kernels give each channel its own blocks, whose loads in flight
    bound how fast one channel streams (bandwidth × latency); a layer with fewer
    channels than it takes to fill DRAM's bandwidth runs slower however large its
    images are. Channels-last reduces across the contiguous channels and has no such
    limit. Measured on an H100, ResNet-50 at batch 256, NCHW against the price of the
    same bytes: C = 64 2.8-2.9x, 128 1.5-1.8x, 256 1.1-1.2x, 512 and more 1.0 (fp32;
    16-bit alike once :data:`BN_16BIT_KERNELS` is set apart); this curve gives
    2.75, 1.62, 1.19 and 1.05 there. Channels-last measured flat at 0.9-1.1."""
    shape = node.shapes[0] if node.shapes else []
    if len(shape) < 3 or shape[1] <= 0:
        return 1.0
    fill = spec.mem_bw * efficiency_of(spec.kind, spec.device).memory / BN_NCHW_CHANNEL_RATE
    return math.sqrt(1.0 + (fill / shape[1]) ** 2)


# channels a 16-bit channels-last training batch norm needs to stream at the price's rate
# (bn_nhwc_occupancy); fitted to an H200's per-shape kernel times
BN_NHWC_FILL_CHANNELS = 26.0


def bn_nhwc_occupancy(node: OpNode) -> float:
    """How much longer a 16-bit channels-last training batch norm of ``C`` channels takes
    than one of many channels: ``sqrt(1 + (BN_NHWC_FILL_CHANNELS / C)^2)``.

    Why: channels-last rows are ``C`` elements long, and cuDNN's kernels reduce each
    channel's statistics and gradient sums across rows; with few channels a row is a
    few 16-byte loads, and the reductions' work per byte grows as the rows shorten.
    Measured on an H200 (benchmarks/gpu_kernels.py, the per-shape kernel times of 23
    models' batch norms over 8 MB, docs/BENCHMARKS.md), forward and backward against
    the same batch norm at 64 or more channels: C = 8 3.8x and 3.2x, 16 2.0x and 1.8x,
    24 1.7x and 1.3x, 32 1.3x and 1.2x; this curve gives 3.4, 1.9, 1.5 and 1.3, and
    1.08 at 64 channels."""
    shape = node.shapes[0] if node.shapes else []
    if len(shape) < 3 or shape[1] <= 0:
        return 1.0
    return math.sqrt(1.0 + (BN_NHWC_FILL_CHANNELS / shape[1]) ** 2)


def inputs_per_group(node: OpNode) -> float:
    """A convolution's input channels per group, from its FLOPs: multiply-adds per output
    = input channels per group × kernel taps."""
    assert node.conv is not None
    outputs = math.prod(node.shapes[0]) if node.shapes and node.shapes[0] else 0
    taps = math.prod(int(k) for k in node.conv["kernel"])
    return node.fwd_flops / (2.0 * outputs * taps) if outputs and taps else 0.0


def max_pool_bytes(node: OpNode, part: float = 1.0) -> tuple[float, float]:
    """(forward, backward) bytes of a training max pool on a GPU.

    The forward reads its input and writes the maxima and their indices (int64). The
    backward is a gather: for each input element PyTorch's CUDA kernel reads the
    index and the gradient of every window covering it (``prod(kernel / stride)`` on
    average: 2.25 for ResNet's 3x3 stride 2) and writes one gradient. Priced as that
    traffic, though neighbours' windows overlap in cache: on an H100 ResNet-50's max
    pool measured 2.8-3.3 ms (fwd + bwd, batch 256) in every precision, where this
    gives 2.0-2.6 ms and its bytes as an elementwise op gave 0.5-1.0 ms."""
    assert node.pool is not None
    inp = float(max(0, node.read_bytes - node.param_bytes)) * part
    out = float(node.out_bytes) * part
    elems_out = (math.prod(node.shapes[0]) if node.shapes and node.shapes[0] else 0) * part
    elem = out / elems_out if elems_out else 4.0
    elems_in = inp / elem
    cover = math.prod(k / max(1, s) for k, s in zip(node.pool["kernel"], node.pool["stride"]))
    fwd = inp + out + INDEX_BYTES * elems_out
    bwd = elems_in * (max(1.0, cover) * (INDEX_BYTES + elem) + elem)
    return fwd, bwd


def max_pool_forward_floor(node: OpNode, spec: DeviceSpec, part: float = 1.0) -> float:
    """Seconds a GPU's training max pool forward takes at least: its outputs at
    :data:`POOL_OUTPUTS_PER_SM_S` per SM, whatever their bytes.

    Why: each output scans its window and records the argmax, work per output that
    the bytes do not show. On an H200 (kernels by shape, 25 pools of 12 models) the
    forward ran 2.8-5x its bytes' price, fp32 NCHW as slowly as fp16 channels-last
    (ResNet-50: 0.81 and 0.83 ms for twice the bytes), and an H100, with the same SMs
    and 0.7x the bandwidth, took the same time: bound by the SMs, not by memory."""
    outputs = (math.prod(node.shapes[0]) if node.shapes and node.shapes[0] else 0) * part
    return outputs / (sm_count(spec.kind) * POOL_OUTPUTS_PER_SM_S)


def autograd_copy_bytes(graph: OpGraph, node: OpNode) -> float:
    """Bytes an in-place op moves before it runs, in training: the copy of its input
    that autograd saves for a backward that needs it (``silu_``, ``hardswish_``,
    ``relu6``/``hardtanh_``: memory.py's ``_COPIES_INPUT``), read and written.

    Measured on one EPYC core (1-4 M elements, float32): ``F.silu(x, inplace=True)``
    on a tensor that needs a gradient took 0.59-0.70 ns an element where the same op
    out of place took 0.42-0.46, and ``hardswish_`` 0.31-0.42 against ``relu_``'s
    0.05-0.12. Every device runs the copy; it was priced on none."""
    return 2.0 * node.out_bytes if graph.mode == "train" and copies_input(graph, node) else 0.0


def passes_gradient_through(graph: OpGraph, node: OpNode) -> bool:
    """Whether ``node``'s backward hands its gradient on unchanged: an ``add`` or ``sub``
    of same-shape tensors (autograd gives each input the incoming gradient, negated for
    ``sub``'s second, in no kernel of its own; a broadcast input would need a reduction).
    An H100 profile of ResNet-50 measured its 16 adds at 3.0 ms forward and backward
    together, the forward's traffic alone, where twice that was priced again for the
    backward. The fan-in's cost is elsewhere: where the gradients of a tensor read
    twice meet (:func:`fan_out_seconds`)."""
    kind, tgt = _key(node)
    if kind not in ("add", "sub") and tgt not in ("add", "sub", "iadd", "isub"):
        return False
    shapes = [graph.node(i).shapes[0] for i in node.inputs if i in graph and graph.node(i).shapes]
    out = node.shapes[0] if node.shapes else None
    return bool(shapes) and out is not None and all(s == out for s in shapes)


def unary_backward(graph: OpGraph, node: OpNode) -> bool:
    """Whether ``node`` is a one-input op of its output's shape without weights (an
    activation, a softmax, an in-place ReLU): its backward reads the incoming gradient and
    one saved tensor and writes one gradient, three tensors of the output's size where
    the forward moved two (1.5x, where two-input ops move twice the forward's bytes).
    Measured on an H200 (ResNet-50, batch 256, kernels by shape): ReLU's backward
    (``threshold_backward``) took 3.47 ms in fp16 and 6.72 ms in fp32, 0.76 and 0.74 of
    the 2x price, and its forward 1.07 and 1.02 of its price."""
    if node.param_bytes > 0 or "batch_norm" in node.kind or not node.shapes:
        return False
    tensors = [graph.node(i) for i in node.inputs if i in graph and graph.node(i).shapes]
    return len(tensors) == 1 and tensors[0].shapes[0] == node.shapes[0]


def consumers(graph: OpGraph) -> dict[str, int]:
    """How many times each node's output is read by other nodes (the output node too)."""
    out: dict[str, int] = {}
    for n in graph.nodes:
        for i in n.inputs:
            out[i] = out.get(i, 0) + 1
    return out


def fan_out_seconds(node: OpNode, readers: int, spec: DeviceSpec) -> float:
    """Backward seconds autograd spends summing the gradients of a tensor read ``readers``
    times: one add (two reads, one write of the tensor) per extra reader, each a
    kernel. ResNet's block inputs feed the convolution and the shortcut; DenseNet's
    layer outputs feed every later layer of their block."""
    if readers <= 1 or node.is_io or node.op == "get_attr" or node.out_bytes <= 0:
        return 0.0
    bw = spec.mem_bw * efficiency_of(spec.kind, spec.device).memory
    return (readers - 1) * (3.0 * node.out_bytes / bw + spec.launch_overhead_s)


def bn_kernels(graph: OpGraph, node: OpNode, spec: DeviceSpec) -> float:
    """How much longer a training batch norm of ``node``'s dtype and ``graph``'s layout
    takes on a GPU than fp16 channels-last of many channels (:data:`BN_16BIT_KERNELS`),
    times its channel occupancy: NCHW's (:func:`bn_channel_occupancy`), or 16-bit
    channels-last's (:func:`bn_nhwc_occupancy`); 1 on a CPU and in inference (one
    elementwise pass, measured in neither layout)."""
    if not gpu_training(graph, spec):
        return 1.0
    factor = BN_16BIT_KERNELS.get((node.dtype, graph.channels_last), 1.0)
    if not graph.channels_last:
        factor *= bn_channel_occupancy(node, spec)
    elif node.dtype in _HALF:
        factor *= bn_nhwc_occupancy(node)
    return factor


def gpu_training(graph: OpGraph, spec: DeviceSpec) -> bool:
    """Whether ``graph`` trains on a GPU: where the batch-norm kernels' terms apply."""
    return graph.mode == "train" and efficiency_of(spec.kind, spec.device).generation != "cpu"
