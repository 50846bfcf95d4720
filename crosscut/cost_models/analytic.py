"""Analytic costs: a roofline per node at *achieved* rates, no hardware needed.

``time = max(flops / achieved[math mode], bytes / achieved_bw) + kernels × launch``
(``efficiency.py`` says what a generation achieves and which math PyTorch
uses; a CPU core adds the two terms instead, ``cpu_terms.roofline``). Forward
moves what the node reads plus what it writes; backward does ``bwd_flops``
and moves about twice the forward bytes (read the saved tensors
and the incoming gradient, write input and weight gradients). Batch norm in
training reads its input twice (statistics, then normalisation). In-place ops
(``relu_``, ``inplace=True``) read and write their tensor, and first copy it where
autograd saves their input (``op_terms.autograd_copy_bytes``); only pure views
(``view``, ``flatten``, ...) move none and pay only the dispatch. Under
autocast every 16-bit op with weights also casts them (fp32 read, 16-bit
write) forward and casts the weight gradient back. A tensor-core convolution
of a model in PyTorch's default NCHW layout also pays cuDNN's transposes to
NHWC and back (:func:`nchw_transposes`). Placeholders, the output and
``get_attr`` cost nothing. On a GPU the host issues those kernels one after
another, tens of microseconds each, and a step of short kernels waits for it:
:func:`analytic_costs` charges every node what it adds to a host/GPU flow shop
(``host_flow.py``), which is the roofline where kernels are long. A CPU prices NCHW
max pools, training batch norms and exp-like activations by ``cpu_terms.py``.
"""

from __future__ import annotations

from typing import Any

from crosscut import cpu_malloc
from crosscut.cost_models import cpu_terms
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.conv_math import (
    BWD_BYTES_FACTOR,
    MathFlags,
    conv_choice,
    narrow_input,
    nchw_transposes,
    pays_transposes,
    priced_mode,
    weight_cast,
    winograd,
)
from crosscut.cost_models.cpu_terms import cpu_node_times, fresh_seconds
from crosscut.cost_models.devices import PRESETS, DeviceSpec, cpu_spec
from crosscut.cost_models.efficiency import (
    GENERATIONS,
    HOST_DISPATCH_S,
    efficiency_of,
)
from crosscut.cost_models.host_flow import flow_charges, launches
from crosscut.cost_models.memory import _VIEW, _key, activation_bytes, is_alias, resident_bytes
from crosscut.cost_models.op_terms import (
    BN_16BIT_KERNELS,
    autograd_copy_bytes,
    bn_channel_occupancy,
    bn_kernels,
    consumers,
    fan_out_seconds,
    gpu_training,
    max_pool_bytes,
    max_pool_forward_floor,
    passes_gradient_through,
    unary_backward,
)
from crosscut.cost_models.table import CostTable, NodeCost
from crosscut.ir.graph import OpGraph, OpNode

__all__ = [
    "BN_16BIT_KERNELS",
    "UNARY_BWD_BYTES_FACTOR",
    "MathFlags",
    "analytic_costs",
    "bn_kernels",
    "channel_scales",
    "host_dispatch_s",
    "narrow_input",
    "nchw_transposes",
    "node_times",
    "pays_transposes",
    "priced_rate",
    "rates_summary",
    "winograd",
]

UNARY_BWD_BYTES_FACTOR = 1.5  # op_terms.unary_backward: grad and a saved tensor in, grad out
BN_FWD_PASSES = 1.5  # training batch norm reads its input twice: (2 reads + 1 write) / 2


def _is_view(node: OpNode) -> bool:
    kind, tgt = _key(node)
    return kind in _VIEW or tgt in _VIEW


