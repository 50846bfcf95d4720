"""Find the ops that mix samples by running them: a share must compute its own rows.

A batch-split stage runs each member on a share of the micro-batch and joins
the shares' outputs along dim 0. That is right only for ops whose output rows
for a sample depend on that sample's input rows alone. The traced shapes catch
the ops that change the batch's size (a mean over it, a 0-d loss:
``partitioner/build.mixes_batch_value``) and the call arguments catch those
that name dim 0 (``frontend/batch_dims.py``); neither sees ``x @ x.T``,
``torch.cdist(x, x)``, or a leaf module that normalises across the batch.

So the model is run for real on a few rows, once: ``big`` rows of the example
inputs (4 when the batch allows), and each op is also run on the first half of
its inputs' rows (its share), exactly as a batch-split member would run it. An
op whose share output is not the first rows of its whole output mixes samples.
Batch norm is left out (per-share statistics are the runtime's documented
``bn_mode`` contract), and so is an op that draws random numbers (dropout,
stochastic depth: a share's rows differ by chance, not by mixing). An op
that cannot run on a share at all counts as mixing: no batch-split stage
could run it either.

The same run records which buffers each leaf module wrote, by their values
(``node.meta[STATE]``, read by ``frontend/written_state.py``): a fused kernel such
as QAT's ``fused_moving_avg_obs_fake_quant`` updates its observer and scale without
moving a version counter, which is all the fake-tensor trace can watch. A write
that leaves a value as it was is not seen.

The probe needs real tensors: a model or inputs on the ``meta`` device, or a
model whose state is too large to copy back, are not probed (``None``: the
static rules alone decide). The caller's parameters and random number
streams are given back as they were here; its buffers by the tracer, which
runs the probe inside ``_untouched_state``.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from crosscut.frontend.alias import STATE
from crosscut.frontend.stock import stock_module
from crosscut.frontend.written_state import state_writes

__all__ = ["copied_back", "row_mixing_ops"]

MAX_STATE_BYTES = 2 << 30  # copies of parameters and buffers the probe may hold
Probed = tuple[frozenset[str] | None, dict[str, list[str]]]  # (mixing ops, state by node)
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[str, Probed]] = weakref.WeakKeyDictionary()


def row_mixing_ops(
    model: nn.Module, gm: fx.GraphModule, inputs: list[Tensor]
) -> frozenset[str] | None:
    """Names of ``gm``'s nodes whose output rows for one sample read other samples' rows.

    Run in the modes the model is in (the tracer has set them). ``None`` where
    the probe cannot run (see the module docstring). The answer is cached per
    model and traced code: a model traced at several micro-batch sizes is
    probed once."""
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
    if batch < 2 or not _real(model, inputs):
        return None
    big = 4 if batch >= 4 else 2  # shares of 2 rows where there are 4: a share of one
    # is a case of its own (``x.squeeze()`` drops its batch dim), probed only when traced
    key = f"{big}:{hashlib.sha256(gm.code.encode()).hexdigest()}"
    cached = _CACHE.setdefault(model, {})
    if key not in cached:
        cached[key] = _probe(model, gm, inputs, batch, big)
    mixing, writes = cached[key]
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, keys in writes.items():  # the same code, so the same node names
        node = by_name[name]
        node.meta[STATE] = sorted({*node.meta.get(STATE, []), *keys})
    return mixing


def _probe(
    model: nn.Module, gm: fx.GraphModule, inputs: list[Tensor], batch: int, big: int
) -> Probed:
    """(the ops that mix samples, the module state each leaf wrote) from one run."""
    rows = [_rows(t, batch, big) for t in inputs]
    devices = sorted(
        {
            torch.cuda.current_device() if t.device.index is None else t.device.index
            for t in [*inputs, *model.parameters()]
            if t.device.type == "cuda"
        }
    )
    try:
        with _given_back(model, gm), torch.random.fork_rng(devices=devices), torch.no_grad():
            probe = _Probe(gm, batch, big, devices)
            probe.run(*rows)
            return frozenset(probe.mixing), probe.writes
    except Exception:  # shapes fixed at the traced batch, an op refusing few rows
        return None, {}


def _real(model: nn.Module, inputs: list[Tensor]) -> bool:
    state = [*model.parameters(), *model.buffers()]
    if any(t.device.type == "meta" or isinstance(t, FakeTensor) for t in [*state, *inputs]):
        return False
    return sum(t.numel() * t.element_size() for t in state) <= MAX_STATE_BYTES


def _rows(t: Tensor, batch: int, big: int) -> Tensor:
    """The first ``big`` rows of a batch-major input, copied (ops may write in place);
    identical rows are nudged apart, or no mixing could show."""
    if t.dim() == 0 or int(t.shape[0]) != batch:
        return t.clone()
    x = t[:big].clone()
    if x.is_floating_point() and all(torch.equal(x[0], x[i]) for i in range(1, big)):
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
        x = x + noise.to(x) * (1e-2 * (float(x.abs().max()) + 1.0))
    return x


@contextmanager
def _given_back(model: nn.Module, gm: fx.GraphModule) -> Iterator[None]:
    """Parameters as they were: the probe runs the ops that write them. (Buffers are
    the tracer's: ``tracer._untouched_state`` gives every one back.)

    Copied: the parameters the traced graph writes (``written_state.state_writes``)
    and those of modules run as opaque leaves. Not every parameter: a VGG's would
    cost 0.5 GB a process, on every torchrun rank."""
    named = dict(model.named_parameters())
    written = [named[k] for _, k in state_writes(gm) if k in named]
    opaque = [
        m
        for n in gm.graph.nodes
        if n.op == "call_module"
        and not stock_module(m := gm.get_submodule(str(n.target)), _PER_SAMPLE_MODULES)
    ]
    state = {id(p): p for p in [*written, *(p for m in opaque for p in m.parameters())]}
    with copied_back(state.values()):
        yield


@contextmanager
def copied_back(tensors: Iterable[Tensor]) -> Iterator[None]:
    """Copy ``tensors`` now and copy every one back on the way out, written or not (a
    version counter does not tell: batch norm's kernel moves none). One the run resized
    (a QAT observer's per-channel scale, empty until its first forward) gets its old
    shape back with its values."""
    saved = [(t, t.detach().clone()) for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, copy in saved:
                if t.shape != copy.shape:
                    t.data = copy
                else:
                    t.copy_(copy)


def _graded(n: fx.Node, run: Callable[[], Any]) -> Any:
    """``run()`` without autograd, as the probe runs; a leaf module that fails there runs
    again with it (one registering a tensor hook needs it: frontend/tensor_hooks.py)."""
    try:
        return run()
    except RuntimeError:
        if n.op != "call_module":
            raise
        with torch.enable_grad():
            return run()


class _Probe(fx.Interpreter):
    """Runs ``gm`` on ``big`` rows; before each op, runs it on its inputs' first half."""

    def __init__(self, gm: fx.GraphModule, batch: int, big: int, devices: list[int]) -> None:
        super().__init__(gm)
        self.extra_traceback = False
        self.batch, self.big, self.half = batch, big, big // 2
        self.devices = devices  # CUDA devices whose random streams an op may draw from
        self.fed: set[fx.Node] = set()  # computed from a model input
        self.shared: dict[fx.Node, Any] = {}  # values that are not plain tensors, per share
        self.mixing: set[str] = set()
        # module state each call_module node wrote (its buffers' values moved)
        self.writes: dict[str, list[str]] = {}

    def run_node(self, n: fx.Node) -> Any:
        """Each node, and which of a leaf module's buffers it wrote, by their values: a
        fused kernel (QAT's ``fused_moving_avg_obs_fake_quant`` writing its observer's
        min/max and its scale) moves no version counter, which the trace's record
        (``frontend/alias.record_writes``) reads."""
        if n.op != "call_module":
            return self._run_one(n)
        module = self.module.get_submodule(str(n.target))
        before = [(k, b, b.clone()) for k, b in module.named_buffers()]
        out = self._run_one(n)
        moved = [k for k, b, old in before if not torch.equal(b, old)]
        if moved:
            self.writes[n.name] = [f"{n.target}.{k}" for k in moved]
        return out

    def _run_one(self, n: fx.Node) -> Any:
        if n.op == "placeholder":
            self.fed.add(n)
            return super().run_node(n)
        if n.op in ("get_attr", "output"):
            return super().run_node(n)
        if any(u in self.fed for u in n.all_input_nodes):
            self.fed.add(n)
        if n not in self.fed or _batch_norm(self.module, n) or _per_sample_op(self.module, n):
            return super().run_node(n)
        share_args = fx.map_arg((n.args, n.kwargs), self._share_of)
        try:
            share = _graded(n, lambda: getattr(self, n.op)(n.target, *_cloned(share_args)))
        except Exception:
            share = _FAILED
        streams = self._streams()
        out = _graded(n, lambda: super(_Probe, self).run_node(n))
        if not isinstance(out, Tensor) and share is not _FAILED:
            self.shared[n] = share
        # an op that draws random numbers (dropout, stochastic depth) gives other rows on
        # a share by chance, not by mixing: it is not judged
        drew = any(not torch.equal(a, b) for a, b in zip(streams, self._streams()))
        if not drew and not self._rows_agree(n, out, share):
            self.mixing.add(n.name)
        return out

    def _streams(self) -> list[Tensor]:
        """The random number generators' states: the CPU's and each CUDA device's used."""
        return [torch.random.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in self.devices]

    def _share_of(self, u: fx.Node) -> Any:
        """What a share's member holds of ``u``'s current value."""
        value = self.env[u]
        if u not in self.fed:
            return value
        if not isinstance(value, Tensor) and u in self.shared:
            return self.shared[u]
        leaves, spec = tree_flatten(value)
        per = self._per_sample(u, leaves)
        return tree_unflatten([v[: self.half * k] if k else v for v, k in zip(leaves, per)], spec)

    def _per_sample(self, n: fx.Node, leaves: list[Any]) -> list[int | None]:
        """For each leaf of ``n``'s value, the rows it holds per sample where it holds
        the batch along dim 0 (traced ``batch * k`` rows, here ``big * k``); ``None``
        for a leaf that does not, and 0 for one the tracer saw as batch-major that is
        not here (its dim 0 only matched the batch by chance: a transpose, a mean)."""
        traced, _ = tree_flatten(n.meta.get("val"))
        if len(traced) != len(leaves):
            traced = [None] * len(leaves)
        out: list[int | None] = []
        for v, t in zip(leaves, traced):
            if isinstance(t, Tensor):
                rows = int(t.shape[0]) if t.dim() else 0
                k = rows // self.batch if rows and rows % self.batch == 0 else None
            elif isinstance(v, Tensor) and v.dim() and int(v.shape[0]) % self.big == 0:
                k = int(v.shape[0]) // self.big  # not traced: judged by its size here
            else:
                k = None
            if k is not None and not (
                isinstance(v, Tensor) and v.dim() and v.shape[0] == self.big * k
            ):
                k = 0
            out.append(k)
        return out

    def _rows_agree(self, n: fx.Node, out: Any, share: Any) -> bool:
        """Whether each batch-major leaf of ``out`` begins with the share's output."""
        outs, _ = tree_flatten(out)
        per = self._per_sample(n, outs)
        if all(k is None for k in per):
            return True  # no rows to compare: the traced shapes judge it
        if share is _FAILED or 0 in per:
            return False
        shares, _ = tree_flatten(share)
        if len(shares) != len(outs):
            return False
        return all(k is None or _close(o[: self.half * k], s) for o, s, k in zip(outs, shares, per))


_FAILED = object()


def _batch_norm(root: nn.Module, n: fx.Node) -> bool:
    """Batch norm, by module or by function, or a leaf module holding one: its per-share
    statistics are the ``bn_mode`` contract, not a mixing to refuse."""
    if n.op == "call_module":
        mod = root.get_submodule(str(n.target))
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in mod.modules())
    name = getattr(n.target, "__name__", str(n.target))
    return "batch_norm" in name


# ops that compute each sample's rows from its own alone, whatever their inputs: the
# convolutions and matmuls that are most of a CNN's time are not run a second time
_PER_SAMPLE_MODULES = {  # exact types, without hooks (stock.py)
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool2d,
    nn.Dropout,
    nn.Dropout2d,
    nn.ReLU,
    nn.ReLU6,
    nn.SiLU,
    nn.GELU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Sigmoid,
    nn.Tanh,
    nn.LeakyReLU,
    nn.Identity,
}
_PER_SAMPLE_FUNCTIONS = {
    torch.conv1d,
    torch.conv2d,
    torch.conv3d,
    torch.nn.functional.conv1d,
    torch.nn.functional.conv2d,
    torch.nn.functional.conv3d,
    torch.nn.functional.linear,
    torch.relu,
    torch.nn.functional.relu,
}


def _per_sample_op(root: nn.Module, n: fx.Node) -> bool:
    if n.op == "call_module":
        return stock_module(root.get_submodule(str(n.target)), _PER_SAMPLE_MODULES)
    return n.op == "call_function" and n.target in _PER_SAMPLE_FUNCTIONS


def _cloned(value: Any) -> Any:
    leaves, spec = tree_flatten(value)
    return tree_unflatten([v.clone() if isinstance(v, Tensor) else v for v in leaves], spec)


def _close(a: Tensor, b: Any) -> bool:
    if not isinstance(b, Tensor) or a.shape != b.shape:
        return False
    if not a.is_floating_point() and not a.is_complex():
        return torch.equal(a, b.to(a.dtype))
    a, b = a.detach().double(), b.detach().double()
    scale = float(a.abs().nan_to_num(0.0).max()) if a.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-3, atol=1e-3 * scale + 1e-6, equal_nan=True))
