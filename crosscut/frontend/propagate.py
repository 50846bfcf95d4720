"""Fake-tensor shape propagation with per-node FLOP counting (step 2 and 3 of tracing).

Kept apart from :mod:`crosscut.frontend.tracer` because it is the part that
touches torch internals (fake tensors, dispatch modes, reparametrisation); see
that module's docstring for why each choice was made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from crosscut.errors import InputError
from crosscut.frontend.alias import record_writes, versions
from crosscut.precision import autocast

__all__ = [
    "Propagator",
    "conv_backward_flops",
    "first_line",
    "iter_tensors",
    "named_tensors",
    "propagate",
    "shapes_of",
]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class Propagator(torch.fx.Interpreter):
    """Runs the graph on fake tensors, recording per-node outputs and FLOPs."""

    # convolution and linear modules' backward FLOPs from torch's own formulas at the
    # traced shapes, without running their backward (a quarter of a trace's time);
    # tests/test_trace.py checks both ways agree on every kind of convolution
    analytic_backward = True

    def __init__(
        self, gm: torch.fx.GraphModule, mode: FakeTensorMode, device: torch.device, train: bool
    ) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our errors already name the node
        self.fake_mode = mode
        self.device = device
        self.train = train
        self.flops_mode = _FlopMode()
        self._grad_param_cache: dict[str, bool] = {}
        self.flops: dict[str, tuple[int, int]] = {}
        # each convolution node's geometry (groups, kernel, stride, dilation), for the rates
        self.convs: dict[str, dict[str, Any]] = {}
        # each max pool's window (kernel, stride), for its backward's price
        self.pools: dict[str, dict[str, Any]] = {}
        self.needs_grad: dict[str, bool] = {}
        self.concrete: set[str] = set()
        self._fakes: dict[int, Tensor] = {}

    def fake(self, t: Tensor) -> Tensor:
        """A fake twin of ``t`` on the trace device (meta tensors included), cached by identity."""
        if isinstance(t, FakeTensor):
            return t
        if id(t) not in self._fakes:
            if t.device.type == "meta":
                with self.fake_mode:
                    f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
            else:
                f = self.fake_mode.from_tensor(t)
            if t.requires_grad and f.is_floating_point() and not f.requires_grad:
                f.requires_grad_(True)
            self._fakes[id(t)] = f
        return self._fakes[id(t)]

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "get_attr":
            out = tree_map(
                lambda v: self.fake(v) if isinstance(v, Tensor) else v,
                self.fetch_attr(str(n.target)),
            )
        elif n.op in ("call_module", "call_function", "call_method"):
            # version counters before and after: which inputs (and module buffers) the op
            # wrote, views included (they share their base's counter); see alias.py
            module = self.fetch_attr(str(n.target)) if n.op == "call_module" else None
            before = versions(n, self.env, module)
            out = self._run_op(n)
            record_writes(n, before, versions(n, self.env, module))
        else:
            out = super().run_node(n)
        if n.op == "placeholder" or n.op == "get_attr":
            self.needs_grad[n.name] = any(
                isinstance(t, Tensor) and t.requires_grad for t in tree_flatten(out)[0]
            )
        n.meta["val"] = out
        return out

    def _callable(self, n: torch.fx.Node) -> Callable[..., Any]:
        if n.op == "call_module":
            return self.fetch_attr(str(n.target))  # type: ignore[no-any-return]
        if n.op == "call_method":
            name = str(n.target)
            if name == "retain_grad":  # only what a backward keeps; shapes need no grad
                return lambda obj: None
            return lambda obj, *a, **k: getattr(obj, name)(*a, **k)
        return n.target  # type: ignore[return-value]

    def _run_op(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        fn = self._callable(n)
        grad_in = self.train and any(self.needs_grad.get(a.name, False) for a in n.all_input_nodes)
        try:
            out, fwd, bwd, needs = self._counted(n, fn, args, kwargs, grad_in)
        except Exception as fake_exc:
            module = fn if isinstance(fn, nn.Module) else None
            try:
                with unset_fake_temporarily():
                    real_args, real_kwargs = tree_map(self._zeros, (args, kwargs))
                    ctx: AbstractContextManager[Any] = nullcontext()
                    if module is not None:
                        ctx = _reparametrize_module(module, named_tensors(module, self._zeros))
                    with ctx:
                        out, fwd, bwd, needs = self._counted(n, fn, real_args, real_kwargs, grad_in)
                out = tree_map(lambda v: self.fake(v) if isinstance(v, Tensor) else v, out)
                self.concrete.add(n.name)
            except Exception as exc:
                raise _rejected(n, module, args, exc) from fake_exc
        self.flops[n.name] = (fwd, bwd)
        self.needs_grad[n.name] = needs
        return out

    def _zeros(self, v: Any) -> Any:
        if not isinstance(v, Tensor):
            return v
        dev = torch.device("cpu") if v.device.type == "meta" else v.device
        z = torch.zeros(v.shape, dtype=v.dtype, device=dev)
        return z.requires_grad_(v.requires_grad) if z.is_floating_point() else z

    def _counted(
        self, n: torch.fx.Node, fn: Callable[..., Any], args: Any, kwargs: Any, grad_in: bool
    ) -> tuple[Any, int, int, bool]:
        """Forward without autograd; then, only where it can matter, forward+backward.

        Why two runs: recording autograd for every node on fake tensors costs
        more than the whole trace. The counter only knows matmul/conv-like ops,
        whose backward is again matmul/conv-like, so a node whose forward counts
        no FLOPs has a backward that counts none and its backward is skipped.
        """
        start = self.flops_mode.total
        self.flops_mode.conv = self.flops_mode.pool = None
        try:
            with torch.no_grad():
                out = fn(*args, **kwargs)
        except RuntimeError:
            if not (grad_in or self._grad_params(n)):
                raise
            # a forward that needs autograd (a leaf registering a tensor hook, which
            # torch refuses on a tensor that wants no gradient): as a call with autograd
            # on runs it (a training step; an eval call outside no_grad)
            self.flops_mode.conv = self.flops_mode.pool = None
            start = self.flops_mode.total
            with torch.enable_grad():
                out = fn(*args, **kwargs)
        fwd = self.flops_mode.total - start
        if self.flops_mode.conv is not None:
            self.convs[n.name] = self.flops_mode.conv
        if self.flops_mode.pool is not None:
            self.pools[n.name] = self.flops_mode.pool
        floating = any(
            isinstance(t, Tensor) and t.is_floating_point() for t in tree_flatten(out)[0]
        )
        needs = self.train and floating and (grad_in or self._grad_params(n))
        bwd = 0
        if needs and fwd > 0:
            known = self._module_backward_flops(fn, args, out, grad_in)
            bwd = known if known is not None else self._backward_flops(fn, args, kwargs, grad_in)
        return out, fwd, bwd, needs

    def _module_backward_flops(
        self, fn: Callable[..., Any], args: Any, out: Any, grad_in: bool
    ) -> int | None:
        """Backward FLOPs of a plain convolution or linear module, by torch's formulas for
        the ops its backward runs (``convolution_backward``; two ``mm``); None otherwise."""
        if not self.analytic_backward or not isinstance(out, Tensor) or not args:
            return None
        x = args[0]
        if not isinstance(x, Tensor) or x.dtype != out.dtype:
            return None
        w = getattr(fn, "weight", None)
        if type(fn) in _CONVS and isinstance(w, Tensor) and isinstance(fn, nn.modules.conv._ConvNd):
            if fn.padding_mode != "zeros" or isinstance(fn.padding, str):
                return None
            mask = [grad_in, w.requires_grad]
            return conv_backward_flops(list(out.shape), list(x.shape), list(w.shape), False, mask)
        if type(fn) is nn.Linear and isinstance(w, Tensor):
            rows = out.numel() // max(1, out.shape[-1]) if out.dim() else 1
            each = 2 * rows * fn.in_features * fn.out_features  # one mm of the forward's size
            return each * (int(grad_in) + int(w.requires_grad))
        return None

    def _grad_params(self, n: torch.fx.Node) -> bool:
        if n.op != "call_module":
            return False
        key = str(n.target)
        if key not in self._grad_param_cache:
            mod = self.module.get_submodule(key)
            self._grad_param_cache[key] = any(p.requires_grad for p in mod.parameters())
        return self._grad_param_cache[key]

    def _backward_flops(self, fn: Callable[..., Any], args: Any, kwargs: Any, grad_in: bool) -> int:
        """FLOPs of the backward of ``fn`` at these inputs, counted on a fresh autograd graph."""

        def prep(v: Any) -> Any:
            if isinstance(v, Tensor) and grad_in and v.is_floating_point():
                return v.detach().requires_grad_(True).clone()  # non-leaf: in-place ops allowed
            return v

        args, kwargs = tree_map(prep, (args, kwargs))
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.grad_fn is not None]
        if not outs:
            return 0
        start = self.flops_mode.total
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        return self.flops_mode.total - start


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def conv_backward_flops(
    grad_out_shape: list[int],
    x_shape: list[int],
    w_shape: list[int],
    transposed: bool,
    output_mask: list[bool],
) -> int:
    """FLOPs of ``aten.convolution_backward``: each gradient asked for (of the input, of
    the weight) is one convolution of the forward's size.

    The forward multiplies every output element (every input element of a
    transposed convolution) by ``prod(w_shape[1:])`` weights — ``Cin/groups × kh
    × kw`` — so groups are counted. torch's own formula
    (``torch.utils.flop_counter.conv_backward_flop``, torch 2.14) leaves groups out
    ("for the sake of brevity") and counts a depthwise convolution's backward as
    if it were dense: 145x its forward on 144 channels, where a dense one's is 2x.
    Priced that way, MobileNetV2's 17 depthwise backwards took 353 ms of a 458 ms
    predicted CPU step that runs in 190-270 ms."""
    rows = x_shape if transposed else grad_out_shape
    each = 2
    for d in [*rows, *w_shape[1:]]:
        each *= int(d)
    return each * (int(output_mask[0]) + int(output_mask[1]))


_CONV_BACKWARD = torch.ops.aten.convolution_backward
_CONV = torch.ops.aten.convolution
_MAX_POOLS = (
    torch.ops.aten.max_pool2d,
    torch.ops.aten.max_pool2d_with_indices,
    torch.ops.aten.max_pool3d_with_indices,
)


class _FlopMode(TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    """Adds up ``torch.utils.flop_counter``'s per-op formulas (a convolution's backward
    by :func:`conv_backward_flops`, which counts groups), nothing else.

    ``FlopCounterMode`` also tracks modules and tries to decompose every
    unregistered op, which made tracing 3x slower; the formulas are the same.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0
        self.conv: dict[str, Any] | None = None  # geometry of the last forward convolution
        self.pool: dict[str, Any] | None = None  # window of the last forward max pool

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket is _CONV_BACKWARD:  # torch's formula leaves groups out
            grad_out, x, w = args[0], args[1], args[2]
            transposed, mask = bool(args[7]), list(args[10])
            self.total += conv_backward_flops(
                list(grad_out.shape), list(x.shape), list(w.shape), transposed, mask
            )
            return out
        if func._overloadpacket in _MAX_POOLS:
            dims = len(args[0].shape) - 2
            kernel = [int(k) for k in args[1]] * (dims if len(args[1]) == 1 else 1)
            given = list(args[2]) if len(args) > 2 else []
            stride = [int(v) for v in given] * (dims if len(given) == 1 else 1) or kernel
            self.pool = {"kernel": kernel, "stride": stride}
        if func._overloadpacket is _CONV:
            w, stride, padding = args[1], args[3], args[4]
            dilation, transposed, groups = args[5], args[6], args[8]
            self.conv = {
                "groups": int(groups),
                "kernel": [int(k) for k in w.shape[2:]],
                "stride": [int(v) for v in stride],
                "padding": [int(v) for v in padding],
                # oneDNN runs a convolution channels-last when its input is laid out so
                # (ConvNeXt's blocks hand on permuted tensors): other kernels, other rules
                "channels_last": _channels_last(args[0]),
                "dilation": [int(v) for v in dilation],
                "transposed": bool(transposed),
            }
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def _channels_last(x: Any) -> bool:
    """Whether the 4-D tensor ``x`` is laid out channels-last and not also plain NCHW, as
    PyTorch's ``suggest_memory_format`` judges it."""
    if not isinstance(x, Tensor) or x.dim() != 4 or x.is_contiguous():
        return False
    return bool(x.is_contiguous(memory_format=torch.channels_last))