def node_times(
    graph: OpGraph,
    node: OpNode,
    spec: DeviceSpec,
    flags: MathFlags | None = None,
    part: float = 1.0,
) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` on ``spec``.

    ``part`` < 1 prices one channel shard of the node (a channel-split stage): a
    node with FLOPs (a convolution or matmul) still reads its whole input but
    ``part`` of its weights, does ``part`` of the FLOPs at the rate of ``part`` of
    the outputs, and writes ``part``; any other node moves ``part`` of its bytes.
    Launch overhead stays whole: that is why small shards cost more than their
    fraction."""
    if node.is_io or node.op == "get_attr":
        return 0.0, 0.0
    train = graph.mode == "train"
    launch = spec.launch_overhead_s
    if node.fwd_flops == 0 and is_alias(graph, node) and _is_view(node):
        return launch, launch if train else 0.0
    eff = efficiency_of(spec.kind, spec.device)
    if eff.generation == "cpu" and (on_cpu := cpu_node_times(graph, node, spec, part)):
        return on_cpu  # an NCHW max pool or a training batch norm (cpu_terms.py)
    bw = spec.mem_bw * eff.memory
    if node.fwd_flops == 0 and is_alias(graph, node):  # in place: read and write the tensor
        moved = 2.0 * node.out_bytes * part
    elif node.fwd_flops > 0 and part < 1.0:  # a shard: the whole input, its part of weights
        inputs = max(0, node.read_bytes - node.param_bytes)
        moved = inputs + part * (node.param_bytes + node.out_bytes)
    else:
        moved = float(node.read_bytes + node.out_bytes) * part
    if train and "batch_norm" in node.kind:
        moved *= BN_FWD_PASSES * bn_kernels(graph, node, spec)
    cast, kernels = weight_cast(graph, node, part)  # fp32 -> 16-bit weight copy
    if node.fwd_flops > 0:
        flags = flags or MathFlags.from_torch()
        _, times = conv_choice(graph, node, spec, flags, part, moved, (cast, kernels))
        if eff.generation == "cpu":
            return cpu_terms.onednn_convolution(graph, node, spec, part, times)
        return times
    if train and node.pool is not None and eff.generation != "cpu":
        fwd_b, bwd_b = max_pool_bytes(node, part)
        fwd = max(fwd_b / bw, max_pool_forward_floor(node, spec, part))
        return fwd + launch, bwd_b / bw + 2.0 * launch  # zero-fill, then the gather
    copy = autograd_copy_bytes(graph, node) * part  # an in-place op's input, saved first
    arith = cpu_terms.elementwise_arithmetic(node, spec, part)  # exp and kin; 0 off a CPU
    fwd = max(moved / bw, arith[0]) + (copy + cast) / bw + (kernels + (copy > 0)) * launch
    if not train or passes_gradient_through(graph, node):
        return fwd, 0.0
    factor = UNARY_BWD_BYTES_FACTOR if unary_backward(graph, node) else BWD_BYTES_FACTOR
    return fwd, max(factor * moved / bw, arith[1]) + cast / bw + kernels * launch


def host_dispatch_s(spec: DeviceSpec) -> float:
    """Host seconds to issue one kernel on ``spec`` (0 on a CPU, whose dispatch is its
    ``launch_overhead_s``): :data:`~crosscut.cost_models.efficiency.HOST_DISPATCH_S`."""
    return HOST_DISPATCH_S["cpu" if spec.device.startswith("cpu") else "gpu"]


def _charge_host(
    graph: OpGraph, nodes: dict[str, NodeCost], kind: str, dispatch: float, readers: dict[str, int]
) -> None:
    """Re-charge ``kind``'s node times as the host/GPU flow shop finishes them
    (:mod:`~crosscut.cost_models.host_flow`): forward in program order, then backward
    in reverse; a no-op where the host issues for free."""
    if dispatch <= 0:
        return
    count = {n.name: launches(graph, n, readers.get(n.name, 0)) for n in graph.nodes}
    order = [
        (n.name, nodes[n.name].fwd[kind], count[n.name][0] * dispatch, count[n.name][0])
        for n in graph.nodes
    ]
    if graph.mode == "train":
        order += [
            (n.name, nodes[n.name].bwd[kind], count[n.name][1] * dispatch, count[n.name][1])
            for n in reversed(graph.nodes)
        ]
    charges = flow_charges(order)
    ahead = len(graph.nodes)
    for (name, *_), charge in zip(order[:ahead], charges[:ahead]):
        nodes[name].fwd[kind] = charge
    for (name, *_), charge in zip(order[ahead:], charges[ahead:]):
        nodes[name].bwd[kind] = charge


def _modes(graph: OpGraph, spec: DeviceSpec, flags: MathFlags) -> list[str]:
    """The math modes ``graph``'s matmuls run in on ``spec``, and the layout cost if any."""
    per_node = [(n, priced_mode(graph, n, spec, flags)) for n in graph.nodes if n.fwd_flops > 0]
    modes = sorted({mode.name for _, mode in per_node})
    transposed = any(pays_transposes(graph, n, mode) for n, mode in per_node)
    if transposed:
        modes.append("NCHW: cuDNN's transposes priced (channels_last avoids them)")
    norms = [n for n in graph.nodes if "batch_norm" in n.kind] if gpu_training(graph, spec) else []
    slow = {BN_16BIT_KERNELS.get((n.dtype, graph.channels_last), 1.0) for n in norms} - {1.0}
    layout = "channels-last" if graph.channels_last else "NCHW"
    if slow:  # 16-bit NCHW or bf16 batch norm (BN_16BIT_KERNELS)
        modes.append(
            f"batch norm: {layout} {graph.precision} kernels priced at "
            f"{max(slow):.2f}x fp16 channels-last's"
        )
    if norms and not graph.channels_last:
        worst = max(bn_channel_occupancy(n, spec) for n in norms)
        modes.append(f"batch norm: NCHW channel occupancy priced (up to {worst:.2f}x)")
    return modes


def rates_summary(graph: OpGraph, spec: DeviceSpec, flags: MathFlags | None = None) -> str:
    """What ``spec`` was priced at for ``graph``: preset, math modes, efficiency source."""
    flags = flags or MathFlags.from_torch()
    eff = efficiency_of(spec.kind, spec.device)
    modes = _modes(graph, spec, flags)
    host = host_dispatch_s(spec)
    issue = f"; host {host * 1e6:.0f} µs a kernel issued" if host > 0 else ""
    return (
        f"{spec.kind}: {', '.join(modes) or 'no matmuls'}; efficiency '{eff.generation}' "
        f"(fma {eff.fma:.2f}, tensor {eff.tensor:.2f}, memory {eff.memory:.2f} of "
        f"{spec.mem_bw / 1e9:.0f} GB/s) from {eff.source}{issue}"
    )


def _cpu_rates(spec: DeviceSpec) -> str:
    """A CPU's two rates, and whether they are the reference core's (``devices.cpu_spec``,
    not this machine's) or its own (``Cluster.from_devices(..., measure=True)``, a JSON)."""
    ref = cpu_spec(spec.name)
    own = (spec.peak("float32"), spec.mem_bw, spec.page_fault_bw) != (
        ref.peak("float32"),
        ref.mem_bw,
        ref.page_fault_bw,
    )
    faults = (
        f"page faults at {spec.page_fault_bw / 1e9:.1f} GB/s"
        if spec.page_fault_bw
        else "no page faults"
    )
    rates = f"{spec.peak('float32') / 1e9:.0f} GFLOP/s, {spec.mem_bw / 1e9:.0f} GB/s, {faults}"
    return f"{rates}, " + (
        "measured or described" if own else "the reference core's, not calibrated on this machine"
    )


def priced_rate(graph: OpGraph, spec: DeviceSpec, flags: MathFlags | None = None) -> dict[str, Any]:
    """The record ``Plan.rates`` keeps for ``spec``: preset, math modes, efficiency source.

    A user reading a plan has to know whether its times rest on a datasheet
    and fractions fitted to published measurements, on a default nobody
    checked (Hopper, a hand-described device), or on this machine's
    stopwatch; this says which, in words, for the kind ``spec`` prices."""
    flags = flags or MathFlags.from_torch()
    eff = efficiency_of(spec.kind, spec.device)
    base = PRESETS.get(spec.kind)
    is_preset = spec.kind == "cpu" or (
        base is not None and base.peak_flops == spec.peak_flops and base.mem_bw == spec.mem_bw
    )
    modes = _modes(graph, spec, flags)
    fractions = (
        f"fma {eff.fma:.2f}, tensor {eff.tensor:.2f}, tf32 {eff.tf32:.2f}, "
        f"memory {eff.memory:.2f} of {spec.mem_bw / 1e9:.0f} GB/s"
    )
    if eff.generation == "cpu":
        where = (
            f"analytic: {_cpu_rates(spec)}; NCHW max pools and training batch norms by "
            f"cpu_terms; blocks glibc maps afresh under CROSSCUT_CPU_MALLOC={cpu_malloc.mode()}"
        )
    elif spec.kind not in GENERATIONS:
        where = f"analytic default: '{eff.generation}' fractions ({fractions}), kind not a preset"
    elif eff.fitted:
        where = (
            f"calibrated: '{eff.generation}' fractions ({fractions}; fitted: "
            f"{', '.join(eff.fitted)}) from {eff.source}"
        )
    else:
        where = f"analytic default: '{eff.generation}' fractions ({fractions}), {eff.source}"
    host = host_dispatch_s(spec)
    if host > 0:
        where += (
            f"; host: {host * 1e6:.0f} µs to issue a kernel, where kernels are shorter "
            "(measured on a lent H200's host)"
        )
    return {
        "kind": spec.kind,
        "preset": spec.kind if is_preset else "",
        "math": modes,
        "efficiency": where,
        "costs": "analytic",
    }


def channel_scales(
    graph: OpGraph, cluster: Cluster, widths: list[int], *, tf32: bool | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """Per node: width ``w`` (a string) -> kind -> how much more than ``1/w`` of its time
    one of ``w`` channel shards takes (``node_times`` with ``part=1/w``, training time
    as the graph's mode has it). Nodes with no time get none."""
    cluster.validate()
    flags = MathFlags.of(tf32)
    specs: dict[str, DeviceSpec] = {}
    for d in cluster.devices:
        specs.setdefault(d.kind, d)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for n in graph.nodes:
        by_width: dict[str, dict[str, float]] = {}
        for w in sorted({w for w in widths if w > 1}):
            by_kind = {}
            for kind, spec in specs.items():
                whole = sum(node_times(graph, n, spec, flags))
                shard = sum(node_times(graph, n, spec, flags, part=1.0 / w))
                if whole > 0 and shard > 0:
                    by_kind[kind] = shard / (whole / w)
            if by_kind:
                by_width[str(w)] = by_kind
        if by_width:
            out[n.name] = by_width
    return out


def analytic_costs(
    graph: OpGraph, cluster: Cluster, *, optimizer: str = "sgd", tf32: bool | None = None
) -> CostTable:
    """A CostTable with an achieved-rate roofline for every device kind in ``cluster``.

    ``tf32``: price fp32 convolutions and matmuls on Ampere and later at the TF32
    rate (True) or the fp32 rate (False); None follows this process's
    ``torch.backends.cudnn.allow_tf32`` / ``torch.backends.cuda.matmul.allow_tf32``,
    which is what the compiled module will run with.
    """
    cluster.validate()
    flags = MathFlags.of(tf32)
    specs: dict[str, DeviceSpec] = {}
    for d in cluster.devices:
        specs.setdefault(d.kind, d)
    acts = activation_bytes(graph)
    readers = consumers(graph)
    nodes: dict[str, NodeCost] = {}
    fresh = {kind: fresh_seconds(graph, spec) for kind, spec in specs.items()}  # CPU faults
    for n in graph.nodes:
        cost = NodeCost(resident=0 if n.is_io else resident_bytes(n, graph.mode, optimizer))
        cost.activation = acts.get(n.name, 0)
        for kind, spec in specs.items():
            fwd, bwd = node_times(graph, n, spec, flags)
            fault_fwd, fault_bwd = fresh[kind].get(n.name, (0.0, 0.0))
            fwd, bwd = fwd + fault_fwd, bwd + fault_bwd
            cost.fwd[kind] = fwd
            fan_out = fan_out_seconds(n, readers.get(n.name, 0), spec)
            cost.bwd[kind] = bwd + (fan_out if graph.mode == "train" else 0.0)
        nodes[n.name] = cost
    for kind, spec in specs.items():
        _charge_host(graph, nodes, kind, host_dispatch_s(spec), readers)
    meta = {
        "fingerprint": graph.fingerprint(),
        "batch_size": graph.batch_size,
        "rates": {kind: rates_summary(graph, spec, flags) for kind, spec in specs.items()},
        "priced": {kind: priced_rate(graph, spec, flags) for kind, spec in specs.items()},
    }
    return CostTable(nodes, "analytic", graph.mode, optimizer, meta)
