"""The memory model: what a set of nodes keeps on its device while training or inferring.

Three parts, each a rule written down so the partitioner's numbers can be checked:

* **Resident bytes** per node: parameters and buffers; in train mode also one
  gradient per parameter and the optimizer state (sgd 0, momentum 1x params,
  adam/adamw 2x params).
* **Saved activations** per micro-batch (train mode only). We follow what
  autograd really saves, op by op (``derivatives.yaml``): conv / linear / matmul,
  batch and layer norm, pooling, gelu/silu/hardtanh save their *input*; relu,
  sigmoid, tanh, softmax save their *output*; mul/div save both inputs;
  max-pool adds its int64 indices, dropout its byte mask; add, cat, views and
  reductions save nothing. A tensor saved by several ops is counted once, and
  views and in-place ops (``ReLU(inplace=True)``, ``out += identity``) alias
  their input's storage instead of allocating (this is what makes ResNet's
  estimate honest) — except in-place activations whose backward needs their
  original input (ReLU6, SiLU, hardswish...), for which autograd saves a
  copy. ``activation_bytes`` charges each saved storage to the node that
  produced it. ``tests/test_saved_bytes.py`` holds twelve families to autograd's
  own count.
* **Peak**: :func:`peak_memory` simulates one micro-batch's forward then
  backward over the chosen nodes (allocating outputs, freeing them after their
  last reader unless saved, allocating input gradients, freeing saved tensors
  after their last backward reader) and adds ``inflight - 1`` more micro-batches
  of saved activations — the schedule's in-flight count (GPipe: all
  micro-batches; 1F1B: stages after this one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from crosscut.errors import InputError
from crosscut.ir.graph import OpGraph, OpNode

__all__ = [
    "OPTIMIZER_STATE",
    "MemorySim",
    "activation_bytes",
    "copies_input",
    "is_alias",
    "live_tensors",
    "peak_memory",
    "resident_bytes",
    "saved_by",
]

OPTIMIZER_STATE: dict[str, float] = {
    "sgd": 0.0,
    "momentum": 1.0,
    "rmsprop": 2.0,  # square average + momentum buffer (momentum > 0, as EfficientNet trains)
    "adam": 2.0,
    "adamw": 2.0,
}
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}

_VIEW = ("view", "reshape", "flatten", "squeeze", "unsqueeze", "permute", "transpose", "expand",
         "getitem", "split", "chunk", "narrow", "select", "slice", "unbind", "detach", "identity",
         "contiguous", "size", "getattr", "dim", "t")  # fmt: skip
_SAVE_OUT = ("relu", "sigmoid", "tanh", "softmax", "exp", "sqrt", "rsqrt", "elu")
_SAVE_IN = ("conv", "linear", "addmm", "batch_norm", "batchnorm", "layer_norm", "layernorm",
            "group_norm", "instance_norm", "pool", "gelu", "silu", "hardswish", "hardsigmoid",
            "hardtanh", "relu6", "leaky", "mish", "pow", "embedding", "interpolate", "upsample",
            "lrn", "local_response")  # fmt: skip
_SAVE_ALL = ("mul", "div", "matmul", "bmm", "mm", "truediv")
# In-place activations whose backward reads their *original* input: autograd saves a copy
# of it before overwriting (``hardtanh_``, ``silu_``...: the saved ``self`` is a storage of
# its own), so in memory they are out of place. ReLU, leaky ReLU and ELU save their result,
# and stay aliases. Missing this left MobileNetV2's and EfficientNet-B0's saved bytes at
# 0.69-0.72 of autograd's, and their measured peaks on an H200 at 0.68-0.71.
_COPIES_INPUT = ("relu6", "hardtanh", "silu", "hardswish", "hardsigmoid", "mish", "threshold")
_PASS_GRAD = ("add", "sub", "cat", "stack", "mean", "sum", "avg_pool_none")


def _key(node: OpNode) -> tuple[str, str]:
    """Lower-case kind and the last component of the target, the names rules match on."""
    return node.kind.lower(), node.target.lower().rsplit(".", 1)[-1]


def _matches(node: OpNode, names: Iterable[str]) -> bool:
    kind, tgt = _key(node)
    return any(n in (kind, tgt) or (len(n) > 3 and n in kind) for n in names)


def is_alias(graph: OpGraph, node: OpNode) -> bool:
    """True when ``node``'s output shares its first input's storage (views, in-place ops)."""
    if node.op in ("placeholder", "output") or not node.inputs:
        return False
    kind, tgt = _key(node)
    if node.op == "call_module":  # its target is an attribute's name, not an op's: a
        tgt = kind  # module named ``t`` (an ``nn.Tanh``) is not a transpose
    if kind in _VIEW or tgt in _VIEW:
        return True
    if tgt in ("iadd", "isub", "imul", "itruediv") or (
        tgt.endswith("_") and not tgt.endswith("__")
    ):
        return True
    return _inplace_flag(graph, node)


def _shares_storage(graph: OpGraph, node: OpNode) -> bool:
    """:func:`is_alias`, less the in-place ops autograd copies the input of
    (:func:`copies_input`): what the memory model treats as no new storage."""
    return is_alias(graph, node) and not _matches(node, _COPIES_INPUT)


def copies_input(graph: OpGraph, node: OpNode) -> bool:
    """An in-place op whose backward needs its input, so autograd saves a copy of
    it before the write (:data:`_COPIES_INPUT`: ``silu_``, ``hardtanh_``...)."""
    return is_alias(graph, node) and _matches(node, _COPIES_INPUT)


def _inplace_flag(graph: OpGraph, node: OpNode) -> bool:
    """``inplace=True`` on the fx node's module or kwargs, when the GraphModule is at hand."""
    gm = graph.gm
    if gm is None:
        return False
    for fx_node in gm.graph.nodes:
        if fx_node.name != node.name:
            continue
        if bool(fx_node.kwargs.get("inplace", False)):
            return True
        if fx_node.op == "call_module":
            try:
                return bool(getattr(gm.get_submodule(str(fx_node.target)), "inplace", False))
            except AttributeError:
                return False
        return False
    return False


