"""Trace an ``nn.Module`` into an :class:`~crosscut.ir.graph.OpGraph` on fake tensors.

Three steps, each chosen so that tracing a 600M-parameter model on a laptop is
cheap and never touches real data, and a fourth that does, on a few rows:

1. **Symbolic trace** with :class:`torch.fx.Tracer`. A submodule whose forward
   fx cannot follow (data-dependent control flow such as ``if x.sum() > 0``) is
   made a *leaf* automatically: the tracer catches the failure at the innermost
   ``call_module`` frame, emits an opaque ``call_module`` node there and goes
   on, so one pass finds every failing submodule; a clean retrace with those
   leaves builds the final graph. Failures in the root's own forward (e.g.
   torchvision detection models) cannot be fixed this way and raise
   :class:`~crosscut.errors.TraceError`.
2. **Shape propagation** under :class:`FakeTensorMode`: parameters (real or on
   the ``meta`` device) and inputs become fake tensors, so every op computes
   only metadata. A node the fake kernels cannot run (a data-dependent leaf)
   falls back to real execution on *zeros* of the right shapes.
3. **FLOPs** with :class:`~torch.utils.flop_counter.FlopCounterMode` during
   that same pass. Backward FLOPs are *counted*, not estimated: each node is
   re-run on detached inputs and ``autograd.backward`` is called on its fake
   outputs, with gradients required only where the real backward needs them
   (not for the input images, so the first conv pays no input-gradient FLOPs).
   In ``mode="infer"`` no backward runs and ``bwd_flops`` is 0.
4. **Ops that mix samples** (:mod:`crosscut.frontend.row_probe`): where the
   model and inputs are real, the graph runs once on 4 of the example rows,
   each op also on its inputs' first 2 rows, as a batch-split member would;
   the model's state and the random streams are given back. Skipped on
   ``meta`` tensors (``OpGraph.row_mixing`` is ``None``).

``mode`` also sets ``module.training`` while tracing (restored afterwards), so
``if self.training`` branches and dropout are traced as they will run.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from crosscut.errors import InputError, TraceError
from crosscut.frontend.alias import find_root, order_mutations, written_state_ties
from crosscut.frontend.autocast_check import refusing_autocast
from crosscut.frontend.autograd_functions import OpaqueFunctionError, tracing_autograd_functions
from crosscut.frontend.factory_sizes import packing_factory_sizes
from crosscut.frontend.grad_mode import NO_GRAD, detach_no_grad
from crosscut.frontend.hidden_writes import HiddenWriteError, refusing_hidden_writes
from crosscut.frontend.model_check import check_model
from crosscut.frontend.propagate import Propagator, first_line, iter_tensors, propagate, shapes_of
from crosscut.frontend.python_state import (
    persist_rebound,
    rebound_buffers,
    refuse_changed_layout,
    refuse_own_generators,
    refusing_python_state,
)
from crosscut.frontend.row_probe import copied_back, row_mixing_ops
from crosscut.frontend.stock import hooked, refuse_lost_hooks
from crosscut.frontend.tensor_hooks import TensorHookError, check_tensor_hook
from crosscut.frontend.written_state import mark_bn_stats
from crosscut.ir.graph import MODES, OpGraph, OpNode

__all__ = ["runs_channels_last", "trace"]


# Module class names whose generic snake_case would read badly ("re_lu").
_CLASS_KINDS = {
    "ReLU": "relu",
    "ReLU6": "relu6",
    "LeakyReLU": "leaky_relu",
    "PReLU": "prelu",
    "RReLU": "rrelu",
    "SiLU": "silu",
    "GELU": "gelu",
    "ELU": "elu",
    "CELU": "celu",
    "SELU": "selu",
    "GLU": "glu",
    "SyncBatchNorm": "batch_norm",
    "MultiheadAttention": "multihead_attention",
}
# Function names that are the same family as another ("x += y" is an add).
_FN_KINDS = {
    "iadd": "add",
    "isub": "sub",
    "imul": "mul",
    "itruediv": "div",
    "truediv": "div",
    "floordiv": "floor_divide",
    "linear": "linear",
}


def _snake(name: str) -> str:
    """``AdaptiveAvgPool2d`` -> ``adaptive_avg_pool2d``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _module_kind(module: nn.Module) -> str:
    """Short family name of a module: the class name in snake case, dims dropped for norms."""
    cls = type(module).__name__
    if cls in _CLASS_KINDS:
        return _CLASS_KINDS[cls]
    return re.sub(r"^(batch_norm|instance_norm|lazy_batch_norm)[123]d$", r"\1", _snake(cls))


def _callable_kind(fn: Any) -> str:
    """Short family name of a function or method name (``relu_`` -> ``relu``)."""
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", type(fn).__name__)
    name = name.strip("_") or name
    return _FN_KINDS.get(name, _snake(name))


