"""The host as a second machine: a GPU step is as slow as the slower of two pipelined workers.

Eager PyTorch issues a GPU's kernels from one host thread, each after tens of
microseconds of Python, dispatcher and autograd work, and the GPU runs them
while the host issues the next. Where kernels are long (ResNet-50 at batch
256) the host runs ahead and the step is the kernels' time; where they are
short (an SE block's ops on ``[N, C, 1, 1]``, a RegNet's or a DenseNet's late
layers) the GPU waits for the host. Measured on an H200 (benchmarks/gpu_kernels.py,
docs/BENCHMARKS.md): RegNetY-400MF's kernels took 22 ms of a 39-57 ms step,
EfficientNetV2-S's 37 ms of 104 ms, DenseNet-169's 31 of 114; ResNet-50's 41 of 42.
Pricing every kernel's launch as a few microseconds added to its time, as the
roofline did alone, priced those steps at 0.29-0.48 of what they took.

The model is a two-machine flow shop over the nodes in program order (forward,
then backward in reverse): the host spends ``launches × HOST_DISPATCH_S`` on a
node, the GPU starts the node's kernels once the host has issued them and the
previous node's kernels are done. A node is charged what it adds to the GPU's
finishing time, so the charges sum to the step the flow shop predicts, and a
stage priced from them pays the host where its kernels are short. That is
per-node and additive, as the partitioner needs, and falls back to the
roofline's time wherever the GPU is the bottleneck.
"""

from __future__ import annotations

import math

from crosscut.cost_models.op_terms import (
    autograd_copy_bytes,
    inputs_per_group,
    passes_gradient_through,
)
from crosscut.ir.graph import OpGraph, OpNode

__all__ = ["VIEW_KINDS", "flow_charges", "launches"]

# ops autograd and the dispatcher handle without a kernel (a view of their input). Not
# memory._VIEW: that counts ``contiguous`` as an alias (its result may share storage),
# but on a non-contiguous input it launches a copy kernel (ShuffleNet's channel shuffle)
VIEW_KINDS = frozenset(
    {"view", "flatten", "getitem", "reshape", "transpose", "permute", "chunk", "split"}
    | {"size", "squeeze", "unsqueeze", "expand", "narrow", "select", "t", "unbind"}
)


def _conv_bias(node: OpNode) -> bool:
    """Whether a convolution carries a bias: more parameter elements than its weight."""
    assert node.conv is not None
    shape = node.shapes[0] if node.shapes else []
    if len(shape) < 2 or node.param_bytes <= 0:
        return False
    taps = math.prod(int(k) for k in node.conv["kernel"])
    weight = int(shape[1]) * round(inputs_per_group(node)) * taps
    return node.param_bytes / 4 > weight  # fp32 parameters


def launches(graph: OpGraph, node: OpNode, readers: int) -> tuple[int, int]:
    """(forward, backward) kernels eager PyTorch launches for ``node`` in a training step.

    A convolution: the weight's cast under autocast and the convolution, then the
    data and weight gradients and the gradient's cast back (3, 3; +1 each with a
    bias); training batch norm: statistics, normalisation and the running
    averages, then the gradient's reductions and its elementwise pass (3, 3); a
    pool's backward zero-fills before it scatters; an in-place activation whose
    backward needs its input copies it first (``op_terms.autograd_copy_bytes``); a
    gradient read by ``readers`` nodes is summed in one add per extra reader. Checked
    against the kernels the profiler counted in 28 H200 steps of 23 models: it counted
    0.82-1.40 times these (docs/BENCHMARKS.md)."""
    kind = node.kind
    if node.is_io or node.op == "get_attr":
        return 0, 0
    if node.conv is not None:
        extra = 1 if _conv_bias(node) else 0
        fwd, bwd = 3 + extra, 3 + extra
    elif "batch_norm" in kind:
        fwd, bwd = 3, 3
    elif kind == "linear":
        fwd, bwd = 6, 10
    elif kind in ("add", "sub", "mul", "iadd", "truediv", "div"):
        fwd, bwd = (1, 0) if passes_gradient_through(graph, node) else (1, 2)
    elif "pool" in kind or kind == "mean":
        fwd, bwd = 2, 3
    elif kind in ("dropout", "stochastic_depth"):
        fwd, bwd = 2, 2
    elif kind in VIEW_KINDS:
        fwd, bwd = 0, 0
    else:
        fwd, bwd = 1, 1
    if graph.mode != "train":
        return fwd, 0
    copy = 1 if autograd_copy_bytes(graph, node) else 0  # an in-place op's saved input
    return fwd + copy, bwd + max(0, readers - 1)


def flow_charges(order: list[tuple[str, float, float, int]]) -> list[float]:
    """What each of ``order``'s (name, GPU seconds, host seconds, kernels) adds to the
    GPU's finishing time.

    The host issues the nodes one after another, a node's kernels evenly over its
    host seconds; the GPU runs them in order, each once it is issued and the one
    before is done. A node then ends when its kernels have run after the node
    before, or when its last kernel, issued with the host's last, has run
    (``gpu / kernels`` of its time): whichever is later. The charges sum to the
    flow shop's finish (module docstring)."""
    host = 0.0
    done = 0.0
    out = []
    for _, gpu, issue, kernels in order:
        host += issue
        end = max(done + gpu, host + gpu / max(kernels, 1))
        out.append(end - done)
        done = end
    return out