def _itemsize(node: OpNode) -> int:
    return _ITEMSIZE.get(node.dtype, 4)


def saved_by(graph: OpGraph, node: OpNode) -> tuple[list[str], int]:
    """(producer nodes whose outputs ``node`` saves for backward, extra bytes it allocates).

    Producers are named by fx node (``node.name`` itself for an op that saves
    its output); extra bytes are max-pool indices and dropout masks.
    """
    if (
        node.is_io
        or node.op == "get_attr"
        or (_shares_storage(graph, node) and not _matches(node, _SAVE_OUT))
    ):
        return [], 0
    data_in = [i for i in node.inputs if graph.node(i).op != "get_attr"]
    numel = node.out_bytes // _itemsize(node)
    if "dropout" in node.kind.lower():
        return [], numel  # a bool mask, one byte per element
    if _matches(node, _SAVE_OUT) and not _matches(node, ("gelu", "leaky", *_COPIES_INPUT)):
        return [node.name], 0
    if _matches(node, _SAVE_IN):
        extra = numel * 8 if "max" in node.kind.lower() and "pool" in node.kind.lower() else 0
        return data_in[:1], extra
    if _matches(node, _SAVE_ALL):
        return data_in, 0
    return [], 0


@dataclass
class MemorySim:
    """Result of :func:`live_tensors`: bytes above the resident base, for one micro-batch."""

    peak: int  # highest live bytes during forward and backward
    saved: int  # saved-activation bytes held between forward and backward
    by_node: dict[str, int] = field(default_factory=dict)  # saved bytes charged to producers


def _roots(graph: OpGraph) -> dict[str, str]:
    root: dict[str, str] = {}
    for n in graph.nodes:
        root[n.name] = root.get(n.inputs[0], n.inputs[0]) if _shares_storage(graph, n) else n.name
    return root