# ---- 1. symbolic trace with automatic leaves ------------------------------------------------


class _LeafTracer(torch.fx.Tracer):
    """A Tracer that turns submodules fx cannot follow into leaves instead of failing.

    The innermost failing ``call_module`` frame catches the exception first, so
    the recorded module is the smallest one that fails.
    """

    def __init__(self, leaves: set[str], leaf_types: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        # buffers read in forward become get_attr nodes, so ``self.calls.add_(1)`` is a
        # node of the graph (run on every call) instead of running once, on the caller's
        # real buffer, while tracing
        self.proxy_buffer_attributes = True
        self.leaves = set(leaves)
        self.leaf_types = leaf_types
        self.found: dict[str, str] = {}

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        if not torch.is_grad_enabled():  # inside the forward's own torch.no_grad()
            node.meta[NO_GRAD] = True
        return node

    def create_proxy(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> Any:
        check_tensor_hook(kind, target)  # y.register_hook(fn): a leaf, or refused
        return super().create_proxy(kind, target, *args, **kwargs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves or isinstance(m, self.leaf_types):
            return True
        if hooked(m):  # its hooks run only if it is called as a module: stock.py
            return True
        return bool(super().is_leaf_module(m, module_qualified_name))

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        depth = len(self.module_stack)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            try:
                path = self.path_of_module(m)
            except Exception:
                raise exc from None
            if path in self.leaves:
                raise  # failed while emitting the leaf itself: nothing left to cut out
            while len(self.module_stack) > depth:  # fx pops only on success
                self.module_stack.popitem(last=True)
            self.found.setdefault(path, first_line(exc))
            self.leaves.add(path)
            return self.create_proxy("call_module", path, args, kwargs)


def _symbolic_trace(
    model: nn.Module, user_leaves: set[str], leaf_types: tuple[type[nn.Module], ...]
) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """Trace, find failing submodules in one pass, retrace cleanly with them as leaves."""
    auto: dict[str, str] = {}
    for _ in range(sum(1 for _ in model.modules()) + 1):
        tracer = _LeafTracer(user_leaves | set(auto), leaf_types)
        try:
            # enable_grad: so NO_GRAD marks only the forward's own no_grad blocks
            with (
                torch.enable_grad(),
                rebound_buffers(model) as rebound,
                tracing_autograd_functions(),  # custom backwards: autograd_functions.py
                packing_factory_sizes(),  # torch.zeros(x.size(0), 4): factory_sizes.py
                refusing_hidden_writes(model),  # p.mul_() via .parameters(): hidden_writes.py
            ):
                graph = tracer.trace(model)
        except Exception as exc:
            raise _root_failure(model, exc, auto) from exc
        if not tracer.found:
            break
        auto.update(tracer.found)
    kept = {p: r for p, r in auto.items() if not any(p.startswith(q + ".") for q in auto)}
    persist_rebound(graph, rebound)  # self.ema = ... kept as a write: python_state.py
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    detach_no_grad(gm)  # fx does not record torch.no_grad(): see grad_mode.py
    mark_bn_stats(model, gm)  # functional batch norms on a module's buffers: written_state.py
    return gm, dict(sorted(kept.items()))


def _root_failure(model: nn.Module, exc: Exception, auto: dict[str, str]) -> TraceError:
    """The root's own forward is untraceable: name it and suggest a part to partition."""
    if isinstance(exc, (OpaqueFunctionError, HiddenWriteError, TensorHookError)):
        return exc.refusal(type(model).__name__)
    children = list(model.named_children())
    suggest = "backbone" if hasattr(model, "backbone") else ""
    if not suggest and children:
        suggest = max(children, key=lambda c: sum(p.numel() for p in c[1].parameters()))[0]
    remedy = (
        f"partition a traceable part instead, e.g. crosscut.trace(model.{suggest}, ...), "
        if suggest
        else "rewrite the forward without data-dependent Python control flow, "
    )
    return TraceError(
        f"torch.fx cannot trace the forward of the root module {type(model).__name__} "
        f"itself ({first_line(exc)}); only submodules can be made leaves automatically"
        + (f" (auto-leaves so far: {sorted(auto)})" if auto else ""),
        value=type(model).__name__,
        remedy=remedy + "or pass leaf_modules=[...] naming the submodules the forward inspects",
    )


@contextmanager
def _training(model: nn.Module, train: bool) -> Iterator[None]:
    """Trace in ``train`` mode, restoring each module's own flag afterwards. In the mode the
    model is in, each submodule keeps its own flag (a batch norm frozen by ``.eval()``
    inside a training model must trace as eval); the other mode is what the model's own
    ``.train(train)`` makes (an override that keeps batch norms frozen included)."""
    saved = [(m, m.training) for m in model.modules()]
    if model.training != train:
        model.train(train)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextmanager
def _untouched_state(model: nn.Module) -> Iterator[None]:
    """Give every buffer back as it was: tracing must not change the caller's model.

    Nothing traced writes a buffer (buffers are graph nodes), but Python code run for
    real (a tensor attribute that is not a buffer's alias, a leaf's hook) could, and the
    probe for ops that mix samples (``row_probe.py``) runs the model on a few rows. Every
    buffer is cloned (statistics, counters: small) and copied back (batch norm's kernel
    updates its statistics without moving their version counter); parameters are nodes.
    """
    with copied_back(b for b in model.buffers() if b.device.type != "meta"):
        yield


# ---- the public entry point ------------------------------------------------------------------


def trace(
    model: nn.Module,
    example_inputs: Tensor | Sequence[Tensor],
    *,
    mode: str = "train",
    leaf_modules: Sequence[str | type[nn.Module]] = (),
    precision: str = "fp32",
) -> OpGraph:
    """Trace ``model`` into an :class:`OpGraph` with shapes, bytes and FLOPs per fx node.

    ``precision`` ``"bf16"``/``"fp16"`` propagates under ``torch.autocast`` with
    that dtype, so each node records the dtype and bytes it has when run so
    (:mod:`crosscut.precision`).

    ``example_inputs`` fix the shapes (dim 0 of the first is the batch); they may
    live on the ``meta`` device, and so may the model's parameters. Only the
    probe for ops that mix samples computes on them, on 4 rows at most, and
    not on ``meta`` tensors. ``leaf_modules`` names submodule paths or classes to keep
    opaque. ``OpGraph.gm`` is the traced GraphModule; its node names are the
    OpNode names.
    """
    inputs, leaf_paths, leaf_types = _validate(model, example_inputs, mode, leaf_modules)
    train = mode == "train"
    with _training(model, train), _untouched_state(model), refusing_python_state(model):
        with refusing_autocast(precision):
            gm, auto = _symbolic_trace(model, leaf_paths, leaf_types)
        refuse_lost_hooks(model, gm)
        refuse_own_generators(model, gm)
        prop = propagate(gm, inputs, train, precision)
        refuse_changed_layout(gm)
        # writes through views, and buffers a functional norm writes: frontend/alias.py
        ties = _ties(gm) + order_mutations(gm) + written_state_ties(gm)
        mixing = row_mixing_ops(model, gm, inputs)  # a run on a few rows, where real
    nodes = _build_nodes(gm, prop, auto)
    graph = OpGraph(
        nodes=nodes,
        batch_size=int(inputs[0].shape[0]),
        mode=mode,
        ties=ties,
        leaves=auto,
        model_name=type(model).__name__,
        precision=precision,
        channels_last=runs_channels_last(model, inputs),
        row_mixing=None if mixing is None else sorted(mixing),
        gm=gm,
    )
    return graph


def runs_channels_last(model: nn.Module, inputs: list[Tensor]) -> bool:
    """Whether the model's convolutions run channels-last (NHWC) as PyTorch runs them.

    A convolution's output takes the channels-last layout when its input or its
    weight has it, and passes it on: a model converted with
    ``model.to(memory_format=torch.channels_last)``, or fed a channels-last
    image, runs NHWC throughout; anything else runs PyTorch's default NCHW."""

    def nhwc(t: Tensor) -> bool:
        return (
            t.dim() == 4
            and not t.is_contiguous()
            and t.is_contiguous(memory_format=torch.channels_last)
        )

    # the stored tensors, not ``m.weight``: on a parametrized convolution that runs the
    # parametrization, and spectral norm's then takes a power-iteration step in place
    weights = (p for m in model.modules() if isinstance(m, nn.Conv2d) for p in m.parameters())
    return any(nhwc(w) for w in weights) or (bool(inputs) and nhwc(inputs[0]))


def _validate(
    model: Any, example_inputs: Any, mode: Any, leaf_modules: Any
) -> tuple[list[Tensor], set[str], tuple[type[nn.Module], ...]]:
    check_model(model)  # a module, lazy ones initialised
    if isinstance(example_inputs, Tensor):
        example_inputs = [example_inputs]
    if not isinstance(example_inputs, (tuple, list)) or not all(
        isinstance(t, Tensor) for t in example_inputs
    ):
        raise InputError(
            "example_inputs must be a Tensor or a tuple/list of Tensors",
            value=type(example_inputs).__name__,
            remedy="pass e.g. torch.randn(1, 3, 224, 224) or (images,)",
        )
    inputs = list(example_inputs)
    if not inputs or inputs[0].dim() == 0 or inputs[0].shape[0] < 1:
        raise InputError(
            "the first example input needs a batch dimension 0 of size >= 1",
            value=[list(t.shape) for t in inputs],
            remedy="pass a batched tensor, e.g. torch.randn(1, 3, 224, 224)",
        )
    if mode not in MODES:
        raise InputError(
            f"mode must be one of {MODES}", value=mode, remedy="use 'train' or 'infer'"
        )
    paths: set[str] = set()
    types: list[type[nn.Module]] = []
    for item in leaf_modules:
        if isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
            continue
        try:
            model.get_submodule(item)
        except (AttributeError, TypeError):
            raise InputError(
                "leaf_modules entries are submodule paths of the model or nn.Module classes",
                value=item,
                remedy="use a name from model.named_modules(), e.g. 'layer4.0'",
            ) from None
        paths.add(item)
    return inputs, paths, tuple(types)


def _tensor_bytes(values: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_flatten(values)[0] if isinstance(t, Tensor)
    )


def _node_tensors(gm: torch.fx.GraphModule, n: torch.fx.Node) -> list[tuple[str, Tensor]]:
    """The parameters/buffers/constants a node reads directly, under their qualified names."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        return [(f"{n.target}.{k}", t) for k, t in iter_tensors(mod)]
    if n.op == "get_attr":
        obj = gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        if isinstance(obj, Tensor):
            return [(str(n.target), obj)]
    return []


def _build_nodes(gm: torch.fx.GraphModule, prop: Propagator, auto: dict[str, str]) -> list[OpNode]:
    canon: dict[int, str] = {}
    for name, t in iter_tensors(gm):
        canon.setdefault(id(t), name)
    param_ids = {id(p) for p in gm.parameters()}
    counted: set[int] = set()
    nodes: list[OpNode] = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        tensors = list(tree_flatten(val)[0])
        first = next((t for t in tensors if isinstance(t, Tensor)), None)
        node = OpNode(
            name=n.name,
            op=n.op,
            kind=_kind(gm, n),
            target=_target(n),
            inputs=[a.name for a in n.all_input_nodes],
            shapes=shapes_of(val),
            dtype=str(first.dtype).removeprefix("torch.") if first is not None else "none",
            out_bytes=0 if n.op == "output" else _tensor_bytes(val),
            module_path=_module_path(n),
            leaf_reason=auto.get(str(n.target)) if n.op == "call_module" else None,
            non_tensor=first is None or any(not isinstance(t, Tensor) for t in tensors),
        )
        node.fwd_flops, node.bwd_flops = prop.flops.get(n.name, (0, 0))
        node.conv = prop.convs.get(n.name)
        node.pool = prop.pools.get(n.name)
        own: dict[int, Tensor] = {}
        for qual, t in _node_tensors(gm, n):
            own.setdefault(id(t), t)
            if canon.get(id(t), qual) not in node.params:
                node.params.append(canon.get(id(t), qual))
        for tid, t in own.items():
            if tid in counted:
                continue
            counted.add(tid)
            size = t.numel() * t.element_size()
            if tid in param_ids:
                node.param_bytes += size
            else:
                node.buffer_bytes += size
        if n.op in ("call_module", "call_function", "call_method"):
            args = [a.meta.get("val") for a in n.all_input_nodes]
            node.read_bytes = _tensor_bytes(args) + sum(
                t.numel() * t.element_size() for t in own.values()
            )
        if n.name in prop.concrete and node.leaf_reason is None:
            node.leaf_reason = "ran on zeros: fake tensors could not run this op"
        nodes.append(node)
    return nodes


def _kind(gm: torch.fx.GraphModule, n: torch.fx.Node) -> str:
    if n.op in ("placeholder", "output", "get_attr"):
        return str(n.op)
    if n.op == "call_module":
        return _module_kind(gm.get_submodule(str(n.target)))
    return _callable_kind(n.target)


def _target(n: torch.fx.Node) -> str:
    if n.op == "call_function":
        if n.target is operator.getitem:
            return "getitem"
        return str(torch.fx.node._get_qualified_name(n.target))  # type: ignore[arg-type]
    return str(n.target)


def _module_path(n: torch.fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])


def _ties(gm: torch.fx.GraphModule) -> list[list[str]]:
    """Groups of nodes that read a common parameter or buffer (union-find over tensor ids)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        return find_root(parent, x)

    first_user: dict[int, str] = {}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        for _, t in _node_tensors(gm, n):
            parent.setdefault(n.name, n.name)
            if id(t) in first_user:
                a, b = find(first_user[id(t)]), find(n.name)
                if a != b:
                    parent[max(a, b, key=order.__getitem__)] = min(a, b, key=order.__getitem__)
            else:
                first_user[id(t)] = n.name
    groups: dict[str, list[str]] = {}
    for name in sorted(parent, key=order.__getitem__):
        groups.setdefault(find(name), []).append(name)
    return [g for g in groups.values() if len(g) > 1]