def named_tensors(module: nn.Module, conv: Callable[[Tensor], Any]) -> dict[str, Any]:
    """Every parameter and buffer under every name (ties keep one object per tensor)."""
    cache: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for name, t in iter_tensors(module):
        if id(t) not in cache:
            cache[id(t)] = conv(t)
        out[name] = cache[id(t)]
    return out


def iter_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def shapes_of(values: Any) -> list[list[int]]:
    return [list(t.shape) for t in tree_flatten(values)[0] if isinstance(t, Tensor)]


def _rejected(n: torch.fx.Node, module: nn.Module | None, args: Any, exc: Exception) -> InputError:
    """The model refused the example inputs at node ``n``: say where and with what."""
    where = f"node {n.name!r}"
    if module is not None:
        where += f" (module {n.target!r}, {type(module).__name__})"
    else:
        where += f" ({getattr(n.target, '__name__', n.target)})"
    return InputError(
        f"the model rejected the example inputs at {where}: {first_line(exc)}",
        value=f"input shapes {shapes_of(args)}",
        remedy="pass example inputs with the shape and dtype the model's forward expects "
        "(e.g. (N, 3, H, W) float32 images for torchvision classifiers)",
    )


def _trace_device(inputs: list[Tensor], gm: nn.Module) -> torch.device:
    """The device fake tensors pretend to live on: the first non-meta input or parameter."""
    for t in [*inputs, *(t for _, t in iter_tensors(gm))]:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def propagate(
    gm: torch.fx.GraphModule, inputs: list[Tensor], train: bool, precision: str = "fp32"
) -> Propagator:
    """Run ``gm`` on fake twins of ``inputs`` (under ``precision``'s autocast), recording
    every node's shapes, dtypes, FLOPs and writes; nothing is computed for real."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) > len(placeholders):
        raise InputError(
            f"the model's forward takes {len(placeholders)} input(s) {placeholders}, "
            f"but {len(inputs)} example inputs were given",
            value=f"input shapes {shapes_of(inputs)}",
            remedy="pass one tensor per positional argument of the model's forward",
        )
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    prop = Propagator(gm, fake_mode, _trace_device(inputs, gm), train)
    state = named_tensors(gm, prop.fake)
    fake_inputs = [prop.fake(t) for t in inputs]
    with ExitStack() as stack:
        stack.enter_context(_reparametrize_module(gm, state))
        stack.enter_context(fake_mode)
        stack.enter_context(prop.flops_mode)
        stack.enter_context(autocast(precision, prop.device.type))
        try:
            prop.run(*fake_inputs)
        except InputError:
            raise
        except Exception as exc:  # wrong number of inputs, or a failure outside any op
            raise InputError(
                f"the traced graph could not be run on the example inputs: {first_line(exc)}",
                value=f"input shapes {shapes_of(inputs)}",
                remedy="pass one tensor per positional argument of the model's forward",
            ) from exc
    return prop