def live_tensors(graph: OpGraph, nodes: Sequence[str] | None = None, *, training: bool = True,
             grads_resident: bool = True) -> MemorySim:  # fmt: skip
    """Live-tensor simulation of one micro-batch over ``nodes`` (default: all compute nodes)."""
    names = (
        graph.subgraph_names(nodes)
        if nodes is not None
        else [n.name for n in graph.compute_nodes()]
    )
    inside = set(names)
    root = _roots(graph)
    size = {n.name: (0 if n.op == "get_attr" else n.out_bytes) for n in graph.nodes}
    succ = graph.successors()
    pos = {name: i for i, name in enumerate(names)}
    end = len(names)
    # Forward: when each storage is last needed, and who saves it.
    last: dict[str, int] = {}
    savers: dict[str, list[int]] = {}
    extra: dict[str, int] = {}
    for name in names:
        n = graph.node(name)
        for i in n.inputs:
            last[root[i]] = max(last.get(root[i], -1), pos[name])
        if any(s not in inside for s in succ[name]):
            last[root[name]] = end  # sent to a later stage / the loss: live until forward ends
        if training:
            saved, ext = saved_by(graph, n)
            for s in saved:
                savers.setdefault(root[s], []).append(pos[name])
            extra[name] = ext
    live: dict[str, int] = {}
    for name in names:  # storages received from outside the set (incl. the input batch)
        for i in graph.node(name).inputs:
            if i not in inside and graph.node(i).op != "get_attr":
                live.setdefault(root[i], size[root[i]])
    peak = sum(live.values())
    for name in names:
        if root[name] == name:
            live[name] = size[name]
        if extra.get(name):
            live[f"extra:{name}"] = extra[name]
        peak = max(peak, sum(live.values()))
        for r in [r for r in live if last.get(r, -1) <= pos[name] and r not in savers]:
            if not r.startswith("extra:"):
                del live[r]
    by_node = {r: size[r] for r in savers}
    saved_total = sum(by_node.values()) + sum(extra.values())
    for r in [r for r in live if r not in savers and not r.startswith("extra:")]:
        if last.get(r, -1) < end:
            del live[r]
    if not training:
        return MemorySim(peak, 0, {})
    # Backward: reverse order; gradients appear, saved tensors go after their first saver.
    release = {r: min(p) for r, p in savers.items()}
    grads: dict[str, int] = {}
    for name in names:
        if any(s not in inside for s in succ[name]):
            grads[name] = size[root[name]]  # incoming gradient from the loss / later stage
    param_grads = 0
    for name in reversed(names):
        n = graph.node(name)
        g = grads.pop(name, 0)
        alias = _shares_storage(graph, n) or _matches(n, _PASS_GRAD)
        transient = 0
        for i in n.inputs:
            p = graph.node(i)
            if p.op in ("placeholder", "get_attr"):
                continue
            new = 0 if alias and g else size[root[i]]
            if i in grads:
                transient += new  # accumulated into the existing buffer
            else:
                grads[i] = new
        if not grads_resident:
            param_grads += n.param_bytes
        current = sum(live.values()) + sum(grads.values()) + g + transient + param_grads
        peak = max(peak, current)
        for r in [r for r, at in release.items() if at == pos[name]]:
            live.pop(r, None)
        live.pop(f"extra:{name}", None)
    return MemorySim(peak, saved_total, by_node)


def resident_bytes(node: OpNode, mode: str = "train", optimizer: str = "sgd") -> int:
    """Parameters and buffers, plus gradients and optimizer state when training."""
    if optimizer not in OPTIMIZER_STATE:
        raise InputError(
            "the optimizer must be one the memory model knows",
            value=optimizer,
            remedy=f"use one of {sorted(OPTIMIZER_STATE)}",
        )
    if mode != "train":
        return node.param_bytes + node.buffer_bytes
    return int(node.param_bytes * (2 + OPTIMIZER_STATE[optimizer])) + node.buffer_bytes


def activation_bytes(graph: OpGraph, mode: str | None = None) -> dict[str, int]:
    """Saved bytes per micro-batch charged to each node (0 everywhere in infer mode)."""
    if (mode or graph.mode) != "train":
        return {n.name: 0 for n in graph.nodes}
    sim = live_tensors(graph, training=True)
    out = {n.name: sim.by_node.get(n.name, 0) for n in graph.nodes}
    for n in graph.compute_nodes():
        out[n.name] += saved_by(graph, n)[1]
    return out


def peak_memory(
    graph: OpGraph,
    nodes: Sequence[str] | None = None,
    inflight_microbatches: int = 1,
    *,
    mode: str | None = None,
    optimizer: str = "sgd",
    grads_resident: bool = True,
) -> int:
    """Peak bytes on a device running ``nodes`` with ``inflight_microbatches`` in flight.

    ``grads_resident=True`` (the pipeline case: gradients accumulate across
    micro-batches) counts every gradient from the start; ``False`` models one
    plain step after ``zero_grad(set_to_none=True)``, where gradients appear
    during backward.
    """
    if inflight_microbatches < 1:
        raise InputError("at least one micro-batch is in flight", value=inflight_microbatches)
    training = (mode or graph.mode) == "train"
    names = (
        graph.subgraph_names(nodes)
        if nodes is not None
        else [n.name for n in graph.compute_nodes()]
    )
    sim = live_tensors(graph, names, training=training, grads_resident=grads_resident)
    m = "train" if training else "infer"
    res = sum(resident_bytes(graph.node(x), m, optimizer) for x in names)
    if training and not grads_resident:
        res -= sum(graph.node(x).param_bytes for x in names)
    return res + sim.peak + (inflight_microbatches - 1) * sim.saved
